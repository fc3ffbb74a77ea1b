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
//! The workers' behaviour, the client and these checks are `jobs.rs`'s, shared with the ring
//! schedules that carry sealed jobs beside their runs; this world adds the workers' fates
//! (when each dies or freezes) and the coordinator's node lease as a fixed delay.
//!
//! A failing seed replays exactly: `TESSERA_SIM_SEED=N cargo test -p tessera-coord sim::`.

use std::collections::BTreeMap;
use std::time::Duration;

use tessera_seal::{LeaseConfig, SecretKey, UnixMillis};

use super::jobs::{
    desk_step, JobEv, JobsHost, Running, SealedJobs, SealedSummary, Worker, TICK_MS,
};
use super::violation::Violation;
use super::Rng;
use crate::cluster::Cluster;
use crate::sealed::{
    verify_config, DeskFault, SealedConfig, SealedDesk, SealedInput, SealedOutput,
};

/// The coordinator's node lease: a worker silent this long has left.
const NODE_LEASE_MS: u64 = 3_000;

/// Settings of one schedule.
#[derive(Clone, Debug, Default)]
pub struct SealedSimConfig {
    /// A deliberate bug in the desk (to show the invariants catch it).
    pub fault: Option<DeskFault>,
}

/// When a worker runs: its fate in this schedule, and what the coordinator saw of it.
struct Fate {
    dies_at: Option<u64>,
    /// Stopped (SIGSTOP) from the first time to the second.
    frozen: Option<(u64, u64)>,
    /// The coordinator saw its session end and has not heard a claim since.
    left: bool,
    /// Its control session: messages and work of an earlier one are gone with it.
    session: u64,
}

impl Fate {
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

enum Ev {
    Jobs(JobEv),
    Tick,
    /// The coordinator's node lease of `w` ran out.
    NodeLeft(usize),
    /// A thawed worker reconnects and claims again.
    Reclaim(usize),
}

struct SealedWorld {
    /// The coordinator's composition, with the desk in it: every sealed input goes in as the
    /// runtime's does ([`ClusterInput::Sealed`]).
    cluster: Cluster,
    /// The jobs, the workers and the client (taken out while they run a step against this
    /// world).
    jobs: Option<SealedJobs>,
    fates: Vec<Fate>,
    queue: BTreeMap<(u64, u64), Ev>,
    next_seq: u64,
    now: u64,
    horizon: u64,
}

/// Runs schedule `seed`; the first broken invariant is the error.
pub fn simulate_sealed(seed: u64, cfg: SealedSimConfig) -> Result<SealedSummary, Violation> {
    let mut w = SealedWorld::new(seed, cfg);
    w.run()?;
    let jobs = w.jobs.take().expect("jobs are home between steps");
    jobs.finish(w.now, &w.cluster)?;
    Ok(jobs.summary)
}

/// The sealed-job desk of a simulated coordinator: leases as configured, verifying `per_mille`
/// of the answers.
pub(super) fn sim_desk(seed: u64, per_mille: u32, fault: Option<DeskFault>) -> SealedDesk {
    SealedDesk::new(SealedConfig {
        leases: LeaseConfig::default(),
        verify: verify_config([seed as u8; 32], Some(per_mille), true),
        fault,
    })
}

impl SealedWorld {
    fn new(seed: u64, cfg: SealedSimConfig) -> Self {
        let mut rng = Rng::new(seed ^ 0x5EA1_ED00);
        let n = rng.range(1, 6) as usize;
        let liar = (rng.range(0, 3) == 0).then(|| rng.range(0, n as u64) as usize);
        let horizon = 20_000;
        let mut workers = Vec::with_capacity(n);
        let mut fates = Vec::with_capacity(n);
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
            workers.push(Worker::draw(&mut rng, seed_bytes, seal));
            fates.push(Fate {
                dies_at,
                frozen,
                left: false,
                session: 0,
            });
        }
        let per_mille = [0, 300, 1000][rng.range(0, 3) as usize];
        let mut cluster = super::world::empty_cluster(Duration::from_millis(NODE_LEASE_MS));
        cluster.set_sealed_desk(sim_desk(seed, per_mille, cfg.fault));
        let mut jobs = SealedJobs::new(seed, rng, workers, liar, summary);
        let mut world = Self {
            cluster,
            jobs: None,
            fates,
            queue: BTreeMap::new(),
            next_seq: 0,
            now: 0,
            horizon,
        };
        for w in 0..jobs.workers.len() {
            jobs.claim(w, 0, &mut world).expect("claims");
        }
        for (at, i) in jobs.draw_jobs(0, horizon) {
            world.at(at, Ev::Jobs(JobEv::Submit(i)));
        }
        world.jobs = Some(jobs);
        for i in 0..world.fates.len() {
            let (dies_at, frozen) = (world.fates[i].dies_at, world.fates[i].frozen);
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

    fn run(&mut self) -> Result<(), Violation> {
        // Long enough for every job to run out of candidates at the slowest tier's lease.
        let limit = self.horizon + 10 * 60_000;
        while let Some(((t, _), ev)) = self.queue.pop_first() {
            if t > limit {
                break;
            }
            self.now = t;
            let mut jobs = self.jobs.take().expect("jobs are home between steps");
            jobs.summary.events += 1;
            let r = self.step(ev, &mut jobs);
            self.jobs = Some(jobs);
            r?;
        }
        Ok(())
    }

    fn step(&mut self, ev: Ev, jobs: &mut SealedJobs) -> Result<(), Violation> {
        let now = self.now;
        match ev {
            Ev::Jobs(ev) => jobs.step(ev, self)?,
            Ev::Tick => {
                let out = self.desk(SealedInput::Tick {
                    now: UnixMillis(now),
                });
                jobs.apply(out, self)?;
                let fates = &self.fates;
                jobs.check_handover(
                    now,
                    |w, _| fates[w].stopped_at(now),
                    NODE_LEASE_MS + TICK_MS,
                    &format!("node lease {NODE_LEASE_MS} ms"),
                )?;
                if !jobs.all_ended() || now < self.horizon {
                    self.at(now + TICK_MS, Ev::Tick);
                }
            }
            Ev::NodeLeft(w) => {
                let fate = &mut self.fates[w];
                fate.left = true;
                fate.session += 1;
                let node = jobs.workers[w].node;
                let out = self.desk(SealedInput::NodeLeft {
                    node,
                    now: UnixMillis(now),
                });
                jobs.apply(out, self)?;
            }
            Ev::Reclaim(w) => {
                jobs.claim(w, self.fates[w].session, self)?;
                self.fates[w].left = false;
            }
        }
        Ok(())
    }
}

impl JobsHost for SealedWorld {
    fn now_ms(&self) -> u64 {
        self.now
    }

    fn schedule(&mut self, at: u64, ev: JobEv) {
        self.at(at, Ev::Jobs(ev));
    }

    fn cluster(&mut self) -> &mut Cluster {
        &mut self.cluster
    }

    fn desk(&mut self, input: SealedInput) -> Vec<SealedOutput> {
        desk_step(&mut self.cluster, Duration::from_millis(self.now), input)
    }

    /// A frozen worker takes the event up when it thaws, a dead one or one whose session
    /// ended never does.
    fn running(&self, w: usize, session: u64) -> Running {
        let fate = &self.fates[w];
        if fate.session != session || fate.dies_at.is_some_and(|d| d <= self.now) {
            return Running::No;
        }
        match fate.frozen.filter(|(a, b)| (*a..*b).contains(&self.now)) {
            Some((_, thaw)) => Running::Thaws(thaw),
            None => Running::Yes,
        }
    }

    fn session(&self, w: usize) -> Option<u64> {
        Some(self.fates[w].session)
    }

    fn left(&self, w: usize) -> bool {
        self.fates[w].left
    }

    fn extra_delay_ms(&self, _: usize) -> u64 {
        0
    }
}
