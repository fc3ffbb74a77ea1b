//! `tessera lab run SCENARIO`: the scenario's machines as lab hosts, real `tessera`
//! processes on them, and every executable plan measured against its prediction.
//!
//! 1. The lab imposes what it can: each link's delay (half the round trip each way),
//!    bandwidth, jitter and loss; each host's CPU share and memory cap.
//! 2. A `tessera coordinator --plan auto` and one `tessera node` per host start; the nodes
//!    measure themselves and the coordinator measures its links to them, so the resource graph
//!    it writes (`plan-auto.json`) holds *measured* figures: what the lab cannot impose (memory
//!    bandwidth, compute) is the host's. That graph, with the scenario's policy, is the one
//!    predictions are made from.
//! 3. The planner's choice on that graph and each runner-up that can execute (single node and
//!    stage rings) run with `tessera run --plan FILE` from the coordinator's host (a warm-up,
//!    then the measured generation), giving decode tokens/s and time to first token.
//! 4. `tessera_plan::calibrate` on the single-node run (the best-measured one when no single
//!    node ran) corrects the graph; every plan's prediction is shown before and after.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_plan::{
    calibrate, predict, HopMeasurement, Measurement, ModelProfile, Plan, PlanOutcome,
    ResourceGraph, StageMeasurement, StrategyKind,
};

use crate::error::{LabError, Result};
use crate::lab::Lab;
use crate::scenario::Scenario;

/// One executed plan.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub strategy: String,
    pub description: String,
    pub chosen: bool,
    pub predicted_tokens_per_s: f64,
    pub measured_tokens_per_s: f64,
    /// (predicted − measured) / measured.
    pub error: f64,
    pub predicted_rank: usize,
    pub measured_rank: usize,
    pub ttft_ms: f64,
    /// After calibration on the reference run.
    pub calibrated_tokens_per_s: f64,
    pub calibrated_error: f64,
}

/// What a scenario run found.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub scenario: String,
    pub rows: Vec<Row>,
    /// Plans the planner ranked that the lab did not execute, and why.
    pub not_executed: Vec<String>,
    /// Which figures were imposed by the lab and which measured.
    pub provenance: Vec<String>,
    pub calibrated_on: String,
}

/// A child whose stdout lines are collected; killed on drop.
struct Proc {
    child: Child,
    rx: mpsc::Receiver<String>,
    name: String,
}

impl Proc {
    fn spawn(name: &str, mut cmd: std::process::Command, log: &Path) -> Result<Self> {
        let log = std::fs::File::create(log)
            .map_err(|e| LabError::io(format!("creating {}", log.display()), e))?;
        let mut child = cmd
            .env("TESSERA_LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| LabError::io(format!("starting {name}"), e))?;
        let out = BufReader::new(child.stdout.take().expect("piped"));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in out.lines().map_while(std::result::Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            rx,
            name: name.into(),
        })
    }

    /// Waits for the child's JSON event `event` (it runs with `TESSERA_LOG_FORMAT=json`).
    fn wait_event(&mut self, event: &str, timeout: Duration) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(l) => {
                    if let Ok(v) = serde_json::from_str::<Value>(&l) {
                        if v["event"] == event {
                            return Ok(v);
                        }
                    }
                }
                Err(_) => {
                    return Err(LabError::Run(format!(
                        "{} reported no {event:?} event within {timeout:?}",
                        self.name
                    )))
                }
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

/// Runs `scenario` with the `tessera` binary at `tessera`, keeping logs under `dir`.
pub fn run(
    scenario: &Scenario,
    tessera: &Path,
    dir: &Path,
    mut progress: impl FnMut(&str),
) -> Result<Report> {
    let gguf = tessera_model::GgufFile::open(&scenario.model)
        .map_err(|e| LabError::Run(format!("{}: {e}", scenario.model.display())))?;
    let profile = tessera_model::ModelProfile::from_gguf(&gguf)
        .map_err(|e| LabError::Run(format!("model profile: {e}")))?;
    let model = tessera_coord::planning::planner_model(&profile, &scenario.name)
        .map_err(|e| LabError::Run(format!("planner model: {e}")))?;
    drop(gguf);
    let spec = scenario.lab_spec()?;
    let lab = Lab::start(&spec)?;
    progress(&format!("lab {} up: {} hosts", lab.id(), lab.len()));
    std::fs::create_dir_all(dir)
        .map_err(|e| LabError::io(format!("creating {}", dir.display()), e))?;

    let n = scenario.graph.nodes.len();
    let listen = format!("{}:7070", lab.addr(0));
    let mut cmd = lab.command(0, tessera)?;
    cmd.args(["coordinator", "--listen", &listen, "--plan", "auto"])
        .args([
            "--nodes-expected",
            &n.to_string(),
            "--max-context",
            "512",
            "--model",
        ])
        .arg(&scenario.model)
        .arg("--data-dir")
        .arg(dir.join("coordinator"));
    let mut coordinator = Proc::spawn("coordinator", cmd, &dir.join("coordinator.log"))?;
    let join = coordinator.wait_event("join_token", Duration::from_secs(60))?["token"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let mut nodes = Vec::new();
    for (i, node) in scenario.graph.nodes.iter().enumerate() {
        let host = i + 1;
        let mut cmd = lab.command(host, tessera)?;
        cmd.args([
            "node",
            "--join",
            &join,
            "--name",
            &node.name,
            "--quick-probe",
        ])
        .args(["--threads", &scenario.threads.to_string()])
        .args(["--listen", &format!("{}:0", lab.addr(host)), "--data-dir"])
        .arg(dir.join(format!("node-{}", node.name)));
        // The measured graph counts a node's budget plus the process's own overhead: give
        // the node the declared budget less that overhead, so both describe the same machine.
        if let Some(b) = node.memory_budget {
            let own =
                b.0.saturating_sub(tessera_plan::RUNTIME_OVERHEAD_RAM.0)
                    .max(1 << 20);
            cmd.args(["--memory-budget", &own.to_string()]);
        }
        let mut p = Proc::spawn(
            &node.name,
            cmd,
            &dir.join(format!("node-{}.log", node.name)),
        )?;
        p.wait_event("joined", Duration::from_secs(120))?;
        nodes.push(p);
    }
    coordinator.wait_event("plan_auto", Duration::from_secs(120))?;
    let doc: Value = std::fs::read(dir.join("coordinator/plan-auto.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| LabError::Run("no readable plan-auto.json".into()))?;
    let mut graph: ResourceGraph = serde_json::from_value(doc["graph"].clone())
        .map_err(|e| LabError::Run(format!("plan-auto.json graph: {e}")))?;
    graph.policy = scenario.graph.policy.clone();
    progress("nodes joined and measured; planning on the measured graph");

    let outcome = tessera_plan::plan(&model, &graph, 1)
        .map_err(|e| LabError::Run(format!("planning: {e}")))?;
    let (plans, not_executed) = executable(&model, &graph, &outcome);
    let mut measured: Vec<(Plan, f64, Value)> = Vec::new();
    for (k, plan) in plans.iter().enumerate() {
        let file = dir.join(format!("plan-{k}.json"));
        std::fs::write(&file, plan_file(plan).to_string())
            .map_err(|e| LabError::io(format!("writing {}", file.display()), e))?;
        let desc = describe(plan);
        progress(&format!("running {desc}"));
        client(
            &lab,
            tessera,
            &join,
            dir,
            &file,
            &scenario.workload.prompt,
            4,
        )?;
        let report = client(
            &lab,
            tessera,
            &join,
            dir,
            &file,
            &scenario.workload.prompt,
            scenario.workload.tokens,
        )?;
        let predicted = predict(&model, &graph, plan)
            .map_err(|e| LabError::Run(format!("predicting {desc}: {e}")))?
            .decode_tokens_per_s;
        measured.push((plan.clone(), predicted, report));
    }
    drop(nodes);
    drop(coordinator);

    // Calibrate on the single-node run (else the first executed plan).
    let reference = measured
        .iter()
        .position(|(p, _, _)| p.strategy == StrategyKind::Single)
        .unwrap_or(0);
    let (calibrated_graph, calibrated_on) = match measured.get(reference) {
        Some((p, _, r)) => {
            let m = measurement(r);
            match calibrate(&model, &graph, p, &m) {
                Ok(c) => (Some(c.graph), describe(p)),
                Err(e) => (None, format!("calibration failed: {e}")),
            }
        }
        None => (None, "nothing ran".into()),
    };
    let rank = |v: &[f64]| -> Vec<usize> {
        v.iter()
            .map(|x| 1 + v.iter().filter(|y| *y > x).count())
            .collect()
    };
    let preds: Vec<f64> = measured.iter().map(|m| m.1).collect();
    let meas: Vec<f64> = measured
        .iter()
        .map(|m| m.2["decode_tokens_per_s"].as_f64().unwrap_or(0.0))
        .collect();
    let (pr, mr) = (rank(&preds), rank(&meas));
    let rows = measured
        .iter()
        .enumerate()
        .map(|(i, (plan, predicted, report))| {
            let m = meas[i];
            let cal = calibrated_graph
                .as_ref()
                .and_then(|g| predict(&model, g, plan).ok())
                .map_or(f64::NAN, |p| p.decode_tokens_per_s);
            Row {
                strategy: format!("{:?}", plan.strategy).to_lowercase(),
                description: describe(plan),
                chosen: plan.hash == outcome.plan.hash,
                predicted_tokens_per_s: *predicted,
                measured_tokens_per_s: m,
                error: (predicted - m) / m,
                predicted_rank: pr[i],
                measured_rank: mr[i],
                ttft_ms: report["time_to_first_token_ms"]
                    .as_f64()
                    .unwrap_or(f64::NAN),
                calibrated_tokens_per_s: cal,
                calibrated_error: (cal - m) / m,
            }
        })
        .collect();
    Ok(Report {
        scenario: scenario.name.clone(),
        rows,
        not_executed,
        provenance: vec![
            "imposed by the lab: link delay, jitter, bandwidth and loss; CPU share and memory cap \
             where [[lab.node]] sets them"
                .into(),
            "measured by the nodes: memory bandwidth, compute, RAM (the host's), and the \
             coordinator's round trips over the switch: predictions use these"
                .into(),
        ],
        calibrated_on,
    })
}

/// The chosen plan and every runner-up the fabric can execute by a plan file (single node,
/// stage ring); the others, with the reason.
fn executable(
    model: &ModelProfile,
    graph: &ResourceGraph,
    outcome: &PlanOutcome,
) -> (Vec<Plan>, Vec<String>) {
    let runs = |s: StrategyKind| matches!(s, StrategyKind::Single | StrategyKind::Stage);
    let mut plans = Vec::new();
    let mut skipped = Vec::new();
    if runs(outcome.plan.strategy) {
        plans.push(outcome.plan.clone());
    } else {
        skipped.push(format!(
            "chosen {} (a {:?} plan: lab run executes single-node and stage plans)",
            outcome.explanation.chosen.description, outcome.plan.strategy
        ));
    }
    for alt in &outcome.explanation.alternatives {
        if !runs(alt.strategy) {
            skipped.push(format!("{} ({:?})", alt.description, alt.strategy));
            continue;
        }
        // The runner-up's own plan: the graph reduced to its nodes and strategy.
        let mut g = graph.clone();
        g.nodes.retain(|n| alt.nodes.contains(&n.name));
        g.policy.strategies = vec![alt.strategy];
        match tessera_plan::plan(model, &g, 1) {
            Ok(o) if !plans.iter().any(|p: &Plan| p.hash == o.plan.hash) => plans.push(o.plan),
            Ok(_) => {}
            Err(e) => skipped.push(format!("{} ({e})", alt.description)),
        }
    }
    (plans, skipped)
}

fn describe(plan: &Plan) -> String {
    plan.assignments()
        .map(|a| match a.layers {
            Some(l) => format!("{}[{}..{})", a.node, l.start, l.end),
            None => a.node.clone(),
        })
        .collect::<Vec<_>>()
        .join(" -> ")
}

fn plan_file(plan: &Plan) -> Value {
    let stages: Vec<Value> = plan
        .assignments()
        .filter_map(|a| {
            let l = a.layers?;
            Some(serde_json::json!({ "node": a.node, "layers": format!("{}..{}", l.start, l.end) }))
        })
        .collect();
    serde_json::json!({ "stages": stages })
}

/// One greedy `tessera run --plan FILE` from the coordinator's host; its report.
fn client(
    lab: &Lab,
    tessera: &Path,
    join: &str,
    dir: &Path,
    plan: &Path,
    prompt: &str,
    n: usize,
) -> Result<Value> {
    let mut cmd = lab.command(0, tessera)?;
    cmd.args(["run", "--coordinator", join, "--json", "--temperature", "0"])
        .args(["-p", prompt, "-n", &n.to_string(), "--plan"])
        .arg(plan)
        .arg("--data-dir")
        .arg(dir.join("client"));
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| LabError::io("running tessera run", e))?;
    if !out.status.success() {
        return Err(LabError::Run(format!(
            "tessera run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|m| m["type"] == "done")
        .ok_or_else(|| LabError::Run("tessera run printed no report".into()))
}

/// The planner's measurement of a run: decode tokens/s, per-hop time (the token time the
/// stages' compute does not explain, over the ring's hops) with wire bytes, per-stage time.
fn measurement(report: &Value) -> Measurement {
    let names: Vec<String> = report["stages"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|s| s["name"].as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default();
    let tps = report["decode_tokens_per_s"].as_f64().unwrap_or(0.0);
    let per_stage: Vec<(String, f64)> = report["stage_stats"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| {
            let d = &s["decode"];
            let t = d["compute_ns"].as_f64()? / d["steps"].as_f64()?.max(1.0) / 1e9;
            Some((names.get(s["stage"].as_u64()? as usize)?.clone(), t))
        })
        .collect();
    let compute: f64 = per_stage.iter().map(|s| s.1).sum();
    let hops = if names.len() > 1 && tps > 0.0 {
        let lat = ((1.0 / tps - compute) / names.len() as f64).max(0.0);
        report["boundaries"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|b| {
                Some(HopMeasurement {
                    from: names.get(b["from"].as_u64()? as usize)?.clone(),
                    to: names.get(b["to"].as_u64()? as usize)?.clone(),
                    latency_s: lat,
                    wire_bytes: b["decode_bytes_per_token"].as_f64()?,
                })
            })
            .collect()
    } else {
        Vec::new()
    };
    Measurement {
        taken_at_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        decode_tokens_per_s: tps,
        hops,
        stages: per_stage
            .into_iter()
            .map(|(node, t)| StageMeasurement {
                node,
                seconds_per_token: t,
            })
            .collect(),
    }
}

/// The report as a table.
pub fn table(r: &Report) -> String {
    let mut s = format!(
        "scenario {}\n{:<8} {:<44} {:>10} {:>10} {:>7} {:>5} {:>5} {:>9} {:>11} {:>7}\n",
        r.scenario,
        "strategy",
        "plan",
        "predicted",
        "measured",
        "error",
        "p.rk",
        "m.rk",
        "ttft ms",
        "calibrated",
        "error"
    );
    for row in &r.rows {
        s.push_str(&format!(
            "{:<8} {:<44} {:>10.1} {:>10.1} {:>6.0}% {:>5} {:>5} {:>9.1} {:>11.1} {:>6.0}%{}\n",
            row.strategy,
            row.description,
            row.predicted_tokens_per_s,
            row.measured_tokens_per_s,
            row.error * 100.0,
            row.predicted_rank,
            row.measured_rank,
            row.ttft_ms,
            row.calibrated_tokens_per_s,
            row.calibrated_error * 100.0,
            if row.chosen {
                "  (planner's choice)"
            } else {
                ""
            }
        ));
    }
    s.push_str("tokens/s: decode at batch 1; calibrated on ");
    s.push_str(&r.calibrated_on);
    s.push('\n');
    for n in &r.not_executed {
        s.push_str(&format!("not executed: {n}\n"));
    }
    for p in &r.provenance {
        s.push_str(&format!("{p}\n"));
    }
    s
}

/// Where `lab run` keeps its logs by default.
pub fn default_dir(scenario: &Scenario) -> PathBuf {
    std::env::temp_dir().join(format!(
        "tessera-lab-{}-{}",
        scenario.name,
        std::process::id()
    ))
}
