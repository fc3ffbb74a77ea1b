//! The planner's price of the speculating requests a scenario measured: calibrated on the one
//! node plan's speculating requests (one process, where the verifying turns' extra rows cost
//! only compute) and on every plan's plain requests (the graph the lab calibrated, its cost per
//! hop included), then predicted for every plan from the one-node run's turns — the same turns
//! on every plan, since greedy decoding gives every plan the same text and so the same drafts.

use tessera_plan::calibrate::{with_compute, Correction};
use tessera_plan::speculation::{calibrate_verifying, predict_speculating, Turns};
use tessera_plan::{ModelProfile, Plan, ResourceGraph, StrategyKind};
use tessera_proto::RunReport;

use super::calibrate::unix_now;
use super::ring::median;
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
        (c.plan.strategy == StrategyKind::Single && !s.runs.is_empty()).then(|| {
            let rates = s.runs.iter().map(|r| r.decode_tokens_per_s).collect();
            (&c.plan, &s.runs, median(rates))
        })
    })?;
    let turns = turns_of(runs);
    let (_, correction) = calibrate_verifying(model, graph, plan, &turns, rate, unix_now()).ok()?;
    let graph = match &correction {
        Some(c) => {
            let every: Vec<&str> = graph.nodes.iter().map(|n| n.name.as_str()).collect();
            with_compute(graph, &every, c.factor)
        }
        None => graph.clone(),
    };
    Some(SpecPricing {
        graph,
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
