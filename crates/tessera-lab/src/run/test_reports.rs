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

/// `report` with its stages placed on nodes named `names`, in order.
pub(super) fn on_nodes(mut report: RunReport, names: &[&str]) -> RunReport {
    // Node ids are 20 bytes in base32; any distinct ones will do.
    let ids = [
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
    ];
    report.stages = names
        .iter()
        .zip(ids)
        .enumerate()
        .map(|(i, (name, id))| {
            serde_json::from_value(serde_json::json!({
                "stage": i, "node_id": id, "name": name, "layers": "0..1",
                "load": tessera_proto::LoadReport::default(), "link_to_next": null,
            }))
            .expect("a stage placement")
        })
        .collect();
    report
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
