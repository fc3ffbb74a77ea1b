//! Operator certificates: a worker vouched for by someone other than the coordinator.
//!
//! A node's claims are signed by the node itself, and the coordinator decides which claims a
//! client sees, so without more a coordinator that lists a node of its own reads every job
//! sealed to it. A [`Certificate`] is signed by an *operator* key — the person or organisation
//! that runs the machine — over the node's identity, its sealing key, its device tier and what
//! it can run, with a digest of the inventory the node measured. A client that pins operator
//! keys (`tessera client submit --trust KEY`) seals only to workers whose claims carry a
//! certificate from one of them that matches the claims field for field
//! ([`SignedClaims::certified_by`]); the coordinator cannot make one.
//!
//! The operator's key is an ed25519 key like a node's (a `node.key` file in the operator's own
//! directory), so [`Certificate::sign_with`] takes `NodeIdentity::sign` directly.

use ring::signature;
use serde::{Deserialize, Serialize};

use crate::canonical::{hex, unhex, Reader, Writer};
use crate::claims::{KernelPath, NodeKey, SignedClaims};
use crate::error::{ClaimRefusal, FormatError};
use crate::keys::PublicKey;
use crate::tier::DeviceTier;
use crate::UnixMillis;

const CERT_TAG: &str = "tessera-seal operator certificate v1";

/// What an operator vouches for about one worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Certificate {
    /// The operator's ed25519 public key (the signer).
    pub operator: NodeKey,
    pub node: NodeKey,
    /// The key jobs are sealed to: a rotated key needs a new certificate.
    pub seal_key: PublicKey,
    pub tier: DeviceTier,
    pub memory_bytes: u64,
    pub isa: String,
    pub kernel_path: KernelPath,
    /// blake3 of the inventory the node measured (its JSON), the evidence for tier and memory.
    pub inventory: String,
    pub issued_at: UnixMillis,
}

impl Certificate {
    /// The one encoding that is signed.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(CERT_TAG);
        w.fixed(self.operator.as_bytes())
            .fixed(self.node.as_bytes())
            .fixed(self.seal_key.as_bytes())
            .u8(self.tier.code())
            .u64(self.memory_bytes)
            .str(&self.isa)
            .str(&self.kernel_path.0)
            .str(&self.inventory)
            .u64(self.issued_at.0);
        w.finish()
    }

    /// Decodes [`Certificate::canonical_bytes`].
    pub fn from_canonical(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader::new(bytes, CERT_TAG, "certificate")?;
        let c = Self {
            operator: NodeKey::from_bytes(r.fixed()?),
            node: NodeKey::from_bytes(r.fixed()?),
            seal_key: PublicKey::from_bytes(r.fixed()?),
            tier: {
                let code = r.u8()?;
                DeviceTier::from_code(code).ok_or_else(|| FormatError {
                    what: "certificate",
                    reason: format!("unknown device tier code {code}"),
                })?
            },
            memory_bytes: r.u64()?,
            isa: r.str()?,
            kernel_path: KernelPath(r.str()?),
            inventory: r.str()?,
            issued_at: UnixMillis(r.u64()?),
        };
        r.finish()?;
        Ok(c)
    }

    /// The digest an operator certifies for a measured inventory (any bytes: its JSON).
    pub fn inventory_digest(inventory: &[u8]) -> String {
        hex(blake3::hash(inventory).as_bytes())
    }

    /// Signs with a signer holding the operator key (`|m| identity.sign(m)`).
    pub fn sign_with(self, sign: impl FnOnce(&[u8]) -> [u8; 64]) -> SignedCertificate {
        let signature = sign(&self.canonical_bytes());
        SignedCertificate {
            cert: self,
            signature: hex(&signature),
        }
    }
}

/// A certificate with the operator's signature (hex).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedCertificate {
    pub cert: Certificate,
    pub signature: String,
}

impl SignedCertificate {
    /// Checks the signature under the operator key the certificate names.
    pub fn verify(&self) -> Result<(), ClaimRefusal> {
        let sig: [u8; 64] = unhex(&self.signature, "certificate signature")
            .map_err(|_| ClaimRefusal::BadSignature)?;
        signature::UnparsedPublicKey::new(&signature::ED25519, self.cert.operator.as_bytes())
            .verify(&self.cert.canonical_bytes(), &sig)
            .map_err(|_| ClaimRefusal::BadSignature)
    }
}

/// Why a worker's claims are not vouched for by a trusted operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Uncertified {
    #[error("worker {node} (sealing key {seal_key}) carries no operator certificate")]
    Missing { node: NodeKey, seal_key: PublicKey },
    #[error(
        "worker {node} (sealing key {seal_key}) is certified by operator {operator}, whom this \
         client does not trust"
    )]
    UntrustedOperator {
        node: NodeKey,
        seal_key: PublicKey,
        operator: NodeKey,
    },
    #[error("worker {node} (sealing key {seal_key}): the certificate's signature does not verify")]
    BadSignature { node: NodeKey, seal_key: PublicKey },
    #[error("worker {node} (sealing key {seal_key}): its claims' {field} differs from what its operator certified")]
    Mismatch {
        node: NodeKey,
        seal_key: PublicKey,
        field: &'static str,
    },
}

impl SignedClaims {
    /// The operator who vouches for these claims, when one of `trusted` does: the certificate's
    /// signature holds, and it names this node, this sealing key, this tier and these
    /// capabilities. Otherwise why not, naming the uncertified key.
    pub fn certified_by(&self, trusted: &[NodeKey]) -> Result<NodeKey, Uncertified> {
        let c = &self.claims;
        let (node, seal_key) = (c.node, c.seal_key);
        let Some(s) = &self.certificate else {
            return Err(Uncertified::Missing { node, seal_key });
        };
        if !trusted.contains(&s.cert.operator) {
            return Err(Uncertified::UntrustedOperator {
                node,
                seal_key,
                operator: s.cert.operator,
            });
        }
        s.verify()
            .map_err(|_| Uncertified::BadSignature { node, seal_key })?;
        let x = &s.cert;
        let field = if x.node != c.node {
            "node key"
        } else if x.seal_key != c.seal_key {
            "sealing key"
        } else if x.tier != c.tier {
            "device tier"
        } else if x.memory_bytes != c.memory_bytes {
            "memory"
        } else if x.isa != c.isa {
            "instruction set"
        } else if x.kernel_path != c.kernel_path {
            "kernel path"
        } else {
            return Ok(x.operator);
        };
        Err(Uncertified::Mismatch {
            node,
            seal_key,
            field,
        })
    }

    /// The operator named by the certificate, whether or not anyone trusts it (for keeping a
    /// worker's answers from being checked by a machine of the same operator).
    pub fn operator(&self) -> Option<NodeKey> {
        self.certificate
            .as_ref()
            .filter(|s| s.verify().is_ok() && s.cert.node == self.claims.node)
            .map(|s| s.cert.operator)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claims::Claims;
    use crate::keys::SecretKey;

    fn claims(node_seed: &[u8; 32], seal: &SecretKey) -> Claims {
        Claims {
            node: NodeKey::of_seed(node_seed),
            epoch: 1,
            issued_at: UnixMillis(1_000),
            seal_key: seal.public_key(),
            models: vec!["m".into()],
            memory_bytes: 8 << 30,
            max_context: 2048,
            features: vec![],
            isa: "x86_64".into(),
            kernel_path: KernelPath::new("avx2"),
            tier: DeviceTier::Server,
        }
    }

    fn certify(c: &Claims, operator_seed: &[u8; 32]) -> SignedCertificate {
        let pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(operator_seed).unwrap();
        Certificate {
            operator: NodeKey::of_seed(operator_seed),
            node: c.node,
            seal_key: c.seal_key,
            tier: c.tier,
            memory_bytes: c.memory_bytes,
            isa: c.isa.clone(),
            kernel_path: c.kernel_path.clone(),
            inventory: Certificate::inventory_digest(b"{}"),
            issued_at: UnixMillis(5),
        }
        .sign_with(|m| pair.sign(m).as_ref().try_into().unwrap())
    }

    #[test]
    fn claims_certified_by_a_trusted_operator_pass_and_others_are_named() {
        let (node, op, rogue) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        let seal = SecretKey::derive(b"s");
        let trusted = [NodeKey::of_seed(&op)];
        let c = claims(&node, &seal);
        let good = c
            .clone()
            .sign(&node)
            .unwrap()
            .with_certificate(certify(&c, &op));
        assert_eq!(good.certified_by(&trusted), Ok(trusted[0]));
        assert_eq!(good.operator(), Some(trusted[0]));

        // No certificate; another operator's; a certificate for another tier (a worker that
        // claims to be a server its operator called a phone).
        let bare = c.clone().sign(&node).unwrap();
        assert!(matches!(
            bare.certified_by(&trusted),
            Err(Uncertified::Missing { seal_key, .. }) if seal_key == seal.public_key()
        ));
        let other = c
            .clone()
            .sign(&node)
            .unwrap()
            .with_certificate(certify(&c, &rogue));
        assert!(matches!(
            other.certified_by(&trusted),
            Err(Uncertified::UntrustedOperator { .. })
        ));
        let mut phone = c.clone();
        phone.tier = DeviceTier::Phone;
        let lying = c
            .clone()
            .sign(&node)
            .unwrap()
            .with_certificate(certify(&phone, &op));
        assert!(matches!(
            lying.certified_by(&trusted),
            Err(Uncertified::Mismatch {
                field: "device tier",
                ..
            })
        ));
        // A certificate altered after signing.
        let mut forged = certify(&c, &op);
        forged.cert.memory_bytes *= 2;
        let mut c2 = c.clone();
        c2.memory_bytes *= 2;
        let forged = c2.sign(&node).unwrap().with_certificate(forged);
        assert!(matches!(
            forged.certified_by(&trusted),
            Err(Uncertified::BadSignature { .. })
        ));
        assert_eq!(forged.operator(), None);
    }

    #[test]
    fn certificates_round_trip_through_canonical_bytes_and_json() {
        let c = claims(&[1; 32], &SecretKey::derive(b"s"));
        let s = certify(&c, &[2; 32]);
        assert_eq!(
            Certificate::from_canonical(&s.cert.canonical_bytes()).unwrap(),
            s.cert
        );
        let back: SignedCertificate =
            serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        back.verify().unwrap();
    }
}
