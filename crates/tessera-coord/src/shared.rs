//! The coordinator's shared state: its settings, the model it serves, the membership machine
//! behind a lock, the per-node senders, the routes to running generations and the gate. Each
//! session, run shell and the HTTP backend hold an `Arc<Shared>`; decisions stay in the pure
//! machines ([`Membership`], `run::RunMachine`), this is only where their state lives.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_host::Manifest;
use tessera_model::{ModelConfig, Tokenizer};
use tessera_net::{Connection, NodeId};
use tessera_proto::{CoordToNode, MemberStatus, NodeToCoord, StageSpec};
use tokio::sync::{mpsc, watch};

use crate::distribute::ModelServer;
use crate::enrol::Enrolment;
use crate::membership::{Action, Event, Membership, Phase};
use crate::replan::ModelBytes;
use crate::state::{EnrolmentState, EpochRecord, EpochStageRecord};

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

/// Where a cell's epoch is, for drivers waiting on it (the watch holds one per cell).
#[derive(Clone, Debug, PartialEq)]
pub enum EpochStatus {
    Pending(u64),
    Ready(u64),
    Failed(u64, String),
}

/// What changes while the coordinator runs, behind [`Shared::lock`] (the persistent records are
/// in [`crate::state`]).
pub(crate) struct LiveState {
    pub membership: Membership,
    /// Each connected node's current control session and its outbox.
    senders: HashMap<NodeId, NodeSender>,
    sessions: u64,
    pub routes: HashMap<u64, mpsc::UnboundedSender<RouteMsg>>,
    /// The latest expert-cache counters each node streaming experts from disk reported.
    pub expert_cache: HashMap<NodeId, tessera_proto::ExpertCacheStats>,
    /// Which requests are seated on which cell, and each cell's measured speed.
    pub cells: crate::cells::CellBook,
    /// Keys whose lease expired in the last step: the sealed desk hears of them once the lock
    /// is released ([`Shared::apply`]).
    lease_expired: Vec<tessera_net::PublicKey>,
}

impl LiveState {
    pub fn new(membership: Membership) -> Self {
        Self {
            membership,
            senders: HashMap::new(),
            sessions: 0,
            routes: HashMap::new(),
            expert_cache: HashMap::new(),
            cells: crate::cells::CellBook::default(),
            lease_expired: Vec::new(),
        }
    }

    /// Makes `tx` and `conn` node `id`'s current control session (replacing an older one of a
    /// node that reconnected) and returns the session's number.
    pub fn open_session(
        &mut self,
        id: NodeId,
        tx: mpsc::UnboundedSender<CoordToNode>,
        conn: Connection,
    ) -> u64 {
        self.sessions += 1;
        let session = self.sessions;
        self.senders.insert(id, NodeSender { session, tx, conn });
        session
    }

    /// Ends node `id`'s control session `session`; false when a newer session has replaced it
    /// (then the node has not left).
    pub fn close_session(&mut self, id: NodeId, session: u64) -> bool {
        let current = self.senders.get(&id).is_some_and(|s| s.session == session);
        if current {
            self.senders.remove(&id);
        }
        current
    }
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
    pub state: Mutex<LiveState>,
    /// Each cell's epoch status, by slot: changes whenever a cell's epoch or phase does.
    pub epoch_tx: watch::Sender<Vec<EpochStatus>>,
    /// Notified when a request leaves its cell: requests waiting for KV room look again.
    pub seats_freed: tokio::sync::Notify,
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
    /// Sealed jobs: the desk that routes them, and the clients waiting for them.
    pub sealed: Mutex<crate::sealed::SealedEdge>,
}

impl Shared {
    pub fn max_context(&self) -> usize {
        self.max_context.load(Ordering::SeqCst)
    }

    /// The sealed-job desk. Never held while taking [`Shared::lock`] (nor the other way).
    pub fn sealed(&self) -> std::sync::MutexGuard<'_, crate::sealed::SealedEdge> {
        self.sealed.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, LiveState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Feeds an event to the membership machine and carries out its actions. A node whose
    /// lease expired leaves the sealed desk in the same step (its jobs move on at once, its
    /// claims are unlisted): the session it had ends under the lease, and is no longer the
    /// node's current one when its reader stops, so the session's own ending cannot say so.
    pub fn apply(&self, event: Event) {
        let expired = {
            let mut st = self.lock();
            self.apply_locked(&mut st, event);
            std::mem::take(&mut st.lease_expired)
        };
        // The desk's lock is never taken under the state's.
        for key in expired {
            crate::sealed::edge::node_left(self, crate::sealed::edge::node_key(&key));
        }
    }

    /// [`Shared::apply`] with the state already locked (to decide and act atomically).
    pub(crate) fn apply_locked(&self, st: &mut LiveState, event: Event) {
        let before = cell_phases(&st.membership);
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
                        st.lease_expired.push(s.conn.peer_key());
                    }
                }
                Action::EpochReady(e) => {
                    tracing::info!(event = "epoch_ready", epoch = e, "epoch {e} is ready");
                    // Who holds which experts in it (an expert split; after a loss the
                    // survivors hold the departed owner's): one event per holder.
                    let candidates = st.membership.member_candidates();
                    for g in st
                        .membership
                        .epoch_with_id(e)
                        .and_then(|x| x.experts.as_ref())
                        .map_or(&[][..], |x| &x.groups)
                    {
                        // A group names its node by name or by its id (or a 4+ character
                        // prefix of it), resolved as placement resolved it: a one-letter
                        // name must not match another node's id that starts with it.
                        let name = crate::assignment::find_node(&g.node, &candidates)
                            .ok()
                            .and_then(|id| st.membership.member(&id))
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
        // The status drivers wait on follows every cell's epoch.
        let after = cell_phases(&st.membership);
        let status: Vec<EpochStatus> = after
            .iter()
            .map(|(id, phase)| match phase {
                Phase::Loading | Phase::Linking => EpochStatus::Pending(*id),
                Phase::Ready => EpochStatus::Ready(*id),
                Phase::Failed(r) => EpochStatus::Failed(*id, r.clone()),
                Phase::Released => EpochStatus::Failed(*id, "released".into()),
            })
            .collect();
        self.epoch_tx.send_if_modified(|s| {
            if *s == status {
                false
            } else {
                *s = status;
                true
            }
        });
        for e in st.membership.cells() {
            if !before.contains(&(e.id, e.phase.clone())) {
                self.record_epoch(&st.membership, e);
            }
        }
        if before != after {
            let live: Vec<u64> = after.iter().map(|(id, _)| *id).collect();
            st.cells.retain_cells(&live);
        }
        self.release_drained(st);
    }

    /// Releases the draining epochs no run is seated on any more (make before break: a new
    /// split took their cell, and their last runs ended).
    pub(crate) fn release_drained(&self, st: &mut LiveState) {
        let drained = st
            .membership
            .draining()
            .iter()
            .map(|e| e.id)
            .find(|&e| st.cells.seated(e) == 0);
        if let Some(epoch) = drained {
            tracing::info!(
                event = "epoch_drained",
                epoch,
                "epoch {epoch} drained: releasing it"
            );
            // Applying it looks again for the next.
            self.apply_locked(st, Event::Drained { epoch });
        }
    }

    /// Records a cell's epoch (its placement, phase and load evidence) durably.
    fn record_epoch(&self, m: &Membership, e: &crate::membership::Epoch) {
        let rec = EpochRecord {
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

/// Each cell's epoch number and phase, by slot.
/// Every cell's epoch and every draining one (runs on those wait for their changes too).
fn cell_phases(m: &Membership) -> Vec<(u64, Phase)> {
    m.cells()
        .iter()
        .chain(m.draining())
        .map(|e| (e.id, e.phase.clone()))
        .collect()
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

/// What reaches a run: a message from a node about one of its attempts, or its cancellation.
#[derive(Debug)]
pub(crate) enum RouteMsg {
    Node(NodeId, NodeToCoord),
    Cancel,
}
