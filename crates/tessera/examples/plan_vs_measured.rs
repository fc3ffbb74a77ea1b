//! Predicted vs measured decode tokens/s on a loopback cluster (the planner's calibration
//! evidence). Not a test: it measures wall-clock speed, so run it on a quiet machine.
//!
//! ```text
//! cargo build --release -p tessera
//! cargo run --release -p tessera --example plan_vs_measured -- \
//!     [--bin target/release/tessera] [--tokens 64] [--threads 2] [--json OUT.json] MODEL.gguf...
//! ```
//!
//! For each model it starts a `tessera coordinator --plan auto --nodes-expected 3` and three
//! `tessera node` processes on 127.0.0.1, one after another (so their inventory probes do not
//! overlap). The coordinator plans from their measured inventories and links, prints the
//! explanation and writes the resource graph it planned on to `plan-auto.json`. This example
//! then asks the planner (on that same measured graph) for the best ring of 1, 2 and 3 stages —
//! the 2- and 3-stage rings by lowering the graph's budgets until fewer nodes cannot hold the
//! model; the nodes themselves run without budgets — runs each with `tessera run --plan FILE
//! --temperature 0` (a warm-up run, then the measured one), and prints the predicted decode
//! tokens/s (at the run's mean decode position), the measured figure and their ratio. Then it
//! calibrates the graph from each run's measurement (`tessera_plan::calibrate`: per-hop latency
//! and per-stage time) and shows the corrected prediction, and — the harder test — the
//! prediction of every ring from the graph calibrated on the single-node run alone.
//!
//! All node processes share the host: at batch 1 a ring runs one stage at a time, so they do
//! not contend for compute or memory bandwidth while decoding (the coordinator and client do
//! a little work per token).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;
use tessera_plan::{
    calibrate, predict, Bytes, ModelProfile, Plan, PlanOutcome, ResourceGraph, StrategyKind,
    RUNTIME_OVERHEAD_RAM,
};

const PROMPT: &str = "Once upon a time, in a small village by the sea, there lived";
const TIMEOUT: Duration = Duration::from_secs(600);

struct Args {
    bin: PathBuf,
    tokens: usize,
    threads: usize,
    json: Option<PathBuf>,
    models: Vec<PathBuf>,
}

fn args() -> anyhow::Result<Args> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut a = Args {
        bin: root.join("target/release/tessera"),
        tokens: 64,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        json: None,
        models: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--bin" => a.bin = it.next().context("--bin PATH")?.into(),
            "--tokens" => a.tokens = it.next().context("--tokens N")?.parse()?,
            "--threads" => a.threads = it.next().context("--threads N")?.parse()?,
            "--json" => a.json = Some(it.next().context("--json PATH")?.into()),
            m => a.models.push(m.into()),
        }
    }
    if a.models.is_empty() {
        a.models
            .push(root.join("models/test/small-qwen3-Q8_0.gguf"));
        let bench = PathBuf::from("/work/benchmodels/bench-qwen3-dense-q8_0.gguf");
        if bench.is_file() {
            a.models.push(bench);
        }
    }
    Ok(a)
}

/// A child process whose stdout lines are collected; killed on drop.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    name: String,
}

impl Proc {
    fn spawn(bin: &Path, name: &str, args: &[String], log: &Path) -> anyhow::Result<Self> {
        let mut child = Command::new(bin)
            .args(args)
            .env("TESSERA_LOG_FORMAT", "json")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .with_context(|| format!("starting {name} ({})", bin.display()))?;
        let out = BufReader::new(child.stdout.take().context("stdout")?);
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            lines,
            seen: Vec::new(),
            name: name.to_string(),
        })
    }

    /// Waits for the child's JSON event `event` (children run with `TESSERA_LOG_FORMAT=json`).
    fn wait_event(&mut self, event: &str) -> anyhow::Result<Value> {
        let deadline = Instant::now() + TIMEOUT;
        let of = |l: &str| {
            serde_json::from_str::<Value>(l)
                .ok()
                .filter(|v| v["event"] == event)
        };
        if let Some(v) = self.seen.iter().find_map(|l| of(l)) {
            return Ok(v);
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(l) = self.lines.recv_timeout(left) else {
                bail!("{}: no {event:?} event; saw {:?}", self.name, self.seen);
            };
            let hit = of(&l);
            self.seen.push(l);
            if let Some(v) = hit {
                return Ok(v);
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

/// The best ring of exactly `k` of the graph's nodes: budgets lowered (for planning only) until
/// fewer nodes cannot hold the model.
fn ring_of(model: &ModelProfile, graph: &ResourceGraph, k: usize) -> anyhow::Result<Plan> {
    let mut g = graph.clone();
    g.nodes.truncate(k);
    g.policy.strategies = vec![StrategyKind::Single, StrategyKind::Stage];
    g.policy.objective = tessera_plan::Objective::Latency;
    if k == 1 {
        return Ok(tessera_plan::plan(model, &g, 1)?.plan);
    }
    // What one node needs for the whole model, beyond the process itself.
    let whole = tessera_plan::plan(model, &g, 1)?.plan;
    let need = whole.cells[0].assignments[0].memory.total.0 - RUNTIME_OVERHEAD_RAM.0;
    for pct in (5..=95).rev().step_by(5) {
        let share = need as f64 * pct as f64 / 100.0;
        for n in &mut g.nodes {
            n.memory_budget = Some(Bytes(share as u64) + RUNTIME_OVERHEAD_RAM);
        }
        if let Ok(o) = tessera_plan::plan(model, &g, 1) {
            if o.plan.nodes().len() == k {
                return Ok(o.plan);
            }
        }
    }
    bail!("no budget gives a ring of exactly {k} nodes")
}

fn plan_file(plan: &Plan) -> Value {
    let stages: Vec<Value> = plan
        .assignments()
        .map(|a| {
            let l = a.layers.expect("whole layers");
            serde_json::json!({ "node": a.node, "layers": format!("{}..{}", l.start, l.end) })
        })
        .collect();
    serde_json::json!({ "stages": stages })
}

/// Runs one greedy generation; the report.
fn run_once(
    bin: &Path,
    join: &str,
    dir: &Path,
    plan: &Path,
    n: usize,
) -> anyhow::Result<tessera_proto::RunReport> {
    let out = Command::new(bin)
        .args(["run", "--coordinator", join, "--data-dir"])
        .arg(dir.join("client"))
        .arg("--plan")
        .arg(plan)
        .args([
            "--json",
            "-p",
            PROMPT,
            "-n",
            &n.to_string(),
            "--temperature",
            "0",
        ])
        .output()?;
    if !out.status.success() {
        bail!("run failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| match serde_json::from_str(l) {
            Ok(tessera_proto::CoordToClient::Done(r)) => Some(*r),
            _ => None,
        })
        .context("no report")
}

struct Row {
    model: String,
    ring: String,
    predicted: f64,
    measured: f64,
    calibrated: f64,
    from_single: f64,
    stage_ms: Vec<(String, f64, f64)>,
    hop_us: Option<f64>,
    derived_hop_us: Option<f64>,
    predicted_hop_us: f64,
}

fn bench_model(a: &Args, path: &Path, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let gguf = tessera_model::GgufFile::open(path)?;
    let profile = tessera_model::ModelProfile::from_gguf(&gguf)?;
    let model = tessera_placement::planning::planner_model(
        &profile,
        Default::default(),
        &path.display().to_string(),
    )?;
    drop(gguf);
    let ctx = 512;
    let mut coord = Proc::spawn(
        &a.bin,
        "coordinator",
        &[
            "coordinator".into(),
            "--model".into(),
            path.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            d.join("coord").display().to_string(),
            "--max-context".into(),
            ctx.to_string(),
            "--plan".into(),
            "auto".into(),
            "--nodes-expected".into(),
            "3".into(),
        ],
        &d.join("coord.log"),
    )?;
    let join = coord.wait_event("join_token")?["token"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let mut nodes = Vec::new();
    for name in ["n1", "n2", "n3"] {
        let args: Vec<String> = [
            "node",
            "--data-dir",
            &d.join(name).display().to_string(),
            "--listen",
            "127.0.0.1:0",
            "--name",
            name,
            "--threads",
            &a.threads.to_string(),
            "--model",
            &path.display().to_string(),
            "--join",
            &join,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut p = Proc::spawn(&a.bin, name, &args, &d.join(format!("{name}.log")))?;
        p.wait_event("joined")?;
        nodes.push(p);
    }
    let auto = coord.wait_event("plan_auto")?["ring"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    println!(
        "\n== {} ==\ncoordinator --plan auto chose: {auto}",
        model.name
    );
    let doc: Value = serde_json::from_slice(&std::fs::read(d.join("coord/plan-auto.json"))?)?;
    let graph: ResourceGraph = serde_json::from_value(doc["graph"].clone())?;
    let outcome: PlanOutcome = serde_json::from_value(doc["outcome"].clone())?;
    println!(
        "auto plan: {} predicted {:.2} tok/s",
        outcome.explanation.chosen.description, outcome.plan.predicted.decode_tokens_per_s
    );
    for e in graph.evidence.iter().filter(|e| e.subject == "node n1") {
        println!("  n1 {}: {}", e.quantity, e.value);
    }
    if let Some(l) = graph.links.first() {
        println!(
            "  link {}-{}: rtt {:.1} µs, {:.0} MB/s",
            l.a,
            l.b,
            l.spec.rtt_s * 1e6,
            l.spec.bandwidth.0 / 1e6
        );
    }
    let prompt_tokens = {
        let g = tessera_model::GgufFile::open(path)?;
        tessera_model::Tokenizer::from_gguf(&g)?
            .encode(PROMPT, true)
            .len()
    };
    let mut single_graph: Option<ResourceGraph> = None;
    for k in 1..=3 {
        let mut plan = match ring_of(&model, &graph, k) {
            Ok(p) => p,
            Err(e) => {
                println!("ring of {k}: {e}");
                continue;
            }
        };
        // Predict at the run's mean decode position.
        plan.policy.prompt_tokens = (prompt_tokens + a.tokens / 2) as u64;
        let predicted = predict(&model, &graph, &plan)?;
        let file = d.join(format!("ring{k}.json"));
        std::fs::write(&file, serde_json::to_vec(&plan_file(&plan))?)?;
        run_once(&a.bin, &join, d, &file, a.tokens.min(8))?; // load the epoch, warm up
        let report = run_once(&a.bin, &join, d, &file, a.tokens)?;
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        let m = tessera_lab::run::measurement(&report, at);
        let cal = calibrate(&model, &graph, &plan, &m)?;
        if k == 1 {
            single_graph = Some(cal.graph.clone());
        }
        let from_single = match &single_graph {
            Some(g) => predict(&model, g, &plan)?.decode_tokens_per_s,
            None => f64::NAN,
        };
        let ring = plan
            .assignments()
            .map(|x| {
                format!(
                    "{}{}",
                    x.node,
                    x.layers.map_or(String::new(), |l| l.to_string())
                )
            })
            .collect::<Vec<_>>()
            .join(" -> ");
        let stage_ms = m
            .stages
            .iter()
            .map(|s| {
                let p = predicted
                    .stages
                    .iter()
                    .filter(|x| x.node == s.node)
                    .map(|x| x.terms.total_s)
                    .sum::<f64>();
                (s.node.clone(), p * 1e3, s.seconds_per_token * 1e3)
            })
            .collect();
        let predicted_hop_us = predicted
            .hops
            .first()
            .map_or(0.0, |h| h.terms.total_s * 1e6);
        let row = Row {
            model: model.name.clone(),
            ring,
            predicted: predicted.decode_tokens_per_s,
            measured: m.decode_tokens_per_s,
            calibrated: cal.predicted_after,
            from_single,
            stage_ms,
            hop_us: report.hop_latency_us,
            derived_hop_us: m.hops.first().map(|h| h.latency_s * 1e6),
            predicted_hop_us,
        };
        print_row(&row);
        rows.push(row);
    }
    drop(nodes);
    Ok(())
}

fn print_row(r: &Row) {
    println!(
        "{:<40} predicted {:>9.2} tok/s  measured {:>9.2}  ratio {:>5.2}  calibrated {:>9.2}  \
         from 1-node calibration {:>9.2} ({:+.0}%)",
        r.ring,
        r.predicted,
        r.measured,
        r.predicted / r.measured,
        r.calibrated,
        r.from_single,
        (r.from_single / r.measured - 1.0) * 100.0
    );
    for (n, p, m) in &r.stage_ms {
        println!("    stage {n}: predicted {p:.3} ms/token, measured compute {m:.3}");
    }
    if let Some(h) = r.derived_hop_us {
        println!(
            "    hop: predicted {:.1} µs, measured {h:.1} µs per hop per token (token time less \
             stage compute, over hops; the report's hop_latency_us {:.1})",
            r.predicted_hop_us,
            r.hop_us.unwrap_or(f64::NAN)
        );
    }
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    anyhow::ensure!(
        a.bin.is_file(),
        "{} not found (cargo build --release -p tessera, or --bin)",
        a.bin.display()
    );
    println!(
        "host: {} cores; nodes: 3 processes x {} threads on 127.0.0.1; {} tokens per run",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        a.threads,
        a.tokens
    );
    let mut rows = Vec::new();
    for m in &a.models {
        bench_model(&a, m, &mut rows).with_context(|| format!("model {}", m.display()))?;
    }
    println!("\n| model | ring | predicted tok/s | measured tok/s | predicted/measured | calibrated | from 1-node calibration |");
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} ({:+.0}%) |",
            r.model,
            r.ring,
            r.predicted,
            r.measured,
            r.predicted / r.measured,
            r.calibrated,
            r.from_single,
            (r.from_single / r.measured - 1.0) * 100.0
        );
    }
    if let Some(p) = &a.json {
        let v: Vec<Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "model": r.model, "ring": r.ring, "predicted": r.predicted,
                    "measured": r.measured, "calibrated": r.calibrated,
                    "from_single_calibration": r.from_single, "hop_latency_us": r.hop_us,
                })
            })
            .collect();
        std::fs::write(p, serde_json::to_vec_pretty(&v)?)?;
    }
    Ok(())
}
