//! Sealing keys: X25519 key pairs (RFC 9180's DHKEM(X25519, HKDF-SHA256)), their printable forms
//! and the [`KeyId`] that names a key in a routing header.
//!
//! A worker publishes its sealing public key inside its signed capability claims
//! ([`crate::claims`]), so raising the claim epoch rotates the key; a client makes a fresh key pair
//! per request (its reply key) or keeps one.

use std::fmt;
use std::str::FromStr;

use hpke::{Deserializable, Serializable};

use crate::canonical::{hex, unhex};
use crate::error::FormatError;

pub(crate) type Kem = hpke::kem::X25519HkdfSha256;
type HpkePrivate = <Kem as hpke::Kem>::PrivateKey;
pub(crate) type HpkePublic = <Kem as hpke::Kem>::PublicKey;

const KEY_ID_CONTEXT: &str = "tessera-seal 2026 key id v1";
/// First line of a secret key file; the key's 64 hex digits follow on the second.
const SECRET_FILE_TAG: &str = "tessera-seal x25519 secret key v1";

/// An X25519 public key a sender seals to.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey([u8; 32]);

impl PublicKey {
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
    /// The id routing headers name this key by.
    pub fn key_id(&self) -> KeyId {
        let h = blake3::derive_key(KEY_ID_CONTEXT, &self.0);
        let mut id = [0u8; KeyId::LEN];
        id.copy_from_slice(&h[..KeyId::LEN]);
        KeyId(id)
    }
    pub(crate) fn to_hpke(self) -> Result<HpkePublic, FormatError> {
        HpkePublic::from_bytes(&self.0).map_err(|e| FormatError {
            what: "public key",
            reason: e.to_string(),
        })
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

impl FromStr for PublicKey {
    type Err = FormatError;
    fn from_str(s: &str) -> Result<Self, FormatError> {
        unhex(s, "public key").map(Self)
    }
}

/// A key's id: the first 16 bytes of a domain-separated blake3 hash of the public key. Headers
/// carry the id rather than the key: shorter, and a worker matches it against its own.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId([u8; 16]);

impl KeyId {
    pub const LEN: usize = 16;
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

impl FromStr for KeyId {
    type Err = FormatError;
    fn from_str(s: &str) -> Result<Self, FormatError> {
        unhex(s, "key id").map(Self)
    }
}

macro_rules! serde_via_string {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
pub(crate) use serde_via_string;
serde_via_string!(PublicKey);
serde_via_string!(KeyId);

/// An X25519 secret key. It leaves this type only through [`SecretKey::to_file_text`]; the
/// underlying key is zeroed when dropped (x25519-dalek).
#[derive(Clone)]
pub struct SecretKey {
    key: HpkePrivate,
    public: PublicKey,
}

impl SecretKey {
    /// A fresh key from the operating system's random source.
    pub fn generate() -> Self {
        let (key, public) =
            <Kem as hpke::Kem>::gen_keypair(&mut rand_core::UnwrapErr(rand_core::OsRng));
        Self::from_parts(key, &public)
    }

    /// The key derived from input keying material (RFC 9180 DeriveKeyPair): tests and fixtures
    /// that need the same key every run.
    pub fn derive(ikm: &[u8]) -> Self {
        let (key, public) = <Kem as hpke::Kem>::derive_keypair(ikm);
        Self::from_parts(key, &public)
    }

    fn from_parts(key: HpkePrivate, public: &HpkePublic) -> Self {
        let public = PublicKey(public.to_bytes().into());
        Self { key, public }
    }

    pub fn public_key(&self) -> PublicKey {
        self.public
    }

    pub fn key_id(&self) -> KeyId {
        self.public.key_id()
    }

    pub(crate) fn hpke(&self) -> &HpkePrivate {
        &self.key
    }

    /// The key file's text: a tag line, then the secret's hex. Write it with owner-only
    /// permissions.
    pub fn to_file_text(&self) -> String {
        format!("{SECRET_FILE_TAG}\n{}\n", hex(&self.key.to_bytes()))
    }

    /// Reads [`SecretKey::to_file_text`]'s format.
    pub fn from_file_text(text: &str) -> Result<Self, FormatError> {
        let mut lines = text.lines();
        if lines.next().map(str::trim) != Some(SECRET_FILE_TAG) {
            return Err(FormatError {
                what: "secret key file",
                reason: format!("first line is not {SECRET_FILE_TAG:?}"),
            });
        }
        let bytes: [u8; 32] = unhex(lines.next().unwrap_or(""), "secret key file")?;
        let key = HpkePrivate::from_bytes(&bytes).map_err(|e| FormatError {
            what: "secret key file",
            reason: e.to_string(),
        })?;
        let public = <Kem as hpke::Kem>::sk_to_pk(&key);
        Ok(Self::from_parts(key, &public))
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretKey(public {})", self.public)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_key_file_round_trips_and_names_the_same_public_key() {
        let k = SecretKey::generate();
        let back = SecretKey::from_file_text(&k.to_file_text()).unwrap();
        assert_eq!(back.public_key(), k.public_key());
        assert_eq!(back.key_id(), k.public_key().key_id());
        let printed = k.public_key().to_string();
        assert_eq!(printed.parse::<PublicKey>().unwrap(), k.public_key());
        assert!(!format!("{k:?}").contains(&hex(&k.hpke().to_bytes())));
    }

    #[test]
    fn a_key_file_with_another_tag_is_refused() {
        let text = SecretKey::derive(b"x").to_file_text().replace("v1", "v0");
        let err = SecretKey::from_file_text(&text).unwrap_err();
        assert!(err.reason.contains("first line"), "{err}");
    }

    #[test]
    fn derived_keys_are_stable_and_distinct() {
        assert_eq!(
            SecretKey::derive(b"a").public_key(),
            SecretKey::derive(b"a").public_key()
        );
        assert_ne!(
            SecretKey::derive(b"a").key_id(),
            SecretKey::derive(b"b").key_id()
        );
    }
}
