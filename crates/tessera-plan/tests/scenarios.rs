//! Scenario tests: each asserts the planner's decision and the reason it states.

mod common;

use common::*;
use tessera_plan::{
    plan, usable_memory, CellKind, Objective, PlanError, PlanOutcome, Quant, ResourceGraph,
    StrategyKind,
};

fn cluster(toml: &str) -> ResourceGraph {
    ResourceGraph::from_toml(toml).expect("cluster parses")
}

fn within_budgets(o: &PlanOutcome, g: &ResourceGraph) {
    // The tables render for every scenario.
    assert!(tessera_plan::render_text(o).contains("Assignments"));
    for a in o.plan.assignments() {
        let node = g.node(&a.node).unwrap();
        assert!(
            a.memory.total <= usable_memory(node, &g.policy),
            "{} over budget",
            a.node
        );
    }
}

fn reasons(o: &PlanOutcome) -> Vec<&str> {
    o.explanation
        .rejected
        .iter()
        .map(|r| r.reason.as_str())
        .collect()
}

const MIXED_HOME_CLUSTER: &str = r#"
[defaults]
link = "1gbe"

[[node]]
name = "mac"
profile = "apple-m2-16gb"

[[node]]
name = "gpu-box"
profile = "rtx4060ti-16gb"

[[node]]
name = "laptop"
profile = "gtx1650ti-4gb-laptop"

[[node]]
name = "server"
profile = "cpu-server-64gb"

# The laptop is on Wi-Fi.
[[link]]
nodes = ["laptop", "mac"]
profile = "wifi"
[[link]]
nodes = ["laptop", "gpu-box"]
profile = "wifi"
[[link]]
nodes = ["laptop", "server"]
profile = "wifi"
"#;

/// (a) A 16 GB Mac, a 16 GB GPU box, a 4 GB GPU laptop and a 64 GB CPU server with Qwen3-30B-A3B at
/// Q4_K (16 GiB): no node holds it in fast memory alone, so a two-stage ring puts most layers in the
/// GPU's VRAM and the rest in the Mac's 100 GB/s unified memory. The Wi-Fi laptop and the server are
/// left out because their hops cost more than they save.
#[test]
fn mac_gpu_box_gpu_laptop_and_cpu_server_with_30b_a3b_ring_the_gpu_box_and_mac() {
    let m = model(QWEN3_30B_A3B, Quant::Q4_K);
    let g = cluster(MIXED_HOME_CLUSTER);
    let o = plan(&m, &g, 7).unwrap();
    within_budgets(&o, &g);
    assert_eq!(o.plan.strategy, StrategyKind::Stage);
    let mut nodes = o.plan.nodes();
    nodes.sort_unstable();
    assert_eq!(nodes, ["gpu-box", "mac"]);
    let cell = &o.plan.cells[0];
    let layers = |n: &str| {
        cell.assignments
            .iter()
            .find(|a| a.node == n)
            .unwrap()
            .layers
            .unwrap()
            .len()
    };
    assert!(
        layers("gpu-box") > 3 * layers("mac"),
        "the GPU's VRAM takes most layers"
    );
    let gpu = cell
        .assignments
        .iter()
        .find(|a| a.node == "gpu-box")
        .unwrap();
    assert!(gpu.memory.vram.as_gib() > 13.0, "VRAM is filled first");

    // It beats the best single node (the GPU box, spilling experts to 35 GB/s host RAM).
    let single = o
        .explanation
        .alternatives
        .iter()
        .find(|s| s.strategy == StrategyKind::Single)
        .expect("single-node runner-up");
    assert_eq!(single.nodes, ["gpu-box"]);
    assert!(o.plan.predicted.decode_tokens_per_s > 1.15 * single.decode_tokens_per_s);
    assert_eq!(o.plan.predicted.decode.binding(), "memory bandwidth");

    // Stated reasons for leaving nodes out.
    let r = reasons(&o);
    assert!(
        r.iter()
            .any(|s| s.starts_with("adding node laptop to the ring costs")
                && s.contains("in hops over a 4.00 ms link and saves")),
        "{r:#?}"
    );
    assert!(
        r.iter()
            .any(|s| s.starts_with("adding node server to the ring costs")),
        "{r:#?}"
    );
    assert!(o
        .explanation
        .rejected
        .iter()
        .any(|x| x.strategy == StrategyKind::Expert
            && x.reason.contains("round trips per token")
            && x.reason.contains("is no better than")));
}

/// (b) Four 8 GB RK3588 boards with NVMe and Qwen3-235B-A22B at Q4_K (123 GiB, four times their
/// combined RAM): experts stream from every board's disk in parallel, weighted by disk bandwidth
/// (the board with the 3 GB/s drive takes the most); a stage ring would read the disks one after
/// another and is slower.
#[test]
fn four_arm_boards_with_a_moe_larger_than_their_ram_split_experts_onto_disk_by_bandwidth() {
    let m = model(QWEN3_235B_A22B, Quant::Q4_K);
    let g = cluster(
        r#"
        [defaults]
        link = "1gbe"
        [[node]]
        name = "arm1"
        profile = "rk3588-8gb-nvme"
        [[node]]
        name = "arm2"
        profile = "rk3588-8gb-nvme"
        [[node]]
        name = "arm3"
        profile = "rk3588-8gb-nvme"
        [[node]]
        name = "arm4"
        profile = "rk3588-8gb-nvme"
        disk_bandwidth = "3GB/s"
        "#,
    );
    assert!(m.total_weights().as_gib() > 4.0 * 8.0 * 3.0);
    let o = plan(&m, &g, 1).unwrap();
    within_budgets(&o, &g);
    assert_eq!(o.plan.strategy, StrategyKind::Expert);
    let cell = &o.plan.cells[0];
    assert_eq!(cell.kind, CellKind::Expert);
    assert_eq!(cell.assignments.len(), 4);
    assert!(
        cell.assignments
            .iter()
            .all(|a| a.memory.disk.as_gib() > 10.0),
        "experts are disk-backed"
    );
    let experts = |n: &str| {
        cell.assignments
            .iter()
            .find(|a| a.node == n)
            .unwrap()
            .experts
            .map_or(0, |e| e.experts.len())
    };
    for slow in ["arm1", "arm2", "arm3"] {
        assert!(
            experts("arm4") as f64 > 1.4 * experts(slow) as f64,
            "bandwidth-weighted: {slow}"
        );
    }
    assert_eq!(o.plan.predicted.decode.binding(), "disk reads");
    assert!(o.explanation.chosen.description.contains("on disk"));
    // Reading the disks in parallel beats a ring that reads them one after another.
    let stage = o
        .explanation
        .alternatives
        .iter()
        .chain(std::iter::empty())
        .find(|s| s.strategy == StrategyKind::Stage)
        .map(|s| s.decode_tokens_per_s)
        .unwrap_or(0.0);
    // By less than the four disks would add: each layer waits for the board its token reads
    // most experts from, not for the boards' average (`cost::slowest_owner`): 1.30x here.
    assert!(o.plan.predicted.decode_tokens_per_s > 1.2 * stage);
    // And beats streaming everything from the fastest board's disk (1.48x).
    let mut only_single = g.clone();
    only_single.policy.strategies = vec![StrategyKind::Single];
    let single = plan(&m, &only_single, 1).unwrap();
    assert!(o.plan.predicted.decode_tokens_per_s > 1.3 * single.plan.predicted.decode_tokens_per_s);
}

/// (c) Eight laptops over a 40 ms WAN, serving eight concurrent requests: each laptop holds the whole
/// model, so whole-request replicas multiply throughput; a stage split would pay 20 ms per hop.
#[test]
fn eight_laptops_over_a_40ms_wan_serve_whole_request_replicas_not_a_stage_split() {
    let m = model(LLAMA_3_1_8B, Quant::Q4_K);
    let mut toml = String::from("[defaults]\nlink = \"wan-40ms\"\n[policy]\nconcurrency = 8\n");
    for i in 1..=8 {
        toml += &format!("[[node]]\nname = \"laptop{i}\"\nprofile = \"laptop-16gb\"\n");
    }
    let g = cluster(&toml);
    let o = plan(&m, &g, 1).unwrap();
    within_budgets(&o, &g);
    assert_eq!(o.plan.strategy, StrategyKind::Replica);
    assert_eq!(o.plan.cells.len(), 8);
    assert!(o
        .plan
        .cells
        .iter()
        .all(|c| c.kind == CellKind::Single && c.sequences == 1));
    let single = o
        .explanation
        .alternatives
        .iter()
        .find(|s| s.strategy == StrategyKind::Single)
        .unwrap();
    assert!(o.plan.predicted.throughput_tokens_per_s > 2.0 * single.throughput_tokens_per_s);
    assert!((o.plan.predicted.decode_tokens_per_s - single.decode_tokens_per_s).abs() < 1e-9);
    // A stage split pays 20 ms per hop over the WAN: it decodes slower than one laptop and serves
    // less than the replicas; adding more laptops to it is refused for its hops.
    let stage = o
        .explanation
        .alternatives
        .iter()
        .find(|s| s.strategy == StrategyKind::Stage)
        .expect("the best ring is a runner-up");
    assert!(stage.network_s_per_token >= 0.040);
    assert!(stage.decode_tokens_per_s < single.decode_tokens_per_s);
    assert!(stage.throughput_tokens_per_s < 0.75 * o.plan.predicted.throughput_tokens_per_s);
    let r = reasons(&o);
    assert!(
        r.iter().any(
            |s| s.starts_with("adding node laptop3 (or the identical laptop4")
                && s.contains("in hops over a 40.00 ms link")
        ),
        "{r:#?}"
    );
    assert!(r.iter().any(|s| s.starts_with("stage ring laptop1")
        && s.contains("is no better than stage ring laptop1")
        && s.contains("over a 40.00 ms round-trip link")));
}

/// Four 32 GiB hosts over a 40 ms WAN, each holding Llama 3.1 8B, with the gateway serving eight
/// streams: every objective uses all four (one host batching eight requests serves each of them
/// slower than four replicas serving two each, and serves less in all). At one stream nothing is
/// gained by the idle three, and the plan on fewer nodes wins the tie.
#[test]
fn four_32gib_hosts_over_a_40ms_wan_serving_8_streams_choose_replicas_under_every_objective() {
    let m = model(LLAMA_3_1_8B, Quant::Q4_K);
    let mut toml = String::from("[defaults]\nlink = \"wan-40ms\"\n");
    for i in 1..=4 {
        toml += &format!(
            "[[node]]\nname = \"w{i}\"\nram = \"32GiB\"\nmem_bandwidth = \"50GB/s\"\ncompute = \"1TFLOPS\"\n"
        );
    }
    for objective in [
        Objective::Latency,
        Objective::Throughput,
        Objective::Balanced,
    ] {
        let mut g = cluster(&toml);
        g.policy.objective = objective;
        g.policy.concurrency = 8;
        let o = plan(&m, &g, 1).unwrap();
        within_budgets(&o, &g);
        assert_eq!(o.plan.strategy, StrategyKind::Replica, "{objective:?}");
        assert_eq!(o.plan.cells.len(), 4, "{objective:?}");
        assert!(o.plan.cells.iter().all(|c| c.sequences == 2));
        let single = o
            .explanation
            .alternatives
            .iter()
            .find(|s| s.strategy == StrategyKind::Single)
            .expect("a single node is a runner-up");
        // One request alone decodes as fast either way; under load each is faster on replicas.
        assert!((o.plan.predicted.decode_tokens_per_s - single.decode_tokens_per_s).abs() < 1e-9);
        let single_each = single.throughput_tokens_per_s / 8.0;
        assert!(o.plan.predicted.per_request_tokens_per_s() > single_each);
        // One node batches eight requests cheaply (decode is bound by weight reads), so the
        // aggregate gain is smaller than the node count: the model predicts about 1.4x.
        assert!(
            o.plan.predicted.throughput_tokens_per_s > 1.25 * single.throughput_tokens_per_s,
            "{objective:?}: replicas {} vs single {} tok/s",
            o.plan.predicted.throughput_tokens_per_s,
            single.throughput_tokens_per_s
        );
    }
    let mut g = cluster(&toml);
    g.policy.objective = Objective::Throughput;
    let o = plan(&m, &g, 1).unwrap();
    assert_eq!(o.plan.strategy, StrategyKind::Single);
    assert!(reasons(&o)
        .iter()
        .any(|r| r.starts_with("4 whole-request replicas") && r.contains("on fewer nodes")));
}

/// Four hosts that each hold the model but are processes on one machine of two cores (emulated
/// hosts, `[[machine]]`): four requests at once run on four cells that divide two cores, so the
/// replicas serve half what four machines would; one request alone is as fast as before.
#[test]
fn replicas_on_one_machines_cores_divide_them() {
    let m = model(LLAMA_3_1_8B, Quant::Q4_K);
    let mut toml = String::from(
        "[defaults]\nlink = \"wan-40ms\"\n[policy]\nconcurrency = 4\nstrategies = [\"replica\"]\n",
    );
    for i in 1..=4 {
        toml += &format!("[[node]]\nname = \"h{i}\"\nprofile = \"laptop-16gb\"\n");
    }
    let apart = plan(&m, &cluster(&toml), 1).unwrap().plan.predicted;
    let shared = toml.clone()
        + "[[machine]]\nname = \"vm\"\ncores = 2\nnodes = [\"h1\", \"h2\", \"h3\", \"h4\"]\n";
    let g = cluster(&shared);
    assert_eq!(g.machine_of("h3").map(|m| m.cores), Some(2.0));
    let together = plan(&m, &g, 1).unwrap().plan.predicted;
    let ratio = together.throughput_tokens_per_s / apart.throughput_tokens_per_s;
    assert!((ratio - 0.5).abs() < 1e-9, "{ratio}");
    assert!((together.decode_tokens_per_s - apart.decode_tokens_per_s).abs() < 1e-9);
    // Two cores for two nodes: no contention.
    let roomy = shared.replace("cores = 2", "cores = 4");
    let roomy = plan(&m, &cluster(&roomy), 1).unwrap().plan.predicted;
    assert!((roomy.throughput_tokens_per_s - apart.throughput_tokens_per_s).abs() < 1e-6);
}

#[test]
fn a_machine_must_name_known_nodes_once_and_have_cores() {
    let base = "[[node]]\nname = \"a\"\nprofile = \"laptop-16gb\"\n";
    let bad = |extra: &str| ResourceGraph::from_toml(&format!("{base}{extra}")).unwrap_err();
    let e = bad("[[machine]]\nname = \"m\"\ncores = 2\nnodes = [\"b\"]\n");
    assert!(e.to_string().contains("\"b\""), "{e}");
    let e = bad("[[machine]]\nname = \"m\"\ncores = 0\nnodes = [\"a\"]\n");
    assert!(e.to_string().contains("cores must be"), "{e}");
    let e = bad("[[machine]]\nname = \"m\"\ncores = 2\nnodes = [\"a\"]\n\
         [[machine]]\nname = \"n\"\ncores = 2\nnodes = [\"a\"]\n");
    assert!(e.to_string().contains("already on machine"), "{e}");
}

const TWO_GPUS: &str = r#"
[[node]]
name = "gpu0"
profile = "rtx3060-12gb"

# Second card on a PCIe 2.0 x1 riser in the same host, with a slice of its RAM.
[[node]]
name = "gpu1-x1"
profile = "rtx3060-12gb"
ram = "4GiB"

[[link]]
nodes = ["gpu0", "gpu1-x1"]
profile = "pcie-gen2-x1"
"#;

/// (d) Two GPUs, one on PCIe Gen2 x1: a model that fits one card stays on the first; the second
/// card only adds a hop.
#[test]
fn two_gpus_leave_the_pcie_x1_card_idle_when_the_model_fits_one() {
    let m = model(LLAMA_3_1_8B, Quant::Q4_K);
    let g = cluster(TWO_GPUS);
    let o = plan(&m, &g, 1).unwrap();
    within_budgets(&o, &g);
    assert_eq!(o.plan.strategy, StrategyKind::Single);
    assert_eq!(o.plan.nodes(), ["gpu0"]);
    let r = reasons(&o);
    assert!(
        r.iter().any(|s| s.starts_with("stage ring gpu0")
            && s.contains("gpu1-x1")
            && s.contains("is no better than single node gpu0")
            && s.contains("its hops cost")),
        "{r:#?}"
    );
}

/// (d) ... and a model that needs both cards' memory uses the x1 card as a second stage, which is
/// several times faster than spilling to host RAM.
#[test]
fn two_gpus_use_the_pcie_x1_card_when_the_model_needs_its_memory() {
    let m = model(QWEN2_5_14B, Quant::Q8_0);
    let g = cluster(TWO_GPUS);
    let o = plan(&m, &g, 1).unwrap();
    within_budgets(&o, &g);
    assert_eq!(o.plan.strategy, StrategyKind::Stage);
    let mut nodes = o.plan.nodes();
    nodes.sort_unstable();
    assert_eq!(nodes, ["gpu0", "gpu1-x1"]);
    assert!(o.plan.assignments().all(|a| a.memory.vram.as_gib() > 4.0));
    let r = reasons(&o);
    assert!(
        r.iter()
            .any(|s| s.starts_with("single node gpu1-x1: node gpu1-x1 needs")),
        "{r:#?}"
    );
    let single = o
        .explanation
        .alternatives
        .iter()
        .find(|s| s.strategy == StrategyKind::Single)
        .unwrap();
    assert_eq!(single.nodes, ["gpu0"]);
    assert!(o.plan.predicted.decode_tokens_per_s > 3.0 * single.decode_tokens_per_s);
    // The x1 slot is visible in the hop terms but does not bind.
    assert!(o.plan.predicted.decode.network_s() < 0.01 * o.plan.predicted.decode.total_s);
}

/// Nothing fits: planning fails with every reason.
#[test]
fn a_model_too_big_for_every_budget_fails_with_the_reasons() {
    let m = model(QWEN2_5_14B, Quant::F16);
    let g = cluster(
        r#"
        [[node]]
        name = "tiny"
        profile = "laptop-16gb"
        memory_budget = "4GiB"
        disk = "0B"
        "#,
    );
    match plan(&m, &g, 1) {
        Err(PlanError::NoFeasiblePlan { rejected }) => {
            assert!(rejected
                .iter()
                .any(|r| r.reason.contains("needs") && r.reason.contains("budget 4.0 GiB")));
        }
        other => panic!("expected no feasible plan, got {other:?}"),
    }
}

/// A policy floor on decode speed turns a feasible but slow plan into a rejection with the figure.
#[test]
fn a_minimum_tokens_per_second_rejects_slow_plans() {
    let m = model(LLAMA_3_1_8B, Quant::Q4_K);
    let g = cluster(
        r#"
        [policy]
        min_tokens_per_s = 20
        [[node]]
        name = "laptop"
        profile = "laptop-16gb"
        "#,
    );
    let Err(PlanError::NoFeasiblePlan { rejected }) = plan(&m, &g, 1) else {
        panic!("expected refusal")
    };
    assert!(
        rejected[0]
            .reason
            .contains("below the policy minimum of 20 tok/s"),
        "{:?}",
        rejected[0]
    );
}

/// The example cluster files shipped with the crate parse and plan.
#[test]
fn example_cluster_files_parse_and_plan() {
    let m = model(QWEN3_MOE_SMALL, Quant::Q8_0);
    for (name, text) in [
        ("home-mixed", include_str!("../clusters/home-mixed.toml")),
        ("arm-boards", include_str!("../clusters/arm-boards.toml")),
        ("wan-laptops", include_str!("../clusters/wan-laptops.toml")),
        ("two-gpus", include_str!("../clusters/two-gpus.toml")),
        ("custom", include_str!("../clusters/custom.toml")),
        ("loopback", include_str!("../clusters/loopback.toml")),
    ] {
        let g = ResourceGraph::from_toml(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let o = plan(&m, &g, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        within_budgets(&o, &g);
        let json = o.to_json();
        for key in [
            "strategy",
            "assignments",
            "predicted",
            "alternatives",
            "rejected",
            "evidence",
            "hash",
        ] {
            assert!(json.get(key).is_some(), "{name}: JSON lacks {key}");
        }
        assert!(json["predicted"]["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(json["predicted"]["ttft_s"].as_f64().unwrap() > 0.0);
        assert!(json["assignments"][0]["memory"]["total"].as_u64().unwrap() > 0);
    }
    for (name, text) in [
        (
            "qwen3-30b-a3b",
            include_str!("../models/qwen3-30b-a3b.config.json"),
        ),
        (
            "qwen3-235b-a22b",
            include_str!("../models/qwen3-235b-a22b.config.json"),
        ),
        (
            "llama-3.1-8b",
            include_str!("../models/llama-3.1-8b.config.json"),
        ),
        (
            "qwen3-dense-bench",
            include_str!("../models/qwen3-dense-bench.config.json"),
        ),
        (
            "qwen3-moe-bench",
            include_str!("../models/qwen3-moe-bench.config.json"),
        ),
        (
            "gpt-oss-120b",
            include_str!("../models/gpt-oss-120b.config.json"),
        ),
        (
            "deepseek-v3",
            include_str!("../models/deepseek-v3.config.json"),
        ),
        ("glm-4.5", include_str!("../models/glm-4.5.config.json")),
    ] {
        let m = tessera_plan::ModelProfile::from_hf_config(text, Quant::Q4_K)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(m.total_weights().0 > 0);
    }
}

/// The bundled configs of the MoE models people pool machines for plan on the mixed home
/// cluster within every budget, each with an expert split priced; the two that fit in no
/// machine's memory nor in the ring's (DeepSeek V3, GLM 4.5: disk-bound) split by experts, the
/// disks read at once. The others fit a stage ring in memory, which beats an expert split there:
/// each of an expert split's 36-48 MoE layers waits for the owners its token reaches, and the
/// laptop's 4 ms link, reached in some layer of most tokens, costs a whole round trip there.
#[test]
fn bundled_gpt_oss_deepseek_glm_and_llama_4_configs_plan_as_expert_splits() {
    let g = ResourceGraph::from_toml(include_str!("../clusters/home-mixed.toml")).unwrap();
    for (name, text) in [
        (
            "gpt-oss-120b",
            include_str!("../models/gpt-oss-120b.config.json"),
        ),
        (
            "deepseek-v3",
            include_str!("../models/deepseek-v3.config.json"),
        ),
        ("glm-4.5", include_str!("../models/glm-4.5.config.json")),
        (
            "llama-4-scout",
            include_str!("../models/llama-4-scout.config.json"),
        ),
        (
            "llama-4-maverick",
            include_str!("../models/llama-4-maverick.config.json"),
        ),
    ] {
        let m = tessera_plan::ModelProfile::from_hf_config(text, Quant::Q4_K).unwrap();
        let o = plan(&m, &g, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        within_budgets(&o, &g);
        let expert_split = o.plan.strategy == StrategyKind::Expert
            || o.explanation
                .alternatives
                .iter()
                .any(|a| a.strategy == StrategyKind::Expert && a.decode_tokens_per_s > 0.0);
        assert!(expert_split, "{name}: no expert split priced");
        if matches!(name, "deepseek-v3" | "glm-4.5") {
            assert_eq!(o.plan.strategy, StrategyKind::Expert, "{name}");
        }
    }
}
