//! Errors of the node agent and the fabric's node side.

use crate::inventory::{BudgetError, BudgetRefusal};
use crate::stage::StageError;
use crate::store::{FetchError, StoreError};
use tessera_proto::FrameDecodeError;

/// Everything that can stop the agent, or one of its tasks.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    #[error(transparent)]
    Net(#[from] tessera_net::NetError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Fetch(#[from] Box<FetchError>),
    #[error(transparent)]
    Engine(#[from] tessera_engine::EngineError),
    #[error(transparent)]
    Model(#[from] tessera_model::ModelError),
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error(transparent)]
    Budget(#[from] BudgetError),
    #[error("over the memory budget: {0}")]
    OverBudget(#[from] BudgetRefusal),
    #[error(transparent)]
    Frame(#[from] FrameDecodeError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The peer broke the protocol (unexpected message, wrong order).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The coordinator refused this node's session.
    #[error("the coordinator refused this node: {0}")]
    Refused(String),
    /// The node has no coordinator record and was given no join token.
    #[error("this node has not enrolled yet: pass --join TOKEN@HOST:PORT")]
    NotEnrolled,
    /// The node and the coordinator speak different protocol versions.
    #[error("protocol version mismatch: ours {ours}, theirs {theirs}")]
    VersionMismatch { ours: u32, theirs: u32 },
    /// A task ended before finishing its work.
    #[error("{0}")]
    Stopped(String),
}

impl FabricError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}
