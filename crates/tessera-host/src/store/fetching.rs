//! Sources and fetching: a [`ChunkSource`] serves chunks of the original file (a local
//! [`FileSource`], or a network stream); [`fetch`] and [`fetch_needs`] pull the chunks a store
//! lacks from one, verify each, check the received header against the manifest, and report the
//! bytes moved ([`FetchReport`]).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tessera_model::{human_bytes, GgufFile, PartName};

use super::files::read_at;
use super::shard_store::lock;
use super::{ChunkRef, Manifest, Need, ShardStore, StoreError};
use crate::sys;

/// Where chunks come from: the coordinator's copy of the model (a local file here; a network
/// stream from the transport layer later). Sources are not trusted: every chunk is verified.
pub trait ChunkSource {
    /// The bytes `chunk.offset .. chunk.offset + chunk.len` of the original file.
    fn read_chunk(&self, chunk: &ChunkRef) -> io::Result<Vec<u8>>;
}

/// Serves chunks from a GGUF file on local disk (the coordinator side).
#[derive(Debug)]
pub struct FileSource {
    path: PathBuf,
    bytes: SourceBytes,
    len: u64,
}

/// Where a [`FileSource`]'s bytes are read from.
#[derive(Debug)]
enum SourceBytes {
    File(Mutex<File>),
    /// The first part of a gguf-split model: the merged image of its parts, which is the file
    /// its manifest describes.
    Split(Box<GgufFile>),
}

impl FileSource {
    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        let path = path.as_ref().to_owned();
        if PartName::parse(&path).is_some() {
            let g = GgufFile::open(&path).map_err(io::Error::other)?;
            if g.is_split() {
                return Ok(Self {
                    path,
                    len: g.file_len(),
                    bytes: SourceBytes::Split(Box::new(g)),
                });
            }
        }
        let file = File::open(&path)?;
        let len = file.metadata()?.len();
        Ok(Self {
            path,
            bytes: SourceBytes::File(Mutex::new(file)),
            len,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl ChunkSource for FileSource {
    fn read_chunk(&self, chunk: &ChunkRef) -> io::Result<Vec<u8>> {
        if chunk.end() > self.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{chunk} lies beyond the end of {} ({} bytes)",
                    self.path.display(),
                    self.len
                ),
            ));
        }
        match &self.bytes {
            SourceBytes::File(file) => {
                let mut buf = vec![0u8; chunk.len as usize];
                read_at(&lock(file), chunk.offset, &mut buf)?;
                Ok(buf)
            }
            SourceBytes::Split(g) => g
                .image_range(chunk.offset..chunk.end())
                .map(|b| b.into_owned())
                .map_err(io::Error::other),
        }
    }
}

impl<T: ChunkSource + ?Sized> ChunkSource for &T {
    fn read_chunk(&self, chunk: &ChunkRef) -> io::Result<Vec<u8>> {
        (**self).read_chunk(chunk)
    }
}

/// Progress of a [`fetch`], after each chunk.
#[derive(Debug)]
pub struct FetchProgress<'a> {
    pub chunk: &'a ChunkRef,
    /// Bytes received so far in this fetch.
    pub bytes_done: u64,
    /// Bytes this fetch set out to receive (the missing ones).
    pub bytes_total: u64,
}

/// What a fetch moved: the node's account of "bytes transferred ≈ its tensors' bytes".
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FetchReport {
    /// Header plus the chunks of the named tensors (or of the needed ranges): all the
    /// assignment needs.
    pub chunks_needed: u64,
    pub bytes_needed: u64,
    /// Already held (from an earlier fetch, or an adopted file).
    pub chunks_already_present: u64,
    pub bytes_already_present: u64,
    /// Received from the source in this fetch, including any chunk that was then rejected.
    pub chunks_transferred: u64,
    pub bytes_transferred: u64,
    pub chunks_rejected: u64,
    pub elapsed_ms: f64,
}

impl FetchReport {
    /// This report (a fetch of a superset of what `earlier` fetched) with `earlier`'s transfers
    /// folded in: chunks `earlier` received count as received, not as already present.
    pub fn after(mut self, earlier: &Self) -> Self {
        let chunks = earlier
            .chunks_transferred
            .saturating_sub(earlier.chunks_rejected)
            .min(self.chunks_already_present);
        let bytes = earlier.bytes_transferred.min(self.bytes_already_present);
        self.chunks_already_present -= chunks;
        self.bytes_already_present -= bytes;
        self.chunks_transferred += earlier.chunks_transferred;
        self.bytes_transferred += earlier.bytes_transferred;
        self.chunks_rejected += earlier.chunks_rejected;
        self.elapsed_ms += earlier.elapsed_ms;
        self
    }
}

/// A fetch that stopped, with what it had done: every verified chunk is kept, and fetching
/// again resumes after them.
#[derive(Debug, thiserror::Error)]
#[error(
    "{error} (after receiving {} in {} chunks this attempt; verified chunks are kept and a retry \
     resumes from there)",
    human_bytes(partial.bytes_transferred),
    partial.chunks_transferred
)]
pub struct FetchError {
    #[source]
    pub error: StoreError,
    pub partial: FetchReport,
}

/// Pulls the chunks of the header and the named tensors that `store` lacks from `source`,
/// verifying each, and reports the bytes moved. On return the sparse file (see
/// [`ShardStore::path_for`]) opens with the ordinary GGUF reader, and its header has been
/// checked against the manifest.
// The error path is cold and the error is moved once; keeping it unboxed keeps its fields
// directly matchable.
#[allow(clippy::result_large_err)]
pub fn fetch<S: AsRef<str>, C: ChunkSource + ?Sized>(
    store: &ShardStore,
    manifest: &Manifest,
    names: &[S],
    source: &C,
    progress: &mut dyn FnMut(&FetchProgress<'_>),
) -> Result<FetchReport, FetchError> {
    fetch_needs(
        store,
        manifest,
        &Need::whole_tensors(names),
        source,
        progress,
    )
}

/// [`fetch`] for byte ranges: pulls the header's chunks and the chunks overlapping `needs`
/// (see [`Manifest::chunks_for_needs`]) that `store` lacks. Each chunk is verified whole, so
/// a chunk straddling a range's boundary is received whole; the rest of the file stays a hole.
#[allow(clippy::result_large_err)]
pub fn fetch_needs<C: ChunkSource + ?Sized>(
    store: &ShardStore,
    manifest: &Manifest,
    needs: &[Need],
    source: &C,
    progress: &mut dyn FnMut(&FetchProgress<'_>),
) -> Result<FetchReport, FetchError> {
    let start = Instant::now();
    let mut report = FetchReport::default();
    let fail = |error: StoreError, mut report: FetchReport| {
        let _ = store.flush(manifest);
        report.elapsed_ms = start.elapsed().as_secs_f64() * 1e3;
        FetchError {
            error,
            partial: report,
        }
    };
    let needed = match manifest.chunks_for_needs(needs) {
        Ok(c) => c,
        Err(e) => return Err(fail(e, report)),
    };
    let missing = match store.missing_chunks_for(manifest, needs) {
        Ok(c) => c,
        Err(e) => return Err(fail(e, report)),
    };
    report.chunks_needed = needed.len() as u64;
    report.bytes_needed = needed.iter().map(|c| u64::from(c.len)).sum();
    let to_receive: u64 = missing.iter().map(|c| u64::from(c.len)).sum();
    report.chunks_already_present = report.chunks_needed - missing.len() as u64;
    report.bytes_already_present = report.bytes_needed - to_receive;

    if to_receive > 0 {
        let dir = store.data_dir().join("models");
        if let Ok((free, _)) = sys::fs_space(&dir) {
            if free < to_receive {
                return Err(fail(
                    StoreError::NoSpace {
                        dir,
                        needed: to_receive,
                        free,
                    },
                    report,
                ));
            }
        }
    }

    for chunk in &missing {
        let bytes = match source.read_chunk(chunk) {
            Ok(b) => b,
            Err(e) => {
                let error = StoreError::Source {
                    chunk: chunk.to_string(),
                    source: e,
                };
                return Err(fail(error, report));
            }
        };
        report.chunks_transferred += 1;
        report.bytes_transferred += bytes.len() as u64;
        if let Err(e) = store.write_chunk(manifest, chunk, &bytes) {
            report.chunks_rejected += 1;
            return Err(fail(e, report));
        }
        progress(&FetchProgress {
            chunk,
            bytes_done: report.bytes_transferred,
            bytes_total: to_receive,
        });
    }

    if let Err(e) = store.flush(manifest) {
        return Err(fail(e, report));
    }
    let path = store.path_for(manifest);
    if let Err(e) = check_header(manifest, &path) {
        return Err(fail(e, report));
    }
    report.elapsed_ms = start.elapsed().as_secs_f64() * 1e3;
    Ok(report)
}

/// Opens `path` with the GGUF reader and checks its tensor index against the manifest.
fn check_header(manifest: &Manifest, path: &Path) -> Result<(), StoreError> {
    let g = GgufFile::open(path)?;
    let mismatch = |what: String| {
        Err(StoreError::HeaderMismatch {
            path: path.to_owned(),
            what,
        })
    };
    if g.file_len() != manifest.file_len || g.data_offset() != manifest.header.len {
        return mismatch(format!(
            "file length {} / data offset {} where the manifest says {} / {}",
            g.file_len(),
            g.data_offset(),
            manifest.file_len,
            manifest.header.len
        ));
    }
    if g.tensors().len() != manifest.tensors.len() {
        return mismatch(format!(
            "{} tensors where the manifest lists {}",
            g.tensors().len(),
            manifest.tensors.len()
        ));
    }
    for (t, s) in g.tensors().iter().zip(&manifest.tensors) {
        if t.name != s.name || t.offset != s.offset || t.n_bytes != s.len {
            return mismatch(format!(
                "tensor `{}` at {}+{} where the manifest has `{}` at {}+{}",
                t.name, t.offset, t.n_bytes, s.name, s.offset, s.len
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{expert_needs, test_model};

    #[test]
    fn fetching_expert_ranges_receives_only_their_chunks() {
        let path = test_model("small-qwen3moe-Q8_0.gguf");
        let original = std::fs::read(&path).unwrap();
        let g = GgufFile::open(&path).unwrap();
        let m = Manifest::from_gguf_with(&path, 16 << 10, &mut |_, _| {}).unwrap();
        let dir =
            std::env::temp_dir().join(format!("tessera-store-experts-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = ShardStore::open(&dir).unwrap();
        let source = FileSource::open(&path).unwrap();

        let names = m.layer_tensor_names(0..3);
        let held = vec![vec![0, 3, 5]; 3];
        let needs = expert_needs(&g, &names, &held).unwrap();
        let report = fetch_needs(&store, &m, &needs, &source, &mut |_| {}).unwrap();
        let want = m.bytes_for_needs(&needs).unwrap();
        assert_eq!(report.bytes_transferred, want);
        assert_eq!(report.bytes_needed, want);
        assert!(want < m.bytes_for(&names).unwrap());

        // The held experts' bytes are the original's; bytes of an expert no chunk of which was
        // fetched are still a hole.
        let sparse = std::fs::read(store.path_for(&m)).unwrap();
        let t = m.tensor("blk.1.ffn_up_exps.weight").unwrap();
        let per = t.len / 8;
        for e in [0u64, 3, 5] {
            let r = (t.offset + e * per) as usize..(t.offset + (e + 1) * per) as usize;
            assert_eq!(sparse[r.clone()], original[r], "expert {e}");
        }
        let hole = (t.offset + 7 * per) as usize..t.end() as usize;
        let first_hole_chunk = (7 * per).div_ceil(16 << 10) * (16 << 10);
        let hole = hole.start + (first_hole_chunk - 7 * per) as usize..hole.end;
        assert!(!hole.is_empty());
        assert!(sparse[hole].iter().all(|&b| b == 0));

        // Nothing is received twice; widening to whole tensors receives only the rest.
        let again = fetch_needs(&store, &m, &needs, &source, &mut |_| {}).unwrap();
        assert_eq!(again.bytes_transferred, 0);
        let whole = fetch(&store, &m, &names, &source, &mut |_| {}).unwrap();
        assert_eq!(whole.bytes_transferred, m.bytes_for(&names).unwrap() - want);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_report_after_a_header_fetch_counts_its_transfer() {
        let header = FetchReport {
            chunks_needed: 1,
            bytes_needed: 50,
            chunks_transferred: 1,
            bytes_transferred: 50,
            ..Default::default()
        };
        let main = FetchReport {
            chunks_needed: 4,
            bytes_needed: 350,
            chunks_already_present: 1,
            bytes_already_present: 50,
            chunks_transferred: 3,
            bytes_transferred: 300,
            ..Default::default()
        };
        let r = main.after(&header);
        assert_eq!((r.chunks_transferred, r.bytes_transferred), (4, 350));
        assert_eq!((r.chunks_already_present, r.bytes_already_present), (0, 0));
        assert_eq!((r.chunks_needed, r.bytes_needed), (4, 350));
    }
}
