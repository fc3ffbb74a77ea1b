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
use tessera_proto::{
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
    /// The opened (job, attempt) pairs written down, so a replay after a restart is refused.
    seen: Mutex<SeenFile>,
    /// Refusals logged, at a bounded rate.
    refusals: Mutex<LogBudget>,
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
        let mut guard = ReplayGuard::new(MAX_TTL_MS, REPLAY_CAPACITY);
        let seen = SeenFile::open(&data_dir.join(SEEN_FILE), &mut guard, UnixMillis::now())
            .map_err(|e| FabricError::io(format!("reading {SEEN_FILE}"), e))?;
        Ok(Self {
            key,
            identity: identity.clone(),
            options,
            guard: Mutex::new(guard),
            seen: Mutex::new(seen),
            refusals: Mutex::new(LogBudget::default()),
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
        let refuse = |reason: SealedRefusal| {
            if let Some(suppressed) = self
                .refusals
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(std::time::Instant::now())
            {
                tracing::warn!(
                    event = "sealed_refused",
                    job = %header.job,
                    attempt = header.attempt,
                    reason = %reason,
                    suppressed,
                    "refused job {} attempt {}: {reason}{}",
                    header.job,
                    header.attempt,
                    if suppressed > 0 {
                        format!(" ({suppressed} refusals before it not logged)")
                    } else {
                        String::new()
                    }
                );
            }
            Box::new(NodeToCoord::SealedRefused {
                job: header.job,
                attempt: header.attempt,
                reason,
            })
        };
        let body = envelope
            .open(&self.key)
            .map_err(|_| refuse(SealedRefusal::Authentication))?;
        {
            let mut guard = self.guard.lock().unwrap_or_else(|p| p.into_inner());
            guard.admit(&header, UnixMillis::now()).map_err(|r| {
                refuse(match r {
                    ReplayRefusal::Replayed { .. } => SealedRefusal::Replayed,
                    ReplayRefusal::Expired { .. } | ReplayRefusal::TtlTooLong { .. } => {
                        SealedRefusal::Expired
                    }
                    other => SealedRefusal::CannotRun(other.to_string()),
                })
            })?;
            // Written down before the job runs: a restart must not forget it was opened.
            self.seen
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .record(header.job, header.attempt, header.expires_at, &guard)
                .map_err(|e| {
                    refuse(SealedRefusal::CannotRun(format!(
                        "recording the job against replay: {e}"
                    )))
                })?;
        }
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
            speculate: 0,
            prediction: Vec::new(),
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

/// The file in the data directory where opened (job, attempt) pairs are written down.
const SEEN_FILE: &str = "sealed-seen.log";

/// Opened (job, attempt) pairs on disk, one `JOB ATTEMPT EXPIRY_MS` line each, appended and
/// synced before a job runs; rewritten with only the unexpired entries at start and whenever
/// the lines outgrow the guard, so it stays bounded by the envelopes' lifetime.
struct SeenFile {
    path: std::path::PathBuf,
    file: std::fs::File,
    lines: usize,
}

impl SeenFile {
    /// Reads what an earlier run wrote into `guard` (expired lines dropped), and rewrites it.
    fn open(path: &Path, guard: &mut ReplayGuard, now: UnixMillis) -> std::io::Result<Self> {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                for line in text.lines() {
                    let mut f = line.split_whitespace();
                    let parsed = (|| {
                        let job = f.next()?.parse().ok()?;
                        let attempt = f.next()?.parse().ok()?;
                        let expires = f.next()?.parse().ok()?;
                        Some((job, attempt, UnixMillis(expires)))
                    })();
                    // A torn last line (a crash mid-write) is skipped.
                    if let Some((job, attempt, expires)) = parsed {
                        guard.restore(job, attempt, expires, now);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Self::rewrite(path, guard)
    }

    fn rewrite(path: &Path, guard: &ReplayGuard) -> std::io::Result<Self> {
        use std::io::Write;
        let tmp = path.with_extension("tmp");
        let mut text = String::new();
        for (job, attempt, expires) in guard.entries() {
            text.push_str(&format!("{job} {attempt} {}\n", expires.0));
        }
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_data()?;
        }
        std::fs::rename(&tmp, path)?;
        let file = std::fs::OpenOptions::new().append(true).open(path)?;
        Ok(Self {
            path: path.to_owned(),
            file,
            lines: guard.len(),
        })
    }

    /// Writes down one opened pair (durably), compacting when expired lines dominate.
    fn record(
        &mut self,
        job: tessera_seal::JobId,
        attempt: u32,
        expires: UnixMillis,
        guard: &ReplayGuard,
    ) -> std::io::Result<()> {
        use std::io::Write;
        if self.lines > 2 * guard.len() + 64 {
            *self = Self::rewrite(&self.path, guard)?;
            return Ok(());
        }
        self.file
            .write_all(format!("{job} {attempt} {}\n", expires.0).as_bytes())?;
        self.file.sync_data()?;
        self.lines += 1;
        Ok(())
    }
}

/// At most [`LogBudget::PER_WINDOW`] log lines per [`LogBudget::WINDOW`]; the count of those
/// not logged goes with the next line that is.
#[derive(Default)]
struct LogBudget {
    window_start: Option<std::time::Instant>,
    logged: u32,
    suppressed: u64,
}

impl LogBudget {
    const WINDOW: std::time::Duration = std::time::Duration::from_secs(10);
    const PER_WINDOW: u32 = 10;

    /// Whether to log now; `Some(n)`: yes, `n` lines having been suppressed since the last.
    fn take(&mut self, now: std::time::Instant) -> Option<u64> {
        if self
            .window_start
            .is_none_or(|s| now.duration_since(s) >= Self::WINDOW)
        {
            self.window_start = Some(now);
            self.logged = 0;
        }
        if self.logged >= Self::PER_WINDOW {
            self.suppressed += 1;
            return None;
        }
        self.logged += 1;
        Some(std::mem::take(&mut self.suppressed))
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

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_seal::JobId;

    #[test]
    fn opened_jobs_written_down_are_refused_as_replays_after_a_restart() {
        let dir = std::env::temp_dir().join(format!("tessera-seen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(SEEN_FILE);
        let now = UnixMillis(1_000_000);
        let header = |j: u8, expires: u64| tessera_seal::JobHeader {
            job: JobId::from_bytes([j; 16]),
            attempt: 1,
            recipient: SecretKey::derive(b"w").key_id(),
            model: "m".into(),
            context_tokens: 8,
            expires_at: UnixMillis(expires),
            reply_to: SecretKey::derive(b"c").public_key(),
        };
        {
            let mut guard = ReplayGuard::new(MAX_TTL_MS, 100);
            let mut seen = SeenFile::open(&path, &mut guard, now).unwrap();
            for (j, expires) in [(1, now.0 + 60_000), (2, now.0 + 1_000)] {
                let h = header(j, expires);
                guard.admit(&h, now).unwrap();
                seen.record(h.job, h.attempt, h.expires_at, &guard).unwrap();
            }
        }
        // The restart comes 5 s later: job 2's envelope has expired (refused on that ground
        // anyway), job 1's is remembered.
        let later = UnixMillis(now.0 + 5_000);
        let mut guard = ReplayGuard::new(MAX_TTL_MS, 100);
        SeenFile::open(&path, &mut guard, later).unwrap();
        assert_eq!(guard.len(), 1);
        assert!(matches!(
            guard.admit(&header(1, now.0 + 60_000), later),
            Err(ReplayRefusal::Replayed { .. })
        ));
        // The file holds what is still needed, nothing more.
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn refusals_are_logged_at_a_bounded_rate_and_the_rest_counted() {
        let mut b = LogBudget::default();
        let t0 = std::time::Instant::now();
        let logged = (0..25).filter(|_| b.take(t0).is_some()).count();
        assert_eq!(logged, LogBudget::PER_WINDOW as usize);
        // The next window's first line carries the count of those not logged.
        assert_eq!(b.take(t0 + LogBudget::WINDOW), Some(15));
        assert_eq!(b.take(t0 + LogBudget::WINDOW), Some(0));
    }
}
