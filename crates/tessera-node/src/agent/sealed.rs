//! Sealed jobs on the worker: open the envelope with this node's sealing key, refuse a replay or
//! an expired one, run the request as a local sequence on the whole-model stage this node holds,
//! and seal the answer back to the client. The coordinator sees the job's header, its progress
//! count and the sealed result, never the tokens.
//!
//! The sealing key (X25519, `seal.key` in the data directory, owner-only) and what the node can
//! run are published in claims signed with the node's identity key, at an epoch that only grows
//! ([`SealedWorker::claims`]).
//!
//! A local sequence goes through the stage thread like any other; its control messages come back
//! on the same channel as the coordinator's and are taken out of it here
//! ([`SealedWorker::intercept`]) — its seq ids have [`LOCAL_SEQ`] set, which the coordinator's
//! never do.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tessera_net::NodeIdentity;
use tessera_seal::{
    seal_result, AnswerDigest, Certificate, Claims, DeviceTier, JobEnvelope, JobHeader, KernelPath,
    NodeKey, ReplayGuard, ReplayRefusal, SecretKey, SignedCertificate, SignedClaims, UnixMillis,
};
use tokio::sync::mpsc;

use crate::error::FabricError;
use crate::protocol::{
    FinishReason, NodeToCoord, OpenSeq, SealedAnswer, SealedRefusal, SealedRequest, StageAssignment,
};

use super::stage_thread::WorkerMsg;

/// The bit that marks a sequence as this node's own (a sealed job), never the coordinator's.
pub(super) const LOCAL_SEQ: u64 = 1 << 63;
/// The furthest ahead an envelope's expiry may lie.
const MAX_TTL_MS: u64 = 10 * 60_000;
/// Unexpired jobs remembered against replay.
const REPLAY_CAPACITY: usize = 100_000;
/// A progress report (which renews the lease) every this many tokens.
const PROGRESS_EVERY: usize = 8;
/// Prompt tokens per prefill step of a sealed job.
const PREFILL_CHUNK: usize = 256;

/// How this node takes sealed jobs.
#[derive(Clone, Debug)]
pub struct SealedOptions {
    pub tier: DeviceTier,
    /// The operator's key directory (a `node.key` of its own): this node's sealing key, tier
    /// and measured inventory are certified with it, so clients that trust the operator seal
    /// to this node.
    pub operator_dir: Option<std::path::PathBuf>,
    /// Test only: change every answer's tokens (a worker that lies), so verification has
    /// something to catch.
    pub fault_alter_tokens: bool,
    /// Test only: report the honest tokens' digest but ship altered tokens (a worker that lies
    /// to the client only, so the coordinator's comparison of digests agrees).
    pub fault_ship_altered_tokens: bool,
}

impl Default for SealedOptions {
    fn default() -> Self {
        Self {
            tier: DeviceTier::Workstation,
            operator_dir: None,
            fault_alter_tokens: false,
            fault_ship_altered_tokens: false,
        }
    }
}

struct Run {
    header: JobHeader,
    body: Vec<u8>,
    tokens: Vec<u32>,
}

pub(super) struct SealedWorker {
    key: SecretKey,
    identity: NodeIdentity,
    options: SealedOptions,
    guard: Mutex<ReplayGuard>,
    runs: Mutex<HashMap<u64, Run>>,
    next: AtomicU64,
    claims_epoch: AtomicU64,
    /// The memory this node commits to work (claimed).
    memory_bytes: u64,
    /// The operator's certificate of this node's sealing key, tier and capabilities.
    certificate: Option<SignedCertificate>,
}

impl SealedWorker {
    /// Loads `seal.key` from `data_dir`, or makes it.
    pub fn open(
        data_dir: &Path,
        identity: &NodeIdentity,
        options: SealedOptions,
        memory_bytes: u64,
        inventory: &[u8],
    ) -> Result<Self, FabricError> {
        let path = data_dir.join("seal.key");
        let key = match std::fs::read_to_string(&path) {
            Ok(text) => SecretKey::from_file_text(&text)
                .map_err(|e| FabricError::Protocol(format!("{}: {e}", path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = SecretKey::generate();
                write_secret(&path, key.to_file_text().as_bytes())
                    .map_err(|e| FabricError::io(format!("writing {}", path.display()), e))?;
                key
            }
            Err(e) => return Err(FabricError::io(format!("reading {}", path.display()), e)),
        };
        let certificate = match &options.operator_dir {
            None => None,
            Some(dir) => {
                let operator = NodeIdentity::load_or_create(dir).map_err(|e| {
                    FabricError::Protocol(format!("the operator key in {}: {e}", dir.display()))
                })?;
                let cert = Certificate {
                    operator: NodeKey::from_bytes(*operator.public_key().as_bytes()),
                    node: NodeKey::from_bytes(*identity.public_key().as_bytes()),
                    seal_key: key.public_key(),
                    tier: options.tier,
                    memory_bytes,
                    isa: std::env::consts::ARCH.into(),
                    kernel_path: KernelPath::new(tessera_engine::kernels::isa().to_string()),
                    inventory: Certificate::inventory_digest(inventory),
                    issued_at: UnixMillis::now(),
                };
                tracing::info!(
                    event = "certified",
                    operator = %cert.operator,
                    seal_key = %cert.seal_key,
                    tier = %cert.tier,
                    "this node's sealing key, tier and inventory are certified by operator {}",
                    cert.operator
                );
                Some(cert.sign_with(|m| operator.sign(m)))
            }
        };
        Ok(Self {
            key,
            identity: identity.clone(),
            options,
            guard: Mutex::new(ReplayGuard::new(MAX_TTL_MS, REPLAY_CAPACITY)),
            runs: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            claims_epoch: AtomicU64::new(0),
            memory_bytes,
            certificate,
        })
    }

    /// Signed claims for what this node holds now: the model of `holding` when it is a whole
    /// copy on this node alone (the only kind a sealed job can run on). Each call is a new,
    /// higher epoch.
    pub fn claims(&self, holding: Option<&StageAssignment>) -> SignedClaims {
        let issued_at = UnixMillis::now();
        let epoch = {
            let mut e = self.claims_epoch.load(Ordering::SeqCst);
            loop {
                let next = (e + 1).max(issued_at.0);
                match self.claims_epoch.compare_exchange(
                    e,
                    next,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Ok(_) => break next,
                    Err(x) => e = x,
                }
            }
        };
        let held = holding.filter(|a| whole(a));
        let models = held.map(|a| vec![a.model.to_string()]).unwrap_or_default();
        let max_context = held.map_or(0, |a| a.max_context as u64);
        Claims {
            node: NodeKey::from_bytes(*self.identity.public_key().as_bytes()),
            epoch,
            issued_at,
            seal_key: self.key.public_key(),
            models,
            memory_bytes: self.memory_bytes,
            max_context,
            features: vec!["sealed-jobs-v1".into()],
            isa: std::env::consts::ARCH.into(),
            kernel_path: KernelPath::new(tessera_engine::kernels::isa().to_string()),
            tier: self.options.tier,
        }
        .sign_with(|m| self.identity.sign(m))
        .map(|s| match &self.certificate {
            Some(c) => s.with_certificate(c.clone()),
            None => s,
        })
        .expect("claims of this node are valid")
    }

    /// Takes a job: opens, checks and starts it on the stage thread, or says why not.
    pub fn take(
        &self,
        envelope: JobEnvelope,
        holding: Option<&StageAssignment>,
        worker: &mpsc::UnboundedSender<WorkerMsg>,
    ) -> Result<(), Box<NodeToCoord>> {
        let header = envelope.header.clone();
        let refuse = |reason| {
            Box::new(NodeToCoord::SealedRefused {
                job: header.job,
                attempt: header.attempt,
                reason,
            })
        };
        let body = envelope
            .open(&self.key)
            .map_err(|_| refuse(SealedRefusal::Authentication))?;
        self.guard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .admit(&header, UnixMillis::now())
            .map_err(|r| {
                refuse(match r {
                    ReplayRefusal::Replayed { .. } => SealedRefusal::Replayed,
                    ReplayRefusal::Expired { .. } | ReplayRefusal::TtlTooLong { .. } => {
                        SealedRefusal::Expired
                    }
                    other => SealedRefusal::CannotRun(other.to_string()),
                })
            })?;
        let req: SealedRequest = serde_json::from_slice(&body)
            .map_err(|e| refuse(SealedRefusal::CannotRun(format!("malformed request: {e}"))))?;
        let a = holding
            .filter(|a| whole(a) && a.model.to_string() == header.model)
            .ok_or_else(|| {
                refuse(SealedRefusal::CannotRun(format!(
                    "this node holds no whole copy of model {}",
                    header.model
                )))
            })?;
        let positions = req.prompt_tokens.len() + req.max_new_tokens;
        if req.prompt_tokens.is_empty() || positions > a.max_context {
            return Err(refuse(SealedRefusal::CannotRun(format!(
                "{} prompt tokens plus {} new need {positions} positions (1 to {} here)",
                req.prompt_tokens.len(),
                req.max_new_tokens,
                a.max_context
            ))));
        }
        let seq = LOCAL_SEQ | self.next.fetch_add(1, Ordering::Relaxed);
        let open = OpenSeq {
            seq,
            epoch: a.epoch,
            prompt: req.prompt_tokens,
            sampling: req.sampling,
            max_new_tokens: req.max_new_tokens,
            eog: req.eog,
            prefill_chunk: PREFILL_CHUNK,
            trace: false,
            grammar: None,
            logprobs: None,
            replayed: 0,
        };
        self.runs.lock().unwrap_or_else(|p| p.into_inner()).insert(
            seq,
            Run {
                header,
                body,
                tokens: Vec::new(),
            },
        );
        let _ = worker.send(WorkerMsg::Open(open));
        Ok(())
    }

    /// Takes a local sequence's message out of the coordinator's outbox and acts on it; gives
    /// back every other message. What a local sequence leads to (progress, the sealed answer, a
    /// refusal) comes back as messages for the coordinator.
    pub fn intercept(
        &self,
        msg: NodeToCoord,
        worker: &mpsc::UnboundedSender<WorkerMsg>,
    ) -> Result<NodeToCoord, Vec<NodeToCoord>> {
        let Some(seq) = msg.seq() else {
            return Ok(msg);
        };
        if seq & LOCAL_SEQ == 0 {
            return Ok(msg);
        }
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        let Some(run) = runs.get_mut(&seq) else {
            return Err(Vec::new());
        };
        let refused = |run: &Run, why: String| NodeToCoord::SealedRefused {
            job: run.header.job,
            attempt: run.header.attempt,
            reason: SealedRefusal::CannotRun(why),
        };
        match msg {
            NodeToCoord::Opened { .. } => {
                // From the first position: a sealed job neither reuses nor leaves a cache
                // (another client's timing must not tell what it sent).
                let _ = worker.send(WorkerMsg::Start(seq, 0));
                Err(Vec::new())
            }
            NodeToCoord::OpenFailed { reason, .. } => {
                let run = runs.remove(&seq).expect("present");
                Err(vec![refused(&run, reason)])
            }
            NodeToCoord::Token { token, .. } => {
                run.tokens.push(token);
                if run.tokens.len() % PROGRESS_EVERY == 0 {
                    return Err(vec![NodeToCoord::SealedProgress {
                        job: run.header.job,
                        attempt: run.header.attempt,
                        tokens: run.tokens.len(),
                    }]);
                }
                Err(Vec::new())
            }
            NodeToCoord::Finished { reason, error, .. } => {
                let _ = worker.send(WorkerMsg::Close(seq, Vec::new()));
                let mut run = runs.remove(&seq).expect("present");
                if reason == FinishReason::Error || reason == FinishReason::Cancelled {
                    let why = error.unwrap_or_else(|| format!("{reason:?}"));
                    return Err(vec![refused(&run, why)]);
                }
                if self.options.fault_alter_tokens {
                    for t in &mut run.tokens {
                        *t ^= 1;
                    }
                }
                Err(vec![self.answer(run, reason)])
            }
            NodeToCoord::Closed { .. } | NodeToCoord::Trace(_) => Err(Vec::new()),
            _ => unreachable!("matched above"),
        }
    }

    fn answer(&self, mut run: Run, reason: FinishReason) -> NodeToCoord {
        let digest = AnswerDigest::of_tokens(&run.body, &run.tokens);
        if self.options.fault_ship_altered_tokens {
            for t in &mut run.tokens {
                *t ^= 1;
            }
        }
        let body = serde_json::to_vec(&SealedAnswer {
            tokens: run.tokens,
            finish_reason: reason,
        })
        .expect("an answer serializes");
        match seal_result(&run.header, &self.key, digest, &body) {
            Ok(result) => NodeToCoord::SealedResult { result },
            Err(e) => NodeToCoord::SealedRefused {
                job: run.header.job,
                attempt: run.header.attempt,
                reason: SealedRefusal::CannotRun(format!("sealing the answer: {e}")),
            },
        }
    }
}

/// A whole copy of the model on this node alone, not sharing experts with others.
fn whole(a: &StageAssignment) -> bool {
    a.n_stages == 1 && a.embed && a.head && a.next.is_none()
}

fn write_secret(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    opts.open(path)?.write_all(bytes)
}
