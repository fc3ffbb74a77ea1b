//! Routing whole requests through a coordinator that cannot read them: the pure parts.
//!
//! A client seals its request to one worker ([`seal_job`]): HPKE (RFC 9180: DHKEM(X25519,
//! HKDF-SHA256), HKDF-SHA256, ChaCha20-Poly1305) with the routing header — job id, attempt,
//! recipient key id, model, context size, expiry, the client's reply key — in clear and bound as
//! the AEAD's associated data. The coordinator routes on the header; it leases the job to a
//! holder ([`JobLeases`]) and re-dispatches when the lease runs out; the worker opens the envelope
//! ([`JobEnvelope::open`]), refuses a replay or an expired one ([`ReplayGuard`]), runs it and seals
//! the result back to the reply key ([`seal_result`]); the coordinator forwards exactly one result;
//! a share of answers is re-run elsewhere and compared ([`Verifier`]). Workers announce what they
//! can do in signed, epoch-stamped claims ([`ClaimBook`]), which an operator's certificate may
//! vouch for ([`cert`]: a client that pins operator keys seals to nothing else); their device
//! tier ([`DeviceTier`]) sets lease lengths, verification rates, the longest job a phone takes
//! and which workers long jobs and checks go to first.
//!
//! Every machine here takes events and the time as values and returns actions: no clock, no I/O
//! (the edges read the clock with [`UnixMillis::now`] and pass it in).
//!
//! ```
//! use tessera_seal::*;
//!
//! // The worker publishes its sealing key (inside its signed claims); the client makes a reply key.
//! let worker = SecretKey::generate();
//! let client = SecretKey::generate();
//! let now = UnixMillis(1_000_000);
//! let header = JobHeader {
//!     job: JobId::random(),
//!     attempt: 1,
//!     recipient: worker.key_id(),
//!     model: "qwen3-0.6b".into(),
//!     context_tokens: 1024,
//!     expires_at: now.plus(60_000),
//!     reply_to: client.public_key(),
//! };
//! let envelope = seal_job(&header, br#"{"prompt":"secret"}"#, &worker.public_key())?;
//!
//! // The coordinator sees the header only. Rewriting it breaks the job at the worker:
//! let mut tampered = envelope.clone();
//! tampered.header.expires_at = now.plus(3_600_000);
//! assert_eq!(tampered.open(&worker), Err(SealError::Authentication { what: "job" }));
//!
//! // The worker opens it once; the same envelope again is a replay.
//! let mut guard = ReplayGuard::new(300_000, 10_000);
//! let body = envelope.open(&worker)?;
//! guard.admit(&envelope.header, now).expect("first time");
//! assert!(matches!(guard.admit(&envelope.header, now), Err(ReplayRefusal::Replayed { .. })));
//!
//! // The answer goes back sealed to the client, and only the worker could have written it. Its
//! // digest (keyed by the request, so it reveals nothing) is what verification compares.
//! let digest = AnswerDigest::of_tokens(&body, &[791, 4, 1033]);
//! let result = seal_result(&envelope.header, &worker, digest, b"the answer")?;
//! let (attempt, text) = result.open(&client, &worker.public_key(), header.job)?;
//! assert_eq!((attempt, &text[..]), (1, &b"the answer"[..]));
//! # assert_eq!(body, br#"{"prompt":"secret"}"#);
//! # Ok::<(), SealError>(())
//! ```
#![forbid(unsafe_code)]

mod canonical;
pub mod cert;
pub mod claims;
pub mod envelope;
mod error;
pub mod keys;
pub mod lease;
pub mod replay;
pub mod tier;
pub mod verify;

use serde::{Deserialize, Serialize};

pub use cert::{Certificate, SignedCertificate, Uncertified};
pub use claims::{ClaimBook, ClaimChange, Claims, KernelPath, NodeKey, SignedClaims};
pub use envelope::{
    seal_attempts, seal_job, seal_result, JobEnvelope, JobHeader, JobId, ResultEnvelope,
    ResultHeader,
};
pub use error::{ClaimRefusal, FormatError, ReplayRefusal, SealError};
pub use keys::{KeyId, PublicKey, SecretKey};
pub use lease::{DropReason, Holder, JobFailure, JobLeases, LeaseAction, LeaseConfig, LeaseEvent};
pub use replay::ReplayGuard;
pub use tier::{DeviceTier, TierPolicy, LONG_JOB_POSITIONS};
pub use verify::{
    AnswerDigest, Inconclusive, Reputation, Verifier, VerifyAction, VerifyConfig, VerifyEvent,
    VerifyStats, Worker,
};

/// A point in time as milliseconds since the Unix epoch. Passed in by callers; no machine in this
/// crate reads a clock.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct UnixMillis(pub u64);

impl UnixMillis {
    /// The wall clock now: for the edges that feed the machines (which never call it).
    pub fn now() -> Self {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        Self(u64::try_from(ms).unwrap_or(u64::MAX))
    }

    /// `self` plus `ms`, saturating.
    pub fn plus(self, ms: u64) -> Self {
        Self(self.0.saturating_add(ms))
    }
}

impl std::fmt::Display for UnixMillis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ms", self.0)
    }
}
