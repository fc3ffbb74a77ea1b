//! Capability claims: what a node says it can do (models held, memory, features, ISA and kernel
//! path, device tier, the key to seal jobs to), signed by its node key and stamped with an epoch.
//!
//! The node key *is* the identity (the same ed25519 key that tessera-net's pinned-key QUIC
//! authenticates, so [`Claims::sign_with`] takes `NodeIdentity::sign` directly); self-signed
//! claims say only that a key claims something. Whether anyone vouches for the node is the
//! operator certificate the signed claims may carry ([`crate::cert`]). A [`ClaimBook`] keeps each node's newest claim: a claim from an
//! older epoch is refused, and a higher epoch supersedes the old claim and revokes its sealing
//! key, which is how a node rotates keys or withdraws a model.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use ring::signature::{self, Ed25519KeyPair, KeyPair};
use serde::{Deserialize, Serialize};

use crate::canonical::{hex, unhex, Reader, Writer, MAX_LIST, MAX_STR};
use crate::error::{ClaimRefusal, FormatError};
use crate::keys::{serde_via_string, PublicKey};
use crate::tier::DeviceTier;
use crate::UnixMillis;

const CLAIMS_TAG: &str = "tessera-seal claims v2";

/// A node's ed25519 public key (the bytes of tessera-net's `PublicKey`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeKey([u8; 32]);

impl NodeKey {
    pub fn from_bytes(b: [u8; 32]) -> Self {
        Self(b)
    }
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
    /// The public key of the ed25519 secret `seed` (tessera-net's node key file holds a seed).
    pub fn of_seed(seed: &[u8; 32]) -> Self {
        let pair = Ed25519KeyPair::from_seed_unchecked(seed).expect("any 32-byte seed is a key");
        Self(pair.public_key().as_ref().try_into().expect("32 bytes"))
    }
}

impl fmt::Display for NodeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeKey({})", &hex(&self.0[..4]))
    }
}

impl FromStr for NodeKey {
    type Err = FormatError;
    fn from_str(s: &str) -> Result<Self, FormatError> {
        unhex(s, "node key").map(Self)
    }
}
serde_via_string!(NodeKey);

/// The kernel path a node computes with ("avx512", "avx2", "neon", "scalar"…). Results are
/// compared bit for bit only between nodes whose paths are known to agree.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KernelPath(pub String);

impl KernelPath {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
}

impl fmt::Display for KernelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a node claims, at one epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub node: NodeKey,
    /// Raised by the node whenever its claims or keys change; never reused.
    pub epoch: u64,
    pub issued_at: UnixMillis,
    /// The key jobs are sealed to until a higher epoch names another.
    pub seal_key: PublicKey,
    pub models: Vec<String>,
    pub memory_bytes: u64,
    /// KV positions (prompt plus new tokens) one job may use on the model held: the sealed
    /// desk sends a job only to workers that claim room for it. 0 when nothing is held.
    pub max_context: u64,
    pub features: Vec<String>,
    /// Instruction set the node runs ("x86_64", "aarch64"…).
    pub isa: String,
    pub kernel_path: KernelPath,
    pub tier: DeviceTier,
}

impl Claims {
    /// The one encoding that is signed.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(CLAIMS_TAG);
        w.fixed(self.node.as_bytes())
            .u64(self.epoch)
            .u64(self.issued_at.0)
            .fixed(self.seal_key.as_bytes())
            .strs(&self.models)
            .u64(self.memory_bytes)
            .u64(self.max_context)
            .strs(&self.features)
            .str(&self.isa)
            .str(&self.kernel_path.0)
            .u8(self.tier.code());
        w.finish()
    }

    /// Decodes [`Claims::canonical_bytes`].
    pub fn from_canonical(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader::new(bytes, CLAIMS_TAG, "claims")?;
        let c = Self {
            node: NodeKey(r.fixed()?),
            epoch: r.u64()?,
            issued_at: UnixMillis(r.u64()?),
            seal_key: PublicKey::from_bytes(r.fixed()?),
            models: r.strs()?,
            memory_bytes: r.u64()?,
            max_context: r.u64()?,
            features: r.strs()?,
            isa: r.str()?,
            kernel_path: KernelPath(r.str()?),
            tier: {
                let code = r.u8()?;
                DeviceTier::from_code(code).ok_or_else(|| FormatError {
                    what: "claims",
                    reason: format!("unknown device tier code {code}"),
                })?
            },
        };
        r.finish()?;
        c.validate()?;
        Ok(c)
    }

    /// Checks field sizes (so the canonical encoding reads back).
    pub fn validate(&self) -> Result<(), FormatError> {
        let bad = |reason: String| FormatError {
            what: "claims",
            reason,
        };
        if self.epoch == 0 {
            return Err(bad("epoch 0 (epochs count from 1)".into()));
        }
        for (name, list) in [("models", &self.models), ("features", &self.features)] {
            if list.len() > MAX_LIST {
                return Err(bad(format!("{} {name} (at most {MAX_LIST})", list.len())));
            }
            if let Some(s) = list.iter().find(|s| s.len() > MAX_STR) {
                return Err(bad(format!("{name} entry of {} bytes", s.len())));
            }
        }
        for (name, s) in [("isa", &self.isa), ("kernel path", &self.kernel_path.0)] {
            if s.len() > MAX_STR {
                return Err(bad(format!("{name} of {} bytes", s.len())));
            }
        }
        Ok(())
    }

    /// Signs with a signer holding the node key (`|m| identity.sign(m)` for tessera-net's
    /// `NodeIdentity`). The book checks that the signature is by `self.node`.
    pub fn sign_with(
        self,
        sign: impl FnOnce(&[u8]) -> [u8; 64],
    ) -> Result<SignedClaims, ClaimRefusal> {
        self.validate()?;
        let signature = sign(&self.canonical_bytes());
        Ok(SignedClaims {
            claims: self,
            signature: hex(&signature),
            certificate: None,
        })
    }

    /// Signs with the node key's ed25519 seed.
    pub fn sign(self, seed: &[u8; 32]) -> Result<SignedClaims, ClaimRefusal> {
        let pair = Ed25519KeyPair::from_seed_unchecked(seed).expect("any 32-byte seed is a key");
        self.sign_with(|m| {
            pair.sign(m)
                .as_ref()
                .try_into()
                .expect("ed25519 signatures are 64 bytes")
        })
    }
}

/// Claims with the node's signature (hex, so the JSON form is readable), and the certificate of
/// the operator who vouches for the node, when one does ([`crate::cert`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedClaims {
    pub claims: Claims,
    pub signature: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<crate::cert::SignedCertificate>,
}

impl SignedClaims {
    /// These claims with an operator's certificate attached (it is checked by whoever relies
    /// on it: [`SignedClaims::certified_by`]).
    pub fn with_certificate(mut self, c: crate::cert::SignedCertificate) -> Self {
        self.certificate = Some(c);
        self
    }

    /// Checks the signature under the node key the claims name, and the fields.
    pub fn verify(&self) -> Result<(), ClaimRefusal> {
        self.claims.validate()?;
        let sig: [u8; 64] =
            unhex(&self.signature, "claim signature").map_err(|_| ClaimRefusal::BadSignature)?;
        signature::UnparsedPublicKey::new(&signature::ED25519, self.claims.node.as_bytes())
            .verify(&self.claims.canonical_bytes(), &sig)
            .map_err(|_| ClaimRefusal::BadSignature)
    }
}

/// What accepting a claim changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimChange {
    /// The node's first claim.
    New,
    /// The same claim again (a node re-announcing after a reconnect).
    Unchanged,
    /// A higher epoch replaced `old_epoch`; `revoked_seal_key` is set when the sealing key changed:
    /// envelopes sealed to it must no longer be routed to this node.
    Superseded {
        old_epoch: u64,
        revoked_seal_key: Option<PublicKey>,
    },
}

/// Each node's newest verified claim.
#[derive(Debug, Clone, Default)]
pub struct ClaimBook {
    current: BTreeMap<NodeKey, SignedClaims>,
}

impl ClaimBook {
    pub fn new() -> Self {
        Self::default()
    }

    /// Verifies and records a claim, or says why not.
    pub fn offer(&mut self, s: SignedClaims) -> Result<ClaimChange, ClaimRefusal> {
        s.verify()?;
        let node = s.claims.node;
        let change = match self.current.get(&node) {
            None => ClaimChange::New,
            Some(old) if s.claims.epoch < old.claims.epoch => {
                return Err(ClaimRefusal::StaleEpoch {
                    offered: s.claims.epoch,
                    current: old.claims.epoch,
                })
            }
            Some(old) if s.claims.epoch == old.claims.epoch => {
                if old.claims == s.claims {
                    return Ok(ClaimChange::Unchanged);
                }
                return Err(ClaimRefusal::EpochReused {
                    epoch: s.claims.epoch,
                });
            }
            Some(old) => ClaimChange::Superseded {
                old_epoch: old.claims.epoch,
                revoked_seal_key: (old.claims.seal_key != s.claims.seal_key)
                    .then_some(old.claims.seal_key),
            },
        };
        self.current.insert(node, s);
        Ok(change)
    }

    /// Every node's current signed claims, in key order.
    pub fn signed(&self) -> impl Iterator<Item = &SignedClaims> + '_ {
        self.current.values()
    }

    /// The node's current claims.
    pub fn get(&self, node: &NodeKey) -> Option<&Claims> {
        self.current.get(node).map(|s| &s.claims)
    }

    /// Whether `key` is the node's current sealing key (a revoked one is not).
    pub fn seal_key_is_current(&self, node: &NodeKey, key: &PublicKey) -> bool {
        self.get(node).is_some_and(|c| c.seal_key == *key)
    }

    /// Nodes whose current claims hold `model`, in key order.
    pub fn holders_of<'a>(&'a self, model: &'a str) -> impl Iterator<Item = &'a Claims> + 'a {
        self.current
            .values()
            .map(|s| &s.claims)
            .filter(move |c| c.models.iter().any(|m| m == model))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::SecretKey;

    fn claims(seed: &[u8; 32], epoch: u64, seal: &SecretKey) -> Claims {
        Claims {
            node: NodeKey::of_seed(seed),
            epoch,
            issued_at: UnixMillis(1_000 * epoch),
            seal_key: seal.public_key(),
            models: vec!["qwen3-0.6b".into()],
            memory_bytes: 16 << 30,
            max_context: 4096,
            features: vec!["kv-q8".into()],
            isa: "x86_64".into(),
            kernel_path: KernelPath::new("avx2"),
            tier: DeviceTier::Laptop,
        }
    }

    #[test]
    fn a_higher_epoch_supersedes_and_revokes_the_old_sealing_key() {
        let seed = [3u8; 32];
        let (k1, k2) = (SecretKey::derive(b"k1"), SecretKey::derive(b"k2"));
        let mut book = ClaimBook::new();
        let first = claims(&seed, 1, &k1).sign(&seed).unwrap();
        assert_eq!(book.offer(first.clone()), Ok(ClaimChange::New));
        assert_eq!(book.offer(first.clone()), Ok(ClaimChange::Unchanged));
        let second = claims(&seed, 2, &k2).sign(&seed).unwrap();
        assert_eq!(
            book.offer(second),
            Ok(ClaimChange::Superseded {
                old_epoch: 1,
                revoked_seal_key: Some(k1.public_key())
            })
        );
        let node = NodeKey::of_seed(&seed);
        assert!(!book.seal_key_is_current(&node, &k1.public_key()));
        assert!(book.seal_key_is_current(&node, &k2.public_key()));
        // The old claim, replayed, is refused.
        assert_eq!(
            book.offer(first),
            Err(ClaimRefusal::StaleEpoch {
                offered: 1,
                current: 2
            })
        );
    }

    #[test]
    fn a_claim_not_signed_by_its_node_or_altered_after_signing_is_refused() {
        let (seed, thief) = ([3u8; 32], [4u8; 32]);
        let k = SecretKey::derive(b"k");
        let mut book = ClaimBook::new();
        // Signed by another key while naming this node.
        let forged = claims(&seed, 5, &k).sign(&thief).unwrap();
        assert_eq!(book.offer(forged), Err(ClaimRefusal::BadSignature));
        // Signed correctly, then a model added.
        let mut s = claims(&seed, 1, &k).sign(&seed).unwrap();
        s.claims.models.push("llama-70b".into());
        assert_eq!(book.offer(s), Err(ClaimRefusal::BadSignature));
        assert!(book.get(&NodeKey::of_seed(&seed)).is_none());
    }

    #[test]
    fn changing_claims_without_raising_the_epoch_is_refused() {
        let seed = [3u8; 32];
        let k = SecretKey::derive(b"k");
        let mut book = ClaimBook::new();
        book.offer(claims(&seed, 1, &k).sign(&seed).unwrap())
            .unwrap();
        let mut more = claims(&seed, 1, &k);
        more.memory_bytes *= 2;
        assert_eq!(
            book.offer(more.sign(&seed).unwrap()),
            Err(ClaimRefusal::EpochReused { epoch: 1 })
        );
    }

    #[test]
    fn claims_round_trip_through_canonical_bytes_and_json() {
        let seed = [9u8; 32];
        let c = claims(&seed, 3, &SecretKey::derive(b"k"));
        assert_eq!(Claims::from_canonical(&c.canonical_bytes()).unwrap(), c);
        let s = c.sign(&seed).unwrap();
        let back: SignedClaims = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        back.verify().unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn the_claim_book_lists_holders_of_a_model() {
        let k = SecretKey::derive(b"k");
        let mut book = ClaimBook::new();
        for seed in [[1u8; 32], [2u8; 32]] {
            book.offer(claims(&seed, 1, &k).sign(&seed).unwrap())
                .unwrap();
        }
        let mut other = claims(&[5u8; 32], 1, &k);
        other.models = vec!["llama".into()];
        book.offer(other.sign(&[5u8; 32]).unwrap()).unwrap();
        assert_eq!(book.holders_of("qwen3-0.6b").count(), 2);
        assert_eq!(book.holders_of("llama").count(), 1);
    }
}
