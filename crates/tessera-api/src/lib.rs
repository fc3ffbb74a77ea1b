//! The seam between the HTTP layer and whatever runs the model.
//!
//! The gateway speaks OpenAI on one side and [`Backend`] on the other. A backend takes a
//! tokenized [`GenerationRequest`] and streams back token ids as [`Event`]s; everything textual —
//! chat templates, detokenization, stop strings, JSON — stays in the gateway, so a backend only
//! has to schedule sequences and run forwards. Two implement it:
//!
//! * `tessera_local::LocalBackend`: the whole model in this process, with a continuous-batching
//!   scheduler thread.
//! * the distributed coordinator (crates/tessera-coord), which fans each step out over the
//!   stages of the current plan.
//!
//! Cancellation is by ownership: dropping a [`RequestHandle`] closes its event channel, and the
//! backend, seeing the channel closed ([`EventSender::is_closed`]), drops the sequence and frees
//! its KV cache on every stage that holds part of it.
//!
//! [`ClusterStatus`] is what the backend knows about the machines — nodes, plan, its own counters
//! — in one serde value that the dashboard, `/api/status` and `/metrics` read.
//!
//! # Implementing it for the coordinator
//!
//! * [`Backend::model`]: build a [`ServedModel`] once with [`ServedModel::from_gguf`] (the
//!   coordinator holds the GGUF it distributes).
//! * [`Backend::submit`]: return [`SubmitError::NotServing`] with a reason while no epoch is
//!   ready ("loading shards: 45%", "replanning after node b7c9 left"); check the context and a
//!   bounded queue; then `RequestHandle::channel(req.id)`, keep the sender with the sequence and
//!   return the handle. Never block.
//! * The driver advances every active sequence once per ring step (one forward per stage per
//!   step, as `tessera_local::LocalBackend` does in one process), sends each generated token as
//!   [`Event::Token`] — stopping at [`ServedModel::is_end_of_generation`] without sending it —
//!   and ends with [`Event::Finished`], or [`Event::Failed`] when a stage is lost and the
//!   sequence cannot be resumed.
//! * Cancellation: before each step (or with `tokio::select!` on [`EventSender::closed`]), a
//!   closed sender means the client left: close the sequence on every stage so each frees its
//!   KV, and count it in [`BackendCounters::cancelled_total`].
//! * [`Backend::status`]: nodes from membership (with per-node `kv_bytes`, so `/metrics` shows
//!   KV returning to zero on every stage), the current epoch's assignments and the planner's
//!   explanation, bytes per link, and the counters.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tessera_grammar::{Grammar, GrammarCompiler, GrammarError};
use tessera_model::{ChatTemplate, GgufFile, ModelConfig, Tokenizer};
use tessera_sampling::SamplingParams;
use tessera_sampling::TokenLogprobs;
use tokio::sync::mpsc;

mod share;

pub use share::{ClientId, OverShare};

/// A request id, unique in this process (`chatcmpl-…` ids are derived from it).
pub type RequestId = u64;

/// One generation, tokenized: what a backend is asked to do.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub id: RequestId,
    /// The prompt, BOS included where the model wants one. Never empty.
    pub prompt_tokens: Vec<u32>,
    pub params: SamplingParams,
    /// At most this many generated tokens. The backend also stops when the context is full.
    pub max_tokens: usize,
    /// Report each token's log-probability and this many alternatives
    /// ([`Event::TokenLogprobs`]); only for a backend whose [`Backend::features`] has `logprobs`.
    pub logprobs: Option<usize>,
    /// Constrain the tokens to a grammar; only for a backend whose [`Backend::features`] has
    /// `grammar`.
    pub grammar: Option<Grammar>,
    /// The answer the client predicts, in tokens (OpenAI's `prediction`; empty: none): the
    /// backend drafts from it and checks the drafts, so the text is the same and an answer
    /// that follows it takes fewer forward passes. Only for a backend whose
    /// [`Backend::features`] has `prediction`.
    pub prediction: Vec<u32>,
}

impl GenerationRequest {
    /// A plain request: no log-probabilities, no grammar.
    pub fn new(
        id: RequestId,
        prompt_tokens: Vec<u32>,
        params: SamplingParams,
        max_tokens: usize,
    ) -> Self {
        Self {
            id,
            prompt_tokens,
            params,
            max_tokens,
            logprobs: None,
            grammar: None,
            prediction: Vec::new(),
        }
    }
}

/// What a backend can do beyond plain sampling. The gateway refuses (400, naming the
/// parameter) what the backend cannot do, so no parameter is silently ignored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendFeatures {
    /// [`GenerationRequest::logprobs`] is honoured.
    pub logprobs: bool,
    /// [`GenerationRequest::grammar`] is honoured.
    pub grammar: bool,
    /// [`Backend::embed`] computes sequence embeddings (otherwise it answers
    /// [`SubmitError::Unsupported`]).
    pub embeddings: bool,
    /// [`GenerationRequest::prediction`] is drafted from.
    pub prediction: bool,
}

/// Sequence embeddings, tokenized: one pooled vector per input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbeddingRequest {
    pub id: RequestId,
    /// Each input's tokens (BOS included where the model wants one). None is empty, each fits
    /// the context, and the gateway has held their number and total to its limits.
    pub inputs: Vec<Vec<u32>>,
}

impl EmbeddingRequest {
    /// The checks every backend makes before taking embeddings: at least one input, none
    /// empty, each within `context_length` positions.
    pub fn check(&self, context_length: usize) -> Result<(), SubmitError> {
        if self.inputs.is_empty() {
            return Err(SubmitError::Invalid("no input to embed".into()));
        }
        for (i, t) in self.inputs.iter().enumerate() {
            if t.is_empty() {
                return Err(SubmitError::Invalid(format!("input {i} has no tokens")));
            }
            if t.len() > context_length {
                return Err(SubmitError::ContextTooLong {
                    limit: context_length,
                    got: t.len(),
                    prompt: t.len(),
                    completion: 0,
                });
            }
        }
        Ok(())
    }
}

/// What [`Backend::embed`] answers: each input's pooled final hidden state, in input order,
/// not normalized (the front end normalizes where its API says so).
#[derive(Clone, Debug, PartialEq)]
pub struct Embeddings {
    pub vectors: Vec<Vec<f32>>,
    /// Tokens run, all inputs together.
    pub prompt_tokens: usize,
}

/// The backend's end of an embedding request: send the answer, or why there is none.
pub type EmbeddingSender = tokio::sync::oneshot::Sender<Result<Embeddings, String>>;

/// A submitted embedding request. Await [`EmbeddingHandle::result`]; drop it to cancel (the
/// backend sees [`EmbeddingSender::is_closed`] and drops the work).
#[derive(Debug)]
pub struct EmbeddingHandle {
    pub id: RequestId,
    answer: tokio::sync::oneshot::Receiver<Result<Embeddings, String>>,
}

impl EmbeddingHandle {
    /// A handle and the sender the backend keeps for it.
    pub fn channel(id: RequestId) -> (Self, EmbeddingSender) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (Self { id, answer: rx }, tx)
    }

    /// The vectors, or why the backend could not compute them (also when it dropped the
    /// request without answering).
    pub async fn result(self) -> Result<Embeddings, String> {
        self.answer
            .await
            .unwrap_or_else(|_| Err("the backend dropped the request".into()))
    }
}

impl GenerationRequest {
    /// The checks every backend makes before taking a request (one place, so that a request
    /// means the same thing whichever backend serves it): a prompt, a token to generate, and
    /// room for both in a context of `context_length` positions.
    pub fn check(&self, context_length: usize) -> Result<(), SubmitError> {
        if self.prompt_tokens.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        if self.max_tokens == 0 {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        let (prompt, completion) = (self.prompt_tokens.len(), self.max_tokens);
        if prompt >= context_length || prompt.saturating_add(completion) > context_length {
            return Err(SubmitError::ContextTooLong {
                limit: context_length,
                got: prompt.saturating_add(completion),
                prompt,
                completion,
            });
        }
        Ok(())
    }
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token (not emitted), or — decided by the gateway — a stop string.
    Stop,
    /// `max_tokens` generated, or the context is full.
    Length,
}

impl FinishReason {
    /// OpenAI's `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Token counts of one request (OpenAI's `usage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values were reused from an earlier request (not
    /// prefilled again).
    #[serde(default)]
    pub cached_tokens: usize,
}

/// Whether an answer was verified: a second, independent worker produced the same tokens.
/// Only backends that run on machines nobody vouches for report it; an answer from a backend
/// that does not carries no mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    Verified,
    Unverified,
}

impl Check {
    pub fn is_verified(self) -> bool {
        self == Self::Verified
    }

    /// The mark of several choices: verified only if every one was.
    pub fn all(checks: impl IntoIterator<Item = Option<Self>>) -> Option<Self> {
        let mut out = None;
        for c in checks {
            out = match (out, c) {
                (_, None) => return None,
                (None | Some(Self::Verified), Some(c)) => Some(c),
                (Some(Self::Unverified), Some(_)) => Some(Self::Unverified),
            };
        }
        out
    }
}

/// What a backend streams back for one request, in order: any number of `Token`s, then exactly
/// one `Finished` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token (end-of-generation tokens are not sent).
    Token(u32),
    /// A generated token with its log-probabilities, sent instead of `Token` when the request
    /// asked for them.
    TokenLogprobs(TokenLogprobs),
    /// The first `n` prompt tokens were already cached (sent before the first token, when a
    /// backend reuses a prefix).
    PromptCached(usize),
    /// Whether a second worker reproduced the answer, sent before `Finished` by a backend whose
    /// workers are strangers (sealed mode). The front ends mark the answer with it.
    Checked(Check),
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    /// The backend could not finish the request (a stage failed and no replan could resume it).
    Failed {
        message: String,
    },
}

/// The backend's end of a request's event stream.
pub type EventSender = mpsc::UnboundedSender<Event>;

/// A submitted request. Receive its events with [`RequestHandle::next_event`]; drop it to cancel.
#[derive(Debug)]
pub struct RequestHandle {
    pub id: RequestId,
    events: mpsc::UnboundedReceiver<Event>,
}

impl RequestHandle {
    /// A handle and the sender the backend keeps for it.
    pub fn channel(id: RequestId) -> (Self, EventSender) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { id, events: rx }, tx)
    }

    /// The next event, or `None` if the backend dropped the request without finishing it.
    pub async fn next_event(&mut self) -> Option<Event> {
        self.events.recv().await
    }
}

/// Why a request was not accepted. Each maps to one HTTP status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The waiting queue is full (429, with `Retry-After`). Retryable.
    #[error("the request queue is full ({capacity} waiting); retry after {retry_after:?}")]
    QueueFull {
        capacity: usize,
        retry_after: Duration,
    },
    /// Prompt plus requested completion do not fit the context (400).
    #[error(
        "this model's maximum context length is {limit} tokens, but {got} tokens were requested \
         ({prompt} in the prompt, {completion} for the completion)"
    )]
    ContextTooLong {
        limit: usize,
        got: usize,
        prompt: usize,
        completion: usize,
    },
    /// No plan is serving (503), with the reason (no nodes, loading, replanning...). Retryable.
    #[error("not serving: {reason}")]
    NotServing { reason: String },
    /// The request cannot be run as given (400), e.g. an empty prompt.
    #[error("{0}")]
    Invalid(String),
    /// The client already holds its fair share of the server (429, with `Retry-After`; the
    /// gateway's fair admission, before the backend sees the request).
    #[error("{0}")]
    OverShare(OverShare),
    /// This backend does not do what was asked (501), with what and why.
    #[error("{0}")]
    Unsupported(String),
}

/// The 501 a cluster (and a sealed federation) answers to embeddings: its stages return
/// tokens, not final hidden states, so far.
pub const NO_CLUSTER_EMBEDDINGS: &str = "embeddings are not served by a distributed cluster yet \
     (serve the model in one process with `tessera serve --model FILE` to compute them)";

/// The model a backend serves, with what the gateway needs to turn text into tokens and back.
#[derive(Debug)]
pub struct ServedModel {
    /// The name clients use in `model` (`stories260K`, `qwen3-8b-q4_k`...).
    pub id: String,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    /// Positions per sequence (prompt plus completion).
    pub context_length: usize,
    /// Unix seconds when serving started (`created` in `/v1/models`).
    pub created: u64,
    /// The grammar compiler over this vocabulary, built on first use (it indexes every token).
    grammars: std::sync::OnceLock<Result<Arc<GrammarCompiler>, String>>,
}

impl ServedModel {
    /// Reads the tokenizer and chat template from a GGUF (the fallback template if it has none).
    pub fn from_gguf(
        id: impl Into<String>,
        g: &GgufFile,
        context_length: usize,
    ) -> tessera_model::Result<Self> {
        let tokenizer = Tokenizer::from_gguf(g)?;
        let template = ChatTemplate::from_gguf(g, &tokenizer)?;
        let config = ModelConfig::from_gguf(g)?;
        Ok(Self {
            id: id.into(),
            tokenizer,
            template,
            context_length: context_length.min(config.context_length).max(1),
            created: unix_now(),
            grammars: std::sync::OnceLock::new(),
        })
    }
}

impl ServedModel {
    /// Whether generating `token` ends the sequence: the tokenizer's end-of-generation ids, and
    /// BOS — a llama-family model that emits BOS has finished its document (stories260K ends
    /// each story this way), as `tessera generate` also treats it.
    pub fn is_end_of_generation(&self, token: u32) -> bool {
        self.tokenizer.is_end_of_generation(token) || self.tokenizer.bos_id() == Some(token)
    }
}

impl ServedModel {
    /// The grammar compiler for this model's vocabulary (indexed on first use, then shared).
    pub fn grammar_compiler(&self) -> Result<Arc<GrammarCompiler>, GrammarError> {
        self.grammars
            .get_or_init(|| {
                GrammarCompiler::new(&self.tokenizer)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(GrammarError::Vocabulary)
    }
}

/// Seconds since the Unix epoch (the clock of [`ServedModel::created`]).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whatever runs the model: the single-process engine or the distributed coordinator.
///
/// `submit` must not block for long (it runs on the HTTP server's async workers): enqueue and
/// return. Events go out through the handle's channel from the backend's own threads or tasks.
pub trait Backend: Send + Sync + 'static {
    /// The model being served.
    fn model(&self) -> Arc<ServedModel>;

    /// Admits `req` into the queue or says why not. The backend checks the context limit and
    /// its queue bound here, so the client learns at once.
    fn submit(&self, req: GenerationRequest) -> Result<RequestHandle, SubmitError>;

    /// A snapshot of the machines, the plan and the backend's counters.
    fn status(&self) -> ClusterStatus;

    /// What this backend honours beyond plain sampling (nothing unless it says so).
    fn features(&self) -> BackendFeatures {
        BackendFeatures::default()
    }

    /// Admits sequence embeddings, as [`Backend::submit`] admits a generation: checks
    /// ([`EmbeddingRequest::check`]) and queues, never blocks. A backend whose
    /// [`BackendFeatures::embeddings`] is false keeps this refusal.
    fn embed(&self, req: EmbeddingRequest) -> Result<EmbeddingHandle, SubmitError> {
        let _ = req;
        Err(SubmitError::Unsupported(
            "embeddings are not served by this backend".into(),
        ))
    }

    /// Speculative decoding's totals, when this backend speculates (`/metrics` shows them).
    fn speculation(&self) -> Option<SpeculationTotals> {
        None
    }
}

impl<B: Backend + ?Sized> Backend for Arc<B> {
    fn model(&self) -> Arc<ServedModel> {
        (**self).model()
    }
    fn submit(&self, req: GenerationRequest) -> Result<RequestHandle, SubmitError> {
        (**self).submit(req)
    }
    fn status(&self) -> ClusterStatus {
        (**self).status()
    }
    fn features(&self) -> BackendFeatures {
        (**self).features()
    }
    fn embed(&self, req: EmbeddingRequest) -> Result<EmbeddingHandle, SubmitError> {
        (**self).embed(req)
    }
    fn speculation(&self) -> Option<SpeculationTotals> {
        (**self).speculation()
    }
}

/// Totals of speculative decoding since the backend's scheduler started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpeculationTotals {
    /// Decode rows that carried drafts.
    pub verifications: u64,
    pub drafted: u64,
    pub accepted: u64,
}

/// Everything the dashboard shows about the machines and the plan. The coordinator fills it from
/// its membership state and current plan; `tessera_local::LocalBackend` reports one local node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The model's name.
    pub model: String,
    /// `None` when serving; otherwise why not (the 503's reason).
    pub not_serving: Option<String>,
    pub nodes: Vec<NodeStatus>,
    /// The plan being served (`None` before the first plan).
    pub plan: Option<PlanStatus>,
    /// Measured traffic between nodes.
    pub links: Vec<LinkStatus>,
    pub counters: BackendCounters,
}

/// How a node is doing, as the coordinator sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    Healthy,
    /// Reachable but slow or missing heartbeats.
    Degraded,
    /// Departed; its work has been (or is being) replanned.
    Down,
    #[default]
    Unknown,
}

/// One machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Stable id (the node's key fingerprint in a cluster; `local` for the single process).
    pub id: String,
    /// Human name (host name).
    pub name: String,
    /// Where it listens (`host:port`), if it is remote.
    pub address: Option<String>,
    pub health: Health,
    pub inventory: InventorySummary,
    /// The memory this node lets Tessera use, in bytes (a hard limit for the planner).
    pub budget_bytes: u64,
    /// Bytes in use now: weights plus KV.
    pub used_bytes: u64,
    /// Of which KV cache.
    pub kv_bytes: u64,
    /// Milliseconds since the last heartbeat (`None` for the local node).
    pub last_seen_ms: Option<u64>,
    /// Counters of the node's expert cache when it streams its experts from disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_cache: Option<ExpertCacheStatus>,
}

/// Counters of a node's expert cache (expert streaming), cumulative since it loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertCacheStatus {
    /// Bytes of experts the node keeps in memory at most.
    pub budget_bytes: u64,
    /// Lookups served from memory.
    pub hits: u64,
    /// Lookups that read the expert from disk.
    pub misses: u64,
    /// Bytes read from disk for experts.
    pub disk_bytes: u64,
    /// Microseconds computations waited for expert reads.
    #[serde(default)]
    pub read_wait_us: u64,
    /// Microseconds with at least one expert read in progress.
    #[serde(default)]
    pub disk_busy_us: u64,
    /// High-water mark of the bytes of built experts the node kept alive at once (cache, read
    /// window, reads in flight, spare allocations).
    #[serde(default)]
    pub peak_bytes: u64,
}

/// The measured hardware of a node, summarised for display.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct InventorySummary {
    pub cpu: String,
    pub threads: usize,
    pub ram_bytes: u64,
    pub vram_bytes: u64,
    /// Measured memory bandwidth, bytes per second (0: not measured).
    pub mem_bandwidth: u64,
    /// Free-form extras worth showing ("AVX2", "GPU: RTX 3060"...).
    pub notes: Vec<String>,
}

/// The plan in force.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanStatus {
    /// Each new plan is a new epoch.
    pub epoch: u64,
    /// "single process", "stage split", "expert split", ...
    pub strategy: String,
    /// Total layers in the model (to draw layer ranges to scale).
    pub n_layers: usize,
    /// Experts per MoE layer (0 for dense models).
    pub n_experts: usize,
    pub assignments: Vec<Assignment>,
    /// The planner's explanation of why this plan was chosen.
    pub explanation: String,
    /// The plan's cells (whole copies of the model, each taking whole requests), when it
    /// holds more than one; `epoch` is then the first cell's.
    #[serde(default)]
    pub cells: Vec<CellStatus>,
    /// The plan's shape as data, from a backend that leaves the words to the gateway (the
    /// coordinator): the dashboard then words `strategy` and `explanation` from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<PlanShape>,
}

/// What a distributed plan is, as data: its ring, its expert split, its cells and what the
/// operator or planner said of it. The gateway's dashboard words it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanShape {
    /// The stages that hold layers, in ring order (of the first cell when there are several).
    pub ring: Vec<RingStage>,
    /// Each MoE layer's experts split by owner, in `--experts` syntax (`0-3@a,4-7@b`), when
    /// they are split.
    pub expert_split: Option<String>,
    /// Whole copies of the model; above 1 the plan runs as cells.
    pub cells: usize,
    /// What the operator or the planner said about the choice (empty: nothing).
    pub note: String,
}

/// One stage of a ring: the node's name and the layers `start..end` it runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingStage {
    pub node: String,
    pub layers: [usize; 2],
}

/// One cell of a plan: a whole copy of the model that takes whole requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CellStatus {
    /// Its slot in the plan (0, 1, ...).
    pub cell: usize,
    /// Its own epoch: a cell is re-planned without touching the others.
    pub epoch: u64,
    /// "ready", "loading", "linking", "failed: ..." or "released".
    pub state: String,
    /// Its nodes' ids, in ring order.
    pub nodes: Vec<String>,
    /// Requests it is running now.
    pub active: usize,
    /// Decode tokens/s its finished requests measured (a moving average; 0: none yet).
    pub decode_tokens_per_s: f64,
}

/// What one node does under a plan.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub node_id: String,
    /// The cell (whole copy of the model) it belongs to: 0 unless the plan holds several.
    #[serde(default)]
    pub cell: usize,
    /// Layers `start..end` (empty for a node holding only experts or nothing).
    pub layers: [usize; 2],
    /// Experts held per MoE layer (0: none or dense).
    pub experts: usize,
    pub embed: bool,
    pub head: bool,
    /// Weight bytes the assignment places on the node.
    pub weight_bytes: u64,
    /// The node's memory budget (repeated here so a bar can be drawn from the plan alone).
    pub budget_bytes: u64,
}

/// Bytes sent over one link.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkStatus {
    pub from: String,
    pub to: String,
    pub bytes_total: u64,
    /// Measured round-trip time in microseconds (0: not measured).
    pub rtt_us: u64,
}

/// The backend's own counters (the gateway counts requests, latency and throughput itself).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendCounters {
    /// Requests waiting for a batch slot.
    pub queue_depth: usize,
    pub queue_capacity: usize,
    /// Sequences in the running batch.
    pub active_sequences: usize,
    pub max_active_sequences: usize,
    /// KV cache bytes held by all sequences on all nodes.
    pub kv_bytes: u64,
    /// Forward steps run.
    pub steps_total: u64,
    pub prompt_tokens_total: u64,
    pub generated_tokens_total: u64,
    /// Sequences dropped because their client went away.
    pub cancelled_total: u64,
}
