//! Sealed jobs in a simulated world, shared by both kinds of schedule: the workers' keys,
//! claims and behaviour (answer, refuse, alter their tokens), the client that seals each job to
//! a few of the workers the desk lists, what the simulator knows of each job, and the sealed
//! invariants checked against every output of the desk.
//!
//! The sealed-job schedules (`sealed.rs`: a world of workers only) and the ring schedules that
//! carry sealed jobs beside their runs (`world/`: the workers are its nodes) each implement
//! [`JobsHost`]: when a worker runs, which session it is in, whether the coordinator saw it
//! leave, and the desk inside the host's [`Cluster`].

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tessera_proto::{SealedFailure, SealedNews, SealedRefusal};
use tessera_seal::{
    seal_attempts, seal_result, AnswerDigest, Claims, DeviceTier, JobEnvelope, JobId, KernelPath,
    NodeKey, SecretKey, SignedClaims, UnixMillis,
};

use super::violation::{Invariant, Violation};
use super::Rng;
use crate::cluster::{Cluster, ClusterInput, ClusterOutput};
use crate::sealed::{SealedInput, SealedOutput};

/// The desk's clock ticks this often (as the coordinator's sealed edge does).
pub(super) const TICK_MS: u64 = 250;
const MODEL: &str = "m";
/// What every job asks (the workers' tokens depend on the job, not on the body).
const BODY: &[u8] = br#"{"prompt_tokens":[1,2,3]}"#;

/// What a schedule's sealed jobs did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SealedSummary {
    pub jobs: usize,
    pub answered: usize,
    pub verified: usize,
    pub failed: usize,
    /// Jobs the client could not seal: the desk listed no worker.
    pub unsealed: usize,
    /// Jobs in flight when the coordinator restarted (their client's session ended with it).
    pub lost: usize,
    /// Unverified answers to clients that asked for verified ones only (the client refuses
    /// them: no second worker was left to check).
    pub refused_by_client: usize,
    /// Jobs that moved from a holder that died or froze to another worker.
    pub handed_over: usize,
    pub kills: usize,
    pub freezes: usize,
    pub quarantined: usize,
    pub events: u64,
}

impl SealedSummary {
    /// Adds another schedule's counts.
    pub fn add(&mut self, s: &Self) {
        self.jobs += s.jobs;
        self.answered += s.answered;
        self.verified += s.verified;
        self.failed += s.failed;
        self.unsealed += s.unsealed;
        self.lost += s.lost;
        self.refused_by_client += s.refused_by_client;
        self.handed_over += s.handed_over;
        self.kills += s.kills;
        self.freezes += s.freezes;
        self.quarantined += s.quarantined;
        self.events += s.events;
    }
}

/// A worker: its keys and how it behaves (when it runs is its host's).
pub(super) struct Worker {
    seed: [u8; 32],
    seal: SecretKey,
    pub node: NodeKey,
    tier: DeviceTier,
    /// Ships altered tokens (with their honest-looking digest).
    liar: bool,
    /// Refuses this many envelopes in a thousand.
    refuses: u64,
    ms_per_token: u64,
}

impl Worker {
    /// A worker whose node key is `seed`'s, sealing with `seal`; the rest drawn from `rng`.
    pub fn draw(rng: &mut Rng, seed: [u8; 32], seal: SecretKey) -> Self {
        let tiers = [
            DeviceTier::Phone,
            DeviceTier::Laptop,
            DeviceTier::Workstation,
            DeviceTier::Server,
        ];
        Self {
            node: NodeKey::of_seed(&seed),
            seed,
            seal,
            tier: tiers[rng.range(0, 4) as usize],
            liar: false,
            refuses: [0, 0, 100, 400][rng.range(0, 4) as usize],
            ms_per_token: rng.range(5, 120),
        }
    }

    /// Its signed claims, from session `session`.
    pub fn claims(&self, session: u64, now: u64) -> SignedClaims {
        Claims {
            node: self.node,
            epoch: session + 1,
            issued_at: UnixMillis(now),
            seal_key: self.seal.public_key(),
            models: vec![MODEL.into()],
            memory_bytes: 1 << 30,
            max_context: 8192,
            features: vec![],
            isa: "x86_64".into(),
            kernel_path: KernelPath::new("avx2"),
            tier: self.tier,
        }
        .sign(&self.seed)
        .expect("claims sign")
    }
}

/// A worker's message to the desk, on its way.
#[derive(Debug)]
pub(super) enum Report {
    Progress {
        job: JobId,
        attempt: u32,
        tokens: usize,
    },
    Result(tessera_seal::ResultEnvelope),
    Refused {
        job: JobId,
        attempt: u32,
        reason: SealedRefusal,
    },
}

/// The sealed jobs' events, in the host's queue.
#[derive(Debug)]
pub(super) enum JobEv {
    Submit(usize),
    /// An envelope reaches worker `w` (sent in its session `session`).
    Envelope {
        w: usize,
        session: u64,
        envelope: JobEnvelope,
    },
    /// Worker `w` has generated `done` of `total` tokens of an envelope.
    Step {
        w: usize,
        session: u64,
        envelope: JobEnvelope,
        done: usize,
        total: usize,
    },
    /// A worker's report reaches the desk.
    Report {
        w: usize,
        session: u64,
        report: Report,
    },
}

/// Whether a worker runs now.
pub(super) enum Running {
    Yes,
    /// Frozen: it takes the event up when it thaws, at this time.
    Thaws(u64),
    /// Dead, or that session is over: the event is lost.
    No,
}

/// Feeds the desk inside `cluster` one input at `now`, as the runtime does
/// (`ClusterInput::Sealed`); the desk's outputs.
pub(super) fn desk_step(
    cluster: &mut Cluster,
    now: Duration,
    input: SealedInput,
) -> Vec<SealedOutput> {
    cluster
        .handle(now, ClusterInput::Sealed(input))
        .into_iter()
        .filter_map(|o| match o {
            ClusterOutput::Sealed(o) => Some(o),
            _ => None,
        })
        .collect()
}

/// What the sealed jobs need of the world they run in.
pub(super) trait JobsHost {
    fn now_ms(&self) -> u64;
    fn schedule(&mut self, at: u64, ev: JobEv);
    /// The coordinator, with the desk in it.
    fn cluster(&mut self) -> &mut Cluster;
    /// Feeds the desk one input through the cluster (`ClusterInput::Sealed`); its outputs.
    fn desk(&mut self, input: SealedInput) -> Vec<SealedOutput>;
    /// Whether worker `w` runs the work of its session `session` now.
    fn running(&self, w: usize, session: u64) -> Running;
    /// Worker `w`'s session with the coordinator now (`None`: nothing reaches it).
    fn session(&self, w: usize) -> Option<u64>;
    /// The coordinator saw worker `w` leave and has had no claims from it since.
    fn left(&self, w: usize) -> bool;
    /// Delay that messages to and from worker `w` suffer beyond the network's own.
    fn extra_delay_ms(&self, w: usize) -> u64;
}

/// What the simulator knows of a job, to check the desk's word against.
#[derive(Default)]
struct JobTruth {
    ended: bool,
    verified_only: bool,
    /// The worker holding the live attempt, since when and when it was last heard from.
    holder: Option<(usize, u64)>,
    /// The holder has sent its answer (waiting on a check now).
    holder_answered: bool,
    /// A holder stopped (died or froze) while holding it.
    lost_holder: bool,
}

/// A schedule's sealed jobs, its workers and its client.
pub(super) struct SealedJobs {
    seed: u64,
    pub rng: Rng,
    pub workers: Vec<Worker>,
    client: SecretKey,
    jobs: Vec<(JobId, bool)>,
    truth: BTreeMap<JobId, JobTruth>,
    quarantined: BTreeSet<NodeKey>,
    pub summary: SealedSummary,
}

fn honest_tokens(job: JobId) -> Vec<u32> {
    let b = job.as_bytes();
    let n = 4 + usize::from(b[0] % 40);
    (0..n)
        .map(|k| u32::from(b[k % 16]) * 7 + k as u32)
        .collect()
}

impl SealedJobs {
    /// Worker `liar`, if any, alters its tokens.
    pub fn new(
        seed: u64,
        rng: Rng,
        mut workers: Vec<Worker>,
        liar: Option<usize>,
        summary: SealedSummary,
    ) -> Self {
        if let Some(w) = liar.and_then(|l| workers.get_mut(l)) {
            w.liar = true;
        }
        Self {
            seed,
            rng,
            workers,
            client: SecretKey::derive(&seed.to_le_bytes()),
            jobs: Vec::new(),
            truth: BTreeMap::new(),
            quarantined: BTreeSet::new(),
            summary,
        }
    }

    /// Draws the client's jobs, each submitted at a time in `from..to`: the host schedules
    /// [`JobEv::Submit`] of each at the time given.
    pub fn draw_jobs(&mut self, from: u64, to: u64) -> Vec<(u64, usize)> {
        let n_jobs = self.rng.range(1, 12) as usize;
        (0..n_jobs)
            .map(|i| {
                let mut id = [0u8; 16];
                id[..8].copy_from_slice(&self.rng.next_u64().to_le_bytes());
                id[8..16].copy_from_slice(&(i as u64).to_le_bytes());
                let verified_only = self.rng.range(0, 3) == 0;
                self.jobs.push((JobId::from_bytes(id), verified_only));
                (self.rng.range(from, to), i)
            })
            .collect()
    }

    pub fn worker_of(&self, node: &NodeKey) -> Option<usize> {
        self.workers.iter().position(|w| w.node == *node)
    }

    /// Every job submitted so far has ended.
    pub fn all_ended(&self) -> bool {
        self.truth.values().all(|t| t.ended)
    }

    pub fn violation(&self, now: u64, broke: Invariant, what: String) -> Violation {
        Violation {
            seed: self.seed,
            at: Duration::from_millis(now),
            broke,
            what: format!("sealed: {what}"),
        }
    }

    /// A message's delay on the network, beyond `extra`.
    fn delay(&mut self, extra: u64) -> u64 {
        self.rng.range(1, 40) + extra
    }

    pub fn step(&mut self, ev: JobEv, host: &mut impl JobsHost) -> Result<(), Violation> {
        let now = host.now_ms();
        // A worker's own work waits while it is frozen, and is lost with it or its session.
        if let JobEv::Envelope { w, session, .. } | JobEv::Step { w, session, .. } = &ev {
            match host.running(*w, *session) {
                Running::Yes => {}
                Running::Thaws(t) => {
                    host.schedule(t, ev);
                    return Ok(());
                }
                Running::No => return Ok(()),
            }
        }
        match ev {
            JobEv::Submit(i) => self.submit(i, host)?,
            JobEv::Envelope {
                w,
                session,
                envelope,
            } => {
                let (job, attempt) = (envelope.header.job, envelope.header.attempt);
                let worker = &self.workers[w];
                if self.rng.range(0, 1000) < worker.refuses {
                    let reason = SealedRefusal::CannotRun("busy".into());
                    let report = Report::Refused {
                        job,
                        attempt,
                        reason,
                    };
                    self.report(host, w, session, report);
                    return Ok(());
                }
                envelope.open(&worker.seal).map_err(|e| {
                    let what = format!("an envelope did not open: {e}");
                    self.violation(now, Invariant::Harness, what)
                })?;
                let total = honest_tokens(job).len();
                let step = JobEv::Step {
                    w,
                    session,
                    envelope,
                    done: 0,
                    total,
                };
                host.schedule(now + worker.ms_per_token, step);
            }
            JobEv::Step {
                w,
                session,
                envelope,
                done,
                total,
            } => {
                let done = (done + 8).min(total);
                let (job, attempt) = (envelope.header.job, envelope.header.attempt);
                if done < total {
                    let report = Report::Progress {
                        job,
                        attempt,
                        tokens: done,
                    };
                    self.report(host, w, session, report);
                    let t = now + 8 * self.workers[w].ms_per_token;
                    let step = JobEv::Step {
                        w,
                        session,
                        envelope,
                        done,
                        total,
                    };
                    host.schedule(t, step);
                } else {
                    let worker = &self.workers[w];
                    let mut tokens = honest_tokens(job);
                    if worker.liar {
                        tokens[0] += 1;
                    }
                    let digest = AnswerDigest::of_tokens(BODY, &tokens);
                    let result = seal_result(&envelope.header, &worker.seal, digest, b"answer")
                        .map_err(|e| {
                            let what = format!("sealing a result: {e}");
                            self.violation(now, Invariant::Harness, what)
                        })?;
                    self.report(host, w, session, Report::Result(result));
                }
            }
            JobEv::Report { w, session, report } => {
                // A report sent in a session that has ended is lost with it.
                if host.session(w) != Some(session) {
                    return Ok(());
                }
                let from = self.workers[w].node;
                let now = UnixMillis(now);
                let input = match report {
                    Report::Progress {
                        job,
                        attempt,
                        tokens,
                    } => SealedInput::Progress {
                        job,
                        attempt,
                        from,
                        tokens,
                        now,
                    },
                    Report::Result(result) => {
                        if let Some(t) = self.truth.get_mut(&result.header.job) {
                            if t.holder.is_some_and(|(h, _)| h == w) {
                                t.holder_answered = true;
                            }
                        }
                        SealedInput::Result { result, from, now }
                    }
                    Report::Refused {
                        job,
                        attempt,
                        reason,
                    } => SealedInput::Refused {
                        job,
                        attempt,
                        from,
                        reason,
                        now,
                    },
                };
                let out = host.desk(input);
                self.apply(out, host)?;
            }
        }
        Ok(())
    }

    fn report(&mut self, host: &mut impl JobsHost, w: usize, session: u64, report: Report) {
        let t = host.now_ms() + self.delay(host.extra_delay_ms(w));
        host.schedule(t, JobEv::Report { w, session, report });
    }

    /// The client seals job `i` to a few of the workers the desk lists, in a random order.
    fn submit(&mut self, i: usize, host: &mut impl JobsHost) -> Result<(), Violation> {
        let now = host.now_ms();
        let (job, verified_only) = self.jobs[i];
        self.summary.jobs += 1;
        let mut listed = host.cluster().sealed_desk().holders(Some(MODEL));
        if listed.is_empty() {
            self.summary.unsealed += 1;
            return Ok(());
        }
        for k in (1..listed.len()).rev() {
            let j = self.rng.range(0, k as u64 + 1) as usize;
            listed.swap(k, j);
        }
        listed.truncate(self.rng.range(1, 5) as usize);
        let long = self.rng.range(0, 5) == 0;
        let envelopes = seal_attempts(
            job,
            BODY,
            &listed,
            if long { 6_000 } else { 64 },
            UnixMillis(now + 60 * 60_000),
            &self.client.public_key(),
        )
        .map_err(|e| self.violation(now, Invariant::Harness, format!("sealing: {e}")))?;
        self.truth.insert(
            job,
            JobTruth {
                verified_only,
                ..JobTruth::default()
            },
        );
        let out = host.desk(SealedInput::Submit {
            client: 1,
            envelopes,
            verified_only,
            now: UnixMillis(now),
        });
        self.apply(out, host)
    }

    /// Worker `w` claims again from session `session` (it connected, or thawed).
    pub fn claim(&self, w: usize, session: u64, host: &mut impl JobsHost) -> Result<(), Violation> {
        let now = host.now_ms();
        let claims = self.workers[w].claims(session, now);
        let node = self.workers[w].node;
        host.cluster()
            .sealed_desk_mut()
            .offer_claims(node, claims)
            .map(|_| ())
            .map_err(|e| {
                let what = format!("a worker's claims: {e}");
                self.violation(now, Invariant::Harness, what)
            })
    }

    /// Carries the desk's outputs out, checking each against what the simulator knows.
    pub fn apply(
        &mut self,
        out: Vec<SealedOutput>,
        host: &mut impl JobsHost,
    ) -> Result<(), Violation> {
        let now = host.now_ms();
        for o in out {
            match o {
                SealedOutput::Dispatch { to, envelope } => {
                    let w = self.worker_of(&to).ok_or_else(|| {
                        self.violation(
                            now,
                            Invariant::DispatchOnlyToCurrentWorkers,
                            format!("dispatched to unknown {to}"),
                        )
                    })?;
                    let job = envelope.header.job;
                    if host.left(w) {
                        let what = format!(
                            "job {job} dispatched to worker {w}, which the coordinator saw leave"
                        );
                        return Err(self.violation(
                            now,
                            Invariant::DispatchOnlyToCurrentWorkers,
                            what,
                        ));
                    }
                    if self.quarantined.contains(&to) {
                        let what = format!("job {job} dispatched to quarantined worker {w}");
                        return Err(self.violation(
                            now,
                            Invariant::DispatchOnlyToCurrentWorkers,
                            what,
                        ));
                    }
                    // Sent on the worker's session; lost if it has none.
                    let Some(session) = host.session(w) else {
                        continue;
                    };
                    let t = now + self.delay(host.extra_delay_ms(w));
                    let ev = JobEv::Envelope {
                        w,
                        session,
                        envelope,
                    };
                    host.schedule(t, ev);
                }
                SealedOutput::Tell { job, news, .. } => self.told(now, job, news)?,
                SealedOutput::Quarantined { node, job } => {
                    let w = self.worker_of(&node);
                    if !w.is_some_and(|w| self.workers[w].liar) {
                        return Err(self.violation(
                            now,
                            Invariant::QuarantineOnlyLiars,
                            format!("honest worker {w:?} quarantined over job {job}"),
                        ));
                    }
                    if self.quarantined.insert(node) {
                        self.summary.quarantined += 1;
                    }
                }
            }
        }
        Ok(())
    }

    fn told(&mut self, now: u64, job: JobId, news: SealedNews) -> Result<(), Violation> {
        let holder = match &news {
            SealedNews::Dispatched { to, .. } => self.worker_of(to),
            _ => None,
        };
        let Some(t) = self.truth.get_mut(&job) else {
            return Err(self.violation(
                now,
                Invariant::NewsOfLiveJobsOnly,
                format!("news of job {job}, which nobody submitted"),
            ));
        };
        if t.ended {
            return Err(self.violation(
                now,
                Invariant::NewsOfLiveJobsOnly,
                format!("news of job {job} after its end: {news:?}"),
            ));
        }
        match news {
            SealedNews::Dispatched { .. } => {
                if t.lost_holder {
                    self.summary.handed_over += 1;
                    t.lost_holder = false;
                }
                t.holder = holder.map(|h| (h, now));
                t.holder_answered = false;
            }
            SealedNews::Progress { .. } => {
                if let Some(h) = &mut t.holder {
                    h.1 = now;
                }
            }
            SealedNews::Result {
                result, verified, ..
            } => {
                t.ended = true;
                self.summary.answered += 1;
                if !verified && t.verified_only {
                    self.summary.refused_by_client += 1;
                }
                if verified {
                    self.summary.verified += 1;
                    if result.header.answer != AnswerDigest::of_tokens(BODY, &honest_tokens(job)) {
                        return Err(self.violation(
                            now,
                            Invariant::VerifiedIsHonest,
                            format!("job {job}: a verified answer is not honest"),
                        ));
                    }
                }
            }
            SealedNews::Failed { reason } => {
                t.ended = true;
                self.summary.failed += 1;
                // A job given up on names why each candidate was passed over.
                let unexplained = match &reason {
                    SealedFailure::NoWorkerFits { passed_over }
                    | SealedFailure::NoCandidateLeft { passed_over, .. }
                    | SealedFailure::GaveUp { passed_over, .. } => passed_over.is_empty(),
                    _ => false,
                };
                if unexplained {
                    return Err(self.violation(
                        now,
                        Invariant::FailuresSayWhy,
                        format!(
                            "job {job} failed without saying why its candidates were passed over: \
                         {reason:?}"
                        ),
                    ));
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// No job stays with a holder whose work stopped (it died or froze, or died and runs again
    /// without the job) more than `within` ms after `lost(w, held_since)` says it did
    /// (`None`: the work goes on). `lease` names the bound in the report.
    pub fn check_handover(
        &mut self,
        now: u64,
        lost: impl Fn(usize, u64) -> Option<u64>,
        within: u64,
        lease: &str,
    ) -> Result<(), Violation> {
        let mut stuck = None;
        for (job, t) in &mut self.truth {
            let Some((h, held)) = t.holder.filter(|_| !t.ended && !t.holder_answered) else {
                continue;
            };
            let Some(stopped) = lost(h, held) else {
                continue;
            };
            t.lost_holder = true;
            if now > stopped + within {
                stuck = Some((*job, h, now - stopped));
            }
        }
        match stuck {
            Some((job, h, ms)) => Err(self.violation(
                now,
                Invariant::HandoverWithinLease,
                format!("job {job} still with worker {h}, stopped {ms} ms ago ({lease})"),
            )),
            None => Ok(()),
        }
    }

    /// The coordinator restarted with a new desk: every job in flight is lost with its
    /// client's session, and the new desk has quarantined nobody yet.
    pub fn coordinator_restarted(&mut self) {
        for t in self.truth.values_mut().filter(|t| !t.ended) {
            t.ended = true;
            self.summary.lost += 1;
        }
        self.quarantined.clear();
    }

    /// At the end: every job has ended, and the desk holds none.
    pub fn finish(&self, now: u64, cluster: &Cluster) -> Result<(), Violation> {
        if let Some((job, _)) = self.truth.iter().find(|(_, t)| !t.ended) {
            let what = format!("job {job} never ended");
            return Err(self.violation(now, Invariant::EveryJobEnds, what));
        }
        let held = cluster.sealed_desk().in_flight();
        if held != 0 {
            let what = format!("the desk still holds {held} jobs after every job ended");
            return Err(self.violation(now, Invariant::EveryJobEnds, what));
        }
        Ok(())
    }
}
