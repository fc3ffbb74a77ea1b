//! Calibrating how much a workload's routing reuses experts ([`Policy::expert_reuse`]) from a
//! run that streamed experts from disk: the reuse at which the plan predicts what was measured.
//! Pure: the measurement comes in as a number.
//!
//! [`Policy::expert_reuse`]: crate::resources::Policy::expert_reuse

use crate::calibrate::predict;
use crate::cost::MAX_EXPERT_REUSE;
use crate::model::ModelProfile;
use crate::plan::Plan;
use crate::resources::ResourceGraph;

/// The routing reuse at which `plan` on `graph` predicts the decode rate `measured_tok_s`
/// (tokens/s at batch 1), held to [1, [`MAX_EXPERT_REUSE`]]: 1 when even uniform routing
/// predicts it faster (the shortfall is not the cache's), the maximum when no reuse predicts
/// it fast enough. `None` when the plan leaves no expert on disk (reuse changes nothing), the
/// measurement is not a rate, or the plan cannot be re-costed on `graph`.
pub fn calibrate_expert_reuse(
    model: &ModelProfile,
    graph: &ResourceGraph,
    plan: &Plan,
    measured_tok_s: f64,
) -> Option<f64> {
    if !plan.assignments().any(|a| a.memory.disk.0 > 0) || !measured_tok_s.is_finite() {
        return None;
    }
    if measured_tok_s <= 0.0 {
        return None;
    }
    let rate = |reuse: f64| {
        let mut g = graph.clone();
        g.policy.expert_reuse = reuse;
        predict(model, &g, plan).ok().map(|p| p.decode_tokens_per_s)
    };
    if measured_tok_s <= rate(1.0)? {
        return Some(1.0);
    }
    if measured_tok_s >= rate(MAX_EXPERT_REUSE)? {
        return Some(MAX_EXPERT_REUSE);
    }
    // The predicted rate grows with the reuse (fewer misses): bisect, on a log scale since
    // the misses fall geometrically with it.
    let (mut lo, mut hi) = (0.0f64, MAX_EXPERT_REUSE.ln());
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if rate(mid.exp())? < measured_tok_s {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(((lo + hi) / 2.0).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Quant;
    use crate::resources::StrategyKind;

    /// bench-qwen3moe-q4_0's geometry (12 layers of 64 experts, 8 a token; 724 MiB).
    const BENCH_MOE: &str = r#"{"model_type":"qwen3_moe","hidden_size":1024,"num_hidden_layers":12,
        "num_attention_heads":16,"num_key_value_heads":4,"head_dim":128,"intermediate_size":6144,
        "moe_intermediate_size":512,"num_experts":64,"num_experts_per_tok":8,"vocab_size":32000,
        "tie_word_embeddings":false}"#;

    /// One board of `crates/tessera-lab/scenarios/moe-bigger-than-any.toml`: 300 MiB of
    /// budget, its eMMC's 300 MB/s.
    const BOARD: &str = r#"
        [policy]
        strategies = ["single"]
        objective = "latency"
        context = 512
        prompt_tokens = 16
        [[node]]
        name = "board-a"
        profile = "laptop-16gb"
        memory_budget = "300MiB"
        disk_bandwidth = "300MB/s"
    "#;

    fn board() -> (ModelProfile, ResourceGraph, Plan) {
        let m = ModelProfile::from_hf_config(BENCH_MOE, Quant::Q4_0).unwrap();
        let g = ResourceGraph::from_toml(BOARD).unwrap();
        let plan = crate::plan(&m, &g, 1).unwrap().plan;
        (m, g, plan)
    }

    fn at(m: &ModelProfile, g: &ResourceGraph, plan: &Plan, reuse: f64) -> f64 {
        let mut g = g.clone();
        g.policy.expert_reuse = reuse;
        predict(m, &g, plan).unwrap().decode_tokens_per_s
    }

    #[test]
    fn one_board_streams_its_experts_and_reuse_prices_the_cache_it_keeps() {
        let (m, g, plan) = board();
        assert_eq!(plan.strategy, StrategyKind::Single);
        let a = plan.assignments().next().unwrap();
        // Most of the 648 MiB of experts stay on the eMMC.
        assert!(a.memory.disk.0 > 400 << 20, "{:?}", a.memory);
        // Uniform routing: ~63 MiB missed a token at 300 MB/s, about 4.6 tok/s.
        let uniform = at(&m, &g, &plan, 1.0);
        assert!((4.0..5.5).contains(&uniform), "{uniform}");
        assert_eq!(uniform, plan.predicted.decode_tokens_per_s);
        // Routing that repeats experts: the cache misses less, the board decodes faster.
        let mut last = uniform;
        for reuse in [2.0, 4.0, 8.0, 16.0] {
            let r = at(&m, &g, &plan, reuse);
            assert!(r > last, "reuse {reuse}: {r} after {last}");
            last = r;
        }
        assert!(last > 5.0 * uniform, "{last}");
    }

    #[test]
    fn calibration_finds_the_reuse_a_streaming_run_implies() {
        let (m, g, plan) = board();
        for reuse in [1.5, 6.0, 20.0] {
            let measured = at(&m, &g, &plan, reuse);
            let found = calibrate_expert_reuse(&m, &g, &plan, measured).unwrap();
            assert!(
                (found - reuse).abs() < 0.01 * reuse,
                "{reuse}: found {found}"
            );
        }
        // Slower than uniform routing predicts: not the cache's doing, reuse stays 1.
        let slow = at(&m, &g, &plan, 1.0) / 2.0;
        assert_eq!(calibrate_expert_reuse(&m, &g, &plan, slow), Some(1.0));
        // Faster than any cache explains: held to the maximum.
        assert_eq!(
            calibrate_expert_reuse(&m, &g, &plan, 1e6),
            Some(MAX_EXPERT_REUSE)
        );
        assert_eq!(calibrate_expert_reuse(&m, &g, &plan, f64::NAN), None);
        // A plan with every expert in memory says nothing of reuse.
        let mut roomy = g.clone();
        roomy.nodes[0].memory_budget = None;
        let fits = crate::plan(&m, &roomy, 1).unwrap().plan;
        assert!(fits.assignments().all(|a| a.memory.disk.0 == 0));
        assert_eq!(calibrate_expert_reuse(&m, &roomy, &fits, 10.0), None);
    }
}
