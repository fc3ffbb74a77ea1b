//! The simulated world: an event queue in virtual time, the coordinator's machines, the
//! simulated nodes, the network between them, and the invariants.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tessera_net::NodeId;
use tessera_proto::{CoordToNode, FinishReason, NodeToCoord};

use super::node::{identity_seed, NodeEffect, SimNode};
use super::{next_token, Rng};
use crate::assignment::ExpertSplit;
use crate::cluster::{Cluster, ClusterConfig, ClusterInput, ClusterOutput, RunNews};
use crate::membership::{Member, Membership};
use crate::run::{Fault, RunEvent, RunSpec};
use crate::sealed::DeskFault;
use crate::sim::jobs::{JobEv, SealedSummary};
pub use crate::sim::violation::{Invariant, Violation};

mod faults;
mod invariants;
mod jobs;
mod network;
mod runs;
mod schedule;

const VOCAB: u32 = 48;
/// The stand-in model's end-of-generation token.
const EOG: u32 = 0;
const N_LAYER: usize = 6;
/// Experts per MoE layer of the stand-in model, in schedules with an expert split.
const N_EXPERT: usize = 8;

/// The experts a node holds, per layer.
type LayersExperts = Vec<Vec<usize>>;

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
    /// A deliberate bug in the sealed desk of the schedules with sealed jobs.
    pub desk_fault: Option<DeskFault>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            lease: Duration::from_millis(1000),
            fault_horizon: Duration::from_secs(20),
            time_limit: Duration::from_secs(1800),
            fault: None,
            desk_fault: None,
        }
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
    /// Owners of experts in this schedule's expert split (0: no expert split).
    pub expert_owners: usize,
    /// Epochs whose experts were re-placed because an owner had left.
    pub experts_replaced: usize,
    /// The sealed jobs submitted beside the runs (none in most schedules).
    pub sealed: SealedSummary,
    /// Inputs the sealed desk took while a run was in flight in the same cluster.
    pub desk_inputs_beside_runs: usize,
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
    /// Something of the sealed jobs beside the runs.
    Jobs(JobEv),
    /// The sealed desk's clock.
    SealedTick,
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
    /// Epochs each node told the coordinator it linked (`Linked` delivered).
    linked: BTreeSet<(NodeId, u64)>,
    /// The expert split every plan places (`None`: each stage holds its layers' experts).
    experts: Option<ExpertSplit>,
    /// Per epoch, the experts of each layer the coordinator gave each node
    /// ([`CoordToNode::AssignExperts`]), checked once the epoch links.
    experts_given: BTreeMap<u64, Vec<(NodeId, LayersExperts)>>,
    experts_checked: BTreeSet<u64>,
    highest_epoch: u64,
    /// When the coordinator last heard from each node on its current session.
    heard: Vec<Duration>,
    /// The sealed jobs beside the runs, in schedules that have them.
    sealed: Option<jobs::MixedJobs>,
    summary: Summary,
}

/// Runs the schedule drawn from `seed`.
pub fn simulate(seed: u64, cfg: Config) -> Result<Summary, Violation> {
    let mut w = World::new(seed, cfg);
    w.draw_schedule();
    w.draw_sealed_jobs();
    w.run()?;
    w.finish()?;
    w.finish_jobs()?;
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
        let experts = draw_expert_split(seed, n_nodes, cells);
        let cluster = new_cluster(&cfg, None, experts.as_ref());
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
            linked: BTreeSet::new(),
            experts_given: BTreeMap::new(),
            experts_checked: BTreeSet::new(),
            highest_epoch: 0,
            heard: vec![Duration::ZERO; n_nodes],
            sealed: None,
            summary: Summary {
                expert_owners: experts.as_ref().map_or(0, |x| x.groups.len()),
                ..Summary::default()
            },
            experts,
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

    fn violation(&self, broke: Invariant, what: String) -> Violation {
        Violation {
            seed: self.seed,
            at: self.now,
            broke,
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
            let runs_ended = self.runs.iter().all(|r| r.ended.is_some());
            if settled && runs_ended && self.jobs_ended() {
                break;
            }
            if self.now > self.cfg.time_limit {
                let (broke, what) = if runs_ended {
                    (Invariant::EveryJobEnds, "sealed jobs")
                } else {
                    (Invariant::EveryRequestEnds, "requests")
                };
                let what = format!("{what} still open at the time limit");
                return Err(self.violation(broke, what));
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
            Ev::Jobs(ev) => self.with_jobs(|jobs, world| jobs.step(ev, world)),
            Ev::SealedTick => self.sealed_tick(),
        }
    }
}

/// An expert split over every node in about a third of the schedules with one cell and two
/// nodes or more: node `i` owns a contiguous share of the experts, so the nodes the ring does
/// not take hold experts only. Drawn from its own generator, so that the rest of each seed's
/// schedule is what it was before expert splits were simulated.
fn draw_expert_split(seed: u64, n_nodes: usize, cells: usize) -> Option<ExpertSplit> {
    let mut rng = Rng::new(seed ^ 0xE8E8_7A11_0C8E_5EED);
    if cells != 1 || n_nodes < 2 || !rng.chance(35) {
        return None;
    }
    let owners = rng.range(2, n_nodes as u64 + 1) as usize;
    let ranges = crate::replan::even_ranges(N_EXPERT, owners);
    let spec: Vec<String> = ranges
        .iter()
        .enumerate()
        .map(|(i, r)| format!("{}-{}@n{i}", r.start, r.end - 1))
        .collect();
    Some(crate::assignment::parse_experts(&spec.join(",")).expect("a valid split"))
}

/// A coordinator for the simulated model, continuing epoch numbers after `last`, placing
/// `experts` in every plan.
fn new_cluster(cfg: &Config, last: Option<u64>, experts: Option<&ExpertSplit>) -> Cluster {
    let mut membership = Membership::new();
    membership.set_expert_split(experts.cloned());
    if let Some(last) = last {
        membership.continue_epochs_after(last);
    }
    let mut cluster = Cluster::new(sim_model(), membership, cfg.lease);
    cluster.inject_fault(cfg.fault);
    cluster
}

/// A coordinator for the simulated model with no members yet (the sealed-job schedules').
pub(super) fn empty_cluster(lease: std::time::Duration) -> Cluster {
    Cluster::new(sim_model(), Membership::new(), lease)
}

/// The simulated model, as the coordinator knows it.
fn sim_model() -> ClusterConfig {
    ClusterConfig {
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
