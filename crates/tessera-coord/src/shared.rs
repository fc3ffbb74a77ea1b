//! The coordinator's shared state: its settings, the model it serves, the inbox of the one task
//! that owns the [`Cluster`] (every decision) with the I/O handles its outputs go to, the view
//! that task publishes, and the gate. Each session, run shell and the HTTP backend hold an
//! `Arc<Shared>` and only translate I/O into the cluster's inputs ([`Shared::handle`]) and its
//! outputs into I/O (on the cluster's task).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_host::Manifest;
use tessera_model::{ModelConfig, Tokenizer};
use tessera_net::{Connection, NodeId};
use tessera_proto::{CoordToNode, MemberStatus, StageSpec};
use tokio::sync::{mpsc, watch};

use crate::cluster::{Cluster, ClusterInput, ClusterOutput, ClusterView, RunNews};
use crate::distribute::ModelServer;
use crate::enrol::Enrolment;
use crate::membership::Member;
use crate::replan::ModelBytes;
use crate::run::RunSpec;
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

/// What one task owns while the coordinator runs ([`spawn_cluster`]): the [`Cluster`] that
/// decides, and the I/O handles its outputs go to (each node's control session, each run's
/// owner). The persistent records are in [`crate::state`].
struct Core {
    cluster: Cluster,
    /// Each connected node's current control session and its outbox.
    outboxes: HashMap<NodeId, NodeOutbox>,
    /// Where each run's news goes.
    owners: HashMap<u64, RunOwner>,
}

/// A node's current control session: its number, its outbox, and its connection (closed when
/// the cluster says the lease expired).
pub(crate) struct NodeOutbox {
    session: u64,
    tx: mpsc::UnboundedSender<CoordToNode>,
    conn: Connection,
}

/// What the cluster's task is asked: an input for the cluster, with the I/O handle it needs
/// where there is one, or a setting.
pub(crate) enum Command {
    Input(ClusterInput),
    /// A node's new control session (it joined).
    Open {
        member: Box<Member>,
        outbox: NodeOutbox,
    },
    /// A node's control session ended.
    Close {
        node: NodeId,
        session: u64,
    },
    /// A request, and where its news goes.
    Submit {
        run: u64,
        input: ClusterInput,
        owner: RunOwner,
    },
    /// Send on a node's current session (the sealed desk's dispatch).
    ToNode {
        to: NodeId,
        msg: Box<CoordToNode>,
    },
    Set(Setting),
}

/// The cluster's settings, changed from outside.
pub(crate) enum Setting {
    Lease(Duration),
    MaxContext(usize),
    KvType(tessera_model::kv::KvType),
    ExpertSplit(Option<crate::assignment::ExpertSplit>),
    /// The coordinator is shutting down.
    Closing,
}

pub(crate) struct Shared {
    pub id: NodeId,
    pub config: CoordinatorConfig,
    pub enrol: Arc<Enrolment>,
    pub model: ModelInfo,
    pub server: ModelServer,
    /// The cluster's task's inbox: every input goes through it, in order.
    inbox: mpsc::UnboundedSender<Command>,
    /// The cluster as its task last published it (whenever something readers see changed).
    view: watch::Receiver<Arc<ClusterView>>,
    pub next_seq: AtomicU64,
    /// Control session numbers.
    pub next_session: AtomicU64,
    /// Node lease, ms (see [`Coordinator::set_lease`]).
    pub lease_ms: AtomicU64,
    /// The KV type plans use (see [`Coordinator::set_kv_type`]), read back at once.
    pub kv_type: std::sync::atomic::AtomicU8,
    /// Where plan epochs are recorded.
    pub store: Arc<dyn EnrolmentState>,
    /// Set by [`Coordinator::close`]: sessions ending now are the coordinator's own shutdown,
    /// not nodes leaving (nothing is re-planned).
    pub closing: std::sync::atomic::AtomicBool,
    /// Who may say what ([`crate::authz`]): roles, client admission, refusal counts.
    pub authz: crate::authz::Gate,
    /// Most positions per sequence in the plans made from now on: the configured
    /// `max_context` until a planner chooses a context that fits
    /// ([`Coordinator::set_max_context`]).
    pub max_context: std::sync::atomic::AtomicUsize,
    /// Sealed jobs: the desk that routes them, and the clients waiting for them.
    pub sealed: Mutex<crate::sealed::SealedEdge>,
}

/// What [`Shared`] is made of besides the cluster (which [`spawn_cluster`] starts).
pub(crate) struct SharedParts {
    pub id: NodeId,
    pub config: CoordinatorConfig,
    pub enrol: Arc<Enrolment>,
    pub model: ModelInfo,
    pub server: ModelServer,
    pub store: Arc<dyn EnrolmentState>,
    pub max_context: usize,
    pub sealed: crate::sealed::SealedEdge,
}

/// Starts the task that owns `cluster` and returns the state every session shares.
pub(crate) fn spawn_cluster(cluster: Cluster, parts: SharedParts) -> Arc<Shared> {
    let (inbox, commands) = mpsc::unbounded_channel();
    let (view_tx, view) = watch::channel(Arc::new(cluster.view()));
    let started = tokio::time::Instant::now();
    let shared = Arc::new(Shared {
        id: parts.id,
        config: parts.config,
        enrol: parts.enrol,
        model: parts.model,
        server: parts.server,
        inbox,
        view,
        next_seq: AtomicU64::new(1),
        next_session: AtomicU64::new(1),
        lease_ms: AtomicU64::new(cluster.lease().as_millis() as u64),
        kv_type: std::sync::atomic::AtomicU8::new(kv_code(cluster.membership().kv_type())),
        store: parts.store,
        closing: std::sync::atomic::AtomicBool::new(false),
        authz: crate::authz::Gate::new(),
        max_context: std::sync::atomic::AtomicUsize::new(parts.max_context),
        sealed: Mutex::new(parts.sealed),
    });
    let core = Core {
        cluster,
        outboxes: HashMap::new(),
        owners: HashMap::new(),
    };
    let (effects_tx, effects) = mpsc::unbounded_channel();
    tokio::spawn(drive_cluster(core, commands, view_tx, effects_tx, started));
    tokio::spawn(carry_out_effects(Arc::downgrade(&shared), effects));
    shared
}

/// The one task that owns the cluster: it takes each command in order, and the cluster's
/// timeouts when they come; carries out sends and run news itself (channel sends, the owners'
/// sinks), publishes the view when it changed, and hands the rest (closing a connection, the
/// sealed desk, writing a record) to [`carry_out_effects`]. Nothing heavy runs here: requests
/// come parsed, tokenized and checked; grammars compile on the nodes; model bytes are served by
/// their own streams.
async fn drive_cluster(
    mut core: Core,
    mut commands: mpsc::UnboundedReceiver<Command>,
    view: watch::Sender<Arc<ClusterView>>,
    effects: mpsc::UnboundedSender<Vec<Later>>,
    started: tokio::time::Instant,
) {
    loop {
        let next = core.cluster.poll_timeout();
        let timeout = async {
            match next {
                Some(t) => tokio::time::sleep_until(started + t).await,
                None => std::future::pending().await,
            }
        };
        let command = tokio::select! {
            c = commands.recv() => match c {
                Some(c) => c,
                // Every sender is gone: the coordinator was dropped.
                None => return,
            },
            () = timeout => Command::Input(ClusterInput::Timeout),
        };
        let later = core.step(started.elapsed(), command);
        if core.cluster.take_changed() {
            view.send_replace(Arc::new(core.cluster.view()));
        }
        if !later.is_empty() {
            let _ = effects.send(later);
        }
    }
}

/// Carries out, in order, what the cluster said that is not a send: closing a connection, the
/// sealed desk, a durable record, a refusal.
async fn carry_out_effects(
    shared: std::sync::Weak<Shared>,
    mut effects: mpsc::UnboundedReceiver<Vec<Later>>,
) {
    while let Some(batch) = effects.recv().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        for l in batch {
            match l {
                Later::Expired(conn) => {
                    conn.close("lease expired");
                    crate::sealed::edge::node_left(
                        &shared,
                        crate::sealed::edge::node_key(&conn.peer_key()),
                    );
                }
                Later::Left(key) => {
                    crate::sealed::edge::node_left(&shared, crate::sealed::edge::node_key(&key));
                }
                Later::Record(mut rec) => {
                    rec.recorded_at_unix_ms = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64);
                    let store = shared.store.clone();
                    let written = tokio::task::spawn_blocking(move || store.record_epoch(&rec));
                    if let Ok(Err(e)) = written.await {
                        tracing::warn!("recording an epoch: {e}");
                    }
                }
                Later::Refused(node, why) => shared.authz.refuse(node, &why),
            }
        }
    }
}

impl Core {
    fn step(&mut self, now: Duration, command: Command) -> Vec<Later> {
        match command {
            Command::Input(input) => self.handle(now, input),
            Command::Open { member, outbox } => {
                self.outboxes.insert(member.node_id, outbox);
                self.handle(now, ClusterInput::Joined(member))
            }
            Command::Close { node, session } => {
                if self
                    .outboxes
                    .get(&node)
                    .is_some_and(|s| s.session == session)
                {
                    self.outboxes.remove(&node);
                }
                self.handle(now, ClusterInput::Left { node, session })
            }
            Command::Submit { run, input, owner } => {
                self.owners.insert(run, owner);
                self.handle(now, input)
            }
            Command::ToNode { to, msg } => {
                if let Some(s) = self.outboxes.get(&to) {
                    let _ = s.tx.send(*msg);
                }
                Vec::new()
            }
            Command::Set(setting) => {
                match setting {
                    Setting::Lease(l) => self.cluster.set_lease(l),
                    Setting::MaxContext(n) => self.cluster.set_max_context(n),
                    Setting::KvType(k) => self.cluster.set_kv_type(k),
                    Setting::ExpertSplit(x) => self.cluster.set_expert_split(x),
                    Setting::Closing => self.cluster.set_closing(),
                }
                Vec::new()
            }
        }
    }

    /// Feeds the cluster one input; carries out sends and run news at once and returns the
    /// rest.
    fn handle(&mut self, now: Duration, input: ClusterInput) -> Vec<Later> {
        let mut later = Vec::new();
        for o in self.cluster.handle(now, input) {
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
                        later.push(Later::Expired(s.conn));
                    }
                }
                ClusterOutput::NodeLeft { key, .. } => later.push(Later::Left(key)),
                ClusterOutput::RecordEpoch(r) => later.push(Later::Record(r)),
                ClusterOutput::Refused { node, why } => later.push(Later::Refused(node, why)),
            }
        }
        later
    }
}

impl Shared {
    pub fn max_context(&self) -> usize {
        self.max_context.load(Ordering::SeqCst)
    }

    /// The sealed-job desk.
    pub fn sealed(&self) -> std::sync::MutexGuard<'_, crate::sealed::SealedEdge> {
        self.sealed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cluster as its task last published it.
    pub fn view(&self) -> Arc<ClusterView> {
        self.view.borrow().clone()
    }

    /// Hands the cluster's task a command (dropped if the coordinator is going away).
    pub fn command(&self, command: Command) {
        let _ = self.inbox.send(command);
    }

    /// Feeds the cluster one input.
    pub fn handle(&self, input: ClusterInput) {
        self.command(Command::Input(input));
    }

    /// Makes `tx` and `conn` node `member`'s current control session (replacing an older one
    /// of a node that reconnected) and tells the cluster it joined; returns the session's
    /// number.
    pub fn open_session(
        &self,
        mut member: Member,
        tx: mpsc::UnboundedSender<CoordToNode>,
        conn: Connection,
    ) -> u64 {
        let session = self.next_session.fetch_add(1, Ordering::Relaxed);
        member.session = session;
        self.command(Command::Open {
            member: Box::new(member),
            outbox: NodeOutbox { session, tx, conn },
        });
        session
    }

    /// Ends node `id`'s control session `session` (a newer session may have replaced it: then
    /// the node has not left).
    pub fn close_session(&self, id: NodeId, session: u64) {
        self.command(Command::Close { node: id, session });
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
        self.command(Command::Submit { run, input, owner });
    }

    /// The node lease.
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms.load(Ordering::Relaxed).max(1))
    }

    /// Sends a message to a node, if it has a session.
    pub fn send(&self, to: NodeId, msg: CoordToNode) -> bool {
        let connected = self.view().has_session(&to);
        if connected {
            self.command(Command::ToNode {
                to,
                msg: Box::new(msg),
            });
        }
        connected
    }
}

/// The KV type as a number, and back ([`Shared::kv_type`]).
pub(crate) fn kv_code(k: tessera_model::kv::KvType) -> u8 {
    use tessera_model::kv::KvType;
    match k {
        KvType::F32 => 0,
        KvType::F16 => 1,
        KvType::Q8_0 => 2,
    }
}

pub(crate) fn kv_of(code: u8) -> tessera_model::kv::KvType {
    use tessera_model::kv::KvType;
    match code {
        0 => KvType::F32,
        2 => KvType::Q8_0,
        _ => KvType::F16,
    }
}

/// A run's owner: called with each piece of its news on the cluster's task, where the node's
/// message is handled. It must only hand the news on (a channel send, a counter).
pub(crate) type RunOwner = Box<dyn FnMut(RunNews) + Send>;

/// What the cluster's task hands on.
enum Later {
    Expired(Connection),
    Left(tessera_net::PublicKey),
    Record(Box<crate::state::EpochRecord>),
    Refused(NodeId, crate::authz::Refusal),
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
    let m = view.membership();
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
