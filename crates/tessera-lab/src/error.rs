//! The lab's one error type.

use std::io;

/// What can go wrong building, running or cleaning a lab.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// The machine cannot host a lab: not root, no `ip`, no `/dev/net/tun`, no namespaces.
    #[error("this machine cannot create a lab: {0}")]
    Unsupported(String),
    /// A system call or file operation failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    /// An `ip` (or other helper) command failed.
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    /// The lab description is wrong (unknown host, bad figure, …).
    #[error("lab description: {0}")]
    Spec(String),
    /// A scenario file was refused: `problem` says why (boxed: its TOML errors are large, and
    /// every result of the lab carries this type).
    #[error("scenario {path}: {problem}")]
    Scenario {
        path: String,
        problem: Box<crate::scenario::ScenarioError>,
    },
    /// The model file could not be read: opened, or its configuration, profile or tokenizer.
    #[error("the model {path}: {message}")]
    Model { path: String, message: String },
    /// What was asked cannot be run on this model or these hosts (too many stages for its
    /// layers, a prompt longer than its context, too few hosts or streams).
    #[error("{0}")]
    Unrunnable(String),
    /// A process in the lab exited with a failure.
    #[error("{process} failed: {message}")]
    ProcessFailed { process: String, message: String },
    /// A process did not report what it should have in time (an event, a token, a report).
    #[error("{process} reported no {what} within {timeout:?}{detail}")]
    Silent {
        process: String,
        what: String,
        timeout: std::time::Duration,
        /// What it had said, or the end of its log (empty or starting with a separator).
        detail: String,
    },
    /// A process's output could not be read as what it should be.
    #[error("{process}'s {what} was not readable: {message}")]
    Unreadable {
        process: String,
        what: String,
        message: String,
    },
    /// The planner could not plan the scenario.
    #[error("planning: {0}")]
    Plan(#[from] tessera_plan::PlanError),
    /// A plan could not be written as the coordinator reads it.
    #[error("writing a plan file: {0}")]
    PlanFile(#[source] serde_json::Error),
    /// The plans to measure could not be listed (a forced strategy or split, a runner-up).
    /// Not a `#[source]`: the text says it already.
    #[error("planning: {0}")]
    Candidates(crate::run::plans::CandidatesError),
    /// A path whose reads the lab caps is on no block device to cap (a memory or network file
    /// system); `via` says how it was followed there.
    #[error(
        "{via}: no block device to cap (a memory or network file system?); give the lab a \
         directory on a disk"
    )]
    NoBlockDevice {
        path: std::path::PathBuf,
        via: String,
    },
    /// A measurement produced nothing to measure (no overlap of the streams, an empty transfer).
    #[error("nothing to measure: {0}")]
    NothingMeasured(String),
    /// A helper thread of the lab panicked.
    #[error("the lab's {0} thread panicked")]
    ThreadPanicked(&'static str),
}

impl LabError {
    /// [`LabError::Model`] for the model at `path`.
    pub(crate) fn model(path: &std::path::Path, message: impl std::fmt::Display) -> Self {
        Self::Model {
            path: path.display().to_string(),
            message: message.to_string(),
        }
    }

    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }
}

/// The lab's result.
pub type Result<T> = std::result::Result<T, LabError>;
