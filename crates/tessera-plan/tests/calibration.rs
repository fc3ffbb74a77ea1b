//! Calibration: measured figures from an executed plan correct the graph so the plan predicts them.

mod common;

use common::*;
use tessera_plan::{
    calibrate, plan, predict, HopMeasurement, Measurement, Quant, ResourceGraph, Source,
    StageMeasurement, StrategyKind,
};

/// A loopback cluster like the fabric issue's: two processes on one host, the model split in two
/// stages because each is given little memory.
fn loopback() -> ResourceGraph {
    ResourceGraph::from_toml(include_str!("../clusters/loopback.toml")).unwrap()
}

#[test]
fn calibrating_from_the_token_rate_makes_the_plan_predict_it() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q8_0);
    let g = loopback();
    let o = plan(&m, &g, 1).unwrap();
    assert_eq!(o.plan.strategy, StrategyKind::Stage);
    let predicted = o.plan.predicted.decode_tokens_per_s;
    let measured = Measurement {
        taken_at_unix_s: 1_764_500_000,
        decode_tokens_per_s: predicted * 0.6,
        hops: vec![HopMeasurement {
            from: "a".into(),
            to: "b".into(),
            latency_s: 40e-6,
            wire_bytes: 4096.0,
        }],
        stages: vec![],
    };
    let c = calibrate(&m, &g, &o.plan, &measured).unwrap();
    assert!((c.relative_error_before - (1.0 / 0.6 - 1.0)).abs() < 1e-9);
    assert!(
        (c.predicted_after - measured.decode_tokens_per_s).abs() / measured.decode_tokens_per_s
            < 1e-6
    );
    assert!(c
        .corrections
        .iter()
        .any(|x| x.subject == "link a-b" && x.quantity == "rtt"));
    assert!(c
        .corrections
        .iter()
        .any(|x| x.subject == "node a" && x.factor < 1.0));
    // The evidence now says these figures were measured, and when.
    assert!(c.graph.evidence.iter().any(|e| e.subject == "node b"
        && e.quantity == "mem_bandwidth"
        && e.source
            == Source::Measured {
                at_unix_s: 1_764_500_000,
                method: "calibration".into()
            }));
    // Re-planning on the corrected graph is consistent with it.
    let again = predict(&m, &c.graph, &o.plan).unwrap();
    assert!((again.decode_tokens_per_s - c.predicted_after).abs() < 1e-9);
}

#[test]
fn a_token_time_that_is_mostly_network_leaves_the_nodes_rates_alone() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q8_0);
    let mut g = loopback();
    // A WAN between the two: 200 ms a round trip, so a token is mostly the two crossings.
    if let Some(l) = g.default_link.as_mut() {
        l.rtt_s = 0.2;
    }
    for l in &mut g.links {
        l.spec.rtt_s = 0.2;
    }
    let ring = plan(&m, &g, 1).unwrap().plan;
    assert_eq!(ring.strategy, StrategyKind::Stage);
    let predicted = predict(&m, &g, &ring).unwrap();
    assert!(predicted.decode.network_s() > 0.19, "{predicted:?}");
    let measured = Measurement {
        taken_at_unix_s: 1,
        decode_tokens_per_s: predicted.decode_tokens_per_s * 0.9,
        hops: vec![],
        stages: vec![],
    };
    let c = calibrate(&m, &g, &ring, &measured).unwrap();
    for n in ["a", "b"] {
        let before = g.nodes.iter().find(|x| x.name == n).unwrap();
        let after = c.graph.nodes.iter().find(|x| x.name == n).unwrap();
        assert_eq!(before.ram_compute, after.ram_compute, "node {n}");
        assert_eq!(before.ram.bandwidth, after.ram.bandwidth, "node {n}");
        let x = c
            .corrections
            .iter()
            .find(|x| x.subject == format!("node {n}"))
            .expect("a line saying why");
        assert_eq!(x.factor, 1.0);
    }
}

#[test]
fn calibrating_from_stage_times_corrects_each_node_separately() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q8_0);
    let g = loopback();
    let o = plan(&m, &g, 1).unwrap();
    let stage = |n: &str| {
        o.plan
            .predicted
            .stages
            .iter()
            .find(|s| s.node == n)
            .unwrap()
            .terms
            .total_s
    };
    let measured = Measurement {
        taken_at_unix_s: 1,
        decode_tokens_per_s: 10.0,
        hops: vec![],
        stages: vec![
            StageMeasurement {
                node: "a".into(),
                seconds_per_token: stage("a") * 2.0,
            },
            StageMeasurement {
                node: "b".into(),
                seconds_per_token: stage("b"),
            },
        ],
    };
    let c = calibrate(&m, &g, &o.plan, &measured).unwrap();
    let factor = |n: &str| {
        c.corrections
            .iter()
            .find(|x| x.subject == format!("node {n}"))
            .unwrap()
            .factor
    };
    assert!((factor("a") - 0.5).abs() < 1e-9);
    assert!((factor("b") - 1.0).abs() < 1e-9);
    let after = predict(&m, &c.graph, &o.plan).unwrap();
    let new_a = after
        .stages
        .iter()
        .find(|s| s.node == "a")
        .unwrap()
        .terms
        .total_s;
    assert!((new_a - 2.0 * stage("a")).abs() < 1e-9);
    // The stages held their weights in memory: their times say nothing of the disks, which
    // keep their rates (a node streaming from its disk is priced as before).
    let disk = |g: &ResourceGraph, n: &str| g.node(n).unwrap().disk.map(|t| t.bandwidth.0);
    assert!(disk(&g, "a").is_some(), "the profile has a disk");
    assert_eq!(disk(&c.graph, "a"), disk(&g, "a"));
}

#[test]
fn token_time_the_stages_and_hops_do_not_explain_becomes_the_runtime_overhead() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q8_0);
    let g = loopback();
    let o = plan(&m, &g, 1).unwrap();
    let p = &o.plan.predicted;
    // The stages run exactly as predicted, but every token takes 2 ms longer.
    let stages = p
        .stages
        .iter()
        .map(|s| StageMeasurement {
            node: s.node.clone(),
            seconds_per_token: s.terms.total_s,
        })
        .collect();
    let measured_s = p.decode.total_s + 0.002;
    let c = calibrate(
        &m,
        &g,
        &o.plan,
        &Measurement {
            taken_at_unix_s: 7,
            decode_tokens_per_s: 1.0 / measured_s,
            hops: vec![],
            stages,
        },
    )
    .unwrap();
    assert!((c.graph.token_overhead_s - 0.002).abs() < 1e-9);
    assert!((c.predicted_after * measured_s - 1.0).abs() < 1e-9);
    let e = c
        .graph
        .evidence
        .iter()
        .find(|e| e.subject == "runtime" && e.quantity == "token_overhead")
        .unwrap();
    assert!(matches!(e.source, Source::Measured { at_unix_s: 7, .. }));
    // It is part of every decode step the graph predicts from now on.
    let after = predict(&m, &c.graph, &o.plan).unwrap();
    assert!((after.decode.total_s - measured_s).abs() < 1e-9);
}

/// Every crossing of a ring between distinct nodes costs the graph's hop overhead on top of
/// the link; a ring's run measured slower than its nodes and links explain teaches that cost.
#[test]
fn a_rings_unexplained_token_time_becomes_the_cost_of_a_hop() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q8_0);
    let mut g = loopback();
    g.hop_overhead_s = 0.0;
    let o = plan(&m, &g, 1).unwrap();
    assert_eq!(o.plan.strategy, StrategyKind::Stage);
    let free = predict(&m, &g, &o.plan).unwrap();
    assert_eq!(free.hops.len(), 2, "a two-stage ring: there and back");
    // The same plan on a graph whose hops cost 100 µs: two crossings per token more.
    let mut costly = g.clone();
    costly.hop_overhead_s = 100e-6;
    let slow = predict(&m, &costly, &o.plan).unwrap();
    assert!((slow.decode.total_s - free.decode.total_s - 200e-6).abs() < 1e-12);
    assert!(slow.hops.iter().all(|h| h.terms.latency_s >= 100e-6));

    // Measured 2 × 150 µs slower than free hops predict: each hop costs 150 µs.
    let measured = 1.0 / (free.decode.total_s + 300e-6);
    let c = tessera_plan::calibrate_hop_overhead(&m, &g, &o.plan, measured, 9).unwrap();
    assert!((c.crossings_per_token - 2.0).abs() < 1e-6);
    assert!((c.hop_overhead_after_s - 150e-6).abs() < 1e-9);
    assert!((c.graph.hop_overhead_s - 150e-6).abs() < 1e-9);
    assert!((c.predicted_after / measured - 1.0).abs() < 1e-9);
    assert!(!c.clamped);
    let e = c
        .graph
        .evidence
        .iter()
        .find(|e| e.subject == "runtime" && e.quantity == "hop_overhead")
        .unwrap();
    assert!(matches!(e.source, Source::Measured { at_unix_s: 9, .. }));
    // What it learned predicts the ring from now on, and travels in the cluster file.
    let after = predict(&m, &c.graph, &o.plan).unwrap();
    assert!((after.decode_tokens_per_s / measured - 1.0).abs() < 1e-9);
    let back = ResourceGraph::from_toml(&c.graph.to_toml()).unwrap();
    assert!((back.hop_overhead_s - 150e-6).abs() < 1e-12);
}

#[test]
fn a_ring_faster_than_free_hops_keeps_the_hop_cost_at_zero_and_says_so() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q8_0);
    let g = loopback();
    let o = plan(&m, &g, 1).unwrap();
    let mut free = g.clone();
    free.hop_overhead_s = 0.0;
    let fastest = predict(&m, &free, &o.plan).unwrap().decode_tokens_per_s;
    let c = tessera_plan::calibrate_hop_overhead(&m, &g, &o.plan, fastest * 1.5, 1).unwrap();
    assert!(c.clamped);
    assert_eq!(c.hop_overhead_after_s, 0.0);
    assert_eq!(c.hop_overhead_before_s, g.hop_overhead_s);
    assert!(c.correction.reason.contains("kept at zero"), "{c:?}");
}

#[test]
fn a_plan_without_hops_cannot_teach_the_cost_of_a_hop() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q8_0);
    let mut g = loopback();
    g.nodes[0].memory_budget = None;
    g.policy.strategies = vec![StrategyKind::Single];
    let o = plan(&m, &g, 1).unwrap();
    assert_eq!(o.plan.strategy, StrategyKind::Single);
    let e = tessera_plan::calibrate_hop_overhead(&m, &g, &o.plan, 10.0, 1).unwrap_err();
    assert!(e.to_string().contains("no hop between nodes"), "{e}");
}

#[test]
fn cluster_files_carry_the_hop_cost_and_refuse_a_negative_one() {
    let base = include_str!("../clusters/loopback.toml");
    let g = ResourceGraph::from_toml(base).unwrap();
    assert_eq!(g.hop_overhead_s, tessera_plan::DEFAULT_HOP_OVERHEAD_S);
    let g = ResourceGraph::from_toml(&format!("hop_overhead_us = 40\n{base}")).unwrap();
    assert!((g.hop_overhead_s - 40e-6).abs() < 1e-12);
    let e = ResourceGraph::from_toml(&format!("hop_overhead_us = -1\n{base}")).unwrap_err();
    assert!(e.to_string().contains("hop_overhead_us"), "{e}");
}

/// One node serving four requests at once, as `tessera lab run` measures it.
fn one_node_at_four() -> ResourceGraph {
    ResourceGraph::from_toml(
        "[policy]\nstrategies = [\"single\"]\nconcurrency = 4\n\
         [[node]]\nname = \"a\"\nprofile = \"laptop-16gb\"\n",
    )
    .unwrap()
}

#[test]
fn a_batch_slower_than_predicted_lowers_the_compute_rate_and_keeps_batch_one() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q8_0);
    let g = one_node_at_four();
    let o = plan(&m, &g, 1).unwrap();
    let p = &o.plan.predicted;
    assert!(
        p.throughput_tokens_per_s > 2.0 * p.decode_tokens_per_s,
        "{p:?}"
    );
    // Four at once measured only 1.5× one: the batch's work binds, not the weights' bytes.
    let measured = 1.5 * p.decode_tokens_per_s;
    let (cal, correction) =
        tessera_plan::calibrate_batching(&m, &g, &o.plan, measured, 1_764_500_000).unwrap();
    let c = correction.expect("over-predicted, so corrected");
    assert_eq!(
        (c.subject.as_str(), c.quantity.as_str()),
        ("node a", "compute")
    );
    assert!(c.factor < 1.0, "{c:?}");
    let after = predict(&m, &cal, &o.plan).unwrap();
    assert!(
        (after.throughput_tokens_per_s - measured).abs() / measured < 1e-3,
        "{after:?}"
    );
    // Memory bandwidth is untouched.
    assert_eq!(cal.nodes[0].ram.bandwidth, g.nodes[0].ram.bandwidth);
    // Already at or below the measurement: nothing to correct.
    let (same, none) = tessera_plan::calibrate_batching(
        &m,
        &g,
        &o.plan,
        p.throughput_tokens_per_s * 1.1,
        1_764_500_000,
    )
    .unwrap();
    assert!(none.is_none());
    assert_eq!(same, g);
    // A plan at concurrency 1 has no batch to learn from.
    let mut one = o.plan.clone();
    one.policy.concurrency = 1;
    assert!(tessera_plan::calibrate_batching(&m, &g, &one, measured, 0).is_err());
}

/// A single node whose run took longer (or shorter) per token than its stage and the runtime's
/// common cost explain: the difference is the node's, so its plan predicts its own run again.
#[test]
fn a_single_nodes_token_time_beyond_the_runtimes_cost_is_charged_to_the_node() {
    let m = model(QWEN3_DENSE_SMALL, Quant::Q8_0);
    let mut g = one_node_at_four();
    g.token_overhead_s = 1e-4;
    let mut single = plan(&m, &g, 1).unwrap().plan;
    single.policy.concurrency = 1;
    let p = predict(&m, &g, &single).unwrap();
    let measured_s = 1.0 / p.decode_tokens_per_s + 2e-3;
    let (cal, c) = tessera_plan::calibrate_node_to_token_time(
        &m,
        &g,
        &single,
        1.0 / measured_s,
        1_764_500_000,
    )
    .unwrap();
    let c = c.expect("slower than explained, so charged");
    assert_eq!(c.subject, "node a");
    assert!(c.factor < 1.0, "{c:?}");
    assert_eq!(cal.token_overhead_s, 1e-4, "the runtime's figure stays");
    let after = predict(&m, &cal, &single).unwrap();
    assert!(
        (after.decode_tokens_per_s * measured_s - 1.0).abs() < 1e-6,
        "{after:?}"
    );
    // A run faster than the graph explains makes the node faster, the same way.
    let quick_s = 1.0 / p.decode_tokens_per_s - 5e-5;
    let (cal, c) =
        tessera_plan::calibrate_node_to_token_time(&m, &g, &single, 1.0 / quick_s, 0).unwrap();
    assert!(c.expect("faster than explained").factor > 1.0);
    let after = predict(&m, &cal, &single).unwrap();
    assert!((after.decode_tokens_per_s * quick_s - 1.0).abs() < 1e-6);
    // A run the graph already predicts changes nothing.
    let (same, none) =
        tessera_plan::calibrate_node_to_token_time(&m, &g, &single, p.decode_tokens_per_s, 0)
            .unwrap();
    assert!(none.is_none());
    assert_eq!(same, g);
    // Only a plan of one node says whose the time is.
    let ring = plan(&m, &loopback(), 1).unwrap().plan;
    assert_eq!(ring.nodes().len(), 2);
    assert!(tessera_plan::calibrate_node_to_token_time(&m, &loopback(), &ring, 10.0, 0).is_err());
}
