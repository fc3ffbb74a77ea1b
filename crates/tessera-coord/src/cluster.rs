//! The coordinator's composition as one synchronous machine: [`Cluster`] owns the
//! [`Membership`] with its leases, the cell book (who is seated where), each node's current
//! control session, one [`RunMachine`] per request with the routes to it, and a timer table.
//!
//! It is driven like quinn-proto's `Connection`: the shell feeds it inputs with the time
//! ([`Cluster::handle`]), carries out the outputs it returns (send to a node, close a session,
//! tell a run's owner, record an epoch), and calls `handle(now, ClusterInput::Timeout)` at
//! [`Cluster::poll_timeout`]. No clock, no channels, no I/O: the coordinator's runtime
//! (`shared.rs`) and the simulator (`sim/`) drive this very type.
//!
//! What it decides that used to live in the shell:
//! - a run's epoch no longer served is pushed to its machine as `EpochLost` when the
//!   membership changes (no polling);
//! - runs waiting for a cell (first placement, or after a loss) are seated as soon as one is
//!   ready or has room;
//! - a draining epoch is released when its last run leaves it;
//! - a node whose lease expired is one output ([`ClusterOutput::LeaseExpired`]) that the shell
//!   turns into both effects at once: the session closed, the sealed desk told;
//! - a node message about a sequence touches only its run: no bookkeeping pass per token.
//!
//! Timers are a table keyed by kind (the lease clock, and each run's five timers and its
//! placement deadline): re-arming one replaces it, so the table holds at most one entry per
//! key, however many tokens a run streams.

use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

use tessera_host::ContentHash;
use tessera_model::kv::KvShape;
use tessera_net::{NodeId, PublicKey};
use tessera_proto::{CoordToNode, ExpertCacheStats, NodeToCoord, StageSpec};

use crate::assignment::{resolve, AssignmentError};
use crate::cells::CellBook;
use crate::membership::{Action, Event, Member, Membership, Phase};
use crate::run::{Fault, Input, Output, RunEvent, RunMachine, RunOutcome, RunSpec, Timer};
use crate::sealed::{SealedDesk, SealedInput, SealedOutput};
use crate::state::{EpochRecord, EpochStageRecord};

/// How long a request may wait for a cell (a new epoch loading, model transfer included, or
/// room on a busy one) before it is refused.
pub const PLACEMENT_TIMEOUT: Duration = Duration::from_secs(600);

/// What the cluster is told.
#[derive(Debug)]
pub enum ClusterInput {
    /// A node opened a control session (`member.session` is the shell's number for it).
    Joined(Box<Member>),
    /// A node's control session `session` ended.
    Left { node: NodeId, session: u64 },
    /// A message on node `node`'s control session `session` (it renews the lease).
    Node {
        node: NodeId,
        session: u64,
        msg: NodeToCoord,
    },
    /// The shell measured the link to a node.
    LinkMeasured {
        node: NodeId,
        link: tessera_net::LinkMeasurement,
    },
    /// Place these stages now (`--split`, a planner's choice): a new epoch.
    Plan { stages: Vec<(NodeId, Range<usize>)> },
    /// A request: run `run` (its id, also its first attempt's stage-side id), reserving
    /// `positions` of KV on its cell; on the cell whose ring is `stages` when given (planned if
    /// no cell is), else on the cell the router chooses.
    Submit {
        run: u64,
        spec: Box<RunSpec>,
        stages: Option<Vec<StageSpec>>,
        positions: u64,
    },
    /// Run `run`'s owner gave up.
    Cancel { run: u64 },
    /// Something for the sealed-job desk (a client's job, a worker's answer, a departure, its
    /// clock).
    Sealed(SealedInput),
    /// The time [`Cluster::poll_timeout`] gave has come.
    Timeout,
}

/// What the shell carries out.
#[derive(Debug)]
pub enum ClusterOutput {
    /// Send on node `to`'s current control session.
    ToNode { to: NodeId, msg: Box<CoordToNode> },
    /// Node `node` was silent for a lease: close its session `session` (it reconnects afresh
    /// if it is still there) and tell the sealed desk it is gone, both now.
    LeaseExpired { node: NodeId, session: u64 },
    /// Node `node` (key `key`) left, or connected again while its earlier session was still
    /// current: the sealed desk moves its jobs on.
    NodeLeft { node: NodeId, key: PublicKey },
    /// News for run `run`'s owner.
    Run { run: u64, news: RunNews },
    /// Record a cell's epoch durably.
    RecordEpoch(Box<EpochRecord>),
    /// A node said something it may not say: count and log it.
    Refused {
        node: NodeId,
        why: crate::authz::Refusal,
    },
    /// What the sealed-job desk decided (dispatch an envelope, tell a client, quarantine).
    Sealed(SealedOutput),
}

/// What a run's owner hears.
#[derive(Debug)]
pub enum RunNews {
    Event(RunEvent),
    /// The run is over: how it ended, or why it never started.
    Ended(Result<Box<RunOutcome>, RunRefused>),
}

/// What the cluster needs to know about the model it serves.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub model: ContentHash,
    pub n_layer: usize,
    /// KV geometry (bytes per position per layer, with the membership's KV type).
    pub kv_shape: KvShape,
    /// Most positions per sequence in the plans made from now on.
    pub max_context: usize,
    /// An assignment applied as soon as enough nodes are connected (`--split`).
    pub initial_split: Option<Vec<StageSpec>>,
}

/// A request, before and after it has a machine.
enum RunState {
    /// Waiting for its first cell: `target` is the epoch placing the stages it asked for.
    Placing {
        spec: Box<RunSpec>,
        target: Option<u64>,
    },
    Running {
        machine: Box<RunMachine>,
        /// Waiting for a ready cell other than `Some(lost)` (`Some(None)`: any).
        awaiting: Option<Option<u64>>,
        /// The epoch its attempt is on.
        on_epoch: Option<u64>,
    },
}

struct Run {
    state: RunState,
    positions: u64,
    /// Stage-side ids of its attempts (the first is the run's own id).
    attempts: u64,
}

/// The coordinator's decisions, composed (see the module docs).
pub struct Cluster {
    config: ClusterConfig,
    membership: Membership,
    cells: CellBook,
    /// Each connected node's current control session.
    sessions: HashMap<NodeId, u64>,
    runs: HashMap<u64, Run>,
    /// Stage-side id of an attempt → its run.
    routes: HashMap<u64, u64>,
    timers: TimerTable,
    lease: Duration,
    /// The latest expert-cache counters each node streaming experts from disk reported.
    expert_cache: HashMap<NodeId, ExpertCacheStats>,
    /// Sealed jobs: who claims to run what, and where each job is.
    sealed: SealedDesk,
    /// The coordinator is shutting down: sessions ending are not nodes leaving, and no lease
    /// expires.
    closing: bool,
    /// Cells or seats changed: runs waiting may be placed, drained epochs released.
    unsettled: bool,
    drained: u64,
    fault: Option<Fault>,
    /// Bumped whenever what [`Cluster::membership`], [`Cluster::cells`] or
    /// [`Cluster::expert_cache`] show may have changed (not by a run's messages, nor by a heartbeat): the shell republishes its view
    /// of them only then.
    generation: u64,
}

/// Bit offset of the attempt number in a stage-side sequence id (the run's id below it).
const ATTEMPT_SHIFT: u32 = 48;

impl Cluster {
    pub fn new(config: ClusterConfig, mut membership: Membership, lease: Duration) -> Self {
        membership.set_lease(lease);
        let mut timers = TimerTable::default();
        timers.arm(TimerKey::Lease, Duration::ZERO, 0);
        Self {
            config,
            membership,
            cells: CellBook::default(),
            sessions: HashMap::new(),
            runs: HashMap::new(),
            routes: HashMap::new(),
            timers,
            lease,
            expert_cache: HashMap::new(),
            sealed: SealedDesk::default(),
            closing: false,
            unsettled: false,
            drained: 0,
            fault: None,
            generation: 0,
        }
    }

    // ---- settings and views --------------------------------------------------------------

    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    pub fn cells(&self) -> &CellBook {
        &self.cells
    }

    pub fn expert_cache(&self) -> &HashMap<NodeId, ExpertCacheStats> {
        &self.expert_cache
    }

    /// The sealed-job desk (its claims and jobs), to read.
    pub fn sealed_desk(&self) -> &SealedDesk {
        &self.sealed
    }

    /// The sealed-job desk, to take a node's claims ([`SealedDesk::offer_claims`] answers at
    /// once, with nothing to send).
    pub fn sealed_desk_mut(&mut self) -> &mut SealedDesk {
        &mut self.sealed
    }

    /// Replaces the sealed-job desk (its settings changed; before clients connect).
    pub fn set_sealed_desk(&mut self, desk: SealedDesk) {
        self.sealed = desk;
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// See the field: a new value means the membership or the expert caches may have changed.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn set_lease(&mut self, lease: Duration) {
        self.generation += 1;
        self.lease = lease;
        self.membership.set_lease(lease);
    }

    pub fn set_max_context(&mut self, positions: usize) {
        self.config.max_context = positions;
    }

    pub fn set_kv_type(&mut self, kv: tessera_model::kv::KvType) {
        self.generation += 1;
        self.membership.set_kv_type(kv);
    }

    pub fn set_expert_split(&mut self, split: Option<crate::assignment::ExpertSplit>) {
        self.generation += 1;
        self.membership.set_expert_split(split);
    }

    pub fn set_expert_budgets(&mut self, budgets: std::collections::BTreeMap<String, u64>) {
        self.generation += 1;
        self.membership.set_expert_budgets(budgets);
    }

    /// From now on, sessions ending are the coordinator's own shutdown.
    pub fn set_closing(&mut self) {
        self.closing = true;
    }

    /// A deliberate bug in every run machine made from now on, the membership or the cell book
    /// (the simulator's mutation tests).
    #[cfg(test)]
    pub fn inject_fault(&mut self, fault: Option<Fault>) {
        self.fault = fault;
        self.membership.inject_fault(fault);
        self.cells.inject_fault(fault);
    }

    /// Runs in flight (placing or running).
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// The epoch run `run`'s attempt is on and the attempt's stage-side id.
    pub fn attempt(&self, run: u64) -> Option<(u64, u64)> {
        match &self.runs.get(&run)?.state {
            RunState::Running {
                machine,
                on_epoch: Some(e),
                ..
            } => Some((*e, machine.attempt_seq()?)),
            _ => None,
        }
    }

    /// Draining epochs released so far, once their last run left them.
    pub fn drained(&self) -> u64 {
        self.drained
    }

    /// Timers armed (bounded by the runs in flight, never by the tokens they stream).
    pub fn timers_armed(&self) -> usize {
        self.timers.len()
    }

    /// When to call `handle(now, ClusterInput::Timeout)` next.
    pub fn poll_timeout(&self) -> Option<Duration> {
        self.timers.next()
    }

    // ---- inputs --------------------------------------------------------------------------

    /// Takes one input at `now` (time since the shell started); returns what to do.
    pub fn handle(&mut self, now: Duration, input: ClusterInput) -> Vec<ClusterOutput> {
        let mut out = Vec::new();
        match input {
            ClusterInput::Joined(member) => {
                // A node that connects again while its earlier session is still the current
                // one (it restarted, or its connection broke, within its lease): that
                // session's work is gone with it, so the sealed desk hears it left now and
                // moves its jobs at once, not when their own leases run out. The new
                // session's claims list it again.
                let earlier = self.sessions.insert(member.node_id, member.session);
                if earlier.is_some_and(|s| s != member.session)
                    && !self.closing
                    && self.fault != Some(Fault::ForgetReplacedSessions)
                {
                    out.push(ClusterOutput::NodeLeft {
                        node: member.node_id,
                        key: member.key,
                    });
                }
                self.apply(Event::Joined(member), &mut out);
                self.maybe_initial_split(&mut out);
            }
            ClusterInput::Left { node, session } => {
                if self.sessions.get(&node) == Some(&session) {
                    self.sessions.remove(&node);
                    // If it held a stage, the epoch fails and one is planned on the survivors;
                    // runs on it pause and resume there.
                    if !self.closing {
                        let key = self.membership.member(&node).map(|m| m.key);
                        self.apply(Event::Left { node, session }, &mut out);
                        if let Some(key) = key {
                            out.push(ClusterOutput::NodeLeft { node, key });
                        }
                    }
                }
            }
            ClusterInput::Node { node, session, msg } => {
                // Liveness: a direct update, no actions, no bookkeeping.
                self.membership.handle(Event::Heard { node, session, now });
                self.node_message(now, node, msg, &mut out);
            }
            ClusterInput::LinkMeasured { node, link } => {
                self.apply(Event::LinkMeasured { node, link }, &mut out);
            }
            ClusterInput::Plan { stages } => {
                let event = self.plan_event(stages);
                self.apply(event, &mut out);
            }
            ClusterInput::Submit {
                run,
                spec,
                stages,
                positions,
            } => self.submit(now, run, spec, stages, positions, &mut out),
            ClusterInput::Cancel { run } => self.cancel(now, run, &mut out),
            ClusterInput::Sealed(input) => {
                out.extend(
                    self.sealed
                        .handle(input)
                        .into_iter()
                        .map(ClusterOutput::Sealed),
                );
            }
            ClusterInput::Timeout => self.fire_timers(now, &mut out),
        }
        self.settle(now, &mut out);
        out
    }

    fn plan_event(&self, stages: Vec<(NodeId, Range<usize>)>) -> Event {
        Event::Plan {
            model: self.config.model,
            stages,
            n_layer: self.config.n_layer,
            max_context: self.config.max_context,
        }
    }

    /// Applies `--split` once enough nodes are connected and no epoch exists yet.
    fn maybe_initial_split(&mut self, out: &mut Vec<ClusterOutput>) {
        let Some(split) = &self.config.initial_split else {
            return;
        };
        if self.membership.epoch().is_some() || !self.membership.expert_split_ready() {
            return;
        }
        let Ok(stages) = resolve(split, self.config.n_layer, &self.membership.candidates()) else {
            return;
        };
        let event = self.plan_event(stages);
        self.apply(event, out);
    }

    fn node_message(
        &mut self,
        now: Duration,
        node: NodeId,
        msg: NodeToCoord,
        out: &mut Vec<ClusterOutput>,
    ) {
        let event = match msg {
            NodeToCoord::Heartbeat {
                expert_cache: Some(c),
            } => {
                if self.expert_cache.insert(node, c) != Some(c) {
                    self.generation += 1;
                    let name = self.name_of(&node);
                    tracing::info!(
                        event = "expert_cache",
                        node = %name,
                        hits = c.hits,
                        misses = c.misses,
                        budget_bytes = c.budget_bytes,
                        peak_bytes = c.peak_bytes,
                        peak_read_buffer_bytes = c.peak_read_buffer_bytes,
                        "expert cache: {name} hits {} misses {} disk bytes {} read wait {:.1} ms \
                         disk busy {:.1} ms",
                        c.hits,
                        c.misses,
                        c.bytes_read,
                        c.read_wait_us as f64 / 1e3,
                        c.disk_busy_us as f64 / 1e3
                    );
                }
                return;
            }
            NodeToCoord::Loaded { epoch, report } => Event::Loaded {
                node,
                epoch,
                report,
            },
            NodeToCoord::LoadFailed { epoch, reason } => Event::LoadFailed {
                node,
                epoch,
                reason,
            },
            NodeToCoord::Linked { epoch, link } => Event::Linked { node, epoch, link },
            NodeToCoord::LinkFailed {
                epoch,
                reason,
                peer,
            } => Event::LinkFailed {
                node,
                epoch,
                reason,
                peer,
            },
            NodeToCoord::Inventory(inventory) => Event::InventoryMeasured { node, inventory },
            NodeToCoord::PeerLinks { links } => Event::PeerLinksMeasured { node, links },
            // The rest that name a sequence are its run's: that run alone hears it.
            m => {
                let Some(run) = m.seq().and_then(|seq| self.routes.get(&seq).copied()) else {
                    return;
                };
                self.run_input(now, run, Input::Node { from: node, msg: m }, out);
                return;
            }
        };
        self.apply(event, out);
    }

    fn name_of(&self, node: &NodeId) -> String {
        self.membership
            .member(node)
            .map_or_else(|| node.short(), |m| m.name.clone())
    }

    // ---- the membership ------------------------------------------------------------------

    /// Feeds the membership one event and carries out its actions; when the cells changed,
    /// records them and marks the runs for settling.
    fn apply(&mut self, event: Event, out: &mut Vec<ClusterOutput>) {
        self.generation += 1;
        let before = cell_phases(&self.membership);
        for a in self.membership.handle(event) {
            match a {
                Action::Send { to, msg } => {
                    if self.sessions.contains_key(&to) {
                        out.push(ClusterOutput::ToNode {
                            to,
                            msg: Box::new(msg.0),
                        });
                    }
                }
                Action::LeaseExpired { node, session } => {
                    // The node is already planned around; its session ends so that it
                    // reconnects (and starts afresh) if it is still there.
                    if self.sessions.get(&node) == Some(&session) {
                        self.sessions.remove(&node);
                        let name = self.name_of(&node);
                        tracing::info!(
                            event = "lease_expired",
                            node = %name,
                            node_id = %node,
                            "lease expired: {name} {node} silent for {} ms",
                            self.lease.as_millis()
                        );
                        out.push(ClusterOutput::LeaseExpired { node, session });
                    }
                }
                Action::EpochReady(e) => self.log_ready(e),
                Action::EpochFailed { epoch, reason } => {
                    tracing::warn!(event = "epoch_failed", epoch, %reason, "epoch {epoch} failed: {reason}");
                }
                Action::Note(note) => tracing::info!("{note}"),
                Action::Refused { node, why } => out.push(ClusterOutput::Refused { node, why }),
            }
        }
        let after = cell_phases(&self.membership);
        if before != after {
            for e in self.membership.cells() {
                if !before.contains(&(e.id, e.phase.clone())) {
                    out.push(ClusterOutput::RecordEpoch(Box::new(epoch_record(
                        &self.membership,
                        e,
                    ))));
                }
            }
            let live: Vec<u64> = after.iter().map(|(id, _)| *id).collect();
            self.cells.retain_cells(&live);
            self.unsettled = true;
        }
    }

    /// Who holds which experts in a ready epoch (an expert split; after a loss the survivors
    /// hold the departed owner's): one line per holder.
    fn log_ready(&self, e: u64) {
        tracing::info!(event = "epoch_ready", epoch = e, "epoch {e} is ready");
        let candidates = self.membership.member_candidates();
        for g in self
            .membership
            .epoch_with_id(e)
            .and_then(|x| x.experts.as_ref())
            .map_or(&[][..], |x| &x.groups)
        {
            // A group names its node by name or by its id (or a 4+ character prefix of it),
            // resolved as placement resolved it.
            let name = crate::assignment::find_node(&g.node, &candidates)
                .ok()
                .and_then(|id| self.membership.member(&id))
                .map_or_else(|| g.node.clone(), |m| m.name.clone());
            let experts: Vec<String> = g.experts.iter().map(usize::to_string).collect();
            let experts = experts.join(",");
            tracing::info!(
                event = "experts_placed",
                epoch = e,
                node = %name,
                experts = %experts,
                "epoch {e}: {name} holds experts {experts}"
            );
        }
    }

    // ---- timers --------------------------------------------------------------------------

    fn fire_timers(&mut self, now: Duration, out: &mut Vec<ClusterOutput>) {
        while let Some((key, n)) = self.timers.pop_due(now) {
            match key {
                TimerKey::Lease => {
                    // A coordinator shutting down declares no one gone.
                    if !self.closing {
                        self.apply(Event::Tick { now }, out);
                    }
                    let period = (self.lease / 4).max(Duration::from_millis(1));
                    self.timers.arm(TimerKey::Lease, now + period, 0);
                }
                TimerKey::Run(run, k) => {
                    let kind = RUN_TIMER_KINDS[usize::from(k)];
                    self.run_input(now, run, Input::Timer(Timer { kind, n }), out);
                }
                TimerKey::Placement(run) => {
                    let target = match self.runs.get(&run).map(|r| &r.state) {
                        Some(RunState::Placing { target, .. }) => *target,
                        _ => continue,
                    };
                    let why = match target {
                        Some(t) => PlacementTimeout::EpochNotReady(t),
                        None => PlacementTimeout::NoCell(PLACEMENT_TIMEOUT),
                    };
                    self.refuse_run(run, RunRefused::Timeout(why), out);
                }
            }
        }
    }

    // ---- runs ----------------------------------------------------------------------------

    fn submit(
        &mut self,
        now: Duration,
        run: u64,
        spec: Box<RunSpec>,
        stages: Option<Vec<StageSpec>>,
        positions: u64,
        out: &mut Vec<ClusterOutput>,
    ) {
        let target = match stages {
            Some(s) => match self.plan_spec(&s, out) {
                Ok(t) => Some(t),
                Err(e) => {
                    out.push(ClusterOutput::Run {
                        run,
                        news: RunNews::Ended(Err(RunRefused::Assignment(e))),
                    });
                    return;
                }
            },
            None => None,
        };
        self.runs.insert(
            run,
            Run {
                state: RunState::Placing { spec, target },
                positions,
                attempts: 0,
            },
        );
        self.timers
            .arm(TimerKey::Placement(run), now + PLACEMENT_TIMEOUT, 0);
        self.unsettled = true;
    }

    /// The live cell whose ring is `spec`, or a new plan of it (which replaces every cell), as
    /// its epoch number: requests asking for the same placement share one epoch.
    fn plan_spec(
        &mut self,
        spec: &[StageSpec],
        out: &mut Vec<ClusterOutput>,
    ) -> Result<u64, AssignmentError> {
        let wanted = resolve(spec, self.config.n_layer, &self.membership.candidates())?;
        let current = self.membership.cells().iter().find(|e| {
            !matches!(e.phase, Phase::Failed(_) | Phase::Released) && {
                // Expert-only nodes (no layers) follow the ring stages of an expert split.
                let ring: Vec<_> = e.stages.iter().filter(|s| !s.layers.is_empty()).collect();
                wanted.len() == ring.len()
                    && wanted
                        .iter()
                        .zip(&ring)
                        .all(|((n, l), s)| *n == s.node_id && *l == s.layers)
            }
        });
        if let Some(e) = current {
            return Ok(e.id);
        }
        let event = self.plan_event(wanted);
        self.apply(event, out);
        Ok(self.membership.epoch().map_or(0, |e| e.id))
    }

    fn cancel(&mut self, now: Duration, run: u64, out: &mut Vec<ClusterOutput>) {
        let placing = match self.runs.get(&run) {
            Some(r) => matches!(r.state, RunState::Placing { .. }),
            None => return,
        };
        if placing {
            // A machine that never started, cancelled: it ends at once, saying so.
            let r = self.runs.get_mut(&run).expect("checked");
            let RunState::Placing { spec, .. } = &r.state else {
                unreachable!("checked")
            };
            let (machine, _) = RunMachine::new((**spec).clone(), self.lease);
            r.state = RunState::Running {
                machine: Box::new(machine),
                awaiting: None,
                on_epoch: None,
            };
            self.timers.disarm(TimerKey::Placement(run));
        }
        self.run_input(now, run, Input::Cancel, out);
    }

    fn refuse_run(&mut self, run: u64, why: RunRefused, out: &mut Vec<ClusterOutput>) {
        self.forget_run(run);
        out.push(ClusterOutput::Run {
            run,
            news: RunNews::Ended(Err(why)),
        });
    }

    /// Drops a run's machine, routes, timers and seat.
    fn forget_run(&mut self, run: u64) {
        if let Some(r) = self.runs.remove(&run) {
            for a in 0..=r.attempts {
                self.routes.remove(&(run | (a << ATTEMPT_SHIFT)));
            }
        }
        for k in RUN_TIMER_KINDS {
            self.timers.disarm(TimerKey::Run(run, kind_index(k)));
        }
        self.timers.disarm(TimerKey::Placement(run));
        if self.cells.unseat(run) {
            self.generation += 1;
            self.unsettled = true;
        }
    }

    fn run_input(&mut self, now: Duration, run: u64, input: Input, out: &mut Vec<ClusterOutput>) {
        let Some(Run {
            state: RunState::Running { machine, .. },
            ..
        }) = self.runs.get_mut(&run)
        else {
            return;
        };
        let outputs = machine.handle(now, input);
        self.run_outputs(now, run, outputs, out);
    }

    /// Carries out a run machine's outputs; feeds back what cannot be delivered.
    fn run_outputs(
        &mut self,
        now: Duration,
        run: u64,
        outputs: Vec<Output>,
        out: &mut Vec<ClusterOutput>,
    ) {
        let mut follow = Vec::new();
        for o in outputs {
            match o {
                Output::Send { to, msg } => {
                    if self.sessions.contains_key(&to) {
                        out.push(ClusterOutput::ToNode {
                            to,
                            msg: Box::new(msg.0),
                        });
                    } else {
                        follow.push(Input::Undeliverable { to });
                    }
                }
                Output::AwaitEpoch { lost } => {
                    if let Some(Run {
                        state:
                            RunState::Running {
                                machine,
                                awaiting,
                                on_epoch,
                            },
                        ..
                    }) = self.runs.get_mut(&run)
                    {
                        *awaiting = Some(lost);
                        *on_epoch = None;
                        if let Some(lost) = lost {
                            tracing::info!(
                                event = "run_paused",
                                seq = run,
                                epoch = lost,
                                "seq {run}: paused after {} tokens on epoch {lost}",
                                machine.generated().len()
                            );
                        }
                        self.unsettled = true;
                    }
                }
                Output::ArmTimer { timer, after } => self.timers.arm(
                    TimerKey::Run(run, kind_index(timer.kind)),
                    now + after,
                    timer.n,
                ),
                Output::Event(e) => {
                    if let RunEvent::Resumed { epoch, generated } = &e {
                        tracing::info!(
                            event = "run_resumed",
                            seq = run,
                            epoch,
                            generated,
                            "seq {run}: resuming on epoch {epoch} after {generated} tokens"
                        );
                    }
                    out.push(ClusterOutput::Run {
                        run,
                        news: RunNews::Event(e),
                    });
                }
                Output::Refused { from, why } => {
                    out.push(ClusterOutput::Refused { node: from, why })
                }
                Output::Done(o) => {
                    if let (Some(p), Some((n, d))) = (&o.placement, o.decode) {
                        self.cells.measured(p.epoch, n, d.as_secs_f64().max(1e-9));
                        self.generation += 1;
                    }
                    self.forget_run(run);
                    out.push(ClusterOutput::Run {
                        run,
                        news: RunNews::Ended(Ok(o)),
                    });
                }
            }
        }
        for input in follow {
            self.run_input(now, run, input, out);
        }
    }

    /// Bytes of KV cache per position per layer, as the stages hold it.
    fn kv_bytes(&self) -> u64 {
        self.membership
            .kv_type()
            .bytes_per_position(self.config.kv_shape) as u64
    }

    /// Why no cell can take a request now and none is coming.
    fn unavailable(&self) -> Option<Unavailable> {
        let m = &self.membership;
        if m.cells()
            .iter()
            .any(|e| matches!(e.phase, Phase::Loading | Phase::Linking | Phase::Ready))
        {
            return None;
        }
        let failed = m.epoch().and_then(|e| match &e.phase {
            Phase::Failed(why) => Some(Unavailable::EpochFailed {
                epoch: e.id,
                why: why.clone(),
            }),
            _ => None,
        });
        Some(match (m.outage(), failed) {
            (Some(why), _) => Unavailable::Outage(why.clone()),
            (None, Some(failed)) => failed,
            (None, None) => Unavailable::NoAssignment,
        })
    }
}

/// Every cell's epoch and every draining one, with its phase.
fn cell_phases(m: &Membership) -> Vec<(u64, Phase)> {
    m.cells()
        .iter()
        .chain(m.draining())
        .map(|e| (e.id, e.phase.clone()))
        .collect()
}

/// A cell's epoch (its placement, phase and load evidence) as recorded.
fn epoch_record(m: &Membership, e: &crate::membership::Epoch) -> EpochRecord {
    EpochRecord {
        epoch: e.id,
        model: e.model,
        phase: e.phase.to_string(),
        stages: e
            .stages
            .iter()
            .map(|s| EpochStageRecord {
                node_id: s.node_id,
                name: m.member(&s.node_id).map(|m| m.name.clone()),
                layers: s.layers.clone(),
                load: s.loaded.clone(),
                link_to_next: s.link,
            })
            .collect(),
        // Stamped by the shell, which has the wall clock.
        recorded_at_unix_ms: 0,
    }
}

mod refusal;
mod seating;
#[cfg(test)]
mod tests;
mod timers;

pub use refusal::{PlacementTimeout, RunRefused, Unavailable};
use timers::{kind_index, TimerKey, TimerTable, RUN_TIMER_KINDS};
