//! What the cluster backend books from its runs, kept by the core task beside the cluster
//! ([`crate::shared::Core`]) and read from its view: the KV each live sequence holds on each
//! node, the worst case of the sequences a stage never confirmed closing, the bytes each link
//! carried, the batching evidence and the speculation counts of closed sequences.
//!
//! A sequence's positions are counted by its own sink as tokens arrive (an atomic of its own,
//! shared with nothing another run touches); the ledger is told only when a sequence starts
//! and when it ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tessera_api::SpeculationTotals;
use tessera_net::NodeId;
use tessera_proto::RunReport;

/// What the closed sequences' stage-0 statistics say about batching. Stage 0 attributes each
/// hidden-state frame's bytes to the sequences in it in equal shares, so a decode step shared
/// by `k` sequences leaves each `floor(fixed / k)` bytes of frame overhead instead of `fixed`:
/// a rigorous lower bound on the decode tokens that ran in shared steps, and so an upper bound
/// on the ring steps taken.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchingStats {
    /// Decode tokens stage 0 ran (one per step a sequence took part in).
    pub decode_tokens: u64,
    /// At least this many of them ran in a step shared with another sequence.
    pub shared_tokens_at_least: u64,
    /// Ring steps (stage-0 decode forward passes) taken: at most this many.
    pub steps_at_most: u64,
    /// Prefill chunks run on stage 0 (a prompt is prefilled alone).
    pub prefill_steps: u64,
}

/// The model's sizes the books are kept in.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rates {
    /// Bytes of KV per position per layer.
    pub kv_per_pos_layer: u64,
    /// Stage-0 frame bytes of a decode step independent of the number of sequences, and per
    /// sequence.
    pub frame_fixed: u64,
    pub frame_per_seq: u64,
    /// Bytes of one hidden row (a draft row of a speculative step adds one).
    pub row_bytes: u64,
}

/// A sequence in flight: where its KV lives and how far it got.
#[derive(Clone, Debug)]
pub(crate) struct LiveSeq {
    /// (node, layers held) per stage.
    pub stages: Vec<(NodeId, usize)>,
    /// Positions the sequence has reached (its sink counts them).
    pub positions: Arc<AtomicUsize>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Ledger {
    live: HashMap<u64, LiveSeq>,
    /// Worst-case KV of sequences a node never confirmed closing.
    unconfirmed_kv: HashMap<NodeId, u64>,
    /// Bytes sent per link (from, to), from closed sequences' statistics.
    link_bytes: HashMap<(NodeId, NodeId), u64>,
    /// Σ per sequence of stage-0 decode frame overhead bytes.
    decode_excess: u64,
    batching: BatchingStats,
    /// The sampling stages' speculation counts, from closed sequences.
    speculation: SpeculationTotals,
    /// Bumped by every change (the core republishes its view then).
    revision: u64,
}

impl Ledger {
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Sequence `seq` started on its stages.
    pub fn started(&mut self, seq: u64, live: LiveSeq) {
        self.revision += 1;
        self.live.insert(seq, live);
    }

    /// Sequence `seq` ended, with its report when it ran: books its confirmed closes, link
    /// bytes and batching evidence.
    pub fn ended(&mut self, seq: u64, report: Option<&RunReport>, rates: Rates) {
        self.revision += 1;
        let live = self.live.remove(&seq);
        if let Some(report) = report {
            self.account(report, live.as_ref(), rates);
        }
    }

    /// The sequences in flight.
    pub fn live(&self) -> Vec<u64> {
        self.live.keys().copied().collect()
    }

    pub fn batching(&self) -> BatchingStats {
        self.batching
    }

    pub fn speculation(&self) -> SpeculationTotals {
        self.speculation
    }

    pub fn link_bytes(&self) -> &HashMap<(NodeId, NodeId), u64> {
        &self.link_bytes
    }

    /// KV bytes per node: the live sequences' as far as each has got, plus the worst case of
    /// those never confirmed closed.
    pub fn kv_per_node(&self, rates: Rates) -> HashMap<NodeId, u64> {
        let mut kv = self.unconfirmed_kv.clone();
        for l in self.live.values() {
            for (node, layers) in &l.stages {
                *kv.entry(*node).or_default() += *layers as u64
                    * rates.kv_per_pos_layer
                    * l.positions.load(Ordering::Relaxed) as u64;
            }
        }
        kv
    }

    fn account(&mut self, report: &RunReport, live: Option<&LiveSeq>, rates: Rates) {
        if let Some(sampler) = report.stage_stats.last() {
            self.speculation.verifications += sampler.verifications;
            self.speculation.drafted += sampler.drafted;
            self.speculation.accepted += sampler.drafts_accepted;
        }
        let n = report.stages.len();
        for (i, st) in report.stage_stats.iter().enumerate() {
            let node = report.stages[i].node_id;
            if report.unconfirmed_stages.contains(&i) {
                let positions = live.map_or(report.prompt_tokens + report.generated, |l| {
                    l.positions.load(Ordering::Relaxed)
                });
                *self.unconfirmed_kv.entry(node).or_default() += report.stages[i].layers.len()
                    as u64
                    * rates.kv_per_pos_layer
                    * positions as u64;
            }
            if n > 1 {
                let next = report.stages[(i + 1) % n].node_id;
                *self.link_bytes.entry((node, next)).or_default() +=
                    st.prefill.bytes_sent + st.decode.bytes_sent;
            }
        }
        if n > 1 {
            if let Some(s0) = report.stage_stats.first() {
                let tokens = s0.decode.frames_sent;
                // Speculative steps carry draft rows beyond each sequence's one: not overhead.
                let draft_rows = s0.decode.tokens.saturating_sub(s0.decode.steps);
                let excess = s0
                    .decode
                    .bytes_sent
                    .saturating_sub(tokens * rates.frame_per_seq + draft_rows * rates.row_bytes);
                self.decode_excess += excess;
                let b = &mut self.batching;
                b.decode_tokens += tokens;
                b.prefill_steps += s0.prefill.steps;
                // A token decoded alone leaves `fixed` bytes of overhead; one in a shared step
                // at most `fixed / 2`. So at most excess / fixed tokens ran alone.
                let alone_at_most = self.decode_excess / rates.frame_fixed.max(1);
                let shared = b.decode_tokens.saturating_sub(alone_at_most);
                b.shared_tokens_at_least = shared;
                b.steps_at_most = b.decode_tokens - shared / 2;
            }
        }
    }
}
