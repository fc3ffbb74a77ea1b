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

use tessera_net::{Accepted, AllowList, Endpoint, NodeIdentity};
use tokio::sync::mpsc;

use crate::error::FabricError;
use crate::inventory::{measure, Inventory, ProbeOptions};
use crate::store::ShardStore;
use tessera_proto::{Hello, NodeToCoord, Role, PROTOCOL_VERSION};

mod config;
mod data_links;
mod epochs;
mod experts;
mod hop_ledger;
mod load;
mod peer_links;
mod ring;
mod ring_out;
mod sealed;
mod session;
mod shared;
mod stage_thread;

pub use config::{AgentConfig, CoordinatorRecord, JoinTarget, ProbeLevel};
pub use load::stage_tensor_names;
pub use sealed::SealedOptions;

use epochs::{DataLink, EpochAction, EpochEvent, MemoryLimit, NodeEpochs};
use ring::serve_peer;
use session::serve_sessions;
use shared::{Epochs, Shared};
use stage_thread::worker_loop;

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
