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
    /// A scenario file could not be read or parsed.
    #[error("scenario {path}: {message}")]
    Scenario { path: String, message: String },
    /// A process in the lab did not do what was expected of it.
    #[error("{0}")]
    Run(String),
}

impl LabError {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }
}

/// The lab's result.
pub type Result<T> = std::result::Result<T, LabError>;
