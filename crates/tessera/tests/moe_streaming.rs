//! Expert streaming on a node of an expert split, with real processes on 127.0.0.1: a `tessera
//! coordinator --experts ...` and two `tessera node` agents, the expert-only one given an
//! `--expert-budget` of about two experts, so it streams its experts from disk (and the home
//! stage too, for its own experts). Greedy output must equal one process, the coordinator must
//! hear both nodes' expert-cache misses, each node's high-water mark of expert memory stays
//! within its budget plus one expert, and the expert node's resident set grows by no more than
//! that plus its read buffers and a stated overhead.

mod common;

use std::time::Duration;

use common::{ids, model, reference_tokens, report_of, tokens_of, ExpertCluster};
use tessera_model::{GgufFile, ModelConfig, Tokenizer};

const TIMEOUT: Duration = Duration::from_secs(120);

/// What a node's resident set may grow by, beyond its experts and read buffers, while it serves
/// a run: the runtime's per-request allocations, new threads' stacks and allocator arenas, QUIC
/// buffers. It does not depend on the model.
const RSS_OVERHEAD: u64 = 8 << 20;

/// Built (repacked) bytes of the largest expert: what the store counts against its budget.
fn built_expert_bytes(g: &GgufFile) -> u64 {
    let cfg = ModelConfig::from_gguf(g).unwrap();
    let m = tessera_engine::Model::load_streaming(
        g,
        tessera_engine::LoadSpec::full(&cfg),
        tessera_engine::ExpertStreaming::with_budget(u64::MAX / 2),
        1,
        &mut |_, _| {},
    )
    .unwrap();
    m.expert_stats().unwrap().expert_bytes
}

/// A process's anonymous resident memory (`RssAnon`: its heap and stacks) and its resident
/// file pages (`RssFile`: mapped file pages, which the kernel may drop), in bytes; `None` once
/// it is gone.
fn rss(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |key: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|k| k * 1024)
    };
    Some((kib("RssAnon:")?, kib("RssFile:")?))
}

/// Samples `pid`'s resident memory until `stop` is set; the largest of each figure.
fn sample_rss(
    pid: u32,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<(u64, u64, usize)> {
    std::thread::spawn(move || {
        let (mut anon, mut file, mut n) = (0, 0, 0);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some((a, f)) = rss(pid) {
                anon = anon.max(a);
                file = file.max(f);
                n += 1;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        (anon, file, n)
    })
}

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

/// `tessera run --json` greedily on `stages`: `steps` tokens after `prompt`, prefilled `chunk` at
/// a time; its messages.
fn greedy(
    c: &ExpertCluster,
    stages: &[(&str, std::ops::Range<usize>)],
    prompt: &str,
    steps: usize,
    chunk: usize,
) -> Vec<serde_json::Value> {
    let (steps, chunk) = (steps.to_string(), chunk.to_string());
    let args = [
        "-p",
        prompt,
        "-n",
        &steps,
        "--temperature",
        "0",
        "--prefill-chunk",
        &chunk,
    ];
    c.run_json(stages, &args)
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
    // b reads its local copy of the model (no transfer buffers in its memory).
    c.add_node(
        "b",
        &[
            "--expert-budget".into(),
            budget.to_string(),
            "--model".into(),
            path.display().to_string(),
        ],
    );
    // b's resident memory once it has joined, before it loads or reads anything, then sampled
    // through the run.
    let b_pid = c.nodes[1].child.id();
    let (b_before, _) = rss(b_pid).expect("node b runs");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = sample_rss(b_pid, stop.clone());
    let msgs = greedy(&c, &[("a", 0..l)], prompt_text, steps, chunk);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (b_anon_peak, b_file_peak, samples) = sampler.join().unwrap();
    assert_eq!(tokens_of(&msgs), want, "streamed experts: tokens");
    let report = report_of(&msgs);
    let trips: u64 = report["stage_stats"]
        .as_array()
        .unwrap()
        .iter()
        .map(|st| st["decode"]["expert_round_trips"].as_u64().unwrap_or(0))
        .sum();
    assert!(trips > 0, "no expert requests in {report}");
    // The home stage's own streamed experts, counted over the sequence's decode steps: every
    // step looks its experts up, its budget holds about two, so some are read from disk.
    let home = &report["stage_stats"][0]["decode"];
    let (lookups, misses) = (
        home["expert_lookups"].as_u64().unwrap(),
        home["expert_misses"].as_u64().unwrap(),
    );
    assert!(lookups > 0, "{report}");
    assert!(misses > 0 && misses <= lookups, "{report}");
    assert!(home["expert_disk_bytes"].as_u64().unwrap() > 0, "{report}");
    // The expert-only node streams too: its replies carry what each request cost it, summed
    // on the home's decode steps (its lookups, some read from disk, and its compute time).
    let owners = &home["owners"];
    let owner_lookups = owners["lookups"].as_u64().unwrap();
    let owner_misses = owners["misses"].as_u64().unwrap();
    assert!(owner_lookups > 0, "{report}");
    assert!(
        owner_misses > 0 && owner_misses <= owner_lookups,
        "{report}"
    );
    assert!(owners["disk_bytes"].as_u64().unwrap() > 0, "{report}");
    assert!(owners["slowest_serve_ns"].as_u64().unwrap() > 0, "{report}");

    // Heartbeats carry each node's expert-cache counters to the coordinator (an `expert_cache`
    // event whenever they change): the expert-only node's, and the home stage's for its own
    // streamed experts. Both read experts from disk (their budgets hold about two), so each
    // reports misses; every peak it reports (a high-water mark: cache, read window, reads in
    // flight, experts a computation holds, spare allocations) stays within its budget plus the
    // one expert a computation may hold outside the cache.
    let built = built_expert_bytes(&g);
    for node in ["a", "b"] {
        let fields = [("event", "expert_cache"), ("node", node)];
        c.coordinator
            .wait_event_where(&fields, 1, |e| e["misses"].as_u64() > Some(0));
        for e in c.coordinator.events(&fields) {
            let peak = e["peak_bytes"].as_u64().unwrap();
            assert_eq!(e["budget_bytes"].as_u64(), Some(budget), "{e}");
            // A miss is a read, and every read is counted in the peak.
            assert!(e["misses"].as_u64() == Some(0) || peak > 0, "{e}");
            assert!(
                peak <= budget + built,
                "{node} held {peak} bytes of experts, over its budget of {budget} plus one \
                 expert of {built}: {e}"
            );
        }
    }
    // b's anonymous resident memory, sampled through the run, grew by no more than its
    // experts' bound, its read buffers and the stated overhead. (Its file pages are the model
    // file's, mapped while it is received and checked: the page cache's, printed only.)
    let last = c
        .coordinator
        .events(&[("event", "expert_cache"), ("node", "b")])
        .pop()
        .unwrap();
    let buffers = last["peak_read_buffer_bytes"].as_u64().unwrap();
    let grown = b_anon_peak.saturating_sub(b_before);
    eprintln!(
        "node b: anonymous resident {b_before} bytes after joining, {b_anon_peak} at its \
         sampled peak (+{grown}, {samples} samples), file pages up to {b_file_peak}; expert \
         budget {budget}, one expert {built}, read buffers {buffers}"
    );
    assert!(samples > 0, "node b was never sampled");
    assert!(
        grown <= budget + built + buffers + RSS_OVERHEAD,
        "node b's anonymous resident memory grew by {grown} bytes: over its expert budget \
         {budget} + one expert {built} + read buffers {buffers} + {RSS_OVERHEAD} overhead"
    );
}

/// A ring of two stages of an MoE model, each node given `--expert-budget` of about two experts:
/// each stage streams the experts of its own layers from its disk (there is no expert split:
/// a stage holds every expert of its layers), and the text is one process's.
#[test]
fn ring_stages_stream_their_own_experts_under_an_expert_budget() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let l = cfg.n_layer;
    let budget = 2 * expert_bytes(&g, &cfg);
    let prompt_text = "Once upon a time, in a quiet village";
    let prompt = Tokenizer::from_gguf(&g).unwrap().encode(prompt_text, true);
    let (steps, chunk) = (8, 4);
    let want = reference_tokens(&path, &prompt, steps, chunk);

    let mut c = ExpertCluster::start_with(&path, None, TIMEOUT);
    for node in ["a", "b"] {
        c.add_node(node, &["--expert-budget".into(), budget.to_string()]);
    }
    let msgs = greedy(
        &c,
        &[("a", 0..l / 2), ("b", l / 2..l)],
        prompt_text,
        steps,
        chunk,
    );
    assert_eq!(tokens_of(&msgs), want, "ring stages streaming: tokens");
    let report = report_of(&msgs);
    let stages = report["stage_stats"].as_array().unwrap();
    assert_eq!(stages.len(), 2, "{report}");
    for st in stages {
        let d = &st["decode"];
        let (lookups, misses) = (
            d["expert_lookups"].as_u64().unwrap(),
            d["expert_misses"].as_u64().unwrap(),
        );
        assert!(lookups > 0, "a stage looked no expert up: {report}");
        assert!(misses > 0 && misses <= lookups, "{report}");
        assert!(d["expert_disk_bytes"].as_u64().unwrap() > 0, "{report}");
        assert_eq!(d["expert_round_trips"].as_u64().unwrap_or(0), 0, "{report}");
    }
    for node in ["a", "b"] {
        let fields = [("event", "expert_cache"), ("node", node)];
        let e = c
            .coordinator
            .wait_event_where(&fields, 1, |e| e["misses"].as_u64() > Some(0));
        assert_eq!(e["budget_bytes"].as_u64(), Some(budget), "{e}");
    }
}

/// The small MoE test model, and a budget of two experts a layer (so a decode misses).
fn small_moe_with_two_experts_a_layer() -> (std::path::PathBuf, u64) {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let budget = 2 * expert_bytes(&g, &cfg) * cfg.n_layer as u64;
    (path, budget)
}

#[test]
fn bench_with_an_expert_budget_reports_the_streaming_figures() {
    let (path, budget) = small_moe_with_two_experts_a_layer();
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

/// `--timeline` writes the last decode run as Chrome trace events: one step a token on the
/// computing thread, one after another; each wait for a read inside a step; reads and their
/// builds on the readers' tracks, a build for every read.
#[test]
fn bench_writes_a_timeline_of_the_streamed_decode() {
    let (path, budget) = small_moe_with_two_experts_a_layer();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("timeline.json");
    let out = std::process::Command::new(common::bin())
        .args(["bench", "-t", "1", "-p", "4", "-n", "12", "-r", "2", "-m"])
        .arg(&path)
        .args(["--expert-budget", &budget.to_string(), "--timeline"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&file).unwrap()).expect("a JSON trace");
    let events = trace["traceEvents"].as_array().unwrap();
    let spans = |cat: &str| -> Vec<&serde_json::Value> {
        events.iter().filter(|e| e["cat"] == cat).collect()
    };
    let t = |e: &serde_json::Value, k: &str| e[k].as_u64().unwrap();
    let steps = spans("step");
    assert_eq!(steps.len(), 12, "one step a token of the last run");
    for w in steps.windows(2) {
        assert!(t(w[0], "ts") + t(w[0], "dur") <= t(w[1], "ts"), "{:?}", w);
    }
    let waits = spans("wait");
    assert!(
        !waits.is_empty(),
        "a cache of 2 experts a layer waits for reads"
    );
    for w in &waits {
        assert_eq!(t(w, "tid"), 0);
        let (a, b) = (t(w, "ts"), t(w, "ts") + t(w, "dur"));
        assert!(
            steps
                .iter()
                .any(|s| t(s, "ts") <= a && b <= t(s, "ts") + t(s, "dur")),
            "a wait outside every step: {w}"
        );
    }
    let (reads, builds) = (spans("read"), spans("build"));
    assert!(!reads.is_empty());
    assert_eq!(reads.len(), builds.len(), "a build for every read");
    assert!(reads
        .iter()
        .all(|r| t(r, "tid") >= 1 && r["args"]["why"].is_string()));
    assert!(events
        .iter()
        .any(|e| e["ph"] == "M" && e["args"]["name"] == "computing thread"));
    assert!(stderr.contains("timeline: "), "{stderr}");
    // Without streaming there is nothing to record: refused, not ignored.
    let refused = std::process::Command::new(common::bin())
        .args(["bench", "-n", "1", "-p", "1", "--timeline"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--expert-budget"));
    // A file it cannot create fails before the benchmark runs, not after.
    let unwritable = std::process::Command::new(common::bin())
        .args(["bench", "-n", "1", "-p", "1", "-m"])
        .arg(&path)
        .args(["--expert-budget", &budget.to_string(), "--timeline"])
        .arg(dir.path().join("missing").join("t.json"))
        .output()
        .unwrap();
    assert!(!unwritable.status.success());
    let stderr = String::from_utf8_lossy(&unwritable.stderr);
    assert!(
        stderr.contains("creating") && stderr.contains("t.json"),
        "{stderr}"
    );
    assert!(unwritable.stdout.is_empty(), "no report: nothing ran");
}
