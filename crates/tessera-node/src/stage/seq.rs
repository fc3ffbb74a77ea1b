//! A stage's words (what it emits, why it refuses) and what it keeps per sequence. Its own
//! file so that the sampling part needs nothing of the stage itself.

use std::time::Instant;

use tessera_engine::KvCache;
use tessera_grammar::Grammar;

use tessera_proto::{NodeToCoord, OpenSeq, RingToken, StageSeqStats, StepHeader};

/// What a stage emits.
#[derive(Debug, Clone)]
pub enum StageOutput {
    /// Hidden states for the next stage.
    Hidden(StepHeader, Vec<f32>),
    /// A token for the first stage (from the last).
    Token(RingToken),
    /// A message for the coordinator.
    Control(NodeToCoord),
}

/// Why a stage refused an input.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("sequence {0} is not open on this stage")]
    UnknownSeq(u64),
    #[error("sequence {0} is already open")]
    AlreadyOpen(u64),
    #[error("sequence {seq}: {what}")]
    BadStep { seq: u64, what: String },
    #[error("sequence {seq} needs {needed} bytes of KV cache but only {available} of the memory budget are left")]
    OverBudget {
        seq: u64,
        needed: u64,
        available: u64,
    },
    #[error("this stage does not {0}")]
    WrongStage(&'static str),
    #[error("sequence {seq}: grammar: {reason}")]
    Grammar { seq: u64, reason: String },
    /// A peer sent NaN or infinite values: computing on them would sample garbage (token 0)
    /// into a user's answer, so the step fails and names the sender.
    #[error(
        "the hidden state from {from} holds {count} non-finite values (NaN or infinity) of \
         {len}: refusing to compute on it"
    )]
    NonFinite {
        from: String,
        count: usize,
        len: usize,
    },
    #[error(transparent)]
    Engine(#[from] tessera_engine::EngineError),
}

pub(super) struct SeqState {
    pub(super) open: OpenSeq,
    pub(super) kv: KvCache,
    /// Last stage: every token of the sequence so far (prompt and generated).
    pub(super) history: Vec<u32>,
    pub(super) generated: usize,
    /// KV bytes reserved against the budget.
    pub(super) reserved: u64,
    pub(super) stats: StageSeqStats,
    /// First stage: when the last `SAMPLE` hidden state left (for ring timing).
    pub(super) sent_at: Option<Instant>,
    pub(super) finished: bool,
    /// Last stage: the sequence's grammar, in the state its tokens so far left it.
    pub(super) grammar: Option<Grammar>,
    /// No step has run yet: `kv` holds the positions of a kept cache that match the prompt,
    /// and the first step's start position says how many of them the ring uses.
    pub(super) unstarted: bool,
    /// A step failed part-way: the cache may hold some layers' positions and not others',
    /// so it is not kept.
    pub(super) broken: bool,
    /// Speculation: positions of the last step past its first row (drafts), not yet known to
    /// be agreed; the next step may start among them, and a kept cache drops them.
    pub(super) unverified: usize,
    /// Last stage, speculation: the drafts sent with the last token, to check the next step's
    /// rows against.
    pub(super) drafts: Vec<u32>,
}
