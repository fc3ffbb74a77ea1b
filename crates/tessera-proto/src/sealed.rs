//! Sealed jobs: what travels inside the envelopes ([`SealedRequest`], [`SealedAnswer`]) and the
//! control messages that carry them. The coordinator routes envelopes on their authenticated
//! headers and never sees these bodies: the client seals a [`SealedRequest`] to each candidate
//! worker (`tessera_seal::seal_job`), the worker runs it on the single-node stage it holds and
//! seals a [`SealedAnswer`] back to the client's reply key.

use serde::{Deserialize, Serialize};
use tessera_sampling::SamplingParams;
use tessera_seal::{JobEnvelope, NodeKey, ResultEnvelope, SignedClaims};

use super::FinishReason;

/// A request as the worker reads it. The client tokenizes (it holds the model's tokenizer), so
/// the worker needs nothing but the weights it already holds, and no text crosses the wire.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SealedRequest {
    pub prompt_tokens: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// End-of-generation token ids (not emitted); empty: generate `max_new_tokens`.
    pub eog: Vec<u32>,
}

/// A worker's answer, sealed to the client's reply key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SealedAnswer {
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
}

/// Why a worker did not run a job it was sent (in clear: the coordinator moves the job on).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SealedRefusal {
    /// The envelope did not open with the worker's key: not sealed to it, or its header or
    /// ciphertext was changed on the way.
    Authentication,
    /// The same job and attempt was opened before.
    Replayed,
    /// Its expiry has passed, or lies further ahead than the worker accepts.
    Expired,
    /// The worker holds no whole copy of the job's model now, or cannot run the request.
    CannotRun(String),
}

impl std::fmt::Display for SealedRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Authentication => f.write_str(
                "authentication failed: the envelope was not sealed to this worker, or was altered",
            ),
            Self::Replayed => f.write_str("replayed: this job attempt was opened before"),
            Self::Expired => {
                f.write_str("expired, or its expiry is further ahead than this worker accepts")
            }
            Self::CannotRun(why) => write!(f, "cannot run it: {why}"),
        }
    }
}

/// Coordinator → client news of a sealed job (everything but the result is routing metadata).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum SealedNews {
    /// Attempt `attempt` went to `to` (the node whose key it is sealed to).
    Dispatched { attempt: u32, to: NodeKey },
    /// The holder reported progress (tokens generated so far).
    Progress { attempt: u32, tokens: usize },
    /// A worker refused the envelope of `attempt`.
    Refused {
        attempt: u32,
        from: NodeKey,
        reason: SealedRefusal,
    },
    /// The holder of `attempt` went silent or left: the next envelope goes out.
    Expired { attempt: u32, holder: NodeKey },
    /// The answer was re-run on another worker to be checked.
    Verifying { attempt: u32, on: NodeKey },
    /// A candidate was left out before any dispatch (its key is no longer current, it does
    /// not hold the model, the job does not fit its memory or tier), and why.
    Skipped { attempt: u32, reason: String },
    /// The job's one answer. `verified`: a second worker's tokens agreed with it, and then
    /// `witness` is that worker's result, sealed to the client too, so the client can compare
    /// the two itself rather than take the coordinator's word.
    Result {
        result: ResultEnvelope,
        verified: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        witness: Option<ResultEnvelope>,
    },
    /// The job cannot complete.
    Failed { reason: String },
}

/// The client's messages about sealed jobs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SealedSubmit {
    /// One envelope per attempt, all of one job: attempt `k` is sealed to the `k`th candidate
    /// worker, so the coordinator can move the job on (or have it checked) without reading it
    /// or re-addressing an envelope.
    pub envelopes: Vec<JobEnvelope>,
    /// The client takes verified answers only: the desk checks this job's answer on a second
    /// worker whatever the tier's rate.
    #[serde(default)]
    pub verified_only: bool,
}

/// Workers' current signed claims, for the client to choose and seal to.
pub type Holders = Vec<SignedClaims>;
