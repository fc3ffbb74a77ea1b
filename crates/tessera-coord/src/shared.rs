//! The coordinator's shared state: its settings, the model it serves, the gate, and the inbox
//! of the one task that owns the [`Cluster`] (every decision) with the I/O handles its outputs
//! go to ([`Core`]). Each session, run shell and the HTTP backend hold an `Arc<Shared>` and
//! only translate I/O into the cluster's inputs ([`Shared::handle`]) and its outputs into I/O;
//! what they read of the cluster comes from the view the core publishes ([`Shared::view`]).
//! No lock guards the cluster: a node's message reaches its run through the core's inbox and
//! nothing else.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{BoxStream, SelectAll, StreamExt};
use tessera_host::Manifest;
use tessera_model::{ModelConfig, Tokenizer};
use tessera_net::{Connection, NodeId};
use tessera_proto::{CoordToNode, ExpertCacheStats, MemberStatus, StageSpec};
use tokio::sync::{mpsc, watch};

use crate::authz::{Refusal, SenderFacts};
use crate::cluster::{Cluster, ClusterInput, ClusterOutput, RunNews};
use crate::distribute::ModelServer;
use crate::door::{Door, DoorNote, EnrolmentSlot, Notes, RunPermit};
use crate::enrol::{Enrolment, EnrolmentBook};
use crate::ledger::Ledger;
use crate::membership::{Member, Membership};
use crate::replan::ModelBytes;
use crate::run::RunSpec;
use crate::sealed::{SealedEdge, SealedSettings};
use crate::state::EnrolmentState;

/// How long a node may stay silent before it is declared gone, by default.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(3);

/// The coordinator's settings.
#[derive(Clone, Debug)]
pub struct CoordinatorConfig {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// The model this cluster serves. The coordinator reads its metadata and tokenizer and
    /// serves its chunks; it loads no weights.
    pub model: PathBuf,
    /// An assignment to apply as soon as enough nodes are connected.
    pub split: Option<Vec<StageSpec>>,
    /// Most positions per sequence.
    pub max_context: usize,
    pub progress: bool,
    /// Bytes per chunk of the model's manifest (the unit nodes fetch and verify);
    /// [`DEFAULT_CHUNK_SIZE`] unless a model's expert slices are not much larger than that.
    pub chunk_size: u32,
}

/// The model as the coordinator knows it.
#[derive(Debug)]
pub struct ModelInfo {
    pub name: String,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    /// End-of-generation token ids.
    pub eog: Vec<u32>,
}

/// What changes while the coordinator runs: the [`Cluster`] that decides, the I/O handles its
/// outputs go to (each node's control session, each run's owner) and the sealed desk. One task
/// owns it ([`spawn_core`]); everything else reaches it by [`Shared::handle`], [`Shared::with`]
/// and [`Shared::ask`], in the order they were called, and reads the [`ClusterView`] it
/// publishes. The persistent records are in [`crate::state`].
pub(crate) struct Core {
    pub cluster: Cluster,
    /// Each connected node's current control session and its outbox.
    outboxes: HashMap<NodeId, NodeOutbox>,
    /// Where each run's news goes.
    owners: HashMap<u64, RunOwner>,
    /// The sealed desk's edge: the clients waiting for sealed jobs, the settings (the desk
    /// itself is the cluster's).
    sealed: SealedEdge,
    /// What the cluster backend books from its runs.
    ledger: Ledger,
    /// The cluster's generation and the ledger's revision the view was last published at.
    published: Option<(u64, u64)>,
    /// Node control streams handed over, for the core task to read ([`Shared::add_reader`]).
    new_readers: Vec<BoxStream<'static, Command>>,
    /// The enrolment records (published to [`Shared::enrol`] after each change).
    pub enrolment: EnrolmentBook,
    /// The gate's places and each key's connections.
    pub door: Door,
    /// Where plan epochs are recorded.
    store: Arc<dyn EnrolmentState>,
}

impl Core {
    pub fn new(
        mut cluster: Cluster,
        enrolment: EnrolmentBook,
        store: Arc<dyn EnrolmentState>,
    ) -> Self {
        cluster.set_sealed_desk(crate::sealed::edge::desk(&Default::default()));
        Self {
            cluster,
            outboxes: HashMap::new(),
            owners: HashMap::new(),
            sealed: SealedEdge::new(&Default::default()),
            ledger: Ledger::default(),
            published: None,
            new_readers: Vec::new(),
            enrolment,
            door: Door::default(),
            store,
        }
    }

    pub fn ledger_mut(&mut self) -> &mut Ledger {
        &mut self.ledger
    }

    /// The sealed desk's edge, over this core.
    pub fn edge<'a>(&'a mut self, shared: &'a Shared) -> EdgeHost<'a> {
        EdgeHost { core: self, shared }
    }

    /// Replaces the sealed desk and its edge (the settings changed; before clients connect).
    pub fn set_sealed(&mut self, settings: &SealedSettings) {
        self.sealed = SealedEdge::new(settings);
        self.cluster
            .set_sealed_desk(crate::sealed::edge::desk(settings));
    }

    fn run(&mut self, shared: &Shared, command: Command) {
        match command {
            Command::Input(input) => self.handle(shared, input),
            Command::With(f) => f(self, shared),
            Command::Door(note) => self.door.note(note),
        }
        self.publish(shared);
    }

    /// Feeds the cluster one input and carries out its outputs: sends and news first, then
    /// records, refusals, the sealed desk and closing a connection.
    pub fn handle(&mut self, shared: &Shared, input: ClusterInput) {
        let outputs = self.cluster.handle(shared.now(), input);
        // The view goes out before any message does: a node told of a new epoch asks for its
        // chunks at once, and the model server checks them against the view.
        self.publish(shared);
        let mut later = Vec::new();
        let mut sealed = Vec::new();
        for o in outputs {
            match o {
                ClusterOutput::ToNode { to, msg } => {
                    if let Some(s) = self.outboxes.get(&to) {
                        let _ = s.tx.send(*msg);
                    }
                }
                ClusterOutput::Run { run, news } => {
                    if matches!(news, RunNews::Ended(_)) {
                        if let Some(mut owner) = self.owners.remove(&run) {
                            owner(news);
                        }
                    } else if let Some(owner) = self.owners.get_mut(&run) {
                        owner(news);
                    }
                }
                ClusterOutput::LeaseExpired { node, session } => {
                    if self
                        .outboxes
                        .get(&node)
                        .is_some_and(|s| s.session == session)
                    {
                        let s = self.outboxes.remove(&node).expect("checked");
                        s.conn.close("lease expired");
                        later.push(crate::sealed::edge::node_key(&s.conn.peer_key()));
                    }
                }
                ClusterOutput::NodeLeft { key, .. } => {
                    later.push(crate::sealed::edge::node_key(&key));
                }
                ClusterOutput::RecordEpoch(mut rec) => {
                    rec.recorded_at_unix_ms = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64);
                    if let Err(e) = self.store.record_epoch(&rec) {
                        tracing::warn!("recording epoch {}: {e}", rec.epoch);
                    }
                }
                ClusterOutput::Refused { node, why } => shared.authz.refuse(node, &why),
                ClusterOutput::Sealed(o) => sealed.push(o),
            }
        }
        if !sealed.is_empty() {
            crate::sealed::edge::carry_out(&mut self.edge(shared), sealed);
        }
        // The desk hears of departures after the cluster's sends (its own go on the
        // sessions still open).
        for key in later {
            crate::sealed::edge::node_left(&mut self.edge(shared), key);
        }
    }

    /// Ends node `id`'s control session `session` (a newer session may have replaced it: then
    /// the node has not left).
    pub fn close_session(&mut self, shared: &Shared, id: NodeId, session: u64) {
        if self.outboxes.get(&id).is_some_and(|s| s.session == session) {
            self.outboxes.remove(&id);
        }
        self.handle(shared, ClusterInput::Left { node: id, session });
    }

    /// Publishes the view when the cluster's generation or the ledger's revision moved.
    fn publish(&mut self, shared: &Shared) {
        let g = (self.cluster.generation(), self.ledger.revision());
        if self.published != Some(g) {
            self.published = Some(g);
            shared.view.send_replace(Arc::new(ClusterView {
                membership: self.cluster.membership().clone(),
                cells: self.cluster.cells().clone(),
                expert_cache: self.cluster.expert_cache().clone(),
                ledger: self.ledger.clone(),
            }));
        }
    }
}

/// The membership, the cell book, the expert caches and the ledger as of the core's last
/// change, for
/// readers that must not wait for the core task (the gateway's status, `Backend::submit`, the
/// model server's checks, the coordinator's getters).
#[derive(Default)]
pub(crate) struct ClusterView {
    pub membership: Membership,
    pub cells: crate::cells::CellBook,
    pub expert_cache: HashMap<NodeId, ExpertCacheStats>,
    pub ledger: Ledger,
}

/// What the core task is asked to do: an input for the cluster (a node's message, a
/// timeout), a place given back to the gate, or anything else done with the core.
// Not boxed: `Input` carries every node message (a token each), and a box would be one more
// allocation per token; the rare `With` is what is small.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Command {
    Input(ClusterInput),
    With(CoreJob),
    Door(DoorNote),
}

/// Work done on the core task with the core.
pub(crate) type CoreJob = Box<dyn FnOnce(&mut Core, &Shared) + Send>;

/// A node's current control session: its number, its outbox, and its connection (closed when
/// the cluster says the lease expired).
struct NodeOutbox {
    session: u64,
    tx: mpsc::UnboundedSender<CoordToNode>,
    conn: Connection,
}

pub(crate) struct Shared {
    pub id: NodeId,
    pub config: CoordinatorConfig,
    pub enrol: Arc<Enrolment>,
    pub model: ModelInfo,
    pub server: ModelServer,
    /// The core task's inbox ([`spawn_core`]).
    core: mpsc::UnboundedSender<Command>,
    /// What the core last published.
    view: watch::Sender<Arc<ClusterView>>,
    pub next_seq: AtomicU64,
    /// Control session numbers.
    pub next_session: AtomicU64,
    /// Node lease, ms (see [`Coordinator::set_lease`]).
    pub lease_ms: AtomicU64,
    /// Set by [`Coordinator::close`]: sessions ending now are the coordinator's own shutdown,
    /// not nodes leaving (nothing is re-planned).
    pub closing: std::sync::atomic::AtomicBool,
    /// The origin of the `now` given to the cluster.
    pub started: tokio::time::Instant,
    /// Who may say what ([`crate::authz`]): roles, client admission, refusal counts.
    pub authz: crate::authz::Gate,
    /// Most positions per sequence in the plans made from now on: the configured
    /// `max_context` until a planner chooses a context that fits
    /// ([`Coordinator::set_max_context`]).
    pub max_context: std::sync::atomic::AtomicUsize,
}

/// What [`Shared::new`] needs besides the core.
pub(crate) struct SharedParts {
    pub id: NodeId,
    pub config: CoordinatorConfig,
    pub enrol: Arc<Enrolment>,
    pub model: ModelInfo,
    pub server: ModelServer,
    /// The enrolment records, for the core ([`Core::enrolment`]).
    pub enrolment: EnrolmentBook,
    /// Where plan epochs are recorded.
    pub store: Arc<dyn EnrolmentState>,
    pub max_context: usize,
}

impl Shared {
    /// The shared state around `cluster`, and the task that owns the cluster. Must be called
    /// inside a tokio runtime.
    pub fn start(parts: SharedParts, cluster: Cluster) -> Arc<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Self {
            id: parts.id,
            config: parts.config,
            enrol: parts.enrol,
            model: parts.model,
            server: parts.server,
            core: tx,
            view: watch::Sender::new(Arc::default()),
            next_seq: AtomicU64::new(1),
            next_session: AtomicU64::new(1),
            lease_ms: AtomicU64::new(DEFAULT_LEASE.as_millis() as u64),
            closing: std::sync::atomic::AtomicBool::new(false),
            started: tokio::time::Instant::now(),
            authz: crate::authz::Gate::new(),
            max_context: std::sync::atomic::AtomicUsize::new(parts.max_context),
        });
        let mut core = Core::new(cluster, parts.enrolment, parts.store);
        core.publish(&shared);
        spawn_core(&shared, core, rx);
        shared
    }

    pub fn max_context(&self) -> usize {
        self.max_context.load(Ordering::SeqCst)
    }

    /// The time since the coordinator started, as the cluster counts it.
    pub fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// The membership and expert caches as the core last published them.
    pub fn view(&self) -> Arc<ClusterView> {
        self.view.borrow().clone()
    }

    /// Feeds the cluster one input (on the core task, after everything asked before it).
    pub fn handle(&self, input: ClusterInput) {
        let _ = self.core.send(Command::Input(input));
    }

    /// Runs `command` on the core task, after everything asked before it.
    pub fn run(&self, command: Command) {
        let _ = self.core.send(command);
    }

    /// Where the gate's places send their notes when dropped: the core task's inbox.
    pub fn door_notes(&self) -> Notes {
        let core = self.core.clone();
        Arc::new(move |note| {
            let _ = core.send(Command::Door(note));
        })
    }

    /// A place for one client run, asked of the core task; `None` (counted and logged as a
    /// refusal) when the client or all clients have every place taken.
    pub async fn admit_run(&self, sender: &SenderFacts) -> Option<RunPermit> {
        let client = sender.node;
        let permit = self
            .ask(move |core, shared| core.door.admit_run(client, &shared.door_notes()))
            .await
            .flatten();
        if permit.is_none() {
            self.authz.refuse(client, &Refusal::TooManyRuns);
        }
        permit
    }

    /// A place for one enrolment in progress from `ip`, asked of the core task.
    pub async fn enrolment_slot(&self, ip: std::net::IpAddr) -> Option<EnrolmentSlot> {
        self.ask(move |core, shared| core.door.open_enrolment(ip, &shared.door_notes()))
            .await
            .flatten()
    }

    /// Runs `f` on the core task, after everything asked before it.
    pub fn with(&self, f: impl FnOnce(&mut Core, &Self) + Send + 'static) {
        let _ = self.core.send(Command::With(Box::new(f)));
    }

    /// What `f` returns, run on the core task after everything asked before it; the view is
    /// published before the answer comes. `None` once the coordinator is gone.
    pub async fn ask<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Core, &Self) -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.with(move |core, shared| {
            let t = f(core, shared);
            core.publish(shared);
            let _ = tx.send(t);
        });
        rx.await.ok()
    }

    /// Makes `tx` and `conn` node `member`'s current control session (replacing an older one
    /// of a node that reconnected) and tells the cluster it joined.
    pub fn open_session(
        &self,
        mut member: Member,
        tx: mpsc::UnboundedSender<CoordToNode>,
        conn: Connection,
    ) -> u64 {
        let session = self.next_session.fetch_add(1, Ordering::Relaxed);
        member.session = session;
        let id = member.node_id;
        self.with(move |core, shared| {
            core.outboxes.insert(id, NodeOutbox { session, tx, conn });
            core.handle(shared, ClusterInput::Joined(Box::new(member)));
        });
        session
    }

    /// Hands a node's control stream to the core task, which reads it from now on: each item
    /// is run as it comes, in the stream's order.
    pub fn add_reader(&self, frames: BoxStream<'static, Command>) {
        self.with(move |core, _| core.new_readers.push(frames));
    }

    /// Starts run `run`: its news goes to `owner`.
    pub fn submit(
        &self,
        run: u64,
        spec: RunSpec,
        stages: Option<Vec<StageSpec>>,
        positions: u64,
        owner: RunOwner,
    ) {
        let input = ClusterInput::Submit {
            run,
            spec: Box::new(spec),
            stages,
            positions,
        };
        self.with(move |core, shared| {
            core.owners.insert(run, owner);
            core.handle(shared, input);
        });
    }

    /// The node lease.
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms.load(Ordering::Relaxed).max(1))
    }
}

/// The sealed desk's edge over the core: its state, the cluster's desk, the node sessions,
/// the members' names.
pub(crate) struct EdgeHost<'a> {
    core: &'a mut Core,
    shared: &'a Shared,
}

impl crate::sealed::edge::SealedHost for EdgeHost<'_> {
    fn edge(&mut self) -> &mut SealedEdge {
        &mut self.core.sealed
    }

    fn desk(&mut self) -> &mut crate::sealed::SealedDesk {
        self.core.cluster.sealed_desk_mut()
    }

    fn feed(&mut self, input: crate::sealed::SealedInput) {
        self.core.handle(self.shared, ClusterInput::Sealed(input));
    }

    fn send(&mut self, to: NodeId, msg: CoordToNode) -> bool {
        self.core
            .outboxes
            .get(&to)
            .is_some_and(|s| s.tx.send(msg).is_ok())
    }

    fn member_name(&self, id: &NodeId) -> Option<String> {
        self.core
            .cluster
            .membership()
            .member(id)
            .map(|m| m.name.clone())
    }
}

/// A run's owner: called with each piece of its news where the cluster decides it. It must
/// only hand the news on (a channel send, a counter), never call back into the cluster.
pub(crate) type RunOwner = Box<dyn FnMut(RunNews) + Send>;

/// Far enough that the core's clock never fires before it is first armed.
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// The core task: owns the [`Core`], runs the commands in the order they came (from its inbox,
/// and from each node's control stream in that stream's order), feeds the cluster `Timeout` at
/// its [`Cluster::poll_timeout`] and ticks the sealed desk's clock, until the coordinator is
/// dropped.
fn spawn_core(shared: &Arc<Shared>, mut core: Core, mut inbox: mpsc::UnboundedReceiver<Command>) {
    let weak = Arc::downgrade(shared);
    let started = shared.started;
    tokio::spawn(async move {
        // One timer, moved only when the cluster's next timeout comes closer: a run re-arms
        // its timers with each token, which only pushes them later, so a token moves nothing
        // here; a clock that fires early finds nothing due and is armed again from the
        // cluster's next timeout.
        let clock = tokio::time::sleep(NEVER);
        tokio::pin!(clock);
        let mut armed: Option<Duration> = None;
        let mut sealed_tick = tokio::time::interval(crate::sealed::edge::SEALED_TICK);
        sealed_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut readers = SelectAll::new();
        loop {
            readers.extend(core.new_readers.drain(..));
            if let Some(next) = core.cluster.poll_timeout() {
                if armed.is_none_or(|a| next < a) {
                    armed = Some(next);
                    clock.as_mut().reset(started + next);
                }
            }
            tokio::select! {
                biased;
                command = inbox.recv() => {
                    let (Some(command), Some(shared)) = (command, weak.upgrade()) else {
                        return;
                    };
                    core.run(&shared, command);
                }
                Some(command) = readers.next(), if !readers.is_empty() => {
                    let Some(shared) = weak.upgrade() else { return };
                    core.run(&shared, command);
                }
                () = &mut clock, if armed.is_some() => {
                    // A fired sleep stays ready: re-armed from the cluster's next timeout
                    // whatever it is, even the same one (not yet due by the cluster's `now`).
                    armed = None;
                    let Some(shared) = weak.upgrade() else { return };
                    core.run(&shared, Command::Input(ClusterInput::Timeout));
                }
                _ = sealed_tick.tick() => {
                    let Some(shared) = weak.upgrade() else { return };
                    if !shared.closing.load(Ordering::SeqCst) {
                        crate::sealed::edge::tick(&mut core.edge(&shared));
                    }
                }
            }
        }
    });
}

/// What the model's weights weigh per layer, embedding and head, and one expert per layer (for
/// budget checks when re-planning).
pub(crate) fn model_bytes(manifest: &Manifest, n_expert: usize) -> ModelBytes {
    let bytes = |names: &[String]| manifest.bytes_for(names).unwrap_or(0);
    let n_layer = (0u32..)
        .take_while(|&l| !manifest.layer_tensor_names(l..l + 1).is_empty())
        .count() as u32;
    let has = |n: &str| manifest.tensor(n).is_some();
    let mut head = vec!["output_norm.weight".to_string()];
    head.push(if has("output.weight") {
        "output.weight".into()
    } else {
        "token_embd.weight".into()
    });
    // Tensor bytes without the header `bytes_for` counts in.
    let tensor = |n: String| manifest.tensor(&n).map_or(0, |t| t.len);
    let expert = (0..n_layer)
        .map(|l| {
            let packed: u64 = ["gate", "up", "down"]
                .iter()
                .map(|w| tensor(format!("blk.{l}.ffn_{w}_exps.weight")))
                .sum();
            packed / n_expert.max(1) as u64
        })
        .collect();
    ModelBytes {
        layers: (0..n_layer)
            .map(|l| bytes(&manifest.layer_tensor_names(l..l + 1)))
            .collect(),
        embed: bytes(&["token_embd.weight".to_string()]),
        head: bytes(&head),
        expert,
        n_expert,
    }
}

/// Status of every member, for clients.
pub(crate) fn member_status(shared: &Shared) -> (Vec<MemberStatus>, Option<u64>) {
    let view = shared.view();
    let m = &view.membership;
    let members = m
        .members()
        .map(|m| MemberStatus {
            node_id: m.node_id,
            name: m.name.clone(),
            connected: m.connected,
            addr: Some(m.addr),
            memory_budget_bytes: m.memory_budget_bytes,
            link: m.link,
        })
        .collect();
    (members, m.epoch().map(|e| e.id))
}
