//! Expert streaming on a node of an expert split, with real processes on 127.0.0.1: a `tessera
//! coordinator --experts ...` and two `tessera node` agents, the expert-only one given an
//! `--expert-budget` of about two experts, so it streams its experts from disk. Greedy output
//! must equal one process, and the coordinator must hear the node's expert-cache misses.

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
    coordinator: Proc,
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
            coordinator,
            join,
            nodes: Vec::new(),
        }
    }

    fn add_node(&mut self, name: &str, extra: &[String]) {
        let mut args: Vec<String> = vec![
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
        args.extend_from_slice(extra);
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

/// Bytes of one expert of layer 0 in the GGUF (gate, up and down).
fn expert_bytes(g: &GgufFile, n_expert: usize) -> u64 {
    ["gate", "up", "down"]
        .iter()
        .map(|w| {
            g.tensor(&format!("blk.0.ffn_{w}_exps.weight"))
                .unwrap_or_else(|| panic!("no ffn_{w}_exps"))
                .n_bytes
        })
        .sum::<u64>()
        / n_expert as u64
}

#[test]
fn streamed_experts_on_a_node_match_one_process_small() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let (l, n) = (cfg.n_layer, cfg.n_expert);
    assert!(n >= 4);
    let budget = 2 * expert_bytes(&g, n);
    let prompt_text = "Once upon a time, in a quiet village";
    let prompt = Tokenizer::from_gguf(&g).unwrap().encode(prompt_text, true);
    let (steps, chunk) = (10, 4);
    let want = reference_tokens(&path, &prompt, steps, chunk);

    let a: Vec<usize> = (0..n / 2).collect();
    let b: Vec<usize> = (n / 2..n).collect();
    let mut c = Cluster::start(&path, &format!("{}@a,{}@b", ids(&a), ids(&b)));
    c.add_node("a", &[]);
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

    // The node's heartbeats carry its expert-cache counters to the coordinator; wait for
    // one reporting misses (it read experts from disk: the budget holds about two).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let line = c.coordinator.wait_for("expert cache: b ");
        let misses: u64 = line
            .split_whitespace()
            .skip_while(|w| *w != "misses")
            .nth(1)
            .and_then(|m| m.parse().ok())
            .unwrap_or_else(|| panic!("malformed line {line:?}"));
        if misses > 0 {
            eprintln!("coordinator saw: expert cache: b {line}");
            break;
        }
        // Look at later lines only.
        c.coordinator
            .seen
            .retain(|s| !s.starts_with("expert cache: b "));
        assert!(Instant::now() < deadline, "no misses reported: {line}");
    }
}
