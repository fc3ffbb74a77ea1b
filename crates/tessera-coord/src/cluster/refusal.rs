//! Why a request never became a run, as data: the HTTP and CLI front ends turn it into their
//! own words and statuses, tests match its variants.

use std::time::Duration;

use crate::assignment::AssignmentError;
use crate::cells::NoCell;
use crate::membership::EpochFailure;
use crate::replan::NoPlacement;

/// Why a request never became a run.
#[derive(Debug)]
pub enum RunRefused {
    /// The stages it asked for do not resolve against the model and the nodes.
    Assignment(AssignmentError),
    /// No cell can take it, and none is coming.
    Unavailable(Unavailable),
    /// No cell took it in time.
    Timeout(PlacementTimeout),
}

/// Why no cell can take a request, and none is coming.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// No split of the connected nodes fits the model.
    #[error("service unavailable: {0}")]
    Outage(NoPlacement),
    /// The epoch it would run on failed.
    #[error("service unavailable: epoch {epoch} failed: {why}")]
    EpochFailed { epoch: u64, why: EpochFailure },
    /// The epoch it was placed on was replaced before it started (`None`: no longer known).
    #[error("{}", match .0 { Some(e) => format!("epoch {e} was replaced"), None => "the epoch was replaced".into() })]
    EpochReplaced(Option<u64>),
    /// Nothing was ever planned, and no planner runs.
    #[error("no assignment is active: give the stages (e.g. --split 0..3,3..5)")]
    NoAssignment,
    /// No cell could hold it even idle.
    #[error("{0}")]
    NoCell(NoCell),
}

/// Why a request waited in vain for a cell.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementTimeout {
    #[error("epoch {0} did not become ready")]
    EpochNotReady(u64),
    #[error("no cell could take the request within {0:?}")]
    NoCell(Duration),
}

impl From<RunRefused> for crate::CoordError {
    fn from(r: RunRefused) -> Self {
        match r {
            RunRefused::Assignment(e) => Self::Assignment(e),
            RunRefused::Unavailable(u) => Self::Run(u.to_string()),
            RunRefused::Timeout(t) => Self::Timeout(t.to_string()),
        }
    }
}
