//! The simulated world: an event queue in virtual time, the coordinator's machines, the
//! simulated nodes, the network between them, and the invariants.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tessera_net::NodeId;
use tessera_proto::{CoordToNode, FinishReason, NodeToCoord};

use super::node::{NodeEffect, SimNode};
use super::{next_token, Rng};
use crate::cluster::{Cluster, ClusterConfig, ClusterInput, ClusterOutput, RunNews};
use crate::membership::{Member, Membership};
use crate::run::{Fault, RunEvent, RunSpec};

mod faults;
mod invariants;
mod network;
mod runs;
mod schedule;

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
    /// Cells the first plan placed (whole copies of the model).
    pub cells: usize,
    /// Epochs replaced by a new split made beside them and released once drained.
    pub drained: usize,
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
    /// The coordinator's next timeout ([`Cluster::poll_timeout`]).
    CoordTimeout {
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
    /// Handed to the coordinator (as run `index + 1`).
    submitted: bool,
    /// The fault-free text.
    reference: Vec<u32>,
    streamed: Vec<u32>,
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
    /// The coordinator: the very type the runtime drives.
    cluster: Cluster,
    /// When the coordinator's next timeout is scheduled.
    coord_wake: Option<Duration>,
    /// Epochs drained by the coordinator's earlier incarnations.
    drained_before: usize,
    /// Incarnation of the coordinator (a restart makes earlier timers stale).
    coord_life: u64,
    stages: usize,
    /// Whole copies of the model the first plan asks for (each a ring of `stages`).
    cells: usize,
    runs: Vec<SimRun>,
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
        // Several cells in about half the schedules where the nodes allow it.
        let most = n_nodes / stages;
        let cells = if most >= 2 && rng.range(0, 2) == 1 {
            rng.range(2, most as u64 + 1) as usize
        } else {
            1
        };
        let cluster = new_cluster(&cfg, None);
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
            cluster,
            coord_wake: None,
            drained_before: 0,
            coord_life: 0,
            stages,
            cells,
            runs: Vec::new(),
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
            Ev::CoordTimeout { life } => {
                if life != self.coord_life {
                    return Ok(());
                }
                if self.coord_wake.is_some_and(|t| t <= self.now) {
                    self.coord_wake = None;
                }
                self.coord(ClusterInput::Timeout)
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
            Ev::Submit { run } => self.submit(run),
        }
    }
}

/// A coordinator for the simulated model, continuing epoch numbers after `last`.
fn new_cluster(cfg: &Config, last: Option<u64>) -> Cluster {
    let mut membership = Membership::new();
    if let Some(last) = last {
        membership.continue_epochs_after(last);
    }
    let config = ClusterConfig {
        model: tessera_host::ContentHash([7; 32]),
        n_layer: N_LAYER,
        kv_shape: tessera_model::kv::KvShape {
            n_head_kv: 1,
            k_head_dim: 1,
            v_head_dim: 1,
            shared_v: false,
        },
        max_context: 256,
        initial_split: None,
    };
    let mut cluster = Cluster::new(config, membership, cfg.lease);
    cluster.inject_fault(cfg.fault);
    cluster
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
