//! Coordinator errors.

/// Everything the coordinator can fail at.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    #[error(transparent)]
    Net(#[from] tessera_net::NetError),
    #[error(transparent)]
    Store(#[from] tessera_host::StoreError),
    #[error(transparent)]
    Model(#[from] tessera_model::ModelError),
    #[error(transparent)]
    Assignment(#[from] crate::assignment::AssignmentError),
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// A peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A generation could not be run.
    #[error("run failed: {0}")]
    Run(String),
    #[error("timed out: {0}")]
    Timeout(String),
    /// The sealing client would not release an answer (it does not match its digest, or it is
    /// not verified and only verified answers were asked for), or would not seal to a worker.
    #[error("refused: {0}")]
    Refused(String),
}
