//! Seeded schedules of sealed jobs against the coordinator's own [`SealedDesk`], inside the very
//! [`Cluster`] the runtime drives (every input goes in as `ClusterInput::Sealed`): workers that
//! answer, refuse, alter their tokens, freeze and die, and clients that seal each job to a few
//! of the workers the desk lists. Everything the desk sees is real: signed claims, envelopes
//! sealed to the workers' keys, results sealed back with the digests of the tokens; the
//! workers, the network and the coordinator's node leases are modelled, in virtual time.
//!
//! After every step of the desk, its outputs are checked:
//!
//! - nothing is dispatched to a worker after the coordinator saw it leave (a kill or a freeze
//!   past the node lease), nor to a quarantined one;
//! - a job gets exactly one end, an answer or an explicit failure, and no news after it;
//! - an answer marked verified holds the honest tokens;
//! - only a worker that altered its tokens is ever quarantined;
//! - a job whose holder died or froze moves on within the node lease plus one tick of the
//!   desk's clock;
//! - at the end every job has ended, and the desk holds none.
//!
//! A failing seed replays exactly: `TESSERA_SIM_SEED=N cargo test -p tessera-coord sim::`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tessera_proto::{SealedFailure, SealedNews, SealedRefusal};
use tessera_seal::{
    seal_result, AnswerDigest, Claims, DeviceTier, JobEnvelope, JobId, KernelPath, LeaseConfig,
    NodeKey, SecretKey, SignedClaims, UnixMillis,
};

use super::world::{Invariant, Violation};
use super::Rng;
use crate::cluster::{Cluster, ClusterInput, ClusterOutput};
use crate::sealed::{
    verify_config, DeskFault, SealedConfig, SealedDesk, SealedInput, SealedOutput,
};
use tessera_seal::seal_attempts;

/// The desk's clock ticks this often (as the coordinator's sealed edge does).
const TICK_MS: u64 = 250;
/// The coordinator's node lease: a worker silent this long has left.
const NODE_LEASE_MS: u64 = 3_000;
const MODEL: &str = "m";
/// What every job asks (the workers' tokens depend on the job, not on the body).
const BODY: &[u8] = br#"{"prompt_tokens":[1,2,3]}"#;

/// Settings of one schedule.
#[derive(Clone, Debug, Default)]
pub struct SealedSimConfig {
    /// A deliberate bug in the desk (to show the invariants catch it).
    pub fault: Option<DeskFault>,
}

/// What a schedule did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SealedSummary {
    pub jobs: usize,
    pub answered: usize,
    pub verified: usize,
    pub failed: usize,
    /// Jobs the client could not seal: the desk listed no worker.
    pub unsealed: usize,
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

struct Worker {
    seed: [u8; 32],
    seal: SecretKey,
    node: NodeKey,
    tier: DeviceTier,
    /// Ships altered tokens (with their honest-looking digest).
    liar: bool,
    /// Refuses this many envelopes in a thousand.
    refuses: u64,
    ms_per_token: u64,
    dies_at: Option<u64>,
    /// Stopped (SIGSTOP) from the first time to the second.
    frozen: Option<(u64, u64)>,
    /// The coordinator saw its session end and has not heard a claim since.
    left: bool,
    /// Its control session: messages and work of an earlier one are gone with it.
    session: u32,
}

impl Worker {
    fn claims(&self, now: u64) -> SignedClaims {
        Claims {
            node: self.node,
            epoch: u64::from(self.session) + 1,
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

    /// When the worker stopped for good or for now, if it is not running at `t`.
    fn stopped_at(&self, t: u64) -> Option<u64> {
        if let Some(d) = self.dies_at.filter(|d| *d <= t) {
            return Some(d);
        }
        self.frozen
            .filter(|(a, b)| (*a..*b).contains(&t))
            .map(|f| f.0)
    }
}

/// A worker's message to the desk, on its way.
enum Report {
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

enum Ev {
    Submit(usize),
    Tick,
    /// An envelope reaches worker `w` (sent in its session `session`).
    Envelope {
        w: usize,
        session: u32,
        envelope: JobEnvelope,
    },
    /// Worker `w` has generated `done` of `total` tokens of an envelope.
    Step {
        w: usize,
        session: u32,
        envelope: JobEnvelope,
        done: usize,
        total: usize,
    },
    /// A worker's report reaches the desk.
    Report {
        w: usize,
        session: u32,
        report: Report,
    },
    /// The coordinator's node lease of `w` ran out.
    NodeLeft(usize),
    /// A thawed worker reconnects and claims again.
    Reclaim(usize),
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

struct SealedWorld {
    seed: u64,
    rng: Rng,
    /// The coordinator's composition, with the desk in it: every sealed input goes in as the
    /// runtime's does ([`ClusterInput::Sealed`]).
    cluster: Cluster,
    workers: Vec<Worker>,
    client: SecretKey,
    jobs: Vec<(JobId, bool)>,
    truth: BTreeMap<JobId, JobTruth>,
    quarantined: BTreeSet<NodeKey>,
    queue: BTreeMap<(u64, u64), Ev>,
    next_seq: u64,
    now: u64,
    horizon: u64,
    summary: SealedSummary,
}

/// Runs schedule `seed`; the first broken invariant is the error.
pub fn simulate_sealed(seed: u64, cfg: SealedSimConfig) -> Result<SealedSummary, Violation> {
    let mut w = SealedWorld::new(seed, cfg);
    w.run()?;
    w.finish()?;
    Ok(w.summary)
}

fn honest_tokens(job: JobId) -> Vec<u32> {
    let b = job.as_bytes();
    let n = 4 + usize::from(b[0] % 40);
    (0..n)
        .map(|k| u32::from(b[k % 16]) * 7 + k as u32)
        .collect()
}

impl SealedWorld {
    fn new(seed: u64, cfg: SealedSimConfig) -> Self {
        let mut rng = Rng::new(seed ^ 0x5EA1_ED00);
        let n = rng.range(1, 6) as usize;
        let liar = (rng.range(0, 3) == 0).then(|| rng.range(0, n as u64) as usize);
        let horizon = 20_000;
        let tiers = [
            DeviceTier::Phone,
            DeviceTier::Laptop,
            DeviceTier::Workstation,
            DeviceTier::Server,
        ];
        let mut workers = Vec::with_capacity(n);
        let mut summary = SealedSummary::default();
        for i in 0..n {
            let mut seed_bytes = [0u8; 32];
            seed_bytes[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
            seed_bytes[8] = i as u8;
            let seal = SecretKey::derive(&rng.next_u64().to_le_bytes());
            let fate = rng.range(0, 10);
            let at = rng.range(500, horizon);
            let (dies_at, frozen) = match fate {
                0 | 1 => (Some(at), None),
                2 | 3 => (None, Some((at, at + rng.range(500, 8_000)))),
                _ => (None, None),
            };
            summary.kills += usize::from(dies_at.is_some());
            summary.freezes += usize::from(frozen.is_some());
            workers.push(Worker {
                node: NodeKey::of_seed(&seed_bytes),
                seed: seed_bytes,
                seal,
                tier: tiers[rng.range(0, 4) as usize],
                liar: liar == Some(i),
                refuses: [0, 0, 100, 400][rng.range(0, 4) as usize],
                ms_per_token: rng.range(5, 120),
                dies_at,
                frozen,
                left: false,
                session: 0,
            });
        }
        let per_mille = [0, 300, 1000][rng.range(0, 3) as usize];
        let mut cluster = super::world::empty_cluster(Duration::from_millis(NODE_LEASE_MS));
        cluster.set_sealed_desk(SealedDesk::new(SealedConfig {
            leases: LeaseConfig::default(),
            verify: verify_config([seed as u8; 32], Some(per_mille), true),
            fault: cfg.fault,
        }));
        for w in &workers {
            let desk = cluster.sealed_desk_mut();
            desk.offer_claims(w.node, w.claims(0)).expect("claims");
        }
        let mut world = Self {
            seed,
            rng,
            cluster,
            workers,
            client: SecretKey::derive(&seed.to_le_bytes()),
            jobs: Vec::new(),
            truth: BTreeMap::new(),
            quarantined: BTreeSet::new(),
            queue: BTreeMap::new(),
            next_seq: 0,
            now: 0,
            horizon,
            summary,
        };
        let n_jobs = world.rng.range(1, 12) as usize;
        for i in 0..n_jobs {
            let mut id = [0u8; 16];
            id[..8].copy_from_slice(&world.rng.next_u64().to_le_bytes());
            id[8..16].copy_from_slice(&(i as u64).to_le_bytes());
            let verified_only = world.rng.range(0, 3) == 0;
            world.jobs.push((JobId::from_bytes(id), verified_only));
            let at = world.rng.range(0, horizon);
            world.at(at, Ev::Submit(i));
        }
        for i in 0..world.workers.len() {
            let (dies_at, frozen) = (world.workers[i].dies_at, world.workers[i].frozen);
            if let Some(d) = dies_at {
                world.at(d + NODE_LEASE_MS, Ev::NodeLeft(i));
            }
            if let Some((a, b)) = frozen {
                if b - a > NODE_LEASE_MS {
                    world.at(a + NODE_LEASE_MS, Ev::NodeLeft(i));
                    world.at(b, Ev::Reclaim(i));
                }
            }
        }
        world.at(TICK_MS, Ev::Tick);
        world
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.queue.insert((t, self.next_seq), ev);
        self.next_seq += 1;
    }

    fn delay(&mut self) -> u64 {
        self.rng.range(1, 40)
    }

    fn violation(&self, broke: Invariant, what: String) -> Violation {
        Violation {
            seed: self.seed,
            at: Duration::from_millis(self.now),
            broke,
            what: format!("sealed: {what}"),
        }
    }

    fn run(&mut self) -> Result<(), Violation> {
        // Long enough for every job to run out of candidates at the slowest tier's lease.
        let limit = self.horizon + 10 * 60_000;
        while let Some(((t, _), ev)) = self.queue.pop_first() {
            if t > limit {
                break;
            }
            self.now = t;
            self.summary.events += 1;
            self.step(ev)?;
        }
        Ok(())
    }

    /// Feeds the desk one input through the cluster, at the world's time; its outputs.
    fn desk_step(&mut self, input: SealedInput) -> Vec<SealedOutput> {
        let now = Duration::from_millis(self.now);
        self.cluster
            .handle(now, ClusterInput::Sealed(input))
            .into_iter()
            .filter_map(|o| match o {
                ClusterOutput::Sealed(o) => Some(o),
                _ => None,
            })
            .collect()
    }

    fn step(&mut self, ev: Ev) -> Result<(), Violation> {
        let now = self.now;
        match ev {
            Ev::Submit(i) => self.submit(i)?,
            Ev::Tick => {
                let out = self.desk_step(SealedInput::Tick {
                    now: UnixMillis(now),
                });
                self.apply(out)?;
                self.check_handover()?;
                if self.truth.values().any(|j| !j.ended) || now < self.horizon {
                    self.at(now + TICK_MS, Ev::Tick);
                }
            }
            Ev::Envelope {
                w,
                session,
                envelope,
            } => {
                let Some(w) = self.running(w, session, now, || Ev::Envelope {
                    w,
                    session,
                    envelope: envelope.clone(),
                }) else {
                    return Ok(());
                };
                let (job, attempt) = (envelope.header.job, envelope.header.attempt);
                let worker = &self.workers[w];
                if self.rng.range(0, 1000) < worker.refuses {
                    let reason = SealedRefusal::CannotRun("busy".into());
                    self.report(
                        w,
                        Report::Refused {
                            job,
                            attempt,
                            reason,
                        },
                    );
                    return Ok(());
                }
                envelope.open(&worker.seal).map_err(|e| {
                    self.violation(Invariant::Harness, format!("an envelope did not open: {e}"))
                })?;
                let total = honest_tokens(job).len();
                let t = now + worker.ms_per_token;
                let session = worker.session;
                self.at(
                    t,
                    Ev::Step {
                        w,
                        session,
                        envelope,
                        done: 0,
                        total,
                    },
                );
            }
            Ev::Step {
                w,
                session,
                envelope,
                done,
                total,
            } => {
                let Some(w) = self.running(w, session, now, || Ev::Step {
                    w,
                    session,
                    envelope: envelope.clone(),
                    done,
                    total,
                }) else {
                    return Ok(());
                };
                let done = (done + 8).min(total);
                let (job, attempt) = (envelope.header.job, envelope.header.attempt);
                if done < total {
                    self.report(
                        w,
                        Report::Progress {
                            job,
                            attempt,
                            tokens: done,
                        },
                    );
                    let t = now + 8 * self.workers[w].ms_per_token;
                    self.at(
                        t,
                        Ev::Step {
                            w,
                            session,
                            envelope,
                            done,
                            total,
                        },
                    );
                } else {
                    let worker = &self.workers[w];
                    let mut tokens = honest_tokens(job);
                    if worker.liar {
                        tokens[0] += 1;
                    }
                    let digest = AnswerDigest::of_tokens(BODY, &tokens);
                    let result = seal_result(&envelope.header, &worker.seal, digest, b"answer")
                        .map_err(|e| {
                            self.violation(Invariant::Harness, format!("sealing a result: {e}"))
                        })?;
                    self.report(w, Report::Result(result));
                }
            }
            Ev::Report { w, session, report } => {
                // A report sent in a session that has ended is lost with it.
                if self.workers[w].session != session {
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
                let out = self.desk_step(input);
                self.apply(out)?;
            }
            Ev::NodeLeft(w) => {
                let worker = &mut self.workers[w];
                worker.left = true;
                worker.session += 1;
                let node = worker.node;
                let out = self.desk_step(SealedInput::NodeLeft {
                    node,
                    now: UnixMillis(now),
                });
                self.apply(out)?;
            }
            Ev::Reclaim(w) => {
                let claims = self.workers[w].claims(now);
                let node = self.workers[w].node;
                self.cluster
                    .sealed_desk_mut()
                    .offer_claims(node, claims)
                    .map_err(|e| {
                        self.violation(
                            Invariant::Harness,
                            format!("a returning worker's claims: {e}"),
                        )
                    })?;
                self.workers[w].left = false;
            }
        }
        Ok(())
    }

    /// `w` if it runs now in session `session`; a frozen worker takes the event up when it
    /// thaws, a dead one or one whose session ended never does.
    fn running(
        &mut self,
        w: usize,
        session: u32,
        now: u64,
        again: impl Fn() -> Ev,
    ) -> Option<usize> {
        let worker = &self.workers[w];
        if worker.session != session || worker.dies_at.is_some_and(|d| d <= now) {
            return None;
        }
        if let Some((_, thaw)) = worker.frozen.filter(|(a, b)| (*a..*b).contains(&now)) {
            self.at(thaw, again());
            return None;
        }
        Some(w)
    }

    fn report(&mut self, w: usize, report: Report) {
        let t = self.now + self.delay();
        let session = self.workers[w].session;
        self.at(t, Ev::Report { w, session, report });
    }

    /// The client seals job `i` to a few of the workers the desk lists, in a random order.
    fn submit(&mut self, i: usize) -> Result<(), Violation> {
        let (job, verified_only) = self.jobs[i];
        self.summary.jobs += 1;
        let mut listed = self.cluster.sealed_desk().holders(Some(MODEL));
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
            UnixMillis(self.now + 60 * 60_000),
            &self.client.public_key(),
        )
        .map_err(|e| self.violation(Invariant::Harness, format!("sealing: {e}")))?;
        self.truth.insert(
            job,
            JobTruth {
                verified_only,
                ..JobTruth::default()
            },
        );
        let out = self.desk_step(SealedInput::Submit {
            client: 1,
            envelopes,
            verified_only,
            now: UnixMillis(self.now),
        });
        self.apply(out)
    }

    fn worker_of(&self, node: &NodeKey) -> Option<usize> {
        self.workers.iter().position(|w| w.node == *node)
    }

    /// Carries the desk's outputs out, checking each against what the simulator knows.
    fn apply(&mut self, out: Vec<SealedOutput>) -> Result<(), Violation> {
        for o in out {
            match o {
                SealedOutput::Dispatch { to, envelope } => {
                    let w = self.worker_of(&to).ok_or_else(|| {
                        self.violation(
                            Invariant::DispatchOnlyToCurrentWorkers,
                            format!("dispatched to unknown {to}"),
                        )
                    })?;
                    if self.workers[w].left {
                        return Err(self.violation(
                            Invariant::DispatchOnlyToCurrentWorkers,
                            format!(
                                "job {} dispatched to worker {w}, which the coordinator saw leave",
                                envelope.header.job
                            ),
                        ));
                    }
                    if self.quarantined.contains(&to) {
                        return Err(self.violation(
                            Invariant::DispatchOnlyToCurrentWorkers,
                            format!(
                                "job {} dispatched to quarantined worker {w}",
                                envelope.header.job
                            ),
                        ));
                    }
                    let t = self.now + self.delay();
                    let session = self.workers[w].session;
                    self.at(
                        t,
                        Ev::Envelope {
                            w,
                            session,
                            envelope,
                        },
                    );
                }
                SealedOutput::Tell { job, news, .. } => self.told(job, news)?,
                SealedOutput::Quarantined { node, job } => {
                    let w = self.worker_of(&node);
                    if !w.is_some_and(|w| self.workers[w].liar) {
                        return Err(self.violation(
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

    fn told(&mut self, job: JobId, news: SealedNews) -> Result<(), Violation> {
        let now = self.now;
        let holder = match &news {
            SealedNews::Dispatched { to, .. } => self.worker_of(to),
            _ => None,
        };
        let Some(t) = self.truth.get_mut(&job) else {
            return Err(self.violation(
                Invariant::NewsOfLiveJobsOnly,
                format!("news of job {job}, which nobody submitted"),
            ));
        };
        if t.ended {
            return Err(self.violation(
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

    /// No job stays with a holder that died or froze past the node lease (plus a tick of the
    /// desk's clock, and the network's delay).
    fn check_handover(&mut self) -> Result<(), Violation> {
        let now = self.now;
        let mut stuck = None;
        for (job, t) in &mut self.truth {
            let Some((h, _)) = t.holder.filter(|_| !t.ended && !t.holder_answered) else {
                continue;
            };
            let Some(stopped) = self.workers[h].stopped_at(now) else {
                continue;
            };
            t.lost_holder = true;
            if now > stopped + NODE_LEASE_MS + TICK_MS {
                stuck = Some((*job, h, now - stopped));
            }
        }
        match stuck {
            Some((job, h, ms)) => Err(self.violation(
                Invariant::HandoverWithinLease,
                format!(
                    "job {job} still with worker {h}, stopped {ms} ms ago (node lease \
                 {NODE_LEASE_MS} ms)"
                ),
            )),
            None => Ok(()),
        }
    }

    fn finish(&mut self) -> Result<(), Violation> {
        if let Some((job, _)) = self.truth.iter().find(|(_, t)| !t.ended) {
            return Err(self.violation(Invariant::EveryJobEnds, format!("job {job} never ended")));
        }
        if self.cluster.sealed_desk().in_flight() != 0 {
            return Err(self.violation(
                Invariant::EveryJobEnds,
                format!(
                    "the desk still holds {} jobs after every job ended",
                    self.cluster.sealed_desk().in_flight()
                ),
            ));
        }
        Ok(())
    }
}
