//! [`LocalBackend`]: the whole model in this process, driven by one scheduler thread — the
//! engine behind `tessera serve`'s gateway. The gateway crate itself knows only the
//! [`Backend`] trait, so the coordinator can serve through it without compiling the engine.
//!
//! `submit` (on an HTTP worker) checks the context limit and the queue bound, then pushes the
//! request onto a bounded waiting queue and wakes the engine thread. The engine thread loops:
//! move waiting requests into the batch while there is room, drop sequences whose client has
//! gone (their KV caches with them), ask the [`Scheduler`] for the next batch, run it as *one*
//! forward pass (decode rows and prompt chunks together: embed → all layers → head on the rows
//! that need logits), and send each sequence its token. Kernels are batch-invariant, so a
//! sequence's tokens do not depend on what else shares its batch.
//!
//! With [`Speculation`] on ([`LocalBackend::start_speculative`]), each decoding sequence first
//! gets drafts (prompt lookup or a draft model, as many as its adaptive k says); its decode row
//! carries them, the head runs on each of them, the scheduler keeps the drafts equal to what
//! one-token decoding draws, and the KV cache is truncated past the first rejection. The
//! tokens are those of plain decoding.
//!
//! Embeddings ([`Backend::embed`]) wait in the same inbox and run on the same thread: one
//! bounded pass between generation steps ([`embed_queue`]), pooled as the GGUF's
//! `{arch}.pooling_type` says (mean when it has none).
//!
//! ```no_run
//! use std::sync::Arc;
//! use tessera_engine::Model;
//! use tessera_gateway::{Gateway, GatewayConfig};
//! use tessera_local::{LocalBackend, LocalConfig};
//! use tessera_model::GgufFile;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let gguf = GgufFile::open("models/stories260K.gguf")?;
//! let model = Model::load_full(&gguf, 2)?;
//! let backend = LocalBackend::start("stories260K", &gguf, model, LocalConfig::default())?;
//! let gateway = Gateway::new(Arc::new(backend), GatewayConfig::default());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! let ctrl_c = async { tokio::signal::ctrl_c().await.ok(); };
//! tessera_gateway::serve(listener, gateway, ctrl_c).await?;
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

/// Kept in the engine, where the node's stages use it too; re-exported under its old path.
pub use tessera_engine::prefix_cache;

mod embed_queue;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_engine::speculate::ModelDraft;
use tessera_engine::{Hidden, KvCache, LocalExperts, Model, Pooling, SeqStep};
use tessera_model::{human_bytes, GgufFile};
use tessera_sampling::prediction::{Predicted, PREDICTION_DRAFTS};
use tessera_sampling::speculate::{AdaptiveK, CostMeter, DraftSource, PromptLookup};

use embed_queue::{EmbedJob, EmbedQueue};
use prefix_cache::{PrefixCache, Reuse};
use tessera_api::SpeculationTotals;
use tessera_api::{
    Assignment, Backend, BackendCounters, BackendFeatures, ClusterStatus, EmbeddingHandle,
    EmbeddingRequest, Event, EventSender, GenerationRequest, Health, InventorySummary, NodeStatus,
    PlanStatus, RequestHandle, ServedModel, SubmitError,
};
use tessera_gateway::scheduler::{Output, Scheduler, SchedulerConfig, Sequence, StepItem};

/// How the local backend batches and queues.
#[derive(Clone, Copy, Debug)]
pub struct LocalConfig {
    pub scheduler: SchedulerConfig,
    /// Requests that may wait for a batch slot; more are refused with 429.
    pub max_queue: usize,
    /// Positions per sequence (clamped to the model's context length).
    pub context_length: usize,
    /// Finished sequences' KV caches kept for requests that start the same way (a chat's next
    /// turn); 0 turns prefix reuse off. Each holds `context_length` positions of memory.
    pub prefix_cache: usize,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            scheduler: SchedulerConfig::default(),
            max_queue: 64,
            context_length: usize::MAX,
            prefix_cache: DEFAULT_PREFIX_CACHE,
        }
    }
}

/// Where drafts come from, for speculative decoding (same text, fewer forward passes).
#[derive(Clone, Default)]
pub enum Speculation {
    /// One token per forward pass.
    #[default]
    Off,
    /// Prompt lookup: drafts copied from earlier in the sequence; up to `max_k` per step.
    Lookup { max_k: usize },
    /// A smaller model with the target's vocabulary
    /// ([`tessera_engine::speculate::check_same_vocabulary`]) drafts greedily; up to `max_k`
    /// per step.
    DraftModel { model: Arc<Model>, max_k: usize },
}

impl std::fmt::Debug for Speculation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Off => write!(f, "Off"),
            Self::Lookup { max_k } => write!(f, "Lookup {{ max_k: {max_k} }}"),
            Self::DraftModel { max_k, .. } => write!(f, "DraftModel {{ max_k: {max_k} }}"),
        }
    }
}

impl Speculation {
    fn max_k(&self) -> usize {
        match self {
            Self::Off => 0,
            Self::Lookup { max_k } | Self::DraftModel { max_k, .. } => *max_k,
        }
    }

    /// A drafter for one sequence of up to `capacity` positions.
    fn drafter(&self, capacity: usize) -> Option<Box<dyn DraftSource>> {
        match self {
            Self::Off => None,
            Self::Lookup { .. } => Some(Box::new(PromptLookup::default())),
            Self::DraftModel { model, .. } => {
                Some(Box::new(ModelDraft::new(model.clone(), capacity)))
            }
        }
    }
}

/// Caches kept for prefix reuse unless configured: two conversations alternating keep theirs.
pub const DEFAULT_PREFIX_CACHE: usize = prefix_cache::DEFAULT_KEPT;

struct Waiting {
    req: GenerationRequest,
    events: EventSender,
}

struct Inbox {
    waiting: VecDeque<Waiting>,
    /// Embedding requests not yet taken by the engine thread.
    embeds: VecDeque<EmbedJob>,
    shutdown: bool,
}

/// Embedding requests the engine thread holds at once; the rest wait in the inbox (bounded by
/// `max_queue`).
const EMBED_JOBS_HELD: usize = 16;

struct Shared {
    inbox: Mutex<Inbox>,
    wake: Condvar,
    counters: Mutex<BackendCounters>,
    /// Speculation's totals, when speculating.
    speculation: Mutex<Option<SpeculationTotals>>,
    /// The engine thread has exited (shutdown).
    stopped: AtomicBool,
}

/// Per-sequence state the engine thread keeps next to the scheduler's.
struct Slot {
    kv: KvCache,
    events: EventSender,
    /// Proposes drafts, when speculating.
    drafter: Option<Box<dyn DraftSource>>,
}

/// The single-process backend. Dropping it stops the engine thread.
pub struct LocalBackend {
    served: Arc<ServedModel>,
    shared: Arc<Shared>,
    config: LocalConfig,
    node: NodeStatus,
    plan: PlanStatus,
    weight_bytes: u64,
    /// How embeddings pool, or why this model's are not served.
    pooling: Result<Pooling, String>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for LocalBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBackend")
            .field("model", &self.served.id)
            .field("config", &self.config)
            .finish()
    }
}

impl LocalBackend {
    /// Starts serving `model` (loaded from `gguf`) under the name `id`.
    pub fn start(
        id: &str,
        gguf: &GgufFile,
        model: Model,
        config: LocalConfig,
    ) -> tessera_model::Result<Self> {
        Self::start_speculative(id, gguf, model, config, Speculation::Off)
    }

    /// As [`LocalBackend::start`], drafting with `speculation` (the caller has checked a draft
    /// model's vocabulary).
    pub fn start_speculative(
        id: &str,
        gguf: &GgufFile,
        model: Model,
        config: LocalConfig,
        speculation: Speculation,
    ) -> tessera_model::Result<Self> {
        let served = Arc::new(ServedModel::from_gguf(id, gguf, config.context_length)?);
        let config = LocalConfig {
            context_length: served.context_length,
            ..config
        };
        let mc = model.config().clone();
        let pooling = Pooling::from_gguf(gguf).map_err(|e| e.to_string());
        let weight_bytes = model.resident_bytes() as u64;
        let threads = model.pool().n_threads();
        let inventory = local_inventory(threads);
        let budget = inventory.ram_bytes;
        let node = NodeStatus {
            id: "local".into(),
            name: host_name(),
            address: None,
            health: Health::Healthy,
            inventory,
            budget_bytes: budget,
            used_bytes: weight_bytes,
            kv_bytes: 0,
            last_seen_ms: None,
            expert_cache: None,
        };
        let plan = PlanStatus {
            epoch: 1,
            strategy: "single process".into(),
            n_layers: mc.n_layer,
            n_experts: mc.n_expert,
            assignments: vec![Assignment {
                node_id: "local".into(),
                cell: 0,
                layers: [0, mc.n_layer],
                experts: mc.n_expert,
                embed: true,
                head: true,
                weight_bytes,
                budget_bytes: budget,
            }],
            explanation: format!(
                "One process holds the whole model ({} of weights, {} layers) and runs every \
                 step itself on {threads} threads; no network is involved. Requests are batched \
                 continuously: up to {} sequences advance together in one forward pass.",
                human_bytes(weight_bytes),
                mc.n_layer,
                config.scheduler.max_active
            ),
            cells: Vec::new(),
            shape: None,
        };
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox {
                waiting: VecDeque::new(),
                embeds: VecDeque::new(),
                shutdown: false,
            }),
            wake: Condvar::new(),
            counters: Mutex::new(BackendCounters {
                queue_capacity: config.max_queue,
                max_active_sequences: config.scheduler.max_active,
                ..BackendCounters::default()
            }),
            // Every server speculates where a client sends a prediction.
            speculation: Mutex::new(Some(SpeculationTotals::default())),
            stopped: AtomicBool::new(false),
        });
        let engine = Engine {
            model,
            served: served.clone(),
            shared: shared.clone(),
            scheduler: Scheduler::new(config.scheduler),
            capacity: config.context_length,
            prefix_cache: PrefixCache::new(config.prefix_cache),
            speculation,
            meter: CostMeter::default(),
            embeds: EmbedQueue::new(*pooling.as_ref().unwrap_or(&Pooling::Mean)),
            embed_budget: config.scheduler.max_batch_tokens,
        };
        let thread = std::thread::Builder::new()
            .name("tessera-engine".into())
            .spawn(move || engine.run())
            .expect("spawning the engine thread");
        Ok(Self {
            served,
            shared,
            config,
            node,
            plan,
            weight_bytes,
            pooling,
            thread: Some(thread),
        })
    }
}

impl Drop for LocalBackend {
    fn drop(&mut self) {
        lock(&self.shared.inbox).shutdown = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The refusals generation and embedding submissions share.
impl LocalBackend {
    /// Refuses new work once the engine is shutting down.
    fn check_serving(&self) -> Result<(), SubmitError> {
        if self.shared.stopped.load(Ordering::Relaxed) {
            return Err(SubmitError::NotServing {
                reason: "the engine is shutting down".into(),
            });
        }
        Ok(())
    }

    /// Refuses a request when `queued` requests of its kind already fill the queue.
    fn check_room(&self, queued: usize) -> Result<(), SubmitError> {
        if queued >= self.config.max_queue {
            return Err(SubmitError::QueueFull {
                capacity: self.config.max_queue,
                retry_after: Duration::from_secs(1),
            });
        }
        Ok(())
    }
}

impl Backend for LocalBackend {
    fn model(&self) -> Arc<ServedModel> {
        self.served.clone()
    }

    fn submit(&self, req: GenerationRequest) -> Result<RequestHandle, SubmitError> {
        self.check_serving()?;
        req.check(self.config.context_length)?;
        let mut inbox = lock(&self.shared.inbox);
        // Requests whose client already left do not hold queue places.
        inbox.waiting.retain(|w| !w.events.is_closed());
        self.check_room(inbox.waiting.len())?;
        let (handle, events) = RequestHandle::channel(req.id);
        tracing::debug!(
            request = req.id,
            prompt_tokens = req.prompt_tokens.len(),
            "queued"
        );
        inbox.waiting.push_back(Waiting { req, events });
        lock(&self.shared.counters).queue_depth = inbox.waiting.len();
        drop(inbox);
        self.shared.wake.notify_one();
        Ok(handle)
    }

    fn features(&self) -> BackendFeatures {
        BackendFeatures {
            logprobs: true,
            grammar: true,
            embeddings: self.pooling.is_ok(),
            prediction: true,
        }
    }

    fn embed(&self, req: EmbeddingRequest) -> Result<EmbeddingHandle, SubmitError> {
        self.check_serving()?;
        if let Err(why) = &self.pooling {
            return Err(SubmitError::Unsupported(why.clone()));
        }
        req.check(self.config.context_length)?;
        let mut inbox = lock(&self.shared.inbox);
        inbox.embeds.retain(|j| !j.reply.is_closed());
        self.check_room(inbox.embeds.len())?;
        let (handle, reply) = EmbeddingHandle::channel(req.id);
        tracing::debug!(
            request = req.id,
            inputs = req.inputs.len(),
            "embeddings queued"
        );
        inbox.embeds.push_back(EmbedJob::new(req, reply));
        drop(inbox);
        self.shared.wake.notify_one();
        Ok(handle)
    }

    fn speculation(&self) -> Option<SpeculationTotals> {
        *lock(&self.shared.speculation)
    }

    fn status(&self) -> ClusterStatus {
        let counters = lock(&self.shared.counters).clone();
        let mut node = self.node.clone();
        node.kv_bytes = counters.kv_bytes;
        node.used_bytes = self.weight_bytes + counters.kv_bytes;
        let not_serving = self
            .shared
            .stopped
            .load(Ordering::Relaxed)
            .then(|| "the engine has stopped".to_string());
        if not_serving.is_some() {
            node.health = Health::Down;
        }
        ClusterStatus {
            model: self.served.id.clone(),
            not_serving,
            nodes: vec![node],
            plan: Some(self.plan.clone()),
            links: Vec::new(),
            counters,
        }
    }
}

/// The engine thread's state.
struct Engine {
    model: Model,
    served: Arc<ServedModel>,
    shared: Arc<Shared>,
    scheduler: Scheduler<Slot>,
    capacity: usize,
    prefix_cache: PrefixCache<KvCache>,
    speculation: Speculation,
    /// Measured forward and drafting costs, for each sequence's adaptive k.
    meter: CostMeter,
    /// Embedding requests taken from the inbox.
    embeds: EmbedQueue,
    /// Rows per embedding pass.
    embed_budget: usize,
}

impl Engine {
    fn run(mut self) {
        loop {
            if !self.take_work() {
                break;
            }
            let cancelled = self.scheduler.take_where(|s| s.payload.events.is_closed());
            if !cancelled.is_empty() {
                for s in &cancelled {
                    tracing::info!(
                        request = s.id,
                        "request cancelled; sequence dropped, KV freed"
                    );
                }
                lock(&self.shared.counters).cancelled_total += cancelled.len() as u64;
                self.keep_caches(cancelled);
            }
            self.embed_pass();
            if self.scheduler.is_idle() {
                self.publish(0, 0, 0);
                continue;
            }
            self.draft();
            let items = self.scheduler.plan_step();
            let t = Instant::now();
            match self.forward(&items) {
                Ok(logits) => {
                    let rows = items.iter().map(|it| it.n_tokens).sum();
                    self.meter.record_forward(rows, t.elapsed().as_secs_f64());
                    self.deliver(&items, &logits);
                }
                Err(e) => self.fail_all(&e.to_string()),
            }
        }
        // Shutting down: whoever is still waiting gets told.
        self.embeds.fail_all("the server is shutting down");
        for j in lock(&self.shared.inbox).embeds.drain(..) {
            let _ = j.reply.send(Err("the server is shutting down".into()));
        }
        let left = self.scheduler.take_where(|_| true);
        for s in left {
            let _ = s.payload.events.send(Event::Failed {
                message: "the server is shutting down".into(),
            });
        }
        self.shared.stopped.store(true, Ordering::Relaxed);
    }

    /// One embedding pass, when embeddings wait (cancelled ones dropped first).
    fn embed_pass(&mut self) {
        let cancelled = self.embeds.drop_cancelled();
        if cancelled > 0 {
            tracing::info!(cancelled, "embedding requests cancelled");
            lock(&self.shared.counters).cancelled_total += cancelled as u64;
        }
        if self.embeds.is_empty() {
            return;
        }
        let rows = self.embeds.step(&self.model, self.embed_budget);
        let mut c = lock(&self.shared.counters);
        c.steps_total += 1;
        c.prompt_tokens_total += rows as u64;
    }

    /// Asks each speculating sequence's drafter for drafts: the server's draft source, or the
    /// client's prediction (which a server without speculation drafts from too).
    fn draft(&mut self) {
        let decoding = self
            .scheduler
            .active()
            .iter()
            .filter(|s| !s.is_prefilling())
            .count();
        let costs = self.meter.costs(decoding);
        let t = Instant::now();
        let mut drafted = 0;
        self.scheduler.draft(&costs, |history, k, slot| {
            let d = slot
                .drafter
                .as_mut()
                .map_or_else(Vec::new, |x| x.propose(history, k));
            drafted += d.len();
            d
        });
        self.meter.record_draft(drafted, t.elapsed().as_secs_f64());
    }

    /// Moves waiting requests into the batch while there is room; sleeps while there is nothing
    /// to do. Returns `false` on shutdown.
    fn take_work(&mut self) -> bool {
        let mut inbox = lock(&self.shared.inbox);
        loop {
            if inbox.shutdown {
                return false;
            }
            inbox.waiting.retain(|w| !w.events.is_closed());
            while self.embeds.len() < EMBED_JOBS_HELD {
                let Some(j) = inbox.embeds.pop_front() else {
                    break;
                };
                self.embeds.push(j);
            }
            while self.scheduler.has_room() {
                let Some(w) = inbox.waiting.pop_front() else {
                    break;
                };
                let (kv, reused) = match self.prefix_cache.take(&w.req.prompt_tokens) {
                    Some(Reuse { mut kv, reused }) => {
                        kv.truncate(reused);
                        let _ = w.events.send(Event::PromptCached(reused));
                        (kv, reused)
                    }
                    None => (self.model.new_kv(self.capacity), 0),
                };
                tracing::debug!(request = w.req.id, reused, "joins the batch");
                // A client's prediction is this sequence's draft source, whatever the server's.
                let (drafter, max_k) = if w.req.prediction.is_empty() {
                    (
                        self.speculation.drafter(self.capacity),
                        self.speculation.max_k(),
                    )
                } else {
                    let p = Predicted::new(w.req.prediction, w.req.prompt_tokens.len());
                    let max_k = match self.speculation.max_k() {
                        0 => PREDICTION_DRAFTS,
                        k => k,
                    };
                    (Some(Box::new(p) as Box<dyn DraftSource>), max_k)
                };
                let mut seq = Sequence::new(
                    w.req.id,
                    w.req.prompt_tokens,
                    w.req.params,
                    w.req.max_tokens,
                    self.capacity,
                    Slot {
                        kv,
                        events: w.events,
                        drafter,
                    },
                )
                .with_options(w.req.logprobs, w.req.grammar)
                .with_cached_prefix(reused);
                if seq.payload.drafter.is_some() {
                    seq = seq.with_speculation(AdaptiveK::new(max_k));
                }
                self.scheduler.admit(seq);
            }
            lock(&self.shared.counters).queue_depth = inbox.waiting.len() + inbox.embeds.len();
            if !self.scheduler.is_idle() || !self.embeds.is_empty() {
                return true;
            }
            inbox = self
                .shared
                .wake
                .wait_timeout(inbox, Duration::from_millis(500))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// One forward pass over every item; the logits of the items that want them, in order.
    fn forward(&mut self, items: &[StepItem]) -> tessera_engine::Result<Vec<Vec<f32>>> {
        let mut tokens = Vec::new();
        for it in items {
            tokens.extend(self.scheduler.tokens(it));
        }
        let batch: Vec<SeqStep> = items
            .iter()
            .map(|it| SeqStep {
                n_tokens: it.n_tokens,
                start_pos: it.start_pos,
            })
            .collect();
        let model = &self.model;
        let mut hidden = model.embed(&tokens)?;
        {
            let mut want = items.iter().map(|it| it.seq).peekable();
            let mut kvs: Vec<&mut KvCache> = Vec::with_capacity(items.len());
            for (i, s) in self.scheduler.active_mut().iter_mut().enumerate() {
                if want.peek() == Some(&i) {
                    want.next();
                    kvs.push(&mut s.payload.kv);
                }
            }
            model.run_layers(
                0..model.config().n_layer,
                &mut hidden,
                &batch,
                &mut kvs,
                &mut LocalExperts(model),
            )?;
        }
        // The head only on the rows that sample: the last of each item that wants logits, and
        // the drafts' rows before it.
        let n_embd = hidden.n_embd;
        let mut rows = Vec::new();
        let mut end = 0;
        for it in items {
            end += it.n_tokens;
            rows.extend(end - it.logits_rows()..end);
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let mut last = Hidden::zeros(rows.len(), n_embd);
        for (k, &r) in rows.iter().enumerate() {
            last.row_mut(k).copy_from_slice(hidden.row(r));
        }
        let logits = model.head(&last)?;
        Ok((0..rows.len()).map(|k| logits.row(k).to_vec()).collect())
    }

    fn deliver(&mut self, items: &[StepItem], logits: &[Vec<f32>]) {
        let prompt_fed: usize = items
            .iter()
            .filter(|it| self.scheduler.active()[it.seq].is_prefilling())
            .map(|it| it.n_tokens)
            .sum();
        let rows: Vec<&[f32]> = logits.iter().map(Vec::as_slice).collect();
        let served = &self.served;
        let (outputs, mut finished) = self
            .scheduler
            .handle_logits(items, &rows, &|t| served.is_end_of_generation(t));
        // Rejected drafts' positions leave the caches.
        for s in self.scheduler.active_mut() {
            let fed = s.fed();
            s.payload.kv.truncate(fed);
        }
        for s in &mut finished {
            let fed = s.fed();
            s.payload.kv.truncate(fed);
        }
        if let Some(t) = lock(&self.shared.speculation).as_mut() {
            *t = self.scheduler.speculation();
        }
        let mut generated = 0;
        for out in outputs {
            let (id, event) = match out {
                Output::Token {
                    id,
                    token,
                    logprobs,
                } => {
                    generated += 1;
                    match logprobs {
                        Some(lp) => (id, Event::TokenLogprobs(lp)),
                        None => (id, Event::Token(token)),
                    }
                }
                Output::Failed { id, message } => (id, Event::Failed { message }),
                Output::Finished { id, reason, usage } => {
                    tracing::debug!(request = id, ?reason, ?usage, "finished");
                    (id, Event::Finished { reason, usage })
                }
            };
            let target = self
                .scheduler
                .active()
                .iter()
                .map(|s| (s.id, &s.payload.events))
                .chain(finished.iter().map(|s| (s.id, &s.payload.events)))
                .find(|(sid, _)| *sid == id);
            if let Some((_, tx)) = target {
                // A closed channel is noticed (and the sequence dropped) on the next step.
                let _ = tx.send(event);
            }
        }
        self.keep_caches(finished);
        self.publish(1, prompt_fed, generated);
    }

    /// Keeps ended sequences' caches for the next request that starts the same way.
    fn keep_caches(&mut self, ended: Vec<Sequence<Slot>>) {
        for s in ended {
            let tokens = s.fed_tokens().to_vec();
            self.prefix_cache.put(tokens, s.payload.kv);
        }
    }

    fn fail_all(&mut self, message: &str) {
        tracing::error!(error = message, "forward pass failed; failing the batch");
        let all = self.scheduler.take_where(|_| true);
        for s in all {
            let _ = s.payload.events.send(Event::Failed {
                message: message.to_string(),
            });
        }
    }

    /// Updates the shared counters after a step.
    fn publish(&self, steps: u64, prompt_tokens: usize, generated: usize) {
        let kv: usize = self
            .scheduler
            .active()
            .iter()
            .map(|s| s.payload.kv.bytes())
            .sum::<usize>()
            + self.embeds.kv_bytes();
        let mut c = lock(&self.shared.counters);
        c.steps_total += steps;
        c.prompt_tokens_total += prompt_tokens as u64;
        c.generated_tokens_total += generated as u64;
        c.active_sequences = self.scheduler.active().len();
        c.kv_bytes = kv as u64;
    }
}

/// This machine, as far as /proc tells (empty fields where it does not).
fn local_inventory(threads: usize) -> InventorySummary {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default();
    let flags = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags"))
        .unwrap_or_default();
    let mut notes = Vec::new();
    for f in ["avx2", "avx512f", "fma"] {
        if flags.split_whitespace().any(|x| x == f) {
            notes.push(f.to_uppercase());
        }
    }
    let ram_bytes = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024);
    InventorySummary {
        cpu,
        threads,
        ram_bytes,
        vram_bytes: 0,
        mem_bandwidth: 0,
        notes,
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}
