//! Planning from measured inventory: the nodes' [`Inventory`] (sent in their hello) and the
//! measured links become a [`ResourceGraph`] whose every figure says when and how it was
//! measured; the planner chooses; the chosen plan becomes the coordinator's stage assignment
//! (and, for an expert split, its expert placement).
//!
//! Pure: the inventories, link measurements and policy come in as data.
//!
//! - [`planner_model`]: the planner's view of a GGUF model (the one conversion the CLI's
//!   `tessera plan` and the coordinator's `--plan auto` both use).
//! - [`resource_graph`]: inventory and links → resource graph.
//! - [`plan_executable`]: plan, falling back to the best single-node, stage-ring or expert-split plan
//!   when the best plan is one the fabric cannot execute yet (a weight bank, or a ring that
//!   would stream experts from disk: only an expert split's nodes do, and a single node that
//!   streams runs as an expert split homed on it). Replicas run as cells.
//! - [`to_placement`]: an executable plan → a [`PlanFile`] of pinned stages, plus the expert
//!   split of an expert plan ([`to_assignment`], [`to_expert_placement`]).
//!
//! # How inventory figures map to the graph
//!
//! - RAM: the node's usable total (total RAM, lowered by a cgroup limit), divided among the
//!   nodes that share its host (same host name, CPU model and total RAM), since they share it.
//! - Memory bandwidth: the all-threads read test, run with the node's own thread count, times
//!   [`DECODE_STREAM_EFFICIENCY`] (the share of it batch-1 decode reaches; see there).
//! - Compute: the engine's Q8_0 matmul probe. The probe runs on every core of the host; a node
//!   limited to fewer threads (`--threads`) gets the single-thread rate times its threads, capped
//!   by the all-core rate.
//! - Co-hosted nodes (same host name, CPU model and total RAM) are one machine: each gets the
//!   median of their measured bandwidths and compute rates.
//! - Disk: the read rate and free space of the model cache, when measured.
//! - Budget: the fabric's budget covers weights and KV cache (a node refuses an assignment beyond
//!   it); the planner's also counts the process itself, so the graph's budget is the node's budget
//!   (or, without one, the RAM available at start) plus [`RUNTIME_OVERHEAD_RAM`].
//! - Co-hosted nodes (e.g. a loopback test cluster) each get the host's full bandwidth and
//!   compute: at batch 1 a ring runs one stage at a time, so they do not contend while decoding.
//!   Their probes must not overlap (start them one after another); overlapping probes are noted
//!   in the evidence, as is the sharing itself.

use tessera_plan::{plan, ModelProfile, Plan, PlanError, PlanOutcome, ResourceGraph, StrategyKind};

// Named in the documentation above.
#[cfg(doc)]
use {crate::assignment::PlanFile, tessera_host::Inventory, tessera_plan::RUNTIME_OVERHEAD_RAM};

mod graph;
mod model;
mod placement;
#[cfg(test)]
mod test_support;

pub use graph::{
    links_via_coordinator, node_links, resource_graph, MeasuredLink, PeerMeasurement,
    DECODE_STREAM_EFFICIENCY,
};
pub use model::planner_model;
pub use placement::{
    expert_budgets, to_assignment, to_expert_placement, to_placement, to_streaming_placement,
    NotExecutable, NotExpertPlacement, Placement,
};

/// The strategies the fabric executes today.
pub const EXECUTABLE: [StrategyKind; 4] = [
    StrategyKind::Single,
    StrategyKind::Stage,
    StrategyKind::Expert,
    StrategyKind::Replica,
];

/// Whether the fabric can run `plan` of a model with `n_layer` layers of `n_expert` experts:
/// cells that are each a single node or a ring of whole layers held in memory (several are
/// replicas, run as the coordinator's cells), or an expert split whose
/// ring holds whole layers and whose every expert is held once ([`to_placement`]).
pub fn executable(plan: &Plan, n_layer: usize, n_expert: usize) -> bool {
    to_placement(plan, n_layer, n_expert).is_ok()
}

/// Plans `m` (the planner's view of the model, [`planner_model`]) on `graph`. When the best
/// plan is one the fabric cannot execute yet (weight bank, a dense model's ring leaving weights
/// on disk),
/// plans again with expert splits, and with single nodes and rings holding everything in
/// memory, takes the better, and says so in the explanation's notes (with the better plan's
/// predicted figure).
pub fn plan_executable(
    m: &ModelProfile,
    graph: &ResourceGraph,
    epoch: u64,
) -> Result<PlanOutcome, PlanError> {
    let best = plan(m, graph, epoch)?;
    let (n_layer, n_expert) = (m.n_layers(), m.n_expert as usize);
    if executable(&best.plan, n_layer, n_expert) {
        return Ok(best);
    }
    // What the fabric runs: expert splits as planned (their nodes stream experts from disk when
    // given more than their budget), and single nodes and rings holding every weight in memory.
    // Expert splits are also tried with every weight in memory: with disks, the planner may keep
    // every expert on the home and stream them there (a single-node plan, which is skipped as an
    // expert split and cannot run), while an in-memory split across the nodes can.
    let mut found: Option<PlanOutcome> = None;
    let mut errors = Vec::new();
    // A single node streaming its experts from its disk runs too: never slower than the best
    // single node, a split that loses to it is not chosen.
    let mut best_split: Option<PlanOutcome> = None;
    for (allowed, in_memory) in [
        (&[StrategyKind::Expert][..], false),
        (&[StrategyKind::Expert][..], true),
        (&[StrategyKind::Single, StrategyKind::Stage][..], true),
        (&[StrategyKind::Single][..], false),
    ] {
        let mut g = graph.clone();
        g.policy.strategies.retain(|s| allowed.contains(s));
        if g.policy.strategies.is_empty() {
            continue;
        }
        if in_memory {
            for n in &mut g.nodes {
                n.disk = None;
            }
        }
        match plan(m, &g, epoch) {
            Ok(o) if executable(&o.plan, n_layer, n_expert) => {
                let score = |o: &PlanOutcome| o.plan.predicted.score(g.policy.objective);
                if o.plan.strategy != StrategyKind::Single
                    && best_split.as_ref().is_none_or(|f| score(&o) > score(f))
                {
                    best_split = Some(o.clone());
                }
                if found.as_ref().is_none_or(|f| score(&o) > score(f)) {
                    found = Some(o);
                }
            }
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
    }
    let Some(mut fallback) = found else {
        // Nothing executable: why the executable strategies found no plan (every pass's
        // rejections), or (a policy that allows none of them) the best plan, whose placement
        // says why it cannot run.
        if errors.is_empty() {
            return Ok(best);
        }
        if errors
            .iter()
            .all(|e| matches!(e, PlanError::NoFeasiblePlan { .. }))
        {
            let mut rejected = Vec::new();
            for e in errors {
                if let PlanError::NoFeasiblePlan { rejected: r } = e {
                    rejected.extend(r);
                }
            }
            return Err(PlanError::NoFeasiblePlan { rejected });
        }
        return Err(errors.swap_remove(0));
    };
    fallback.explanation.notes.insert(
        0,
        format!(
            "the best plan, {} ({:.2} tok/s: {}), is not executable by the fabric yet ({}); \
             using the best {} plan instead",
            best.plan.strategy,
            best.plan.predicted.decode_tokens_per_s,
            best.explanation.chosen.description,
            to_placement(&best.plan, n_layer, n_expert)
                .err()
                .map_or_else(String::new, |e| e.to_string()),
            fallback.plan.strategy
        ),
    );
    if let (StrategyKind::Single, Some(split)) = (fallback.plan.strategy, &best_split) {
        fallback.explanation.notes.insert(
            1,
            format!(
                "never slower than the best single node: the best executable plan over several \
                 nodes, {} ({:.2} tok/s), is predicted slower than {} ({:.2} tok/s), so that \
                 one node runs",
                split.explanation.chosen.description,
                split.plan.predicted.decode_tokens_per_s,
                fallback.explanation.chosen.description,
                fallback.plan.predicted.decode_tokens_per_s
            ),
        );
    }
    Ok(fallback)
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;
    use tessera_host::Inventory;
    use tessera_net::LinkMeasurement;
    use tessera_plan::{Bytes, BytesPerSec, Objective, Policy, Quant, Tier};

    fn model() -> ModelProfile {
        let config = r#"{"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 3072, "vocab_size": 32000, "tie_word_embeddings": true}"#;
        ModelProfile::from_hf_config(config, Quant::Q8_0).unwrap()
    }

    fn cluster(budgets: &[u64]) -> (Vec<(String, Inventory)>, ResourceGraph) {
        let invs: Vec<(String, Inventory)> = budgets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                (
                    format!("n{i}"),
                    inv(&format!("host{i}"), 1_000_000, 4, Some(*b)),
                )
            })
            .collect();
        let refs: Vec<(&str, &Inventory)> = invs.iter().map(|(n, i)| (n.as_str(), i)).collect();
        let coord: Vec<(&str, LinkMeasurement)> = invs
            .iter()
            .map(|(n, _)| (n.as_str(), link(1, 100.0, 1_000_000)))
            .collect();
        let policy = Policy {
            objective: Objective::Latency,
            context_tokens: 512,
            prompt_tokens: 64,
            ..Policy::default()
        };
        let g = resource_graph(&refs, &links_via_coordinator(&coord), &policy);
        (invs, g)
    }

    #[test]
    fn a_stage_plan_becomes_pinned_contiguous_stages_within_budgets() {
        let m = model();
        // ~0.6 GiB of weights: neither node can hold it alone.
        let (_, g) = cluster(&[300 << 20, 500 << 20]);
        let out = plan_executable(&m, &g, 7).unwrap();
        assert_eq!(out.plan.strategy, StrategyKind::Stage);
        let file = to_assignment(&out.plan).unwrap();
        assert_eq!(file.stages.len(), 2);
        assert_eq!(file.stages[0].layers.start, 0);
        assert_eq!(file.stages[0].layers.end, file.stages[1].layers.start);
        assert_eq!(file.stages[1].layers.end, 28);
        for (s, a) in file.stages.iter().zip(out.plan.assignments()) {
            assert_eq!(s.node.as_deref(), Some(a.node.as_str()));
            assert!(a.memory.total <= a.memory.budget, "{a:?}");
        }
        // It resolves against the coordinator's connected nodes by name.
        let ns: Vec<crate::assignment::Candidate> = (0..2)
            .map(|i| crate::assignment::Candidate {
                node_id: tessera_net::NodeIdentity::from_seed([i as u8 + 1; 32]).node_id(),
                name: format!("n{i}"),
            })
            .collect();
        let placed = crate::assignment::resolve(&file.stages, 28, &ns).unwrap();
        assert_eq!(placed.len(), 2);
    }

    #[test]
    fn a_single_node_plan_is_one_stage_of_every_layer() {
        let m = model();
        let (_, g) = cluster(&[300 << 20, 4 * GIB]);
        let out = plan_executable(&m, &g, 1).unwrap();
        assert_eq!(out.plan.strategy, StrategyKind::Single);
        let file = to_assignment(&out.plan).unwrap();
        assert_eq!(file.stages.len(), 1);
        assert_eq!(file.stages[0].node.as_deref(), Some("n1"));
        assert_eq!(file.stages[0].layers, 0..28);
    }

    #[test]
    fn replicas_at_served_concurrency_run_as_cells_one_per_node() {
        let m = model();
        let (_, mut g) = cluster(&[4 * GIB, 4 * GIB]);
        g.policy.objective = Objective::Throughput;
        g.policy.concurrency = 8;
        let out = plan_executable(&m, &g, 1).unwrap();
        assert_eq!(out.plan.strategy, StrategyKind::Replica);
        let ns: Vec<crate::assignment::Candidate> = (0..2)
            .map(|i| crate::assignment::Candidate {
                node_id: tessera_net::NodeIdentity::from_seed([i as u8 + 1; 32]).node_id(),
                name: format!("n{i}"),
            })
            .collect();
        assert!(executable(&out.plan, 28, 0));
        // Two whole copies, each on its own node: a split that starts again at layer 0.
        let file = to_assignment(&out.plan).unwrap();
        let layers: Vec<_> = file.stages.iter().map(|s| s.layers.clone()).collect();
        assert_eq!(layers, vec![0..28, 0..28]);
        let placed = crate::assignment::resolve(&file.stages, 28, &ns).unwrap();
        assert_eq!(crate::assignment::cells_of(&placed), vec![0..1, 1..2]);
        assert_ne!(placed[0].0, placed[1].0);
    }

    fn moe_model() -> ModelProfile {
        let config = r#"{"model_type": "qwen3_moe", "hidden_size": 1024, "num_hidden_layers": 4,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 3072, "moe_intermediate_size": 768, "num_experts": 16,
            "num_experts_per_tok": 2, "vocab_size": 32000, "tie_word_embeddings": true}"#;
        ModelProfile::from_hf_config(config, Quant::Q8_0).unwrap()
    }

    #[test]
    fn an_expert_split_plan_is_executed_as_a_home_ring_and_an_expert_split() {
        let m = moe_model();
        // 16 experts of ~2.4 MiB in each of 4 layers: the home holds the rest and some experts,
        // the others a few experts each but no whole layer.
        let (_, mut g) = cluster(&[200 << 20, 60 << 20, 60 << 20]);
        // Without weight banks, which the fabric cannot run yet: one prices above the split
        // here (each of the split's layers waits for the owner its token reaches).
        g.policy.strategies.retain(|s| *s != StrategyKind::Bank);
        let out = plan_executable(&m, &g, 3).unwrap();
        assert_eq!(
            out.plan.strategy,
            StrategyKind::Expert,
            "{:?}",
            out.explanation
        );
        assert!(out
            .explanation
            .notes
            .iter()
            .all(|n| !n.contains("not executable")));
        let p = to_placement(&out.plan, 4, 16).unwrap();
        assert_eq!(p.ring.stages.len(), 1);
        assert_eq!(p.ring.stages[0].node.as_deref(), Some("n0"));
        assert_eq!(p.ring.stages[0].layers, 0..4);
        let split = p.experts.unwrap();
        assert!(split.duplicates().is_empty());
        let mut all: Vec<usize> = split
            .groups
            .iter()
            .flat_map(|g| g.experts.clone())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..16).collect::<Vec<_>>());
        assert!(split.groups.len() >= 2, "{split}");
    }

    fn with_disks(g: &mut ResourceGraph) {
        for n in &mut g.nodes {
            n.disk = Some(Tier {
                capacity: Bytes(100 * GIB),
                bandwidth: BytesPerSec(2e9),
            });
        }
    }

    #[test]
    fn a_ring_whose_stages_stream_their_experts_from_disk_runs_as_planned() {
        let m = moe_model();
        let (_, mut g) = cluster(&[200 << 20, 60 << 20, 60 << 20]);
        with_disks(&mut g);
        // Links slow enough that the expert split, contacting an owner only in the layers
        // where a token needs its experts, still loses to streaming them.
        for l in &mut g.links {
            l.spec.rtt_s = 0.05;
        }
        // No single node (which would stream as an expert split homed on it, see below).
        g.policy.strategies = vec![StrategyKind::Stage, StrategyKind::Expert];
        // With disks, rings hold layers whose experts partly stay on disk...
        let best = tessera_plan::plan(&m, &g, 1).unwrap();
        assert_eq!(
            best.plan.strategy,
            StrategyKind::Stage,
            "{:?}",
            best.explanation
        );
        assert!(best.plan.assignments().any(|a| a.memory.disk.0 > 0));
        // ... which their stages stream: the ring runs as planned, without an expert split.
        let out = plan_executable(&m, &g, 1).unwrap();
        assert_eq!(out.plan.cells, best.plan.cells);
        let placed = to_placement(&out.plan, 4, 16).unwrap();
        assert!(placed.experts.is_none());
        assert_eq!(placed.ring.stages.len(), best.plan.assignments().count());
    }

    #[test]
    fn the_executable_choice_is_never_predicted_slower_than_the_best_single_node() {
        let m = moe_model();
        for budgets in [
            [200u64 << 20, 60 << 20, 60 << 20],
            [120 << 20, 120 << 20, 120 << 20],
            [150 << 20, 100 << 20, 100 << 20],
        ] {
            let mut slowest = None;
            for rtt in [0.0005, 0.002, 0.005, 0.01, 0.02, 0.05] {
                let (_, mut g) = cluster(&budgets);
                with_disks(&mut g);
                for l in &mut g.links {
                    l.spec.rtt_s = rtt;
                }
                if let Some(d) = &mut g.default_link {
                    d.rtt_s = rtt;
                }
                let out = plan_executable(&m, &g, 1).unwrap();
                assert!(executable(&out.plan, 4, 16), "{:?}", out.explanation);
                let mut single = g.clone();
                single.policy.strategies = vec![StrategyKind::Single];
                let one = tessera_plan::plan(&m, &single, 1).unwrap();
                let (chosen, alone) = (
                    out.plan.predicted.decode_tokens_per_s,
                    one.plan.predicted.decode_tokens_per_s,
                );
                assert!(
                    chosen >= alone,
                    "{budgets:?} at {rtt} s: chose {} at {chosen}, one node {alone}",
                    out.explanation.chosen.description
                );
                slowest = Some(out.plan.strategy);
            }
            // Round trips of 50 ms: no split pays; the one node streaming runs.
            assert_eq!(slowest, Some(StrategyKind::Single), "{budgets:?}");
        }
    }

    #[test]
    fn slow_links_that_keep_every_expert_home_run_the_home_streaming_from_its_disk() {
        let m = moe_model();
        let (_, mut g) = cluster(&[200 << 20, 60 << 20, 60 << 20]);
        with_disks(&mut g);
        // Links slow enough that streaming every expert from the home's disk predicts faster
        // than sending hidden states to other owners: with disks, the expert strategy keeps
        // every expert home (a single-node plan).
        for l in &mut g.links {
            l.spec.rtt_s = 0.05;
        }
        if let Some(d) = &mut g.default_link {
            d.rtt_s = 0.05;
        }
        let best = tessera_plan::plan(&m, &g, 1).unwrap();
        assert_eq!(
            best.plan.strategy,
            StrategyKind::Single,
            "{:?}",
            best.explanation
        );
        // It runs as it is: the home streams, as an expert split homed on it owning every
        // expert.
        let out = plan_executable(&m, &g, 1).unwrap();
        assert_eq!(out.plan, best.plan, "{:?}", out.explanation);
        let p = to_placement(&out.plan, 4, 16).unwrap();
        let split = p.experts.expect("the home owns every expert");
        assert_eq!(split.groups.len(), 1);
        assert_eq!(
            Some(split.groups[0].node.as_str()),
            p.ring.stages[0].node.as_deref()
        );
    }

    #[test]
    fn a_single_node_plan_with_experts_on_disk_runs_as_an_expert_split_homed_on_it() {
        let m = moe_model();
        // One node, too small for every expert in memory, with a disk: the planner streams the
        // rest from disk, which only an expert split's nodes do.
        let (_, mut g) = cluster(&[200 << 20]);
        with_disks(&mut g);
        let best = tessera_plan::plan(&m, &g, 1).unwrap();
        assert_eq!(best.plan.strategy, StrategyKind::Single);
        assert!(best.plan.assignments().any(|a| a.memory.disk.0 > 0));
        // Alone, it is what runs.
        assert_eq!(plan_executable(&m, &g, 1).unwrap().plan, best.plan);
        // As an expert split homed on it that owns every expert, the node streams them.
        let p = to_streaming_placement(&best.plan, 4, 16).expect("a streaming placement");
        assert_eq!(to_placement(&best.plan, 4, 16).as_ref(), Ok(&p));
        assert_eq!(p.ring.stages.len(), 1);
        assert_eq!(p.ring.stages[0].node.as_deref(), Some("n0"));
        assert_eq!(p.ring.stages[0].layers, 0..4);
        let split = p.experts.expect("every expert placed");
        assert_eq!(split.groups.len(), 1);
        assert_eq!(split.groups[0].node, "n0");
        assert_eq!(split.groups[0].experts, (0..16).collect::<Vec<_>>());
        // Not for a plan of another model's geometry, nor for one with every weight in memory.
        assert!(to_streaming_placement(&best.plan, 4, 8).is_none());
        assert!(to_streaming_placement(&best.plan, 5, 16).is_none());
        let (_, roomy) = cluster(&[2 << 30]);
        let fits = tessera_plan::plan(&m, &roomy, 1).unwrap();
        assert!(fits.plan.assignments().all(|a| a.memory.disk.0 == 0));
        assert!(to_streaming_placement(&fits.plan, 4, 16).is_none());
    }
}
