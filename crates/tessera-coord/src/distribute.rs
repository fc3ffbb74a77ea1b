//! Serving a model's tensors to nodes, over [`stream::MODEL`](tessera_proto::stream::MODEL) streams.
//!
//! The coordinator describes its model file by content ([`Manifest`]: whole-file blake3 hash,
//! per-chunk hashes) and answers two requests: the manifest, and a list of chunk ids, which it
//! streams back in the order asked, each as a `CHUNK` frame, then `ChunksDone`. The node chooses
//! the ids: whole tensors, or in an expert split only the chunks overlapping its experts' byte
//! ranges (see [`tessera_host::store::Need`]); the chunk size is the manifest's (the
//! coordinator's `--chunk-size` sets it). The node verifies every chunk against the manifest
//! before writing it. The coordinator reads chunks
//! from disk as they are sent: serving a model does not load it into memory.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tessera_host::{ChunkRef, ChunkSource, FileSource, Manifest};
use tessera_net::FramedStream;
use tessera_proto::{encode_chunk, frame, ModelReply, ModelRequest};

use crate::error::CoordError;

/// A model file ready to be served.
pub struct ModelServer {
    manifest: Arc<Manifest>,
    chunks: HashMap<u32, ChunkRef>,
    source: Arc<FileSource>,
    /// Bytes of chunks sent, all nodes together.
    pub bytes_served: AtomicU64,
    progress: bool,
}

impl std::fmt::Debug for ModelServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelServer")
            .field("model", &self.manifest.model_hash)
            .finish_non_exhaustive()
    }
}

impl ModelServer {
    /// Serves `path`, described by `manifest` (built from the same file).
    pub fn new(path: &Path, manifest: Manifest, progress: bool) -> Result<Self, CoordError> {
        let names: Vec<&str> = manifest.tensors.iter().map(|t| t.name.as_str()).collect();
        let chunks = manifest
            .chunks_for(&names)?
            .into_iter()
            .map(|c| (c.id, c))
            .collect();
        let source = FileSource::open(path).map_err(|e| CoordError::Io {
            context: format!("opening {}", path.display()),
            source: e,
        })?;
        Ok(Self {
            manifest: Arc::new(manifest),
            chunks,
            source: Arc::new(source),
            bytes_served: AtomicU64::new(0),
            progress,
        })
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Answers one model stream until the node finishes it. Each request is first put to
    /// `authorize` (who may receive what: [`crate::model_access`]); a refusal is answered
    /// with its reason and no bytes.
    pub async fn serve(
        &self,
        mut s: FramedStream,
        peer: String,
        authorize: &(dyn Fn(&ModelRequest) -> Result<(), String> + Send + Sync),
    ) -> Result<(), CoordError> {
        while let Some(f) = s.reader.read_frame().await? {
            if f.kind != frame::MSG {
                return Err(CoordError::Protocol(format!(
                    "unexpected frame kind {:#06x} on a model stream",
                    f.kind
                )));
            }
            let req: ModelRequest = f.json()?;
            if let Err(message) = authorize(&req) {
                s.writer
                    .write_message(frame::MSG, &ModelReply::Error { message })
                    .await?;
                continue;
            }
            match req {
                ModelRequest::Manifest { model } if model == self.manifest.model_hash => {
                    s.writer
                        .write_message(
                            frame::MSG,
                            &ModelReply::Manifest(Box::new((*self.manifest).clone())),
                        )
                        .await?;
                }
                ModelRequest::Manifest { model } | ModelRequest::Chunks { model, .. }
                    if model != self.manifest.model_hash =>
                {
                    s.writer
                        .write_message(
                            frame::MSG,
                            &ModelReply::Error {
                                message: format!(
                                    "this coordinator serves model {}, not {}",
                                    self.manifest.model_hash.short(),
                                    model.short()
                                ),
                            },
                        )
                        .await?;
                }
                ModelRequest::Chunks { ids, .. } => {
                    let refs: Option<Vec<ChunkRef>> =
                        ids.iter().map(|id| self.chunks.get(id).cloned()).collect();
                    let Some(refs) = refs.filter(|r| r.len() <= self.chunks.len()) else {
                        s.writer
                            .write_message(
                                frame::MSG,
                                &ModelReply::Error {
                                    message: "unknown chunk id".into(),
                                },
                            )
                            .await?;
                        continue;
                    };
                    let total: u64 = refs.iter().map(|c| u64::from(c.len)).sum();
                    let bar = if self.progress {
                        let b = indicatif::ProgressBar::new(total);
                        b.set_style(
                            indicatif::ProgressStyle::with_template(
                                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
                            )
                            .expect("valid template"),
                        );
                        b.set_message(format!("sending to {peer}"));
                        b
                    } else {
                        indicatif::ProgressBar::hidden()
                    };
                    for c in &refs {
                        let src = self.source.clone();
                        let c2 = c.clone();
                        let bytes = tokio::task::spawn_blocking(move || src.read_chunk(&c2))
                            .await
                            .map_err(|e| CoordError::Protocol(format!("reader task: {e}")))?
                            .map_err(|e| CoordError::Io {
                                context: format!("reading {c}"),
                                source: e,
                            })?;
                        s.writer
                            .write_frame(frame::CHUNK, &encode_chunk(c.id, &bytes))
                            .await?;
                        self.bytes_served
                            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                        bar.inc(bytes.len() as u64);
                    }
                    bar.finish_and_clear();
                    tracing::info!(
                        "sent {} chunks ({:.1} MiB) of model {} to {}",
                        refs.len(),
                        total as f64 / f64::from(1u32 << 20),
                        self.manifest.model_hash.short(),
                        peer
                    );
                    s.writer
                        .write_message(
                            frame::MSG,
                            &ModelReply::ChunksDone {
                                count: refs.len() as u64,
                            },
                        )
                        .await?;
                }
                ModelRequest::Manifest { .. } => unreachable!("handled above"),
            }
        }
        s.writer.finish().await?;
        Ok(())
    }
}
