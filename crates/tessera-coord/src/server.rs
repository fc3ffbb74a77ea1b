//! The coordinator's I/O loop: the QUIC endpoint, enrolment, control sessions of nodes and
//! clients, and model streams. Decisions are made by [`Membership`] (pure); this module feeds it
//! events and carries out its actions.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_host::Manifest;
use tessera_model::{GgufFile, ModelConfig, Tokenizer};
use tessera_net::{
    measure_link, Accepted, Connection, Endpoint, FramedStream, JoinToken, NodeId, NodeIdentity,
};
use tessera_proto::{
    frame, limits, stream, CoordToNode, Hello, MemberStatus, NodeToCoord, Role, StageSpec,
    PROTOCOL_VERSION,
};
use tokio::sync::{mpsc, watch};

use crate::distribute::ModelServer;
use crate::enrol::Enrolment;
use crate::error::CoordError;
use crate::membership::{Action, Event, Member, Membership, Phase};
use crate::replan::ModelBytes;
use crate::state::{EnrolmentState, EpochRecord, EpochStageRecord, RedbState};

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

/// Where the current epoch is, for drivers waiting on it.
#[derive(Clone, Debug, PartialEq)]
pub enum EpochStatus {
    None,
    Pending(u64),
    Ready(u64),
    Failed(u64, String),
}

pub(crate) struct State {
    pub membership: Membership,
    /// Each connected node's current control session and its outbox.
    senders: HashMap<NodeId, NodeSender>,
    sessions: u64,
    pub routes: HashMap<u64, mpsc::UnboundedSender<crate::driver::RouteMsg>>,
    /// The latest expert-cache counters each node streaming experts from disk reported.
    pub expert_cache: HashMap<NodeId, tessera_proto::ExpertCacheStats>,
}

/// A node's current control session: its number, its outbox, and its connection (closed when
/// the membership says the lease expired).
struct NodeSender {
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
    pub state: Mutex<State>,
    pub epoch_tx: watch::Sender<EpochStatus>,
    pub next_seq: AtomicU64,
    /// Node lease, ms (see [`Coordinator::set_lease`]).
    pub lease_ms: AtomicU64,
    /// Where plan epochs are recorded.
    pub store: Arc<dyn EnrolmentState>,
    /// Set by [`Coordinator::close`]: sessions ending now are the coordinator's own shutdown,
    /// not nodes leaving (nothing is re-planned).
    pub closing: std::sync::atomic::AtomicBool,
    /// The origin of the `now` given to the membership machine (leases).
    pub started: tokio::time::Instant,
    /// Who may say what ([`crate::authz`]): roles, client admission, refusal counts.
    pub authz: crate::authz::Gate,
    /// Most positions per sequence in the plans made from now on: the configured
    /// `max_context` until a planner chooses a context that fits
    /// ([`Coordinator::set_max_context`]).
    pub max_context: std::sync::atomic::AtomicUsize,
}

impl Shared {
    pub fn max_context(&self) -> usize {
        self.max_context.load(Ordering::SeqCst)
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Feeds an event to the membership machine and carries out its actions.
    pub fn apply(&self, event: Event) {
        let mut st = self.lock();
        self.apply_locked(&mut st, event);
    }

    /// [`Shared::apply`] with the state already locked (to decide and act atomically).
    pub(crate) fn apply_locked(&self, st: &mut State, event: Event) {
        let before = st.membership.epoch().map(|e| (e.id, e.phase.clone()));
        let actions = st.membership.handle(event);
        for a in actions {
            match a {
                Action::Send { to, msg } => {
                    if let Some(s) = st.senders.get(&to) {
                        let _ = s.tx.send(msg.0);
                    }
                }
                Action::LeaseExpired { node, session } => {
                    // The node is already planned around; end its session so that it
                    // reconnects (and starts afresh) if it is still there.
                    if st.senders.get(&node).is_some_and(|s| s.session == session) {
                        let s = st.senders.remove(&node).expect("checked");
                        let name = st.membership.member(&node).map_or("", |m| &m.name);
                        tracing::info!(
                            event = "lease_expired",
                            node = %name,
                            node_id = %node,
                            "lease expired: {name} {node} silent for {} ms",
                            self.lease().as_millis()
                        );
                        s.conn.close("lease expired");
                    }
                }
                Action::EpochReady(e) => {
                    tracing::info!(event = "epoch_ready", epoch = e, "epoch {e} is ready");
                    // Who holds which experts in it (an expert split; after a loss the
                    // survivors hold the departed owner's): one event per holder.
                    for g in st
                        .membership
                        .epoch_expert_split()
                        .map_or(&[][..], |x| &x.groups)
                    {
                        // A group names its node by name or by (a prefix of) its id.
                        let name = st
                            .membership
                            .members()
                            .find(|m| {
                                m.name == g.node || m.node_id.to_string().starts_with(&g.node)
                            })
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
                Action::EpochFailed { epoch, reason } => {
                    tracing::warn!(event = "epoch_failed", epoch, %reason, "epoch {epoch} failed: {reason}");
                }
                Action::Note(note) => tracing::info!("{note}"),
                Action::Refused { node, why } => self.authz.refuse(node, &why),
            }
        }
        // The status drivers wait on follows the membership's current epoch.
        let after = st.membership.epoch().map(|e| (e.id, e.phase.clone()));
        let status = match &after {
            None => EpochStatus::None,
            Some((id, Phase::Loading | Phase::Linking)) => EpochStatus::Pending(*id),
            Some((id, Phase::Ready)) => EpochStatus::Ready(*id),
            Some((id, Phase::Failed(r))) => EpochStatus::Failed(*id, r.clone()),
            Some((id, Phase::Released)) => EpochStatus::Failed(*id, "released".into()),
        };
        self.epoch_tx.send_if_modified(|s| {
            if *s == status {
                false
            } else {
                *s = status;
                true
            }
        });
        if before != after {
            self.record_epoch(&st.membership);
        }
    }

    /// Records the current epoch (its placement, phase and load evidence) durably.
    fn record_epoch(&self, m: &Membership) {
        let Some(e) = m.epoch() else { return };
        let rec = EpochRecord {
            epoch: e.id,
            model: e.model,
            phase: match &e.phase {
                Phase::Loading => "loading".into(),
                Phase::Linking => "linking".into(),
                Phase::Ready => "ready".into(),
                Phase::Failed(r) => format!("failed: {r}"),
                Phase::Released => "released".into(),
            },
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
            recorded_at_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        };
        if let Err(e) = self.store.record_epoch(&rec) {
            tracing::warn!("recording epoch {}: {e}", rec.epoch);
        }
    }

    /// The node lease.
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms.load(Ordering::Relaxed).max(1))
    }

    /// Sends a message to a node, if it is connected.
    pub fn send(&self, to: NodeId, msg: CoordToNode) -> bool {
        self.lock()
            .senders
            .get(&to)
            .is_some_and(|s| s.tx.send(msg).is_ok())
    }
}

/// A bound coordinator.
pub struct Coordinator {
    shared: Arc<Shared>,
    endpoint: Endpoint,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("id", &self.shared.id)
            .finish_non_exhaustive()
    }
}

impl Coordinator {
    /// Loads identity, enrolment state and the model's metadata, describes the model file by
    /// content, and binds the endpoint. Must run inside a tokio runtime.
    pub async fn bind(config: CoordinatorConfig) -> Result<Self, CoordError> {
        std::fs::create_dir_all(&config.data_dir).map_err(|e| CoordError::Io {
            context: format!("creating {}", config.data_dir.display()),
            source: e,
        })?;
        let identity = NodeIdentity::load_or_create(&config.data_dir)?;
        let store: Arc<dyn EnrolmentState> = Arc::new(RedbState::open(&config.data_dir)?);
        // A data directory from before the database: take its `state.json` over once.
        {
            let snap = store.load()?;
            if snap.token.is_none() && snap.nodes.is_empty() {
                let old = crate::state::JsonFileState::new(&config.data_dir).load()?;
                if old.token.is_some() || !old.nodes.is_empty() {
                    tracing::info!("importing state.json into state.redb");
                    store.save(&old)?;
                }
            }
        }
        let last_epoch = store.last_epoch()?;
        let enrol = Enrolment::open(Box::new(store.clone()), identity.node_id())?;
        let path = config.model.clone();
        let chunk_size = config.chunk_size;
        let (model, manifest) =
            tokio::task::spawn_blocking(move || -> Result<(ModelInfo, Manifest), CoordError> {
                let g = GgufFile::open(&path)?;
                let config = ModelConfig::from_gguf(&g)?;
                let tokenizer = Tokenizer::from_gguf(&g)?;
                // The same stop set as `tessera generate`: end-of-generation tokens, and BOS
                // (a llama-family model that emits BOS has finished its document).
                let mut eog: Vec<u32> = (0..tokenizer.vocab_size() as u32)
                    .filter(|&t| tokenizer.is_end_of_generation(t))
                    .collect();
                eog.extend(tokenizer.bos_id());
                let name = path
                    .file_stem()
                    .map_or("model".into(), |s| s.to_string_lossy().into_owned());
                let manifest = Manifest::from_gguf_with(&path, chunk_size, &mut |_, _| {})?;
                Ok((
                    ModelInfo {
                        name,
                        config,
                        tokenizer,
                        eog,
                    },
                    manifest,
                ))
            })
            .await
            .map_err(|e| CoordError::Protocol(format!("model task: {e}")))??;
        let server = ModelServer::new(&config.model, manifest, config.progress)?;
        let max_context = config.max_context;
        let endpoint = Endpoint::bind(config.listen, &identity, enrol.clone())?;
        let (epoch_tx, _) = watch::channel(EpochStatus::None);
        let mut membership = Membership::new();
        if let Some(last) = last_epoch {
            tracing::info!(
                event = "epochs_continue",
                after = last,
                "plan epochs continue after {last}"
            );
            membership.continue_epochs_after(last);
        }
        membership.set_model_bytes(Some(model_bytes(server.manifest(), model.config.n_expert)));
        membership.set_lease(DEFAULT_LEASE);
        let coordinator = Self {
            shared: Arc::new(Shared {
                id: identity.node_id(),
                config,
                enrol,
                model,
                server,
                state: Mutex::new(State {
                    membership,
                    senders: HashMap::new(),
                    sessions: 0,
                    routes: HashMap::new(),
                    expert_cache: HashMap::new(),
                }),
                epoch_tx,
                next_seq: AtomicU64::new(1),
                lease_ms: AtomicU64::new(DEFAULT_LEASE.as_millis() as u64),
                store,
                closing: std::sync::atomic::AtomicBool::new(false),
                started: tokio::time::Instant::now(),
                authz: crate::authz::Gate::new(),
                max_context: std::sync::atomic::AtomicUsize::new(max_context),
            }),
            endpoint,
        };
        spawn_lease_clock(Arc::downgrade(&coordinator.shared));
        Ok(coordinator)
    }

    pub fn local_addr(&self) -> Result<SocketAddr, CoordError> {
        Ok(self.endpoint.local_addr()?)
    }

    pub fn node_id(&self) -> NodeId {
        self.shared.id
    }

    pub fn token(&self) -> &JoinToken {
        self.shared.enrol.token()
    }

    /// The operator token (clients that place stages and administer credentials).
    pub fn operator_token(&self) -> &JoinToken {
        self.shared.enrol.operator_token()
    }

    /// Messages refused by [`crate::authz`] so far.
    pub fn refused_messages(&self) -> u64 {
        self.shared.authz.refused()
    }

    pub fn model(&self) -> &ModelInfo {
        &self.shared.model
    }

    pub fn manifest(&self) -> &Manifest {
        self.shared.server.manifest()
    }

    /// Sets the node lease: a node silent this long (no heartbeat, no message) is declared gone
    /// and planned around. Nodes heartbeat four times per lease. Default [`DEFAULT_LEASE`].
    pub fn set_lease(&self, lease: Duration) {
        self.shared.lock().membership.set_lease(lease);
        self.shared
            .lease_ms
            .store(lease.as_millis().max(1) as u64, Ordering::Relaxed);
    }

    /// The last plan epoch handed out (continues across restarts).
    pub fn last_epoch(&self) -> u64 {
        self.shared.lock().membership.last_epoch_id()
    }

    /// Why no epoch can be placed right now (no feasible plan on the connected nodes), for a
    /// front end to answer "503 Service Unavailable" with; `None` when the cluster has capacity.
    pub fn outage(&self) -> Option<String> {
        self.shared.lock().membership.outage().map(str::to_string)
    }

    /// The shared state, for the gateway backend in this crate.
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Accepts connections until the endpoint is closed.
    pub async fn run(&self) -> Result<(), CoordError> {
        while let Some(incoming) = self.endpoint.accept().await {
            let shared = self.shared.clone();
            tokio::spawn(async move {
                let from = incoming.remote_addr();
                let conn = match incoming.handshake().await {
                    Ok(Accepted::Peer(c)) => c,
                    Ok(Accepted::Enrolment(req)) => {
                        let id = req.peer_id();
                        // Bounded: unknown keys cannot hold more than a few enrolments open.
                        let Some(_slot) = shared.authz.enrolment_slot() else {
                            let why = "too many enrolments in progress; retry later";
                            let _ = req.refuse(tessera_net::Refusal::Other(why.into()));
                            shared.authz.log_net(Some(id), &why, || {
                                format!("refused enrolment of {id}: {why}")
                            });
                            return;
                        };
                        match shared.enrol.complete(req).await {
                            Ok(c) => {
                                tracing::info!(event = "enrolled", node_id = %id, "enrolled node {id}");
                                c
                            }
                            Err(e) => {
                                shared.authz.log_net(Some(id), &e, || {
                                    format!("refused enrolment of {id} from {from}: {e}")
                                });
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        shared.authz.log_net(None, &e, || {
                            format!("refused a connection from {from}: {e}")
                        });
                        return;
                    }
                };
                serve_connection(shared, conn).await;
            });
        }
        Ok(())
    }

    /// The latest expert-cache counters of each node that streams its experts from disk.
    pub fn expert_cache(&self) -> Vec<(NodeId, tessera_proto::ExpertCacheStats)> {
        let mut v: Vec<_> = self
            .shared
            .lock()
            .expert_cache
            .iter()
            .map(|(id, c)| (*id, *c))
            .collect();
        v.sort_by_key(|(id, _)| id.to_string());
        v
    }

    /// Connected nodes in join order, with the inventory, budget and link each reported (for
    /// planning from measured inventory, [`crate::planning`]).
    pub fn connected_members(&self) -> Vec<crate::membership::Member> {
        self.shared
            .lock()
            .membership
            .connected()
            .into_iter()
            .cloned()
            .collect()
    }

    /// Applies an assignment now, as `--split` does once enough nodes are connected: checks the
    /// stages against the model and the connected nodes and starts a new epoch. Returns the
    /// `(node, layers)` placed, in ring order.
    pub fn apply_stages(
        &self,
        stages: &[StageSpec],
    ) -> Result<Vec<(NodeId, std::ops::Range<usize>)>, crate::assignment::AssignmentError> {
        let n_layer = self.shared.model.config.n_layer;
        let placed = {
            let st = self.shared.lock();
            let nodes = st.membership.candidates();
            crate::assignment::resolve(stages, n_layer, &nodes)?
        };
        self.shared.apply(Event::Plan {
            model: self.shared.server.manifest().model_hash,
            stages: placed.clone(),
            n_layer,
            max_context: self.shared.max_context(),
        });
        Ok(placed)
    }

    /// Most positions per sequence in the plans made from now on (a planner's choice of the
    /// context that fits; call before applying its stages).
    pub fn set_max_context(&self, positions: usize) {
        self.shared.max_context.store(positions, Ordering::SeqCst);
    }

    pub fn max_context(&self) -> usize {
        self.shared.max_context()
    }

    /// The KV cache type stages are assigned from the next plan on (call before nodes join for
    /// the first plan to use it).
    pub fn set_kv_type(&self, kv_type: tessera_model::kv::KvType) {
        self.shared.lock().membership.set_kv_type(kv_type);
    }

    pub fn kv_type(&self) -> tessera_model::kv::KvType {
        self.shared.lock().membership.kv_type()
    }

    /// Splits every MoE layer's experts across nodes in the plans made from now on (call before
    /// nodes join for the initial split to use it).
    pub fn set_expert_split(&self, split: Option<crate::assignment::ExpertSplit>) {
        self.shared.lock().membership.set_expert_split(split);
    }

    /// Closes every connection (peers are told at once) and stops accepting.
    pub fn close(&self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        self.endpoint.close();
    }

    /// Waits (at most a second) until closed connections are shut down.
    pub async fn wait_idle(&self) {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), self.endpoint.wait_idle())
            .await;
    }
}

async fn serve_connection(shared: Arc<Shared>, conn: Connection) {
    loop {
        let s = match conn.accept_stream().await {
            Ok(Some(s)) => s,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("connection {}: {e}", conn.peer_id().short());
                return;
            }
        };
        let (shared, conn) = (shared.clone(), conn.clone());
        match s.kind {
            stream::CONTROL => {
                tokio::spawn(async move {
                    let peer = conn.peer_id().short();
                    if let Err(e) = control_session(shared, conn, s).await {
                        tracing::warn!("control stream of {peer}: {e}");
                    }
                });
            }
            stream::MODEL => {
                tokio::spawn(async move {
                    let peer = conn.peer_id().short();
                    let mut s = s;
                    s.reader.set_max_len(limits::CONTROL);
                    if let Err(e) = shared.server.serve(s, peer.clone()).await {
                        tracing::warn!("model stream of {peer}: {e}");
                    }
                });
            }
            kind => {
                tracing::info!(
                    "{}: refusing a stream of unknown kind {kind:#06x}",
                    conn.peer_id().short()
                );
                let mut s = s;
                let _ = s.writer.finish().await;
            }
        }
    }
}

async fn control_session(
    shared: Arc<Shared>,
    conn: Connection,
    mut s: FramedStream,
) -> Result<(), CoordError> {
    s.reader.set_max_len(limits::CONTROL);
    let first = s.reader.recv_kind(frame::MSG, "a hello").await?;
    let v: serde_json::Value = serde_json::from_slice(&first)
        .map_err(|e| CoordError::Protocol(format!("malformed hello: {e}")))?;
    let hello: Hello = match v.get("type").and_then(|t| t.as_str()) {
        Some("hello") => serde_json::from_value(v)
            .map_err(|e| CoordError::Protocol(format!("malformed hello: {e}")))?,
        _ => {
            return Err(CoordError::Protocol(
                "the first message must be a hello".into(),
            ))
        }
    };
    if hello.protocol_version != PROTOCOL_VERSION {
        let reason = format!(
            "protocol version mismatch: the coordinator speaks {PROTOCOL_VERSION}, the peer {}",
            hello.protocol_version
        );
        let msg = CoordToNode::Refused {
            reason: reason.clone(),
        };
        let _ = s_write(&mut s.writer, &msg).await;
        let _ = s.writer.finish().await;
        return Err(CoordError::Protocol(reason));
    }
    if let Err(r) = shared
        .enrol
        .bind_name(&conn.peer_key(), &hello.name, hello.role)
    {
        let reason = r.to_string();
        let _ = s_write(
            &mut s.writer,
            &CoordToNode::Refused {
                reason: reason.clone(),
            },
        )
        .await;
        let _ = s.writer.finish().await;
        return Err(CoordError::Protocol(reason));
    }
    shared.authz.track(&conn);
    match hello.role {
        Role::Node => node_session(shared, conn, s, hello).await,
        Role::Client => crate::driver::client_session(shared, conn, s).await,
    }
}

async fn s_write<T: serde::Serialize>(
    w: &mut tessera_net::FrameWriter<tessera_net::quinn::SendStream>,
    msg: &T,
) -> Result<(), CoordError> {
    Ok(w.write_message(frame::MSG, msg).await?)
}

async fn node_session(
    shared: Arc<Shared>,
    conn: Connection,
    s: FramedStream,
    hello: Hello,
) -> Result<(), CoordError> {
    let id = conn.peer_id();
    let FramedStream {
        mut reader,
        mut writer,
        ..
    } = s;
    let (tx, mut rx) = mpsc::unbounded_channel::<CoordToNode>();
    let _ = tx.send(CoordToNode::Welcome {
        protocol_version: PROTOCOL_VERSION,
        coordinator: shared.id,
        observed_addr: conn.remote_addr(),
    });
    let lease = shared.lease();
    let lease_msg = CoordToNode::Lease {
        heartbeat_ms: (lease.as_millis() as u64 / 4).max(1),
        lease_ms: lease.as_millis() as u64,
    };
    let _ = tx.send(lease_msg.clone());
    // The coordinator's own heartbeat: the lease, repeated.
    let _beat = {
        let tx = tx.clone();
        AbortOnDrop(tokio::spawn(async move {
            let mut tick = tokio::time::interval((lease / 4).max(Duration::from_millis(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                if tx.send(lease_msg.clone()).is_err() {
                    break;
                }
            }
        }))
    };
    // The port the node listens on, sent right after its hello (see
    // `NodeToCoord::Listening`); any other first message is handled after the join.
    let mut addr = conn.remote_addr();
    let mut early = None;
    match tokio::time::timeout(lease, reader.read_frame()).await {
        Ok(Ok(Some(f))) if f.kind == frame::MSG => match f.json::<NodeToCoord>() {
            Ok(NodeToCoord::Listening { addr: a }) => addr = peer_addr(addr, a),
            Ok(m) => early = Some(m),
            Err(e) => return Err(e.into()),
        },
        Ok(Ok(Some(f))) => {
            return Err(CoordError::Protocol(format!(
                "unexpected frame kind {:#06x} on a control stream",
                f.kind
            )))
        }
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => {}
    }
    let writer_task = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if writer.write_message(frame::MSG, &m).await.is_err() {
                break;
            }
        }
    });
    let session = {
        let mut st = shared.lock();
        st.sessions += 1;
        let session = st.sessions;
        st.senders.insert(
            id,
            NodeSender {
                session,
                tx,
                conn: conn.clone(),
            },
        );
        session
    };
    shared.apply(Event::Joined(Box::new(Member {
        node_id: id,
        key: conn.peer_key(),
        name: hello.name.clone(),
        addr,
        connected: true,
        joined: 0,
        memory_budget_bytes: hello.memory_budget_bytes,
        inventory: hello.inventory.map(|b| *b),
        models: hello.models,
        link: None,
        session,
    })));
    tracing::info!(
        event = "node_joined",
        node = %hello.name,
        node_id = %id,
        session,
        "node joined: {} {} at {addr}",
        hello.name,
        id
    );
    // Measure the link to the node in the background.
    {
        let (shared, conn) = (shared.clone(), conn.clone());
        tokio::spawn(async move {
            match measure_link(&conn, 8, 1 << 20).await {
                Ok(link) => {
                    tracing::info!(
                        "link to {}: rtt {:?}, {:.1} MB/s",
                        id.short(),
                        link.rtt_median,
                        link.bytes_per_s / 1e6
                    );
                    shared.apply(Event::LinkMeasured { node: id, link });
                }
                Err(e) => tracing::warn!("measuring the link to {}: {e}", id.short()),
            }
        });
    }
    maybe_apply_initial_split(&shared);
    if let Some(m) = early {
        handle_node_message(&shared, id, m);
    }

    let result = async {
        loop {
            // Every message renews the lease (the membership machine expires it: a node
            // silent for a whole lease, dead, frozen or cut off, is declared gone and this
            // session is closed under the read).
            let Some(f) = reader.read_frame().await? else {
                break;
            };
            shared.apply(Event::Heard {
                node: id,
                session,
                now: shared.started.elapsed(),
            });
            if f.kind != frame::MSG {
                return Err(CoordError::Protocol(format!(
                    "unexpected frame kind {:#06x} on a control stream",
                    f.kind
                )));
            }
            let msg: NodeToCoord = f.json()?;
            handle_node_message(&shared, id, msg);
        }
        Ok(())
    }
    .await;
    writer_task.abort();
    tracing::info!(event = "node_left", node = %hello.name, node_id = %id, "node left: {} {}", hello.name, id);
    let current = {
        let mut st = shared.lock();
        let current = st.senders.get(&id).is_some_and(|s| s.session == session);
        if current {
            st.senders.remove(&id);
        }
        current
    };
    // If it held a stage, the membership fails the epoch and plans one on the survivors;
    // drivers see the epoch change and resume their sequences on the new one.
    if current && !shared.closing.load(Ordering::SeqCst) {
        shared.apply(Event::Left { node: id, session });
    }
    result
}

fn handle_node_message(shared: &Shared, id: NodeId, msg: NodeToCoord) {
    let sender = crate::authz::SenderFacts {
        node: id,
        grant: crate::authz::Grant::Node,
    };
    if shared.authz.check_node(&sender, &msg).is_err() {
        return;
    }
    let seq = match &msg {
        NodeToCoord::Hello(_) => {
            tracing::warn!("{}: a second hello; ignored", id.short());
            return;
        }
        NodeToCoord::Heartbeat { expert_cache } => {
            if let Some(c) = expert_cache {
                let mut st = shared.lock();
                if st.expert_cache.insert(id, *c) != Some(*c) {
                    let name = st
                        .membership
                        .member(&id)
                        .map_or_else(|| id.short(), |m| m.name.clone());
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
            }
            return;
        }
        NodeToCoord::Listening { .. } => return,
        NodeToCoord::Loaded { epoch, report } => {
            return shared.apply(Event::Loaded {
                node: id,
                epoch: *epoch,
                report: report.clone(),
            })
        }
        NodeToCoord::LoadFailed { epoch, reason } => {
            return shared.apply(Event::LoadFailed {
                node: id,
                epoch: *epoch,
                reason: reason.clone(),
            })
        }
        NodeToCoord::Linked { epoch, link } => {
            return shared.apply(Event::Linked {
                node: id,
                epoch: *epoch,
                link: *link,
            })
        }
        NodeToCoord::LinkFailed { epoch, reason } => {
            return shared.apply(Event::LinkFailed {
                node: id,
                epoch: *epoch,
                reason: reason.clone(),
            })
        }
        NodeToCoord::Inventory(inv) => {
            return shared.apply(Event::InventoryMeasured {
                node: id,
                inventory: inv.clone(),
            })
        }
        NodeToCoord::Opened { seq }
        | NodeToCoord::OpenFailed { seq, .. }
        | NodeToCoord::Token { seq, .. }
        | NodeToCoord::Finished { seq, .. }
        | NodeToCoord::Closed { seq, .. } => *seq,
        NodeToCoord::Trace(t) => t.seq,
    };
    if let Some(r) = shared.lock().routes.get(&seq) {
        let _ = r.send(crate::driver::RouteMsg::Node(id, msg));
    }
}

/// Applies `--split` once enough nodes are connected and no epoch exists yet.
fn maybe_apply_initial_split(shared: &Shared) {
    let Some(split) = &shared.config.split else {
        return;
    };
    let stages = {
        let st = shared.lock();
        if st.membership.epoch().is_some() || !st.membership.expert_split_ready() {
            return;
        }
        let nodes = st.membership.candidates();
        match crate::assignment::resolve(split, shared.model.config.n_layer, &nodes) {
            Ok(s) => s,
            Err(_) => return,
        }
    };
    shared.apply(Event::Plan {
        model: shared.server.manifest().model_hash,
        stages,
        n_layer: shared.model.config.n_layer,
        max_context: shared.max_context(),
    });
}

/// The membership's clock: a [`Event::Tick`] four times per lease, until the coordinator is
/// dropped.
fn spawn_lease_clock(shared: std::sync::Weak<Shared>) {
    tokio::spawn(async move {
        loop {
            let period = match shared.upgrade() {
                Some(s) => {
                    // A coordinator shutting down declares no one gone.
                    if !s.closing.load(Ordering::SeqCst) {
                        s.apply(Event::Tick {
                            now: s.started.elapsed(),
                        });
                    }
                    (s.lease() / 4).max(Duration::from_millis(1))
                }
                None => return,
            };
            tokio::time::sleep(period).await;
        }
    });
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The address peers should dial for a node that listens on `advertised` and was seen at
/// `observed`: the advertised port at the observed host when the hosts agree (or the node
/// listens on every address), else what was observed (e.g. behind NAT).
fn peer_addr(observed: SocketAddr, advertised: SocketAddr) -> SocketAddr {
    if advertised.ip().is_unspecified() {
        SocketAddr::new(observed.ip(), advertised.port())
    } else if advertised.ip() == observed.ip() {
        advertised
    } else {
        observed
    }
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
    let st = shared.lock();
    let members = st
        .membership
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
    (members, st.membership.epoch().map(|e| e.id))
}
