//! The simulated world: an event queue in virtual time, the coordinator's machines, the
//! simulated nodes, the network between them, and the invariants.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tessera_net::NodeId;
use tessera_proto::{CoordToNode, FinishReason, NodeToCoord};

use super::node::{NodeEffect, SimNode};
use super::{next_token, Rng};
use crate::membership::{Action, Event, Member, Membership, Phase};
use crate::run::{Fault, Input, Output, Placement, RunEvent, RunMachine, RunSpec, Timer};

const VOCAB: u32 = 48;
/// The stand-in model's end-of-generation token.
const EOG: u32 = 0;
const N_LAYER: usize = 6;

/// What a schedule may contain.
#[derive(Clone, Debug)]
pub struct Config {
    pub lease: Duration,
    /// Faults happen before this; afterwards everything heals and the world settles.
    pub fault_horizon: Duration,
    /// Stop waiting for requests to end after this (a request still open then is a violation).
    pub time_limit: Duration,
    /// A deliberate bug in every run machine (to show the invariants catch it).
    pub fault: Option<Fault>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            lease: Duration::from_millis(1000),
            fault_horizon: Duration::from_secs(20),
            time_limit: Duration::from_secs(1800),
            fault: None,
        }
    }
}

/// An invariant that broke, with the seed and virtual time to replay it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub seed: u64,
    pub at: Duration,
    pub what: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seed {} at {:?}: {} (replay: TESSERA_SIM_SEED={} cargo test -p tessera-coord sim::)",
            self.seed, self.at, self.what, self.seed
        )
    }
}

/// What one schedule did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub requests: usize,
    /// Ended with exactly the fault-free text.
    pub completed: usize,
    /// Ended with an explicit error.
    pub errors: usize,
    pub faults: usize,
    /// Times a request paused on a lost epoch and resumed on another.
    pub resumes: usize,
    pub epochs: u64,
    pub events: u64,
    /// Messages a hostile member sent that it had no right to send.
    pub forged: usize,
}

#[derive(Debug)]
enum Ev {
    /// A message on a control session, node → coordinator.
    ToCoord {
        node: usize,
        conn: u64,
        msg: NodeToCoord,
    },
    /// A message on a control session, coordinator → node.
    ToNode {
        node: usize,
        conn: u64,
        msg: CoordToNode,
    },
    /// The coordinator closed session `conn`; the node learns it.
    Closed {
        node: usize,
        conn: u64,
    },
    Beat {
        node: usize,
        life: u64,
    },
    LoadDone {
        node: usize,
        life: u64,
        epoch: u64,
    },
    /// The ring computes the next token of `seq` (the node is the sampler).
    RingStep {
        node: usize,
        life: u64,
        seq: u64,
    },
    Reconnect {
        node: usize,
        life: u64,
    },
    CoordTick {
        life: u64,
    },
    RunTimer {
        run: usize,
        timer: Timer,
        life: u64,
    },
    Submit {
        run: usize,
    },
    Fault(FaultKind),
}

#[derive(Clone, Copy, Debug)]
enum FaultKind {
    Kill(usize),
    Restart(usize),
    Freeze(usize, Duration),
    Partition(usize, Duration),
    SlowLinks(Duration),
    CoordinatorRestart,
    Join(usize),
    /// An enrolled node turns hostile for a moment: it sends tokens and finishes for runs
    /// it does not sample, and load and link failures for epochs it is not a stage of.
    Forge(usize),
}

struct SimRun {
    spec: RunSpec,
    machine: Option<RunMachine>,
    /// The fault-free text.
    reference: Vec<u32>,
    streamed: Vec<u32>,
    /// Waiting for a ready epoch other than this one (`Some(None)`: any).
    awaiting: Option<Option<u64>>,
    /// The epoch of the attempt in flight.
    epoch: Option<u64>,
    ended: Option<Result<(), String>>,
}

struct World {
    seed: u64,
    cfg: Config,
    rng: Rng,
    now: Duration,
    queue: BTreeMap<(Duration, u64), Ev>,
    counter: u64,
    nodes: Vec<SimNode>,
    /// The coordinator's current session with each node.
    coord_conn: Vec<Option<u64>>,
    next_conn: u64,
    /// Per-direction delivery horizon, so each control stream stays in order.
    stream_clock: BTreeMap<(usize, bool), Duration>,
    extra_latency: Duration,
    membership: Membership,
    /// Incarnation of the coordinator (a restart makes earlier timers stale).
    coord_life: u64,
    stages: usize,
    runs: Vec<SimRun>,
    /// Stage-side id → run.
    routes: BTreeMap<u64, usize>,
    next_seq: u64,
    /// Epochs the coordinator gave each node (Assign sent).
    given: BTreeSet<(NodeId, u64)>,
    highest_epoch: u64,
    summary: Summary,
}

/// Runs the schedule drawn from `seed`.
pub fn simulate(seed: u64, cfg: Config) -> Result<Summary, Violation> {
    let mut w = World::new(seed, cfg);
    w.draw_schedule();
    w.run()?;
    w.finish()?;
    Ok(w.summary)
}

impl World {
    fn new(seed: u64, cfg: Config) -> Self {
        let mut rng = Rng::new(seed);
        let n_nodes = rng.range(1, 5) as usize;
        let stages = rng.range(1, n_nodes as u64 + 1) as usize;
        let mut membership = Membership::new();
        membership.set_lease(cfg.lease);
        Self {
            seed,
            rng,
            now: Duration::ZERO,
            queue: BTreeMap::new(),
            counter: 0,
            nodes: (0..n_nodes).map(SimNode::new).collect(),
            coord_conn: vec![None; n_nodes],
            next_conn: 0,
            stream_clock: BTreeMap::new(),
            extra_latency: Duration::ZERO,
            membership,
            coord_life: 0,
            stages,
            runs: Vec::new(),
            routes: BTreeMap::new(),
            next_seq: 1,
            given: BTreeSet::new(),
            highest_epoch: 0,
            summary: Summary::default(),
            cfg,
        }
    }

    fn at(&mut self, t: Duration, ev: Ev) {
        self.counter += 1;
        self.queue.insert((t, self.counter), ev);
    }

    fn after(&mut self, d: Duration, ev: Ev) {
        self.at(self.now + d, ev);
    }

    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_micros(self.rng.range(lo * 1000, hi * 1000))
    }

    fn violation(&self, what: String) -> Violation {
        Violation {
            seed: self.seed,
            at: self.now,
            what,
        }
    }

    // ---- the schedule --------------------------------------------------------------------

    fn draw_schedule(&mut self) {
        let n = self.nodes.len();
        // Most nodes start at once; some join late.
        for i in 0..n {
            let t = if i > 0 && self.rng.chance(20) {
                self.ms(500, 15_000)
            } else {
                self.ms(0, 50)
            };
            self.at(t, Ev::Fault(FaultKind::Join(i)));
        }
        self.at(self.cfg.lease / 4, Ev::CoordTick { life: 0 });
        let requests = self.rng.range(1, 6) as usize;
        for r in 0..requests {
            let prompt: Vec<u32> = (0..self.rng.range(1, 8))
                .map(|_| self.rng.range(1, u64::from(VOCAB)) as u32)
                .collect();
            let max_new = self.rng.range(1, 24) as usize;
            let sampling = tessera_sampling::SamplingParams {
                seed: self.rng.next_u64(),
                ..Default::default()
            };
            let eog = if self.rng.chance(50) {
                vec![EOG]
            } else {
                vec![]
            };
            let spec = RunSpec::new(prompt, VOCAB as usize, sampling, max_new, eog)
                .expect("drawn requests are valid");
            let reference = reference(&spec);
            self.runs.push(SimRun {
                spec,
                machine: None,
                reference,
                streamed: Vec::new(),
                awaiting: None,
                epoch: None,
                ended: None,
            });
            let t = self.ms(100, 12_000);
            self.at(t, Ev::Submit { run: r });
        }
        self.summary.requests = requests;
        let faults = self.rng.range(0, 5);
        for _ in 0..faults {
            let t = self.ms(200, self.cfg.fault_horizon.as_millis() as u64);
            let node = self.rng.range(0, n as u64) as usize;
            let lease_ms = self.cfg.lease.as_millis() as u64;
            let kind = match self.rng.range(0, 7) {
                0 => FaultKind::Kill(node),
                1 => FaultKind::Freeze(node, self.ms(lease_ms / 4, lease_ms * 3)),
                2 => FaultKind::Partition(node, self.ms(lease_ms / 4, lease_ms * 4)),
                3 => FaultKind::SlowLinks(self.ms(5, 80)),
                4 => FaultKind::CoordinatorRestart,
                5 => FaultKind::Forge(node),
                _ => FaultKind::Freeze(node, self.ms(10, lease_ms / 2)),
            };
            self.at(t, Ev::Fault(kind));
            if let FaultKind::Kill(node) = kind {
                let back = t + self.ms(100, 8_000);
                self.at(back, Ev::Fault(FaultKind::Restart(node)));
            }
        }
        self.summary.faults = faults as usize;
    }

    // ---- the loop ------------------------------------------------------------------------

    fn run(&mut self) -> Result<(), Violation> {
        while let Some(((t, _), ev)) = self.queue.pop_first() {
            self.now = t;
            self.summary.events += 1;
            self.step(ev)?;
            self.check()?;
            let settled = self.now > self.cfg.fault_horizon + self.cfg.lease * 4;
            if settled && self.runs.iter().all(|r| r.ended.is_some()) {
                break;
            }
            if self.now > self.cfg.time_limit {
                return Err(self.violation("requests still open at the time limit".into()));
            }
        }
        Ok(())
    }

    fn step(&mut self, ev: Ev) -> Result<(), Violation> {
        match ev {
            Ev::Fault(f) => self.fault(f),
            Ev::Reconnect { node, life } => {
                if self.nodes[node].incarnation == life {
                    self.connect(node);
                }
                Ok(())
            }
            Ev::Beat { node, life } => {
                let n = &self.nodes[node];
                if !n.alive || n.incarnation != life {
                    return Ok(());
                }
                if let Some(until) = n.frozen_until.filter(|t| *t > self.now) {
                    self.at(until, Ev::Beat { node, life });
                    return Ok(());
                }
                self.node_send(node, NodeToCoord::Heartbeat { expert_cache: None });
                self.after(self.cfg.lease / 4, Ev::Beat { node, life });
                Ok(())
            }
            Ev::CoordTick { life } => {
                if life != self.coord_life {
                    return Ok(());
                }
                self.membership_event(Event::Tick { now: self.now })?;
                self.after(self.cfg.lease / 4, Ev::CoordTick { life });
                Ok(())
            }
            Ev::ToNode { node, conn, msg } => self.node_receives(node, conn, msg),
            Ev::ToCoord { node, conn, msg } => self.coord_receives(node, conn, msg),
            Ev::Closed { node, conn } => {
                let n = &mut self.nodes[node];
                if n.alive && n.conn == Some(conn) {
                    if let Some(until) = n.frozen_until.filter(|t| *t > self.now) {
                        self.at(until, Ev::Closed { node, conn });
                        return Ok(());
                    }
                    n.drop_state();
                    let (life, backoff) = (n.incarnation, self.ms(50, 500));
                    self.after(backoff, Ev::Reconnect { node, life });
                }
                Ok(())
            }
            Ev::LoadDone { node, life, epoch } => {
                let n = &self.nodes[node];
                if !n.alive || n.incarnation != life {
                    return Ok(());
                }
                if let Some(until) = n.frozen_until.filter(|t| *t > self.now) {
                    self.at(until, Ev::LoadDone { node, life, epoch });
                    return Ok(());
                }
                if let Some(m) = n.loaded(epoch) {
                    self.node_send(node, m);
                }
                Ok(())
            }
            Ev::RingStep { node, life, seq } => self.ring_step(node, life, seq),
            Ev::RunTimer { run, timer, life } => {
                if life == self.coord_life {
                    self.run_input(run, Input::Timer(timer))?;
                }
                Ok(())
            }
            Ev::Submit { run } => self.submit(run),
        }
    }

    fn fault(&mut self, f: FaultKind) -> Result<(), Violation> {
        match f {
            FaultKind::Join(i) => {
                self.nodes[i].enrolled = true;
                self.connect(i);
            }
            FaultKind::Kill(i) => {
                let n = &mut self.nodes[i];
                n.alive = false;
                n.incarnation += 1;
                n.drop_state();
            }
            FaultKind::Restart(i) => {
                let n = &mut self.nodes[i];
                if !n.alive {
                    n.alive = true;
                    n.incarnation += 1;
                    n.frozen_until = None;
                    if n.enrolled {
                        self.connect(i);
                    }
                }
            }
            FaultKind::Freeze(i, d) => self.nodes[i].frozen_until = Some(self.now + d),
            FaultKind::Partition(i, d) => self.nodes[i].partitioned_until = Some(self.now + d),
            FaultKind::SlowLinks(d) => self.extra_latency = d,
            FaultKind::CoordinatorRestart => self.restart_coordinator()?,
            FaultKind::Forge(i) => self.forge(i)?,
        }
        Ok(())
    }

    /// The coordinator process restarts: its runs end with an error (their clients' sessions
    /// drop), every node session closes, and epoch numbers continue from the store.
    fn restart_coordinator(&mut self) -> Result<(), Violation> {
        self.coord_life += 1;
        for r in self.runs.iter_mut().filter(|r| r.machine.is_some()) {
            if r.ended.is_none() {
                r.ended = Some(Err("the coordinator restarted".into()));
                self.summary.errors += 1;
            }
            r.machine = None;
            r.awaiting = None;
            r.epoch = None;
        }
        self.routes.clear();
        let last = self.membership.last_epoch_id();
        self.membership = Membership::new();
        self.membership.set_lease(self.cfg.lease);
        self.membership.continue_epochs_after(last);
        for i in 0..self.nodes.len() {
            if let Some(conn) = self.coord_conn[i].take() {
                let d = self.latency(i);
                self.after(d, Ev::Closed { node: i, conn });
            }
        }
        let life = self.coord_life;
        self.after(self.cfg.lease / 4, Ev::CoordTick { life });
        Ok(())
    }

    /// What a hostile member may try; every one of these must be refused by the machines
    /// (the invariants then show each victim's text unchanged and the service going on).
    fn forge(&mut self, node: usize) -> Result<(), Violation> {
        let Some(conn) = self.coord_conn[node] else {
            return Ok(());
        };
        let id = self.nodes[node].id;
        let epoch = self.membership.epoch().map(|e| {
            let sampler = e.stages.iter().rev().find(|s| !s.layers.is_empty());
            (
                e.id,
                e.stages.iter().any(|s| s.node_id == id),
                sampler.map(|s| s.node_id),
            )
        });
        let mut forged = Vec::new();
        if let Some((epoch, false, _)) = epoch {
            forged.push(NodeToCoord::LoadFailed {
                epoch,
                reason: "forged".into(),
            });
            forged.push(NodeToCoord::LinkFailed {
                epoch,
                reason: "forged".into(),
                peer: None,
            });
        }
        let samples = epoch.is_some_and(|(_, _, sampler)| sampler == Some(id));
        if !samples {
            for run in &self.runs {
                if let Some(seq) = run.machine.as_ref().and_then(|m| m.attempt_seq()) {
                    let pos = run.spec.prompt.len() + run.streamed.len();
                    forged.push(NodeToCoord::Token {
                        seq,
                        pos,
                        token: VOCAB - 1,
                        logprobs: None,
                    });
                    forged.push(NodeToCoord::Finished {
                        seq,
                        reason: FinishReason::Length,
                        generated: 1,
                        error: None,
                    });
                }
            }
        }
        self.summary.forged += forged.len();
        for msg in forged {
            self.coord_receives(node, conn, msg)?;
        }
        Ok(())
    }

    // ---- the network ---------------------------------------------------------------------

    fn latency(&mut self, node: usize) -> Duration {
        let base = self.ms(0, 3) + self.extra_latency;
        match self.nodes[node].partitioned_until {
            Some(t) if t > self.now => (t - self.now) + base,
            _ => base,
        }
    }

    /// When a message sent now on `node`'s stream in direction `up` arrives (in order).
    fn arrival(&mut self, node: usize, up: bool) -> Duration {
        let t = self.now + self.latency(node);
        let clock = self.stream_clock.entry((node, up)).or_default();
        *clock = (*clock).max(t);
        *clock
    }

    fn node_send(&mut self, node: usize, msg: NodeToCoord) {
        let Some(conn) = self.nodes[node].conn else {
            return;
        };
        let t = self.arrival(node, true);
        self.at(t, Ev::ToCoord { node, conn, msg });
    }

    /// The coordinator sends on its session with `node`; false if it has none.
    fn coord_send(&mut self, node: usize, msg: CoordToNode) -> bool {
        let Some(conn) = self.coord_conn[node] else {
            return false;
        };
        if let CoordToNode::Assign(a) = &msg {
            self.given.insert((self.nodes[node].id, a.epoch));
        }
        let t = self.arrival(node, false);
        self.at(t, Ev::ToNode { node, conn, msg });
        true
    }

    fn index(&self, id: NodeId) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == id)
    }

    fn connect(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        if !n.alive || n.conn.is_some() {
            return;
        }
        self.next_conn += 1;
        let conn = self.next_conn;
        n.conn = Some(conn);
        let life = n.incarnation;
        self.node_send(
            node,
            NodeToCoord::Listening {
                addr: "127.0.0.1:1".parse().expect("an address"),
                advertised: false,
            },
        );
        self.after(self.cfg.lease / 4, Ev::Beat { node, life });
    }

    // ---- the node side -------------------------------------------------------------------

    fn node_receives(&mut self, node: usize, conn: u64, msg: CoordToNode) -> Result<(), Violation> {
        let n = &self.nodes[node];
        if !n.alive || n.conn != Some(conn) {
            return Ok(());
        }
        if let Some(until) = n.frozen_until.filter(|t| *t > self.now) {
            self.at(until, Ev::ToNode { node, conn, msg });
            return Ok(());
        }
        let life = n.incarnation;
        for effect in self.nodes[node].handle(msg) {
            match effect {
                NodeEffect::Reply(m) => self.node_send(node, m),
                NodeEffect::LoadLater(epoch) => {
                    let d = self.ms(1, 200);
                    self.after(d, Ev::LoadDone { node, life, epoch });
                }
                NodeEffect::RingStart(seq) => {
                    // The hidden state goes round the ring to the sampler.
                    if let Some(sampler) = self.sampler_of(node, seq) {
                        let life = self.nodes[sampler].incarnation;
                        let d = self.ms(1, 20);
                        self.after(
                            d,
                            Ev::RingStep {
                                node: sampler,
                                life,
                                seq,
                            },
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// The node that samples `seq` in the epoch `node` holds it under.
    fn sampler_of(&self, node: usize, seq: u64) -> Option<usize> {
        let epoch = self.nodes[node].seqs.get(&seq)?.epoch;
        self.nodes.iter().position(|n| {
            n.holding
                .as_ref()
                .is_some_and(|h| h.epoch == epoch && h.head)
        })
    }

    /// One lap of the ring for `seq`, computed at its sampler.
    fn ring_step(&mut self, node: usize, life: u64, seq: u64) -> Result<(), Violation> {
        let n = &self.nodes[node];
        if !n.alive || n.incarnation != life {
            return Ok(());
        }
        let Some(s) = n.seqs.get(&seq) else {
            return Ok(());
        };
        let epoch = s.epoch;
        // Every stage of the epoch must be up and reachable for the lap to complete.
        let ring: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i]
                    .holding
                    .as_ref()
                    .is_some_and(|h| h.epoch == epoch)
            })
            .collect();
        let stalled = ring
            .iter()
            .chain([&node])
            .filter_map(|&i| self.nodes[i].frozen_until.filter(|t| *t > self.now))
            .max();
        if let Some(until) = stalled {
            self.at(until, Ev::RingStep { node, life, seq });
            return Ok(());
        }
        let broken = ring.iter().any(|&i| {
            self.nodes[i].partitioned(self.now) || !self.nodes[i].seqs.contains_key(&seq)
        }) || ring.len() < self.stage_count_of(epoch);
        if broken {
            // A stage sees its neighbour's stream fail and reports it.
            self.node_send(
                node,
                NodeToCoord::Finished {
                    seq,
                    reason: FinishReason::Error,
                    generated: 0,
                    error: Some("the ring is broken".into()),
                },
            );
            return Ok(());
        }
        let s = self.nodes[node].seqs.get_mut(&seq).expect("checked above");
        let token = next_token(s.seed, &s.history, VOCAB);
        let pos = s.history.len();
        let generated = pos - s.prompt_len;
        if s.eog.contains(&token) {
            let end = NodeToCoord::Finished {
                seq,
                reason: FinishReason::EndOfGeneration,
                generated,
                error: None,
            };
            self.node_send(node, end);
            return Ok(());
        }
        s.history.push(token);
        s.remaining = s.remaining.saturating_sub(1);
        let remaining = s.remaining;
        self.node_send(
            node,
            NodeToCoord::Token {
                seq,
                pos,
                token,
                logprobs: None,
            },
        );
        if remaining == 0 {
            let end = NodeToCoord::Finished {
                seq,
                reason: FinishReason::Length,
                generated: generated + 1,
                error: None,
            };
            self.node_send(node, end);
        } else {
            let d = self.ms(10, 150);
            self.after(d, Ev::RingStep { node, life, seq });
        }
        Ok(())
    }

    /// How many stages epoch `epoch` has (from the membership, when it is the current one).
    fn stage_count_of(&self, epoch: u64) -> usize {
        self.membership
            .epoch()
            .filter(|e| e.id == epoch)
            .map_or(0, |e| e.stages.len())
    }

    // ---- the coordinator side ------------------------------------------------------------

    fn coord_receives(
        &mut self,
        node: usize,
        conn: u64,
        msg: NodeToCoord,
    ) -> Result<(), Violation> {
        let id = self.nodes[node].id;
        if let NodeToCoord::Listening { addr, .. } = msg {
            // A new session: the hello, as the server takes it.
            if let Some(old) = self.coord_conn[node].replace(conn) {
                if old != conn {
                    let d = self.latency(node);
                    self.after(d, Ev::Closed { node, conn: old });
                }
            }
            let member = Member {
                node_id: id,
                key: tessera_net::NodeIdentity::from_seed([node as u8 + 1; 32]).public_key(),
                name: self.nodes[node].name.clone(),
                addr,
                connected: true,
                joined: 0,
                memory_budget_bytes: None,
                inventory: None,
                models: vec![],
                link: None,
                session: conn,
            };
            self.membership_event(Event::Joined(Box::new(member)))?;
            return self.maybe_plan();
        }
        if self.coord_conn[node] != Some(conn) {
            return Ok(()); // that session is closed
        }
        self.membership_event(Event::Heard {
            node: id,
            session: conn,
            now: self.now,
        })?;
        let seq = match &msg {
            NodeToCoord::Loaded { epoch, report } => {
                return self.membership_event(Event::Loaded {
                    node: id,
                    epoch: *epoch,
                    report: report.clone(),
                })
            }
            NodeToCoord::LoadFailed { epoch, reason } => {
                return self.membership_event(Event::LoadFailed {
                    node: id,
                    epoch: *epoch,
                    reason: reason.clone(),
                })
            }
            NodeToCoord::Linked { epoch, link } => {
                return self.membership_event(Event::Linked {
                    node: id,
                    epoch: *epoch,
                    link: *link,
                })
            }
            NodeToCoord::LinkFailed {
                epoch,
                reason,
                peer,
            } => {
                return self.membership_event(Event::LinkFailed {
                    node: id,
                    epoch: *epoch,
                    reason: reason.clone(),
                    peer: *peer,
                })
            }
            NodeToCoord::Opened { seq }
            | NodeToCoord::OpenFailed { seq, .. }
            | NodeToCoord::Token { seq, .. }
            | NodeToCoord::Finished { seq, .. }
            | NodeToCoord::Closed { seq, .. } => *seq,
            _ => return Ok(()),
        };
        match self.routes.get(&seq) {
            Some(&run) => self.run_input(run, Input::Node { from: id, msg }),
            None => Ok(()),
        }
    }

    /// The first plan: the configured stage count over the connected nodes, once enough
    /// have joined (later plans are the membership's own re-planning).
    fn maybe_plan(&mut self) -> Result<(), Violation> {
        if self.membership.auto_plan().is_some() || self.membership.epoch().is_some() {
            return Ok(());
        }
        let connected: Vec<NodeId> = self
            .membership
            .connected()
            .iter()
            .map(|m| m.node_id)
            .collect();
        let alive = self.nodes.iter().filter(|n| n.alive && n.enrolled).count();
        if connected.len() < self.stages.min(alive.max(1)) {
            return Ok(());
        }
        let k = self.stages.min(connected.len());
        let stages = connected
            .into_iter()
            .zip(crate::replan::even_ranges(N_LAYER, k))
            .collect();
        self.membership_event(Event::Plan {
            model: tessera_host::ContentHash([7; 32]),
            stages,
            n_layer: N_LAYER,
            max_context: 256,
        })
    }

    fn membership_event(&mut self, event: Event) -> Result<(), Violation> {
        let actions = self.membership.handle(event);
        for a in actions {
            match a {
                Action::Send { to, msg } => {
                    if let Some(i) = self.index(to) {
                        self.coord_send(i, msg.0);
                    }
                }
                Action::LeaseExpired { node, session } => {
                    if let Some(i) = self.index(node) {
                        if self.coord_conn[i] == Some(session) {
                            self.coord_conn[i] = None;
                            let d = self.latency(i);
                            self.after(
                                d,
                                Ev::Closed {
                                    node: i,
                                    conn: session,
                                },
                            );
                        }
                    }
                }
                Action::EpochReady(_)
                | Action::EpochFailed { .. }
                | Action::Note(_)
                | Action::Refused { .. } => {}
            }
        }
        self.epochs_changed()
    }

    /// Tells runs about the epoch as it now is: lost under them, or ready for those waiting.
    fn epochs_changed(&mut self) -> Result<(), Violation> {
        let current = self.membership.epoch().map(|e| (e.id, e.phase.clone()));
        if let Some((id, _)) = &current {
            if *id < self.highest_epoch {
                return Err(self.violation(format!(
                    "epoch went backwards: {id} after {}",
                    self.highest_epoch
                )));
            }
            self.highest_epoch = *id;
            self.summary.epochs = self.summary.epochs.max(*id);
        }
        let ready = match &current {
            Some((id, Phase::Ready)) => Some(*id),
            _ => None,
        };
        for run in 0..self.runs.len() {
            if let Some(e) = self.runs[run].epoch {
                if ready != Some(e) {
                    self.runs[run].epoch = None;
                    let why = format!("epoch {e} was lost");
                    self.run_input(run, Input::EpochLost { epoch: e, why })?;
                }
            }
        }
        if let Some(id) = ready {
            for run in 0..self.runs.len() {
                match self.runs[run].awaiting {
                    Some(lost) if lost != Some(id) => {
                        self.runs[run].awaiting = None;
                        let placement =
                            Placement::of(&self.membership, id).expect("the ready epoch");
                        let attempt_seq = self.next_seq;
                        self.next_seq += 1;
                        self.routes.insert(attempt_seq, run);
                        self.runs[run].epoch = Some(id);
                        self.run_input(
                            run,
                            Input::EpochReady {
                                placement,
                                attempt_seq,
                            },
                        )?;
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn submit(&mut self, run: usize) -> Result<(), Violation> {
        let mut spec = self.runs[run].spec.clone();
        spec.prefill_chunk = 4;
        let (mut machine, out) = RunMachine::new(spec, self.cfg.lease);
        if let Some(f) = self.cfg.fault {
            machine.inject_fault(f);
        }
        self.runs[run].machine = Some(machine);
        self.outputs(run, out)
    }

    fn run_input(&mut self, run: usize, input: Input) -> Result<(), Violation> {
        let Some(m) = self.runs[run].machine.as_mut() else {
            return Ok(());
        };
        let out = m.handle(self.now, input);
        self.outputs(run, out)
    }

    /// Carries out a run machine's outputs, as the driver does.
    fn outputs(&mut self, run: usize, out: Vec<Output>) -> Result<(), Violation> {
        let mut follow = Vec::new();
        for o in out {
            match o {
                Output::Send { to, msg } => {
                    let Some(i) = self.index(to) else { continue };
                    if let CoordToNode::Open(open) = &msg.0 {
                        if !self.given.contains(&(to, open.epoch)) {
                            return Err(self.violation(format!(
                                "opened a sequence on {} for epoch {}, which it was not given",
                                self.nodes[i].name, open.epoch
                            )));
                        }
                    }
                    if !self.coord_send(i, msg.0) {
                        follow.push(Input::Undeliverable { to });
                    }
                }
                Output::AwaitEpoch { lost } => {
                    if lost.is_some() {
                        self.summary.resumes += 1;
                    }
                    self.runs[run].awaiting = Some(lost);
                    self.runs[run].epoch = None;
                }
                Output::ArmTimer { timer, after } => {
                    let life = self.coord_life;
                    self.after(after, Ev::RunTimer { run, timer, life });
                }
                Output::Event(RunEvent::Token { pos, token, .. }) => {
                    let r = &mut self.runs[run];
                    let i = r.streamed.len();
                    let want = r.reference.get(i).copied();
                    let at = r.spec.prompt.len() + i;
                    if want != Some(token) || pos != at {
                        let what = format!(
                            "request {run} streamed token {token} at position {pos}; the \
                             fault-free run has {want:?} at {at}"
                        );
                        return Err(self.violation(what));
                    }
                    r.streamed.push(token);
                }
                Output::Event(_) | Output::Refused { .. } => {}
                Output::Done(outcome) => {
                    let r = &mut self.runs[run];
                    r.awaiting = None;
                    r.epoch = None;
                    match outcome.reason {
                        FinishReason::Error => {
                            if outcome.error.as_deref().is_none_or(str::is_empty) {
                                return Err(self.violation(format!(
                                    "request {run} failed without saying why"
                                )));
                            }
                            r.ended = Some(Err(outcome.error.unwrap_or_default()));
                            self.summary.errors += 1;
                        }
                        FinishReason::Cancelled => {
                            return Err(self.violation(format!(
                                "request {run} was cancelled, and nobody cancelled it"
                            )));
                        }
                        FinishReason::Length | FinishReason::EndOfGeneration => {
                            if r.streamed != r.reference || outcome.generated != r.reference {
                                let what = format!(
                                    "request {run} ended ({:?}) with {:?}; the fault-free run \
                                     gives {:?}",
                                    outcome.reason, outcome.generated, r.reference
                                );
                                return Err(self.violation(what));
                            }
                            r.ended = Some(Ok(()));
                            self.summary.completed += 1;
                        }
                    }
                }
            }
        }
        for input in follow {
            self.run_input(run, input)?;
        }
        // A run asking for an epoch may find one ready now.
        if self.runs[run].awaiting.is_some() {
            self.epochs_changed()?;
        }
        Ok(())
    }

    // ---- invariants ----------------------------------------------------------------------

    fn check(&self) -> Result<(), Violation> {
        for (i, r) in self.runs.iter().enumerate() {
            if r.streamed.len() > r.reference.len() {
                return Err(self.violation(format!("request {i} streamed too many tokens")));
            }
        }
        Ok(())
    }

    /// After the world settled: nothing open, nobody lost, nothing held.
    fn finish(&mut self) -> Result<(), Violation> {
        // Let sessions settle for a few leases with no faults.
        let until = self.now + self.cfg.lease * 4;
        while let Some((&(t, _), _)) = self.queue.first_key_value() {
            if t > until {
                break;
            }
            let ((t, _), ev) = self.queue.pop_first().expect("peeked");
            self.now = t;
            self.step(ev)?;
        }
        if let Some(i) = self.runs.iter().position(|r| r.ended.is_none()) {
            return Err(self.violation(format!("request {i} never ended")));
        }
        for n in self.nodes.iter().filter(|n| n.alive && n.enrolled) {
            let member = self.membership.member(&n.id);
            if !member.is_some_and(|m| m.connected) {
                return Err(self.violation(format!(
                    "{} is up and enrolled but not a connected member",
                    n.name
                )));
            }
            if !n.seqs.is_empty() {
                return Err(self.violation(format!(
                    "{} still holds sequences {:?} after every request ended",
                    n.name,
                    n.seqs.keys().collect::<Vec<_>>()
                )));
            }
        }
        Ok(())
    }
}

/// The fault-free text of a request: the stand-in model run from its prompt.
fn reference(spec: &RunSpec) -> Vec<u32> {
    let mut history = spec.prompt.clone();
    let mut out = Vec::new();
    while out.len() < spec.max_new_tokens {
        let t = next_token(spec.sampling.seed, &history, VOCAB);
        if spec.eog.contains(&t) {
            break;
        }
        history.push(t);
        out.push(t);
    }
    out
}
