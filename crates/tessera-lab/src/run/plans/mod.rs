//! Which plans a scenario run measures: the planner's choice and each runner-up (or what the
//! flags force), each with its placement on the fabric, or why the fabric cannot execute it.
//! Pure: planning and re-costing only.

mod error;

pub use error::{CandidatesError, SplitSyntax};

use tessera_placement::planning::{expert_budgets, plan_executable, to_placement, Placement};
use tessera_plan::plan::{ExpertSlice, LayerRange};
use tessera_plan::{
    predict, CellKind, ModelProfile, Plan, PlanOutcome, ResourceGraph, StrategyKind,
};

/// What the flags of `tessera lab run` force.
#[derive(Debug, Clone, Default)]
pub struct Force {
    /// Run the best plan of this strategy on the measured graph (and the planner's choice).
    pub strategy: Option<StrategyKind>,
    /// Run this stage split, `NODE=START..END,…` in ring order (one part: a single node), and
    /// the planner's choice.
    pub split: Option<String>,
}

/// One plan to measure, or to list with why it cannot run.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub plan: Plan,
    /// "choice", "executable choice" (what the coordinator runs when the choice cannot
    /// execute), "runner-up" (ranked by the planner), "rejected" (the best plan of a strategy
    /// the policy allows that the planner ranked out) or "forced".
    pub role: &'static str,
    /// Its stages (and expert split) on the fabric, or why the fabric cannot execute it.
    pub placement: Result<Placement, String>,
    /// The nodes that stream experts from their disks (a single node,
    /// [`tessera_placement::planning::to_streaming_placement`],
    /// or a ring's stages), each with the bytes of experts the plan keeps in its memory (its
    /// `--expert-budget`).
    pub streams: Vec<(String, u64)>,
}

impl Candidate {
    fn new(plan: Plan, role: &'static str, model: &ModelProfile, n_expert: usize) -> Self {
        let n_layer = model.n_layers();
        let placement = to_placement(&plan, n_layer, n_expert).map_err(|e| e.to_string());
        let streams = if placement.is_ok() {
            expert_budgets(model, &plan)
        } else {
            Vec::new()
        };
        Self {
            plan,
            role,
            placement,
            streams,
        }
    }
}

/// The plans a run measures, the planner's choice first. A runner-up is the planner's best plan
/// of its strategy on its own nodes; a strategy with no feasible plan has no row.
pub fn candidates(
    model: &ModelProfile,
    profile: &tessera_model::ModelProfile,
    graph: &ResourceGraph,
    outcome: &PlanOutcome,
    force: &Force,
) -> Result<Vec<Candidate>, CandidatesError> {
    let n_expert = profile.config.n_expert;
    let mut out = vec![Candidate::new(
        outcome.plan.clone(),
        "choice",
        model,
        n_expert,
    )];
    let push = |plan: Plan, role, out: &mut Vec<Candidate>| {
        if !out.iter().any(|c| c.plan.cells == plan.cells) {
            out.push(Candidate::new(plan, role, model, n_expert));
        }
    };
    // What the coordinator's `--plan auto` would run when the choice cannot execute.
    if out[0].placement.is_err() {
        if let Ok(o) = plan_executable(model, graph, 1) {
            push(o.plan, "executable choice", &mut out);
        }
    }
    if let Some(s) = force.strategy {
        let mut g = graph.clone();
        g.policy.strategies = vec![s];
        let o = tessera_plan::plan(model, &g, 1)
            .map_err(|error| CandidatesError::Strategy { strategy: s, error })?;
        push(o.plan, "forced", &mut out);
    }
    if let Some(split) = &force.split {
        push(forced_split(model, graph, split)?, "forced", &mut out);
    }
    if force.strategy.is_some() || force.split.is_some() {
        return Ok(out);
    }
    for alt in &outcome.explanation.alternatives {
        let mut g = graph.clone();
        g.nodes.retain(|n| alt.nodes.contains(&n.name));
        g.policy.strategies = vec![alt.strategy];
        match tessera_plan::plan(model, &g, 1) {
            Ok(o) => push(o.plan, "runner-up", &mut out),
            // Listed by the planner but not re-plannable alone: keep its reason visible.
            Err(error) => {
                return Err(CandidatesError::Replan {
                    description: alt.description.clone(),
                    error,
                })
            }
        }
    }
    // Every strategy the policy allows is measured (or listed), also those the planner ranked
    // out, so the table shows whether ranking them out was right.
    for &s in &graph.policy.strategies {
        if out.iter().any(|c| c.plan.strategy == s) {
            continue;
        }
        let mut g = graph.clone();
        g.policy.strategies = vec![s];
        let mut best = tessera_plan::plan(model, &g, 1);
        if best.is_err() {
            // As the coordinator does: an expert split with every weight in memory, where with
            // disks the planner keeps every expert home and streams them.
            for n in &mut g.nodes {
                n.disk = None;
            }
            best = tessera_plan::plan(model, &g, 1);
        }
        if let Ok(o) = best {
            push(o.plan, "rejected", &mut out);
        }
    }
    Ok(out)
}

/// Parses `NODE=START..END,…` into (node, range) parts.
pub fn parse_split(s: &str) -> Result<Vec<(String, LayerRange)>, CandidatesError> {
    let bad = |why| CandidatesError::SplitSyntax {
        split: s.to_string(),
        why,
    };
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|part| {
            let (node, range) = part
                .split_once('=')
                .ok_or_else(|| bad(SplitSyntax::NoEquals))?;
            let (a, b) = range
                .split_once("..")
                .ok_or_else(|| bad(SplitSyntax::NoRange))?;
            let (a, b): (usize, usize) = (
                a.trim().parse().map_err(|_| bad(SplitSyntax::BadStart))?,
                b.trim().parse().map_err(|_| bad(SplitSyntax::BadEnd))?,
            );
            if a >= b {
                return Err(bad(SplitSyntax::EmptyRange));
            }
            Ok((node.trim().to_string(), LayerRange::new(a, b)))
        })
        .collect()
}

/// The plan of a given split, costed on `graph`: the planner's own plan for those nodes (a
/// single node or a ring) with its stages' layers replaced by the split's.
fn forced_split(
    model: &ModelProfile,
    graph: &ResourceGraph,
    split: &str,
) -> Result<Plan, CandidatesError> {
    let parts = parse_split(split)?;
    if let Some((n, _)) = parts.iter().find(|(n, _)| graph.node(n).is_none()) {
        return Err(CandidatesError::SplitNode { node: n.clone() });
    }
    let (kind, strategy) = if parts.len() == 1 {
        (CellKind::Single, StrategyKind::Single)
    } else {
        (CellKind::Stage, StrategyKind::Stage)
    };
    // A template of the right kind, for the shape of its assignments (which weights a stage
    // holds for this model); its placement is then replaced.
    let mut g = graph.clone();
    g.policy.strategies = vec![strategy];
    let mut plan = tessera_plan::plan(model, &g, 1)
        .map_err(|error| CandidatesError::SplitTemplate { strategy, error })?
        .plan;
    let cell = plan
        .cells
        .first_mut()
        .filter(|c| c.kind == kind)
        .ok_or(CandidatesError::SplitCell { strategy })?;
    let shape = cell.assignments[0].clone();
    let last = parts.len() - 1;
    cell.assignments = parts
        .iter()
        .enumerate()
        .map(|(i, (node, layers))| {
            let mut a = shape.clone();
            a.node = node.clone();
            a.layers = Some(*layers);
            a.ffn = shape.ffn.map(|_| *layers);
            a.experts = shape.experts.map(|x| ExpertSlice {
                layers: *layers,
                experts: x.experts,
            });
            a.embedding = i == 0;
            a.head = i == last;
            a
        })
        .collect();
    plan.strategy = strategy;
    plan.predicted = predict(model, graph, &plan).map_err(|error| CandidatesError::SplitCost {
        split: split.to_string(),
        error,
    })?;
    Ok(plan)
}

/// The plan in one line: each node with its layers (or experts).
pub fn describe(plan: &Plan) -> String {
    let mut parts = Vec::new();
    for (i, cell) in plan.cells.iter().enumerate() {
        let nodes: Vec<String> = cell
            .assignments
            .iter()
            .map(|a| match (a.layers, a.experts) {
                (Some(l), _) if a.memory.experts_on_disk.0 > 0 => format!(
                    "{}[{}..{}) streaming {:.0} MiB",
                    a.node,
                    l.start,
                    l.end,
                    a.memory.experts_on_disk.0 as f64 / f64::from(1 << 20)
                ),
                (Some(l), _) => format!("{}[{}..{})", a.node, l.start, l.end),
                (None, Some(x)) => format!("{}{{e{}..{}}}", a.node, x.experts.start, x.experts.end),
                (None, None) => a.node.clone(),
            })
            .collect();
        let sep = if cell.kind == CellKind::Expert {
            " + "
        } else {
            " -> "
        };
        parts.push(if plan.cells.len() > 1 {
            format!("#{i} {}", nodes.join(sep))
        } else {
            nodes.join(sep)
        });
    }
    parts.join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_is_parsed_in_ring_order_and_bad_ones_say_why() {
        let p = parse_split("a=0..2, b=2..3").unwrap();
        assert_eq!(p[0], ("a".into(), LayerRange::new(0, 2)));
        assert_eq!(p[1], ("b".into(), LayerRange::new(2, 3)));
        let why = |s: &str| match parse_split(s) {
            Err(CandidatesError::SplitSyntax { split, why }) => {
                assert_eq!(split, s);
                why
            }
            other => panic!("{s:?}: {other:?}"),
        };
        assert_eq!(why("a:0..2"), SplitSyntax::NoEquals);
        assert_eq!(why("a=0:2"), SplitSyntax::NoRange);
        assert_eq!(why("a=x..2"), SplitSyntax::BadStart);
        assert_eq!(why("a=0..y"), SplitSyntax::BadEnd);
        assert_eq!(why("a=0..1,b=2..2"), SplitSyntax::EmptyRange);
    }
}
