//! Calibrating how much a workload's routing reuses experts ([`Policy::expert_reuse`]) from what
//! streaming nodes' caches measured: each node's share of its experts left on disk, and the
//! share of its expert lookups it read from disk. Pure: the measurements come in as numbers.
//!
//! The reuse is fitted to every cache a run measured at once, not to one: a split's home keeps
//! a larger share of its experts in memory than one node streaming the whole model, and a reuse
//! fitted on the single node alone mispriced the homes. On the lab's walking model
//! (`tessera lab run … moe-bigger-than-any.toml`, 2026-12-05) one board with 78% of its experts
//! on disk read 64% of its lookups from disk (a reuse of 1.8), while homes with 36% and 33% on
//! disk read 36% and 33%, exactly chance: that reuse credited the homes with half their reads.
//!
//! [`Policy::expert_reuse`]: crate::resources::Policy::expert_reuse

use crate::cost::MAX_EXPERT_REUSE;
use crate::model::ModelProfile;
use crate::plan::Plan;

/// One streaming node's expert cache, as a run measured it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheMeasurement {
    /// The share of the node's experts the plan left on its disk.
    pub on_disk: f64,
    /// The share of its expert lookups it read from disk (bytes read over the bytes looked up,
    /// so reads ahead count as reads).
    pub missed: f64,
}

impl CacheMeasurement {
    /// `node`'s cache in `plan`, from what it measured over some decode tokens: its expert
    /// `lookups` and the bytes it read from disk. `None` when the plan leaves none of the node's
    /// experts on disk or the figures say nothing (no lookup).
    pub fn of(
        model: &ModelProfile,
        plan: &Plan,
        node: &str,
        lookups: f64,
        disk_bytes: f64,
    ) -> Option<Self> {
        let a = plan.assignments().find(|a| a.node == node)?;
        let slice = a.experts?;
        let layers: Vec<_> = model
            .layers
            .iter()
            .enumerate()
            .filter(|(i, l)| slice.layers.contains(*i) && l.n_expert > 0)
            .map(|(_, l)| l)
            .collect();
        if layers.is_empty() || a.memory.experts_on_disk.0 == 0 || lookups <= 0.0 {
            return None;
        }
        let owned: f64 = layers
            .iter()
            .map(|l| l.expert.as_f64() * slice.experts.len() as f64)
            .sum();
        let per_expert =
            layers.iter().map(|l| l.expert.as_f64()).sum::<f64>() / layers.len() as f64;
        if owned <= 0.0 || per_expert <= 0.0 {
            return None;
        }
        Some(Self {
            on_disk: (a.memory.experts_on_disk.as_f64() / owned).min(1.0),
            missed: disk_bytes.max(0.0) / (lookups * per_expert),
        })
    }
}

/// The routing reuse that best fits `caches` to the planner's miss model (a cache leaving a
/// share `d` on disk misses `d^reuse` of its reads): least squares on the logarithms, so each
/// cache's relative error weighs alike, held to [1, [`MAX_EXPERT_REUSE`]]. `None` when no
/// measurement has a share on disk strictly between 0 and 1 and some reads missed.
pub fn fit_expert_reuse(caches: &[CacheMeasurement]) -> Option<f64> {
    let (mut xy, mut xx) = (0.0, 0.0);
    for c in caches {
        if !(c.on_disk > 0.0 && c.on_disk < 1.0 && c.missed > 0.0 && c.missed.is_finite()) {
            continue;
        }
        let (x, y) = (c.on_disk.ln(), c.missed.min(1.0).ln());
        xy += x * y;
        xx += x * x;
    }
    (xx > 0.0).then(|| (xy / xx).clamp(1.0, MAX_EXPERT_REUSE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::expert_miss_share;
    use crate::model::Quant;
    use crate::resources::ResourceGraph;

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

    #[test]
    fn a_cache_measurement_is_the_plans_share_on_disk_and_the_reads_it_made() {
        let m = ModelProfile::from_hf_config(BENCH_MOE, Quant::Q4_0).unwrap();
        let g = ResourceGraph::from_toml(BOARD).unwrap();
        let plan = crate::plan(&m, &g, 1).unwrap().plan;
        let a = plan.assignments().next().unwrap();
        let expert = m.layers[0].expert.as_f64();
        let all = expert * 64.0 * 12.0;
        // 96 lookups a token, 61.7 experts' bytes read: 64% of them.
        let c = CacheMeasurement::of(&m, &plan, "board-a", 96.0, 61.7 * expert).unwrap();
        assert!((c.on_disk - a.memory.experts_on_disk.as_f64() / all).abs() < 1e-12);
        assert!(c.on_disk > 0.7 && c.on_disk < 0.85, "{c:?}");
        assert!((c.missed - 61.7 / 96.0).abs() < 1e-12);
        assert_eq!(CacheMeasurement::of(&m, &plan, "board-b", 96.0, 1.0), None);
        assert_eq!(CacheMeasurement::of(&m, &plan, "board-a", 0.0, 1.0), None);
    }

    #[test]
    fn the_fit_recovers_a_reuse_every_cache_agrees_on() {
        for reuse in [1.0, 1.8, 6.0] {
            let caches: Vec<_> = [0.78, 0.52, 0.36]
                .iter()
                .map(|&d| CacheMeasurement {
                    on_disk: d,
                    missed: expert_miss_share(d, reuse),
                })
                .collect();
            let r = fit_expert_reuse(&caches).unwrap();
            assert!((r - reuse).abs() < 1e-9, "{reuse}: {r}");
        }
    }

    #[test]
    fn caches_that_disagree_weigh_alike_and_chance_bounds_the_fit() {
        // The lab's board (78% on disk, 64% read) and homes reading exactly by chance.
        let lab = [(0.78, 0.643), (0.52, 0.466), (0.363, 0.362), (0.334, 0.329)]
            .map(|(on_disk, missed)| CacheMeasurement { on_disk, missed });
        let all = fit_expert_reuse(&lab).unwrap();
        let board_alone = fit_expert_reuse(&lab[..1]).unwrap();
        assert!(board_alone > 1.7, "{board_alone}");
        assert!(all > 1.0 && all < 1.2, "{all}");
        // Reading more than chance is not the cache's doing: never below 1.
        let worse = [CacheMeasurement {
            on_disk: 0.5,
            missed: 0.9,
        }];
        assert_eq!(fit_expert_reuse(&worse), Some(1.0));
        // Nothing to fit: all on disk, none on disk, no reads.
        for (on_disk, missed) in [(1.0, 1.0), (0.0, 0.0), (0.5, 0.0)] {
            assert_eq!(
                fit_expert_reuse(&[CacheMeasurement { on_disk, missed }]),
                None
            );
        }
    }
}
