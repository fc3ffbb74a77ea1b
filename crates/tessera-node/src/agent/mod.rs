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
//! 7. **Epochs**: which epoch is assigned, whether a finished load is installed, the two epochs
//!    held while the coordinator switches splits, who is admitted, which lost links matter and
//!    what a release takes are decided by one pure machine (`NodeEpochs`, in `epochs.rs`) behind
//!    one lock; the rest of this module carries out its actions.
//!
//! Every stream is read with a size limit for its kind; a malformed frame on a ring stream ends
//! that stream (and is logged), never the node.
//!
//! [`CoordToNode`]: tessera_proto::CoordToNode
//! [`LoadReport`]: tessera_proto::LoadReport
//! [`stream::RING`]: tessera_proto::stream::RING
//! [`Stage`]: crate::stage::Stage

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_engine::Model;
use tessera_net::{Accepted, AllowList, Connection, Endpoint, NodeIdentity};
use tokio::sync::mpsc;

use crate::error::FabricError;
use crate::inventory::{measure, Inventory, ProbeOptions};
use crate::store::ShardStore;
use tessera_proto::{
    ExpertCacheStats, Hello, NodeToCoord, Role, StageAssignment, PROTOCOL_VERSION,
};

mod config;
mod epochs;
mod experts;
mod hop_ledger;
mod load;
mod ring;
mod sealed;
mod session;
mod stage_thread;

pub use config::{AgentConfig, CoordinatorRecord, JoinTarget, ProbeLevel};
pub use load::stage_tensor_names;
pub use sealed::SealedOptions;

use epochs::{DataLink, EpochAction, EpochEvent, MemoryLimit, NodeEpochs};
use ring::serve_peer;
use session::serve_sessions;
use stage_thread::{worker_loop, WorkerMsg};

/// The epoch machine and what the shell keeps for its installed epochs, behind one lock.
struct Epochs {
    machine: NodeEpochs,
    /// Data links of installed epochs this node dialled: the ring to the next stage (one per
    /// epoch) and the expert links to workers.
    links: Vec<(u64, DataLink, Connection)>,
    /// Expert split: the model serving other homes' requests (experts of layers outside this
    /// node's stage), per installed epoch that has one.
    serving: BTreeMap<u64, Arc<Model>>,
}

impl Epochs {
    /// Closes every data link of `epoch` and drops its expert serving model.
    fn close_links(&mut self, epoch: u64) {
        self.links.retain(|(e, _, c)| {
            if *e == epoch {
                c.close("epoch released");
            }
            *e != epoch
        });
        self.serving.remove(&epoch);
    }
}

struct Shared {
    allow: Arc<AllowList>,
    worker: mpsc::UnboundedSender<WorkerMsg>,
    ctrl: mpsc::UnboundedSender<NodeToCoord>,
    /// The node's epochs ([`NodeEpochs`]: assignments, loads, installed epochs, admissions)
    /// with the connections and models kept for them. Every decision about them is the
    /// machine's; the shell only carries out its actions ([`Shared::handle_epochs`]).
    epochs: Mutex<Epochs>,
    /// The counters of the current stage's own streamed experts (the stage's model lives on the
    /// worker thread; the handle reads them from here, and reads nothing once it is dropped).
    stage_experts: Mutex<Option<tessera_engine::expert_store::ExpertStatsSource>>,
    /// Sealed jobs: this node's sealing key, replay guard and local sequences.
    sealed: sealed::SealedWorker,
}

impl Shared {
    fn lock_epochs(&self) -> std::sync::MutexGuard<'_, Epochs> {
        self.epochs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Feeds the epoch machine one event and carries out its actions, all under the epochs'
    /// lock (so the stage thread sees installs and releases in the machine's order). The
    /// actions that need what only the caller holds (a load to start, a loaded stage to
    /// install, a link just made, a lost link's error) go to `edge`. New sealed claims are
    /// published after the lock is let go.
    fn handle_epochs(&self, event: EpochEvent, mut edge: impl FnMut(&mut Epochs, EpochAction)) {
        let mut claims = false;
        {
            let mut g = self.lock_epochs();
            let actions = g.machine.handle(event);
            for action in actions {
                match action {
                    EpochAction::Admit(key) => self.allow.insert(key),
                    EpochAction::Unadmit(id) => {
                        self.allow.remove(&id);
                    }
                    EpochAction::CloseLinks { epoch } => g.close_links(epoch),
                    EpochAction::ReleaseStage { epoch } => {
                        let _ = self.worker.send(WorkerMsg::Release(epoch));
                    }
                    EpochAction::Refuse { epoch, why } => {
                        tracing::warn!("cannot take epoch {epoch}: {why}");
                        let _ = self.ctrl.send(NodeToCoord::LoadFailed {
                            epoch,
                            reason: why.to_string(),
                        });
                    }
                    EpochAction::PublishClaims => claims = true,
                    other => edge(&mut g, other),
                }
            }
        }
        if claims {
            self.publish_claims();
        }
    }

    /// What this node holds that a sealed job can run on: the current assignment, unless its
    /// experts are shared with other nodes.
    fn sealed_holding(&self) -> Option<StageAssignment> {
        self.lock_epochs().machine.sealed_holding()
    }

    /// Whether a lost link of `epoch` matters (it is assigned or installed here).
    fn holds_epoch(&self, epoch: u64) -> bool {
        self.lock_epochs().machine.holds(epoch)
    }

    /// Tells the coordinator what this node can run sealed jobs on now, in new signed claims.
    fn publish_claims(&self) {
        let claims = self.sealed.claims(self.sealed_holding().as_ref());
        let _ = self.ctrl.send(NodeToCoord::Claims(Box::new(claims)));
    }

    /// Counters of this node's streamed experts: the stage's own and those of the model serving
    /// other homes' experts, summed (`None` when neither streams experts).
    fn expert_cache(&self) -> Option<ExpertCacheStats> {
        let stage = self
            .stage_experts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|s| s.stats());
        let serving: Vec<_> = {
            let g = self.lock_epochs();
            g.serving
                .values()
                .filter_map(|m| m.expert_stats())
                .collect()
        };
        let st = stage.into_iter().chain(serving).reduce(|mut a, b| {
            a.add(&b);
            a
        })?;
        Some(ExpertCacheStats {
            budget_bytes: st.budget_bytes,
            lookups: st.lookups,
            hits: st.hits,
            misses: st.misses,
            bytes_read: st.bytes_read,
            read_wait_us: st.read_wait_us,
            disk_busy_us: st.disk_busy_us,
            peak_bytes: st.peak_bytes,
            peak_read_buffer_bytes: st.peak_read_buffer_bytes,
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
    tracing::info!(
        event = "identity",
        node_id = %identity.node_id(),
        "node id: {}",
        identity.node_id()
    );
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
    tracing::info!(
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
        tracing::info!(
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
    let listening = endpoint.local_addr()?;
    tracing::info!(
        event = "listening",
        addr = %listening,
        "listening on {listening}"
    );

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
        worker: worker_tx,
        ctrl: ctrl_tx,
        epochs: Mutex::new(Epochs {
            machine: NodeEpochs::new(MemoryLimit::of(&inventory)),
            links: Vec::new(),
            serving: BTreeMap::new(),
        }),
        stage_experts: Mutex::new(None),
        sealed: sealed::SealedWorker::open(
            &config.data_dir,
            &identity,
            config.sealed.clone(),
            budget.unwrap_or(0),
            &serde_json::to_vec(&inventory).unwrap_or_default(),
        )?,
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
                        Err(e) => tracing::warn!("refused a connection: {e}"),
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
            tracing::info!("shutting down");
            Ok(())
        }
    };
    endpoint.close();
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    result
}
