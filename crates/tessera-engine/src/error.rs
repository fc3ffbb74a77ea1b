//! Errors from loading and running a model. Each names what is at fault: the tensor, the layer
//! range, the limit.

use std::ops::Range;

use tessera_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("tensor '{tensor}': {what}")]
    Tensor { tensor: String, what: String },
    #[error("tensor '{tensor}' has type {type_name}, which the engine cannot compute with")]
    UnsupportedType { tensor: String, type_name: String },
    #[error("layers {requested:?} are not all loaded (this model holds layers {loaded:?})")]
    LayersNotLoaded {
        requested: Range<usize>,
        loaded: Range<usize>,
    },
    #[error("layer {layer}: expert {expert} is not loaded in this part")]
    ExpertNotLoaded { layer: usize, expert: usize },
    #[error("{what} is not loaded in this part (see LoadSpec)")]
    NotLoaded { what: &'static str },
    #[error("sequence needs {needed} positions, but the context limit is {limit}")]
    ContextOverflow { needed: usize, limit: usize },
    #[error("token id {token} is outside the vocabulary of {vocab_size}")]
    BadToken { token: u32, vocab_size: usize },
    #[error("invalid input: {0}")]
    BadInput(String),
    #[error("expert outputs: {0}")]
    ExpertOutputs(String),
    /// A remote expert worker failed the step; `fault` is the executor's own error type (the
    /// engine only carries it, so callers can downcast and match it).
    #[error("expert worker {peer}: {fault}")]
    ExpertPeer {
        peer: String,
        fault: Box<dyn std::error::Error + Send + Sync>,
    },
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

impl From<tessera_model::kv::KvTypeUnfit> for EngineError {
    fn from(e: tessera_model::kv::KvTypeUnfit) -> Self {
        Self::BadInput(e.to_string())
    }
}
