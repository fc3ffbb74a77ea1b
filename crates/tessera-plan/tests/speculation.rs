//! The price of a speculating request: plain turns price as plain decoding, a ring on slow links
//! gains more of its tokens per turn than one machine, and calibrating on one node's speculating run fits the
//! compute rate alone.

mod common;

use common::*;
use tessera_plan::speculation::{calibrate_verifying, predict_speculating, Turns};
use tessera_plan::{plan, predict, ModelProfile, Plan, Quant, ResourceGraph, StrategyKind};

/// Three equal machines on 40 ms links; `strategy` is the only one the planner may choose.
fn cluster(strategy: &str) -> ResourceGraph {
    let mut text = format!(
        "[policy]\nobjective = \"latency\"\nstrategies = [\"{strategy}\"]\nprompt_tokens = 32\n"
    );
    for n in ["a", "b", "c"] {
        text.push_str(&format!(
            "[[node]]\nname = \"{n}\"\nram = \"4GiB\"\nmem_bandwidth = \"20GB/s\"\n\
             compute = \"100GFLOPS\"\n"
        ));
    }
    for (x, y) in [("a", "b"), ("b", "c"), ("a", "c")] {
        text.push_str(&format!(
            "[[link]]\nnodes = [\"{x}\", \"{y}\"]\nrtt_ms = 40\nbandwidth = \"1Gbit/s\"\n"
        ));
    }
    ResourceGraph::from_toml(&text).unwrap()
}

fn planned(m: &ModelProfile, strategy: &str, kind: StrategyKind) -> (ResourceGraph, Plan) {
    let g = cluster(strategy);
    let p = plan(m, &g, 1).unwrap().plan;
    assert_eq!(p.strategy, kind);
    (g, p)
}

/// Every draft of `k` agreed: each verifying turn yields `k + 1` tokens.
fn all_agree(tokens: u64, k: u64) -> Turns {
    let verifying = tokens.div_ceil(k + 1);
    Turns {
        decoded: tokens,
        verifying,
        drafted: verifying * k,
        accepted: tokens - verifying,
    }
}

fn speedup(m: &ModelProfile, g: &ResourceGraph, p: &Plan, turns: &Turns) -> f64 {
    predict_speculating(m, g, p, turns).unwrap() / predict(m, g, p).unwrap().decode_tokens_per_s
}

#[test]
fn turns_without_drafts_price_as_plain_decoding() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q4_0);
    let (g, ring) = planned(&m, "stage", StrategyKind::Stage);
    let none = Turns {
        decoded: 63,
        ..Turns::default()
    };
    assert_eq!(none.plain(), 63);
    let s = speedup(&m, &g, &ring, &none);
    assert!((s - 1.0).abs() < 1e-9, "{s}");
}

#[test]
fn a_ring_on_slow_links_gains_more_of_its_tokens_per_turn_than_one_machine() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q4_0);
    let (gr, ring) = planned(&m, "stage", StrategyKind::Stage);
    let (gs, single) = planned(&m, "single", StrategyKind::Single);
    let turns = all_agree(63, 8);
    let per_turn = 63.0 / turns.verifying as f64;
    let (on_ring, alone) = (
        speedup(&m, &gr, &ring, &turns),
        speedup(&m, &gs, &single, &turns),
    );
    assert!(
        on_ring > alone,
        "ring {on_ring:.2}× vs one node {alone:.2}×"
    );
    // The links cost as much with drafts as without; the rows' compute is what is left.
    assert!(
        on_ring > 0.4 * per_turn && on_ring <= per_turn,
        "{on_ring:.2}× of {per_turn:.2} tokens a turn"
    );
}

#[test]
fn calibrating_on_one_nodes_speculation_meets_its_measurement_and_moves_only_compute() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q4_0);
    let (g, single) = planned(&m, "single", StrategyKind::Single);
    let turns = all_agree(63, 8);
    let predicted = predict_speculating(&m, &g, &single, &turns).unwrap();
    // Measured slower than predicted: the extra rows cost more than the graph says.
    let measured = predicted * 0.6;
    let (fixed, c) = calibrate_verifying(&m, &g, &single, &turns, measured, 1).unwrap();
    let c = c.expect("a correction");
    assert!(c.factor < 1.0, "{c:?}");
    let after = predict_speculating(&m, &fixed, &single, &turns).unwrap();
    assert!(
        (after / measured - 1.0).abs() < 0.01,
        "{after} vs {measured}"
    );
    let node = |g: &ResourceGraph| g.node(single.nodes()[0]).unwrap().clone();
    assert_eq!(node(&fixed).ram.bandwidth, node(&g).ram.bandwidth);
    assert!(node(&fixed).ram_compute.0 < node(&g).ram_compute.0);
    // Already right: nothing to correct.
    let (_, none) = calibrate_verifying(&m, &g, &single, &turns, predicted, 1).unwrap();
    assert!(none.is_none());
}
