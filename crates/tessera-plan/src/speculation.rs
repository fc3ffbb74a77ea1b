//! The price of a speculating request on a cell.
//!
//! A speculating request decodes in turns: a plain turn carries one row (the last token) and
//! yields one token; a verifying turn carries the last token and its drafts, every stage
//! computes those rows at once, every hop carries them, and it yields the accepted drafts and one
//! more. How many turns of each kind a request takes is fixed by its text, its draft source and
//! `k` — greedy, the same text on every plan — so it is an input here ([`Turns`]), counted where
//! the request ran (the sampling stage's statistics) or replayed from a known text. What a turn
//! of `r` rows costs is the cost model's decode pass at `r` rows.
//!
//! On a ring whose links cost milliseconds, a verifying turn costs little more than a plain one,
//! so the speedup approaches the tokens per turn; on one machine the extra rows' compute is what
//! limits it. That compute is what batch-1 calibration cannot see (it scales reading and
//! computing together), so [`calibrate_verifying`] fits the compute rate to a measured
//! speculating run — one process's, whose only cost is compute — before the ring is predicted.

use crate::calibrate::{
    bisect_factor, compute_evidence, plan_nodes, recost_policy, with_compute, Correction,
    MAX_FACTOR, MIN_FACTOR,
};
use crate::cost::{turn_s, Ctx};
use crate::model::ModelProfile;
use crate::plan::Plan;
use crate::resources::ResourceGraph;
use crate::PlanError;

/// How a speculating request's decode went, in turns (the first token, from the prompt's
/// prefill, is not one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Turns {
    /// Tokens decoded after the first.
    pub decoded: u64,
    /// Turns that carried drafts.
    pub verifying: u64,
    /// Drafts those turns carried, and how many of them the draws agreed with.
    pub drafted: u64,
    pub accepted: u64,
}

impl Turns {
    /// Turns without drafts: every decoded token not yielded by a verifying turn.
    pub fn plain(&self) -> u64 {
        self.decoded.saturating_sub(self.verifying + self.accepted)
    }

    /// Rows a verifying turn carries on average: the last token and its drafts.
    pub fn rows_per_verifying(&self) -> f64 {
        if self.verifying == 0 {
            1.0
        } else {
            1.0 + self.drafted as f64 / self.verifying as f64
        }
    }
}

/// Decode tokens/s of one request speculating with `turns` on `plan`'s one cell, on `graph`.
pub fn predict_speculating(
    model: &ModelProfile,
    graph: &ResourceGraph,
    plan: &Plan,
    turns: &Turns,
) -> Result<f64, PlanError> {
    let [cell] = plan.cells.as_slice() else {
        return Err(PlanError::Recost(
            "a speculating request is priced on a plan of one cell".into(),
        ));
    };
    let policy = recost_policy(plan, graph);
    let ctx = Ctx {
        model,
        graph,
        policy: &policy,
    };
    let turn = |rows: f64| {
        turn_s(
            &ctx,
            cell.kind,
            cell.assignments.clone(),
            cell.sequences,
            rows,
        )
        .map_err(PlanError::Recost)
    };
    let mut secs = turns.plain() as f64 * turn(1.0)?;
    if turns.verifying > 0 {
        secs += turns.verifying as f64 * turn(turns.rows_per_verifying())?;
    }
    if !(secs > 0.0 && secs.is_finite()) {
        return Err(PlanError::Recost(
            "a speculating request with no turns has no rate".into(),
        ));
    }
    Ok(turns.decoded as f64 / secs)
}

/// Corrects the compute rates of `plan`'s nodes so that the plan, speculating with `turns`,
/// predicts the `measured_tokens_per_s` it was measured at; the memory rates stay (a graph
/// calibrated at batch 1 already predicts the plain turns). Returns the corrected graph and the
/// correction (none when the prediction already meets the measurement within 1%).
pub fn calibrate_verifying(
    model: &ModelProfile,
    graph: &ResourceGraph,
    plan: &Plan,
    turns: &Turns,
    measured_tokens_per_s: f64,
    taken_at_unix_s: u64,
) -> Result<(ResourceGraph, Option<Correction>), PlanError> {
    if !(measured_tokens_per_s.is_finite() && measured_tokens_per_s > 0.0) {
        return Err(PlanError::Recost(
            "measured tokens/s must be positive".into(),
        ));
    }
    let nodes = plan_nodes(plan);
    let at = |k: f64| predict_speculating(model, &with_compute(graph, &nodes, k), plan, turns);
    let before = at(1.0)?;
    if (before / measured_tokens_per_s - 1.0).abs() <= 0.01 {
        return Ok((graph.clone(), None));
    }
    let k = bisect_factor(at, measured_tokens_per_s, MIN_FACTOR, MAX_FACTOR)?;
    let g = compute_evidence(
        with_compute(graph, &nodes, k),
        &nodes,
        taken_at_unix_s,
        "calibration: a speculating request's verifying turns".into(),
    );
    let correction = Correction {
        subject: format!("node {}", nodes.join(", node ")),
        quantity: "compute".into(),
        factor: k,
        reason: format!(
            "speculating ({:.2} rows a verifying turn) measured {measured_tokens_per_s:.1} tok/s, \
             predicted {before:.1}: the extra rows' work",
            turns.rows_per_verifying()
        ),
    };
    Ok((g, Some(correction)))
}
