//! What goes wrong on the client's side of a session.

/// A client session's failure.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Net(#[from] tessera_net::NetError),
    /// The coordinator (or an answer through it) broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Refused: by the coordinator, or an answer this client will not release.
    #[error("refused: {0}")]
    Refused(String),
}
