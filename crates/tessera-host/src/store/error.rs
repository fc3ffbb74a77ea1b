//! [`StoreError`]: what went wrong in the shard store, with enough context to act on.

use std::io;
use std::path::PathBuf;

use tessera_model::{human_bytes, ModelError};

use super::{ContentHash, Part};

/// What went wrong in the shard store, with enough context to act on.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("bad manifest: {0}")]
    BadManifest(String),
    #[error("model {model} has no tensor named `{name}`")]
    UnknownTensor { model: String, name: String },
    #[error(
        "bytes {start}..{end} of tensor `{tensor}` of model {model} are not within its {len} bytes"
    )]
    BadRange {
        model: String,
        tensor: String,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("tensor `{tensor}`: {what}")]
    Experts { tensor: String, what: String },
    #[error("{chunk} does not belong to model {model}: {what}")]
    UnknownChunk {
        model: String,
        chunk: String,
        what: String,
    },
    #[error("{chunk} rejected: expected {expected} bytes, received {actual}")]
    WrongLength {
        chunk: String,
        expected: u64,
        actual: u64,
    },
    #[error(
        "chunk {index} of {part} (file bytes {offset}..{end}) rejected: its blake3 is {actual}, \
         the manifest says {expected}"
    )]
    HashMismatch {
        part: Part,
        index: u32,
        offset: u64,
        end: u64,
        expected: ContentHash,
        actual: ContentHash,
    },
    #[error("reading {chunk} from the source: {source}")]
    Source {
        chunk: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "not enough disk space in {}: {} to receive, {} free",
        dir.display(),
        human_bytes(*needed),
        human_bytes(*free)
    )]
    NoSpace {
        dir: PathBuf,
        needed: u64,
        free: u64,
    },
    #[error("{}: the received header disagrees with the manifest: {what}", path.display())]
    HeaderMismatch { path: PathBuf, what: String },
    #[error("{}: {what}", path.display())]
    Adopt { path: PathBuf, what: String },
}

pub(super) fn io_err(context: String) -> impl FnOnce(io::Error) -> StoreError {
    move |source| StoreError::Io { context, source }
}
