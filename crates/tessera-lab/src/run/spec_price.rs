//! The planner's price of the speculating requests a scenario measured: calibrated on the one
//! node plan's speculating requests (one process, where the verifying turns' extra rows cost
//! only compute) and on every plan's plain requests (the graph the lab calibrated, its cost per
//! hop included), then predicted for every plan from the one-node run's turns — the same turns
//! on every plan, since greedy decoding gives every plan the same text and so the same drafts.

use tessera_plan::calibrate::Correction;
use tessera_plan::speculation::{calibrate_verifying, predict_speculating, Turns};
use tessera_plan::{FlopsPerSec, ModelProfile, Plan, ResourceGraph, StrategyKind};
use tessera_proto::RunReport;

use super::{plans::Candidate, Measured};

/// A graph whose compute rates price verifying turns, and the turns it prices.
pub(super) struct SpecPricing {
    graph: ResourceGraph,
    turns: Turns,
    pub(super) correction: Option<Correction>,
}

/// The turns of `runs` together: decoded tokens (after each run's first) and the sampling
/// stages' counts.
pub(super) fn turns_of(runs: &[RunReport]) -> Turns {
    let mut t = Turns::default();
    for r in runs {
        t.decoded += (r.generated as u64).saturating_sub(1);
        for s in &r.stage_stats {
            t.verifying += s.verifications;
            t.drafted += s.drafted;
            t.accepted += s.drafts_accepted;
        }
    }
    t
}

/// Calibrates on the single-node plan whose speculating requests were measured, if one was:
/// its compute factor goes to every node, since every lab host shares this machine's cores.
pub(super) fn calibrate(
    model: &ModelProfile,
    graph: &ResourceGraph,
    candidates: &[Candidate],
    measured: &[Option<std::result::Result<Measured, String>>],
) -> Option<SpecPricing> {
    let (plan, runs, rate) = candidates.iter().zip(measured).find_map(|(c, m)| {
        let s = m
            .as_ref()?
            .as_ref()
            .ok()?
            .speculating
            .as_ref()?
            .as_ref()
            .ok()?;
        (c.plan.strategy == StrategyKind::Single && !s.runs.is_empty())
            .then(|| (&c.plan, &s.runs, median_rate(&s.runs)))
    })?;
    let turns = turns_of(runs);
    let (fitted, correction) = calibrate_verifying(model, graph, plan, &turns, rate, now()).ok()?;
    let mut g = graph.clone();
    if let Some(c) = &correction {
        for n in &mut g.nodes {
            n.ram_compute = FlopsPerSec(n.ram_compute.0 * c.factor);
            n.gpu_compute = FlopsPerSec(n.gpu_compute.0 * c.factor);
        }
    } else {
        g = fitted;
    }
    Some(SpecPricing {
        graph: g,
        turns,
        correction,
    })
}

impl SpecPricing {
    /// `plan`'s decode tokens/s speculating. A ring's hops cost what the plain requests of the
    /// rings taught the graph (the speculating requests themselves teach it nothing).
    pub(super) fn predict(&self, model: &ModelProfile, plan: &Plan) -> Option<f64> {
        predict_speculating(model, &self.graph, plan, &self.turns).ok()
    }
}

fn median_rate(runs: &[RunReport]) -> f64 {
    let mut r: Vec<f64> = runs.iter().map(|r| r.decode_tokens_per_s).collect();
    r.sort_by(f64::total_cmp);
    r[r.len() / 2]
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
