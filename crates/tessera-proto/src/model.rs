//! Model distribution ([`super::stream::MODEL`]): manifest and chunk requests and replies, and
//! the [`super::frame::CHUNK`] payload encoding.

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::frame;
use super::FrameDecodeError;
use tessera_host::ContentHash;

/// Model-stream requests (node → coordinator).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ModelRequest {
    Manifest {
        model: ContentHash,
    },
    /// Send these chunks, in this order, as [`frame::CHUNK`] frames, then
    /// [`ModelReply::ChunksDone`].
    Chunks {
        model: ContentHash,
        ids: Vec<u32>,
    },
}

/// Model-stream replies.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ModelReply {
    Manifest(Box<tessera_host::Manifest>),
    ChunksDone { count: u64 },
    Error { message: String },
}

/// Encodes a chunk frame payload: `u32 id` LE then the bytes.
pub fn encode_chunk(id: u32, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + bytes.len());
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(bytes);
    out
}

/// Splits a chunk frame payload into its id and bytes.
pub fn decode_chunk(payload: &[u8]) -> Result<(u32, &[u8]), FrameDecodeError> {
    if payload.len() < 4 {
        return Err(FrameDecodeError::Short {
            len: payload.len(),
            need: 4,
        });
    }
    Ok((
        u32::from_le_bytes(payload[0..4].try_into().expect("4 bytes")),
        &payload[4..],
    ))
}
