//! Mixture-of-experts across machines, with real processes on 127.0.0.1: a `tessera
//! coordinator --experts ...`, `tessera node` agents (ring stages and expert-only nodes) and
//! `tessera run` clients. The experts of every MoE layer are split across 2 and 3 node
//! processes, alone and combined with a 2-stage split; greedy output must equal one process
//! (`Generator`, what `tessera generate` runs) token for token, the hidden state after every
//! stage at every step must hash equal to one process's (`--trace`: bits, not only tokens), and
//! the home stages must have sent at most one expert request per contacted node per MoE layer
//! per step.

mod common;

use std::time::Duration;

use common::{
    ids, model, reference_boundaries, reference_boundaries_from, reference_tokens, report_of,
    tokens_of, traces_of, ExpertCluster,
};
use serde_json::Value;
use tessera_model::{GgufFile, ModelConfig, Tokenizer};

const TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `prompt_text` greedily on a cluster with `experts` split over `nodes` and the ring
/// `stages`; checks the tokens against one process and the expert round trips.
fn expert_split_matches_one_process(
    model_name: &str,
    experts: &str,
    nodes: &[&str],
    stages: &[(&str, std::ops::Range<usize>)],
    contacted_max: usize,
) -> Value {
    let path = model(model_name);
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let prompt_text = "Once upon a time, in a quiet village";
    let prompt = Tokenizer::from_gguf(&g).unwrap().encode(prompt_text, true);
    let n = 10;
    let chunk = 4;
    let want = reference_tokens(&path, &prompt, n, chunk);
    let mut c = ExpertCluster::start(&path, experts, TIMEOUT);
    for name in nodes {
        c.add_node(name, &[]);
    }
    let msgs = c.run_json(
        stages,
        &[
            "-p",
            prompt_text,
            "-n",
            &n.to_string(),
            "--temperature",
            "0",
            "--prefill-chunk",
            &chunk.to_string(),
            "--trace",
        ],
    );
    let got = tokens_of(&msgs);
    assert_eq!(got, want, "{model_name} experts {experts}: tokens");
    // Bit for bit: the hidden state each stage hands on (or ends with), at every step.
    let ends: Vec<usize> = stages.iter().map(|(_, l)| l.end).collect();
    let traces = traces_of(&msgs);
    assert_eq!(
        traces.len(),
        ends.len() * (prompt.len().div_ceil(chunk) + want.len() - 1),
        "a trace per stage per step"
    );
    assert_eq!(
        traces,
        reference_boundaries(&path, &prompt, &want, chunk, &ends),
        "{model_name} experts {experts}: hidden-state hashes"
    );
    let report = report_of(&msgs).clone();
    // Expert requests: at most one per contacted node per MoE layer per step, and some.
    let stats = report["stage_stats"].as_array().unwrap();
    let mut trips = 0;
    let mut steps_layers = 0;
    for (s, st) in stats.iter().enumerate() {
        for phase in ["prefill", "decode"] {
            trips += st[phase]["expert_round_trips"].as_u64().unwrap_or(0);
        }
        if let Some(place) = report["stages"].as_array().and_then(|p| p.get(s)) {
            let layers = &place["layers"];
            let span = layers
                .as_str()
                .and_then(|l| l.split_once(".."))
                .map_or(0, |(a, b)| {
                    b.parse::<u64>().unwrap() - a.parse::<u64>().unwrap()
                });
            let steps = st["prefill"]["steps"].as_u64().unwrap_or(0)
                + st["decode"]["steps"].as_u64().unwrap_or(0);
            steps_layers += span * steps;
        }
    }
    let decode_trips: u64 = stats
        .iter()
        .map(|st| st["decode"]["expert_round_trips"].as_u64().unwrap_or(0))
        .sum();
    let decode_steps = stats
        .first()
        .map_or(0, |st| st["decode"]["steps"].as_u64().unwrap_or(0));
    eprintln!(
        "{model_name} experts {experts} stages {stages:?}: {trips} expert round trips \
         ({decode_trips} over {decode_steps} decode steps)"
    );
    assert!(trips > 0, "no expert requests in {report}");
    for place in report["stages"].as_array().unwrap() {
        eprintln!(
            "  node {} layers {}: received {} bytes, resident {} bytes",
            place["name"],
            place["layers"],
            place["load"]["bytes_transferred"],
            place["load"]["resident_bytes"]
        );
        // An expert-only node receives whole packed expert tensors but keeps only its own
        // experts in memory.
        if place["layers"] == "0..0" {
            let got = place["load"]["bytes_transferred"].as_u64().unwrap();
            let resident = place["load"]["resident_bytes"].as_u64().unwrap();
            assert!(resident > 0 && resident < got, "{place}");
        }
    }
    assert!(
        trips <= steps_layers * contacted_max as u64,
        "{trips} requests for {steps_layers} layer steps"
    );
    assert!(cfg.n_expert > 0);
    report
}

fn halves(n: usize) -> (Vec<usize>, Vec<usize>) {
    ((0..n / 2).collect(), (n / 2..n).collect())
}

fn thirds(n: usize) -> [Vec<usize>; 3] {
    [0, 1, 2].map(|r| (0..n).filter(|e| e % 3 == r).collect())
}

fn shape(name: &str) -> (usize, usize) {
    let g = GgufFile::open(model(name)).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    (cfg.n_layer, cfg.n_expert)
}

fn two_nodes(name: &str) {
    let (l, n) = shape(name);
    let (a, b) = halves(n);
    expert_split_matches_one_process(
        name,
        &format!("{}@a,{}@b", ids(&a), ids(&b)),
        &["a", "b"],
        &[("a", 0..l)],
        1,
    );
}

fn three_nodes(name: &str) {
    let (l, n) = shape(name);
    let [a, b, c] = thirds(n);
    expert_split_matches_one_process(
        name,
        &format!("{}@a,{}@b,{}@c", ids(&a), ids(&b), ids(&c)),
        &["a", "b", "c"],
        &[("a", 0..l)],
        2,
    );
}

fn stages_and_experts(name: &str) {
    let (l, n) = shape(name);
    let [a, b, c] = thirds(n);
    expert_split_matches_one_process(
        name,
        &format!("{}@a,{}@b,{}@c", ids(&a), ids(&b), ids(&c)),
        &["a", "b", "c"],
        &[("a", 0..l / 2), ("b", l / 2..l)],
        2,
    );
}

#[test]
fn experts_split_across_2_nodes_match_one_process_tiny() {
    two_nodes("test/tiny-qwen3moe-Q8_0.gguf");
}

#[test]
fn experts_split_across_3_nodes_match_one_process_tiny() {
    three_nodes("test/tiny-qwen3moe-Q8_0.gguf");
}

#[test]
fn experts_split_with_2_stages_match_one_process_tiny() {
    stages_and_experts("test/tiny-qwen3moe-Q8_0.gguf");
}

/// gpt-oss: MXFP4 experts with biases, sinks, a sliding window the 20-token run passes, YaRN.
#[test]
fn experts_split_across_3_nodes_match_one_process_gpt_oss() {
    three_nodes("test/tiny-gpt-oss-MXFP4.gguf");
}

#[test]
fn experts_split_with_2_stages_match_one_process_gpt_oss() {
    stages_and_experts("test/tiny-gpt-oss-MXFP4.gguf");
}

/// deepseek2: latent attention (keys wider than values), a dense first layer, sigmoid gating
/// with a selection bias in expert groups, a shared expert that stays with the home stage.
#[test]
fn experts_split_across_3_nodes_match_one_process_deepseek2() {
    three_nodes("test/tiny-deepseek2-Q8_0.gguf");
}

#[test]
fn experts_split_with_2_stages_match_one_process_deepseek2() {
    stages_and_experts("test/tiny-deepseek2-Q8_0.gguf");
}

/// deepseek2 in the absorbed layout (`attn_k_b`/`attn_v_b`): each stage caches one latent per
/// position.
#[test]
fn experts_split_with_2_stages_match_one_process_deepseek2_absorbed() {
    stages_and_experts("test/tiny-deepseek2-mla-Q8_0.gguf");
}

/// glm4moe: Q/K/V biases, partial RoPE, a dense first layer, sigmoid gating with a selection
/// bias, a shared expert.
#[test]
fn experts_split_with_2_stages_match_one_process_glm4moe() {
    stages_and_experts("test/tiny-glm4moe-Q8_0.gguf");
}

#[test]
fn experts_split_across_2_nodes_match_one_process_small() {
    two_nodes("test/small-qwen3moe-Q8_0.gguf");
}

#[test]
fn experts_split_across_3_nodes_match_one_process_small() {
    three_nodes("test/small-qwen3moe-Q8_0.gguf");
}

#[test]
fn experts_split_with_2_stages_match_one_process_small() {
    stages_and_experts("test/small-qwen3moe-Q8_0.gguf");
}

/// llama4: MoE every second layer with dense ones between, a shared expert at home, top-1
/// routing weighting the expert's input, iRoPE and RoPE frequency factors (which every stage
/// fetches with its layers).
#[test]
fn experts_split_with_2_stages_match_one_process_llama4() {
    stages_and_experts("test/tiny-llama4-Q8_0.gguf");
}

/// Prefix reuse on expert-split homes: two home stages (each computing its layers' experts
/// with the others' owners) and an expert-only node. A second run whose prompt begins with the
/// first run's prompt and answer starts, on both homes, from the caches they kept: only the
/// new tail is prefilled, and every hidden state each stage hands on is bit-identical to one
/// process computing the whole prompt from scratch.
#[test]
fn expert_split_homes_reuse_a_kept_prefix_bit_for_bit() {
    let name = "test/tiny-qwen3moe-Q8_0.gguf";
    let path = model(name);
    let (l, n) = shape(name);
    let [a, b, c] = thirds(n);
    let mut cluster = ExpertCluster::start(
        &path,
        &format!("{}@a,{}@b,{}@c", ids(&a), ids(&b), ids(&c)),
        TIMEOUT,
    );
    for node in ["a", "b", "c"] {
        cluster.add_node(node, &[]);
    }
    let stages = [("a", 0..l / 2), ("b", l / 2..l)];
    let g = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let chunk = 4;
    let run = |text: &str| {
        cluster.run_json(
            &stages,
            &[
                "-p",
                text,
                "-n",
                "6",
                "--temperature",
                "0",
                "--prefill-chunk",
                &chunk.to_string(),
                "--trace",
            ],
        )
    };
    let started = |msgs: &[Value]| {
        msgs.iter()
            .find(|m| m["type"] == "started")
            .unwrap_or_else(|| panic!("no start in {msgs:?}"))["cached_tokens"]
            .as_u64()
            .unwrap() as usize
    };
    let first_text = "Once upon a time, in a quiet village";
    let first = run(first_text);
    assert_eq!(started(&first), 0, "nothing was kept before");
    let answer = tokens_of(&first);
    let text = format!("{first_text}{} and then the end", tok.decode(&answer));
    let prompt = tok.encode(&text, true);
    // What the stages kept: the first prompt and the answer, but for its last token when the
    // length ended it (that token was never fed; an end-of-generation token follows the last
    // one fed).
    let fed_answer = if answer.len() == 6 {
        &answer[..5]
    } else {
        &answer[..]
    };
    let fed: Vec<u32> = tok
        .encode(first_text, true)
        .into_iter()
        .chain(fed_answer.iter().copied())
        .collect();
    let shared = fed.iter().zip(&prompt).take_while(|(x, y)| x == y).count();
    assert!(
        shared > 8,
        "the second prompt re-sends the first ({shared} shared)"
    );
    let second = run(&text);
    let cached = started(&second);
    assert_eq!(cached, shared.min(prompt.len() - 1));
    let want = reference_tokens(&path, &prompt, 6, chunk);
    assert_eq!(tokens_of(&second), want);
    assert_eq!(
        traces_of(&second),
        reference_boundaries_from(&path, &prompt, &want, chunk, &[l / 2, l], cached),
        "hidden-state hashes of the steps after the reused prefix"
    );
    for st in report_of(&second)["stage_stats"].as_array().unwrap() {
        if st["prefill"]["steps"].as_u64().unwrap_or(0) > 0 {
            assert_eq!(
                st["prefill"]["tokens"].as_u64().unwrap() as usize,
                prompt.len() - cached,
                "only the tail is prefilled: {st}"
            );
        }
    }
}

/// Speculation in an expert split (`--speculate 4`): a decode step carries the token and its
/// drafts, so each expert request carries their k + 1 rows, one request per contacted node
/// per MoE layer per step; the tokens are those without speculation, and with drafts accepted
/// the home took fewer decode steps than it generated tokens. (Fewer steps need not mean fewer
/// round trips: one row often needs no remote expert, k + 1 rows almost always do.)
#[test]
fn a_speculating_expert_split_sends_k_plus_1_rows_per_round_trip_and_matches_one_process() {
    let name = "test/small-qwen3moe-Q8_0.gguf";
    let (l, n) = shape(name);
    let (a, b) = halves(n);
    let tokens = 40;
    let mut c = ExpertCluster::start(
        &model(name),
        &format!("{}@a,{}@b", ids(&a), ids(&b)),
        TIMEOUT,
    );
    c.add_node("a", &[]);
    c.add_node("b", &[]);
    // The synthetic model's text repeats itself only when told to (a penalty below 1 favours
    // tokens already seen): then prompt lookup has something to find.
    let n_tokens = tokens.to_string();
    let run = |extra: &[&str]| {
        let flags = [
            &[
                "-p",
                "Once upon a time, in a quiet village",
                "-n",
                &n_tokens,
                "--temperature",
                "0",
                "--repeat-penalty",
                "0.2",
                "--ignore-eos",
            ][..],
            extra,
        ]
        .concat();
        c.run_json(&[("a", 0..l)], &flags)
    };
    let (plain, spec) = (run(&[]), run(&["--speculate", "4"]));
    assert_eq!(
        tokens_of(&spec).len(),
        tokens,
        "{:?}",
        &spec[spec.len().saturating_sub(3)..]
    );
    assert_eq!(tokens_of(&spec), tokens_of(&plain), "tokens");
    let home = &report_of(&spec)["stage_stats"][0];
    let accepted = home["drafts_accepted"].as_u64().unwrap();
    assert!(accepted > 0, "no draft was accepted: {home}");
    let steps = home["decode"]["steps"].as_u64().unwrap();
    let trips = home["decode"]["expert_round_trips"].as_u64().unwrap();
    assert!(
        steps < tokens as u64 - 1,
        "{steps} decode steps for {tokens} tokens"
    );
    assert!(
        trips <= steps * l as u64,
        "{trips} expert requests for {steps} steps"
    );
    // Draft rows rode along: more rows than steps, each step's rows in one request per peer.
    let rows = home["decode"]["tokens"].as_u64().unwrap();
    assert!(rows > steps, "{rows} rows in {steps} steps");
    let before = &report_of(&plain)["stage_stats"][0]["decode"];
    eprintln!(
        "expert split, 40 tokens: {steps} decode steps and {trips} expert round trips with \
         --speculate 4 ({accepted} drafts accepted), {} and {} without",
        before["steps"], before["expert_round_trips"]
    );
}
