//! Mixture-of-experts across machines, with real processes on 127.0.0.1: a `tessera
//! coordinator --experts ...`, `tessera node` agents (ring stages and expert-only nodes) and
//! `tessera run` clients. The experts of every MoE layer are split across 2 and 3 node
//! processes, alone and combined with a 2-stage split; greedy output must equal one process
//! (`Generator`, what `tessera generate` runs) token for token, and the home stages must have
//! sent at most one expert request per contacted node per MoE layer per step.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_engine::{Generator, Model, SamplingParams};
use tessera_model::{GgufFile, ModelConfig, Tokenizer};

const TIMEOUT: Duration = Duration::from_secs(120);

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_tessera")
}

fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name)
}

/// A child process whose stdout lines are collected; killed on drop.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    name: String,
}

impl Proc {
    fn spawn(name: &str, args: &[String]) -> Self {
        let mut child = Command::new(bin())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
            name: name.to_string(),
        }
    }

    /// Waits for a stdout line starting with `prefix`; returns the rest of it.
    fn wait_for(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + TIMEOUT;
        if let Some(l) = self.seen.iter().find(|l| l.starts_with(prefix)) {
            return l[prefix.len()..].to_string();
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    let hit = l.starts_with(prefix).then(|| l[prefix.len()..].to_string());
                    self.seen.push(l);
                    if let Some(h) = hit {
                        return h;
                    }
                }
                Err(_) => panic!(
                    "{}: no line starting with {prefix:?}; saw {:?}",
                    self.name, self.seen
                ),
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A coordinator with an expert split, and its nodes.
struct Cluster {
    dir: tempfile::TempDir,
    _coordinator: Proc,
    join: String,
    nodes: Vec<Proc>,
}

impl Cluster {
    fn start(model_path: &Path, experts: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut coordinator = Proc::spawn(
            "coordinator",
            &[
                "coordinator".into(),
                "--model".into(),
                model_path.display().to_string(),
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--data-dir".into(),
                dir.path().join("coord").display().to_string(),
                "--experts".into(),
                experts.into(),
            ],
        );
        let join = coordinator.wait_for("join token: ");
        Self {
            dir,
            _coordinator: coordinator,
            join,
            nodes: Vec::new(),
        }
    }

    fn add_node(&mut self, name: &str) {
        let args: Vec<String> = vec![
            "node".into(),
            "--data-dir".into(),
            self.dir.path().join(name).display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--name".into(),
            name.into(),
            "--threads".into(),
            "1".into(),
            "--quick-probe".into(),
            "--join".into(),
            self.join.clone(),
        ];
        let mut p = Proc::spawn(name, &args);
        p.wait_for("joined coordinator ");
        self.nodes.push(p);
    }

    /// `tessera run --json` on a plan pinning ring stages to nodes; its messages.
    fn run_json(&self, stages: &[(&str, std::ops::Range<usize>)], extra: &[&str]) -> Vec<Value> {
        let plan = self.dir.path().join("plan.json");
        let stages: Vec<Value> = stages
            .iter()
            .map(|(n, l)| serde_json::json!({"node": n, "layers": format!("{}..{}", l.start, l.end)}))
            .collect();
        std::fs::write(&plan, serde_json::json!({ "stages": stages }).to_string()).unwrap();
        let mut cmd = Command::new(bin());
        cmd.args(["run", "--coordinator", &self.join, "--data-dir"])
            .arg(self.dir.path().join("client"))
            .arg("--plan")
            .arg(&plan)
            .args(["--json"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = run_with_timeout(cmd);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

fn run_with_timeout(mut cmd: Command) -> Output {
    let mut child = cmd.spawn().expect("spawning");
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("timed out: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tokens_of(msgs: &[Value]) -> Vec<u32> {
    msgs.iter()
        .filter(|m| m["type"] == "token" && m["token"].as_u64() != Some(u64::from(u32::MAX)))
        .map(|m| m["token"].as_u64().unwrap() as u32)
        .collect()
}

fn report_of(msgs: &[Value]) -> &Value {
    msgs.iter()
        .find(|m| m["type"] == "done")
        .unwrap_or_else(|| panic!("no report in {msgs:?}"))
}

/// Greedy tokens of one process, as `tessera generate` computes them.
fn reference_tokens(path: &Path, prompt: &[u32], n: usize, chunk: usize) -> Vec<u32> {
    let g = GgufFile::open(path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let mut eog: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&t| tok.is_end_of_generation(t))
        .collect();
    eog.extend(tok.bos_id());
    let m = Model::load_full(&g, 1).unwrap();
    let mut gen = Generator::new(&m, SamplingParams::greedy(), prompt.len() + n);
    gen.prefill_chunk = chunk;
    let mut out = Vec::new();
    gen.generate(prompt, n, &eog, &mut |t| {
        out.push(t);
        true
    })
    .unwrap();
    out
}

/// `ids` as an `--experts` group (`a+b+c`).
fn ids(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join("+")
}

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
    let mut c = Cluster::start(&path, experts);
    for name in nodes {
        c.add_node(name);
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
        ],
    );
    let got = tokens_of(&msgs);
    assert_eq!(got, want, "{model_name} experts {experts}: tokens");
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
