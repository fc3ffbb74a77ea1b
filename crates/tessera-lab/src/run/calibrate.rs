//! Calibration on a `lab run`'s measurements: the planner's graph corrected by what the plans
//! that ran showed, in steps, each on the graph the steps before it left.
//!
//! 0. Every node that streamed experts from its disk (a single node, an expert split's home)
//!    measured its cache: the share of its lookups it read from disk, against the share of its
//!    experts the plan left there. How much the routing reuses experts is fitted to all of them
//!    at once (`tessera_plan::fit_expert_reuse`). First, so that a streaming reference's
//!    predicted reads (step 1) are already its cache's: fitted last, a 3-host ring's stage
//!    whose reads the prior overstated took a compute rate ×1.54 to make up for them.
//! 1. Every single-node run (else the first plan that ran) calibrates the graph
//!    (`tessera_plan::calibrate`): each is the evidence on its own node. A plan streaming
//!    experts from a disk is not (a single node, or an expert split whose home or owners
//!    stream): its time is the disk's as much as the nodes'; unless its reads took next to
//!    none of it ([`reads_negligible`]: a ring whose stages stream a few MiB each). Without
//!    that, a run of 3 hosts whose every plan streamed calibrated no node's rates, and on a
//!    slow hour of the VM its rings' predictions came out 44–52% fast once the caches' hit
//!    rates were fitted (the reads that had hidden the slow compute fitted away).
//! 2. Each node no reference ran on is calibrated from its own stage in the first other plan
//!    that ran on it (`tessera_plan::calibrate_nodes`).
//! 3. The runtime's cost per token is the median of the references' (one throttled host does
//!    not set it for all), and each reference's node then takes what its own run took beside
//!    it (`tessera_plan::calibrate_node_to_token_time`).
//! 4. At a concurrency above 1, each single node's requests at once correct its compute rate
//!    where the batch was slower than predicted (`tessera_plan::calibrate_batching`).
//! 5. The rings that ran each imply a cost per hop (`tessera_plan::calibrate_hop_overhead`):
//!    the graph takes their median, and each ring's own row the others' figure.
//! 6. Where the machine was measured again just before the cells ran, its cores are that.

use tessera_plan::{
    calibrate, HopMeasurement, Measurement, ResourceGraph, StageMeasurement, StrategyKind,
};

use super::machine::Parallelism;
use super::plans::{describe, Candidate};
use super::ring::median;
use super::Measured;

/// The plans a run executed, what each measured (`None`: not run), and each successful
/// run's report as the planner reads it (parsed once, at one time).
pub(super) struct Runs<'a> {
    model: &'a tessera_plan::ModelProfile,
    candidates: &'a [Candidate],
    measured: &'a [Option<std::result::Result<Measured, String>>],
    measurements: Vec<Option<Measurement>>,
}

/// What calibration gives.
#[derive(Default)]
pub(super) struct Calibration {
    /// The calibrated graph (`None` where no plan ran or none could calibrate it).
    pub graph: Option<ResourceGraph>,
    /// One line per correction made, saying why.
    pub corrections: Vec<String>,
    /// The runs calibrated on (and those that could not be, with why).
    pub on: Vec<String>,
    /// Each ring's cost per hop for its own calibrated row (candidate, seconds): the other
    /// rings' figure, so that no ring's error is fitted to itself.
    pub ring_hop: Vec<(usize, f64)>,
}

pub(super) fn line(x: &tessera_plan::calibrate::Correction) -> String {
    format!(
        "{} {} ×{:.2}: {}",
        x.subject, x.quantity, x.factor, x.reason
    )
}

/// Seconds since the Unix epoch, for the evidence a calibration records.
pub(super) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl<'a> Runs<'a> {
    pub fn new(
        model: &'a tessera_plan::ModelProfile,
        candidates: &'a [Candidate],
        measured: &'a [Option<std::result::Result<Measured, String>>],
    ) -> Self {
        let at = unix_now();
        let measurements = measured
            .iter()
            .map(|m| match m {
                Some(Ok(m)) => Some(measurement(&m.report, at)),
                _ => None,
            })
            .collect();
        Self {
            model,
            candidates,
            measured,
            measurements,
        }
    }

    /// The planner's measurement of candidate `i`'s run, where it succeeded.
    fn measurement(&self, i: usize) -> Option<&Measurement> {
        self.measurements[i].as_ref()
    }

    /// The run of candidate `i`, where it succeeded.
    fn ok(&self, i: usize) -> Option<&Measured> {
        match &self.measured[i] {
            Some(Ok(m)) => Some(m),
            _ => None,
        }
    }

    fn is_single(&self, i: usize) -> bool {
        self.candidates[i].plan.strategy == StrategyKind::Single
    }

    /// Whether candidate `i`'s time is the disk's and the expert cache's as much as the nodes'
    /// compute, so it is no reference for their rates: it streamed experts from a disk (any of
    /// its nodes), and its run waited for reads more than [`reads_negligible`] allows or is
    /// neither a single node nor a ring (an expert split's owners' reads, or a bank's, its
    /// stages do not report).
    fn disk_timed(&self, i: usize) -> bool {
        let c = &self.candidates[i];
        let streamed =
            !c.streams.is_empty() || c.plan.assignments().any(|a| a.memory.experts_on_disk.0 > 0);
        streamed
            && (!matches!(c.plan.strategy, StrategyKind::Single | StrategyKind::Stage)
                || !self.ok(i).is_some_and(|m| reads_negligible(&m.report)))
    }
}

/// The most of a token's time a run's reads may have kept its stages waiting for the run to
/// time its nodes' compute as a run in memory does: the rates it gives are then at most a
/// tenth slow, well within the 20% the calibrated predictions are held to (a 3-host ring
/// streaming 4, 4 and 24 MiB waited 1.1 ms of its 20.9 ms tokens).
const NEGLIGIBLE_READ_WAIT: f64 = 0.10;

/// Whether the streaming stages of a run (`report`) waited for reads, all together, for less
/// than [`NEGLIGIBLE_READ_WAIT`] of its token time.
fn reads_negligible(report: &tessera_proto::RunReport) -> bool {
    let token_ms = 1e3 / report.decode_tokens_per_s;
    let waited: f64 = super::report::StageStreaming::of(report)
        .iter()
        .map(|s| s.read_wait_ms_per_token)
        .sum();
    token_ms.is_finite() && waited < NEGLIGIBLE_READ_WAIT * token_ms
}

/// Calibrates `graph` on `runs` (the steps in the module's doc); `machine_again` is the
/// machine's measurement just before the cells ran, with the cores it gives.
pub(super) fn on_runs(
    runs: &Runs,
    graph: &ResourceGraph,
    concurrency: usize,
    machine_again: Option<(Parallelism, f64)>,
) -> Calibration {
    let ran: Vec<usize> = (0..runs.candidates.len())
        .filter(|&i| runs.ok(i).is_some())
        .collect();
    // In memory, or streaming with reads that took next to none of its time.
    let node_timed: Vec<usize> = ran
        .iter()
        .copied()
        .filter(|&i| !runs.disk_timed(i))
        .collect();
    let mut references: Vec<usize> = node_timed
        .iter()
        .copied()
        .filter(|&i| runs.is_single(i))
        .collect();
    if references.is_empty() {
        references.extend(node_timed.first());
    }
    let mut c = Calibration::default();
    let fitted = c.expert_reuse(runs, graph, &ran);
    let graph = fitted.as_ref().unwrap_or(graph);
    let overheads = c.on_references(runs, graph, &references);
    c.on_uncovered_nodes(runs, &node_timed, &references);
    c.runtime_overhead_median(runs, overheads, &references);
    if concurrency > 1 {
        c.on_batches(runs, &references);
    }
    if references.iter().all(|&i| runs.is_single(i)) {
        c.learn_hops(runs);
    }
    if let Some((p, cores)) = machine_again {
        c.machine_measured_again(p, cores);
    }
    if c.graph.is_none() {
        if let Some(g) = fitted {
            c.on.push("the streaming runs' expert caches only".into());
            c.graph = Some(g);
        }
    }
    c
}

impl Calibration {
    /// Step 1: each reference run calibrates the graph in turn; the runtime cost per token
    /// each implied.
    fn on_references(
        &mut self,
        runs: &Runs,
        graph: &ResourceGraph,
        references: &[usize],
    ) -> Vec<f64> {
        let mut overheads = Vec::new();
        for &i in references {
            let m = runs.measurement(i).expect("a reference ran");
            let plan = &runs.candidates[i].plan;
            let base = self.graph.as_ref().unwrap_or(graph);
            match calibrate(runs.model, base, plan, m) {
                Ok(c) => {
                    self.corrections.extend(c.corrections.iter().map(line));
                    overheads.push(c.graph.token_overhead_s);
                    self.graph = Some(c.graph);
                    self.on.push(describe(plan));
                }
                Err(e) => self.on.push(format!("not {} ({e})", describe(plan))),
            }
        }
        overheads
    }

    /// Step 2: nodes no reference ran on, each from the first other plan that ran on it, by
    /// its own stage's figures (a ring's stage, an expert split's home), so that every node an
    /// executed plan covered carries what it showed. (A node covered is one whose stage
    /// reported compute: an expert split's owners report none, their expert work being done
    /// outside a stage.)
    fn on_uncovered_nodes(&mut self, runs: &Runs, ran: &[usize], references: &[usize]) {
        let mut covered: Vec<String> = references
            .iter()
            .filter_map(|&i| runs.measurement(i))
            .flat_map(|m| &m.stages)
            .filter(|s| s.seconds_per_token > 0.0)
            .map(|s| s.node.clone())
            .collect();
        for &i in ran {
            let Some(m) = runs.measurement(i) else {
                continue;
            };
            let Some(base) = self.graph.as_ref() else {
                break;
            };
            let fresh: Vec<StageMeasurement> = m
                .stages
                .iter()
                .filter(|s| s.seconds_per_token > 0.0 && !covered.contains(&s.node))
                .cloned()
                .collect();
            if fresh.is_empty() {
                continue;
            }
            let plan = &runs.candidates[i].plan;
            match tessera_plan::calibrate_nodes(runs.model, base, plan, &fresh, m.taken_at_unix_s) {
                Ok((g, c)) => {
                    self.corrections.extend(c.iter().map(line));
                    covered.extend(fresh.iter().map(|s| s.node.clone()));
                    let nodes: Vec<&str> = fresh.iter().map(|s| s.node.as_str()).collect();
                    self.on
                        .push(format!("{} (for {})", describe(plan), nodes.join(", ")));
                    self.graph = Some(g);
                }
                Err(e) => self.on.push(format!("not {} ({e})", describe(plan))),
            }
        }
    }

    /// Step 3: each run implies its own runtime cost per token (the model has one for the
    /// cluster): the median of them, so one throttled node does not set it for all; then each
    /// reference's node is fitted to its own run beside that median.
    fn runtime_overhead_median(
        &mut self,
        runs: &Runs,
        mut overheads: Vec<f64>,
        references: &[usize],
    ) {
        let Some(g) = self.graph.as_mut() else {
            return;
        };
        if overheads.len() < 2 {
            return;
        }
        overheads.sort_by(f64::total_cmp);
        g.token_overhead_s = overheads[overheads.len() / 2];
        self.corrections.push(format!(
            "runtime token_overhead: {:.1} µs, the median of the runs' ({})",
            g.token_overhead_s * 1e6,
            overheads
                .iter()
                .map(|x| format!("{:.1}", x * 1e6))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        let (fitted, lines) = fit_single_nodes_to_their_runs(runs, g, references);
        *g = fitted;
        self.corrections.extend(lines);
    }

    /// Step 4: each single node's requests at once, on its batch-1 calibration: where the
    /// batch was slower than predicted, the node's work binds at that batch, and its compute
    /// rate is set from it (the memory rates stay as batch 1 set them).
    fn on_batches(&mut self, runs: &Runs, references: &[usize]) {
        for &i in references {
            let (Some(m), Some(x), Some(g)) =
                (runs.ok(i), runs.measurement(i), self.graph.as_ref())
            else {
                continue;
            };
            let plan = &runs.candidates[i].plan;
            if !runs.is_single(i) {
                continue;
            }
            let at = x.taken_at_unix_s;
            let throughput = m.figures.throughput_tokens_per_s;
            match tessera_plan::calibrate_batching(runs.model, g, plan, throughput, at) {
                Ok((g, Some(x))) => {
                    self.corrections.push(line(&x));
                    self.graph = Some(g);
                }
                Ok((_, None)) => {}
                Err(e) => self
                    .on
                    .push(format!("not the batch of {} ({e})", describe(plan))),
            }
        }
    }

    /// Step 5: the rings that ran, on a graph whose nodes single-node runs calibrated, each
    /// imply a cost per hop: the graph takes their median; each ring's own row is predicted
    /// with the others' (else the prior figure), so its error is not fitted to itself.
    fn learn_hops(&mut self, runs: &Runs) {
        let Some(g) = self.graph.as_mut() else {
            return;
        };
        let prior = g.hop_overhead_s;
        let learned = learn_hop_overhead(runs, g, &mut self.corrections);
        if learned.is_empty() {
            return;
        }
        let values: Vec<f64> = learned.iter().map(|x| x.1).collect();
        g.hop_overhead_s = median(values.clone());
        self.corrections.push(format!(
            "runtime hop_overhead: {:.1} µs per hop, the median of the rings' (was {:.1})",
            g.hop_overhead_s * 1e6,
            prior * 1e6
        ));
        for (k, &(i, _)) in learned.iter().enumerate() {
            let others: Vec<f64> = values
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != k)
                .map(|(_, &v)| v)
                .collect();
            let v = if others.is_empty() {
                prior
            } else {
                median(others)
            };
            self.ring_hop.push((i, v));
        }
    }

    /// Step 0: how much the workload's routing reuses experts, fitted to the caches of every
    /// node that streamed experts in the runs (`tessera_plan::fit_expert_reuse`), one line each:
    /// `graph` with the fitted figure, where any node streamed.
    fn expert_reuse(
        &mut self,
        runs: &Runs,
        graph: &ResourceGraph,
        ran: &[usize],
    ) -> Option<ResourceGraph> {
        let mut caches = Vec::new();
        for &i in ran {
            let (Some(m), plan) = (runs.ok(i), &runs.candidates[i].plan) else {
                continue;
            };
            for st in super::report::StageStreaming::of(&m.report) {
                let Some(c) = tessera_plan::CacheMeasurement::of(
                    runs.model,
                    plan,
                    &st.node,
                    st.lookups_per_token,
                    st.disk_mib_per_token * (1 << 20) as f64,
                ) else {
                    continue;
                };
                self.corrections.push(format!(
                    "expert cache of {} in {}: {:.0}% of its experts on disk, {:.1}% of its \
                     lookups read from disk",
                    st.node,
                    describe(plan),
                    c.on_disk * 100.0,
                    c.missed * 100.0
                ));
                caches.push(c);
            }
        }
        let reuse = tessera_plan::fit_expert_reuse(&caches)?;
        self.corrections.push(format!(
            "routing reuse {:.2} → {reuse:.2}: fitted to the {} expert cache(s) above (a cache \
             leaving a share d of its experts on disk reads d^reuse of its lookups there)",
            graph.policy.expert_reuse,
            caches.len()
        ));
        let mut g = graph.clone();
        g.policy.expert_reuse = reuse;
        Some(g)
    }

    /// Step 6: the machine's cores as measured again just before the cells ran.
    fn machine_measured_again(&mut self, p: Parallelism, cores: f64) {
        let Some(g) = self.graph.as_mut() else {
            return;
        };
        for m in &mut g.machines {
            let was = m.cores;
            m.cores = cores;
            self.corrections.push(format!(
                "machine {} cores {:.2} → {:.2}: measured again before the cells ran ({} \
                 decoder(s) at once made {:.1} tok/s, one alone {:.1})",
                m.name, was, m.cores, p.copies, p.together_tok_s, p.alone_tok_s
            ));
        }
    }
}

/// The cost per hop each ring that ran implies on `graph` (its nodes calibrated on single-node
/// runs), with one line per ring in `corrections`: (candidate, seconds per hop).
fn learn_hop_overhead(
    runs: &Runs,
    graph: &ResourceGraph,
    corrections: &mut Vec<String>,
) -> Vec<(usize, f64)> {
    let mut out = Vec::new();
    for (i, c) in runs.candidates.iter().enumerate() {
        let (Some(m), Some(at)) = (runs.ok(i), runs.measurement(i)) else {
            continue;
        };
        if c.plan.strategy != StrategyKind::Stage || c.plan.nodes().len() < 2 {
            continue;
        }
        match tessera_plan::calibrate_hop_overhead(
            runs.model,
            graph,
            &c.plan,
            m.figures.decode_tokens_per_s,
            at.taken_at_unix_s,
        ) {
            Ok(h) => {
                corrections.push(format!(
                    "{}: {:.1} µs per hop ({})",
                    describe(&c.plan),
                    h.hop_overhead_after_s * 1e6,
                    h.correction.reason
                ));
                out.push((i, h.hop_overhead_after_s));
            }
            Err(e) => corrections.push(format!("{}: no hop cost ({e})", describe(&c.plan))),
        }
    }
    out
}

/// Gives each single-node reference run's node what its token time took beside the runtime's
/// median cost per token ([`tessera_plan::calibrate_node_to_token_time`]): one throttled host
/// does not set the runtime's figure for all, and each node's own run is still predicted.
fn fit_single_nodes_to_their_runs(
    runs: &Runs,
    graph: &ResourceGraph,
    references: &[usize],
) -> (ResourceGraph, Vec<String>) {
    let mut g = graph.clone();
    let mut lines = Vec::new();
    for &i in references {
        let (Some(m), plan) = (runs.measurement(i), &runs.candidates[i].plan) else {
            continue;
        };
        if let Ok((next, Some(c))) = tessera_plan::calibrate_node_to_token_time(
            runs.model,
            &g,
            plan,
            m.decode_tokens_per_s,
            m.taken_at_unix_s,
        ) {
            lines.push(format!(
                "{} {} ×{:.2}: {:.3} ms a token measured on it alone, beside the runtime's \
                 median {:.1} µs: the difference is the node's",
                c.subject,
                c.quantity,
                c.factor,
                1e3 / m.decode_tokens_per_s,
                g.token_overhead_s * 1e6
            ));
            g = next;
        }
    }
    (g, lines)
}

/// The planner's measurement of a run's report (`tessera run --json`'s `done` message), taken
/// at `at` (Unix seconds): decode tokens/s, per-hop time (the token time the stages' compute
/// does not explain, over the ring's hops) with wire bytes, per-stage time.
///
/// A stage that asked other nodes for experts (an expert split) waited for their answers
/// inside its steps, so its step time is not its compute: on a 20 ms link a home stage's
/// 279 ms a token were 15 ms of work, and taking them for work slowed its node ×0.05 in the
/// calibrated graph. Such a run gives no per-stage times; calibration then attributes to the
/// nodes only what the predicted network does not explain.
pub fn measurement(report: &tessera_proto::RunReport, at: u64) -> Measurement {
    let names: Vec<String> = report.stages.iter().map(|s| s.name.clone()).collect();
    let tps = report.decode_tokens_per_s;
    let waited_on_peers = report
        .stage_stats
        .iter()
        .any(|s| s.decode.expert_round_trips > 0);
    let per_stage: Vec<(String, f64)> = report
        .stage_stats
        .iter()
        .filter(|_| !waited_on_peers)
        .filter_map(|s| {
            let t = s.decode.compute_ns as f64 / s.decode.steps.max(1) as f64 / 1e9;
            Some((names.get(s.stage)?.clone(), t))
        })
        .collect();
    let compute: f64 = per_stage.iter().map(|s| s.1).sum();
    let hops = if names.len() > 1 && tps > 0.0 {
        let lat = ((1.0 / tps - compute) / names.len() as f64).max(0.0);
        report
            .boundaries
            .iter()
            .filter_map(|b| {
                Some(HopMeasurement {
                    from: names.get(b.from)?.clone(),
                    to: names.get(b.to)?.clone(),
                    latency_s: lat,
                    wire_bytes: b.decode_bytes_per_token,
                })
            })
            .collect()
    } else {
        Vec::new()
    };
    Measurement {
        taken_at_unix_s: at,
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

#[cfg(test)]
mod tests {
    use super::super::test_reports::{decode, on_nodes, report};
    use super::*;

    #[test]
    fn a_ring_gives_each_stages_time_and_an_expert_split_none() {
        let ring = on_nodes(
            report(vec![decode(0, 4_000_000, 2), decode(1, 3_000_000, 3)], 2),
            &["a", "b"],
        );
        let m = measurement(&ring, 7);
        let times: Vec<(String, f64)> = m
            .stages
            .iter()
            .map(|s| (s.node.clone(), s.seconds_per_token))
            .collect();
        assert_eq!(times, [("a".into(), 0.002), ("b".into(), 0.001)]);
        // The home stage asked the other node for experts: its steps include the waits.
        let mut home = decode(0, 279_000_000, 1);
        home.decode.expert_round_trips = 12;
        let split = on_nodes(report(vec![home, decode(1, 1_000_000, 1)], 0), &["a", "b"]);
        let m = measurement(&split, 7);
        assert!(m.stages.is_empty(), "{:?}", m.stages);
        assert_eq!(m.decode_tokens_per_s, 100.0);
    }

    #[test]
    fn a_run_whose_reads_took_next_to_none_of_its_time_times_its_nodes() {
        // 100 tokens/s: 10 ms a token. Two streaming stages of 8 steps.
        let streaming = |wait_ms_per_token: [f64; 2]| {
            let stages = (0..2)
                .map(|s| {
                    let mut d = decode(s, 4_000_000, 8);
                    d.decode.expert_lookups = 64;
                    d.decode.expert_read_wait_ns = (wait_ms_per_token[s] * 8e6) as u64;
                    d
                })
                .collect();
            report(stages, 2)
        };
        assert!(reads_negligible(&streaming([0.2, 0.0])));
        assert!(reads_negligible(&streaming([0.5, 0.45])));
        // Together a millisecond of the ten: a tenth, no longer negligible.
        assert!(!reads_negligible(&streaming([0.5, 0.5])));
        assert!(!reads_negligible(&streaming([3.0, 0.0])));
        // No decode timed: nothing to say the reads were small against.
        let mut none = streaming([0.0, 0.0]);
        none.decode_tokens_per_s = 0.0;
        assert!(!reads_negligible(&none));
    }
}
