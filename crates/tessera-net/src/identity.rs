//! Node identity: an ed25519 key pair, its public key and the [`NodeId`] derived from it.

use std::fmt;
use std::fs;
use std::io::Write;
use std::path::Path;
use std::str::FromStr;

use ring::rand::SecureRandom;
use ring::signature::{self, Ed25519KeyPair, KeyPair};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::base32;
use crate::error::NetError;

/// File name of the node key inside a data directory.
pub const KEY_FILE_NAME: &str = "node.key";
/// Key file format: this magic followed by the 32-byte ed25519 seed.
const KEY_FILE_MAGIC: &[u8; 8] = b"TSRKEY1\n";
/// Fixed DER prefix of an ed25519 SubjectPublicKeyInfo (RFC 8410); the 32 key bytes follow.
const ED25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];
/// Fixed DER prefix of a PKCS#8 v1 ed25519 private key (RFC 8410); the 32 seed bytes follow.
const ED25519_PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];
const NODE_ID_CONTEXT: &str = "tessera-net 2026 node id v1";

/// An ed25519 public key: the long-term identity of a node.
///
/// Printable as 52 base32 characters; serialized as that string.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey([u8; 32]);

impl PublicKey {
    /// Wraps raw key bytes. Any 32 bytes are accepted here; a key that is not a valid curve point
    /// simply never verifies a signature.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw 32 key bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The node id of this key.
    pub fn node_id(&self) -> NodeId {
        let h = blake3::derive_key(NODE_ID_CONTEXT, &self.0);
        let mut id = [0u8; NodeId::LEN];
        id.copy_from_slice(&h[..NodeId::LEN]);
        NodeId(id)
    }

    /// Verifies an ed25519 signature by this key.
    pub fn verify(&self, message: &[u8], signature: &[u8]) -> bool {
        signature::UnparsedPublicKey::new(&signature::ED25519, &self.0)
            .verify(message, signature)
            .is_ok()
    }

    /// DER SubjectPublicKeyInfo of this key, as found in an X.509 certificate.
    pub fn to_spki_der(&self) -> Vec<u8> {
        let mut v = ED25519_SPKI_PREFIX.to_vec();
        v.extend_from_slice(&self.0);
        v
    }

    /// Parses an ed25519 SubjectPublicKeyInfo; any other algorithm is refused.
    pub fn from_spki_der(spki: &[u8]) -> Option<Self> {
        let key = spki.strip_prefix(&ED25519_SPKI_PREFIX[..])?;
        Some(Self(key.try_into().ok()?))
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&base32::encode(&self.0))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

impl FromStr for PublicKey {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Self, NetError> {
        base32::decode(s)
            .map(Self)
            .map_err(|reason| NetError::Parse {
                what: "public key",
                reason,
            })
    }
}

/// A node's id: the first 20 bytes of a domain-separated blake3 hash of its public key.
///
/// Printable as 32 lowercase base32 characters; [`NodeId::short`] gives 8 for logs.
/// Two keys never share an id in practice (160-bit second-preimage resistance), so an id names a
/// key; still, policy decisions compare full keys, not ids.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId([u8; 20]);

impl NodeId {
    /// Length of an id in bytes.
    pub const LEN: usize = 20;

    /// The raw id bytes.
    pub fn as_bytes(&self) -> &[u8; Self::LEN] {
        &self.0
    }

    /// The first 8 characters of the printable id, for log lines.
    pub fn short(&self) -> String {
        let mut s = self.to_string();
        s.truncate(8);
        s
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&base32::encode(&self.0))
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeId({self})")
    }
}

impl FromStr for NodeId {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Self, NetError> {
        base32::decode(s)
            .map(Self)
            .map_err(|reason| NetError::Parse {
                what: "node id",
                reason,
            })
    }
}

macro_rules! serde_via_string {
    ($t:ty) => {
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
serde_via_string!(PublicKey);
serde_via_string!(NodeId);

/// A node's long-term ed25519 key pair.
///
/// The secret never leaves this type except through [`NodeIdentity::load_or_create`]'s key file.
pub struct NodeIdentity {
    seed: [u8; 32],
    pair: Ed25519KeyPair,
    public: PublicKey,
}

impl NodeIdentity {
    /// A fresh identity held in memory only (tests, ephemeral clients).
    pub fn generate() -> Result<Self, NetError> {
        let mut seed = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut seed)
            .map_err(|_| NetError::TlsSetup("system random number generator failed".into()))?;
        Ok(Self::from_seed(seed))
    }

    /// The identity for a 32-byte ed25519 seed (secret key).
    pub fn from_seed(seed: [u8; 32]) -> Self {
        let pair = Ed25519KeyPair::from_seed_unchecked(&seed)
            .expect("any 32-byte seed is a valid ed25519 secret key");
        let public = PublicKey(
            pair.public_key()
                .as_ref()
                .try_into()
                .expect("ed25519 public keys are 32 bytes"),
        );
        Self { seed, pair, public }
    }

    /// Loads `dir/node.key`, or creates it (and `dir`) with a fresh key on first use.
    ///
    /// On unix the file is created with mode 0600 and the directory with 0700; an existing key
    /// file readable by group or others is refused ([`NetError::InsecureKeyFile`]) rather than
    /// trusted.
    pub fn load_or_create(dir: impl AsRef<Path>) -> Result<Self, NetError> {
        let dir = dir.as_ref();
        let path = dir.join(KEY_FILE_NAME);
        match fs::read(&path) {
            Ok(bytes) => {
                check_permissions(&path)?;
                Self::parse_key_file(&path, &bytes)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                create_private_dir(dir)?;
                let id = Self::generate()?;
                match publish_private_file(&path, &id.key_file_bytes()) {
                    Ok(()) => Ok(id),
                    // Another process created it first: use theirs.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        Self::load_or_create(dir)
                    }
                    Err(e) => Err(NetError::io(format!("writing {}", path.display()), e)),
                }
            }
            Err(e) => Err(NetError::io(format!("reading {}", path.display()), e)),
        }
    }

    fn parse_key_file(path: &Path, bytes: &[u8]) -> Result<Self, NetError> {
        let bad = |reason: &str| NetError::BadKeyFile {
            path: path.display().to_string(),
            reason: reason.into(),
        };
        let seed = bytes
            .strip_prefix(&KEY_FILE_MAGIC[..])
            .ok_or_else(|| bad("not a tessera node key (bad magic)"))?;
        let seed: [u8; 32] = seed
            .try_into()
            .map_err(|_| bad("wrong length: expected 8-byte magic and a 32-byte seed"))?;
        Ok(Self::from_seed(seed))
    }

    fn key_file_bytes(&self) -> Vec<u8> {
        let mut v = KEY_FILE_MAGIC.to_vec();
        v.extend_from_slice(&self.seed);
        v
    }

    /// The public key.
    pub fn public_key(&self) -> PublicKey {
        self.public
    }

    /// The node id.
    pub fn node_id(&self) -> NodeId {
        self.public.node_id()
    }

    /// Signs `message` with the node key (64-byte ed25519 signature).
    pub fn sign(&self, message: &[u8]) -> [u8; 64] {
        self.pair
            .sign(message)
            .as_ref()
            .try_into()
            .expect("ed25519 signatures are 64 bytes")
    }

    /// PKCS#8 v1 DER of the secret key, for rcgen and rustls.
    pub(crate) fn pkcs8_der(&self) -> Vec<u8> {
        let mut v = ED25519_PKCS8_PREFIX.to_vec();
        v.extend_from_slice(&self.seed);
        v
    }
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        Self::from_seed(self.seed)
    }
}

impl fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("node_id", &self.node_id())
            .finish_non_exhaustive()
    }
}

impl Drop for NodeIdentity {
    fn drop(&mut self) {
        // Best effort; ring keeps its own copy of the expanded key.
        self.seed = [0; 32];
        std::hint::black_box(&self.seed);
    }
}

#[cfg(unix)]
fn check_permissions(path: &Path) -> Result<(), NetError> {
    use std::os::unix::fs::PermissionsExt;
    let meta =
        fs::metadata(path).map_err(|e| NetError::io(format!("stat {}", path.display()), e))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(NetError::InsecureKeyFile {
            path: path.display().to_string(),
            mode,
        });
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_permissions(_path: &Path) -> Result<(), NetError> {
    Ok(())
}

fn create_private_dir(dir: &Path) -> Result<(), NetError> {
    let mut b = fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir)
        .map_err(|e| NetError::io(format!("creating {}", dir.display()), e))
}

/// Writes `bytes` to a private temporary file, then links it into place; the key file thus
/// appears complete or not at all, and an existing one is never replaced.
fn publish_private_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let result = opts.open(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::hard_link(&tmp, path)
    });
    let _ = fs::remove_file(&tmp);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_verify_and_printable_forms() {
        let id = NodeIdentity::generate().unwrap();
        let sig = id.sign(b"hello");
        assert!(id.public_key().verify(b"hello", &sig));
        assert!(!id.public_key().verify(b"hellO", &sig));

        let pk = id.public_key();
        assert_eq!(pk.to_string().parse::<PublicKey>().unwrap(), pk);
        let nid = id.node_id();
        assert_eq!(nid.to_string().len(), 32);
        assert_eq!(nid.to_string().parse::<NodeId>().unwrap(), nid);
        let json = serde_json::to_string(&nid).unwrap();
        assert_eq!(serde_json::from_str::<NodeId>(&json).unwrap(), nid);
        let json = serde_json::to_string(&pk).unwrap();
        assert_eq!(serde_json::from_str::<PublicKey>(&json).unwrap(), pk);
        assert!("not-an-id".parse::<NodeId>().is_err());

        assert_eq!(PublicKey::from_spki_der(&pk.to_spki_der()), Some(pk));
    }

    #[test]
    fn load_or_create_persists_with_private_mode() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("data");
        let a = NodeIdentity::load_or_create(&sub).unwrap();
        let b = NodeIdentity::load_or_create(&sub).unwrap();
        assert_eq!(a.public_key(), b.public_key());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let path = sub.join(KEY_FILE_NAME);
            let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
            fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
            assert!(matches!(
                NodeIdentity::load_or_create(&sub),
                Err(NetError::InsecureKeyFile { .. })
            ));
            fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
            fs::write(&path, b"garbage").unwrap();
            assert!(matches!(
                NodeIdentity::load_or_create(&sub),
                Err(NetError::BadKeyFile { .. })
            ));
        }
    }
}
