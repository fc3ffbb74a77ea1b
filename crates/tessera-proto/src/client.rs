//! Client ↔ coordinator messages: generation requests, the plan and accounting of a run, and
//! the membership status.

use std::net::SocketAddr;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use tessera_net::{LinkMeasurement, NodeId};
use tessera_sampling::GrammarSpec;
use tessera_sampling::SamplingParams;
use tessera_sampling::TokenLogprobs;

use super::range_serde;
use super::{BoundaryTrace, FinishReason, Hello, LoadReport, StageSeqStats};
use super::{Holders, SealedNews, SealedSubmit};
use tessera_seal::JobId;

/// A generation request from a client.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunRequest {
    /// Text to tokenize with the model's tokenizer (BOS added as the model asks)...
    pub prompt: Option<String>,
    /// ...or the prompt as token ids.
    pub prompt_tokens: Option<Vec<u32>>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Stages to run on; `None` keeps the current assignment.
    pub stages: Option<Vec<StageSpec>>,
    pub prefill_chunk: usize,
    pub trace: bool,
    /// Stop at end-of-generation tokens (default true).
    pub stop_at_eog: bool,
    /// Constrain the generated tokens to a grammar (see [`super::OpenSeq::grammar`]).
    #[serde(default)]
    pub grammar: Option<GrammarSpec>,
    /// Report each token's log-probability and this many alternatives.
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Drafts per ring turn by prompt lookup (0: no speculation; at most
    /// [`crate::OpenSeq::MAX_SPECULATE`]): fewer ring turns, the same tokens.
    #[serde(default)]
    pub speculate: usize,
    /// What the answer is expected to be close to (text to tokenize without BOS, or tokens):
    /// the drafts come from it ([`tessera_sampling::prediction`]). Only with `speculate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prediction: Option<Prediction>,
}

/// A predicted answer, as text or as tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prediction {
    Text(String),
    Tokens(Vec<u32>),
}

/// One stage of a requested split: a layer range, optionally pinned to a node (by name, node
/// id or id prefix). Unpinned stages take connected nodes in the order they joined.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSpec {
    #[serde(default)]
    pub node: Option<String>,
    #[serde(with = "range_serde")]
    pub layers: Range<usize>,
}

/// Client → coordinator messages.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientToCoord {
    Hello(Hello),
    Run(Box<RunRequest>),
    Cancel {
        seq: u64,
    },
    /// Ask for [`CoordToClient::Status`].
    Status,
    /// Administer credentials (operator credentials only); answered with
    /// [`CoordToClient::Admin`].
    Admin(AdminRequest),
    /// Ask for the workers' current signed claims ([`CoordToClient::Holders`]), of those that
    /// hold `model` whole (any model when `None`).
    Holders {
        model: Option<String>,
    },
    /// Route a sealed job: news comes back as [`CoordToClient::Sealed`].
    SealedSubmit(SealedSubmit),
}

/// What an operator may ask of the coordinator about credentials.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminRequest {
    /// Issue a join token granting `role` (`node`, `client` or `operator`).
    CreateToken {
        role: String,
        /// Keys that may enrol with it (`None`: any number).
        uses: Option<u32>,
        /// Lifetime, ms (`None`: never expires).
        lifetime_ms: Option<u64>,
    },
    ListTokens,
    /// Revoke the token whose id starts with `id`, and with `with_keys` the keys that
    /// enrolled with it (their sessions end; `None`: only for a single-use token).
    RevokeToken {
        id: String,
        #[serde(default)]
        with_keys: Option<bool>,
    },
    /// Revoke an enrolled key by name, node id or id prefix: its sessions end and it cannot
    /// enrol again with any token.
    RevokeNode {
        name: String,
    },
}

/// A token as listed: everything but its secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenInfo {
    pub id: String,
    pub role: String,
    pub uses_left: Option<u32>,
    pub enrolled: u32,
    pub expires_at_unix_ms: Option<u64>,
    pub revoked: bool,
    pub created_at_unix_ms: u64,
}

/// The answer to an [`AdminRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum AdminReply {
    /// A new token: its secret (`tsr1-…`, shown this once) and its listing.
    Token {
        token: String,
        info: TokenInfo,
    },
    Tokens {
        tokens: Vec<TokenInfo>,
    },
    Revoked {
        what: String,
    },
    Refused {
        reason: String,
    },
}

/// The plan the run used, as reported to the client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagePlacement {
    pub stage: usize,
    pub node_id: NodeId,
    pub name: String,
    #[serde(with = "range_serde::or_empty")]
    pub layers: Range<usize>,
    pub load: LoadReport,
    /// Link from this stage to the next (measured by this stage).
    pub link_to_next: Option<LinkMeasurement>,
}

/// The accounting of one finished run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    pub seq: u64,
    pub epoch: u64,
    pub prompt_tokens: usize,
    pub generated: usize,
    pub reason: FinishReason,
    pub error: Option<String>,
    pub stages: Vec<StagePlacement>,
    pub stage_stats: Vec<StageSeqStats>,
    /// From `Start` to the first token, ms (as seen by the coordinator).
    pub time_to_first_token_ms: f64,
    /// Decode rate between the first and the last token, tokens/s.
    pub decode_tokens_per_s: f64,
    /// Hidden size and the bytes one decode token puts on each boundary.
    pub n_embd: usize,
    pub boundaries: Vec<BoundaryReport>,
    /// Estimated time one hop adds per decode token, µs (see [`BoundaryReport`]).
    pub hop_latency_us: Option<f64>,
    /// Stages that never answered the close (a lost node): their `stage_stats` are defaults and
    /// the KV they held is not known to be freed. A stage that did answer may report all
    /// zeros (a sequence cancelled before its prefill ran), so this, not the statistics, says
    /// which answered.
    #[serde(default)]
    pub unconfirmed_stages: Vec<usize>,
}

/// The traffic over one boundary (stage `from` → stage `to`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BoundaryReport {
    pub from: usize,
    pub to: usize,
    pub decode_bytes_per_token: f64,
    pub prefill_bytes: u64,
    /// `n_embd × 4`: the payload alone, for comparison.
    pub hidden_payload_bytes: usize,
}

/// A member as shown by [`CoordToClient::Status`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemberStatus {
    pub node_id: NodeId,
    pub name: String,
    pub connected: bool,
    pub addr: Option<SocketAddr>,
    pub memory_budget_bytes: Option<u64>,
    pub link: Option<LinkMeasurement>,
}

/// Coordinator → client messages.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CoordToClient {
    Welcome {
        protocol_version: u32,
        coordinator: NodeId,
        observed_addr: SocketAddr,
    },
    Refused {
        reason: String,
    },
    /// The run is placed and its prompt tokenized.
    Started {
        seq: u64,
        epoch: u64,
        prompt_tokens: Vec<u32>,
        stages: Vec<StagePlacement>,
        /// Prompt tokens whose keys and values every stage took from a kept cache (not
        /// prefilled again).
        #[serde(default)]
        cached_tokens: usize,
    },
    /// A generated token and the text it completes.
    Token {
        seq: u64,
        pos: usize,
        token: u32,
        text: String,
        /// When the run asked for them ([`RunRequest::logprobs`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<TokenLogprobs>,
    },
    Trace(BoundaryTrace),
    /// The run's epoch was lost (a stage node left, or a better plan replaces it): the tokens
    /// so far stand, and the run waits for a new epoch. Not an error.
    Paused {
        seq: u64,
        reason: String,
    },
    /// The run goes on on `epoch`, which re-prefills the prompt and the `generated` tokens so far;
    /// the tokens that follow are the ones the run would have had.
    Resumed {
        seq: u64,
        epoch: u64,
        generated: usize,
    },
    Done(Box<RunReport>),
    Error {
        message: String,
    },
    Status {
        members: Vec<MemberStatus>,
        epoch: Option<u64>,
    },
    Admin(AdminReply),
    /// Workers' signed claims: the client checks each signature itself.
    Holders {
        holders: Holders,
    },
    /// News of a sealed job this session submitted.
    Sealed {
        job: JobId,
        news: SealedNews,
    },
}
