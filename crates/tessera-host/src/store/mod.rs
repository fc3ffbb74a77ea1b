//! The shard store: a node receives only the tensors its assignment needs, verified chunk by
//! chunk, cached across restarts, resumable after interruption.
//!
//! A [`Manifest`] describes one GGUF file by content: the blake3 hash of the whole file, the
//! header (everything before the tensor data) and, for each tensor, its place in the file and the
//! blake3 hashes of its fixed-size chunks. The coordinator builds it from its copy of the model
//! ([`Manifest::from_gguf`]) and sends it to nodes.
//!
//! On the node, [`ShardStore`] keeps `data_dir/models/<model-hash>/`:
//!
//! - `model.gguf`: a *sparse* file with the original's length and layout — the header at the
//!   start, each received tensor at its original offset, everything else a hole — so the engine
//!   opens it with the ordinary GGUF reader and maps it;
//! - `state.json`: which chunks are present (a bitmap), replaced atomically (write, fsync,
//!   rename) and only after the data it vouches for has been synced;
//! - `manifest.json`: the manifest the state refers to.
//!
//! Every chunk is checked against the manifest's hash before it is written; a bad chunk is
//! rejected with an error naming the tensor and chunk. [`fetch`] pulls the missing chunks of the
//! named tensors from any [`ChunkSource`] (a local file here; a network stream later) and reports
//! the bytes it moved; [`fetch_needs`] does the same for byte ranges of tensors ([`Need`]), so
//! that a node owning some experts of a packed expert tensor receives only the chunks that
//! overlap them ([`expert_needs`]). A node that already holds the whole file adopts it
//! ([`ShardStore::adopt`]) and downloads nothing.
//!
//! Trust: the manifest is the root of trust. It should come from the authenticated coordinator;
//! the store checks that it is well formed and that the received header agrees with it, and
//! every byte written is checked against it.

#[cfg(test)]
use std::path::{Path, PathBuf};

mod error;
mod fetching;
mod files;
mod hash;
mod manifest;
mod model_state;
mod needs;
mod shard_store;

pub use error::StoreError;
pub use fetching::{
    fetch, fetch_needs, ChunkSource, FetchError, FetchProgress, FetchReport, FileSource,
};
pub use hash::ContentHash;
pub use manifest::{
    ChunkRef, Manifest, Part, Section, DEFAULT_CHUNK_SIZE, MANIFEST_FORMAT, MAX_CHUNK_SIZE,
};
pub use needs::{expert_needs, Need};
pub use shard_store::{ShardStore, VerifyReport, DEFAULT_FLUSH_EVERY};

/// The GGUF files under `models/test`, shared by the unit tests of the submodules.
#[cfg(test)]
fn test_model(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/test")
        .join(name)
}
