//! [`ShardStore`]: the node's model cache. It writes verified chunks into each model's sparse
//! file, tells which chunks are missing, adopts a complete local copy, and re-verifies what it
//! holds.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use tessera_model::GgufFile;

use super::error::io_err;
use super::files::write_at;
use super::manifest::Index;
use super::model_state::{
    bitmap_from_hex, Adopted, FileStamp, ModelState, StateFile, MANIFEST_FILE, MODEL_FILE,
    STATE_FILE, STATE_FORMAT,
};
use super::{
    ChunkRef, ChunkSource, ContentHash, FileSource, Manifest, Need, StoreError, DEFAULT_CHUNK_SIZE,
};

/// Chunks written between two persists of the presence state, by default.
pub const DEFAULT_FLUSH_EVERY: u32 = 64;

/// Result of [`ShardStore::verify`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    pub chunks_checked: u64,
    /// Chunks that were marked present but whose bytes no longer match; now marked missing.
    pub chunks_bad: u64,
}

/// The node's model cache: `data_dir/models/<model-hash>/`. Cheap to share across threads.
pub struct ShardStore {
    root: PathBuf,
    models: Mutex<HashMap<ContentHash, Arc<Mutex<ModelState>>>>,
    flush_every: u32,
}

impl fmt::Debug for ShardStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardStore")
            .field("root", &self.root)
            .field("flush_every", &self.flush_every)
            .finish_non_exhaustive()
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves at worst a stale in-memory bitmap, which only ever
    // under-reports what is on disk; carry on.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ShardStore {
    /// Opens (creating) the store under `data_dir`.
    pub fn open(data_dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        let root = data_dir.as_ref().to_owned();
        let models = root.join("models");
        std::fs::create_dir_all(&models)
            .map_err(io_err(format!("creating {}", models.display())))?;
        Ok(Self {
            root,
            models: Mutex::new(HashMap::new()),
            flush_every: DEFAULT_FLUSH_EVERY,
        })
    }

    /// Persists the presence state every `n` chunks (at least 1). Fewer persists cost less I/O;
    /// after a crash at most `n` chunks are received again. [`fetch`] also persists at its end.
    ///
    /// [`fetch`]: super::fetch
    pub fn with_flush_every(mut self, n: u32) -> Self {
        self.flush_every = n.max(1);
        self
    }

    pub fn data_dir(&self) -> &Path {
        &self.root
    }

    /// Where the store keeps a model's files.
    pub fn model_dir(&self, model_hash: &ContentHash) -> PathBuf {
        self.root.join("models").join(model_hash.to_hex())
    }

    /// The file the engine should open for this model: the adopted original if there is one,
    /// else the sparse file (which may not exist yet, or hold only some tensors).
    pub fn path_for(&self, manifest: &Manifest) -> PathBuf {
        match self.state(manifest) {
            Ok(st) => lock(&st).path(),
            Err(_) => self.model_dir(&manifest.model_hash).join(MODEL_FILE),
        }
    }

    /// The file byte ranges this store holds for the model, verified (every byte of an adopted
    /// original), in file order.
    pub fn present_ranges(&self, manifest: &Manifest) -> Result<Vec<Range<u64>>, StoreError> {
        let st = self.state(manifest)?;
        let st = lock(&st);
        if st.adopted.is_some() {
            return Ok(std::iter::once(0..st.manifest.file_len).collect());
        }
        let m = Arc::clone(&st.manifest);
        let mut out: Vec<Range<u64>> = Vec::new();
        for id in (0..st.index.n_chunks).filter(|&id| st.has(id)) {
            let (sec, i) = st.index.locate(id).expect("ids below n_chunks");
            let c = m.chunk_ref(&st.index, sec, i);
            let r = c.offset..c.offset + u64::from(c.len);
            match out.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => out.push(r),
            }
        }
        Ok(out)
    }

    /// Opens the model's file for the engine ([`ShardStore::path_for`]) as a partial copy: its
    /// tensors read as usual where this store holds them, and a read of bytes it never received
    /// fails with [`tessera_model::ModelError::NotFetched`] naming the tensor, instead of
    /// returning the zeros a hole of the sparse file holds.
    pub fn open_model(&self, manifest: &Manifest) -> Result<GgufFile, StoreError> {
        let g = GgufFile::open(self.path_for(manifest))?;
        Ok(g.with_present_ranges(self.present_ranges(manifest)?))
    }

    /// Chunks of the header and the named tensors that this store does not hold, in manifest
    /// order. Unknown tensor names are an error.
    pub fn missing_chunks<S: AsRef<str>>(
        &self,
        manifest: &Manifest,
        names: &[S],
    ) -> Result<Vec<ChunkRef>, StoreError> {
        self.missing_chunks_for(manifest, &Need::whole_tensors(names))
    }

    /// Chunks of [`Manifest::chunks_for_needs`] that this store does not hold, in manifest
    /// order.
    pub fn missing_chunks_for(
        &self,
        manifest: &Manifest,
        needs: &[Need],
    ) -> Result<Vec<ChunkRef>, StoreError> {
        let st = self.state(manifest)?;
        let st = lock(&st);
        let m = Arc::clone(&st.manifest);
        Ok(st
            .index
            .ids_for(&m, needs)?
            .into_iter()
            .filter(|&id| !st.has(id))
            .map(|id| {
                let (sec, i) = st.index.locate(id).expect("ids come from the index");
                m.chunk_ref(&st.index, sec, i)
            })
            .collect())
    }

    /// Whether the header and every named tensor are here, verified.
    pub fn has_all<S: AsRef<str>>(
        &self,
        manifest: &Manifest,
        names: &[S],
    ) -> Result<bool, StoreError> {
        Ok(self.missing_chunks(manifest, names)?.is_empty())
    }

    /// Verifies `bytes` against the manifest's hash for `chunk` and, if they match, writes them
    /// at the chunk's offset in the sparse file and marks the chunk present. A chunk already
    /// present is accepted without writing. A chunk that does not match is rejected with an
    /// error naming its tensor and index, and nothing is written.
    pub fn write_chunk(
        &self,
        manifest: &Manifest,
        chunk: &ChunkRef,
        bytes: &[u8],
    ) -> Result<(), StoreError> {
        let st = self.state(manifest)?;
        let mut st = lock(&st);
        let m = Arc::clone(&st.manifest);
        let unknown = |what: String| StoreError::UnknownChunk {
            model: m.model_hash.short(),
            chunk: chunk.to_string(),
            what,
        };
        let (sec, i) = st
            .index
            .locate(chunk.id)
            .ok_or_else(|| unknown(format!("the manifest has {} chunks", st.index.n_chunks)))?;
        let want = m.chunk_ref(&st.index, sec, i);
        if want != *chunk {
            return Err(unknown(format!("chunk id {} is {want}", chunk.id)));
        }
        if bytes.len() as u64 != u64::from(want.len) {
            return Err(StoreError::WrongLength {
                chunk: want.to_string(),
                expected: u64::from(want.len),
                actual: bytes.len() as u64,
            });
        }
        let expected = m.section(sec).chunks[i as usize];
        let actual = ContentHash::of(bytes);
        if actual != expected {
            return Err(StoreError::HashMismatch {
                end: want.end(),
                part: want.part,
                index: i,
                offset: want.offset,
                expected,
                actual,
            });
        }
        if st.has(want.id) {
            return Ok(());
        }
        let path = st.sparse_path();
        let file = st.file()?;
        write_at(file, want.offset, bytes)
            .map_err(io_err(format!("writing {want} to {}", path.display())))?;
        st.set(want.id);
        st.dirty += 1;
        if st.dirty >= self.flush_every {
            st.persist()?;
        }
        Ok(())
    }

    /// Makes everything written so far for this model durable.
    pub fn flush(&self, manifest: &Manifest) -> Result<(), StoreError> {
        let st = self.state(manifest)?;
        let mut st = lock(&st);
        st.persist()
    }

    /// Records a complete local copy of a model (e.g. given with `--model`) after hashing it:
    /// nothing of it will be downloaded, and [`ShardStore::path_for`] returns `path`. The file
    /// is not copied; if it later changes size or modification time, the adoption lapses.
    pub fn adopt(&self, path: impl AsRef<Path>) -> Result<Manifest, StoreError> {
        self.adopt_with(path, DEFAULT_CHUNK_SIZE, &mut |_, _| {})
    }

    /// [`ShardStore::adopt`] with a chunk size and a hashing progress callback.
    pub fn adopt_with(
        &self,
        path: impl AsRef<Path>,
        chunk_size: u32,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Manifest, StoreError> {
        let path = path.as_ref();
        // Absolute, but links kept: a split model's parts are found by the first part's name,
        // which a link into a cache's blobs (the Hub's snapshots) would lose.
        let path =
            std::path::absolute(path).map_err(io_err(format!("resolving {}", path.display())))?;
        let stamp_err = io_err(format!("reading metadata of {}", path.display()));
        let before = FileStamp::of(&path).map_err(stamp_err)?;
        let manifest = Manifest::from_gguf_with(&path, chunk_size, progress)?;
        let after = FileStamp::of(&path)
            .map_err(io_err(format!("reading metadata of {}", path.display())))?;
        if before != after {
            return Err(StoreError::Adopt {
                path,
                what: "the file changed while it was being hashed".into(),
            });
        }
        let index = Index::new(&manifest);
        let n = index.n_chunks;
        let mut present = vec![u64::MAX; (n as usize).div_ceil(64)];
        if !n.is_multiple_of(64) {
            *present.last_mut().expect("n > 0") = (1u64 << (n % 64)) - 1;
        }
        let mut st = ModelState {
            dir: self.model_dir(&manifest.model_hash),
            manifest: Arc::new(manifest.clone()),
            index,
            present,
            file: None,
            file_ok: false,
            dirty: 1,
            manifest_saved: false,
            adopted: Some(Adopted { path, stamp: after }),
        };
        st.persist()?;
        lock(&self.models).insert(manifest.model_hash, Arc::new(Mutex::new(st)));
        Ok(manifest)
    }

    /// Re-reads and re-hashes every chunk this store claims to hold for the model; chunks whose
    /// bytes no longer match are marked missing (an adopted file that fails is no longer
    /// adopted), so the next fetch receives them again.
    pub fn verify(&self, manifest: &Manifest) -> Result<VerifyReport, StoreError> {
        let st = self.state(manifest)?;
        let mut st = lock(&st);
        let checked: u64 = (0..st.index.n_chunks).filter(|&id| st.has(id)).count() as u64;
        if checked == 0 {
            return Ok(VerifyReport {
                chunks_checked: 0,
                chunks_bad: 0,
            });
        }
        let bits = st.scan(&st.path(), false)?;
        let good: u64 = bits.iter().map(|w| u64::from(w.count_ones())).sum();
        if good != checked {
            if st.adopted.take().is_some() {
                // The sparse file is a separate copy; rebuild what it holds.
                st.rebuild_from_sparse_file();
            } else {
                st.present = bits;
            }
            st.dirty += 1;
            st.persist()?;
        }
        Ok(VerifyReport {
            chunks_checked: checked,
            chunks_bad: checked - good,
        })
    }

    /// Re-reads and re-hashes the held chunks that `needs` covers (and the header) against the
    /// manifest, before they are loaded: bytes changed in the cache since they were received
    /// (a disk fault, or someone editing the file) are refused, naming the first bad chunk's
    /// tensor. Every bad chunk is marked missing (an adopted file that fails is no longer
    /// adopted), so the next fetch receives it again. Returns the chunks checked.
    pub fn check_needs(&self, manifest: &Manifest, needs: &[Need]) -> Result<u64, StoreError> {
        let st = self.state(manifest)?;
        let mut st = lock(&st);
        let m = Arc::clone(&st.manifest);
        let chunks: Vec<ChunkRef> = m
            .chunks_for_needs(needs)?
            .into_iter()
            .filter(|c| st.has(c.id))
            .collect();
        if chunks.is_empty() {
            return Ok(0);
        }
        let path = st.path();
        let source =
            FileSource::open(&path).map_err(io_err(format!("opening {}", path.display())))?;
        let mut first_bad = None;
        let mut bad = Vec::new();
        for c in &chunks {
            let bytes = source
                .read_chunk(c)
                .map_err(io_err(format!("reading {c} from {}", path.display())))?;
            let (sec, i) = st.index.locate(c.id).expect("ids come from the index");
            let expected = m.section(sec).chunks[i as usize];
            let actual = ContentHash::of(&bytes);
            if actual != expected {
                bad.push(c.id);
                first_bad.get_or_insert_with(|| StoreError::HashMismatch {
                    part: c.part.clone(),
                    index: c.index,
                    offset: c.offset,
                    end: c.end(),
                    expected,
                    actual,
                });
            }
        }
        let Some(err) = first_bad else {
            return Ok(chunks.len() as u64);
        };
        if st.adopted.take().is_some() {
            st.rebuild_from_sparse_file();
        }
        for id in bad {
            st.present[(id / 64) as usize] &= !(1 << (id % 64));
        }
        st.dirty += 1;
        st.persist()?;
        Err(err)
    }

    /// The state of a model, loaded from disk on first use.
    fn state(&self, manifest: &Manifest) -> Result<Arc<Mutex<ModelState>>, StoreError> {
        let mut models = lock(&self.models);
        if let Some(st) = models.get(&manifest.model_hash) {
            if lock(st).manifest.same_layout(manifest) {
                return Ok(Arc::clone(st));
            }
            // A different chunking of the same model: persist what we have, reload for the new.
            let _ = lock(st).persist();
        }
        let st = Arc::new(Mutex::new(self.load(manifest)?));
        models.insert(manifest.model_hash, Arc::clone(&st));
        Ok(st)
    }

    fn load(&self, manifest: &Manifest) -> Result<ModelState, StoreError> {
        manifest.validate()?;
        let dir = self.model_dir(&manifest.model_hash);
        let index = Index::new(manifest);
        let n = index.n_chunks;
        let mut st = ModelState {
            dir: dir.clone(),
            manifest: Arc::new(manifest.clone()),
            present: vec![0; (n as usize).div_ceil(64)],
            index,
            file: None,
            file_ok: false,
            dirty: 0,
            manifest_saved: false,
            adopted: None,
        };
        let saved_manifest = std::fs::read(dir.join(MANIFEST_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice::<Manifest>(&b).ok());
        st.manifest_saved = saved_manifest.as_ref() == Some(manifest);
        let state = std::fs::read(dir.join(STATE_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice::<StateFile>(&b).ok())
            .filter(|s| s.format == STATE_FORMAT && s.model_hash == manifest.model_hash);

        // An adopted original still there, unchanged: everything is present, whatever the
        // chunking (the content hash names the whole file).
        if let Some(a) = state.as_ref().and_then(|s| s.adopted.clone()) {
            if FileStamp::of(&a.path).ok().as_ref() == Some(&a.stamp) {
                st.adopted = Some(a);
                if !st.manifest_saved {
                    st.dirty = 1;
                }
                return Ok(st);
            }
            st.dirty = 1; // the adoption lapsed: record that
        }
        let state = state.filter(|s| s.chunk_size == manifest.chunk_size && s.n_chunks == n);

        match state.and_then(|s| bitmap_from_hex(&s.present, n)) {
            Some(bits) if st.manifest_saved && st.sparse_file_ok() => {
                st.file_ok = true;
                st.present = bits;
            }
            // State lost, damaged or for another manifest: trust only what the bytes prove.
            _ => st.rebuild_from_sparse_file(),
        }
        Ok(st)
    }
}

impl Drop for ShardStore {
    fn drop(&mut self) {
        for st in lock(&self.models).values() {
            let _ = lock(st).persist();
        }
    }
}
