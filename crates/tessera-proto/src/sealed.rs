//! Sealed jobs: what travels inside the envelopes ([`SealedRequest`], [`SealedAnswer`]) and the
//! control messages that carry them. The coordinator routes envelopes on their authenticated
//! headers and never sees these bodies: the client seals a [`SealedRequest`] to each candidate
//! worker (`tessera_seal::seal_job`), the worker runs it on the single-node stage it holds and
//! seals a [`SealedAnswer`] back to the client's reply key.

use serde::{Deserialize, Serialize};
use tessera_sampling::SamplingParams;
use tessera_seal::{
    DeviceTier, JobEnvelope, JobId, KeyId, NodeKey, ResultEnvelope, SignedClaims, UnixMillis,
};

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
    Skipped { attempt: u32, reason: PassedOver },
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
    Failed { reason: SealedFailure },
}

/// Why one attempt's worker was passed over: left out before dispatch, or given up on after.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PassedOver {
    /// Sealed to a key no worker claims now: rotated, or its worker left.
    KeyNotClaimed { key: KeyId },
    /// The worker left the cluster.
    WorkerLeft { worker: NodeKey },
    /// The worker was caught altering answers.
    Quarantined { worker: NodeKey },
    /// The worker does not hold the job's model.
    ModelNotHeld { worker: NodeKey, model: String },
    /// The job needs more positions than the worker claims room for.
    NoRoom {
        worker: NodeKey,
        needs: u64,
        room: u64,
    },
    /// The job is longer than the worker's device tier takes.
    TierTooSmall {
        worker: NodeKey,
        tier: DeviceTier,
        needs: u64,
        max: u64,
    },
    /// An earlier attempt of the same job is sealed to the same worker.
    SameWorker { worker: NodeKey },
    /// The holder went silent or left while it held the job.
    WentSilent { holder: NodeKey },
    /// The worker refused the envelope.
    Refused {
        worker: NodeKey,
        reason: SealedRefusal,
    },
}

impl std::fmt::Display for PassedOver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::KeyNotClaimed { key } => write!(
                f,
                "sealed to key {key}, which no worker claims now (rotated, or the worker left)"
            ),
            Self::WorkerLeft { worker } => write!(f, "worker {worker} has left"),
            Self::Quarantined { worker } => write!(f, "worker {worker} is quarantined"),
            Self::ModelNotHeld { worker, model } => {
                write!(f, "worker {worker} does not hold model {model}")
            }
            Self::NoRoom {
                worker,
                needs,
                room,
            } => write!(
                f,
                "the job needs {needs} positions; worker {worker} claims room for {room}"
            ),
            Self::TierTooSmall {
                worker,
                tier,
                needs,
                max,
            } => write!(
                f,
                "the job needs {needs} positions; worker {worker} is a {tier}, which takes jobs \
                 of at most {max}"
            ),
            Self::SameWorker { worker } => {
                write!(f, "another attempt is sealed to worker {worker}")
            }
            Self::WentSilent { holder } => write!(f, "{holder} went silent or left"),
            Self::Refused { worker, reason } => write!(f, "{worker} refused: {reason}"),
        }
    }
}

/// One attempt passed over, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Passed {
    pub attempt: u32,
    pub why: PassedOver,
}

/// Why a sealed job cannot complete.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SealedFailure {
    /// The job id was submitted before (its envelopes are one-shot).
    AlreadySubmitted { job: JobId },
    /// More envelopes than a job may have candidates.
    TooManyEnvelopes { count: usize, max: usize },
    /// The envelopes belong to two jobs.
    MixedJobs { first: JobId, other: JobId },
    /// Envelope `envelope` (counting from 1) carries another attempt number.
    AttemptOutOfOrder { envelope: u32, carries: u32 },
    /// An attempt had expired when it arrived.
    AttemptExpired { attempt: u32, at: UnixMillis },
    /// No candidate fits the job, each for its reason.
    NoWorkerFits { passed_over: Vec<Passed> },
    /// Every candidate was tried and none is left.
    NoCandidateLeft {
        tries: u32,
        passed_over: Vec<Passed>,
    },
    /// The job was moved on as often as it may be.
    GaveUp {
        tries: u32,
        passed_over: Vec<Passed>,
    },
    /// The coordinator refused one of the session's messages (it cannot say which job).
    SessionRefused { message: String },
}

fn write_passed_over(f: &mut std::fmt::Formatter<'_>, passed: &[Passed]) -> std::fmt::Result {
    for (i, p) in passed.iter().enumerate() {
        let sep = if i == 0 { "" } else { "; " };
        write!(f, "{sep}attempt {}: {}", p.attempt, p.why)?;
    }
    Ok(())
}

impl std::fmt::Display for SealedFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::AlreadySubmitted { job } => write!(f, "job {job} was already submitted"),
            Self::TooManyEnvelopes { count, max } => {
                write!(f, "{count} envelopes (at most {max} candidates a job)")
            }
            Self::MixedJobs { first, other } => {
                write!(f, "envelopes of two jobs ({first} and {other})")
            }
            Self::AttemptOutOfOrder { envelope, carries } => write!(
                f,
                "envelope {envelope} carries attempt {carries} (attempts count 1, 2, … in order)"
            ),
            Self::AttemptExpired { attempt, at } => write!(f, "attempt {attempt} expired at {at}"),
            Self::NoWorkerFits { passed_over } => {
                f.write_str("no worker fits this job: ")?;
                write_passed_over(f, passed_over)
            }
            Self::NoCandidateLeft { tries, passed_over } => {
                write!(f, "no candidate worker left after {tries} tries: ")?;
                write_passed_over(f, passed_over)
            }
            Self::GaveUp { tries, passed_over } => {
                write!(f, "gave up after {tries} tries: ")?;
                write_passed_over(f, passed_over)
            }
            Self::SessionRefused { message } => f.write_str(message),
        }
    }
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
