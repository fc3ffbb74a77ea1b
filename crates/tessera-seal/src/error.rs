//! Typed errors: what failed and with which values, so callers (and tests) act on the kind, not on
//! wording. Authentication failures are one variant on purpose: a rewritten header, a wrong key and
//! a flipped ciphertext bit are indistinguishable to the opener, and saying more would help an
//! attacker probe.

use crate::envelope::JobId;
use crate::UnixMillis;

/// Bytes that do not decode: a header, envelope, key or claim that is truncated, oversized or
/// carries an unknown tag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {what}: {reason}")]
pub struct FormatError {
    pub what: &'static str,
    pub reason: String,
}

/// Why sealing or opening an envelope failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// The AEAD refused the envelope: its header was rewritten (recipient, expiry, attempt,
    /// model, size, reply key…), its ciphertext altered, or it was sealed to another key.
    #[error("authentication failed: the {what} envelope was altered or is not sealed to this key")]
    Authentication { what: &'static str },
    /// The envelope or a key does not decode.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// Sealing: the header names a recipient key id other than the key it is being sealed to.
    #[error("the header names recipient {header} but the envelope is sealed to key {key}")]
    RecipientMismatch { header: String, key: String },
    /// Opening a result: it answers another job (or attempt) than the one the client asked for.
    #[error("the result answers job {got} but job {expected} was expected")]
    WrongJob { expected: JobId, got: JobId },
    /// A body larger than [`crate::envelope::MAX_BODY`].
    #[error("body of {len} bytes exceeds the {max}-byte cap")]
    BodyTooLarge { len: usize, max: usize },
    /// The HPKE library refused to seal (a broken random source or an invalid key).
    #[error("sealing failed: {0}")]
    Seal(String),
}

/// Why a worker refuses an authenticated envelope before running it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayRefusal {
    /// The envelope's expiry has passed.
    #[error("job {job} attempt {attempt} expired at {expires_at} (now {now})")]
    Expired {
        job: JobId,
        attempt: u32,
        expires_at: UnixMillis,
        now: UnixMillis,
    },
    /// This job id and attempt was opened before: a replay, not a retry (a retry has a new attempt).
    #[error("job {job} attempt {attempt} was already opened: replay refused")]
    Replayed { job: JobId, attempt: u32 },
    /// The expiry is further ahead than the guard remembers envelopes for; accepting it would let
    /// it be replayed once the guard forgot it.
    #[error("job {job} expires {ttl_ms} ms ahead, beyond the {max_ttl_ms} ms this worker accepts")]
    TtlTooLong {
        job: JobId,
        ttl_ms: u64,
        max_ttl_ms: u64,
    },
    /// The guard holds its maximum of unexpired entries; forgetting one early would allow its
    /// replay, so new envelopes wait until entries expire.
    #[error("replay guard full ({capacity} unexpired jobs)")]
    Full { capacity: usize },
}

/// Why a claim book refuses a signed claim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimRefusal {
    /// The signature does not verify under the node key the claim names.
    #[error("the claim's signature does not verify under its node key")]
    BadSignature,
    /// The node already has a claim at a higher epoch: this one is revoked.
    #[error("claim at epoch {offered} refused: the node's current epoch is {current}")]
    StaleEpoch { offered: u64, current: u64 },
    /// A different claim at the epoch already held: a node changes its claims by raising its epoch.
    #[error("a different claim at the current epoch {epoch}: raise the epoch to change claims")]
    EpochReused { epoch: u64 },
    /// The claim's fields are out of range.
    #[error(transparent)]
    Format(#[from] FormatError),
}
