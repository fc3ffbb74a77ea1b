//! Scoring and choosing: the best candidate under the objective wins; a candidate that uses more
//! nodes than another it cannot beat is refused, with the network's cost and the compute it saves.

use crate::cost::Ctx;
use crate::model::ModelProfile;
use crate::plan::{Candidate, Explanation, Plan, PlanOutcome, Rejection, Summary};
use crate::resources::{Evidence, Objective, ResourceGraph};
use crate::strategies::{self, ms};
use crate::PlanError;

/// Runner-ups listed in the explanation.
pub const MAX_ALTERNATIVES: usize = 5;
/// Scores within this relative margin count as a tie (fewer nodes then win).
const TIE: f64 = 1e-9;

fn objective_label(o: Objective) -> &'static str {
    match o {
        Objective::Latency => "tok/s per request",
        Objective::Throughput => "aggregate tok/s",
        Objective::Balanced => "balanced score",
    }
}

fn node_positions(graph: &ResourceGraph, c: &Candidate) -> Vec<usize> {
    c.nodes()
        .iter()
        .map(|n| {
            graph
                .nodes
                .iter()
                .position(|x| x.name == *n)
                .unwrap_or(usize::MAX)
        })
        .collect()
}

/// Plans `model` on `graph` under `graph.policy`. `epoch` is the caller's plan version.
pub fn plan(
    model: &ModelProfile,
    graph: &ResourceGraph,
    epoch: u64,
) -> Result<PlanOutcome, PlanError> {
    model.validate()?;
    if graph.nodes.is_empty() {
        return Err(PlanError::NoNodes);
    }
    for (i, n) in graph.nodes.iter().enumerate() {
        if graph.nodes[..i].iter().any(|m| m.name == n.name) {
            return Err(PlanError::DuplicateNode(n.name.clone()));
        }
    }
    let ctx = Ctx {
        model,
        graph,
        policy: &graph.policy,
    };
    let objective = graph.policy.objective;
    let gen = strategies::generate(&ctx);
    let mut rejected = gen.rejected;
    let notes = gen.notes;

    // Policy floor.
    let mut feasible = Vec::new();
    for c in gen.candidates {
        match graph.policy.min_tokens_per_s {
            Some(min) if c.predicted.decode_tokens_per_s < min => rejected.push(Rejection {
                strategy: c.strategy,
                nodes: c.nodes().into_iter().map(str::to_string).collect(),
                reason: format!(
                    "{}: predicted {:.2} tok/s is below the policy minimum of {min} tok/s",
                    c.description, c.predicted.decode_tokens_per_s
                ),
                decode_tokens_per_s: Some(c.predicted.decode_tokens_per_s),
            }),
            _ => feasible.push(c),
        }
    }
    // Best first: score, then fewer nodes, then time to first token, then cluster-file order.
    feasible.sort_by(|a, b| {
        let (sa, sb) = (a.predicted.score(objective), b.predicted.score(objective));
        let tie = (sa - sb).abs() <= TIE * sa.abs().max(sb.abs());
        let by_score = if tie {
            std::cmp::Ordering::Equal
        } else {
            sb.total_cmp(&sa)
        };
        by_score
            .then(a.nodes().len().cmp(&b.nodes().len()))
            .then(a.predicted.ttft_s.total_cmp(&b.predicted.ttft_s))
            .then(node_positions(graph, a).cmp(&node_positions(graph, b)))
            .then(a.description.cmp(&b.description))
    });
    // Refuse a candidate that a plan on a strict subset of its nodes matches or beats.
    let mut kept: Vec<Candidate> = Vec::new();
    for c in feasible {
        let nodes = c.nodes();
        let sc = c.predicted.score(objective);
        let beaten = kept.iter().find(|k| {
            let kn = k.nodes();
            kn.len() < nodes.len()
                && kn.iter().all(|n| nodes.contains(n))
                && k.predicted.score(objective) >= sc * (1.0 - TIE)
        });
        match beaten {
            Some(k) if nodes.len() > 1 => {
                let work =
                    |x: &Candidate| x.predicted.decode.total_s - x.predicted.decode.network_s();
                let saved = work(k) - work(&c);
                let rtt = c.predicted.hops.iter().map(|h| h.rtt_s).fold(0.0, f64::max);
                let label = objective_label(objective);
                let effect = if saved >= 0.0 {
                    format!("saves {} of compute", ms(saved))
                } else {
                    format!("adds {} of compute", ms(-saved))
                };
                let net = if c.predicted.hops.is_empty() {
                    String::new()
                } else {
                    format!(
                        ": its hops cost {}/token over a {} round-trip link and it {effect}",
                        ms(c.predicted.decode.network_s()),
                        ms(rtt)
                    )
                };
                rejected.push(Rejection {
                    strategy: c.strategy,
                    nodes: nodes.iter().map(|s| s.to_string()).collect(),
                    reason: format!(
                        "{} ({:.2} {label}) is no better than {} ({:.2}) on fewer nodes{net}",
                        c.description,
                        sc,
                        k.description,
                        k.predicted.score(objective)
                    ),
                    decode_tokens_per_s: Some(c.predicted.decode_tokens_per_s),
                });
            }
            _ => kept.push(c),
        }
    }
    if kept.is_empty() {
        return Err(PlanError::NoFeasiblePlan { rejected });
    }
    let chosen = kept.remove(0);
    let label = objective_label(objective);
    let best = chosen.predicted.score(objective);
    let alternatives = kept
        .iter()
        .take(MAX_ALTERNATIVES)
        .map(|c| {
            let mut s = Summary::of(c, objective);
            let lower = if best > 0.0 {
                100.0 * (1.0 - s.score / best)
            } else {
                0.0
            };
            s.reason = format!(
                "{:.2} {label} vs {best:.2} for the chosen plan ({lower:.0}% lower); bound by {}",
                s.score, s.binding
            );
            s
        })
        .collect();
    let mut chosen_summary = Summary::of(&chosen, objective);
    chosen_summary.reason = format!(
        "best {label} ({best:.2}) among {} feasible candidates; bound by {}",
        kept.len() + 1,
        chosen_summary.binding
    );
    let explanation = Explanation {
        objective,
        chosen: chosen_summary,
        alternatives,
        rejected,
        notes,
    };
    let evidence = evidence_for(graph, &chosen);
    let plan = Plan::new(
        epoch,
        model.name.clone(),
        chosen,
        graph.policy.clone(),
        evidence,
    );
    Ok(PlanOutcome { plan, explanation })
}

fn evidence_for(graph: &ResourceGraph, c: &Candidate) -> Vec<Evidence> {
    let nodes = c.nodes();
    let uses_network = c.cells.iter().any(|cell| cell.assignments.len() > 1);
    let listed = |a: &str, b: &str| {
        graph
            .links
            .iter()
            .any(|l| (l.a == a && l.b == b) || (l.a == b && l.b == a))
    };
    let default_used = uses_network
        && c.cells
            .iter()
            .any(|cell| cell.predicted.hops.iter().any(|h| !listed(&h.from, &h.to)));
    graph
        .evidence
        .iter()
        .filter(|e| {
            if let Some(n) = e.subject.strip_prefix("node ") {
                nodes.contains(&n)
            } else if let Some(pair) = e.subject.strip_prefix("link ") {
                uses_network
                    && c.cells.iter().any(|cell| {
                        cell.predicted
                            .hops
                            .iter()
                            .any(|h| crate::resources::link_subject(&h.from, &h.to) == e.subject)
                    })
                    && !pair.is_empty()
            } else if e.subject == "default link" {
                default_used
            } else {
                false
            }
        })
        .cloned()
        .collect()
}
