//! Sealed jobs beside the runs: in about three schedules in ten, most of the world's nodes are
//! also sealed workers, and a client submits sealed jobs to the same [`Cluster`] while the
//! runs stream. A worker runs when its node does: it dies with it, freezes with it, and loses
//! the work of a session that ends. Its claims reach the desk when its node's session opens;
//! the desk hears it left when the cluster says so (a lease expired), as the runtime's shell
//! tells it. The jobs' invariants are `sim/jobs.rs`'s, checked on every output of the desk.

use super::*;
use crate::sealed::SealedInput;
use crate::sim::jobs::{desk_step, JobEv, JobsHost, Running, SealedJobs, Worker, TICK_MS};
use crate::sim::sealed::sim_desk;

/// Sealed jobs and their workers, in a schedule that has them.
pub(super) struct MixedJobs {
    /// Taken out while they run a step against the world.
    pub jobs: Option<SealedJobs>,
    /// The node each worker is.
    pub node: Vec<usize>,
    /// The desk was told the worker left, and has had no claims from it since.
    pub left: Vec<bool>,
    /// Answers the desk verifies, per thousand (each new desk's setting).
    pub per_mille: u32,
}

/// Whole milliseconds at or after `t`.
fn ceil_ms(t: Duration) -> u64 {
    t.as_micros().div_ceil(1000) as u64
}

impl World {
    /// Draws the sealed jobs of a schedule that has them, from a generator of their own (the
    /// rest of the seed's schedule is what it is without them).
    pub(super) fn draw_sealed_jobs(&mut self) {
        let mut rng = Rng::new(self.seed ^ 0x5EA1_ED00_0B5E_55ED);
        if !rng.chance(30) {
            return;
        }
        let mut nodes: Vec<usize> = (0..self.nodes.len()).filter(|_| rng.chance(75)).collect();
        if nodes.is_empty() {
            nodes.push(0);
        }
        let liar = (rng.range(0, 3) == 0).then(|| rng.range(0, nodes.len() as u64) as usize);
        let mut workers = Vec::with_capacity(nodes.len());
        for &i in &nodes {
            // The node's own key: the desk and the membership know it by the same one.
            let seal = tessera_seal::SecretKey::derive(&rng.next_u64().to_le_bytes());
            workers.push(Worker::draw(&mut rng, identity_seed(i), seal));
        }
        let per_mille = [0, 300, 1000][rng.range(0, 3) as usize];
        let mut jobs = SealedJobs::new(self.seed, rng, workers, liar, Default::default());
        let horizon = self.cfg.fault_horizon.as_millis() as u64;
        for (at, i) in jobs.draw_jobs(100, horizon) {
            self.at(Duration::from_millis(at), Ev::Jobs(JobEv::Submit(i)));
        }
        self.at(Duration::from_millis(TICK_MS), Ev::SealedTick);
        self.sealed = Some(MixedJobs {
            jobs: Some(jobs),
            left: vec![true; nodes.len()],
            node: nodes,
            per_mille,
        });
        let desk = self.new_desk();
        self.cluster.set_sealed_desk(desk);
    }

    /// A fresh coordinator's desk (empty when the schedule has no sealed jobs).
    pub(super) fn new_desk(&self) -> crate::sealed::SealedDesk {
        self.sealed.as_ref().map_or_else(Default::default, |s| {
            sim_desk(self.seed, s.per_mille, self.cfg.desk_fault)
        })
    }

    /// Runs `f` on the sealed jobs, with the world as their host.
    pub(super) fn with_jobs(
        &mut self,
        f: impl FnOnce(&mut SealedJobs, &mut Self) -> Result<(), Violation>,
    ) -> Result<(), Violation> {
        let Some(mut jobs) = self.sealed.as_mut().and_then(|s| s.jobs.take()) else {
            return Ok(());
        };
        jobs.summary.events += 1;
        let r = f(&mut jobs, self);
        if let Some(s) = self.sealed.as_mut() {
            s.jobs = Some(jobs);
        }
        r
    }

    fn worker_at(&self, node: usize) -> Option<usize> {
        self.sealed.as_ref()?.node.iter().position(|&n| n == node)
    }

    /// Node `node` opened session `conn`: a worker claims from it.
    pub(super) fn worker_joined(&mut self, node: usize, conn: u64) -> Result<(), Violation> {
        let Some(w) = self.worker_at(node) else {
            return Ok(());
        };
        self.with_jobs(|jobs, world| jobs.claim(w, conn, world))?;
        if let Some(s) = self.sealed.as_mut() {
            s.left[w] = false;
        }
        Ok(())
    }

    /// The cluster said node `node` left: the desk hears it, as the runtime's shell tells it.
    pub(super) fn worker_left(&mut self, node: usize) -> Result<(), Violation> {
        let Some(w) = self.worker_at(node) else {
            return Ok(());
        };
        if let Some(s) = self.sealed.as_mut() {
            s.left[w] = true;
        }
        self.with_jobs(|jobs, world| {
            let input = SealedInput::NodeLeft {
                node: jobs.workers[w].node,
                now: tessera_seal::UnixMillis(world.now_ms()),
            };
            let out = world.desk(input);
            jobs.apply(out, world)
        })
    }

    /// The desk's clock, and the handover check: a job whose holder's node stopped moves on
    /// once the coordinator's lease of that node runs out (a lease after it was last heard,
    /// found at the next tick of the lease clock), within a tick of the desk's clock.
    pub(super) fn sealed_tick(&mut self) -> Result<(), Violation> {
        let lease = self.cfg.lease;
        let within = (lease + lease / 4).as_millis() as u64 + TICK_MS + 10;
        let what = format!(
            "node lease {} ms, after it was last heard",
            lease.as_millis()
        );
        self.with_jobs(|jobs, world| {
            let now = world.now_ms();
            let out = world.desk(SealedInput::Tick {
                now: tessera_seal::UnixMillis(now),
            });
            jobs.apply(out, world)?;
            let lost = |w: usize, held_since: u64| world.work_lost(w, held_since);
            jobs.check_handover(now, lost, within, &what)?;
            if !jobs.all_ended() || world.now < world.cfg.fault_horizon {
                world.after(Duration::from_millis(TICK_MS), Ev::SealedTick);
            }
            Ok(())
        })
    }

    /// Since when the work worker `w` has held since `held_since` (ms) has been stopped: its
    /// node is dead or frozen now (counted from the last the coordinator heard of it), or was
    /// killed since, whether or not it runs again (a restarted worker has lost it). `None`:
    /// the work goes on.
    fn work_lost(&self, w: usize, held_since: u64) -> Option<u64> {
        let node = self.sealed.as_ref()?.node[w];
        let n = &self.nodes[node];
        let stopped = !n.alive || n.frozen_until.is_some_and(|t| t > self.now);
        if let Some(since) = n.stopped_at.filter(|_| stopped) {
            return Some(ceil_ms(since.max(self.heard[node])));
        }
        n.killed_at
            .map(ceil_ms)
            .filter(|&killed| killed >= held_since)
    }

    /// The coordinator restarted: the jobs in flight are lost with their client's session,
    /// and the new desk knows no worker until its node connects again.
    pub(super) fn jobs_lost_in_restart(&mut self) {
        let desk = self.new_desk();
        self.cluster.set_sealed_desk(desk);
        if let Some(s) = self.sealed.as_mut() {
            s.left.iter_mut().for_each(|l| *l = true);
            if let Some(jobs) = s.jobs.as_mut() {
                jobs.coordinator_restarted();
            }
        }
    }

    /// Every sealed job submitted so far has ended.
    pub(super) fn jobs_ended(&self) -> bool {
        self.sealed
            .as_ref()
            .and_then(|s| s.jobs.as_ref())
            .is_none_or(SealedJobs::all_ended)
    }

    /// At the end: every job ended, and the desk holds none.
    pub(super) fn finish_jobs(&mut self) -> Result<(), Violation> {
        let now = self.now_ms();
        let Some(jobs) = self.sealed.as_mut().and_then(|s| s.jobs.take()) else {
            return Ok(());
        };
        let r = jobs.finish(now, &self.cluster);
        self.summary.sealed = jobs.summary.clone();
        if let Some(s) = self.sealed.as_mut() {
            s.jobs = Some(jobs);
        }
        r
    }
}

impl JobsHost for World {
    fn now_ms(&self) -> u64 {
        self.now.as_millis() as u64
    }

    fn schedule(&mut self, at: u64, ev: JobEv) {
        self.at(Duration::from_millis(at).max(self.now), Ev::Jobs(ev));
    }

    fn cluster(&mut self) -> &mut Cluster {
        &mut self.cluster
    }

    fn desk(&mut self, input: SealedInput) -> Vec<crate::sealed::SealedOutput> {
        if self.cluster.runs() > 0 {
            self.summary.desk_inputs_beside_runs += 1;
        }
        desk_step(&mut self.cluster, self.now, input)
    }

    fn running(&self, w: usize, session: u64) -> Running {
        let Some(node) = self.sealed.as_ref().map(|s| s.node[w]) else {
            return Running::No;
        };
        let n = &self.nodes[node];
        if !n.alive || n.conn != Some(session) {
            return Running::No;
        }
        match n.frozen_until.filter(|t| *t > self.now) {
            Some(t) => Running::Thaws(ceil_ms(t)),
            None => Running::Yes,
        }
    }

    fn session(&self, w: usize) -> Option<u64> {
        self.coord_conn[self.sealed.as_ref()?.node[w]]
    }

    fn left(&self, w: usize) -> bool {
        self.sealed.as_ref().is_none_or(|s| s.left[w])
    }

    fn extra_delay_ms(&self, w: usize) -> u64 {
        let Some(node) = self.sealed.as_ref().map(|s| s.node[w]) else {
            return 0;
        };
        let partition = self.nodes[node]
            .partitioned_until
            .map_or(Duration::ZERO, |t| t.saturating_sub(self.now));
        ceil_ms(partition + self.extra_latency)
    }
}
