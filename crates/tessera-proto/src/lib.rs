//! The fabric's wire contract: stream kinds, frame kinds, control messages and the binary
//! hot-path frames, shared by node agents, the coordinator and clients. Data only: it depends on
//! the transport's identities ([`tessera_net`]) and the data types its messages carry (sampling
//! parameters, the KV type, content hashes, inventories), never on the engine.
//!
//! Everything travels over [`tessera_net`] connections (QUIC, TLS 1.3 with pinned node keys),
//! in its versioned length-prefixed frames. On top of that:
//!
//! | stream kind | opened by | carries |
//! | --- | --- | --- |
//! | [`stream::CONTROL`] | node or client → coordinator | JSON messages ([`frame::MSG`]), both ways |
//! | [`stream::MODEL`] | node → coordinator | manifest request/reply (JSON), then [`frame::CHUNK`] frames |
//! | [`stream::RING`] | stage *i* → stage *i+1* (last → first) | [`frame::HIDDEN`] and [`frame::TOKEN`] |
//! | [`stream::EXPERT`] | home stage → expert worker (expert split) | [`frame::EXPERT_EPOCH`], then [`frame::EXPERT_REQ`] out, [`frame::EXPERT_OUT`] / [`frame::EXPERT_ERR`] back |
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

#![forbid(unsafe_code)]

mod client;
mod control;
mod experts;
mod model;
pub mod range_serde;
mod ring;
mod sealed;

pub use client::{
    AdminReply, AdminRequest, BoundaryReport, ClientToCoord, CoordToClient, MemberStatus,
    Prediction, RunReport, RunRequest, StagePlacement, StageSpec, TokenInfo,
};
pub use control::{
    hash_f32s, BoundaryTrace, CoordToNode, FinishReason, Hello, HopTimes, LoadReport, NodeToCoord,
    OpenSeq, OwnerExpertStats, PeerInfo, PeerLink, PhaseStats, Role, StageAssignment,
    StageSeqStats,
};
pub use experts::{ExpertAssignment, ExpertCacheStats, ExpertPeer};
pub use model::{decode_chunk, encode_chunk, ModelReply, ModelRequest};
pub use ring::{RingToken, StepEntry, StepHeader};
pub use sealed::{
    Holders, Passed, PassedOver, SealedAnswer, SealedFailure, SealedNews, SealedRefusal,
    SealedRequest, SealedSubmit,
};

/// Version of the message protocol in this module; both sides must agree. 2: a sequence may
/// carry a grammar and ask for log-probabilities ([`OpenSeq`]), which a version-1 node would
/// silently ignore. 3: sealed jobs ([`CoordToNode::SealedJob`]) and signed claims
/// ([`NodeToCoord::Claims`]). 4: an expert stream opens with the epoch it serves
/// ([`frame::EXPERT_EPOCH`]), since a node may serve two epochs' experts while a new split is
/// switched to.
pub const PROTOCOL_VERSION: u32 = 4;

/// Stream kinds (first frame of every stream, see `tessera_net::Connection::open_stream`).
pub mod stream {
    /// Control session with the coordinator.
    pub const CONTROL: u16 = 0x0001;
    /// Model distribution: manifest and chunks.
    pub const MODEL: u16 = 0x0002;
    /// Stage-to-stage hot path.
    pub const RING: u16 = 0x0003;
    /// Home stage → expert worker: MoE expert requests and their outputs
    /// ([`super::frame::EXPERT_REQ`] / [`super::frame::EXPERT_OUT`]), see `tessera_node::expert`.
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
    /// (`tessera_node::expert::ExpertRequest`).
    pub const EXPERT_REQ: u16 = 0x0040;
    /// The worker's weighted slot outputs for a request (`tessera_node::expert::ExpertReply`).
    pub const EXPERT_OUT: u16 = 0x0041;
    /// The worker could not compute a request: a UTF-8 reason.
    pub const EXPERT_ERR: u16 = 0x0042;
    /// The first frame of an expert stream: the epoch (`u64`, LE) whose experts it asks for.
    /// A worker may hold two epochs' experts while a new split is switched to (make before
    /// break), and the same home may ask it for both.
    pub const EXPERT_EPOCH: u16 = 0x0043;
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
    #[error("a ring token carries {got} drafts (at most {max})", max = OpenSeq::MAX_SPECULATE)]
    TooManyDrafts { got: usize },
    #[error("a ring token of {len} bytes is not 16 plus 4 per draft")]
    BadDrafts { len: usize },
}
