//! Receiving a model's tensors from the coordinator over a [`stream::MODEL`] stream.
//!
//! The node asks for the manifest, works out with its [`ShardStore`] which chunks of the tensors
//! (or, in an expert split, of the held experts' byte ranges: [`assignment_needs`]) its
//! assignment needs are missing, asks for exactly those in one request, and feeds the
//! replies to the store's [`fetch`] through [`NetChunkSource`]: every chunk is verified against
//! the manifest's blake3 hash before it is written, progress is persisted, and an interrupted
//! transfer resumes where it stopped. The coordinator streams chunks back to back (QUIC flow
//! control is the only brake), so a transfer costs one round trip, not one per chunk.

use std::io;
use std::sync::{Arc, Mutex};

use tessera_net::Connection;
use tokio::sync::mpsc;

use crate::error::FabricError;
use tessera_model::GgufFile;
use tessera_proto::{decode_chunk, frame, limits, stream, ModelReply, ModelRequest};

use crate::store::{
    expert_needs, fetch_needs as store_fetch_needs, ChunkRef, ChunkSource, ContentHash,
    FetchProgress, FetchReport, Manifest, Need, ShardStore,
};

/// Asks the coordinator for the manifest of `model`.
pub async fn fetch_manifest(
    conn: &Connection,
    model: ContentHash,
) -> Result<Manifest, FabricError> {
    let mut s = conn.open_stream(stream::MODEL).await?;
    s.reader.set_max_len(limits::MODEL);
    s.writer
        .write_message(frame::MSG, &ModelRequest::Manifest { model })
        .await?;
    let reply: ModelReply = s.reader.read_message(frame::MSG).await?;
    let _ = s.writer.finish().await;
    match reply {
        ModelReply::Manifest(m) => {
            m.validate()?;
            if m.model_hash != model {
                return Err(FabricError::Protocol(format!(
                    "asked for the manifest of {} and got that of {}",
                    model.short(),
                    m.model_hash.short()
                )));
            }
            Ok(*m)
        }
        ModelReply::Error { message } => Err(FabricError::Protocol(message)),
        other => Err(FabricError::Protocol(format!("unexpected reply {other:?}"))),
    }
}

/// A received chunk (id, bytes), or why the stream failed.
type ChunkResult = Result<(u32, Vec<u8>), String>;

/// A [`ChunkSource`] fed by the network reader task, for the store's blocking [`fetch`].
pub struct NetChunkSource {
    rx: Mutex<mpsc::Receiver<ChunkResult>>,
}

impl ChunkSource for NetChunkSource {
    /// The coordinator sends the requested chunks in ascending id order. The store asks for
    /// what it lacks when it starts writing, which can be fewer than were requested: another
    /// fetch on the same store (a second epoch's load) may have written some meanwhile. Those
    /// come first and are passed over; a chunk past the one due means it was skipped.
    fn read_chunk(&self, chunk: &ChunkRef) -> io::Result<Vec<u8>> {
        let mut rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let e = match rx.blocking_recv() {
                Some(Ok((id, bytes))) if id == chunk.id => return Ok(bytes),
                Some(Ok((id, _))) if id < chunk.id => continue,
                Some(Ok((sent, _))) => ChunkStreamError::OutOfOrder {
                    sent,
                    due: chunk.id,
                },
                Some(Err(e)) => ChunkStreamError::Stream(e),
                None => ChunkStreamError::EndedEarly,
            };
            return Err(io::Error::other(e));
        }
    }
}

/// Why [`NetChunkSource`] could not give the chunk due (inside the `io::Error` the store sees).
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum ChunkStreamError {
    #[error("the coordinator sent chunk {sent} where {due} was due")]
    OutOfOrder { sent: u32, due: u32 },
    #[error("the model stream ended early")]
    EndedEarly,
    #[error("{0}")]
    Stream(String),
}

/// Makes sure `store` holds the header and the tensors `names` of `manifest`, receiving what
/// is missing from the coordinator. `progress(done, total)` is called after each chunk.
pub async fn fetch_tensors(
    conn: &Connection,
    store: Arc<ShardStore>,
    manifest: Arc<Manifest>,
    names: Vec<String>,
    progress: impl FnMut(u64, u64) + Send + 'static,
) -> Result<FetchReport, FabricError> {
    let needs = Need::whole_tensors(&names);
    fetch_needs(conn, store, manifest, needs, progress).await
}

/// What an assignment needs of the tensors `names`: all of each, or with `held` (an expert
/// split: `held[layer]` lists the experts this node loads) only the held experts' byte ranges
/// of the packed expert tensors (see [`expert_needs`]). Reading those tensors' shapes takes
/// the GGUF header, so with `held` the header is received first; the report of that transfer
/// comes back with the needs (fold it into the main fetch's with [`FetchReport::after`]).
pub async fn assignment_needs(
    conn: &Connection,
    store: &Arc<ShardStore>,
    manifest: &Arc<Manifest>,
    names: Vec<String>,
    held: Option<&[Vec<usize>]>,
) -> Result<(Vec<Need>, FetchReport), FabricError> {
    let Some(held) = held else {
        return Ok((Need::whole_tensors(&names), FetchReport::default()));
    };
    let header = fetch_needs(conn, store.clone(), manifest.clone(), Vec::new(), |_, _| {}).await?;
    let (store, manifest, held) = (store.clone(), manifest.clone(), held.to_vec());
    let needs = tokio::task::spawn_blocking(move || -> Result<Vec<Need>, FabricError> {
        let g = GgufFile::open(store.path_for(&manifest))?;
        Ok(expert_needs(&g, &names, &held)?)
    })
    .await
    .map_err(|e| FabricError::Stopped(format!("reading the model header: {e}")))??;
    Ok((needs, header))
}

/// Makes sure `store` holds the header and the chunks overlapping `needs` (see
/// [`Manifest::chunks_for_needs`]), receiving what is missing from the coordinator.
/// `progress(done, total)` is called after each chunk.
pub async fn fetch_needs(
    conn: &Connection,
    store: Arc<ShardStore>,
    manifest: Arc<Manifest>,
    needs: Vec<Need>,
    mut progress: impl FnMut(u64, u64) + Send + 'static,
) -> Result<FetchReport, FabricError> {
    let missing = {
        let (store, manifest, needs) = (store.clone(), manifest.clone(), needs.clone());
        tokio::task::spawn_blocking(move || store.missing_chunks_for(&manifest, &needs))
            .await
            .map_err(|e| FabricError::Stopped(format!("fetch task: {e}")))??
    };
    let (tx, rx) = mpsc::channel(16);
    let reader = if missing.is_empty() {
        None
    } else {
        let mut s = conn.open_stream(stream::MODEL).await?;
        s.reader.set_max_len(limits::MODEL);
        let ids: Vec<u32> = missing.iter().map(|c| c.id).collect();
        let expected = ids.len() as u64;
        s.writer
            .write_message(
                frame::MSG,
                &ModelRequest::Chunks {
                    model: manifest.model_hash,
                    ids,
                },
            )
            .await?;
        Some(tokio::spawn(async move {
            let mut got = 0u64;
            loop {
                let f = match s.reader.recv().await {
                    Ok(f) => f,
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string())).await;
                        return;
                    }
                };
                match f.kind {
                    frame::CHUNK => match decode_chunk(&f.payload) {
                        Ok((id, bytes)) => {
                            got += 1;
                            if tx.send(Ok((id, bytes.to_vec()))).await.is_err() {
                                return; // the fetch stopped (e.g. a bad chunk)
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e.to_string())).await;
                            return;
                        }
                    },
                    frame::MSG => {
                        let msg = match serde_json::from_slice::<ModelReply>(&f.payload) {
                            Ok(ModelReply::ChunksDone { count })
                                if count == expected && got == expected =>
                            {
                                let _ = s.writer.finish().await;
                                return;
                            }
                            Ok(ModelReply::Error { message }) => message,
                            Ok(other) => format!("unexpected reply {other:?}"),
                            Err(e) => format!("bad reply: {e}"),
                        };
                        let _ = tx.send(Err(msg)).await;
                        return;
                    }
                    kind => {
                        let _ = tx
                            .send(Err(format!("unexpected frame kind {kind:#06x}")))
                            .await;
                        return;
                    }
                }
            }
        }))
    };
    let source = NetChunkSource { rx: Mutex::new(rx) };
    let report = tokio::task::spawn_blocking(move || {
        store_fetch_needs(
            &store,
            &manifest,
            &needs,
            &source,
            &mut |p: &FetchProgress<'_>| progress(p.bytes_done, p.bytes_total),
        )
        .map_err(Box::new)
    })
    .await
    .map_err(|e| FabricError::Stopped(format!("fetch task: {e}")))?;
    if let Some(r) = reader {
        r.abort();
    }
    report.map_err(FabricError::Fetch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Part;

    fn due(id: u32) -> ChunkRef {
        ChunkRef {
            id,
            part: Part::Header,
            index: id,
            offset: 0,
            len: 1,
        }
    }

    fn source(ids: &[u32]) -> NetChunkSource {
        let (tx, rx) = mpsc::channel(ids.len().max(1));
        for &id in ids {
            tx.try_send(Ok((id, vec![id as u8]))).unwrap();
        }
        NetChunkSource { rx: Mutex::new(rx) }
    }

    #[test]
    fn chunks_another_fetch_wrote_meanwhile_are_passed_over() {
        // Requested 3, 5, 7; by the time the store wrote, 3 and 5 were already there.
        let s = source(&[3, 5, 7]);
        assert_eq!(s.read_chunk(&due(7)).unwrap(), [7]);
        let s = source(&[3, 5, 7]);
        assert_eq!(s.read_chunk(&due(5)).unwrap(), [5]);
        assert_eq!(s.read_chunk(&due(7)).unwrap(), [7]);
    }

    fn why(e: io::Error) -> ChunkStreamError {
        let inner = e.into_inner().expect("a ChunkStreamError inside");
        *inner
            .downcast::<ChunkStreamError>()
            .expect("a ChunkStreamError")
    }

    #[test]
    fn a_chunk_past_the_one_due_or_an_early_end_is_an_error() {
        let s = source(&[3, 9]);
        assert_eq!(
            why(s.read_chunk(&due(5)).unwrap_err()),
            ChunkStreamError::OutOfOrder { sent: 9, due: 5 }
        );
        let s = source(&[3]);
        assert_eq!(
            why(s.read_chunk(&due(5)).unwrap_err()),
            ChunkStreamError::EndedEarly
        );
    }
}
