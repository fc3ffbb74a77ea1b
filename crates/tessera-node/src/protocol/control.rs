//! Coordinator ↔ node control messages (JSON on [`super::stream::CONTROL`]): the session's
//! [`Hello`], stage assignments, sequences, load and sequence reports, and heartbeats.

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use tessera_engine::{KvType, SamplingParams};
use tessera_net::{LinkMeasurement, NodeId, PublicKey};

use super::range_serde;
use super::{ExpertAssignment, ExpertCacheStats};
use crate::inventory::Inventory;
use crate::store::ContentHash;

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
    /// Element type of the KV caches: every stage of a ring uses the coordinator's, so a split
    /// computes what one process with that type computes.
    #[serde(default)]
    pub kv_type: KvType,
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

/// blake3 of `f32`s as little-endian bytes, hex: the boundary trace hash.
pub fn hash_f32s(data: &[f32]) -> String {
    let mut h = blake3::Hasher::new();
    for x in data {
        h.update(&x.to_le_bytes());
    }
    h.finalize().to_hex().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::StageSpec;

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
            read_wait_us: 11,
            disk_busy_us: 7,
        };
        let s = serde_json::to_string(&NodeToCoord::Heartbeat {
            expert_cache: Some(c),
        })
        .unwrap();
        let m: NodeToCoord = serde_json::from_str(&s).unwrap();
        assert!(matches!(m, NodeToCoord::Heartbeat { expert_cache: Some(x) } if x == c));
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
