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

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tessera_model::{human_bytes, GgufFile, ModelError};

use crate::sys;

/// Chunk size of manifests built with [`Manifest::from_gguf`] (unless [`CHUNK_SIZE_ENV`] says
/// otherwise).
pub const DEFAULT_CHUNK_SIZE: u32 = 1 << 20;
/// Environment variable that sets the chunk size (bytes) of manifests built with
/// [`Manifest::from_gguf`], e.g. by the coordinator: smaller chunks cut the waste at the edges
/// of expert byte ranges on models whose expert slices are not much larger than a chunk.
pub const CHUNK_SIZE_ENV: &str = "TESSERA_CHUNK_SIZE";
/// Largest chunk size a manifest may use (a chunk is held in memory whole).
pub const MAX_CHUNK_SIZE: u32 = 64 << 20;
/// Version of the [`Manifest`] JSON layout.
pub const MANIFEST_FORMAT: u32 = 1;
/// Chunks written between two persists of the presence state, by default.
pub const DEFAULT_FLUSH_EVERY: u32 = 64;

const MODEL_FILE: &str = "model.gguf";
const STATE_FILE: &str = "state.json";
const MANIFEST_FILE: &str = "manifest.json";
const STATE_FORMAT: u32 = 1;

// ---------------------------------------------------------------------------------------------
// Hashes

/// A blake3 hash, written as 64 lowercase hex digits in JSON and messages.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentHash(pub [u8; 32]);

impl ContentHash {
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        blake3::Hash::from_hex(s).ok().map(|h| Self(*h.as_bytes()))
    }

    /// The first 12 hex digits, for messages.
    pub fn short(&self) -> String {
        self.to_hex()[..12].to_string()
    }
}

impl From<blake3::Hash> for ContentHash {
    fn from(h: blake3::Hash) -> Self {
        Self(*h.as_bytes())
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentHash({})", self.to_hex())
    }
}

impl Serialize for ContentHash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ContentHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::from_hex(&s)
            .ok_or_else(|| serde::de::Error::custom("expected 64 hex digits (a blake3 hash)"))
    }
}

// ---------------------------------------------------------------------------------------------
// Manifest

/// One contiguous region of the file (the header, or one tensor's bytes) and its chunk hashes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Section {
    /// The tensor's name; for the header, a label.
    pub name: String,
    /// Absolute byte offset in the file.
    pub offset: u64,
    pub len: u64,
    /// blake3 of the whole region.
    pub hash: ContentHash,
    /// blake3 of each `chunk_size` piece, in order; the last may be shorter.
    pub chunks: Vec<ContentHash>,
}

impl Section {
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// A model described by content: what a node needs to fetch and verify any subset of tensors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    /// blake3 of the whole original file: the model's identity.
    pub model_hash: ContentHash,
    pub file_len: u64,
    pub chunk_size: u32,
    /// Bytes `0..data_offset`: magic, metadata, tensor index and alignment padding.
    pub header: Section,
    /// In the order of the GGUF tensor index.
    pub tensors: Vec<Section>,
}

/// Which region a chunk belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Part {
    Header,
    Tensor(String),
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header => f.write_str("the GGUF header"),
            Self::Tensor(name) => write!(f, "tensor `{name}`"),
        }
    }
}

/// One chunk to transfer: where it lives in the file and which part it belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChunkRef {
    /// Position in the manifest's chunk order (header chunks first, then each tensor's).
    pub id: u32,
    pub part: Part,
    /// Index of the chunk within its part.
    pub index: u32,
    /// Absolute byte offset in the file.
    pub offset: u64,
    pub len: u32,
}

impl ChunkRef {
    pub fn end(&self) -> u64 {
        self.offset + u64::from(self.len)
    }
}

impl fmt::Display for ChunkRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "chunk {} of {} (file bytes {}..{})",
            self.index,
            self.part,
            self.offset,
            self.end()
        )
    }
}

/// Bytes of one tensor that an assignment needs: all of it, or one range of it.
///
/// Transfer and verification stay per chunk: a range is widened to the chunks that overlap it.
/// A chunk straddling the boundary of a needed range is fetched (and verified) whole, so a range
/// costs at most one partly needed chunk at each end, and a chunk shared by two needed ranges
/// (two adjacent experts, say) is fetched once. The bytes of such a boundary chunk outside the
/// range are real model bytes, not holes; the engine simply does not use them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Need {
    pub tensor: String,
    /// Bytes relative to the tensor's first byte; `None`: the whole tensor.
    pub range: Option<Range<u64>>,
}

impl Need {
    /// The whole tensor `tensor`.
    pub fn whole(tensor: impl Into<String>) -> Self {
        Self {
            tensor: tensor.into(),
            range: None,
        }
    }

    /// Bytes `range` of tensor `tensor` (relative to its first byte).
    pub fn bytes(tensor: impl Into<String>, range: Range<u64>) -> Self {
        Self {
            tensor: tensor.into(),
            range: Some(range),
        }
    }

    /// Each name as a whole tensor.
    pub fn whole_tensors<S: AsRef<str>>(names: &[S]) -> Vec<Self> {
        names.iter().map(|n| Self::whole(n.as_ref())).collect()
    }
}

/// Chunk numbering of a manifest: section 0 is the header, section `i + 1` is tensor `i`.
#[derive(Debug)]
struct Index {
    /// First chunk id of each section.
    bases: Vec<u32>,
    by_name: HashMap<String, usize>,
    n_chunks: u32,
}

impl Index {
    fn new(m: &Manifest) -> Self {
        let mut bases = Vec::with_capacity(m.tensors.len() + 1);
        let mut next = 0u32;
        for s in m.sections() {
            bases.push(next);
            next = next.saturating_add(s.chunks.len() as u32);
        }
        let by_name = m
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i + 1))
            .collect();
        Self {
            bases,
            by_name,
            n_chunks: next,
        }
    }

    /// (section, chunk index within it) of a chunk id.
    fn locate(&self, id: u32) -> Option<(usize, u32)> {
        if id >= self.n_chunks {
            return None;
        }
        let sec = self.bases.partition_point(|&b| b <= id) - 1;
        Some((sec, id - self.bases[sec]))
    }

    /// Ids of the header's chunks and of every chunk overlapping a need, ascending, each once.
    fn ids_for(&self, m: &Manifest, needs: &[Need]) -> Result<Vec<u32>, StoreError> {
        let cs = u64::from(m.chunk_size);
        let mut spans: Vec<Range<u32>> = Vec::with_capacity(needs.len() + 1);
        spans.push(0..m.header.chunks.len() as u32);
        for n in needs {
            let &sec = self
                .by_name
                .get(&n.tensor)
                .ok_or_else(|| StoreError::UnknownTensor {
                    model: m.model_hash.short(),
                    name: n.tensor.clone(),
                })?;
            let len = m.section(sec).len;
            let r = n.range.clone().unwrap_or(0..len);
            if r.start > r.end || r.end > len {
                return Err(StoreError::BadRange {
                    model: m.model_hash.short(),
                    tensor: n.tensor.clone(),
                    start: r.start,
                    end: r.end,
                    len,
                });
            }
            if r.is_empty() {
                continue;
            }
            // Every chunk that holds at least one byte of the range.
            let first = (r.start / cs) as u32;
            let last = ((r.end - 1) / cs) as u32;
            let base = self.bases[sec];
            spans.push(base + first..base + last + 1);
        }
        spans.sort_unstable_by_key(|r| r.start);
        let mut ids = Vec::new();
        let mut next = 0u32;
        for r in spans {
            ids.extend(r.start.max(next)..r.end);
            next = next.max(r.end);
        }
        Ok(ids)
    }
}

impl Manifest {
    /// Builds the manifest of a GGUF file with [`DEFAULT_CHUNK_SIZE`] chunks, or the size
    /// [`CHUNK_SIZE_ENV`] gives.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let chunk_size = match std::env::var(CHUNK_SIZE_ENV) {
            Ok(v) => v.trim().parse::<u32>().map_err(|e| {
                StoreError::BadManifest(format!("{CHUNK_SIZE_ENV}={v:?} is not a byte count: {e}"))
            })?,
            Err(_) => DEFAULT_CHUNK_SIZE,
        };
        Self::from_gguf_with(path, chunk_size, &mut |_, _| {})
    }

    /// Builds the manifest of a GGUF file, reading it once, front to back; `progress(done,
    /// total)` is called as bytes are hashed.
    pub fn from_gguf_with(
        path: impl AsRef<Path>,
        chunk_size: u32,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self, StoreError> {
        let path = path.as_ref();
        if chunk_size == 0 || chunk_size > MAX_CHUNK_SIZE {
            return Err(StoreError::BadManifest(format!(
                "chunk size {chunk_size} must be between 1 and {MAX_CHUNK_SIZE} bytes"
            )));
        }
        let gguf = GgufFile::open(path)?;
        let map = gguf
            .mapping()
            .ok_or_else(|| StoreError::BadManifest("GGUF file is not mapped".into()))?;
        let data: &[u8] = &map[..];
        let total = data.len() as u64;
        let data_offset = gguf.data_offset();
        if data_offset > total {
            return Err(StoreError::BadManifest(format!(
                "{}: data section starts at {data_offset}, beyond the end of the file ({total} bytes)",
                path.display()
            )));
        }

        // (offset, len, name, is_header), hashed in file order.
        let mut regions: Vec<(u64, u64, String, Option<usize>)> =
            vec![(0, data_offset, "GGUF header".into(), None)];
        for (i, t) in gguf.tensors().iter().enumerate() {
            regions.push((t.offset, t.n_bytes, t.name.clone(), Some(i)));
        }
        let mut order: Vec<usize> = (0..regions.len()).collect();
        order.sort_by_key(|&i| regions[i].0);

        let mut file_hasher = blake3::Hasher::new();
        let mut sections: Vec<Option<Section>> = vec![None; regions.len()];
        let mut pos = 0u64;
        let feed = |hasher: &mut blake3::Hasher,
                    from: u64,
                    to: u64,
                    progress: &mut dyn FnMut(u64, u64)| {
            let mut p = from;
            while p < to {
                let q = to.min(p + (16 << 20));
                hasher.update(&data[p as usize..q as usize]);
                p = q;
                progress(p, total);
            }
        };
        for &ri in &order {
            let (offset, len, ref name, _) = regions[ri];
            if offset < pos {
                return Err(StoreError::BadManifest(format!(
                    "{}: {name} at byte {offset} overlaps the previous region (ends at {pos})",
                    path.display()
                )));
            }
            feed(&mut file_hasher, pos, offset, progress);
            let bytes = &data[offset as usize..(offset + len) as usize];
            let mut section_hasher = blake3::Hasher::new();
            let mut chunks = Vec::with_capacity(bytes.len().div_ceil(chunk_size as usize));
            let mut done = offset;
            for c in bytes.chunks(chunk_size as usize) {
                file_hasher.update(c);
                section_hasher.update(c);
                chunks.push(ContentHash::of(c));
                done += c.len() as u64;
                progress(done, total);
            }
            sections[ri] = Some(Section {
                name: name.clone(),
                offset,
                len,
                hash: section_hasher.finalize().into(),
                chunks,
            });
            pos = offset + len;
        }
        feed(&mut file_hasher, pos, total, progress);
        progress(total, total);

        let mut sections = sections
            .into_iter()
            .map(|s| s.expect("every region hashed"));
        let header = sections.next().expect("header region");
        let manifest = Self {
            format: MANIFEST_FORMAT,
            model_hash: file_hasher.finalize().into(),
            file_len: total,
            chunk_size,
            header,
            tensors: sections.collect(),
        };
        manifest.validate()?;
        Ok(manifest)
    }

    /// Checks that the manifest is well formed: known format, chunk counts that match the
    /// lengths, regions inside the file and not overlapping, unique tensor names.
    pub fn validate(&self) -> Result<(), StoreError> {
        let bad = |what: String| Err(StoreError::BadManifest(what));
        if self.format != MANIFEST_FORMAT {
            return bad(format!(
                "format {} is not supported (this build reads format {MANIFEST_FORMAT})",
                self.format
            ));
        }
        if self.chunk_size == 0 || self.chunk_size > MAX_CHUNK_SIZE {
            return bad(format!(
                "chunk size {} must be between 1 and {MAX_CHUNK_SIZE} bytes",
                self.chunk_size
            ));
        }
        if self.header.offset != 0 || self.header.len == 0 {
            return bad("the header must start at byte 0 and be non-empty".into());
        }
        let mut names = BTreeSet::new();
        let mut total_chunks = 0u64;
        let mut spans = Vec::with_capacity(self.tensors.len() + 1);
        for (i, s) in self.sections().enumerate() {
            if i > 0 && !names.insert(s.name.as_str()) {
                return bad(format!("tensor `{}` appears twice", s.name));
            }
            if s.len == 0 {
                return bad(format!("`{}` is empty", s.name));
            }
            let end = s.offset.checked_add(s.len);
            if end.is_none_or(|e| e > self.file_len) {
                return bad(format!(
                    "`{}` (bytes {}+{}) lies outside the file ({} bytes)",
                    s.name, s.offset, s.len, self.file_len
                ));
            }
            let want = s.len.div_ceil(u64::from(self.chunk_size));
            if s.chunks.len() as u64 != want {
                return bad(format!(
                    "`{}` has {} chunk hashes, but {} bytes in {}-byte chunks make {want}",
                    s.name,
                    s.chunks.len(),
                    s.len,
                    self.chunk_size
                ));
            }
            total_chunks += want;
            spans.push((s.offset, s.end(), s.name.as_str()));
        }
        if total_chunks > u64::from(u32::MAX) {
            return bad(format!(
                "{total_chunks} chunks is more than this format numbers"
            ));
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return bad(format!("`{}` overlaps `{}`", w[1].2, w[0].2));
            }
        }
        Ok(())
    }

    /// The header, then every tensor, in manifest order.
    pub fn sections(&self) -> impl Iterator<Item = &Section> {
        std::iter::once(&self.header).chain(self.tensors.iter())
    }

    pub fn tensor(&self, name: &str) -> Option<&Section> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Number of chunks in the whole file (header and all tensors).
    pub fn n_chunks(&self) -> u64 {
        self.sections().map(|s| s.chunks.len() as u64).sum()
    }

    /// Every chunk of the header and the named tensors, in manifest order, whatever any store
    /// holds. Unknown names are an error.
    pub fn chunks_for<S: AsRef<str>>(&self, names: &[S]) -> Result<Vec<ChunkRef>, StoreError> {
        self.chunks_for_needs(&Need::whole_tensors(names))
    }

    /// Every chunk of the header, and every chunk overlapping one of `needs` (a chunk that
    /// straddles a range's boundary is included whole), in manifest order, each once, whatever
    /// any store holds. An unknown tensor or a range beyond its tensor's end is an error.
    pub fn chunks_for_needs(&self, needs: &[Need]) -> Result<Vec<ChunkRef>, StoreError> {
        let index = Index::new(self);
        Ok(index
            .ids_for(self, needs)?
            .into_iter()
            .map(|id| {
                let (sec, i) = index.locate(id).expect("ids come from the index");
                self.chunk_ref(&index, sec, i)
            })
            .collect())
    }

    /// Bytes of the header plus the named tensors: what a node holding them stores and what a
    /// fetch from empty transfers.
    pub fn bytes_for<S: AsRef<str>>(&self, names: &[S]) -> Result<u64, StoreError> {
        self.bytes_for_needs(&Need::whole_tensors(names))
    }

    /// Bytes of the chunks [`Manifest::chunks_for_needs`] names: what a node holding `needs`
    /// stores and what a fetch from empty transfers.
    pub fn bytes_for_needs(&self, needs: &[Need]) -> Result<u64, StoreError> {
        Ok(self
            .chunks_for_needs(needs)?
            .iter()
            .map(|c| u64::from(c.len))
            .sum())
    }

    /// Names of the tensors of blocks `layers` (GGUF `blk.<i>.` prefix), in manifest order.
    pub fn layer_tensor_names(&self, layers: Range<u32>) -> Vec<String> {
        self.tensors
            .iter()
            .filter(|t| {
                t.name
                    .strip_prefix("blk.")
                    .and_then(|rest| rest.split_once('.'))
                    .and_then(|(n, _)| n.parse::<u32>().ok())
                    .is_some_and(|n| layers.contains(&n))
            })
            .map(|t| t.name.clone())
            .collect()
    }

    /// Reads a manifest written by [`Manifest::save`] (or any JSON of the same shape) and
    /// validates it.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref();
        let text = std::fs::read(path).map_err(io_err(format!("reading {}", path.display())))?;
        let m: Self = serde_json::from_slice(&text)
            .map_err(|e| StoreError::BadManifest(format!("{}: {e}", path.display())))?;
        m.validate()?;
        Ok(m)
    }

    /// Writes the manifest as JSON, atomically.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), StoreError> {
        let json = serde_json::to_vec(self).expect("a manifest serializes");
        write_atomic(path.as_ref(), &json)
    }

    fn section(&self, sec: usize) -> &Section {
        if sec == 0 {
            &self.header
        } else {
            &self.tensors[sec - 1]
        }
    }

    fn part(&self, sec: usize) -> Part {
        if sec == 0 {
            Part::Header
        } else {
            Part::Tensor(self.tensors[sec - 1].name.clone())
        }
    }

    fn chunk_ref(&self, index: &Index, sec: usize, i: u32) -> ChunkRef {
        let s = self.section(sec);
        let start = u64::from(i) * u64::from(self.chunk_size);
        ChunkRef {
            id: index.bases[sec] + i,
            part: self.part(sec),
            index: i,
            offset: s.offset + start,
            len: (s.len - start).min(u64::from(self.chunk_size)) as u32,
        }
    }

    /// Same model, same chunking: states kept for one are valid for the other.
    fn same_layout(&self, other: &Self) -> bool {
        self.model_hash == other.model_hash
            && self.chunk_size == other.chunk_size
            && self.file_len == other.file_len
            && self.header.hash == other.header.hash
            && self.tensors.len() == other.tensors.len()
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

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

fn io_err(context: String) -> impl FnOnce(io::Error) -> StoreError {
    move |source| StoreError::Io { context, source }
}

// ---------------------------------------------------------------------------------------------
// Files

/// Writes `bytes` to `path` so that readers see the old or the new content, never a mix:
/// write a temporary file, fsync it, rename it over `path`, fsync the directory.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{file_name}.tmp"));
    let ctx = |what: &str| format!("{what} {}", tmp.display());
    let mut f = File::create(&tmp).map_err(io_err(ctx("creating")))?;
    f.write_all(bytes).map_err(io_err(ctx("writing")))?;
    f.sync_all().map_err(io_err(ctx("syncing")))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io_err(format!(
        "renaming {} to {}",
        tmp.display(),
        path.display()
    )))?;
    if let Some(dir) = path.parent() {
        // Makes the rename durable on Linux; not possible everywhere, and not fatal.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

fn read_at(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut f = file;
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(buf)
}

fn write_at(file: &File, offset: u64, buf: &[u8]) -> io::Result<()> {
    let mut f = file;
    f.seek(SeekFrom::Start(offset))?;
    f.write_all(buf)
}

/// Size and modification time of a file, to notice an adopted file being replaced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FileStamp {
    len: u64,
    modified_unix_ns: Option<u64>,
}

impl FileStamp {
    fn of(path: &Path) -> io::Result<Self> {
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
struct Adopted {
    path: PathBuf,
    stamp: FileStamp,
}

/// `state.json`.
#[derive(Serialize, Deserialize)]
struct StateFile {
    format: u32,
    model_hash: ContentHash,
    chunk_size: u32,
    n_chunks: u32,
    /// Presence bitmap: bit `id % 8` of byte `id / 8`, as hex.
    present: String,
    adopted: Option<Adopted>,
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

fn bitmap_from_hex(hex: &str, n: u32) -> Option<Vec<u64>> {
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

// ---------------------------------------------------------------------------------------------
// The store

/// What the store knows about one model.
struct ModelState {
    dir: PathBuf,
    manifest: Arc<Manifest>,
    index: Index,
    present: Vec<u64>,
    /// The sparse file, once opened for writing.
    file: Option<File>,
    /// Whether an existing `model.gguf` has the right length and may be kept.
    file_ok: bool,
    /// Chunks written since the state was last persisted.
    dirty: u32,
    manifest_saved: bool,
    adopted: Option<Adopted>,
}

impl ModelState {
    fn has(&self, id: u32) -> bool {
        self.adopted.is_some() || self.present[(id / 64) as usize] >> (id % 64) & 1 == 1
    }

    fn set(&mut self, id: u32) {
        self.present[(id / 64) as usize] |= 1 << (id % 64);
    }

    fn sparse_path(&self) -> PathBuf {
        self.dir.join(MODEL_FILE)
    }

    fn path(&self) -> PathBuf {
        match &self.adopted {
            Some(a) => a.path.clone(),
            None => self.sparse_path(),
        }
    }

    /// Opens (creating if needed) the sparse file at its full length.
    fn file(&mut self) -> Result<&File, StoreError> {
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
    fn persist(&mut self) -> Result<(), StoreError> {
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
    fn sparse_file_ok(&self) -> bool {
        std::fs::metadata(self.sparse_path()).is_ok_and(|m| m.len() == self.manifest.file_len)
    }

    /// Sets the presence bitmap to what the sparse file's bytes prove (nothing if it is missing,
    /// the wrong length or unreadable), and marks the state for saving.
    fn rebuild_from_sparse_file(&mut self) {
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
    fn scan(&self, path: &Path, all: bool) -> Result<Vec<u64>, StoreError> {
        let m = &self.manifest;
        let mut bits = vec![0u64; (self.index.n_chunks as usize).div_ceil(64)];
        let file = File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
        let mut buf = vec![0u8; m.chunk_size as usize];
        for sec in 0..=m.tensors.len() {
            let s = m.section(sec);
            for (i, expected) in s.chunks.iter().enumerate() {
                let c = m.chunk_ref(&self.index, sec, i as u32);
                if !all && !self.has(c.id) {
                    continue;
                }
                let buf = &mut buf[..c.len as usize];
                read_at(&file, c.offset, buf)
                    .map_err(io_err(format!("reading {c} from {}", path.display())))?;
                if ContentHash::of(buf) == *expected {
                    bits[(c.id / 64) as usize] |= 1 << (c.id % 64);
                }
            }
        }
        Ok(bits)
    }
}

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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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
        let path = path
            .canonicalize()
            .map_err(io_err(format!("resolving {}", path.display())))?;
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
        if n % 64 != 0 {
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

// ---------------------------------------------------------------------------------------------
// Sources and fetching

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
    file: Mutex<File>,
    len: u64,
}

impl FileSource {
    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        let path = path.as_ref().to_owned();
        let file = File::open(&path)?;
        let len = file.metadata()?.len();
        Ok(Self {
            path,
            file: Mutex::new(file),
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
        let mut buf = vec![0u8; chunk.len as usize];
        read_at(&lock(&self.file), chunk.offset, &mut buf)?;
        Ok(buf)
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

// ---------------------------------------------------------------------------------------------
// Experts

/// Layer of a packed expert tensor name, `blk.<N>.ffn_<gate|up|down>_exps.weight`.
fn packed_expert_layer(name: &str) -> Option<usize> {
    let (n, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    let part = rest.strip_prefix("ffn_")?.strip_suffix("_exps.weight")?;
    if !matches!(part, "gate" | "up" | "down") {
        return None;
    }
    n.parse().ok()
}

/// What a part of an expert split needs of the tensors `names`: each whole, except the packed
/// expert tensors `blk.<N>.ffn_{gate,up,down}_exps.weight`, of which only the byte ranges of
/// the experts `held[N]` are needed (none when `held` names no expert of layer `N`).
///
/// A packed tensor's outermost dimension is the expert, so expert `e` of `n` is the contiguous
/// bytes `e * len / n .. (e + 1) * len / n` — what the engine's loader reads for it. Adjacent
/// held experts make one range. `g` is the model's GGUF header (only the tensor index is read,
/// so a sparse file holding just the header will do).
pub fn expert_needs<S: AsRef<str>>(
    g: &GgufFile,
    names: &[S],
    held: &[Vec<usize>],
) -> Result<Vec<Need>, StoreError> {
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let name = name.as_ref();
        let Some(layer) = packed_expert_layer(name) else {
            out.push(Need::whole(name));
            continue;
        };
        let bad = |what: String| StoreError::Experts {
            tensor: name.to_string(),
            what,
        };
        let t = g.require_tensor(name)?;
        let n = match t.shape[..] {
            [_, _, n] if n > 0 && t.n_bytes % n == 0 => n,
            _ => {
                return Err(bad(format!(
                    "shape {:?} ({} bytes) is not a stack of equal expert matrices",
                    t.shape, t.n_bytes
                )))
            }
        };
        let per = t.n_bytes / n;
        let mut ids: Vec<u64> = held
            .get(layer)
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .map(|&e| e as u64)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        if let Some(&e) = ids.iter().find(|&&e| e >= n) {
            return Err(bad(format!(
                "has {n} experts; expert {e} is not one of them"
            )));
        }
        let mut i = 0;
        while i < ids.len() {
            let mut j = i + 1;
            while j < ids.len() && ids[j] == ids[j - 1] + 1 {
                j += 1;
            }
            out.push(Need::bytes(name, ids[i] * per..ids[j - 1] * per + per));
            i = j;
        }
    }
    Ok(out)
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

    /// A manifest over a made-up layout: a 50-byte header, then `tensors` (name, length) at
    /// 64-byte aligned offsets. Hashes are placeholders: only the chunk geometry matters here.
    fn layout(chunk_size: u32, tensors: &[(&str, u64)]) -> Manifest {
        let section = |name: &str, offset: u64, len: u64| Section {
            name: name.into(),
            offset,
            len,
            hash: ContentHash([0; 32]),
            chunks: vec![ContentHash([0; 32]); len.div_ceil(u64::from(chunk_size)) as usize],
        };
        let header = section("GGUF header", 0, 50);
        let mut offset = 64;
        let mut sections = Vec::new();
        for &(name, len) in tensors {
            sections.push(section(name, offset, len));
            offset = (offset + len).next_multiple_of(64);
        }
        let m = Manifest {
            format: MANIFEST_FORMAT,
            model_hash: ContentHash([7; 32]),
            file_len: offset,
            chunk_size,
            header,
            tensors: sections,
        };
        m.validate().unwrap();
        m
    }

    /// (part, chunk index within it) of the chunks `needs` call for.
    fn chunks(m: &Manifest, needs: &[Need]) -> Vec<(String, u32)> {
        let refs = m.chunks_for_needs(needs).unwrap();
        let ids: Vec<u32> = refs.iter().map(|c| c.id).collect();
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "ascending, once: {ids:?}"
        );
        refs.into_iter()
            .map(|c| match c.part {
                Part::Header => ("header".to_string(), c.index),
                Part::Tensor(t) => (t, c.index),
            })
            .collect()
    }

    fn header_and(tensor: &str, idx: &[u32]) -> Vec<(String, u32)> {
        let mut v = vec![("header".to_string(), 0)];
        v.extend(idx.iter().map(|&i| (tensor.to_string(), i)));
        v
    }

    #[test]
    fn byte_ranges_map_to_the_chunks_that_overlap_them() {
        // 100-byte chunks; `exps` packs 8 experts of 125 bytes, so expert boundaries fall in the
        // middle of chunks and neighbouring experts share one.
        let m = layout(100, &[("exps", 1000), ("small", 30), ("tail", 250)]);
        let per = 125;
        let expert = |e: u64| Need::bytes("exps", e * per..(e + 1) * per);

        // Starting and ending mid-chunk: the chunks at both ends are fetched whole.
        assert_eq!(
            chunks(&m, &[Need::bytes("exps", 150..420)]),
            header_and("exps", &[1, 2, 3, 4])
        );
        // On chunk boundaries: nothing beyond; one byte more takes the next chunk.
        assert_eq!(
            chunks(&m, &[Need::bytes("exps", 200..300)]),
            header_and("exps", &[2])
        );
        assert_eq!(
            chunks(&m, &[Need::bytes("exps", 200..301)]),
            header_and("exps", &[2, 3])
        );
        // Adjacent experts share chunk 2 (bytes 200..300 hold the end of expert 1 and the
        // start of expert 2): it is fetched once.
        assert_eq!(chunks(&m, &[expert(1)]), header_and("exps", &[1, 2]));
        assert_eq!(chunks(&m, &[expert(2)]), header_and("exps", &[2, 3]));
        assert_eq!(
            chunks(&m, &[expert(1), expert(2)]),
            header_and("exps", &[1, 2, 3])
        );
        // A non-contiguous set {0, 3, 5}: chunks 2, 5, 8 and 9 hold none of their bytes.
        assert_eq!(
            chunks(&m, &[expert(5), expert(0), expert(3)]),
            header_and("exps", &[0, 1, 3, 4, 6, 7])
        );
        let c = m
            .chunks_for_needs(&[expert(0), expert(3), expert(5)])
            .unwrap();
        assert_eq!(
            m.bytes_for_needs(&[expert(0), expert(3), expert(5)])
                .unwrap(),
            650
        );
        assert_eq!(c.iter().map(|c| u64::from(c.len)).sum::<u64>(), 650);
        // The last expert ends with the tensor, in its last chunk.
        assert_eq!(chunks(&m, &[expert(7)]), header_and("exps", &[8, 9]));
        // A tensor smaller than a chunk: its one (short) chunk.
        let c = m.chunks_for_needs(&[Need::bytes("small", 10..20)]).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!((c[1].index, c[1].len), (0, 30));
        assert_eq!(c[1].offset, m.tensor("small").unwrap().offset);
        // The short last chunk of a tensor.
        let c = m
            .chunks_for_needs(&[Need::bytes("tail", 210..250)])
            .unwrap();
        assert_eq!((c[1].index, c[1].len), (2, 50));
        // The whole tensor wins over a range of it; ranges of several tensors come in manifest
        // order whatever the order asked.
        assert_eq!(
            chunks(&m, &[expert(3), Need::whole("exps")]),
            header_and("exps", &(0..10).collect::<Vec<_>>())
        );
        let mut want = header_and("exps", &[9]);
        want.push(("small".into(), 0));
        assert_eq!(
            chunks(
                &m,
                &[Need::bytes("small", 0..1), Need::bytes("exps", 999..1000)]
            ),
            want
        );
        // Nothing needed, or an empty range: the header alone.
        assert_eq!(chunks(&m, &[]), header_and("exps", &[]));
        assert_eq!(
            chunks(&m, &[Need::bytes("exps", 500..500)]),
            header_and("exps", &[])
        );
        // Names and whole-tensor needs agree.
        assert_eq!(
            m.chunks_for(&["tail", "exps"]).unwrap(),
            m.chunks_for_needs(&[Need::whole("exps"), Need::whole("tail")])
                .unwrap()
        );
        assert_eq!(m.bytes_for(&["tail"]).unwrap(), 50 + 250);
        assert_eq!(m.bytes_for_needs(&[Need::whole("tail")]).unwrap(), 50 + 250);
    }

    #[test]
    fn bad_byte_ranges_are_refused() {
        let m = layout(100, &[("exps", 1000)]);
        for r in [900..1001, 1000..1001, 2000..3000] {
            let err = m.chunks_for_needs(&[Need::bytes("exps", r.clone())]);
            assert!(
                matches!(err, Err(StoreError::BadRange { start, end, len: 1000, .. })
                    if start == r.start && end == r.end),
                "{r:?}: {err:?}"
            );
        }
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = Need::bytes("exps", 300..200);
        assert!(matches!(
            m.chunks_for_needs(&[backwards]),
            Err(StoreError::BadRange { .. })
        ));
        assert!(matches!(
            m.chunks_for_needs(&[Need::bytes("nope", 0..1)]),
            Err(StoreError::UnknownTensor { .. })
        ));
    }

    fn test_model(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/test")
            .join(name)
    }

    #[test]
    fn expert_needs_are_the_held_experts_slices() {
        let g = GgufFile::open(test_model("small-qwen3moe-Q8_0.gguf")).unwrap();
        let names = vec![
            "blk.0.ffn_gate_exps.weight",
            "blk.0.attn_q.weight",
            "blk.1.ffn_down_exps.weight",
            "blk.2.ffn_up_exps.weight",
            "blk.0.ffn_gate_inp.weight",
        ];
        let len = |n: &str| g.tensor(n).unwrap().n_bytes;
        let per = len("blk.0.ffn_gate_exps.weight") / 8;
        let held = vec![vec![5, 0, 3], vec![1, 2, 3], vec![]];
        let needs = expert_needs(&g, &names, &held).unwrap();
        let gate = "blk.0.ffn_gate_exps.weight";
        let down = "blk.1.ffn_down_exps.weight";
        assert_eq!(
            needs,
            vec![
                Need::bytes(gate, 0..per),
                Need::bytes(gate, 3 * per..4 * per),
                Need::bytes(gate, 5 * per..6 * per),
                Need::whole("blk.0.attn_q.weight"),
                // Adjacent experts: one range.
                Need::bytes(down, len(down) / 8..4 * (len(down) / 8)),
                // Layer 2 holds no expert: nothing of its packed tensors.
                Need::whole("blk.0.ffn_gate_inp.weight"),
            ]
        );
        // Layers past the end of `held` hold none either.
        assert_eq!(expert_needs(&g, &names[2..3], &[]).unwrap(), vec![]);
        let err = expert_needs(&g, &names[..1], &[vec![8]]).unwrap_err();
        assert!(matches!(err, StoreError::Experts { .. }), "{err}");
        assert_eq!(packed_expert_layer("blk.12.ffn_up_exps.weight"), Some(12));
        assert_eq!(packed_expert_layer("blk.1.ffn_up_shexp.weight"), None);
        assert_eq!(packed_expert_layer("blk.1.ffn_up.weight"), None);
    }

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

    #[test]
    fn content_hash_hex_round_trip() {
        let h = ContentHash::of(b"tessera");
        assert_eq!(ContentHash::from_hex(&h.to_hex()), Some(h));
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(json, format!("\"{}\"", h.to_hex()));
        assert_eq!(serde_json::from_str::<ContentHash>(&json).unwrap(), h);
        assert!(serde_json::from_str::<ContentHash>("\"abc\"").is_err());
    }
}
