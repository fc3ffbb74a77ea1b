//! [`Note`]: a decision the membership machine made on its own that the operator should read
//! in the log (experts re-placed, a cell left unplaced, a link avoided). Data, so that tests
//! and the simulator match what was decided rather than how it was worded; the sentence is its
//! `Display`.

use std::fmt;

use tessera_net::NodeId;

use crate::assignment::ids_spec;
use crate::replan::NoPlacement;

/// Experts given to one holder when their owner left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MovedExperts {
    pub experts: Vec<usize>,
    /// The holder's name.
    pub to: String,
    /// The holder is now beyond its memory budget: it streams experts from disk.
    pub streams: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Note {
    /// The experts of nodes that left went to the others.
    ExpertsReplaced {
        orphans: Vec<usize>,
        /// The departed owners' names.
        gone: Vec<String>,
        moved: Vec<MovedExperts>,
    },
    /// A new split made beside the serving one failed; the cell is planned again after the
    /// serving one is released.
    SuccessorFailed {
        cell: usize,
        node: NodeId,
        reason: String,
    },
    /// A better split was looked for and none is feasible: the cell keeps what it has.
    KeepsSplit { cell: usize, reason: NoPlacement },
    /// A cell cannot be placed; the other cells serve.
    CellNotPlaced { cell: usize, reason: NoPlacement },
    /// A new epoch took the cell; the old one drains its runs.
    Replaces { epoch: u64, old: u64, cell: usize },
    /// A split made beside the serving one cannot start; the serving epoch goes on.
    SuccessorCannotStart {
        cell: usize,
        epoch: u64,
        reason: String,
    },
    /// Two nodes cannot reach each other: plans keep them apart until either rejoins.
    LinkLost { between: (String, String) },
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ExpertsReplaced {
                orphans,
                gone,
                moved,
            } => {
                write!(
                    f,
                    "experts {} of {} (gone) re-placed: ",
                    ids_spec(orphans),
                    gone.join(", ")
                )?;
                for (i, m) in moved.iter().enumerate() {
                    let sep = if i == 0 { "" } else { ", " };
                    let over = if m.streams {
                        " (beyond its budget: it streams experts from disk)"
                    } else {
                        ""
                    };
                    write!(f, "{sep}{} to {}{over}", ids_spec(&m.experts), m.to)?;
                }
                Ok(())
            }
            Self::SuccessorFailed { cell, node, reason } => write!(
                f,
                "the new split of cell {cell} failed beside the serving one (node {}: \
                 {reason}); re-planning it after releasing the serving one",
                node.short()
            ),
            Self::KeepsSplit { cell, reason } => write!(
                f,
                "cell {cell} keeps its split: no better one is feasible ({reason})"
            ),
            Self::CellNotPlaced { cell, reason } => write!(
                f,
                "cell {cell} is not placed (no feasible plan: {reason}); the other cells serve"
            ),
            Self::Replaces { epoch, old, cell } => write!(
                f,
                "epoch {epoch} replaces epoch {old} in cell {cell}: epoch {old} drains"
            ),
            Self::SuccessorCannotStart {
                cell,
                epoch,
                reason,
            } => write!(
                f,
                "a new split of cell {cell} (epoch {epoch}) cannot start: {reason}; its epoch \
                 serves on"
            ),
            Self::LinkLost { between: (a, b) } => write!(
                f,
                "the link between {a} and {b} is lost: plans avoid it until either rejoins"
            ),
        }
    }
}
