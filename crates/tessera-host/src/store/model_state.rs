//! What the store knows about one model, kept in `data_dir/models/<model-hash>/`: the sparse
//! `model.gguf`, the presence bitmap persisted in `state.json` (replaced atomically, and only
//! after the data it vouches for has been synced), the `manifest.json` it refers to, and an
//! adopted original, if any.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::error::io_err;
use super::files::write_atomic;
use super::manifest::Index;
use super::{ChunkSource, ContentHash, FileSource, Manifest, StoreError};

pub(super) const MODEL_FILE: &str = "model.gguf";
pub(super) const STATE_FILE: &str = "state.json";
pub(super) const MANIFEST_FILE: &str = "manifest.json";
pub(super) const STATE_FORMAT: u32 = 1;

/// Size and modification time of a file, to notice an adopted file being replaced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct FileStamp {
    len: u64,
    modified_unix_ns: Option<u64>,
}

impl FileStamp {
    pub(super) fn of(path: &Path) -> io::Result<Self> {
        let meta = std::fs::metadata(path)?;
        let modified_unix_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .and_then(|d| u64::try_from(d.as_nanos()).ok());
        Ok(Self {
            len: meta.len(),
            modified_unix_ns,
        })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Adopted {
    pub(super) path: PathBuf,
    pub(super) stamp: FileStamp,
}

/// `state.json`.
#[derive(Serialize, Deserialize)]
pub(super) struct StateFile {
    pub(super) format: u32,
    pub(super) model_hash: ContentHash,
    pub(super) chunk_size: u32,
    pub(super) n_chunks: u32,
    /// Presence bitmap: bit `id % 8` of byte `id / 8`, as hex.
    pub(super) present: String,
    pub(super) adopted: Option<Adopted>,
    updated_unix_ms: u64,
}

fn bitmap_to_hex(bits: &[u64], n: u32) -> String {
    let n_bytes = (n as usize).div_ceil(8);
    bits.iter()
        .flat_map(|w| w.to_le_bytes())
        .take(n_bytes)
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub(super) fn bitmap_from_hex(hex: &str, n: u32) -> Option<Vec<u64>> {
    let n_bytes = (n as usize).div_ceil(8);
    if hex.len() != 2 * n_bytes || !hex.is_ascii() {
        return None;
    }
    let mut bits = vec![0u64; (n as usize).div_ceil(64)];
    for i in 0..n_bytes {
        let b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
        bits[i / 8] |= u64::from(b) << (8 * (i % 8));
    }
    Some(bits)
}

/// What the store knows about one model.
pub(super) struct ModelState {
    pub(super) dir: PathBuf,
    pub(super) manifest: Arc<Manifest>,
    pub(super) index: Index,
    pub(super) present: Vec<u64>,
    /// The sparse file, once opened for writing.
    pub(super) file: Option<File>,
    /// Whether an existing `model.gguf` has the right length and may be kept.
    pub(super) file_ok: bool,
    /// Chunks written since the state was last persisted.
    pub(super) dirty: u32,
    pub(super) manifest_saved: bool,
    pub(super) adopted: Option<Adopted>,
}

impl ModelState {
    pub(super) fn has(&self, id: u32) -> bool {
        self.adopted.is_some() || self.present[(id / 64) as usize] >> (id % 64) & 1 == 1
    }

    pub(super) fn set(&mut self, id: u32) {
        self.present[(id / 64) as usize] |= 1 << (id % 64);
    }

    pub(super) fn sparse_path(&self) -> PathBuf {
        self.dir.join(MODEL_FILE)
    }

    pub(super) fn path(&self) -> PathBuf {
        match &self.adopted {
            Some(a) => a.path.clone(),
            None => self.sparse_path(),
        }
    }

    /// Opens (creating if needed) the sparse file at its full length.
    pub(super) fn file(&mut self) -> Result<&File, StoreError> {
        if self.file.is_none() {
            std::fs::create_dir_all(&self.dir)
                .map_err(io_err(format!("creating {}", self.dir.display())))?;
            let path = self.sparse_path();
            let ctx = |what: &str| format!("{what} {}", path.display());
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(!self.file_ok)
                .open(&path)
                .map_err(io_err(ctx("opening")))?;
            let len = f.metadata().map_err(io_err(ctx("reading size of")))?.len();
            if len != self.manifest.file_len {
                // Extending leaves a hole: no disk blocks until a chunk lands there.
                f.set_len(self.manifest.file_len)
                    .map_err(io_err(ctx("sizing")))?;
            }
            self.file_ok = true;
            self.file = Some(f);
        }
        Ok(self.file.as_ref().expect("just opened"))
    }

    /// Makes the presence state durable: data first, then the state that vouches for it.
    pub(super) fn persist(&mut self) -> Result<(), StoreError> {
        if self.dirty == 0 {
            return Ok(());
        }
        std::fs::create_dir_all(&self.dir)
            .map_err(io_err(format!("creating {}", self.dir.display())))?;
        if let Some(f) = &self.file {
            f.sync_data()
                .map_err(io_err(format!("syncing {}", self.sparse_path().display())))?;
        }
        if !self.manifest_saved {
            self.manifest.save(self.dir.join(MANIFEST_FILE))?;
            self.manifest_saved = true;
        }
        let state = StateFile {
            format: STATE_FORMAT,
            model_hash: self.manifest.model_hash,
            chunk_size: self.manifest.chunk_size,
            n_chunks: self.index.n_chunks,
            present: bitmap_to_hex(&self.present, self.index.n_chunks),
            adopted: self.adopted.clone(),
            updated_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        };
        let json = serde_json::to_vec(&state).expect("state serializes");
        write_atomic(&self.dir.join(STATE_FILE), &json)?;
        self.dirty = 0;
        Ok(())
    }

    /// Whether a sparse file of the right length exists.
    pub(super) fn sparse_file_ok(&self) -> bool {
        std::fs::metadata(self.sparse_path()).is_ok_and(|m| m.len() == self.manifest.file_len)
    }

    /// Sets the presence bitmap to what the sparse file's bytes prove (nothing if it is missing,
    /// the wrong length or unreadable), and marks the state for saving.
    pub(super) fn rebuild_from_sparse_file(&mut self) {
        let empty = vec![0; (self.index.n_chunks as usize).div_ceil(64)];
        self.file_ok = self.sparse_file_ok();
        self.present = if self.file_ok {
            self.scan(&self.sparse_path(), true).unwrap_or_else(|_| {
                self.file_ok = false;
                empty
            })
        } else {
            empty
        };
        self.dirty = 1;
    }

    /// Re-hashes the chunks marked present in `path` (or all chunks, with `all`), returning the
    /// presence bitmap the bytes on disk actually support.
    pub(super) fn scan(&self, path: &Path, all: bool) -> Result<Vec<u64>, StoreError> {
        let m = &self.manifest;
        let mut bits = vec![0u64; (self.index.n_chunks as usize).div_ceil(64)];
        // Through a FileSource, which reads an adopted split model's parts as its one file.
        let source =
            FileSource::open(path).map_err(io_err(format!("opening {}", path.display())))?;
        for sec in 0..=m.tensors.len() {
            let s = m.section(sec);
            for (i, expected) in s.chunks.iter().enumerate() {
                let c = m.chunk_ref(&self.index, sec, i as u32);
                if !all && !self.has(c.id) {
                    continue;
                }
                let buf = source
                    .read_chunk(&c)
                    .map_err(io_err(format!("reading {c} from {}", path.display())))?;
                if ContentHash::of(&buf) == *expected {
                    bits[(c.id / 64) as usize] |= 1 << (c.id % 64);
                }
            }
        }
        Ok(bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmap_hex_round_trip() {
        for n in [1u32, 7, 8, 9, 63, 64, 65, 200] {
            let mut bits = vec![0u64; (n as usize).div_ceil(64)];
            for id in (0..n).filter(|i| i % 3 == 0 || i % 7 == 1) {
                bits[(id / 64) as usize] |= 1 << (id % 64);
            }
            let hex = bitmap_to_hex(&bits, n);
            assert_eq!(hex.len(), 2 * (n as usize).div_ceil(8));
            assert_eq!(bitmap_from_hex(&hex, n), Some(bits));
        }
        assert_eq!(bitmap_from_hex("zz", 8), None);
        assert_eq!(bitmap_from_hex("00", 9), None);
    }
}
