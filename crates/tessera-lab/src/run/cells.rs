//! `tessera lab cells`: what whole-request cells add. `hosts` emulated hosts, each capped at
//! `cpu_quota` cores by its cgroup and each able to hold the whole model, serve `streams`
//! concurrent greedy requests:
//!
//! - **one cell**: the first host alone holds the model (`s0[0..n)`), and the coordinator seats
//!   every request on it, where they are batched together;
//! - **`hosts` cells**: every host holds the model (`s0[0..n)`, `s1[0..n)`, …), and the
//!   coordinator routes each whole request to a cell.
//!
//! The two alternate for `rounds` rounds, each on a coordinator started with its placement.
//! A round's aggregate is the tokens that arrived while every stream was decoding, over that
//! window ([`super::pipeline::overlap_window`]); medians are reported. Every stream's text is
//! checked against `tessera generate` of the same prompt in one process.
//!
//! The quota is what makes this machine play several: on a machine of two cores, four hosts
//! of 0.4 core each add compute as four such machines would, while the coordinator and the
//! clients keep the rest. Memory bandwidth is the machine's, shared, and not imposed.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::pipeline::overlap_window;
use super::ring::{load_average, median, stage, write_plan, EqualHosts};
use super::session::{Mode, Session};
use crate::error::{LabError, Result};
use crate::lab::Lab;

/// What `tessera lab cells` measures.
#[derive(Debug, Clone)]
pub struct Options {
    pub model: std::path::PathBuf,
    /// Hosts, each a cell in the cells' placement.
    pub hosts: usize,
    /// Concurrent requests.
    pub streams: usize,
    /// Tokens each request decodes.
    pub tokens: usize,
    /// Rounds (the two placements alternating); medians are reported.
    pub rounds: usize,
    /// Each host's CPU quota, in cores (`None`: no cap).
    pub cpu_quota: Option<f64>,
    /// Round trip of the links between hosts, ms.
    pub rtt_ms: f64,
    /// Compute threads per node.
    pub threads: usize,
}

/// One placement's figures (medians over rounds).
#[derive(Debug, Clone, Serialize)]
pub struct PlacementFigure {
    /// Cells of the placement.
    pub cells: usize,
    /// Tokens per second over every stream, while all of them decoded.
    pub aggregate_tokens_per_s: f64,
    /// Each round's aggregate, in order.
    pub rounds: Vec<f64>,
    /// Requests each node served, over every round.
    pub requests_per_node: BTreeMap<String, usize>,
    /// CPU each cell's host used while the streams ran, in cores (medians over rounds): at
    /// its quota, the quota bounds the host, not this machine.
    pub host_cores: Vec<f64>,
}

/// Everything `tessera lab cells` measured.
#[derive(Debug, Clone, Serialize)]
pub struct CellsReport {
    pub model: String,
    pub hosts: usize,
    pub streams: usize,
    pub tokens: usize,
    pub threads: usize,
    pub cpu_quota: Option<f64>,
    pub rtt_ms: f64,
    pub one_cell: PlacementFigure,
    pub cells: PlacementFigure,
    /// `cells` over `one_cell` aggregate; the issue asks ≥ [`GOAL`] at four cells.
    pub ratio: f64,
    /// Streams whose text equalled one process's, of all streams measured.
    pub texts_identical: usize,
    pub texts_checked: usize,
    pub load_before: Option<f64>,
    pub load_after: Option<f64>,
    pub cores: usize,
}

/// The goal for [`CellsReport::ratio`] with four cells at eight streams.
pub const GOAL: f64 = 3.0;

/// The prompt of stream `i`: each its own, so that no stream's text stands in for another's.
fn prompt(i: usize) -> String {
    const SUBJECTS: [&str; 8] = [
        "Once upon a time",
        "The little dog",
        "In the morning the girl",
        "A big red ball",
        "The old man said",
        "One day a bird",
        "The sun was hot and",
        "Tom and his sister",
    ];
    SUBJECTS[i % SUBJECTS.len()].to_string()
}

/// The scenario of the first `hosts` equal hosts, each with the quota asked.
fn scenario(o: &Options, hosts: usize, context: usize) -> Result<crate::scenario::Scenario> {
    EqualHosts {
        file: "cells.toml",
        model: &o.model,
        nodes: hosts,
        rtt_ms: o.rtt_ms,
        context,
        tokens: o.tokens,
        threads: o.threads,
        cpu_quota: o.cpu_quota,
    }
    .scenario()
}

/// The placement of `cells` single-node cells, each holding all `n_layer` layers, written to
/// `dir`; its path.
fn placement(dir: &Path, n_layer: usize, cells: usize) -> Result<std::path::PathBuf> {
    let path = dir.join(format!("cells-{cells}.json"));
    write_plan(&path, (0..cells).map(|i| stage(i, 0..n_layer)).collect())?;
    Ok(path)
}

/// One round of one placement: the aggregate, which node served each stream, each stream's
/// text, and the CPU each cell's host used while the streams ran, in cores.
struct Round {
    aggregate: f64,
    served_by: Vec<String>,
    texts: Vec<String>,
    host_cores: Vec<f64>,
}

/// CPU seconds used so far by the processes `pids` (user and system, all threads), from
/// `/proc/PID/stat`; a process that is gone counts nothing.
fn cpu_seconds(pids: &[u32]) -> f64 {
    // Clock ticks per second: 100 on every Linux this runs on (USER_HZ).
    const TICKS: f64 = 100.0;
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .filter_map(|s| {
            // The fields after the command name (which may hold spaces), from field 3 on.
            let rest = &s[s.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            let utime: u64 = f.get(11)?.parse().ok()?;
            let stime: u64 = f.get(12)?.parse().ok()?;
            Some((utime + stime) as f64 / TICKS)
        })
        .sum()
}

#[allow(clippy::too_many_arguments)]
fn round(
    lab: &Lab,
    tessera: &Path,
    o: &Options,
    dir: &Path,
    n_layer: usize,
    cells: usize,
    context: usize,
) -> Result<Round> {
    let s = scenario(o, cells, context)?;
    let plan = placement(dir, n_layer, cells)?;
    let mode = Mode::Fixed {
        plan: plan.clone(),
        experts: None,
        expert_budgets: Vec::new(),
    };
    let mut session = Session::start(lab, tessera, &s, dir, &mode)?;
    for _ in 0..cells {
        session
            .coordinator
            .wait_event("epoch_ready", Duration::from_secs(300))?;
    }
    // One request a cell first, long enough that the coordinator measures each cell's speed
    // (the first steps of a fresh process are not its speed).
    session.clients(lab, &plan, &prompt(0), o.tokens.min(32), cells)?;
    let prompts: Vec<String> = (0..o.streams).map(prompt).collect();
    let prompts: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let cpu = || -> Vec<f64> { (1..=cells).map(|i| cpu_seconds(&lab.pids(i))).collect() };
    let (cpu0, t0) = (cpu(), std::time::Instant::now());
    let runs = session.timed_clients(lab, &plan, &prompts, o.tokens)?;
    let secs = t0.elapsed().as_secs_f64();
    let host_cores = cpu()
        .iter()
        .zip(&cpu0)
        .map(|(b, a)| (b - a) / secs)
        .collect();
    let arrivals: Vec<_> = runs.iter().map(|r| r.arrivals.clone()).collect();
    let (tokens, secs) = overlap_window(&arrivals).ok_or_else(|| {
        LabError::NothingMeasured(format!(
            "the {} streams never decoded at the same time on {cells} cell(s) (raise --tokens)",
            o.streams
        ))
    })?;
    Ok(Round {
        aggregate: tokens as f64 / secs,
        served_by: runs
            .iter()
            .map(|r| {
                r.report
                    .stages
                    .first()
                    .map_or_else(|| "?".to_string(), |s| s.name.clone())
            })
            .collect(),
        texts: runs.into_iter().map(|r| r.text).collect(),
        host_cores,
    })
}

/// Measures one cell against `hosts` cells on emulated hosts.
pub fn run(
    o: &Options,
    tessera: &Path,
    dir: &Path,
    mut progress: impl FnMut(&str),
) -> Result<CellsReport> {
    let _copies = super::session::NodeModelCopies::removed_at_end(dir);
    if o.hosts < 2 || o.streams == 0 {
        return Err(LabError::Unrunnable(
            "cells: two hosts or more and one stream or more".into(),
        ));
    }
    let gguf = tessera_model::GgufFile::open(&o.model).map_err(|e| LabError::model(&o.model, e))?;
    let config = tessera_model::ModelConfig::from_gguf(&gguf)
        .map_err(|e| LabError::model(&o.model, format!("its configuration: {e}")))?;
    drop(gguf);
    let context = (o.tokens + 64).max(256);
    if context > config.context_length {
        return Err(LabError::Unrunnable(format!(
            "{} tokens a stream do not fit the model's context of {}",
            o.tokens, config.context_length
        )));
    }
    let load_before = load_average();
    progress(&format!(
        "one process: the text of each of {} prompts",
        o.streams
    ));
    let want: Vec<String> = (0..o.streams)
        .map(|i| super::one_process(tessera, &o.model, o.threads, &prompt(i), o.tokens))
        .collect::<Result<_>>()?;

    let all = scenario(o, o.hosts, context)?;
    let lab = Lab::start(&all.lab_spec()?)?;
    progress(&format!(
        "lab {} up: {} hosts{}",
        lab.id(),
        lab.len() - 1,
        o.cpu_quota
            .map_or(String::new(), |q| format!(" of {q} core(s) each"))
    ));
    std::fs::create_dir_all(dir)
        .map_err(|e| LabError::io(format!("creating {}", dir.display()), e))?;

    let mut figures: [(usize, Vec<Round>, BTreeMap<String, usize>); 2] = [
        (1, Vec::new(), BTreeMap::new()),
        (o.hosts, Vec::new(), BTreeMap::new()),
    ];
    let (mut identical, mut checked) = (0, 0);
    for r in 0..o.rounds.max(1) {
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            let (cells, rounds, served) = &mut figures[k];
            let got = round(&lab, tessera, o, dir, config.n_layer, *cells, context)?;
            for name in &got.served_by {
                *served.entry(name.clone()).or_insert(0) += 1;
            }
            let same = got.texts.iter().zip(&want).filter(|(a, b)| a == b).count();
            identical += same;
            checked += got.texts.len();
            progress(&format!(
                "round {}: {cells} cell(s): {:.1} tok/s, texts equal to one process {same}/{}, \
                 hosts' CPU {} cores",
                r + 1,
                got.aggregate,
                got.texts.len(),
                joined(&got.host_cores, 2)
            ));
            rounds.push(got);
        }
    }
    drop(lab);
    let figure = |(cells, rounds, requests_per_node): (usize, Vec<Round>, _)| PlacementFigure {
        cells,
        aggregate_tokens_per_s: median(rounds.iter().map(|r| r.aggregate).collect()),
        host_cores: (0..cells)
            .map(|h| median(rounds.iter().map(|r| r.host_cores[h]).collect()))
            .collect(),
        rounds: rounds.iter().map(|r| r.aggregate).collect(),
        requests_per_node,
    };
    let [one, many] = figures;
    let (one_cell, cells) = (figure(one), figure(many));
    Ok(CellsReport {
        model: o.model.display().to_string(),
        hosts: o.hosts,
        streams: o.streams,
        tokens: o.tokens,
        threads: o.threads,
        cpu_quota: o.cpu_quota,
        rtt_ms: o.rtt_ms,
        ratio: cells.aggregate_tokens_per_s / one_cell.aggregate_tokens_per_s,
        one_cell,
        cells,
        texts_identical: identical,
        texts_checked: checked,
        load_before,
        load_after: load_average(),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
    })
}

/// `v`'s values with `digits` decimals, joined by " / ".
fn joined(v: &[f64], digits: usize) -> String {
    v.iter()
        .map(|x| format!("{x:.digits$}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// The figures as a table.
pub fn table(r: &CellsReport) -> String {
    let quota = r
        .cpu_quota
        .map_or("no CPU cap".into(), |q| format!("{q} core(s) each"));
    let mut s = format!(
        "{} hosts ({quota}, {} thread(s) a node, {} ms links) holding {}; {} streams of {} \
         tokens; medians of {} rounds; {} cores, load average {} → {}\n",
        r.hosts,
        r.threads,
        r.rtt_ms,
        r.model,
        r.streams,
        r.tokens,
        r.one_cell.rounds.len(),
        r.cores,
        r.load_before.map_or("?".into(), |l| format!("{l:.2}")),
        r.load_after.map_or("?".into(), |l| format!("{l:.2}")),
    );
    s.push_str(&format!(
        "{:>6} {:>12} {:>24} {:>24} {}\n",
        "cells", "aggr tok/s", "rounds", "hosts' CPU (cores)", "requests per node"
    ));
    for f in [&r.one_cell, &r.cells] {
        s.push_str(&format!(
            "{:>6} {:>12.1} {:>24} {:>24} {}\n",
            f.cells,
            f.aggregate_tokens_per_s,
            joined(&f.rounds, 0),
            joined(&f.host_cores, 2),
            f.requests_per_node
                .iter()
                .map(|(n, c)| format!("{n}:{c}"))
                .collect::<Vec<_>>()
                .join(" ")
        ));
    }
    s.push_str(&format!(
        "{} cells against one: {:.2}x (the issue's goal at 4 cells and 8 streams: ≥ {GOAL}x); \
         texts equal to one process: {}/{}\n",
        r.cells.cells, r.ratio, r.texts_identical, r.texts_checked
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cells_placement_gives_every_host_every_layer() {
        let dir = tempfile::tempdir().unwrap();
        let p = placement(dir.path(), 5, 2).unwrap();
        let f: tessera_placement::assignment::PlanFile =
            serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
        let stages: Vec<_> = f.stages.into_iter().map(|s| (s.node, s.layers)).collect();
        assert_eq!(
            stages,
            [(Some("s0".into()), 0..5), (Some("s1".into()), 0..5)]
        );
    }

    #[test]
    fn this_process_has_used_some_cpu_and_a_gone_one_none() {
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(30) {
            std::hint::black_box(0u64);
        }
        assert!(cpu_seconds(&[std::process::id()]) > 0.0);
        assert_eq!(cpu_seconds(&[u32::MAX]), 0.0);
    }

    #[test]
    fn every_stream_has_a_prompt_of_its_own_up_to_eight() {
        let p: std::collections::BTreeSet<String> = (0..8).map(prompt).collect();
        assert_eq!(p.len(), 8);
    }
}
