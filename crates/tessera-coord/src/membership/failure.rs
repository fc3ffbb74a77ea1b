//! Why an epoch failed, as data: the membership machine decides it, the cluster logs it and
//! refuses runs with it, `/api/status` and `state.redb` show its sentence.

use tessera_net::NodeId;

/// How a node stopped being there for an epoch ([`EpochFailure::NodeGone`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Departure {
    /// Its control session ended.
    Left,
    /// It went silent past the lease.
    MissedLease,
    /// It came back as a new process (what it held is gone).
    Restarted,
}

impl std::fmt::Display for Departure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Left => "left",
            Self::MissedLease => "missed its lease",
            Self::Restarted => "restarted",
        })
    }
}

/// Why an epoch failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EpochFailure {
    /// One of its nodes said it could not load or link it (`reason` is the node's words).
    Reported { node: NodeId, reason: String },
    /// One of its nodes went: a ring stage, or a node holding experts only.
    NodeGone {
        node: NodeId,
        expert_only: bool,
        how: Departure,
    },
    /// Re-planning found no split of the nodes left.
    NoFeasiblePlan(crate::replan::NoPlacement),
    /// Its plan could not start (the placement's reason).
    CannotStart(String),
    /// Several cells were asked for with an expert split, which spreads one copy of the
    /// experts over its nodes.
    ExpertSplitIsOneCell,
}

impl std::fmt::Display for EpochFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Reported { node, reason } => write!(f, "node {}: {reason}", node.short()),
            Self::NodeGone {
                node,
                expert_only,
                how,
            } => {
                let role = if *expert_only {
                    "expert node"
                } else {
                    "stage node"
                };
                write!(f, "{role} {} {how}", node.short())
            }
            Self::NoFeasiblePlan(reason) => write!(f, "no feasible plan: {reason}"),
            Self::CannotStart(reason) => f.write_str(reason),
            Self::ExpertSplitIsOneCell => {
                f.write_str("an expert split runs as one cell: give one ring")
            }
        }
    }
}
