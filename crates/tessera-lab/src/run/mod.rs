//! `tessera lab run SCENARIO`: the scenario's machines as lab hosts, real `tessera`
//! processes on them, and every plan the planner ranks measured against its prediction.
//!
//! 1. The lab imposes what it can: each link's delay (half the round trip each way),
//!    bandwidth, jitter and loss; each host's CPU share and memory cap. Its hosts are one
//!    machine, so before any starts it measures what that machine's cores compute at once
//!    ([`machine`]), which the planner divides among the nodes busy together.
//! 2. A `tessera coordinator --plan auto` and one `tessera node` per host start; the nodes
//!    measure themselves and the coordinator measures its links to them, so the resource graph
//!    it writes (`plan-auto.json`) holds *measured* figures: what the lab cannot impose (memory
//!    bandwidth, compute) is the host's. That graph, with the scenario's policy, is the one
//!    predictions are made from.
//! 3. The planner's choice on that graph and each runner-up ([`plans`]) run where the fabric
//!    can execute them: single nodes and stage rings named by each `tessera run --plan FILE`
//!    client, an expert split by a coordinator started with `--plan FILE --experts SPEC`
//!    ([`session`]). Each gives decode tokens/s and time to first token (one request), the
//!    aggregate tokens/s of the workload's concurrency of requests at once, and the bytes the
//!    switch carried between the nodes per decoded token. The others are listed with why not.
//! 4. What ran corrects the graph ([`calibrate`]: every single-node run, else the first that
//!    ran; then nodes no reference covered, the runtime's costs per token and per hop, batches
//!    at the workload's concurrency). Every plan's prediction is shown before and after, and
//!    the calibrated graph can be saved as a scenario that `tessera plan --nodes` and `tessera
//!    lab run` read.

pub mod baseline;
mod calibrate;
pub use calibrate::measurement;
pub mod cells;
pub mod disk_rates;
pub mod hop;
pub mod host_decode;
pub mod machine;
mod measure;
pub mod pipeline;
pub mod plans;
pub mod report;
mod ring;
pub mod scaling;
mod session;
mod spec_price;
#[cfg(test)]
mod test_reports;

use std::path::{Path, PathBuf};
use std::time::Duration;

use tessera_plan::{predict, AutoPlanRecord, Plan, ResourceGraph, StrategyKind};

use crate::error::{LabError, Result};
use crate::lab::Lab;
use crate::scenario::Scenario;
pub use plans::{describe, Force};
pub use report::{
    table, Figures, LinkReport, Report, Row, Speculation, SplitOwners, StageStreaming, TextCheck,
};
use session::{Mode, Session};

/// Tokens of the warm-up request, and of the short request whose traffic is subtracted from
/// the measured one's (so the bytes counted per token are the decode's, not the prefill's).
const SHORT: usize = 4;

/// Measured requests per plan: the median's figures are reported (this machine's other work
/// makes single requests of a tiny model noisy).
const REPEATS: usize = 3;

/// What `tessera lab run` may be asked besides the scenario.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub force: Force,
    /// Save the calibrated graph here, as a scenario (the planner's part calibrated, the
    /// lab's part as given).
    pub save_calibrated: Option<PathBuf>,
    /// Give the coordinator's `--plan auto` this calibrated graph (a saved scenario): the
    /// predictions are then made from its rates.
    pub calibrated: Option<PathBuf>,
    /// Measure llama.cpp's decode with this `llama-bench` on the best single host, under its
    /// caps, after the plans ([`baseline`]).
    pub llama_bench: Option<PathBuf>,
}

/// One executed plan's measurement: its figures and the single request's report.
struct Measured {
    figures: Figures,
    report: tessera_proto::RunReport,
    /// The text of each measured request alone.
    texts: Vec<String>,
    /// The same requests speculating, where the workload asks.
    speculating: Option<std::result::Result<measure::Speculating, String>>,
}

/// Runs `scenario` with the `tessera` binary at `tessera`, keeping logs under `dir`.
pub fn run(
    scenario: &Scenario,
    tessera: &Path,
    dir: &Path,
    opts: &Options,
    mut progress: impl FnMut(&str),
) -> Result<Report> {
    let _copies = session::NodeModelCopies::removed_at_end(dir);
    let gguf = tessera_model::GgufFile::open(&scenario.model)
        .map_err(|e| LabError::model(&scenario.model, e))?;
    let profile = tessera_model::ModelProfile::from_gguf(&gguf)
        .map_err(|e| LabError::model(&scenario.model, format!("its profile: {e}")))?;
    let model =
        tessera_placement::planning::planner_model(&profile, Default::default(), &scenario.name)
            .map_err(|e| {
                LabError::model(&scenario.model, format!("the planner's view of it: {e}"))
            })?;
    drop(gguf);
    // Measured before any host starts, on a quiet machine; with one host too, whose decode
    // sets its node's rates ([`host_decode`]).
    let parallelism = if scenario.graph.machines.is_empty() {
        progress("measuring what this machine's cores compute at once");
        Some(measure_machine(tessera, scenario)?)
    } else {
        None
    };
    // Every plan's text is compared with what one process generates (greedy).
    progress("one process: the workload's text, for every plan's to equal");
    let reference = one_process(
        tessera,
        &scenario.model,
        scenario.threads,
        &scenario.workload.prompt,
        scenario.workload.tokens,
    )?;
    std::fs::create_dir_all(dir)
        .map_err(|e| LabError::io(format!("creating {}", dir.display()), e))?;
    let mut spec = scenario.lab_spec()?;
    // The nodes' data directories (their copies of the model among them) are on their disks.
    spec.disk_dirs.push(dir.to_path_buf());
    let lab = Lab::start(&spec)?;
    progress(&format!("lab {} up: {} hosts", lab.id(), lab.len()));
    // Before any node starts, so that nothing else reads the disk.
    let disk_rates = disk_rates::measure(&lab, scenario)?;
    for r in &disk_rates {
        progress(&format!(
            "{}'s disk under its {} cap: {:.0} MB/s",
            r.node,
            r.profile,
            r.bytes_per_s / 1e6
        ));
    }

    let auto = Mode::Auto(opts.calibrated.clone());
    let mut session = Session::start(&lab, tessera, scenario, dir, &auto)?;
    session
        .coordinator
        .wait_event("plan_auto", Duration::from_secs(120))?;
    let AutoPlanRecord {
        mut graph,
        outcome: auto,
    } = read_plan_auto(&session::coordinator_dir(dir).join("plan-auto.json"))?;
    graph.policy = scenario.graph.policy.clone();
    // A calibrated graph's rates are what the hosts showed, quota included.
    let quotas = match &opts.calibrated {
        None => {
            // The software cost of a hop is the scenario's (its `hop_overhead_us`, else the
            // planner's default): the coordinator cannot measure it before a ring runs.
            graph.hop_overhead_s = scenario.graph.hop_overhead_s;
            // The machine's own decode of the model (unthrottled) before the quotas scale it.
            let decode = parallelism
                .map(|p| host_decode::apply(&model, &mut graph, p.alone_tok_s))
                .unwrap_or_default();
            [decode, apply_cpu_quotas(scenario, &mut graph)].concat()
        }
        Some(c) => vec![format!(
            "the coordinator planned with the rates of the calibrated graph {} in place of the \
             measured ones",
            c.display()
        )],
    };
    let quotas = [
        quotas,
        apply_shared_machine(scenario, parallelism, &mut graph),
        disk_rates::apply(&mut graph, &disk_rates),
    ]
    .concat();
    // Where the coordinator's own choice placed experts (an expert split, or one node streaming
    // its experts, run as a split homed on it that owns every expert), it placed them for every
    // run: stage runs need a coordinator without them (a ring run under one board's placement
    // sent every stage's experts to that board, over the WAN's 20 ms links).
    let mut experts_applied = tessera_placement::planning::to_placement(
        &auto.plan,
        model.n_layers(),
        model.n_expert as usize,
    )
    .is_ok_and(|p| p.experts.is_some());
    progress("nodes joined and measured; planning on the measured graph");

    let outcome = tessera_plan::plan(&model, &graph, 1)?;
    let candidates = plans::candidates(&model, &profile, &graph, &outcome, &opts.force)
        .map_err(LabError::Candidates)?;
    let concurrency = graph.policy.concurrency.max(1) as usize;
    let mut measured: Vec<Option<std::result::Result<Measured, String>>> =
        candidates.iter().map(|_| None).collect();
    // The plans a client names (single nodes, rings) in one session, measured in interleaved
    // rounds so the machine's drift falls on all alike; then each expert split, each plan whose
    // nodes stream experts (given the budgets it placed) and each set of cells (replicas) on a
    // coordinator started with it, whose requests it places itself.
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    for (k, c) in candidates.iter().enumerate() {
        match &c.placement {
            Ok(p) if p.experts.is_some() || c.plan.cells.len() > 1 || !c.streams.is_empty() => {
                groups.push(vec![k])
            }
            Ok(_) => groups[0].push(k),
            Err(_) => {}
        }
    }
    let mut before_cells = None;
    for group in groups.into_iter().filter(|g| !g.is_empty()) {
        let mut files = Vec::new();
        for &k in &group {
            let file = dir.join(format!("plan-{k}.json"));
            let ring = &candidates[k].placement.as_ref().expect("executable").ring;
            let text = serde_json::to_string(ring).map_err(LabError::PlanFile)?;
            std::fs::write(&file, text)
                .map_err(|e| LabError::io(format!("writing {}", file.display()), e))?;
            files.push(file);
        }
        let first = &candidates[group[0]];
        let experts = first
            .placement
            .as_ref()
            .ok()
            .and_then(|p| p.experts.as_ref())
            .map(ToString::to_string);
        if experts.is_some() || first.plan.cells.len() > 1 || !first.streams.is_empty() {
            drop(session);
            // Cells busy together divide the machine, and what it delivers drifts over the
            // minutes a run takes: measured again just before the cells run, for their
            // calibrated prediction.
            if first.plan.cells.len() > 1 && parallelism.is_some() {
                progress("measuring what this machine's cores compute at once, again");
                before_cells = Some(measure_machine(tessera, scenario)?);
            }
            progress(&format!(
                "restarting the coordinator with {}",
                describe(&first.plan)
            ));
            let mode = Mode::Fixed {
                plan: files[0].clone(),
                experts,
                expert_budgets: first.streams.clone(),
            };
            session = Session::start(&lab, tessera, scenario, dir, &mode)?;
            experts_applied = true;
        } else if experts_applied {
            drop(session);
            progress("restarting the coordinator without an expert split");
            session = Session::start(&lab, tessera, scenario, dir, &Mode::ByClient)?;
            experts_applied = false;
        }
        let names: Vec<String> = group
            .iter()
            .map(|&k| describe(&candidates[k].plan))
            .collect();
        progress(&format!("measuring {}", names.join("; ")));
        let results =
            measure::measure(&session, &lab, scenario, &files, concurrency, &mut progress);
        for (k, r) in group.into_iter().zip(results) {
            measured[k] = Some(r);
        }
    }
    drop(session);
    let baseline = opts.llama_bench.as_deref().and_then(|bench| {
        // Where no single host ran the model (a dense model larger than any: Tessera streams
        // only experts), the first node's host: what a user with one of these machines runs.
        let host = best_single_host(&candidates, &measured)
            .or_else(|| scenario.graph.nodes.first().map(|n| n.name.clone()))?;
        let i = lab.host(&host).ok()?;
        progress(&format!(
            "llama.cpp on {host} under its caps (this can take minutes)"
        ));
        Some(baseline::llama_cpp(
            &lab,
            i,
            bench,
            &scenario.model,
            scenario.threads,
            scenario.workload.tokens,
        ))
    });

    let runs = calibrate::Runs::new(&model, &candidates, &measured);
    let machine_again = before_cells.map(|p| (p, machine_cores(p, scenario)));
    let calibrate::Calibration {
        graph: calibrated_graph,
        corrections,
        on,
        ring_hop,
    } = calibrate::on_runs(&runs, &graph, concurrency, machine_again);
    // Speculating requests are priced after one more correction, from the one-node plan's.
    let mut corrections = corrections;
    let pricing = spec_price::calibrate(
        &model,
        calibrated_graph.as_ref().unwrap_or(&graph),
        &candidates,
        &measured,
    );
    if let Some(c) = pricing.as_ref().and_then(|p| p.correction.as_ref()) {
        corrections.push(calibrate::line(c));
    }
    let calibrated_on = if on.is_empty() {
        "nothing (no plan ran)".to_string()
    } else {
        on.join(", ")
    };
    let saved = match (&calibrated_graph, &opts.save_calibrated) {
        (Some(g), Some(path)) => {
            save_calibrated(scenario, g, path)?;
            Some(path.display().to_string())
        }
        _ => None,
    };
    let calibrated = Calibrated {
        graph: calibrated_graph.as_ref(),
        ring_hop: &ring_hop,
        pricing: pricing.as_ref(),
    };
    let rows = rows(
        &model,
        &graph,
        &candidates,
        measured,
        &calibrated,
        &reference,
    );
    let links = link_reports(scenario, &graph);
    let mut provenance = provenance(&model, &graph, &candidates, quotas);
    provenance.extend(links.iter().map(|l| {
        format!(
            "link {}-{}: imposed {:.2} ms round trip, {:.0} Mbit/s; measured {:.2} ms, {:.0} \
             Mbit/s, {} (predictions use the measured)",
            l.a,
            l.b,
            l.imposed_rtt_ms,
            l.imposed_mbit_s,
            l.measured_rtt_ms,
            l.measured_mbit_s,
            l.method
        )
    }));
    let mut report = Report {
        scenario: scenario.name.clone(),
        objective: graph.policy.objective,
        concurrency: concurrency as u32,
        tokens: scenario.workload.tokens,
        rows,
        provenance,
        links,
        machine: parallelism,
        calibrated_on,
        corrections,
        calibrated_graph: saved,
        one_process_text: Some(reference),
        baseline,
    };
    report.rank();
    Ok(report)
}

/// The host of the single-host plan that measured the best decode.
fn best_single_host(
    candidates: &[plans::Candidate],
    measured: &[Option<std::result::Result<Measured, String>>],
) -> Option<String> {
    candidates
        .iter()
        .zip(measured)
        .filter(|(c, _)| c.plan.strategy == StrategyKind::Single)
        .filter_map(|(c, m)| {
            let m = m.as_ref()?.as_ref().ok()?;
            let host = c.plan.cells.first()?.nodes().first()?.to_string();
            Some((host, m.figures.decode_tokens_per_s))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(host, _)| host)
}

/// What calibration gave the report's rows.
struct Calibrated<'a> {
    /// The calibrated graph, where calibration gave one.
    graph: Option<&'a ResourceGraph>,
    /// Each ring's cost per hop for its own calibrated row.
    ring_hop: &'a [(usize, f64)],
    /// The price of speculating requests, where the one-node plan's were measured.
    pricing: Option<&'a spec_price::SpecPricing>,
}

/// The report's rows: each candidate predicted on the measured `graph` and, where calibration
/// gave one, on the calibrated graph (a ring with its cost per hop); measured, or why not.
fn rows(
    model: &tessera_plan::ModelProfile,
    graph: &ResourceGraph,
    candidates: &[plans::Candidate],
    measured: Vec<Option<std::result::Result<Measured, String>>>,
    calibrated: &Calibrated,
    reference: &str,
) -> Vec<Row> {
    let Calibrated {
        graph: calibrated_graph,
        ring_hop,
        pricing,
    } = *calibrated;
    let figures =
        |g: &ResourceGraph, p: &Plan| predict(model, g, p).ok().map(|x| Figures::predicted(&x));
    candidates
        .iter()
        .zip(measured)
        .enumerate()
        .map(|(k, (c, m))| {
            let (streaming, owners) = match &m {
                Some(Ok(m)) => (
                    report::StageStreaming::of(&m.report),
                    report::SplitOwners::of(&m.report),
                ),
                _ => (Vec::new(), Vec::new()),
            };
            let (measured, note, text, speculation) = match (&c.placement, m) {
                (Err(why), _) => (None, Some(why.clone()), None, None),
                (_, Some(Ok(m))) => (
                    Some(m.figures),
                    None,
                    Some(TextCheck::of(&m.texts, reference)),
                    m.speculating.map(|s| {
                        s.map(|s| Speculation {
                            predicted_tokens_per_s: pricing.and_then(|p| p.predict(model, &c.plan)),
                            ..Speculation::of(
                                (s.k, s.predicted),
                                &s.runs,
                                &s.texts,
                                m.figures.decode_tokens_per_s,
                                reference,
                            )
                        })
                    }),
                ),
                (_, Some(Err(e))) => (None, Some(format!("its run failed: {e}")), None, None),
                (_, None) => (None, Some("not run".into()), None, None),
            };
            Row {
                strategy: c.plan.strategy.name().to_string(),
                description: describe(&c.plan),
                role: c.role.to_string(),
                predicted: figures(graph, &c.plan)
                    .unwrap_or_else(|| Figures::predicted(&c.plan.predicted)),
                measured,
                note,
                error: None,
                predicted_rank: None,
                measured_rank: None,
                calibrated: calibrated_graph.and_then(|g| {
                    match ring_hop.iter().find(|x| x.0 == k) {
                        Some(&(_, hop)) => {
                            let mut g = g.clone();
                            g.hop_overhead_s = hop;
                            figures(&g, &c.plan)
                        }
                        None => figures(g, &c.plan),
                    }
                }),
                calibrated_error: None,
                text,
                speculation,
                streaming,
                owners,
            }
        })
        .collect()
}

/// What the lab imposed and what was measured, one line each, for the report.
fn provenance(
    model: &tessera_plan::ModelProfile,
    graph: &ResourceGraph,
    candidates: &[plans::Candidate],
    quotas: Vec<String>,
) -> Vec<String> {
    let mut provenance = vec![
        "imposed by the lab: link delay, jitter, bandwidth and loss (each delay shortened by \
         the switch's own round trip); CPU share, memory cap (page cache included) and disk \
         read caps where [[lab.node]] sets them"
            .to_string(),
        "measured by the nodes: memory bandwidth, compute, RAM (the host's), and the links \
         between them over the switch (each pair measures its own): predictions use these"
            .into(),
    ];
    provenance.extend(quotas);
    // What sharing the machine's cores changes: each plan with several cells, predicted as if
    // every host were a machine of its own.
    if !graph.machines.is_empty() {
        let apart = ResourceGraph {
            machines: Vec::new(),
            ..graph.clone()
        };
        for c in candidates.iter().filter(|c| c.plan.cells.len() > 1) {
            if let (Ok(a), Ok(t)) = (
                predict(model, &apart, &c.plan),
                predict(model, graph, &c.plan),
            ) {
                provenance.push(format!(
                    "{}: aggregate {:.0} tok/s predicted sharing the machine's cores, {:.0} as if \
                     each host were a machine of its own",
                    describe(&c.plan),
                    t.throughput_tokens_per_s,
                    a.throughput_tokens_per_s
                ));
            }
        }
    }
    provenance.push(format!(
        "cost of a hop beyond the link: {:.0} µs before calibration (the scenario's \
         hop_overhead_us, else the planner's default); after, each ring is predicted with the \
         figure the other rings taught (else that one), never its own",
        graph.hop_overhead_s * 1e6
    ));
    provenance.push(
        "measured by the lab: tokens/s and time to first token in the clients' reports (median \
         of 3 requests); wire bytes per token counted by the switch between the nodes' hosts \
         (framing included)"
            .into(),
    );
    provenance
}

/// The coordinator's `plan-auto.json` at `path`: the graph it planned on and its outcome, read
/// as the type the coordinator wrote.
fn read_plan_auto(path: &Path) -> Result<AutoPlanRecord> {
    let unreadable = |message: String| LabError::Unreadable {
        process: "the coordinator".into(),
        what: "plan-auto.json".into(),
        message,
    };
    let bytes = std::fs::read(path).map_err(|e| unreadable(format!("not there: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| unreadable(e.to_string()))
}

/// Each measured link of `graph` beside what the scenario imposed on it, with how it was
/// measured (the graph's evidence).
fn link_reports(scenario: &Scenario, graph: &ResourceGraph) -> Vec<LinkReport> {
    graph
        .links
        .iter()
        .filter_map(|l| {
            let imposed = scenario.graph.link(&l.a, &l.b)?;
            let method = graph
                .link_evidence(&l.a, &l.b, "rtt")
                .map_or_else(String::new, |e| match &e.source {
                    tessera_plan::Source::Measured { method, .. } => method.clone(),
                    tessera_plan::Source::Estimate { source } => format!("estimated: {source}"),
                    tessera_plan::Source::Declared => "declared".into(),
                });
            Some(LinkReport {
                a: l.a.clone(),
                b: l.b.clone(),
                imposed_rtt_ms: imposed.rtt_s * 1e3,
                imposed_mbit_s: imposed.bandwidth.0 * 8e-6,
                measured_rtt_ms: l.spec.rtt_s * 1e3,
                measured_mbit_s: l.spec.bandwidth.0 * 8e-6,
                method,
            })
        })
        .collect()
}

/// Scales the measured compute and memory bandwidth of each node whose host the lab gives a
/// CPU quota below its compute threads: the nodes probe their hosts before the quotas bind
/// ([`Session::start`]), so the figures are the unthrottled host's and the quota is applied
/// exactly once. One line per node, saying so.
fn apply_cpu_quotas(scenario: &Scenario, graph: &mut ResourceGraph) -> Vec<String> {
    let mut lines = Vec::new();
    for n in &mut graph.nodes {
        let Some(q) = scenario.cpu_quota(&n.name) else {
            continue;
        };
        let f = (q / scenario.threads as f64).min(1.0);
        if f < 1.0 {
            n.ram_compute.0 *= f;
            n.ram.bandwidth.0 *= f;
            lines.push(format!(
                "imposed on {}: a CPU quota of {q} cores for {} compute thread(s), so its measured \
                 compute and memory bandwidth are scaled by {f:.2} (its node probed the host \
                 before the quota bound)",
                n.name, scenario.threads
            ));
        }
    }
    lines
}

/// The cores this process may run on.
fn counted_cores() -> f64 {
    std::thread::available_parallelism().map_or(1, |n| n.get()) as f64
}

/// One `tessera bench` decoder of the scenario's model alone, then one per host at once, each
/// with the scenario's threads ([`machine::measure`]).
fn measure_machine(tessera: &Path, scenario: &Scenario) -> Result<machine::Parallelism> {
    let threads = scenario.threads.max(1);
    machine::measure(
        tessera,
        &scenario.model,
        threads,
        scenario.graph.nodes.len(),
    )
}

/// The machine's cores for the planner from what `p` measured: never more than are counted.
fn machine_cores(p: machine::Parallelism, scenario: &Scenario) -> f64 {
    p.effective_cores(scenario.threads.max(1))
        .min(counted_cores())
}

/// Whether the lab's hosts share this machine in the planner's eyes: two or more, and the
/// scenario names no machines of its own.
fn shares_one_machine(graph: &ResourceGraph) -> bool {
    graph.machines.is_empty() && graph.nodes.len() >= 2
}

/// Says in the graph that the lab's hosts are one machine, shared by every node computing with
/// the scenario's threads, so cells or stages busy at once divide it. Its cores are what
/// `parallelism` measured them to deliver (see [`machine`]), else the cores this process may
/// run on. One line saying so; none when the graph already names machines.
fn apply_shared_machine(
    scenario: &Scenario,
    parallelism: Option<machine::Parallelism>,
    graph: &mut ResourceGraph,
) -> Vec<String> {
    if !shares_one_machine(graph) {
        return Vec::new();
    }
    let threads = scenario.threads.max(1);
    let counted = counted_cores();
    let (cores, how) = match parallelism {
        Some(p) => (
            machine_cores(p, scenario),
            format!(
                "measured: {} decoder(s) of {threads} thread(s) at once made {:.1} tok/s, one \
                 alone {:.1} (medians of rounds alternating the two); {counted} cores counted",
                p.copies, p.together_tok_s, p.alone_tok_s
            ),
        ),
        None => (counted, "counted, not measured".to_string()),
    };
    let m = tessera_plan::SharedMachine {
        name: "this machine".into(),
        cores,
        node_cores: threads as f64,
        nodes: graph.nodes.iter().map(|n| n.name.clone()).collect(),
    };
    let line = format!(
        "imposed on every host: one machine of {cores:.2} cores ({how}), shared by the {} nodes \
         at {threads} thread(s) each (nodes computing at once divide its cores)",
        m.nodes.len(),
    );
    graph.machines.push(m);
    vec![line]
}

/// Writes the scenario with its planner part replaced by the calibrated graph: `tessera plan
/// --nodes` plans on it, `tessera lab run` runs it (the model path made absolute).
fn save_calibrated(scenario: &Scenario, graph: &ResourceGraph, path: &Path) -> Result<()> {
    let text = crate::scenario::with_planner_part(scenario, &graph.to_toml())?;
    std::fs::write(path, text).map_err(|e| LabError::io(format!("writing {}", path.display()), e))
}

/// `tessera generate` of `prompt` in one process, greedy, `tokens` tokens with `threads`
/// compute threads: the text after the prompt, what every plan's text is compared with.
pub(crate) fn one_process(
    tessera: &Path,
    model: &Path,
    threads: usize,
    prompt: &str,
    tokens: usize,
) -> Result<String> {
    let out = std::process::Command::new(tessera)
        .args(["generate", "-t", &threads.max(1).to_string(), "-m"])
        .arg(model)
        .args([
            "-p",
            prompt,
            "-n",
            &tokens.to_string(),
            "--temperature",
            "0",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .map_err(|e| LabError::io("running tessera generate", e))?;
    if !out.status.success() {
        return Err(LabError::ProcessFailed {
            process: format!("tessera generate of {prompt:?}"),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .strip_prefix(prompt)
        .and_then(|t| t.strip_suffix('\n'))
        .unwrap_or(&text)
        .to_string())
}

/// Where `lab run` keeps its logs by default.
pub fn default_dir(scenario: &Scenario) -> PathBuf {
    std::env::temp_dir().join(format!(
        "tessera-lab-{}-{}",
        scenario.name,
        std::process::id()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_auto_file_missing_or_of_another_shape_is_unreadable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan-auto.json");
        let unreadable = |r: Result<AutoPlanRecord>| matches!(r, Err(LabError::Unreadable { what, .. }) if what == "plan-auto.json");
        assert!(unreadable(read_plan_auto(&path)), "missing");
        std::fs::write(&path, r#"{"graph": {}, "outcome": {"plan": {}}}"#).unwrap();
        assert!(unreadable(read_plan_auto(&path)), "another shape");
    }
}
