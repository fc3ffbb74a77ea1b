//! The coordinator's I/O loop: the QUIC endpoint and its accept loop, each connection's streams
//! (control sessions in [`crate::session`], model streams in [`crate::distribute`]).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tessera_host::Manifest;
use tessera_model::{GgufFile, ModelConfig, Tokenizer};
use tessera_net::{Accepted, Connection, Endpoint, JoinToken, NodeId, NodeIdentity};
use tessera_proto::{limits, stream, StageSpec};

use crate::cluster::{Cluster, ClusterConfig, ClusterInput};
use crate::distribute::ModelServer;
use crate::enrol::Enrolment;
use crate::error::CoordError;
use crate::membership::Membership;
use crate::state::{EnrolmentState, RedbState};

use crate::session::control_session;
use crate::shared::{
    model_bytes, CoordinatorConfig, ModelInfo, Shared, SharedParts, DEFAULT_LEASE,
};
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
        let (enrol, enrolment) = Enrolment::open(Box::new(store.clone()), identity.node_id())?;
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
        let cluster = Cluster::new(
            ClusterConfig {
                model: server.manifest().model_hash,
                n_layer: model.config.n_layer,
                kv_shape: tessera_model::kv::KvShape::from_config(&model.config),
                max_context,
                initial_split: config.split.clone(),
            },
            membership,
            DEFAULT_LEASE,
        );
        let coordinator = Self {
            shared: Shared::start(
                SharedParts {
                    id: identity.node_id(),
                    config,
                    enrol,
                    model,
                    server,
                    enrolment,
                    store,
                    max_context,
                },
                cluster,
            ),
            endpoint,
        };
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
        self.shared
            .with(move |core, _| core.cluster.set_lease(lease));
        self.shared
            .lease_ms
            .store(lease.as_millis().max(1) as u64, Ordering::Relaxed);
    }

    /// The last plan epoch handed out (continues across restarts).
    pub fn last_epoch(&self) -> u64 {
        self.shared.view().membership.last_epoch_id()
    }

    /// Why no epoch can be placed right now (no feasible plan on the connected nodes), for a
    /// front end to answer "503 Service Unavailable" with; `None` when the cluster has capacity.
    pub fn outage(&self) -> Option<crate::replan::NoPlacement> {
        self.shared.view().membership.outage().cloned()
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
                    Ok(Accepted::Enrolment(req)) => match enrol_stranger(&shared, req).await {
                        Some(c) => c,
                        None => return,
                    },
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
            .view()
            .expert_cache
            .iter()
            .map(|(id, c)| (*id, *c))
            .collect();
        v.sort_by_key(|(id, _)| id.to_string());
        v
    }

    /// Connected nodes in join order, with the inventory, budget and link each reported (for
    /// planning from measured inventory, [`tessera_placement::planning`]).
    pub fn connected_members(&self) -> Vec<crate::membership::Member> {
        self.shared
            .view()
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
        let nodes = self.shared.view().membership.candidates();
        let placed = crate::assignment::resolve(stages, n_layer, &nodes)?;
        self.shared.handle(ClusterInput::Plan {
            stages: placed.clone(),
        });
        Ok(placed)
    }

    /// How sealed jobs are verified, and (tests only) how this coordinator misbehaves with them.
    /// Call before clients connect.
    pub fn set_sealed(&self, settings: &crate::sealed::SealedSettings) {
        let settings = settings.clone();
        self.shared.with(move |core, _| core.set_sealed(&settings));
    }

    /// Most positions per sequence in the plans made from now on (a planner's choice of the
    /// context that fits; call before applying its stages).
    pub fn set_max_context(&self, positions: usize) {
        self.shared.max_context.store(positions, Ordering::SeqCst);
        self.shared
            .with(move |core, _| core.cluster.set_max_context(positions));
    }

    pub fn max_context(&self) -> usize {
        self.shared.max_context()
    }

    /// The KV cache type stages are assigned from the next plan on (call before nodes join for
    /// the first plan to use it). Returns once the cluster has it ([`Coordinator::kv_type`]
    /// says so from then on).
    pub async fn set_kv_type(&self, kv_type: tessera_model::kv::KvType) {
        self.shared
            .ask(move |core, _| core.cluster.set_kv_type(kv_type))
            .await;
    }

    pub fn kv_type(&self) -> tessera_model::kv::KvType {
        self.shared.view().membership.kv_type()
    }

    /// Splits every MoE layer's experts across nodes in the plans made from now on (call before
    /// nodes join for the initial split to use it). Returns once the cluster has it.
    pub async fn set_expert_split(&self, split: Option<crate::assignment::ExpertSplit>) {
        self.shared
            .ask(move |core, _| core.cluster.set_expert_split(split))
            .await;
    }

    /// The bytes of experts each named node keeps in memory in the plans made from now on (the
    /// rest streamed from its disk), as the coordinator's own plan placed them. Returns once the
    /// cluster has them.
    pub async fn set_expert_budgets(&self, budgets: std::collections::BTreeMap<String, u64>) {
        self.shared
            .ask(move |core, _| core.cluster.set_expert_budgets(budgets))
            .await;
    }

    /// Closes every connection (peers are told at once) and stops accepting.
    pub fn close(&self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        self.shared.with(|core, _| core.cluster.set_closing());
        self.endpoint.close();
    }

    /// Waits (at most a second) until closed connections are shut down.
    pub async fn wait_idle(&self) {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), self.endpoint.wait_idle())
            .await;
    }
}

/// Takes an unknown key through enrolment: a place among the enrolments in progress (bounded
/// per source address; a silent one gives way to a newcomer, [`crate::enrolling`]), its claim
/// within the first-message deadline, then the token and the proof judged
/// ([`crate::enrol::EnrolmentBook::judge_now`], on the core task). The connection, enrolled,
/// or `None` (refused and logged).
async fn enrol_stranger(shared: &Shared, req: tessera_net::EnrolmentRequest) -> Option<Connection> {
    let id = req.peer_id();
    let from = req.remote_addr();
    let Some(mut slot) = shared.enrolment_slot(from.ip()).await else {
        let why = "too many enrolments in progress; retry later";
        let _ = req.refuse(tessera_net::Refusal::Other(why.into()));
        shared.authz.log_net(Some(id), &why, || {
            format!("refused enrolment of {id} from {from}: {why}")
        });
        return None;
    };
    let claimed = tokio::select! {
        r = req.read_claim() => r,
        () = slot.evicted() => {
            // Dropping the request closes its connection.
            let why = "silent enrolment gave way to a newcomer";
            shared.authz.log_net(Some(id), &why, || {
                format!("ended enrolment of {id} from {from}: {why}")
            });
            return None;
        }
    };
    let result: Result<Connection, CoordError> = match claimed {
        Ok(c) => {
            slot.claimed();
            let judged = shared
                .ask(move |core, _| {
                    let verdict = core.enrolment.judge_now(&c);
                    (c, verdict)
                })
                .await;
            // Judged: the place is free before the answer's I/O (a refusal waits for the peer
            // to read it, and must not hold a place meanwhile).
            drop(slot);
            match judged {
                Some((c, Ok(()))) => c.accept().await.map_err(Into::into),
                Some((c, Err(r))) => Err(c.refuse(r.into()).await.into()),
                None => Err(CoordError::Protocol("the coordinator is closing".into())),
            }
        }
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(c) => {
            tracing::info!(event = "enrolled", node_id = %id, "enrolled node {}", id.short());
            Some(c)
        }
        Err(e) => {
            shared.authz.log_net(Some(id), &e, || {
                format!("refused enrolment of {id} from {from}: {e}")
            });
            None
        }
    }
}

async fn serve_connection(shared: Arc<Shared>, conn: Connection) {
    // Every connection of a key is known, so that revoking the key ends them all: checked and
    // tracked in one step of the core, so a revocation is either before (refused here) or
    // after (it closes this connection).
    let tracked = conn.clone();
    let enrolled = shared
        .ask(move |core, _| {
            let enrolled = core.enrolment.grant_of(&tracked.peer_key()).is_some();
            if enrolled {
                core.door.track(&tracked);
            }
            enrolled
        })
        .await;
    if enrolled != Some(true) {
        conn.close("revoked");
        return;
    }
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
                    let ended = shared.clone();
                    if let Err(e) = control_session(shared, conn, s).await {
                        stream_failed(&ended, "control", &peer, &e);
                    }
                });
            }
            stream::MODEL => {
                tokio::spawn(async move {
                    let peer = conn.peer_id().short();
                    let mut s = s;
                    s.reader.set_max_len(limits::CONTROL);
                    let key = conn.peer_key();
                    let authorize = |req: &tessera_proto::ModelRequest| {
                        authorize_model_request(&shared, &key, req)
                    };
                    if let Err(e) = shared.server.serve(s, peer.clone(), &authorize).await {
                        stream_failed(&shared, "model", &peer, &e);
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

/// Logs a node stream that ended in error: a warning, unless the coordinator's own stop ended
/// it (every stream ends then, and that is not worth a warning).
fn stream_failed(shared: &Shared, what: &str, peer: &str, e: &dyn std::fmt::Display) {
    if shared.closing.load(Ordering::SeqCst) {
        tracing::debug!("{what} stream of {peer}: {e}");
    } else {
        tracing::warn!("{what} stream of {peer}: {e}");
    }
}

/// Whether `key` may have what `req` asks for now ([`crate::model_access`]): the manifest
/// with a node credential, chunks only of the tensors its live assignments need. A refusal is
/// counted and logged within the gate's budget.
fn authorize_model_request(
    shared: &Shared,
    key: &tessera_net::PublicKey,
    req: &tessera_proto::ModelRequest,
) -> Result<(), String> {
    use crate::model_access::{assigned_tensors, check_chunks, check_manifest};
    let node = key.node_id();
    let Some(grant) = shared.enrol.grant_of(key) else {
        return Err("this key is revoked".into());
    };
    let verdict = match req {
        tessera_proto::ModelRequest::Manifest { .. } => check_manifest(grant),
        tessera_proto::ModelRequest::Chunks { ids, .. } => {
            let parts = assigned_tensors(
                &shared.view().membership,
                shared.model.config.n_layer,
                &node,
            );
            check_chunks(grant, &parts.chunks(shared.server.manifest()), ids)
        }
    };
    verdict.map_err(|e| {
        let why = crate::authz::Refusal::ModelBytes(e);
        shared.authz.refuse(node, &why);
        why.to_string()
    })
}
