//! Run reports for the lab's tests, built from the wire types `tessera run --json` prints.

use tessera_proto::{BoundaryReport, FinishReason, PhaseStats, RunReport, StageSeqStats};

/// A ring's report with these stages' statistics and `boundaries` boundaries.
pub(super) fn report(stage_stats: Vec<StageSeqStats>, boundaries: usize) -> RunReport {
    RunReport {
        seq: 1,
        epoch: 1,
        prompt_tokens: 4,
        generated: 8,
        reason: FinishReason::Length,
        error: None,
        stages: Vec::new(),
        stage_stats,
        time_to_first_token_ms: 1.0,
        decode_tokens_per_s: 100.0,
        n_embd: 64,
        boundaries: (0..boundaries)
            .map(|i| BoundaryReport {
                from: i,
                to: (i + 1) % boundaries,
                decode_bytes_per_token: 300.0,
                prefill_bytes: 0,
                hidden_payload_bytes: 256,
            })
            .collect(),
        hop_latency_us: None,
        unconfirmed_stages: Vec::new(),
    }
}

pub(super) fn decode(stage: usize, compute_ns: u64, steps: u64) -> StageSeqStats {
    StageSeqStats {
        stage,
        decode: PhaseStats {
            compute_ns,
            steps,
            ..PhaseStats::default()
        },
        ..StageSeqStats::default()
    }
}
