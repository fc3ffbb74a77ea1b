//! The coordinator as a [`tessera_api::Backend`]: one OpenAI endpoint in front of the ring.
//!
//! Each HTTP request becomes a sequence driven over the current epoch's stages by the same code
//! that serves `tessera run` ([`crate::driver`]): opened on every stage, prefilled, decoded
//! around the ring, closed everywhere. Stages batch the sequences that are in flight together
//! (one forward pass and one frame per step for all of them), so concurrent requests share ring
//! steps; kernels are batch-invariant, so each request gets the tokens it would get alone.
//!
//! * **Admission**: at most `max_active` sequences run at once; up to `max_queue` more wait for
//!   a slot; beyond that [`SubmitError::QueueFull`]. While no epoch is ready, every request gets
//!   [`SubmitError::NotServing`] with the reason (no plan, loading, linking, failed).
//! * **Cancellation**: a dropped [`RequestHandle`] closes its channel; the request's task sees
//!   it, cancels the sequence, and the driver closes it on every stage, each of which frees its
//!   KV cache and answers with its statistics.
//! * **KV accounting**: per node, the KV of the sequences open on it (estimated from the
//!   positions each has reached), plus the worst case of any sequence a stage never confirmed
//!   closing. When every stage has acknowledged every close, each node's figure is back to 0.
//! * **Batching evidence**: stage 0 attributes each hidden-state frame's bytes to the sequences
//!   in it in equal shares, so a decode step shared by `k` sequences leaves each
//!   `floor(fixed / k)` bytes of frame overhead instead of `fixed`. From the closed sequences'
//!   statistics this gives a rigorous lower bound on the decode tokens that ran in shared steps,
//!   and so an upper bound on the ring steps taken ([`BatchingStats`]).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tessera_api::{
    Assignment, Backend, BackendCounters, BackendFeatures, CellStatus, ClusterStatus,
    EmbeddingHandle, EmbeddingRequest, Event, EventSender, FinishReason, GenerationRequest, Health,
    InventorySummary, LinkStatus, NodeStatus, PlanShape, PlanStatus, RequestHandle, RingStage,
    ServedModel, SpeculationTotals, SubmitError, Usage,
};
use tessera_model::GgufFile;
use tessera_net::NodeId;
use tessera_proto::{FinishReason as SeqFinish, RunRequest, StepEntry, StepHeader};
use tokio::sync::Semaphore;

use crate::error::CoordError;
use crate::membership::Phase;
use crate::run::RunEvent;
use crate::server::Coordinator;
use crate::shared::Shared;

/// Settings of the cluster backend.
#[derive(Clone, Debug)]
pub struct ClusterBackendConfig {
    /// Sequences in flight on the ring at once.
    pub max_active: usize,
    /// Requests that may wait for a slot before new ones get 429.
    pub max_queue: usize,
    /// Prompt tokens per prefill step.
    pub prefill_chunk: usize,
    /// Drafts per ring turn by prompt lookup for every request (0: off).
    pub speculate: usize,
    /// Why the plan is what it is (shown on the dashboard).
    pub explanation: String,
}

impl Default for ClusterBackendConfig {
    fn default() -> Self {
        Self {
            max_active: 64,
            max_queue: 64,
            prefill_chunk: 64,
            speculate: 0,
            explanation: String::new(),
        }
    }
}

pub use crate::ledger::BatchingStats;
use crate::ledger::{LiveSeq, Rates};

/// One request's counts, kept by its sink as tokens arrive and read when it ends.
#[derive(Debug, Default)]
struct Tally {
    /// Positions the sequence has reached (the ledger reads them for the KV it holds).
    positions: Arc<AtomicUsize>,
    /// Tokens sent into the HTTP stream.
    sent: AtomicUsize,
    cached: AtomicUsize,
    /// The HTTP stream is closed.
    gone: AtomicBool,
}

struct Inner {
    shared: Arc<Shared>,
    model: Arc<ServedModel>,
    config: ClusterBackendConfig,
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    active: AtomicUsize,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    cancelled: AtomicU64,
    rt: tokio::runtime::Handle,
    /// The model's sizes the ledger counts in.
    rates: Rates,
}

/// The coordinator's [`Backend`]: serves requests over the current epoch's ring.
#[derive(Clone)]
pub struct ClusterBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ClusterBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterBackend")
            .field("model", &self.inner.model.id)
            .finish_non_exhaustive()
    }
}

impl ClusterBackend {
    /// A backend over `coordinator`, serving its model as `name`. Must be called inside a tokio
    /// runtime (request tasks run on it).
    pub fn new(
        coordinator: &Coordinator,
        name: &str,
        config: ClusterBackendConfig,
    ) -> Result<Self, CoordError> {
        let shared = coordinator.shared().clone();
        let g = GgufFile::open(&shared.config.model)?;
        let model = ServedModel::from_gguf(name, &g, shared.config.max_context)?;
        let c = &shared.model.config;
        let kv_per_pos_layer = coordinator
            .kv_type()
            .bytes_per_position(tessera_model::kv::KvShape::from_config(c))
            as u64;
        let one = StepHeader {
            n_embd: c.n_embd as u32,
            entries: vec![StepEntry {
                seq: 0,
                start_pos: 0,
                n_tokens: 1,
                flags: StepEntry::SAMPLE,
            }],
        };
        let empty = StepHeader {
            n_embd: c.n_embd as u32,
            entries: Vec::new(),
        };
        let frame_fixed = (tessera_net::frame::HEADER_LEN + empty.encoded_len()) as u64;
        let frame_per_seq = (one.encoded_len() - empty.encoded_len() + c.n_embd * 4) as u64;
        let row_bytes = c.n_embd as u64 * 4;
        let config = ClusterBackendConfig {
            max_active: config.max_active.max(1),
            ..config
        };
        Ok(Self {
            inner: Arc::new(Inner {
                shared,
                model: Arc::new(model),
                slots: Arc::new(Semaphore::new(config.max_active)),
                config,
                waiting: AtomicUsize::new(0),
                active: AtomicUsize::new(0),
                prompt_tokens: AtomicU64::new(0),
                generated_tokens: AtomicU64::new(0),
                cancelled: AtomicU64::new(0),
                rt: tokio::runtime::Handle::current(),
                rates: Rates {
                    kv_per_pos_layer,
                    frame_fixed,
                    frame_per_seq,
                    row_bytes,
                },
            }),
        })
    }

    /// `None` when an epoch is ready to serve; otherwise why not.
    pub fn not_serving(&self) -> Option<NotServing> {
        not_serving(&self.inner.shared)
    }

    /// Waits until an epoch is ready, calling `progress` with each new reason it is not yet.
    pub async fn wait_ready(
        &self,
        timeout: Duration,
        mut progress: impl FnMut(&str),
    ) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = String::new();
        loop {
            match self.not_serving() {
                None => return Ok(()),
                Some(r @ NotServing::Failed { .. }) => return Err(r.to_string()),
                Some(r) => {
                    let r = r.to_string();
                    if r != last {
                        progress(&r);
                        last = r;
                    }
                }
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!("not ready after {timeout:?}: {last}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What the closed sequences say about batching so far.
    pub fn batching(&self) -> BatchingStats {
        self.inner.shared.view().ledger.batching()
    }

    /// Cancels every sequence in flight and waits (at most `timeout`) until each is closed on
    /// every stage. New requests still get admitted; stop the HTTP server first.
    pub async fn drain(&self, timeout: Duration) {
        let live = |shared: &Shared| shared.view().ledger.live();
        for s in live(&self.inner.shared) {
            crate::driver::cancel(&self.inner.shared, s);
        }
        let deadline = tokio::time::Instant::now() + timeout;
        while self.inner.active.load(Ordering::Relaxed) + self.inner.waiting.load(Ordering::Relaxed)
            > 0
            && tokio::time::Instant::now() < deadline
        {
            for s in live(&self.inner.shared) {
                crate::driver::cancel(&self.inner.shared, s);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Why the cluster is not serving yet (or any more): the gateway's 503 reason, `up`'s progress
/// lines, and — [`NotServing::Failed`] — the end of waiting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotServing {
    /// No plan yet: nodes are still joining.
    NoPlan { connected: usize },
    /// The epoch's stages are fetching and loading their shards.
    Loading {
        epoch: u64,
        loaded: usize,
        stages: usize,
    },
    /// Every stage is loaded; the ring is being linked.
    Linking { epoch: u64 },
    /// The plan cannot be carried out (a stage refused it): waiting will not help.
    Failed { epoch: u64, reason: String },
    /// The epoch was released and a new one is being planned.
    Replanning { epoch: u64 },
}

impl std::fmt::Display for NotServing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoPlan { connected } => {
                write!(f, "waiting for nodes: {connected} connected, no plan yet")
            }
            Self::Loading {
                epoch,
                loaded,
                stages,
            } => write!(
                f,
                "loading shards: {loaded} of {stages} stages loaded (epoch {epoch})"
            ),
            Self::Linking { epoch } => write!(f, "linking the ring (epoch {epoch})"),
            Self::Failed { epoch, reason } => {
                write!(f, "the plan failed (epoch {epoch}): {reason}")
            }
            Self::Replanning { epoch } => write!(f, "replanning (epoch {epoch} released)"),
        }
    }
}

fn not_serving(shared: &Shared) -> Option<NotServing> {
    let view = shared.view();
    let m = &view.membership;
    let cells = m.cells();
    if cells.is_empty() {
        return Some(NotServing::NoPlan {
            connected: m.connected().len(),
        });
    }
    // One ready cell serves; otherwise the cell furthest along says why not yet, and with
    // none under way the first cell's end says why not at all.
    if cells.iter().any(|e| e.phase == Phase::Ready) {
        return None;
    }
    let e = cells
        .iter()
        .find(|e| e.phase == Phase::Linking)
        .or_else(|| cells.iter().find(|e| e.phase == Phase::Loading))
        .unwrap_or(&cells[0]);
    let epoch = e.id;
    match &e.phase {
        Phase::Ready => None,
        Phase::Loading => Some(NotServing::Loading {
            epoch,
            loaded: e.stages.iter().filter(|s| s.loaded.is_some()).count(),
            stages: e.stages.len(),
        }),
        Phase::Linking => Some(NotServing::Linking { epoch }),
        Phase::Failed(r) => Some(NotServing::Failed {
            epoch,
            reason: r.to_string(),
        }),
        Phase::Released => Some(NotServing::Replanning { epoch }),
    }
}

impl Backend for ClusterBackend {
    fn model(&self) -> Arc<ServedModel> {
        self.inner.model.clone()
    }

    fn submit(&self, req: GenerationRequest) -> Result<RequestHandle, SubmitError> {
        if let Some(reason) = self.not_serving() {
            return Err(SubmitError::NotServing {
                reason: reason.to_string(),
            });
        }
        // The context the plan was made for (`--plan auto` chooses it after this backend is
        // made): a longer request is refused here, saying the limit, not by a stage.
        let context = self
            .inner
            .model
            .context_length
            .min(self.inner.shared.max_context().max(1));
        req.check(context)?;
        let inner = &self.inner;
        // Waiting requests are those that found no free slot; reserve a place atomically.
        let free = inner.slots.available_permits();
        let waiting = inner.waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= free + inner.config.max_queue {
            inner.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull {
                capacity: inner.config.max_queue,
                retry_after: Duration::from_secs(1),
            });
        }
        let (handle, events) = RequestHandle::channel(req.id);
        let seq = inner.shared.next_seq.fetch_add(1, Ordering::Relaxed);
        inner.rt.spawn(drive(inner.clone(), seq, req, events));
        Ok(handle)
    }

    fn status(&self) -> ClusterStatus {
        status(&self.inner)
    }

    /// The sampling stage applies grammars and reports log-probabilities (the wire carries
    /// both, and a resumed run replays the grammar over its tokens so far).
    fn features(&self) -> BackendFeatures {
        BackendFeatures {
            logprobs: true,
            grammar: true,
            embeddings: false,
            prediction: true,
        }
    }

    /// No stage returns final hidden states yet; `tessera serve` (one process) computes them.
    fn embed(&self, _req: EmbeddingRequest) -> Result<EmbeddingHandle, SubmitError> {
        Err(SubmitError::Unsupported(
            tessera_api::NO_CLUSTER_EMBEDDINGS.into(),
        ))
    }

    /// The ring's speculation, counted from closed sequences' sampling stages (any request
    /// with a prediction speculates, whatever the cluster's setting).
    fn speculation(&self) -> Option<SpeculationTotals> {
        Some(self.inner.shared.view().ledger.speculation())
    }
}

/// Runs one request: waits for a slot, drives the sequence, relays tokens, accounts.
async fn drive(inner: Arc<Inner>, seq: u64, req: GenerationRequest, events: EventSender) {
    let permit = tokio::select! {
        p = inner.slots.clone().acquire_owned() => p.ok(),
        () = events.closed() => None,
    };
    inner.waiting.fetch_sub(1, Ordering::SeqCst);
    let Some(_permit) = permit else {
        inner.cancelled.fetch_add(1, Ordering::Relaxed);
        return;
    };
    inner.active.fetch_add(1, Ordering::SeqCst);
    let prompt_len = req.prompt_tokens.len();
    inner
        .prompt_tokens
        .fetch_add(prompt_len as u64, Ordering::Relaxed);
    let run_req = RunRequest {
        prompt: None,
        prompt_tokens: Some(req.prompt_tokens),
        max_new_tokens: req.max_tokens,
        sampling: req.params,
        stages: None,
        prefill_chunk: inner.config.prefill_chunk.max(1),
        trace: false,
        stop_at_eog: true,
        // The sampling stage compiles the grammar anew (the gateway's compiled one checked
        // the spec and is not sent).
        grammar: req.grammar.as_ref().map(|g| g.spec().clone()),
        logprobs: req.logprobs,
        // A client's prediction is drafted from even where the cluster does not speculate.
        speculate: match (inner.config.speculate, req.prediction.is_empty()) {
            (0, false) => tessera_sampling::prediction::PREDICTION_DRAFTS,
            (k, _) => k,
        },
        prediction: (!req.prediction.is_empty())
            .then_some(tessera_proto::Prediction::Tokens(req.prediction)),
    };
    // Each token goes from where the cluster hears it straight into this request's HTTP
    // stream: that stream is the one channel, and the sink takes no lock another run takes
    // (its position count is its own).
    let tally = Arc::new(Tally::default());
    let sink = {
        let (inner, tally, events) = (inner.clone(), tally.clone(), events.clone());
        move |e: RunEvent| match e {
            RunEvent::Started {
                stages,
                prompt_tokens,
                cached_tokens,
                ..
            } => {
                tally
                    .positions
                    .store(prompt_tokens.len(), Ordering::Relaxed);
                let live = LiveSeq {
                    stages: stages.iter().map(|s| (s.node_id, s.layers.len())).collect(),
                    positions: tally.positions.clone(),
                };
                inner
                    .shared
                    .with(move |core, _| core.ledger_mut().started(seq, live));
                tally.cached.store(cached_tokens, Ordering::Relaxed);
                if cached_tokens > 0 && events.send(Event::PromptCached(cached_tokens)).is_err() {
                    tally.gone.store(true, Ordering::Relaxed);
                }
            }
            RunEvent::Token {
                token, logprobs, ..
            } => {
                tally.positions.fetch_add(1, Ordering::Relaxed);
                inner.generated_tokens.fetch_add(1, Ordering::Relaxed);
                if !tally.gone.load(Ordering::Relaxed) {
                    let event = match logprobs {
                        Some(lp) => Event::TokenLogprobs(lp),
                        None => Event::Token(token),
                    };
                    if events.send(event).is_ok() {
                        tally.sent.fetch_add(1, Ordering::Relaxed);
                    } else {
                        // The client left: the drive below sees the stream closed and
                        // cancels (never from here, where the cluster is deciding).
                        tally.gone.store(true, Ordering::Relaxed);
                    }
                }
            }
            _ => {}
        }
    };
    let shared = inner.shared.clone();
    let result = match crate::driver::start(&shared, seq, &run_req, sink) {
        Err(e) => Err(e),
        Ok((prompt_len, ending)) => {
            let run = crate::driver::finish(&shared, seq, prompt_len, ending);
            tokio::pin!(run);
            tokio::select! {
                r = &mut run => r,
                () = events.closed() => {
                    // The client left: the run's machine takes the cancellation as an input.
                    crate::driver::cancel(&shared, seq);
                    loop {
                        tokio::select! {
                            r = &mut run => break r,
                            () = tokio::time::sleep(Duration::from_millis(50)) => {
                                crate::driver::cancel(&shared, seq);
                            }
                        }
                    }
                }
            }
        }
    };
    let gone = tally.gone.load(Ordering::Relaxed);
    let sent = tally.sent.load(Ordering::Relaxed);
    let cached = tally.cached.load(Ordering::Relaxed);
    let cancelled = gone || events.is_closed();
    let result = Some(result);
    if cancelled {
        inner.cancelled.fetch_add(1, Ordering::Relaxed);
    }
    let booked = match &result {
        Some(Ok(report)) => Some(report.clone()),
        _ => None,
    };
    let rates = inner.rates;
    // Booked before the client hears the end: what it reads of the cluster next includes it.
    inner
        .shared
        .ask(move |core, _| core.ledger_mut().ended(seq, booked.as_ref(), rates))
        .await;
    let outcome = match result {
        Some(Ok(report)) => match report.reason {
            SeqFinish::Length => Event::Finished {
                reason: FinishReason::Length,
                usage: Usage {
                    prompt_tokens: prompt_len,
                    completion_tokens: sent,
                    cached_tokens: cached,
                },
            },
            SeqFinish::EndOfGeneration => Event::Finished {
                reason: FinishReason::Stop,
                usage: Usage {
                    prompt_tokens: prompt_len,
                    completion_tokens: sent,
                    cached_tokens: cached,
                },
            },
            SeqFinish::Cancelled | SeqFinish::Error => Event::Failed {
                message: report
                    .error
                    .unwrap_or_else(|| format!("the sequence ended: {}", report.reason)),
            },
        },
        Some(Err(e)) => Event::Failed {
            message: e.to_string(),
        },
        None => Event::Failed {
            message: "the sequence was dropped".into(),
        },
    };
    if !cancelled {
        let _ = events.send(outcome);
    }
    inner.active.fetch_sub(1, Ordering::SeqCst);
}

fn status(inner: &Inner) -> ClusterStatus {
    let shared = &inner.shared;
    let not_serving = not_serving(shared);
    let st = shared.view();
    let kv = st.ledger.kv_per_node(inner.rates);
    let (link_bytes, batching) = (st.ledger.link_bytes(), st.ledger.batching());
    let cfg = &shared.model.config;
    // The cells that hold (or are taking) their nodes; the first describes the plan.
    let held: Vec<&crate::membership::Epoch> = st
        .membership
        .cells()
        .iter()
        .filter(|e| !matches!(e.phase, Phase::Released | Phase::Failed(_)))
        .collect();
    let epoch = held.first().copied().or_else(|| {
        st.membership
            .epoch()
            .filter(|e| !matches!(e.phase, Phase::Released))
    });
    let n_cells = st.membership.cells().len();
    // The weight bytes a node's stage keeps resident (the gateway words what it holds).
    let weights_of = |id: &NodeId| -> u64 {
        held.iter()
            .find_map(|e| e.stages.iter().find(|s| s.node_id == *id))
            .and_then(|s| s.loaded.as_ref())
            .map_or(0, |l| l.resident_bytes)
    };
    // A node's budget: the one it set, else what it measured as available at start.
    let budget_of = |m: &crate::membership::Member| {
        m.memory_budget_bytes
            .or_else(|| m.inventory.as_ref().and_then(|i| i.memory.available_bytes))
            .unwrap_or(0)
    };
    let mut members: Vec<&crate::membership::Member> = st.membership.members().collect();
    members.sort_by_key(|m| (!m.connected, m.joined));
    let nodes: Vec<NodeStatus> = members
        .into_iter()
        .map(|m| {
            let weights = weights_of(&m.node_id);
            let expert_cache =
                st.expert_cache
                    .get(&m.node_id)
                    .map(|c| tessera_api::ExpertCacheStatus {
                        budget_bytes: c.budget_bytes,
                        hits: c.hits,
                        misses: c.misses,
                        disk_bytes: c.bytes_read,
                        read_wait_us: c.read_wait_us,
                        disk_busy_us: c.disk_busy_us,
                        peak_bytes: c.peak_bytes,
                    });
            let kv_bytes = kv.get(&m.node_id).copied().unwrap_or(0);
            let inventory = m
                .inventory
                .as_ref()
                .map_or_else(InventorySummary::default, |inv| {
                    let mut notes = vec![format!("{} {}", inv.host.os, inv.host.arch)];
                    notes.extend(inv.cpu.features.iter().take(6).cloned());
                    if let Some(c) = &inv.compute {
                        notes.push(format!("{:.1} Gop/s ({})", c.ops_per_s / 1e9, c.source));
                    }
                    InventorySummary {
                        cpu: inv
                            .cpu
                            .model_name
                            .clone()
                            .unwrap_or_else(|| "unknown CPU".into()),
                        threads: inv.cpu.usable_cores.or(inv.cpu.logical_cores).unwrap_or(0),
                        ram_bytes: inv.memory.total_bytes.unwrap_or(0),
                        vram_bytes: 0,
                        mem_bandwidth: inv
                            .memory_bandwidth
                            .as_ref()
                            .map_or(0, |b| b.read_all_threads as u64),
                        notes,
                    }
                });
            NodeStatus {
                id: m.node_id.to_string(),
                name: m.name.clone(),
                address: Some(m.addr.to_string()),
                health: if m.connected {
                    Health::Healthy
                } else {
                    Health::Down
                },
                inventory,
                budget_bytes: budget_of(m),
                used_bytes: weights + kv_bytes,
                kv_bytes,
                last_seen_ms: m.connected.then_some(0),
                expert_cache,
            }
        })
        .collect();
    let budget = |id: &NodeId| st.membership.member(id).map_or(0, budget_of);
    // The current epoch's expert split (after a failover it differs from the configured one):
    // experts per layer each node holds, resolved against the members by name or id.
    let members = st.membership.member_candidates();
    let expert_owners: Option<Vec<(NodeId, usize)>> =
        st.membership.epoch_expert_split().map(|split| {
            split
                .groups
                .iter()
                .filter_map(|g| {
                    crate::assignment::find_node(&g.node, &members)
                        .ok()
                        .map(|id| (id, g.experts.len()))
                })
                .collect()
        });
    let plan = epoch.map(|e| {
        // The plan's shape as data (expert-only nodes sit in the ring as stages of no layers:
        // only the others are named); the gateway's dashboard words it.
        let shape = PlanShape {
            ring: e
                .stages
                .iter()
                .filter(|s| !s.layers.is_empty())
                .map(|s| RingStage {
                    node: st
                        .membership
                        .member(&s.node_id)
                        .map_or_else(|| s.node_id.short(), |m| m.name.clone()),
                    layers: [s.layers.start, s.layers.end],
                })
                .collect(),
            expert_split: st
                .membership
                .epoch_expert_split()
                .map(|split| split.to_string()),
            cells: n_cells.max(1),
            note: inner.config.explanation.clone(),
        };
        let held_experts = |id: &NodeId| match &expert_owners {
            Some(owners) => owners.iter().filter(|(o, _)| o == id).map(|(_, k)| k).sum(),
            None => cfg.n_expert,
        };
        let cells: Vec<&crate::membership::Epoch> =
            if n_cells > 1 { held.clone() } else { vec![e] };
        let mut assignments: Vec<Assignment> = cells
            .iter()
            .flat_map(|e| {
                e.stages.iter().enumerate().map(|(i, s)| Assignment {
                    node_id: s.node_id.to_string(),
                    cell: e.cell,
                    layers: [s.layers.start, s.layers.end],
                    experts: held_experts(&s.node_id),
                    embed: i == 0,
                    head: s.layers.end == cfg.n_layer,
                    weight_bytes: s.loaded.as_ref().map_or(0, |l| l.resident_bytes),
                    budget_bytes: budget(&s.node_id),
                })
            })
            .collect();
        // Expert-only nodes: no layers, their share of every MoE layer's experts.
        for (id, k) in expert_owners.iter().flatten() {
            if e.stages.iter().all(|s| s.node_id != *id) {
                assignments.push(Assignment {
                    node_id: id.to_string(),
                    cell: 0,
                    layers: [0, 0],
                    experts: *k,
                    embed: false,
                    head: false,
                    weight_bytes: 0,
                    budget_bytes: budget(id),
                });
            }
        }
        let cells: Vec<CellStatus> = if n_cells > 1 {
            st.membership
                .cells()
                .iter()
                .map(|e| CellStatus {
                    cell: e.cell,
                    epoch: e.id,
                    state: e.phase.to_string(),
                    nodes: e.stages.iter().map(|s| s.node_id.to_string()).collect(),
                    active: st.cells.seated(e.id),
                    decode_tokens_per_s: st.cells.speed(e.id).unwrap_or(0.0),
                })
                .collect()
        } else {
            Vec::new()
        };
        PlanStatus {
            epoch: e.id,
            // Worded by the gateway from `shape`.
            strategy: String::new(),
            n_layers: cfg.n_layer,
            n_experts: cfg.n_expert,
            assignments,
            explanation: String::new(),
            cells,
            shape: Some(shape),
        }
    });
    let links: Vec<LinkStatus> = held
        .iter()
        .filter(|e| e.stages.len() > 1)
        .flat_map(|e| {
            let n = e.stages.len();
            e.stages
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let next = e.stages[(i + 1) % n].node_id;
                    LinkStatus {
                        from: s.node_id.to_string(),
                        to: next.to_string(),
                        bytes_total: link_bytes.get(&(s.node_id, next)).copied().unwrap_or(0),
                        rtt_us: s.link.map_or(0, |l| l.rtt_median.as_micros() as u64),
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let kv_total = kv.values().sum();
    let counters = BackendCounters {
        queue_depth: inner.waiting.load(Ordering::Relaxed),
        queue_capacity: inner.config.max_queue,
        active_sequences: inner.active.load(Ordering::Relaxed),
        max_active_sequences: inner.config.max_active,
        kv_bytes: kv_total,
        steps_total: batching.steps_at_most + batching.prefill_steps,
        prompt_tokens_total: inner.prompt_tokens.load(Ordering::Relaxed),
        generated_tokens_total: inner.generated_tokens.load(Ordering::Relaxed),
        cancelled_total: inner.cancelled.load(Ordering::Relaxed),
    };
    ClusterStatus {
        model: inner.model.id.clone(),
        not_serving: not_serving.map(|r| r.to_string()),
        nodes,
        plan,
        links,
        counters,
    }
}

/// An even split of `n_layer` layers over `n` stages, larger stages first (`5` over `3`:
/// `0..2, 2..4, 4..5`), as `--split` syntax.
pub fn even_split(n_layer: usize, n: usize) -> String {
    crate::replan::even_ranges(n_layer, n)
        .iter()
        .map(|r| format!("{}..{}", r.start, r.end))
        .collect::<Vec<_>>()
        .join(",")
}

/// Reads a model's layer count (for [`even_split`]).
pub fn model_layers(path: &Path) -> Result<usize, CoordError> {
    let g = GgufFile::open(path)?;
    Ok(tessera_model::ModelConfig::from_gguf(&g)?.n_layer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_splits_cover_every_layer() {
        assert_eq!(even_split(5, 3), "0..2,2..4,4..5");
        assert_eq!(even_split(5, 1), "0..5");
        assert_eq!(even_split(2, 3), "0..1,1..2");
        assert_eq!(even_split(28, 3), "0..10,10..19,19..28");
    }
}
