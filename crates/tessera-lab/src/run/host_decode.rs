//! Each node's memory bandwidth and compute from what this machine decodes, not from the
//! nodes' quick probes: the lab's hosts are one machine, and the lab has already measured one
//! `tessera bench` decoder of the scenario's model on it, with the scenario's threads
//! ([`super::machine`]). The quick probe reads a 16 MiB buffer once: in two release runs of
//! moe-bigger-than-any minutes apart it read 22.7 and 4.2 GB/s on the same host, and the
//! second made the planner predict a ring of the four boards at 17 tok/s (it measured 145) and
//! choose an expert split that measured 50. Pure.

use tessera_plan::{predict, ModelProfile, ResourceGraph, StrategyKind};

/// Scales each node's memory bandwidth and compute (alike, as calibration does) so that the
/// node alone, holding the whole model in memory, is predicted to decode `alone_tok_s` (one
/// decoder of the model on this machine, measured); one line per node saying by how much.
/// Nodes the planner cannot cost alone are left as measured, and said.
pub fn apply(model: &ModelProfile, graph: &mut ResourceGraph, alone_tok_s: f64) -> Vec<String> {
    if !(alone_tok_s.is_finite() && alone_tok_s > 0.0) {
        return Vec::new();
    }
    let mut lines = Vec::new();
    for i in 0..graph.nodes.len() {
        // The node alone with room for every weight: the decode the bench measured.
        let mut alone = graph.clone();
        let mut n = alone.nodes[i].clone();
        n.memory_budget = None;
        n.disk = None;
        n.ram.capacity = n.ram.capacity.max(tessera_plan::Bytes(u64::MAX / 4));
        alone.nodes = vec![n];
        alone.links.clear();
        alone.machines.clear();
        alone.policy.strategies = vec![StrategyKind::Single];
        let name = graph.nodes[i].name.clone();
        let Ok(plan) = tessera_plan::plan(model, &alone, 1).map(|o| o.plan) else {
            lines.push(format!(
                "{name}: not costed alone, its probed memory bandwidth and compute kept"
            ));
            continue;
        };
        let rate = |g: &ResourceGraph| {
            predict(model, g, &plan)
                .map(|p| p.decode_tokens_per_s)
                .unwrap_or(0.0)
        };
        let p = rate(&alone);
        if p <= 0.0 {
            continue;
        }
        // The runtime's fixed cost per token does not scale with the rates: a few rounds
        // converge on the measured rate.
        let mut f = 1.0;
        for _ in 0..4 {
            let now = rate(&alone);
            if now <= 0.0 {
                break;
            }
            let step = alone_tok_s / now;
            alone.nodes[0].ram.bandwidth.0 *= step;
            alone.nodes[0].ram_compute.0 *= step;
            f *= step;
        }
        let node = &mut graph.nodes[i];
        node.ram.bandwidth.0 *= f;
        node.ram_compute.0 *= f;
        lines.push(format!(
            "{name}: memory bandwidth and compute ×{f:.2} (now {:.1} GB/s, {:.0} GFLOPS): one \
             decoder of the model on this machine measured {alone_tok_s:.1} tok/s, the \
             node's quick probes predicted {p:.1}",
            node.ram.bandwidth.0 / 1e9,
            node.ram_compute.0 / 1e9
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_plan::Quant;

    const MOE: &str = r#"{"model_type":"qwen3_moe","hidden_size":1024,"num_hidden_layers":12,
        "num_attention_heads":16,"num_key_value_heads":4,"head_dim":128,"intermediate_size":6144,
        "moe_intermediate_size":512,"num_experts":64,"num_experts_per_tok":8,"vocab_size":32000,
        "tie_word_embeddings":false}"#;

    #[test]
    fn each_node_alone_is_then_predicted_at_the_machine_s_measured_decode() {
        let m = ModelProfile::from_hf_config(MOE, Quant::Q4_0).unwrap();
        let mut g = ResourceGraph::from_toml(
            r#"
            [policy]
            objective = "latency"
            context = 512
            prompt_tokens = 16
            [[node]]
            name = "board-a"
            profile = "laptop-16gb"
            memory_budget = "300MiB"
            disk_bandwidth = "300MB/s"
            [[node]]
            name = "board-b"
            profile = "laptop-16gb"
            memory_budget = "300MiB"
            disk_bandwidth = "300MB/s"
            "#,
        )
        .unwrap();
        // One probe read a fifth of the other's bandwidth.
        g.nodes[1].ram.bandwidth.0 /= 5.0;
        let lines = apply(&m, &mut g, 150.0);
        assert_eq!(lines.len(), 2, "{lines:?}");
        for i in 0..2 {
            let mut alone = g.clone();
            alone.nodes = vec![g.nodes[i].clone()];
            alone.nodes[0].memory_budget = None;
            alone.nodes[0].disk = None;
            alone.links.clear();
            alone.policy.strategies = vec![StrategyKind::Single];
            let o = tessera_plan::plan(&m, &alone, 1).unwrap();
            let p = o.plan.predicted.decode_tokens_per_s;
            assert!((p - 150.0).abs() < 0.01 * 150.0, "{}: {p}", g.nodes[i].name);
        }
        // The budgets and disks the plans use are untouched.
        assert!(g
            .nodes
            .iter()
            .all(|n| n.memory_budget.is_some() && n.disk.is_some()));
        assert!(apply(&m, &mut g, f64::NAN).is_empty());
    }
}
