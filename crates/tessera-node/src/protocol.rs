//! The fabric's wire contract: stream kinds, frame kinds, control messages and the binary
//! hot-path frames, shared by node agents, the coordinator and clients.
//!
//! Everything travels over [`tessera_net`] connections (QUIC, TLS 1.3 with pinned node keys),
//! in its versioned length-prefixed frames. On top of that:
//!
//! | stream kind | opened by | carries |
//! | --- | --- | --- |
//! | [`stream::CONTROL`] | node or client → coordinator | JSON messages ([`frame::MSG`]), both ways |
//! | [`stream::MODEL`] | node → coordinator | manifest request/reply (JSON), then [`frame::CHUNK`] frames |
//! | [`stream::RING`] | stage *i* → stage *i+1* (last → first) | [`frame::HIDDEN`] and [`frame::TOKEN`] |
//! | [`stream::EXPERT`] | home stage → expert worker (expert split) | [`frame::EXPERT_REQ`] out, [`frame::EXPERT_OUT`] / [`frame::EXPERT_ERR`] back |
//!
//! A control session starts with [`Hello`] carrying [`PROTOCOL_VERSION`]; a coordinator that
//! speaks another version answers [`CoordToNode::Refused`] naming both, and the frame layer below
//! already refuses other *wire* versions. Every reader caps frame sizes per stream kind
//! ([`limits`]) before allocating; a malformed frame ends that stream only.
//!
//! Hidden states are raw little-endian `f32`s behind a small binary header ([`StepHeader`]):
//! a decode step for one sequence costs `n_embd × 4` bytes plus [`StepHeader::encoded_len`]
//! (23 bytes for one sequence) plus the 8-byte frame header. The header already lists several
//! sequences so that continuous batching (a later issue) can send one frame per batch.

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use tessera_engine::SamplingParams;
use tessera_net::{LinkMeasurement, NodeId, PublicKey};

use crate::inventory::Inventory;
use crate::store::ContentHash;

/// Version of the message protocol in this module; both sides must agree.
pub const PROTOCOL_VERSION: u32 = 1;

/// Stream kinds (first frame of every stream, see `tessera_net::Connection::open_stream`).
pub mod stream {
    /// Control session with the coordinator.
    pub const CONTROL: u16 = 0x0001;
    /// Model distribution: manifest and chunks.
    pub const MODEL: u16 = 0x0002;
    /// Stage-to-stage hot path.
    pub const RING: u16 = 0x0003;
    /// Home stage → expert worker: MoE expert requests and their outputs
    /// ([`super::frame::EXPERT_REQ`] / [`super::frame::EXPERT_OUT`]), see `crate::expert`.
    pub const EXPERT: u16 = 0x0004;
}

/// Frame kinds.
pub mod frame {
    /// A JSON control message.
    pub const MSG: u16 = 0x0010;
    /// A [`super::StepHeader`] followed by hidden-state `f32`s.
    pub const HIDDEN: u16 = 0x0020;
    /// A sampled token travelling from the last stage to the first ([`super::RingToken`]).
    pub const TOKEN: u16 = 0x0021;
    /// One model chunk: `u32` chunk id (LE), then its bytes.
    pub const CHUNK: u16 = 0x0030;
    /// One MoE layer's expert work for one worker: routed tokens' normed rows and routing
    /// (`crate::expert::ExpertRequest`).
    pub const EXPERT_REQ: u16 = 0x0040;
    /// The worker's weighted slot outputs for a request (`crate::expert::ExpertReply`).
    pub const EXPERT_OUT: u16 = 0x0041;
    /// The worker could not compute a request: a UTF-8 reason.
    pub const EXPERT_ERR: u16 = 0x0042;
}

/// Frame size limits per stream kind, enforced by readers before allocation.
pub mod limits {
    /// Control messages (an inventory is a few KiB; a prompt of 64k tokens ~ 500 KiB).
    pub const CONTROL: usize = 4 << 20;
    /// Model stream: a chunk (at most `store::MAX_CHUNK_SIZE` is refused earlier by the
    /// coordinator) or a manifest.
    pub const MODEL: usize = 16 << 20;
    /// Ring frames: a prefill chunk of hidden states.
    pub const RING: usize = 16 << 20;
    /// Expert frames: a prefill chunk's routed rows (or their `k` slot outputs).
    pub const EXPERT: usize = 64 << 20;
    /// Most sequences one hidden frame may carry.
    pub const MAX_STEP_ENTRIES: usize = 1024;
}

/// Which role a connecting party plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A node agent that can hold part of a model.
    Node,
    /// A client that submits generations (`tessera run`; the HTTP API later).
    Client,
}

/// The first message of a control session.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Hello {
    pub protocol_version: u32,
    pub role: Role,
    /// A human name for logs and plan files (defaults to the host name).
    pub name: String,
    /// The node's measured inventory (nodes only).
    pub inventory: Option<Box<Inventory>>,
    /// Memory the node will commit to work, bytes (nodes only).
    pub memory_budget_bytes: Option<u64>,
    /// Models this node holds whole on disk (content hashes).
    pub models: Vec<ContentHash>,
}

/// Another node, as a stage sees its ring neighbours.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    pub node_id: NodeId,
    pub key: PublicKey,
    pub addr: SocketAddr,
}

/// What the coordinator asks one node to hold for an epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageAssignment {
    /// The plan epoch this belongs to.
    pub epoch: u64,
    pub model: ContentHash,
    /// This node's place in the ring, `0..n_stages`.
    pub stage: usize,
    pub n_stages: usize,
    /// Layer indices held, `start..end` (empty for an expert-only node).
    #[serde(with = "range_serde::or_empty")]
    pub layers: Range<usize>,
    /// Holds the embedding (the first stage).
    pub embed: bool,
    /// Holds the output norm and head, and samples (the last stage).
    pub head: bool,
    /// Next stage (the first, for the last stage); `None` when the ring is this node alone.
    pub next: Option<PeerInfo>,
    /// Previous stage; `None` when the ring is this node alone.
    pub prev: Option<PeerInfo>,
    /// Most positions one sequence may use (its KV cache is bounded by this).
    pub max_context: usize,
}

/// Which experts a node holds and whom it talks to for the others (expert-split execution).
///
/// Every node holds `held[layer]` (the experts it computes, possibly for layers outside its
/// stage). A stage node is the *home* of its layers: it runs attention and the router, computes
/// the held experts of its layers itself and sends each routed step to the [`ExpertPeer`]s that
/// own the others, one message per peer per layer. An expert-only node (`expert_only`) holds no
/// layers of the ring and only serves expert requests from `clients`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertAssignment {
    /// `held[layer]`: expert ids this node loads (ascending), for every layer of the model.
    pub held: Vec<Vec<usize>>,
    /// The node is not a ring stage: it only serves expert requests.
    #[serde(default)]
    pub expert_only: bool,
    /// Other nodes owning experts of this node's (home) layers.
    #[serde(default)]
    pub peers: Vec<ExpertPeer>,
    /// Home nodes that will send this node expert requests (admitted on connection).
    #[serde(default)]
    pub clients: Vec<PeerInfo>,
}

/// A node that computes some experts for a home stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertPeer {
    pub peer: PeerInfo,
    /// `experts[layer]`: the experts it owns, for every layer of the model.
    pub experts: Vec<Vec<usize>>,
}

/// Opens a sequence on every stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpenSeq {
    pub seq: u64,
    pub epoch: u64,
    /// Prompt tokens (the first stage embeds them, the last stage seeds its history).
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// End-of-generation token ids (not emitted).
    pub eog: Vec<u32>,
    /// Prompt tokens per prefill step.
    pub prefill_chunk: usize,
    /// Report a blake3 hash of every hidden state a stage outputs.
    pub trace: bool,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_new_tokens` generated, or the context is full.
    Length,
    /// An end-of-generation token was sampled.
    EndOfGeneration,
    /// Cancelled by the client or the coordinator.
    Cancelled,
    /// A stage failed.
    Error,
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Length => "length",
            Self::EndOfGeneration => "end of generation",
            Self::Cancelled => "cancelled",
            Self::Error => "error",
        })
    }
}

/// A blake3 hash of a hidden state a stage produced (its output, i.e. the state that crosses
/// the boundary after its layers), for bit-exactness checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoundaryTrace {
    pub seq: u64,
    pub stage: usize,
    /// Last layer index + 1 of the stage that produced it.
    pub after_layer: usize,
    pub start_pos: usize,
    pub n_tokens: usize,
    /// blake3 of the `f32`s as little-endian bytes, hex.
    pub hash: String,
}

/// Traffic and time of one phase (prefill or decode) of one sequence on one stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseStats {
    /// Steps run (prefill chunks, or decode tokens).
    pub steps: u64,
    /// Tokens processed.
    pub tokens: u64,
    /// Time spent computing (embedding, layers, head, sampling), ns.
    pub compute_ns: u64,
    /// Frame bytes sent to the next stage (headers included).
    pub bytes_sent: u64,
    /// Frames sent to the next stage.
    pub frames_sent: u64,
    /// Expert requests sent to other nodes in the steps this sequence took part in (one per
    /// contacted node per MoE layer per step; expert split only).
    #[serde(default)]
    pub expert_round_trips: u64,
    /// Bytes of those requests and replies (frame headers included).
    #[serde(default)]
    pub expert_bytes: u64,
}

/// What one stage did for one sequence, reported when the sequence is closed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageSeqStats {
    pub stage: usize,
    pub prefill: PhaseStats,
    pub decode: PhaseStats,
    /// First stage only: time from sending a decode step's hidden state to receiving the next
    /// token back, summed over decode steps (the rest of the ring: other stages' compute plus
    /// every hop), ns.
    pub ring_wait_ns: u64,
    /// Ring round trips measured in `ring_wait_ns`.
    pub ring_waits: u64,
    /// KV cache bytes held for the sequence at its end.
    pub kv_bytes: u64,
}

/// Counters of a node's expert cache (expert streaming; cumulative since the load).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertCacheStats {
    /// Bytes of built experts kept in memory at most.
    pub budget_bytes: u64,
    /// Expert lookups (`hits + misses`).
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    /// Bytes read from disk for experts.
    pub bytes_read: u64,
}

/// What a node reports after loading its assignment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// Bytes of the header and tensors the assignment needs.
    pub bytes_needed: u64,
    /// Bytes received from the coordinator for it (0 when cached or held locally).
    pub bytes_transferred: u64,
    /// Bytes already on disk (cache or local file).
    pub bytes_already_present: u64,
    /// Weight bytes the engine keeps resident.
    pub resident_bytes: u64,
    pub fetch_ms: f64,
    pub load_ms: f64,
}

/// Coordinator → node control messages.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CoordToNode {
    /// The session is accepted.
    Welcome {
        protocol_version: u32,
        coordinator: NodeId,
        /// The address this node is reachable at as the coordinator sees it.
        observed_addr: SocketAddr,
    },
    /// The session is refused (the connection closes after this).
    Refused { reason: String },
    /// Load a part of a model for an epoch.
    Assign(StageAssignment),
    /// Expert-split placement for the epoch of the [`CoordToNode::Assign`] that follows it on
    /// the same stream (absent: the node holds every expert of its layers and no others).
    AssignExperts {
        epoch: u64,
        experts: ExpertAssignment,
    },
    /// Every stage of the epoch has loaded: connect to the next stage and measure the link.
    Link { epoch: u64 },
    /// Drop an epoch's assignment (its weights, sequences and links).
    Release { epoch: u64 },
    /// Prepare a sequence.
    Open(OpenSeq),
    /// Start the prefill of an opened sequence (first stage only).
    Start { seq: u64 },
    /// End a sequence and free its KV cache; answered with [`NodeToCoord::Closed`].
    Close { seq: u64 },
    /// Measure the inventory again and report it.
    MeasureInventory,
    /// The node's lease: send [`NodeToCoord::Heartbeat`] every `heartbeat_ms`; a node silent
    /// for `lease_ms` is declared gone (its session is closed and it is planned around). The
    /// coordinator repeats it every `heartbeat_ms` as its own heartbeat: a node that hears
    /// nothing for `lease_ms` drops the session and reconnects.
    Lease { heartbeat_ms: u64, lease_ms: u64 },
}

/// Node → coordinator control messages.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum NodeToCoord {
    Hello(Hello),
    Loaded {
        epoch: u64,
        report: LoadReport,
    },
    /// The node cannot take the assignment (over budget, fetch failed, bad model...).
    LoadFailed {
        epoch: u64,
        reason: String,
    },
    /// Connected to the next stage; the measured link (`None` for a one-node ring).
    Linked {
        epoch: u64,
        link: Option<LinkMeasurement>,
    },
    LinkFailed {
        epoch: u64,
        reason: String,
    },
    Opened {
        seq: u64,
    },
    OpenFailed {
        seq: u64,
        reason: String,
    },
    /// A generated token (last stage).
    Token {
        seq: u64,
        pos: usize,
        token: u32,
    },
    /// The sequence is over (last stage, or any stage on error).
    Finished {
        seq: u64,
        reason: FinishReason,
        generated: usize,
        error: Option<String>,
    },
    Trace(BoundaryTrace),
    Closed {
        seq: u64,
        stats: StageSeqStats,
    },
    Inventory(Box<Inventory>),
    /// The node is alive (renews its lease; see [`CoordToNode::Lease`]).
    Heartbeat {
        /// Counters of the node's expert cache when it streams its experts from disk.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expert_cache: Option<ExpertCacheStats>,
    },
    /// Where the node's endpoint listens, sent right after [`Hello`]. The coordinator tells
    /// peers this port (at the address it observed, when the hosts agree) rather than the
    /// source port it saw, which differs when the node reaches it through a proxy.
    Listening {
        addr: SocketAddr,
    },
}

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
    },
    /// A generated token and the text it completes.
    Token {
        seq: u64,
        pos: usize,
        token: u32,
        text: String,
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
}

/// Model-stream requests (node → coordinator).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ModelRequest {
    Manifest {
        model: ContentHash,
    },
    /// Send these chunks, in this order, as [`frame::CHUNK`] frames, then
    /// [`ModelReply::ChunksDone`].
    Chunks {
        model: ContentHash,
        ids: Vec<u32>,
    },
}

/// Model-stream replies.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ModelReply {
    Manifest(Box<crate::store::Manifest>),
    ChunksDone { count: u64 },
    Error { message: String },
}

/// A malformed binary frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameDecodeError {
    #[error("frame of {len} bytes is shorter than its header ({need} bytes)")]
    Short { len: usize, need: usize },
    #[error("step header lists {0} sequences (at most {max})", max = limits::MAX_STEP_ENTRIES)]
    TooManyEntries(usize),
    #[error("step header lists no sequence")]
    NoEntries,
    #[error("hidden width {got}, expected {expected}")]
    BadWidth { got: usize, expected: usize },
    #[error("payload holds {got} bytes of f32s, the header implies {expected}")]
    BadPayload { got: usize, expected: usize },
    #[error("row count overflows")]
    Overflow,
}

/// One sequence's rows in a hidden-state frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepEntry {
    pub seq: u64,
    /// Position of the first row.
    pub start_pos: u32,
    pub n_tokens: u32,
    /// [`StepEntry::SAMPLE`]: the last stage samples after this entry's last row.
    pub flags: u8,
}

impl StepEntry {
    /// The last row of this entry is to be sampled (final prefill chunk, or a decode step).
    pub const SAMPLE: u8 = 1;

    pub fn sample(&self) -> bool {
        self.flags & Self::SAMPLE != 0
    }
}

/// Header of a [`frame::HIDDEN`] frame: which rows belong to which sequence.
///
/// Layout (little-endian): `u16 n_entries`, `u32 n_embd`, then per entry
/// `u64 seq, u32 start_pos, u32 n_tokens, u8 flags`; then `Σ n_tokens × n_embd` `f32`s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepHeader {
    pub n_embd: u32,
    pub entries: Vec<StepEntry>,
}

const ENTRY_LEN: usize = 8 + 4 + 4 + 1;

impl StepHeader {
    /// Bytes of the encoded header.
    pub fn encoded_len(&self) -> usize {
        2 + 4 + ENTRY_LEN * self.entries.len()
    }

    /// Rows of hidden state the frame carries.
    pub fn n_rows(&self) -> usize {
        self.entries.iter().map(|e| e.n_tokens as usize).sum()
    }

    /// Encodes the header and `data` into one frame payload.
    pub fn encode_with(&self, data: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len() + data.len() * 4);
        out.extend_from_slice(&(self.entries.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.n_embd.to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.seq.to_le_bytes());
            out.extend_from_slice(&e.start_pos.to_le_bytes());
            out.extend_from_slice(&e.n_tokens.to_le_bytes());
            out.push(e.flags);
        }
        tessera_net::frame::extend_f32s_le(&mut out, data);
        out
    }

    /// Decodes a payload, checking the width against `n_embd` and the data length against the
    /// header before allocating for the data.
    pub fn decode(payload: &[u8], n_embd: usize) -> Result<(Self, Vec<f32>), FrameDecodeError> {
        let short = |need| FrameDecodeError::Short {
            len: payload.len(),
            need,
        };
        if payload.len() < 6 {
            return Err(short(6));
        }
        let n = u16::from_le_bytes([payload[0], payload[1]]) as usize;
        let width = u32::from_le_bytes(payload[2..6].try_into().expect("4 bytes"));
        if n == 0 {
            return Err(FrameDecodeError::NoEntries);
        }
        if n > limits::MAX_STEP_ENTRIES {
            return Err(FrameDecodeError::TooManyEntries(n));
        }
        if width as usize != n_embd {
            return Err(FrameDecodeError::BadWidth {
                got: width as usize,
                expected: n_embd,
            });
        }
        let head = 6 + n * ENTRY_LEN;
        if payload.len() < head {
            return Err(short(head));
        }
        let mut entries = Vec::with_capacity(n);
        let mut rows = 0usize;
        for i in 0..n {
            let b = &payload[6 + i * ENTRY_LEN..6 + (i + 1) * ENTRY_LEN];
            let e = StepEntry {
                seq: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
                start_pos: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
                n_tokens: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
                flags: b[16],
            };
            rows = rows
                .checked_add(e.n_tokens as usize)
                .ok_or(FrameDecodeError::Overflow)?;
            entries.push(e);
        }
        let expected = rows
            .checked_mul(n_embd)
            .and_then(|x| x.checked_mul(4))
            .ok_or(FrameDecodeError::Overflow)?;
        let got = payload.len() - head;
        if got != expected {
            return Err(FrameDecodeError::BadPayload { got, expected });
        }
        let data = tessera_net::frame::f32s_from_le_bytes(&payload[head..])
            .expect("length is a multiple of 4");
        Ok((
            Self {
                n_embd: width,
                entries,
            },
            data,
        ))
    }
}

/// A token on its way from the last stage back to the first: `u64 seq, u32 pos, u32 token`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingToken {
    pub seq: u64,
    /// The position the token occupies in the sequence.
    pub pos: u32,
    pub token: u32,
}

impl RingToken {
    pub const LEN: usize = 16;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.pos.to_le_bytes());
        b[12..16].copy_from_slice(&self.token.to_le_bytes());
        b
    }

    pub fn decode(payload: &[u8]) -> Result<Self, FrameDecodeError> {
        if payload.len() != Self::LEN {
            return Err(FrameDecodeError::Short {
                len: payload.len(),
                need: Self::LEN,
            });
        }
        Ok(Self {
            seq: u64::from_le_bytes(payload[0..8].try_into().expect("8 bytes")),
            pos: u32::from_le_bytes(payload[8..12].try_into().expect("4 bytes")),
            token: u32::from_le_bytes(payload[12..16].try_into().expect("4 bytes")),
        })
    }
}

/// Encodes a chunk frame payload: `u32 id` LE then the bytes.
pub fn encode_chunk(id: u32, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + bytes.len());
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(bytes);
    out
}

/// Splits a chunk frame payload into its id and bytes.
pub fn decode_chunk(payload: &[u8]) -> Result<(u32, &[u8]), FrameDecodeError> {
    if payload.len() < 4 {
        return Err(FrameDecodeError::Short {
            len: payload.len(),
            need: 4,
        });
    }
    Ok((
        u32::from_le_bytes(payload[0..4].try_into().expect("4 bytes")),
        &payload[4..],
    ))
}

/// blake3 of `f32`s as little-endian bytes, hex: the boundary trace hash.
pub fn hash_f32s(data: &[f32]) -> String {
    let mut h = blake3::Hasher::new();
    for x in data {
        h.update(&x.to_le_bytes());
    }
    h.finalize().to_hex().to_string()
}

/// Serde for `Range<usize>` as `"start..end"`.
pub mod range_serde {
    use std::ops::Range;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(r: &Range<usize>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{}..{}", r.start, r.end))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Range<usize>, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        parse(&s).map_err(serde::de::Error::custom)
    }

    /// The same, but an empty range `"a..a"` is accepted too: the layers of an expert-only
    /// node in an expert split, on the wire (never in a split or plan file).
    pub mod or_empty {
        use std::ops::Range;

        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(r: &Range<usize>, s: S) -> Result<S::Ok, S::Error> {
            super::serialize(r, s)
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Range<usize>, D::Error> {
            let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
            if let Some((a, b)) = s.trim().split_once("..") {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    if a == b {
                        return Ok(a..a);
                    }
                }
            }
            super::parse(&s).map_err(serde::de::Error::custom)
        }
    }

    /// Parses `"a..b"` with `a < b`.
    pub fn parse(s: &str) -> Result<Range<usize>, String> {
        let (a, b) = s
            .trim()
            .split_once("..")
            .ok_or_else(|| format!("layer range {s:?} must look like 0..3"))?;
        let a: usize = a
            .trim()
            .parse()
            .map_err(|_| format!("bad range start in {s:?}"))?;
        let b: usize = b
            .trim()
            .parse()
            .map_err(|_| format!("bad range end in {s:?}"))?;
        if a >= b {
            return Err(format!("layer range {s:?} is empty"));
        }
        Ok(a..b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_without_expert_stats_is_the_old_message() {
        let plain = serde_json::to_string(&NodeToCoord::Heartbeat { expert_cache: None }).unwrap();
        assert_eq!(plain, r#"{"type":"heartbeat"}"#);
        let m: NodeToCoord = serde_json::from_str(r#"{"type":"heartbeat"}"#).unwrap();
        assert!(matches!(m, NodeToCoord::Heartbeat { expert_cache: None }));
        let c = ExpertCacheStats {
            budget_bytes: 1,
            lookups: 5,
            hits: 2,
            misses: 3,
            bytes_read: 9,
        };
        let s = serde_json::to_string(&NodeToCoord::Heartbeat {
            expert_cache: Some(c),
        })
        .unwrap();
        let m: NodeToCoord = serde_json::from_str(&s).unwrap();
        assert!(matches!(m, NodeToCoord::Heartbeat { expert_cache: Some(x) } if x == c));
    }

    fn header() -> StepHeader {
        StepHeader {
            n_embd: 4,
            entries: vec![
                StepEntry {
                    seq: 7,
                    start_pos: 3,
                    n_tokens: 2,
                    flags: StepEntry::SAMPLE,
                },
                StepEntry {
                    seq: 9,
                    start_pos: 0,
                    n_tokens: 1,
                    flags: 0,
                },
            ],
        }
    }

    #[test]
    fn step_header_round_trip() {
        let h = header();
        let data: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
        let p = h.encode_with(&data);
        assert_eq!(p.len(), h.encoded_len() + 48);
        let (back, d) = StepHeader::decode(&p, 4).unwrap();
        assert_eq!(back, h);
        assert_eq!(d, data);
    }

    #[test]
    fn one_sequence_header_is_small() {
        let h = StepHeader {
            n_embd: 64,
            entries: vec![header().entries[0]],
        };
        assert_eq!(h.encoded_len(), 23);
    }

    #[test]
    fn malformed_step_frames_are_refused_without_panicking() {
        let h = header();
        let p = h.encode_with(&[0.0; 12]);
        assert!(matches!(
            StepHeader::decode(&p, 8),
            Err(FrameDecodeError::BadWidth { .. })
        ));
        assert!(matches!(
            StepHeader::decode(&p[..p.len() - 1], 4),
            Err(FrameDecodeError::BadPayload { .. })
        ));
        assert!(StepHeader::decode(&p[..10], 4).is_err());
        assert!(StepHeader::decode(&[], 4).is_err());
        // A header claiming u32::MAX rows is refused by arithmetic, not allocation.
        let mut big = p.clone();
        big[6 + 12..6 + 16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(StepHeader::decode(&big, 4).is_err());
        let mut many = p;
        many[0..2].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(matches!(
            StepHeader::decode(&many, 4),
            Err(FrameDecodeError::TooManyEntries(_))
        ));
        for cut in 0..40 {
            let junk: Vec<u8> = (0..cut).map(|i| (i * 37 + 11) as u8).collect();
            let _ = StepHeader::decode(&junk, 4);
            let _ = RingToken::decode(&junk);
            let _ = decode_chunk(&junk);
        }
    }

    #[test]
    fn ring_token_round_trip() {
        let t = RingToken {
            seq: u64::MAX - 1,
            pos: 77,
            token: 123_456,
        };
        assert_eq!(RingToken::decode(&t.encode()).unwrap(), t);
        assert!(RingToken::decode(&[0; 15]).is_err());
    }

    #[test]
    fn messages_are_tagged_json() {
        let m = CoordToNode::Start { seq: 4 };
        let s = serde_json::to_string(&m).unwrap();
        assert_eq!(s, r#"{"type":"start","seq":4}"#);
        let spec: StageSpec = serde_json::from_str(r#"{"node":"a","layers":"0..3"}"#).unwrap();
        assert_eq!(spec.layers, 0..3);
        assert!(serde_json::from_str::<StageSpec>(r#"{"layers":"3..3"}"#).is_err());
    }
}
