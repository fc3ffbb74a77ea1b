//! The coordinator's shared state: its settings, the model it serves, the [`Cluster`] (every
//! decision) with the I/O handles its outputs go to, and the gate. Each session, run shell and
//! the HTTP backend hold an `Arc<Shared>` and only translate I/O into the cluster's inputs and
//! its outputs into I/O ([`Shared::handle`]).

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
use tokio::sync::mpsc;

use crate::cluster::{Cluster, ClusterInput, ClusterOutput, RunNews};
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

/// What changes while the coordinator runs, behind [`Shared::lock`]: the [`Cluster`] that
/// decides, and the I/O handles its outputs go to (each node's control session, each run's
/// owner). The persistent records are in [`crate::state`].
pub(crate) struct Core {
    pub cluster: Cluster,
    /// Each connected node's current control session and its outbox.
    outboxes: HashMap<NodeId, NodeOutbox>,
    /// Where each run's news goes.
    owners: HashMap<u64, RunOwner>,
}

impl Core {
    pub fn new(cluster: Cluster) -> Self {
        Self {
            cluster,
            outboxes: HashMap::new(),
            owners: HashMap::new(),
        }
    }
}

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
    pub core: Mutex<Core>,
    /// Woken when the cluster's next timeout may have come closer ([`spawn_clock`]).
    pub clock: Arc<tokio::sync::Notify>,
    pub next_seq: AtomicU64,
    /// Control session numbers.
    pub next_session: AtomicU64,
    /// Node lease, ms (see [`Coordinator::set_lease`]).
    pub lease_ms: AtomicU64,
    /// Where plan epochs are recorded.
    pub store: Arc<dyn EnrolmentState>,
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
    /// Sealed jobs: the desk that routes them, and the clients waiting for them.
    pub sealed: Mutex<crate::sealed::SealedEdge>,
}

impl Shared {
    pub fn max_context(&self) -> usize {
        self.max_context.load(Ordering::SeqCst)
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The time since the coordinator started, as the cluster counts it.
    pub fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// Feeds the cluster one input and carries out its outputs: sends and news under the
    /// lock (channel sends), the rest (records, refusals, the sealed desk, closing a
    /// connection) after it.
    pub fn handle(&self, input: ClusterInput) {
        self.handle_with(input, |_| {});
    }

    /// [`Shared::handle`], after `prepare` (under the same lock: a new session's outbox, a
    /// run's owner).
    pub fn handle_with(&self, input: ClusterInput, prepare: impl FnOnce(&mut Core)) {
        let mut later = Vec::new();
        {
            let mut core = self.lock();
            prepare(&mut core);
            let before = core.cluster.poll_timeout();
            let outputs = core.cluster.handle(self.now(), input);
            for o in outputs {
                match o {
                    ClusterOutput::ToNode { to, msg } => {
                        if let Some(s) = core.outboxes.get(&to) {
                            let _ = s.tx.send(*msg);
                        }
                    }
                    ClusterOutput::Run { run, news } => {
                        if matches!(news, RunNews::Ended(_)) {
                            if let Some(mut owner) = core.owners.remove(&run) {
                                owner(news);
                            }
                        } else if let Some(owner) = core.owners.get_mut(&run) {
                            owner(news);
                        }
                    }
                    ClusterOutput::LeaseExpired { node, session } => {
                        if core
                            .outboxes
                            .get(&node)
                            .is_some_and(|s| s.session == session)
                        {
                            let s = core.outboxes.remove(&node).expect("checked");
                            later.push(Later::Expired(s.conn));
                        }
                    }
                    ClusterOutput::NodeLeft { key, .. } => later.push(Later::Left(key)),
                    ClusterOutput::RecordEpoch(r) => later.push(Later::Record(r)),
                    ClusterOutput::Refused { node, why } => later.push(Later::Refused(node, why)),
                }
            }
            let after = core.cluster.poll_timeout();
            if after.is_some() && (before.is_none() || after < before) {
                self.clock.notify_one();
            }
        }
        // The desk's lock is never taken under the core's.
        for l in later {
            match l {
                Later::Expired(conn) => {
                    conn.close("lease expired");
                    crate::sealed::edge::node_left(
                        self,
                        crate::sealed::edge::node_key(&conn.peer_key()),
                    );
                }
                Later::Left(key) => {
                    crate::sealed::edge::node_left(self, crate::sealed::edge::node_key(&key));
                }
                Later::Record(mut rec) => {
                    rec.recorded_at_unix_ms = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64);
                    if let Err(e) = self.store.record_epoch(&rec) {
                        tracing::warn!("recording epoch {}: {e}", rec.epoch);
                    }
                }
                Later::Refused(node, why) => self.authz.refuse(node, &why),
            }
        }
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
        self.handle_with(ClusterInput::Joined(Box::new(member)), |core| {
            core.outboxes.insert(id, NodeOutbox { session, tx, conn });
        });
        session
    }

    /// Ends node `id`'s control session `session` (a newer session may have replaced it: then
    /// the node has not left).
    pub fn close_session(&self, id: NodeId, session: u64) {
        self.handle_with(ClusterInput::Left { node: id, session }, |core| {
            if core.outboxes.get(&id).is_some_and(|s| s.session == session) {
                core.outboxes.remove(&id);
            }
        });
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
        self.handle_with(input, |core| {
            core.owners.insert(run, owner);
        });
    }

    /// The node lease.
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms.load(Ordering::Relaxed).max(1))
    }

    /// Sends a message to a node, if it is connected.
    pub fn send(&self, to: NodeId, msg: CoordToNode) -> bool {
        self.lock()
            .outboxes
            .get(&to)
            .is_some_and(|s| s.tx.send(msg).is_ok())
    }
}

impl crate::sealed::edge::SealedHost for Shared {
    /// The sealed-job desk. Never held while taking [`Shared::lock`] (nor the other way).
    fn sealed(&self) -> std::sync::MutexGuard<'_, crate::sealed::SealedEdge> {
        self.sealed.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, to: NodeId, msg: CoordToNode) -> bool {
        Self::send(self, to, msg)
    }

    fn member_name(&self, id: &NodeId) -> Option<String> {
        self.lock()
            .cluster
            .membership()
            .member(id)
            .map(|m| m.name.clone())
    }

    fn closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }
}

/// A run's owner: called with each piece of its news where the cluster decides it. It must
/// only hand the news on (a channel send, a counter), never call back into the cluster.
pub(crate) type RunOwner = Box<dyn FnMut(RunNews) + Send>;

/// What is done after the core's lock is released.
enum Later {
    Expired(Connection),
    Left(tessera_net::PublicKey),
    Record(Box<crate::state::EpochRecord>),
    Refused(NodeId, crate::authz::Refusal),
}

/// The cluster's clock: sleeps until its next timeout (or until a nearer one is armed) and
/// feeds it `Timeout`, until the coordinator is dropped.
pub(crate) fn spawn_clock(shared: &Arc<Shared>) {
    let weak = Arc::downgrade(shared);
    let nearer = shared.clock.clone();
    let started = shared.started;
    tokio::spawn(async move {
        loop {
            let notified = nearer.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let next = match weak.upgrade() {
                Some(s) => s.lock().cluster.poll_timeout(),
                None => return,
            };
            let sleep = async {
                match next {
                    Some(t) => tokio::time::sleep_until(started + t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = sleep => match weak.upgrade() {
                    Some(s) => s.handle(ClusterInput::Timeout),
                    None => return,
                },
                () = &mut notified => {}
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
    let core = shared.lock();
    let m = core.cluster.membership();
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
