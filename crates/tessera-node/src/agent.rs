//! The node agent: the long-running process a contributor starts on each machine.
//!
//! 1. **Identity**: an ed25519 key made on first start in the data directory (`node.key`,
//!    mode 0600); the node id is derived from the public key.
//! 2. **Inventory**: the node measures itself ([`crate::inventory`]) and resolves its memory
//!    budget; it never accepts an assignment or a sequence beyond it.
//! 3. **Enrolment**: with a join token (`TOKEN@HOST:PORT`) it proves the token to the
//!    coordinator over an authenticated QUIC session ([`tessera_net::Endpoint::enroll`]), and
//!    records the coordinator's key and address (`coordinator.json`) so that later starts need
//!    no token and pin that key.
//! 4. **Control session**: [`Hello`] (protocol version, inventory, budget, local models), then
//!    the coordinator's [`CoordToNode`] messages: assignments, link-up, sequences.
//! 5. **Assignment**: fetch the manifest, receive the missing tensors into the shard store
//!    ([`crate::fetch_net`]) or read a local copy with the same hash, load the layer range with
//!    the engine, report [`LoadReport`].
//! 6. **Ring**: admit the previous stage's key, dial the next stage (pinning its key), measure
//!    the link, open a [`stream::RING`] stream; the [`Stage`] runs on its own thread and its
//!    outputs go to the ring and the coordinator.
//!
//! Every stream is read with a size limit for its kind; a malformed frame on a ring stream ends
//! that stream (and is logged), never the node.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tessera_engine::{ExpertSelection, ExpertStreaming, LoadSpec, Model};
use tessera_model::GgufFile;
use tessera_net::{
    measure_link, Accepted, AllowList, Connection, Endpoint, FrameWriter, JoinToken,
    LinkMeasurement, NodeIdentity, PublicKey,
};
use tokio::sync::mpsc;

use crate::error::FabricError;
use crate::fetch_net::{assignment_needs, fetch_manifest, fetch_needs};
use crate::inventory::{measure, Inventory, MemoryBudget, ProbeOptions};
use crate::protocol::{
    frame, limits, stream, CoordToNode, ExpertAssignment, ExpertCacheStats, FinishReason, Hello,
    LoadReport, NodeToCoord, OpenSeq, RingToken, Role, StageAssignment, StepHeader,
    PROTOCOL_VERSION,
};
use crate::stage::{Stage, StageOutput};
use crate::store::{Manifest, ShardStore};

/// Where and how to join: `TOKEN@HOST:PORT`.
#[derive(Clone, Debug)]
pub struct JoinTarget {
    pub token: JoinToken,
    pub addr: SocketAddr,
}

impl FromStr for JoinTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (token, addr) = s
            .trim()
            .rsplit_once('@')
            .ok_or_else(|| "expected TOKEN@HOST:PORT".to_string())?;
        let token: JoinToken = token.parse().map_err(|e| format!("{e}"))?;
        let addr = addr
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {addr}: {e}"))?
            .next()
            .ok_or_else(|| format!("{addr} resolves to no address"))?;
        Ok(Self { token, addr })
    }
}

/// How hard the start-up probes work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeLevel {
    /// Full probes (hundreds of MiB of memory and disk traffic, ~2 s).
    Full,
    /// Small buffers, short limits: for tests and quick starts. Figures are less accurate.
    Quick,
}

/// The agent's settings, validated by the CLI.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub data_dir: PathBuf,
    /// Enrol with this token (and coordinator); `None` reconnects to the recorded coordinator.
    pub join: Option<JoinTarget>,
    /// UDP address to bind (peers dial it; the coordinator is dialled from it).
    pub listen: SocketAddr,
    pub name: Option<String>,
    pub memory_budget: Option<MemoryBudget>,
    /// A local copy of a model: adopted (hashed) at start, never downloaded.
    pub model: Option<PathBuf>,
    /// Compute threads for the engine.
    pub threads: usize,
    pub probe: ProbeLevel,
    /// Draw progress bars on stderr (when it is a terminal).
    pub progress: bool,
    /// Stream assigned experts from disk with at most this many bytes of them in memory
    /// (`None`: only when the assigned experts exceed the memory budget).
    pub expert_budget: Option<u64>,
}

/// The coordinator this node enrolled with, pinned from then on.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CoordinatorRecord {
    pub addr: SocketAddr,
    pub key: PublicKey,
}

const COORDINATOR_FILE: &str = "coordinator.json";

impl CoordinatorRecord {
    pub fn load(data_dir: &Path) -> Option<Self> {
        let bytes = std::fs::read(data_dir.join(COORDINATOR_FILE)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    pub fn save(&self, data_dir: &Path) -> Result<(), FabricError> {
        let path = data_dir.join(COORDINATOR_FILE);
        let tmp = data_dir.join(".coordinator.json.tmp");
        let json = serde_json::to_vec_pretty(self).expect("record serializes");
        std::fs::write(&tmp, json)
            .and_then(|_| std::fs::rename(&tmp, &path))
            .map_err(|e| FabricError::io(format!("writing {}", path.display()), e))
    }
}

/// Messages for the stage thread.
enum WorkerMsg {
    Install(Box<Stage>),
    Release(u64),
    Ring(u64, RingOut),
    Open(OpenSeq),
    Start(u64),
    Close(u64),
    Hidden(StepHeader, Vec<f32>),
    Token(RingToken),
    /// Expert split: the links to the workers owning the rest of this stage's experts.
    Experts(u64, crate::expert::RemotePeers),
}

/// Where the stage's ring outputs go.
enum RingOut {
    /// A one-stage ring: tokens come straight back to this stage.
    Loopback,
    /// The stream to the next stage, written by the stage thread itself (no hand-off to
    /// another thread on the hot path; QUIC flow control is the back-pressure), driven by the
    /// agent's runtime.
    Stream(
        Box<FrameWriter<tessera_net::quinn::SendStream>>,
        tokio::runtime::Handle,
    ),
}

impl RingOut {
    /// Writes one frame to the next stage; false if the stream is gone.
    fn send(&mut self, kind: u16, payload: &[u8]) -> bool {
        match self {
            Self::Stream(w, rt) => match rt.block_on(w.write_frame(kind, payload)) {
                Ok(()) => true,
                Err(e) => {
                    eprintln!("ring stream to the next stage: {e}");
                    false
                }
            },
            Self::Loopback => false,
        }
    }
}

/// Expert split state of the current epoch.
#[derive(Clone)]
struct ExpertServing {
    epoch: u64,
    assignment: ExpertAssignment,
    /// Experts this node computes for other homes (`None`: it serves none).
    model: Option<Arc<Model>>,
}

/// A blocking expert link over a network stream, driven by the agent's runtime from the stage
/// thread (like the ring).
struct NetExpertLink {
    writer: FrameWriter<tessera_net::quinn::SendStream>,
    reader: tessera_net::FrameReader<tessera_net::quinn::RecvStream>,
    rt: tokio::runtime::Handle,
}

impl crate::expert::ExpertLink for NetExpertLink {
    fn send(&mut self, kind: u16, payload: Vec<u8>) -> Result<(), String> {
        self.rt
            .block_on(self.writer.write_frame(kind, &payload))
            .map_err(|e| e.to_string())
    }
    fn recv(&mut self) -> Result<(u16, Vec<u8>), String> {
        match self.rt.block_on(self.reader.read_frame()) {
            Ok(Some(f)) => Ok((f.kind, f.payload.to_vec())),
            Ok(None) => Err("the worker closed the stream".into()),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// What the accept loop needs to know about the current epoch.
#[derive(Clone, Debug)]
struct Current {
    assignment: StageAssignment,
    n_embd: usize,
}

struct Shared {
    allow: Arc<AllowList>,
    current: Mutex<Option<Current>>,
    worker: mpsc::UnboundedSender<WorkerMsg>,
    ctrl: mpsc::UnboundedSender<NodeToCoord>,
    /// Keeps the connection to the next stage open.
    next_conn: Mutex<Option<Connection>>,
    /// Expert placements received for epochs not yet loaded.
    pending_experts: Mutex<std::collections::HashMap<u64, ExpertAssignment>>,
    /// Expert split: this node's expert placement and the model serving other homes' requests
    /// (experts of layers outside its stage), for the current epoch.
    experts: Mutex<Option<ExpertServing>>,
    /// Keeps the connections to expert workers open.
    expert_conns: Mutex<Vec<Connection>>,
    /// The counters of the current stage's own streamed experts (the stage's model lives on the
    /// worker thread; the handle reads them from here, and reads nothing once it is dropped).
    stage_experts: Mutex<Option<tessera_engine::expert_store::ExpertStatsSource>>,
    /// The latest epoch assigned and not released (0: none). A load that finishes after a
    /// newer assignment (or the release of its own) is discarded, never installed.
    assigned: std::sync::atomic::AtomicU64,
}

impl Shared {
    /// Counters of this node's streamed experts: the stage's own and those of the model serving
    /// other homes' experts, summed (`None` when neither streams experts).
    fn expert_cache(&self) -> Option<ExpertCacheStats> {
        let stage = self
            .stage_experts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|s| s.stats());
        let serving = {
            let x = self.experts.lock().unwrap_or_else(|p| p.into_inner());
            x.as_ref()
                .and_then(|x| x.model.as_ref())
                .and_then(|m| m.expert_stats())
        };
        let st = match (stage, serving) {
            (Some(mut a), Some(b)) => {
                a.add(&b);
                a
            }
            (a, b) => a.or(b)?,
        };
        Some(ExpertCacheStats {
            budget_bytes: st.budget_bytes,
            lookups: st.lookups,
            hits: st.hits,
            misses: st.misses,
            bytes_read: st.bytes_read,
        })
    }
}

/// Loads or creates the node identity and prints its id. Also the first thing [`run`] does.
pub fn identity(data_dir: &Path) -> Result<NodeIdentity, FabricError> {
    std::fs::create_dir_all(data_dir)
        .map_err(|e| FabricError::io(format!("creating {}", data_dir.display()), e))?;
    Ok(NodeIdentity::load_or_create(data_dir)?)
}

/// Measures this node as configured, with the engine's quantized matmul as compute probe.
pub fn measure_inventory(config: &AgentConfig) -> Result<Inventory, FabricError> {
    let mut opts = ProbeOptions {
        disk_dir: Some(config.data_dir.clone()),
        threads: Some(config.threads),
        compute_probe: Some(Box::new(crate::compute_probe::engine_matmul_rate)),
        ..Default::default()
    };
    if config.probe == ProbeLevel::Quick {
        opts.memory_buffer_bytes = 16 << 20;
        opts.memory_reps = 1;
        opts.disk_test_bytes = 8 << 20;
        opts.probe_time_limit = Duration::from_millis(50);
    }
    let mut inv = measure(&opts);
    if let Some(b) = &config.memory_budget {
        inv.set_budget(b)?;
    }
    Ok(inv)
}

/// Runs the agent: measures, enrols or reconnects, and serves the coordinator's sessions. A lost
/// session is retried with backoff (the coordinator may restart; the node keeps its cache);
/// only a refusal or a protocol mismatch ends the agent.
pub async fn run(config: AgentConfig) -> Result<(), FabricError> {
    run_until(config, std::future::pending()).await
}

/// [`run`] until `shutdown` completes; then closes every connection (peers and the coordinator
/// see the node leave at once, not after an idle timeout) and returns.
pub async fn run_until(
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), FabricError> {
    let identity = identity(&config.data_dir)?;
    println!("node id: {}", identity.node_id());
    if config.join.is_none() && CoordinatorRecord::load(&config.data_dir).is_none() {
        return Err(FabricError::NotEnrolled);
    }
    let inventory = {
        let c = config.clone();
        tokio::task::spawn_blocking(move || measure_inventory(&c))
            .await
            .map_err(|e| FabricError::Stopped(format!("inventory: {e}")))??
    };
    let budget = inventory.memory_budget.as_ref().map(|b| b.bytes);
    eprintln!(
        "inventory: {} cores, {} RAM total, budget {}",
        inventory.cpu.usable_cores.unwrap_or(0),
        inventory
            .memory
            .total_bytes
            .map_or("unknown".into(), tessera_model::human_bytes),
        budget.map_or("none (available RAM)".into(), tessera_model::human_bytes),
    );
    let store = Arc::new(ShardStore::open(&config.data_dir)?);
    let mut models = Vec::new();
    if let Some(path) = &config.model {
        let (s, p) = (store.clone(), path.clone());
        let m = tokio::task::spawn_blocking(move || s.adopt(p))
            .await
            .map_err(|e| FabricError::Stopped(format!("adopt: {e}")))??;
        eprintln!(
            "local model {} has hash {}",
            path.display(),
            m.model_hash.short()
        );
        models.push(m.model_hash);
    }
    let name = config.name.clone().unwrap_or_else(|| {
        inventory
            .host
            .hostname
            .clone()
            .unwrap_or_else(|| identity.node_id().short())
    });
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        role: Role::Node,
        name,
        inventory: Some(Box::new(inventory.clone())),
        memory_budget_bytes: budget,
        models,
    };

    let allow = Arc::new(AllowList::new());
    let endpoint = Endpoint::bind(config.listen, &identity, allow.clone())?;
    println!("listening on {}", endpoint.local_addr()?);

    // The stage thread lives as long as the agent; sessions come and go.
    let (ctrl_tx, ctrl_rx) = mpsc::unbounded_channel::<NodeToCoord>();
    let ctrl_rx = Arc::new(tokio::sync::Mutex::new(ctrl_rx));
    let (worker_tx, worker_rx) = mpsc::unbounded_channel();
    {
        let ctrl = ctrl_tx.clone();
        let me = worker_tx.downgrade();
        std::thread::Builder::new()
            .name("tessera-stage".into())
            .spawn(move || worker_loop(worker_rx, me, ctrl))
            .map_err(|e| FabricError::io("starting the stage thread", e))?;
    }
    let shared = Arc::new(Shared {
        allow,
        current: Mutex::new(None),
        worker: worker_tx,
        ctrl: ctrl_tx,
        next_conn: Mutex::new(None),
        pending_experts: Mutex::new(Default::default()),
        experts: Mutex::new(None),
        stage_experts: Mutex::new(None),
        expert_conns: Mutex::new(Vec::new()),
        assigned: std::sync::atomic::AtomicU64::new(0),
    });

    // Peers (the previous stage) dial us.
    {
        let endpoint = endpoint.clone();
        let shared = shared.clone();
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                let shared = shared.clone();
                tokio::spawn(async move {
                    match incoming.handshake().await {
                        Ok(Accepted::Peer(c)) => serve_peer(c, shared).await,
                        Ok(Accepted::Enrolment(r)) => {
                            let _ = r.refuse(tessera_net::Refusal::Other(
                                "nodes do not enrol others".into(),
                            ));
                        }
                        Err(e) => eprintln!("refused a connection: {e}"),
                    }
                });
            }
        });
    }

    let serve = serve_sessions(
        &config, &hello, &endpoint, &shared, &store, &inventory, &ctrl_rx,
    );
    tokio::pin!(shutdown);
    let result = tokio::select! {
        r = serve => r,
        () = &mut shutdown => {
            println!("shutting down");
            Ok(())
        }
    };
    endpoint.close();
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    result
}

/// Connects (enrolling the first time), serves a session, and reconnects with backoff.
async fn serve_sessions(
    config: &AgentConfig,
    hello: &Hello,
    endpoint: &Endpoint,
    shared: &Arc<Shared>,
    store: &Arc<ShardStore>,
    inventory: &Inventory,
    ctrl_rx: &Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<NodeToCoord>>>,
) -> Result<(), FabricError> {
    let mut join = config.join.clone();
    let mut backoff = Duration::from_millis(500);
    loop {
        let conn = match &join {
            Some(j) => match with_timeout(endpoint.enroll(j.addr, &j.token)).await {
                Ok(conn) => {
                    CoordinatorRecord {
                        addr: j.addr,
                        key: conn.peer_key(),
                    }
                    .save(&config.data_dir)?;
                    join = None;
                    Ok(conn)
                }
                Err(e @ tessera_net::NetError::EnrolmentRefused { .. }) => return Err(e.into()),
                Err(e) => Err(e),
            },
            None => {
                let rec =
                    CoordinatorRecord::load(&config.data_dir).ok_or(FabricError::NotEnrolled)?;
                with_timeout(endpoint.connect(rec.addr, rec.key)).await
            }
        };
        let result = match conn {
            Ok(conn) => {
                backoff = Duration::from_millis(500);
                let ctx = Arc::new(LoadCtx {
                    conn: conn.clone(),
                    store: store.clone(),
                    inventory: inventory.clone(),
                    threads: config.threads,
                    progress: config.progress,
                    expert_budget: config.expert_budget,
                });
                let r = session(&conn, hello, endpoint, shared, &ctx, ctrl_rx).await;
                conn.close("session over");
                r
            }
            Err(e) => Err(e.into()),
        };
        // Whatever the coordinator had placed here is void now.
        forget_epoch(shared);
        match result {
            Err(e @ (FabricError::Refused(_) | FabricError::VersionMismatch { .. })) => {
                return Err(e);
            }
            Err(e) => eprintln!("coordinator session: {e}; retrying in {backoff:?}"),
            Ok(()) => eprintln!("the coordinator ended the session; retrying in {backoff:?}"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

/// How long one attempt to reach the coordinator may take (a cut link must not hold the agent
/// for a whole QUIC idle timeout).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

async fn with_timeout(
    f: impl std::future::Future<Output = Result<Connection, tessera_net::NetError>>,
) -> Result<Connection, tessera_net::NetError> {
    match tokio::time::timeout(CONNECT_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(tessera_net::NetError::Timeout(format!(
            "no answer from the coordinator within {CONNECT_TIMEOUT:?}"
        ))),
    }
}

fn forget_epoch(shared: &Shared) {
    let mut cur = shared.current.lock().unwrap_or_else(|p| p.into_inner());
    shared
        .assigned
        .store(0, std::sync::atomic::Ordering::SeqCst);
    if let Some(c) = cur.take() {
        if let Some(prev) = &c.assignment.prev {
            shared.allow.remove(&prev.node_id);
        }
        let _ = shared.worker.send(WorkerMsg::Release(c.assignment.epoch));
    }
    *shared.next_conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
    release_experts(shared, None);
}

/// Drops the expert split state of `epoch` (or of any epoch): its serving model, its worker
/// connections and the admission of its clients.
fn release_experts(shared: &Shared, epoch: Option<u64>) {
    let mut ex = shared.experts.lock().unwrap_or_else(|p| p.into_inner());
    if ex
        .as_ref()
        .is_some_and(|e| epoch.is_none_or(|epoch| e.epoch == epoch))
    {
        if let Some(e) = ex.take() {
            for c in &e.assignment.clients {
                shared.allow.remove(&c.node_id);
            }
        }
        for c in shared
            .expert_conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            c.close("epoch released");
        }
    }
    let mut pending = shared
        .pending_experts
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    match epoch {
        Some(epoch) => {
            pending.remove(&epoch);
        }
        None => pending.clear(),
    }
}

/// The packed expert tensors of the layers where `held` names experts, outside `skip` (of
/// which [`assignment_needs`] keeps only the held experts' byte ranges).
fn expert_tensor_names(
    manifest: &Manifest,
    held: &[Vec<usize>],
    skip: &std::ops::Range<usize>,
) -> Vec<String> {
    let mut names = Vec::new();
    for (l, ids) in held.iter().enumerate() {
        if ids.is_empty() || skip.contains(&l) {
            continue;
        }
        for part in ["gate", "up", "down"] {
            let n = format!("blk.{l}.ffn_{part}_exps.weight");
            if manifest.tensor(&n).is_some() {
                names.push(n);
            }
        }
    }
    names
}

/// One control session with the coordinator: hello, welcome, then its messages until it ends.
async fn session(
    conn: &Connection,
    hello: &Hello,
    endpoint: &Endpoint,
    shared: &Arc<Shared>,
    ctx: &Arc<LoadCtx>,
    ctrl_rx: &Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<NodeToCoord>>>,
) -> Result<(), FabricError> {
    let mut ctrl = conn.open_stream(stream::CONTROL).await?;
    ctrl.reader.set_max_len(limits::CONTROL);
    ctrl.writer
        .write_message(frame::MSG, &NodeToCoord::Hello(hello.clone()))
        .await?;
    ctrl.writer
        .write_message(
            frame::MSG,
            &NodeToCoord::Listening {
                addr: endpoint.local_addr()?,
            },
        )
        .await?;
    match ctrl.reader.read_message::<CoordToNode>(frame::MSG).await? {
        CoordToNode::Welcome {
            protocol_version,
            coordinator,
            observed_addr,
        } => {
            if protocol_version != PROTOCOL_VERSION {
                return Err(FabricError::VersionMismatch {
                    ours: PROTOCOL_VERSION,
                    theirs: protocol_version,
                });
            }
            println!(
                "joined coordinator {coordinator} as {} ({observed_addr})",
                hello.name
            );
        }
        CoordToNode::Refused { reason } => return Err(FabricError::Refused(reason)),
        other => {
            return Err(FabricError::Protocol(format!(
                "expected a welcome, got {other:?}"
            )))
        }
    }
    // Messages queued for an earlier session are stale.
    let mut rx = ctrl_rx.clone().lock_owned().await;
    while rx.try_recv().is_ok() {}
    let mut ctrl_writer = ctrl.writer;
    let writer_task = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if let Err(e) = ctrl_writer.write_message(frame::MSG, &m).await {
                eprintln!("control stream: {e}");
                break;
            }
        }
    });
    // Answer the coordinator's measurement streams.
    let measure_task = {
        let conn = conn.clone();
        tokio::spawn(async move { while let Ok(Some(_)) = conn.accept_stream().await {} })
    };
    let result = control_loop(&mut ctrl.reader, endpoint, shared, ctx).await;
    writer_task.abort();
    measure_task.abort();
    result
}

async fn control_loop(
    reader: &mut tessera_net::FrameReader<tessera_net::quinn::RecvStream>,
    endpoint: &Endpoint,
    shared: &Arc<Shared>,
    ctx: &Arc<LoadCtx>,
) -> Result<(), FabricError> {
    // Heartbeats for this session's lease (aborted when the session ends).
    struct Heartbeat(Option<tokio::task::JoinHandle<()>>);
    impl Drop for Heartbeat {
        fn drop(&mut self) {
            if let Some(h) = self.0.take() {
                h.abort();
            }
        }
    }
    let mut heartbeat = Heartbeat(None);
    // The coordinator's lease: once it has told one, its silence for that long ends the
    // session (it is gone, or the link is cut) and the node reconnects.
    let mut coordinator_lease: Option<(u64, Duration)> = None;
    loop {
        let frame = match coordinator_lease {
            Some((_, lease)) => match tokio::time::timeout(lease, reader.read_frame()).await {
                Ok(f) => f?,
                Err(_) => {
                    return Err(FabricError::Stopped(format!(
                        "the coordinator was silent for {lease:?}"
                    )))
                }
            },
            None => reader.read_frame().await?,
        };
        let msg = match frame {
            None => {
                println!("the coordinator closed the session");
                return Ok(());
            }
            Some(f) if f.kind == frame::MSG => f.json::<CoordToNode>()?,
            Some(f) => {
                return Err(FabricError::Protocol(format!(
                    "unexpected frame kind {:#06x} on the control stream",
                    f.kind
                )))
            }
        };
        match msg {
            CoordToNode::Assign(a) => {
                let epoch = a.epoch;
                println!(
                    "assigned epoch {epoch}: stage {} of {}, layers {}..{}",
                    a.stage, a.n_stages, a.layers.start, a.layers.end
                );
                if let Some(prev) = &a.prev {
                    shared.allow.insert(prev.key);
                }
                shared
                    .assigned
                    .fetch_max(epoch, std::sync::atomic::Ordering::SeqCst);
                let (shared, ctx) = (shared.clone(), ctx.clone());
                tokio::spawn(async move {
                    let msg = match load_assignment(a, &ctx, &shared).await {
                        Ok(report) => {
                            println!(
                                "loaded epoch {epoch}: needed {} bytes, received {} bytes, {} bytes already present",
                                report.bytes_needed, report.bytes_transferred, report.bytes_already_present
                            );
                            NodeToCoord::Loaded { epoch, report }
                        }
                        Err(e) => {
                            eprintln!("cannot take epoch {epoch}: {e}");
                            NodeToCoord::LoadFailed {
                                epoch,
                                reason: e.to_string(),
                            }
                        }
                    };
                    let _ = shared.ctrl.send(msg);
                });
            }
            CoordToNode::AssignExperts { epoch, experts } => {
                for c in &experts.clients {
                    shared.allow.insert(c.key);
                }
                shared
                    .pending_experts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(epoch, experts);
            }
            CoordToNode::Link { epoch } => {
                let (shared, endpoint) = (shared.clone(), endpoint.clone());
                tokio::spawn(async move {
                    let msg = match link_next(epoch, &endpoint, &shared).await {
                        Ok(link) => NodeToCoord::Linked { epoch, link },
                        Err(e) => NodeToCoord::LinkFailed {
                            epoch,
                            reason: e.to_string(),
                        },
                    };
                    let _ = shared.ctrl.send(msg);
                });
            }
            CoordToNode::Lease {
                heartbeat_ms,
                lease_ms,
            } => {
                let lease = Duration::from_millis(lease_ms.max(1));
                let same = coordinator_lease.is_some_and(|(h, _)| h == heartbeat_ms);
                coordinator_lease = Some((heartbeat_ms, lease));
                if same {
                    continue;
                }
                let every = Duration::from_millis(heartbeat_ms.clamp(10, 60_000));
                eprintln!("lease {lease_ms} ms: heartbeat every {every:?}");
                let ctrl = shared.ctrl.clone();
                let sh = shared.clone();
                let task = tokio::spawn(async move {
                    let mut tick = tokio::time::interval(every);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tick.tick().await;
                        let expert_cache = sh.expert_cache();
                        if ctrl.send(NodeToCoord::Heartbeat { expert_cache }).is_err() {
                            break;
                        }
                    }
                });
                if let Some(old) = heartbeat.0.replace(task) {
                    old.abort();
                }
            }
            CoordToNode::Release { epoch } => {
                let _ = shared.assigned.compare_exchange(
                    epoch,
                    0,
                    std::sync::atomic::Ordering::SeqCst,
                    std::sync::atomic::Ordering::SeqCst,
                );
                let mut cur = shared.current.lock().unwrap_or_else(|p| p.into_inner());
                if cur.as_ref().is_some_and(|c| c.assignment.epoch == epoch) {
                    if let Some(prev) = cur.as_ref().and_then(|c| c.assignment.prev.clone()) {
                        shared.allow.remove(&prev.node_id);
                    }
                    *cur = None;
                    // The released epoch's ring link goes with it.
                    if let Some(c) = shared
                        .next_conn
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .take()
                    {
                        c.close("epoch released");
                    }
                }
                drop(cur);
                release_experts(shared, Some(epoch));
                let _ = shared.worker.send(WorkerMsg::Release(epoch));
            }
            CoordToNode::Open(o) => {
                let _ = shared.worker.send(WorkerMsg::Open(o));
            }
            CoordToNode::Start { seq } => {
                let _ = shared.worker.send(WorkerMsg::Start(seq));
            }
            CoordToNode::Close { seq } => {
                let _ = shared.worker.send(WorkerMsg::Close(seq));
            }
            CoordToNode::MeasureInventory => {
                let shared = shared.clone();
                let ctx = ctx.clone();
                tokio::task::spawn_blocking(move || {
                    let mut inv = measure(&ProbeOptions {
                        disk_dir: Some(ctx.store.data_dir().to_owned()),
                        threads: Some(ctx.threads),
                        ..Default::default()
                    });
                    inv.memory_budget = ctx.inventory.memory_budget.clone();
                    let _ = shared.ctrl.send(NodeToCoord::Inventory(Box::new(inv)));
                });
            }
            CoordToNode::Welcome { .. } | CoordToNode::Refused { .. } => {
                return Err(FabricError::Protocol(
                    "a second welcome on the control stream".into(),
                ))
            }
        }
    }
}

struct LoadCtx {
    conn: Connection,
    store: Arc<ShardStore>,
    inventory: Inventory,
    threads: usize,
    progress: bool,
    expert_budget: Option<u64>,
}

/// The tensors a stage needs: its layers' `blk.N.*`, plus the embedding (first stage, or the
/// last with tied embeddings) and the output norm and head (last stage).
pub fn stage_tensor_names(manifest: &Manifest, a: &StageAssignment) -> Vec<String> {
    let mut names = manifest.layer_tensor_names(a.layers.start as u32..a.layers.end as u32);
    let has = |n: &str| manifest.tensor(n).is_some();
    let tied = !has("output.weight");
    if a.embed || (a.head && tied) {
        names.push("token_embd.weight".into());
    }
    if a.head {
        names.push("output_norm.weight".into());
        if !tied {
            names.push("output.weight".into());
        }
    }
    names
}

async fn load_assignment(
    a: StageAssignment,
    ctx: &LoadCtx,
    shared: &Shared,
) -> Result<LoadReport, FabricError> {
    let t0 = Instant::now();
    let manifest = Arc::new(fetch_manifest(&ctx.conn, a.model).await?);
    let experts = shared
        .pending_experts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&a.epoch);
    let expert_only = experts.as_ref().is_some_and(|x| x.expert_only);
    let mut names = if expert_only {
        Vec::new()
    } else {
        stage_tensor_names(&manifest, &a)
    };
    if let Some(x) = &experts {
        let skip = if expert_only { 0..0 } else { a.layers.clone() };
        names.extend(expert_tensor_names(&manifest, &x.held, &skip));
    }
    // Expert split: only the held experts' byte ranges of the packed expert tensors.
    let held_experts = experts.as_ref().map(|x| x.held.as_slice());
    let (needs, header) =
        assignment_needs(&ctx.conn, &ctx.store, &manifest, names, held_experts).await?;
    let weight_bytes = manifest.bytes_for_needs(&needs)?;
    // Experts over the memory budget are streamed from disk: the node keeps what the budget
    // allows in memory (half the limit, leaving the rest to the dense weights and KV caches).
    let streaming = match (ctx.expert_budget, &experts) {
        (_, None) => None,
        (Some(b), Some(_)) => Some(b),
        (None, Some(_)) => match ctx.inventory.accepts(weight_bytes) {
            Ok(()) => None,
            Err(e) => Some(e.limit.ok_or(e)? / 2),
        },
    };
    if streaming.is_none() {
        ctx.inventory.accepts(weight_bytes)?;
    }

    let bar = progress_bar(ctx.progress, "receiving");
    let b = bar.clone();
    let fetched = fetch_needs(
        &ctx.conn,
        ctx.store.clone(),
        manifest.clone(),
        needs,
        move |done, total| {
            b.set_length(total);
            b.set_position(done);
        },
    )
    .await?
    .after(&header);
    bar.finish_and_clear();
    let fetch_ms = t0.elapsed().as_secs_f64() * 1e3;

    let t1 = Instant::now();
    let path = ctx.store.path_for(&manifest);
    let threads = ctx.threads;
    let spec = LoadSpec {
        layers: if expert_only { 0..0 } else { a.layers.clone() },
        embed: a.embed && !expert_only,
        head: a.head && !expert_only,
        experts: match &experts {
            Some(x) => ExpertSelection::PerLayer(x.held.clone()),
            None => ExpertSelection::All,
        },
        dense: true,
    };
    // The experts this node computes for other homes: those of layers outside its stage.
    let serve_spec = experts.as_ref().and_then(|x| {
        let stage_layers = if expert_only { 0..0 } else { a.layers.clone() };
        let held: Vec<Vec<usize>> = x
            .held
            .iter()
            .enumerate()
            .map(|(l, ids)| {
                if stage_layers.contains(&l) {
                    Vec::new()
                } else {
                    ids.clone()
                }
            })
            .collect();
        held.iter()
            .any(|ids| !ids.is_empty())
            .then(|| LoadSpec::experts_only(0..held.len(), ExpertSelection::PerLayer(held)))
    });
    let (model, serve_model) =
        tokio::task::spawn_blocking(move || -> Result<(Model, Option<Model>), FabricError> {
            let g = GgufFile::open(&path)?;
            // An expert-only node's own model has no layers: nothing of it to stream.
            let load = |spec: LoadSpec, stream: bool| match streaming.filter(|_| stream) {
                Some(b) => Model::load_streaming(
                    &g,
                    spec,
                    ExpertStreaming::with_budget(b),
                    threads,
                    &mut |_, _| {},
                ),
                None => Model::load(&g, spec, threads, &mut |_, _| {}),
            };
            let m = load(spec, !expert_only)?;
            let s = match serve_spec {
                Some(spec) => Some(load(spec, true)?),
                None => None,
            };
            Ok((m, s))
        })
        .await
        .map_err(|e| FabricError::Stopped(format!("loading: {e}")))??;
    let resident = model.resident_bytes() as u64
        + serve_model.as_ref().map_or(0, |m| m.resident_bytes()) as u64;
    // Streamed experts are read from disk as needed: only what the engine keeps counts.
    let held = if streaming.is_some() {
        resident
    } else {
        resident.max(weight_bytes)
    };
    ctx.inventory.accepts(held)?;
    // The same limit `Inventory::accepts` applies: the budget, else the RAM available at start.
    let kv_budget = ctx
        .inventory
        .memory_budget
        .as_ref()
        .map(|b| b.bytes)
        .or(ctx.inventory.memory.available_bytes)
        .map(|limit| limit.saturating_sub(held));
    let n_embd = model.config().n_embd;
    let stage_experts = model.expert_stats_source();
    let stage = Stage::new(a.clone(), model, kv_budget);
    {
        let mut cur = shared.current.lock().unwrap_or_else(|p| p.into_inner());
        // Under the lock, so that an assignment cannot be installed over a newer one.
        if shared.assigned.load(std::sync::atomic::Ordering::SeqCst) != a.epoch {
            return Err(FabricError::Stopped(format!(
                "epoch {} was superseded or released while it loaded",
                a.epoch
            )));
        }
        *shared.experts.lock().unwrap_or_else(|p| p.into_inner()) =
            experts.map(|x| ExpertServing {
                epoch: a.epoch,
                assignment: x,
                model: serve_model.map(Arc::new),
            });
        *shared
            .stage_experts
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = stage_experts;
        *cur = Some(Current {
            assignment: a,
            n_embd,
        });
        let _ = shared.worker.send(WorkerMsg::Install(Box::new(stage)));
    }
    Ok(LoadReport {
        bytes_needed: fetched.bytes_needed,
        bytes_transferred: fetched.bytes_transferred,
        bytes_already_present: fetched.bytes_already_present,
        resident_bytes: resident,
        fetch_ms,
        load_ms: t1.elapsed().as_secs_f64() * 1e3,
    })
}

fn progress_bar(show: bool, what: &str) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// Connects to the next stage of the current epoch, measures the link, opens the ring stream.
async fn link_next(
    epoch: u64,
    endpoint: &Endpoint,
    shared: &Shared,
) -> Result<Option<LinkMeasurement>, FabricError> {
    let a = shared
        .current
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map(|c| c.assignment.clone())
        .filter(|a| a.epoch == epoch)
        .ok_or_else(|| {
            FabricError::Protocol(format!("link for epoch {epoch}, which is not loaded"))
        })?;
    link_experts(epoch, endpoint, shared).await?;
    let Some(next) = a.next else {
        let _ = shared
            .worker
            .send(WorkerMsg::Ring(epoch, RingOut::Loopback));
        return Ok(None);
    };
    let conn = endpoint.connect(next.addr, next.key).await?;
    let link = measure_link(&conn, 8, 1 << 20).await?;
    let mut s = conn.open_stream(stream::RING).await?;
    s.reader.set_max_len(limits::RING);
    *shared.next_conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn);
    let out = RingOut::Stream(Box::new(s.writer), tokio::runtime::Handle::current());
    let _ = shared.worker.send(WorkerMsg::Ring(epoch, out));
    Ok(Some(link))
}

/// Expert split: opens one expert stream to every worker owning experts of this stage's layers
/// and hands the links to the stage thread.
async fn link_experts(epoch: u64, endpoint: &Endpoint, shared: &Shared) -> Result<(), FabricError> {
    let peers = shared
        .experts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .filter(|e| e.epoch == epoch && !e.assignment.expert_only)
        .map(|e| e.assignment.peers.clone())
        .unwrap_or_default();
    if peers.is_empty() {
        return Ok(());
    }
    let mut remote = Vec::with_capacity(peers.len());
    for p in peers {
        let conn = endpoint.connect(p.peer.addr, p.peer.key).await?;
        let mut s = conn.open_stream(stream::EXPERT).await?;
        s.reader.set_max_len(limits::EXPERT);
        shared
            .expert_conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(conn);
        remote.push(crate::expert::RemotePeer {
            name: p.peer.node_id.short(),
            experts: p.experts,
            link: Box::new(NetExpertLink {
                writer: s.writer,
                reader: s.reader,
                rt: tokio::runtime::Handle::current(),
            }),
        });
    }
    let _ = shared.worker.send(WorkerMsg::Experts(
        epoch,
        crate::expert::RemotePeers::new(remote),
    ));
    Ok(())
}

/// Serves an expert stream: each request is computed on the serving model (off the runtime)
/// and answered in order.
async fn serve_experts(
    mut s: tessera_net::FramedStream,
    model: Arc<Model>,
) -> Result<(), FabricError> {
    s.reader.set_max_len(limits::EXPERT);
    while let Some(f) = s.reader.read_frame().await? {
        if f.kind != frame::EXPERT_REQ {
            return Err(FabricError::Protocol(format!(
                "unexpected frame kind {:#06x} on an expert stream",
                f.kind
            )));
        }
        let m = model.clone();
        let (kind, payload) =
            tokio::task::spawn_blocking(move || crate::expert::answer(&m, &f.payload))
                .await
                .map_err(|e| FabricError::Stopped(format!("expert worker: {e}")))?;
        s.writer.write_frame(kind, &payload).await?;
    }
    Ok(())
}

/// Serves a connection from another node: ring streams from the current previous stage.
async fn serve_peer(conn: Connection, shared: Arc<Shared>) {
    loop {
        let mut s = match conn.accept_stream().await {
            Ok(Some(s)) => s,
            Ok(None) => return,
            Err(e) => {
                eprintln!("peer {}: {e}", conn.peer_id().short());
                return;
            }
        };
        let cur = shared
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if s.kind == stream::EXPERT {
            let serving = shared
                .experts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .filter(|e| {
                    e.assignment
                        .clients
                        .iter()
                        .any(|c| c.key == conn.peer_key())
                })
                .and_then(|e| e.model);
            match serving {
                Some(model) => {
                    let peer = conn.peer_id();
                    tokio::spawn(async move {
                        if let Err(e) = serve_experts(s, model).await {
                            eprintln!("expert stream from {}: {e}; closing it", peer.short());
                        }
                    });
                }
                None => {
                    eprintln!(
                        "peer {}: refusing an expert stream (no experts served to it)",
                        conn.peer_id().short()
                    );
                    let _ = s.writer.finish().await;
                }
            }
            continue;
        }
        let expected = cur
            .as_ref()
            .and_then(|c| c.assignment.prev.as_ref())
            .is_some_and(|p| p.key == conn.peer_key());
        if s.kind != stream::RING || !expected {
            eprintln!(
                "peer {}: refusing a stream of kind {:#06x}",
                conn.peer_id().short(),
                s.kind
            );
            let _ = s.writer.finish().await;
            continue;
        }
        let n_embd = cur.map_or(0, |c| c.n_embd);
        s.reader.set_max_len(limits::RING);
        let worker = shared.worker.clone();
        let peer = conn.peer_id();
        tokio::spawn(async move {
            if let Err(e) = read_ring(&mut s.reader, n_embd, &worker).await {
                eprintln!(
                    "ring stream from {}: {e}; closing that stream",
                    peer.short()
                );
            }
        });
    }
}

/// Reads ring frames and hands them to the stage thread. Any malformed frame ends the stream.
async fn read_ring<R: tokio::io::AsyncRead + Unpin>(
    reader: &mut tessera_net::FrameReader<R>,
    n_embd: usize,
    worker: &mpsc::UnboundedSender<WorkerMsg>,
) -> Result<(), FabricError> {
    while let Some(f) = reader.read_frame().await? {
        let msg = match f.kind {
            frame::HIDDEN => {
                let (h, d) = StepHeader::decode(&f.payload, n_embd)?;
                WorkerMsg::Hidden(h, d)
            }
            frame::TOKEN => WorkerMsg::Token(RingToken::decode(&f.payload)?),
            k => {
                return Err(FabricError::Protocol(format!(
                    "unexpected frame kind {k:#06x} on a ring stream"
                )))
            }
        };
        if worker.send(msg).is_err() {
            break;
        }
    }
    Ok(())
}

/// Most sequences the stage thread puts in one step.
const MAX_BATCH: usize = 64;

/// The stage thread: applies messages to the current [`Stage`] in order. Tokens (first stage)
/// or hidden states (other stages) of different sequences that are queued together run as one
/// batch: one forward pass and one frame on to the next stage. Kernels are batch-invariant, so
/// every sequence gets the bits it would get alone.
fn worker_loop(
    mut rx: mpsc::UnboundedReceiver<WorkerMsg>,
    me: mpsc::WeakUnboundedSender<WorkerMsg>,
    ctrl: mpsc::UnboundedSender<NodeToCoord>,
) {
    let mut stage: Option<Stage> = None;
    let mut ring: Option<RingOut> = None;
    let mut pending: std::collections::VecDeque<WorkerMsg> = std::collections::VecDeque::new();
    let fail = |seq: u64, e: &dyn std::fmt::Display| {
        let _ = ctrl.send(NodeToCoord::Finished {
            seq,
            reason: FinishReason::Error,
            generated: 0,
            error: Some(e.to_string()),
        });
    };
    loop {
        let msg = match pending.pop_front() {
            Some(m) => m,
            None => match rx.blocking_recv() {
                Some(m) => m,
                None => break,
            },
        };
        // The next message already queued, without waiting.
        let mut next_ready = |pending: &mut std::collections::VecDeque<WorkerMsg>| {
            pending.pop_front().or_else(|| rx.try_recv().ok())
        };
        match msg {
            WorkerMsg::Install(s) => {
                stage = Some(*s);
                ring = None;
            }
            WorkerMsg::Release(epoch) => {
                if stage
                    .as_ref()
                    .is_some_and(|s| s.assignment().epoch == epoch)
                {
                    stage = None;
                    ring = None;
                }
            }
            WorkerMsg::Experts(epoch, peers) => {
                if let Some(s) = stage.as_mut().filter(|s| s.assignment().epoch == epoch) {
                    s.set_remote_experts(peers);
                }
            }
            WorkerMsg::Ring(epoch, r) => {
                if stage
                    .as_ref()
                    .is_some_and(|s| s.assignment().epoch == epoch)
                {
                    ring = Some(r);
                }
            }
            WorkerMsg::Open(o) => {
                let seq = o.seq;
                let reply = match stage.as_mut() {
                    Some(s) if s.assignment().epoch == o.epoch => match s.open(o) {
                        Ok(()) => NodeToCoord::Opened { seq },
                        Err(e) => NodeToCoord::OpenFailed {
                            seq,
                            reason: e.to_string(),
                        },
                    },
                    _ => NodeToCoord::OpenFailed {
                        seq,
                        reason: format!("no stage loaded for epoch {}", o.epoch),
                    },
                };
                let _ = ctrl.send(reply);
            }
            WorkerMsg::Close(seq) => {
                let stats = stage
                    .as_mut()
                    .and_then(|s| s.close(seq))
                    .unwrap_or_default();
                let _ = ctrl.send(NodeToCoord::Closed { seq, stats });
            }
            WorkerMsg::Start(seq) => {
                let Some(s) = stage.as_mut() else {
                    fail(seq, &"no stage loaded");
                    continue;
                };
                let mut sink = sink(&mut ring, &me, &ctrl);
                if let Err(e) = s.start(seq, &mut sink) {
                    fail(seq, &e);
                }
            }
            WorkerMsg::Token(t) => {
                let mut batch = vec![t];
                while batch.len() < MAX_BATCH {
                    match next_ready(&mut pending) {
                        Some(WorkerMsg::Token(t)) if !batch.iter().any(|b| b.seq == t.seq) => {
                            batch.push(t)
                        }
                        Some(other) => {
                            pending.push_front(other);
                            break;
                        }
                        None => break,
                    }
                }
                let Some(s) = stage.as_mut() else { continue };
                let mut sink = sink(&mut ring, &me, &ctrl);
                for (seq, e) in s.handle_tokens(batch, &mut sink) {
                    fail(seq, &e);
                }
            }
            WorkerMsg::Hidden(mut h, mut d) => {
                while h.entries.len() < MAX_BATCH {
                    match next_ready(&mut pending) {
                        Some(WorkerMsg::Hidden(h2, d2))
                            if h2.n_embd == h.n_embd
                                && !h2
                                    .entries
                                    .iter()
                                    .any(|e| h.entries.iter().any(|x| x.seq == e.seq)) =>
                        {
                            h.entries.extend(h2.entries);
                            d.extend(d2);
                        }
                        Some(other) => {
                            pending.push_front(other);
                            break;
                        }
                        None => break,
                    }
                }
                let Some(s) = stage.as_mut() else { continue };
                let seqs: Vec<u64> = h.entries.iter().map(|e| e.seq).collect();
                let mut sink = sink(&mut ring, &me, &ctrl);
                match s.handle_hidden(h, d, &mut sink) {
                    Ok(()) => {}
                    // A closed sequence's state still in flight (after a cancel).
                    Err(crate::stage::StageError::UnknownSeq(_)) if seqs.len() == 1 => {}
                    Err(e) => {
                        for seq in seqs {
                            fail(seq, &e);
                        }
                    }
                }
            }
        }
    }
}

/// Routes a stage's outputs: hidden states and tokens to the ring, messages to the coordinator.
fn sink<'a>(
    ring: &'a mut Option<RingOut>,
    me: &'a mpsc::WeakUnboundedSender<WorkerMsg>,
    ctrl: &'a mpsc::UnboundedSender<NodeToCoord>,
) -> impl FnMut(StageOutput) + 'a {
    let unlinked = |seq: u64, what: &str| NodeToCoord::Finished {
        seq,
        reason: FinishReason::Error,
        generated: 0,
        error: Some(format!("this stage is not linked to the {what} stage")),
    };
    move |o| match o {
        StageOutput::Control(m) => {
            let _ = ctrl.send(m);
        }
        StageOutput::Hidden(h, d) => {
            let sent = match ring.as_mut() {
                Some(r @ RingOut::Stream(..)) => r.send(frame::HIDDEN, &h.encode_with(&d)),
                _ => false,
            };
            if !sent {
                let _ = ctrl.send(unlinked(h.entries[0].seq, "next"));
            }
        }
        StageOutput::Token(t) => {
            let sent = match ring.as_mut() {
                Some(RingOut::Loopback) => me
                    .upgrade()
                    .is_some_and(|me| me.send(WorkerMsg::Token(t)).is_ok()),
                Some(r @ RingOut::Stream(..)) => r.send(frame::TOKEN, &t.encode()),
                None => false,
            };
            if !sent {
                let _ = ctrl.send(unlinked(t.seq, "first"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::StepEntry;
    use tessera_net::frame::FrameWriter;

    #[tokio::test]
    async fn a_malformed_ring_frame_ends_that_stream_after_the_good_ones() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut w = FrameWriter::new(a);
        let h = StepHeader {
            n_embd: 4,
            entries: vec![StepEntry {
                seq: 1,
                start_pos: 0,
                n_tokens: 1,
                flags: StepEntry::SAMPLE,
            }],
        };
        w.write_frame(frame::HIDDEN, &h.encode_with(&[1.0, 2.0, 3.0, 4.0]))
            .await
            .unwrap();
        w.write_frame(
            frame::TOKEN,
            &RingToken {
                seq: 1,
                pos: 1,
                token: 7,
            }
            .encode(),
        )
        .await
        .unwrap();
        // Width 8 where the model has 4: refused.
        let wide = StepHeader {
            n_embd: 8,
            ..h.clone()
        };
        w.write_frame(frame::HIDDEN, &wide.encode_with(&[0.0; 8]))
            .await
            .unwrap();
        w.write_frame(frame::TOKEN, &[1, 2, 3]).await.unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut r = tessera_net::FrameReader::new(b).with_max_len(limits::RING);
        let err = read_ring(&mut r, 4, &tx).await.unwrap_err();
        assert!(matches!(err, FabricError::Frame(_)), "{err}");
        assert!(matches!(rx.try_recv(), Ok(WorkerMsg::Hidden(..))));
        assert!(matches!(rx.try_recv(), Ok(WorkerMsg::Token(_))));
        assert!(rx.try_recv().is_err(), "nothing after the bad frame");
    }

    #[tokio::test]
    async fn an_oversized_ring_frame_is_refused_before_allocation() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut w = FrameWriter::new(a);
        w.write_frame(frame::HIDDEN, &vec![0u8; 2048])
            .await
            .unwrap();
        let (tx, _rx) = mpsc::unbounded_channel();
        let mut r = tessera_net::FrameReader::new(b).with_max_len(1024);
        let err = read_ring(&mut r, 4, &tx).await.unwrap_err();
        assert!(err.to_string().contains("exceeds"), "{err}");
    }

    #[test]
    fn join_target_parses() {
        let t = JoinToken::generate(None).unwrap();
        let j: JoinTarget = format!("{t}@127.0.0.1:4000").parse().unwrap();
        assert_eq!(j.addr, "127.0.0.1:4000".parse().unwrap());
        assert_eq!(j.token, t);
        assert!("nonsense".parse::<JoinTarget>().is_err());
        assert!(format!("{t}@").parse::<JoinTarget>().is_err());
    }
}
