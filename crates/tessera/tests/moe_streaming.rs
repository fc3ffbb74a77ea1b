//! Expert streaming on a node of an expert split, with real processes on 127.0.0.1: a `tessera
//! coordinator --experts ...` and two `tessera node` agents, the expert-only one given an
//! `--expert-budget` of about two experts, so it streams its experts from disk (and the home
//! stage too, for its own experts). Greedy output must equal one process, and the coordinator
//! must hear both nodes' expert-cache misses.

mod common;

use std::time::{Duration, Instant};

use common::{ids, model, reference_tokens, report_of, tokens_of, ExpertCluster};
use tessera_model::{GgufFile, ModelConfig, Tokenizer};

const TIMEOUT: Duration = Duration::from_secs(120);

/// Bytes of one expert of the first MoE layer in the GGUF (gate, up and down).
fn expert_bytes(g: &GgufFile, cfg: &ModelConfig) -> u64 {
    let (first, n_expert) = (cfg.n_layer_dense_lead, cfg.n_expert);
    ["gate", "up", "down"]
        .iter()
        .map(|w| {
            g.tensor(&format!("blk.{first}.ffn_{w}_exps.weight"))
                .unwrap_or_else(|| panic!("no ffn_{w}_exps"))
                .n_bytes
        })
        .sum::<u64>()
        / n_expert as u64
}

#[test]
fn streamed_experts_on_a_node_match_one_process_small() {
    streamed_experts_match_one_process("test/small-qwen3moe-Q8_0.gguf");
}

/// gpt-oss: MXFP4 experts with their biases, sliding-window layers (the run passes the window).
#[test]
fn streamed_experts_on_a_node_match_one_process_gpt_oss() {
    streamed_experts_match_one_process("test/tiny-gpt-oss-MXFP4.gguf");
}

/// deepseek2: a dense first layer (no experts to stream there), a shared expert kept resident.
#[test]
fn streamed_experts_on_a_node_match_one_process_deepseek2() {
    streamed_experts_match_one_process("test/tiny-deepseek2-Q8_0.gguf");
}

fn streamed_experts_match_one_process(name: &str) {
    let path = model(name);
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let (l, n) = (cfg.n_layer, cfg.n_expert);
    assert!(n >= 4);
    let budget = 2 * expert_bytes(&g, &cfg);
    let prompt_text = "Once upon a time, in a quiet village";
    let prompt = Tokenizer::from_gguf(&g).unwrap().encode(prompt_text, true);
    let (steps, chunk) = (10, 4);
    let want = reference_tokens(&path, &prompt, steps, chunk);

    let a: Vec<usize> = (0..n / 2).collect();
    let b: Vec<usize> = (n / 2..n).collect();
    let mut c = ExpertCluster::start(&path, &format!("{}@a,{}@b", ids(&a), ids(&b)), TIMEOUT);
    c.add_node("a", &["--expert-budget".into(), budget.to_string()]);
    c.add_node("b", &["--expert-budget".into(), budget.to_string()]);
    let msgs = c.run_json(
        &[("a", 0..l)],
        &[
            "-p",
            prompt_text,
            "-n",
            &steps.to_string(),
            "--temperature",
            "0",
            "--prefill-chunk",
            &chunk.to_string(),
        ],
    );
    assert_eq!(tokens_of(&msgs), want, "streamed experts: tokens");
    let report = report_of(&msgs);
    let trips: u64 = report["stage_stats"]
        .as_array()
        .unwrap()
        .iter()
        .map(|st| st["decode"]["expert_round_trips"].as_u64().unwrap_or(0))
        .sum();
    assert!(trips > 0, "no expert requests in {report}");

    // Heartbeats carry each node's expert-cache counters to the coordinator: the expert-only
    // node's, and the home stage's for its own streamed experts. Wait for each to report misses
    // (both read experts from disk: their budgets hold about two).
    for node in ["a", "b"] {
        let prefix = format!("expert cache: {node} ");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let line = c.coordinator.wait_for(&prefix);
            let misses: u64 = line
                .split_whitespace()
                .skip_while(|w| *w != "misses")
                .nth(1)
                .and_then(|m| m.parse().ok())
                .unwrap_or_else(|| panic!("malformed line {line:?}"));
            if misses > 0 {
                eprintln!("coordinator saw: {prefix}{line}");
                break;
            }
            // Look at later lines only.
            c.coordinator.seen.retain(|s| !s.starts_with(&prefix));
            assert!(
                Instant::now() < deadline,
                "no misses reported by {node}: {line}"
            );
        }
    }
}

#[test]
fn bench_with_an_expert_budget_reports_the_streaming_figures() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let budget = 2 * expert_bytes(&g, &cfg) * cfg.n_layer as u64;
    let out = std::process::Command::new(common::bin())
        .args(["bench", "-t", "1", "-p", "4", "-n", "12", "--json", "-m"])
        .arg(&path)
        .args(["--expert-budget", &budget.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON report");
    let s = &report["streaming"];
    assert_eq!(s["budget_bytes"].as_u64(), Some(budget), "{report}");
    let hit = s["hit_rate"].as_f64().unwrap();
    assert!(
        (0.0..1.0).contains(&hit),
        "a cache of 2 experts a layer misses: {report}"
    );
    assert!(
        s["missed_bytes_per_token"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    let disk = s["disk_gb_s"].as_f64().unwrap();
    let bound = s["disk_bound_tok_s"].as_f64().unwrap();
    let missed = s["missed_bytes_per_token"].as_f64().unwrap();
    assert!(
        disk > 0.0 && (bound - disk * 1e9 / missed).abs() <= 1e-6 * bound,
        "{report}"
    );
    // A dense model has no experts to stream.
    let dense = std::process::Command::new(common::bin())
        .args(["bench", "-n", "1", "-p", "1", "--expert-budget", "1MiB"])
        .output()
        .unwrap();
    assert!(!dense.status.success());
    assert!(String::from_utf8_lossy(&dense.stderr).contains("mixture-of-experts"));
}
