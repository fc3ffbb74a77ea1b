//! Why the plans a run measures could not be listed, as data: a forced strategy or split the
//! planner cannot give, or a runner-up it cannot plan again alone. The text is the flag's
//! user's.

use tessera_plan::{PlanError, StrategyKind};

/// Why [`super::candidates`] gave no list.
#[derive(Debug, thiserror::Error)]
pub enum CandidatesError {
    /// `--strategy` names a strategy with no feasible plan on the graph.
    #[error("--strategy {}: {error}", strategy.name())]
    Strategy {
        strategy: StrategyKind,
        error: PlanError,
    },
    /// `--split` is not `NODE=START..END,…`.
    #[error("--split {split:?}: {why} (expected NODE=START..END,…)")]
    SplitSyntax { split: String, why: SplitSyntax },
    /// `--split` names a node the scenario does not declare.
    #[error("--split names {node:?}, which is not a node of the scenario")]
    SplitNode { node: String },
    /// No plan of the split's kind (a single node or a ring) to take its shape from.
    #[error("--split: no {} plan to start from: {error}", strategy.name())]
    SplitTemplate {
        strategy: StrategyKind,
        error: PlanError,
    },
    /// The planner's plan of the split's kind has no cell of that kind.
    #[error("--split: the planner's {} plan has no such cell", strategy.name())]
    SplitCell { strategy: StrategyKind },
    /// The split could not be costed on the graph.
    #[error("--split {split}: {error}")]
    SplitCost { split: String, error: PlanError },
    /// A runner-up the planner listed could not be planned again on its own nodes.
    #[error("re-planning {description}: {error}")]
    Replan {
        description: String,
        error: PlanError,
    },
}

/// What is wrong with one part of a `--split`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SplitSyntax {
    #[error("no '='")]
    NoEquals,
    #[error("no '..'")]
    NoRange,
    #[error("bad start")]
    BadStart,
    #[error("bad end")]
    BadEnd,
    #[error("empty range")]
    EmptyRange,
}
