//! The GGUF container: header, metadata and tensor index, read without touching the weights.
//!
//! Every length and count in a header is treated as hostile: before anything is allocated it is
//! checked against the bytes that remain in the file, so a header that claims 2^40 tensors or a
//! 2^60-byte string is an error, not an allocation. Tensor extents are checked against the file
//! size, so a later read of a tensor's bytes can never run off the end.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::dtype::GgmlType;
use crate::error::{ModelError, Result};

mod reader;
pub mod split;
mod values;
mod write;

use reader::Reader;
pub use split::{write_parts, PartName, SplitOptions};
pub use values::{MetaArray, MetaValue};

/// Default data alignment when `general.alignment` is absent (GGUF spec).
const DEFAULT_ALIGNMENT: u64 = 32;
/// GGML tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;
/// Nested arrays deeper than this are not something any real model writes.
const MAX_ARRAY_DEPTH: u32 = 4;

/// Where one tensor lives and what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML's type id; see [`TensorInfo::dtype`] for the types Tessera can run.
    pub type_id: u32,
    /// Dimensions, innermost first (GGML `ne`): a matrix of `rows` × `cols` is `[cols, rows]`.
    pub shape: Vec<u64>,
    /// Absolute byte offset in the file.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// The type, or an error naming the tensor if Tessera cannot run it.
    pub fn dtype(&self, path: &Path) -> Result<GgmlType> {
        GgmlType::from_id(self.type_id).ok_or_else(|| ModelError::UnsupportedType {
            path: path.to_owned(),
            tensor: self.name.clone(),
            type_name: GgmlType::name_of_id(self.type_id).to_string(),
        })
    }
}

/// A parsed GGUF file: metadata and tensor index, plus (when opened from disk) the mapping
/// through which tensor bytes are read on demand.
pub struct GgufFile {
    path: PathBuf,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_offset: u64,
    file_len: u64,
    backing: Backing,
    /// The byte ranges that hold the file's data, sorted and disjoint; `None`: all of it. A
    /// partial copy (a node's sparse file, which holds only what its assignment fetched) reads
    /// as zeros elsewhere, so reads outside these ranges are refused.
    present: Option<Arc<Vec<Range<u64>>>>,
}

/// Where a file's bytes come from.
enum Backing {
    /// A header parsed from memory: no tensor bytes.
    Header,
    /// One file, memory-mapped.
    File(Arc<Mmap>),
    /// gguf-split parts, read as the one file `gguf-split --merge` would write ([`split`]).
    Split(Arc<split::SplitImage>),
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and memory-maps `path`, parsing the header. Weights are not read: pages of the
    /// mapping are only touched when a tensor's bytes are asked for.
    ///
    /// The first part of a gguf-split model (`NAME-00001-of-00003.gguf`) opens the whole model:
    /// every part is mapped and the parts read as one file ([`split`]). Another part, a missing
    /// part or parts that do not belong together are refused with [`ModelError::Split`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        split::assemble(Self::open_one(path.as_ref())?)
    }

    /// Opens one file, a part of a split model read alone.
    fn open_one(path: &Path) -> Result<Self> {
        let path = path.to_owned();
        let io = |source| ModelError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the mapping is read-only; Tessera never writes model files while serving them.
        // A file truncated underneath us by another process is outside what we can defend.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let mut gguf = Self::parse_header(&map, path.clone(), map.len() as u64)?;
        gguf.backing = Backing::File(Arc::new(map));
        Ok(gguf)
    }

    /// Parses a GGUF image held in memory (tests, fuzzing). Tensor bytes are not available.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        Self::parse_header(bytes, PathBuf::from("<memory>"), bytes.len() as u64)
    }

    /// Parses the header at the start of `bytes`, a file of `file_len` bytes (tensor extents
    /// are checked against it).
    fn parse_header(bytes: &[u8], path: PathBuf, file_len: u64) -> Result<Self> {
        let mut r = Reader {
            bytes,
            pos: 0,
            path: &path,
        };
        let magic: [u8; 4] = r.take(4)?.try_into().expect("4 bytes");
        if &magic != b"GGUF" {
            return Err(ModelError::BadMagic {
                path: path.clone(),
                found: magic,
            });
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::UnsupportedVersion {
                path: path.clone(),
                version,
            });
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        // Each tensor info takes at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes;
        // each key/value at least 8 (key len) + 4 (type) + 1 byte.
        r.check_count(n_tensors, 24, "tensor count")?;
        r.check_count(n_kv, 13, "metadata count")?;

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let key = r.string()?;
            let type_id = r.u32()?;
            let value = r.value(type_id, 0)?;
            meta_index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }

        let mut raw = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(ModelError::BadTensor {
                    path: path.clone(),
                    tensor: name,
                    what: format!("has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"),
                });
            }
            let mut shape = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                shape.push(r.u64()?);
            }
            let type_id = r.u32()?;
            let rel_offset = r.u64()?;
            raw.push((name, shape, type_id, rel_offset));
        }

        let alignment = match meta_index.get("general.alignment") {
            Some(&i) => match metadata[i].1.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
                _ => {
                    return Err(ModelError::BadMetadata {
                        path: path.clone(),
                        key: "general.alignment".into(),
                        what: "must be a power of two no larger than 1 MiB".into(),
                    })
                }
            },
            None => DEFAULT_ALIGNMENT,
        };
        let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;

        let mut tensors = Vec::with_capacity(raw.len());
        let mut tensor_index = HashMap::with_capacity(raw.len());
        for (name, shape, type_id, rel_offset) in raw {
            let bad = |what: String| ModelError::BadTensor {
                path: path.clone(),
                tensor: name.clone(),
                what,
            };
            if shape.contains(&0) {
                return Err(bad(format!("has a zero dimension in shape {shape:?}")));
            }
            let n_elements = shape
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
            let (block, block_bytes) = block_geometry(type_id)
                .ok_or_else(|| bad(format!("has unknown GGML type id {type_id}")))?;
            if shape[0] % block != 0 {
                return Err(bad(format!(
                    "row length {} is not a multiple of the {}-element block of {}",
                    shape[0],
                    block,
                    GgmlType::name_of_id(type_id)
                )));
            }
            let n_bytes = (n_elements / block)
                .checked_mul(block_bytes)
                .ok_or_else(|| bad("size overflows".into()))?;
            if rel_offset % alignment != 0 {
                return Err(bad(format!(
                    "offset {rel_offset} is not aligned to {alignment}"
                )));
            }
            let offset = data_offset
                .checked_add(rel_offset)
                .ok_or_else(|| bad("offset overflows".into()))?;
            let end = offset
                .checked_add(n_bytes)
                .ok_or_else(|| bad("extent overflows".into()))?;
            if end > file_len {
                return Err(bad(format!(
                    "bytes {offset}..{end} lie outside the file ({file_len} bytes): truncated file?"
                )));
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(bad("appears twice".into()));
            }
            tensors.push(TensorInfo {
                name,
                type_id,
                shape,
                offset,
                n_bytes,
            });
        }

        Ok(Self {
            path,
            version,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            data_offset,
            file_len,
            backing: Backing::Header,
            present: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Byte offset where tensor data begins.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// All tensors in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor that must exist, or an error naming it.
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name).ok_or_else(|| ModelError::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
        })
    }

    /// The shared mapping of a single file, whose offsets are the tensor index's. `None` for a
    /// header parsed from memory and for a split model (see [`GgufFile::mapped_range`]).
    pub fn mapping(&self) -> Option<&Arc<Mmap>> {
        match &self.backing {
            Backing::File(map) => Some(map),
            _ => None,
        }
    }

    /// Whether this model was opened from gguf-split parts.
    pub fn is_split(&self) -> bool {
        matches!(self.backing, Backing::Split(_))
    }

    /// The files this model is read from: the file, or every part of a split model in order.
    pub fn part_paths(&self) -> Vec<&Path> {
        match &self.backing {
            Backing::Split(image) => image.part_paths().collect(),
            _ => vec![self.path.as_path()],
        }
    }

    /// The mapping that holds bytes `range` of tensor `tensor` (offsets in the file, or in a
    /// split model's merged image) and where they start in it, for loaders that keep tensors
    /// zero-copy. Refuses bytes a partial copy never received.
    pub fn mapped_range(&self, tensor: &str, range: Range<u64>) -> Result<(Arc<Mmap>, usize)> {
        self.check_present(tensor, range.clone())?;
        let bad = |what: &str| ModelError::BadTensor {
            path: self.path.clone(),
            tensor: tensor.to_string(),
            what: what.into(),
        };
        if range.start > range.end || range.end > self.file_len {
            return Err(bad("range lies outside the file"));
        }
        match &self.backing {
            Backing::Header => Err(bad("no file is mapped (header parsed from memory)")),
            Backing::File(map) => Ok((Arc::clone(map), range.start as usize)),
            Backing::Split(image) => image
                .locate(&range)
                .map(|(map, at)| (Arc::clone(map), at))
                .ok_or_else(|| bad("range does not lie inside one tensor of the split parts")),
        }
    }

    /// The bytes of one tensor (touching only its pages).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> Result<&[u8]> {
        let range = info.offset..info.offset + info.n_bytes;
        self.check_present(&info.name, range.clone())?;
        let bad = |what: &str| ModelError::BadTensor {
            path: self.path.clone(),
            tensor: info.name.clone(),
            what: what.into(),
        };
        // Extents were checked against the file length at parse time.
        match &self.backing {
            Backing::Header => Err(bad("no file is mapped (header parsed from memory)")),
            Backing::File(map) => Ok(&map[range.start as usize..range.end as usize]),
            Backing::Split(image) => image
                .locate(&range)
                .map(|(map, at)| &map[at..at + info.n_bytes as usize])
                .ok_or_else(|| bad("not found in the split parts")),
        }
    }

    /// The file's bytes `range` (for a split model, the merged image's: the synthesized header,
    /// tensor bytes from the parts, zero padding between), for hashing and serving the file by
    /// content. Borrowed from the mapping where possible.
    pub fn image_range(&self, range: Range<u64>) -> Result<Cow<'_, [u8]>> {
        let outside = || ModelError::Corrupt {
            path: self.path.clone(),
            offset: range.start,
            what: format!(
                "bytes {}..{} lie outside the file ({} bytes)",
                range.start, range.end, self.file_len
            ),
        };
        if range.start > range.end || range.end > self.file_len {
            return Err(outside());
        }
        match &self.backing {
            Backing::Header => Err(ModelError::BadTensor {
                path: self.path.clone(),
                tensor: "<file>".into(),
                what: "no file is mapped (header parsed from memory)".into(),
            }),
            Backing::File(map) => Ok(Cow::Borrowed(
                &map[range.start as usize..range.end as usize],
            )),
            Backing::Split(image) => image.range(range.clone()).ok_or_else(outside),
        }
    }
}

impl GgufFile {
    /// Declares this a partial copy whose data is only in `ranges` (absolute file offsets, in
    /// any order, possibly touching): reads of tensor bytes elsewhere then fail with
    /// [`ModelError::NotFetched`] instead of returning the zeros a hole holds.
    pub fn with_present_ranges(mut self, mut ranges: Vec<Range<u64>>) -> Self {
        ranges.retain(|r| r.start < r.end);
        ranges.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
        for r in ranges {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        self.present = Some(Arc::new(merged));
        self
    }

    /// Whether this is a partial copy (see [`GgufFile::with_present_ranges`]).
    pub fn is_partial(&self) -> bool {
        self.present.is_some()
    }

    /// Ok if the bytes `range` of the file (part of tensor `tensor`) are held; else
    /// [`ModelError::NotFetched`] naming the tensor and the first missing byte range. Every
    /// range is held in a complete file.
    pub fn check_present(&self, tensor: &str, range: Range<u64>) -> Result<()> {
        let Some(present) = &self.present else {
            return Ok(());
        };
        let mut at = range.start;
        // The first held range that ends after `at`, then on while they touch.
        let i = present.partition_point(|r| r.end <= at);
        for r in &present[i..] {
            if at >= range.end || r.start > at {
                break;
            }
            at = r.end;
        }
        if at >= range.end {
            return Ok(());
        }
        let gap_end = present
            .iter()
            .find(|r| r.start > at)
            .map_or(range.end, |r| r.start.min(range.end));
        Err(ModelError::NotFetched {
            path: self.path.clone(),
            tensor: tensor.to_string(),
            start: at,
            end: gap_end,
        })
    }
}

/// (elements per block, bytes per block) for every GGML type with a fixed block layout, so that
/// a file's index can be checked and inspected even when Tessera cannot run some of its types.
fn block_geometry(type_id: u32) -> Option<(u64, u64)> {
    if let Some(t) = GgmlType::from_id(type_id) {
        return Some((t.block_size() as u64, t.block_bytes() as u64));
    }
    Some(match type_id {
        3 => (32, 20),    // Q4_1
        6 => (32, 22),    // Q5_0
        7 => (32, 24),    // Q5_1
        9 => (32, 36),    // Q8_1
        10 => (256, 84),  // Q2_K
        11 => (256, 110), // Q3_K
        15 => (256, 292), // Q8_K
        24 => (1, 1),     // I8
        25 => (1, 2),     // I16
        26 => (1, 4),     // I32
        27 => (1, 8),     // I64
        28 => (1, 8),     // F64
        _ => return None,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tiny GGUF image writer for tests of the parser.
    #[derive(Default)]
    pub(crate) struct Builder {
        kv: Vec<u8>,
        n_kv: u64,
        tensors: Vec<u8>,
        n_tensors: u64,
        data_len: u64,
    }

    impl Builder {
        fn put_str(buf: &mut Vec<u8>, s: &str) {
            buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
            buf.extend_from_slice(s.as_bytes());
        }
        pub(crate) fn kv_u32(mut self, k: &str, v: u32) -> Self {
            Self::put_str(&mut self.kv, k);
            self.kv.extend_from_slice(&4u32.to_le_bytes());
            self.kv.extend_from_slice(&v.to_le_bytes());
            self.n_kv += 1;
            self
        }
        pub(crate) fn kv_str(mut self, k: &str, v: &str) -> Self {
            Self::put_str(&mut self.kv, k);
            self.kv.extend_from_slice(&8u32.to_le_bytes());
            Self::put_str(&mut self.kv, v);
            self.n_kv += 1;
            self
        }
        pub(crate) fn tensor(
            mut self,
            name: &str,
            shape: &[u64],
            type_id: u32,
            n_bytes: u64,
        ) -> Self {
            Self::put_str(&mut self.tensors, name);
            self.tensors
                .extend_from_slice(&(shape.len() as u32).to_le_bytes());
            for d in shape {
                self.tensors.extend_from_slice(&d.to_le_bytes());
            }
            self.tensors.extend_from_slice(&type_id.to_le_bytes());
            self.tensors.extend_from_slice(&self.data_len.to_le_bytes());
            self.data_len += n_bytes.div_ceil(32) * 32;
            self.n_tensors += 1;
            self
        }
        pub(crate) fn build(self) -> Vec<u8> {
            let mut out = b"GGUF".to_vec();
            out.extend_from_slice(&3u32.to_le_bytes());
            out.extend_from_slice(&self.n_tensors.to_le_bytes());
            out.extend_from_slice(&self.n_kv.to_le_bytes());
            out.extend_from_slice(&self.kv);
            out.extend_from_slice(&self.tensors);
            out.resize(out.len().div_ceil(32) * 32, 0);
            out.resize(out.len() + self.data_len as usize, 0);
            out
        }
    }

    fn sample() -> Vec<u8> {
        Builder::default()
            .kv_str("general.architecture", "llama")
            .kv_u32("llama.block_count", 1)
            .tensor("a", &[32, 2], 0, 256)
            .tensor("b", &[64], 8, 68)
            .build()
    }

    #[test]
    fn parses_a_well_formed_image() {
        let g = GgufFile::parse(&sample()).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(
            g.meta("general.architecture").unwrap().as_str(),
            Some("llama")
        );
        assert_eq!(g.meta("llama.block_count").unwrap().as_u64(), Some(1));
        let b = g.tensor("b").unwrap();
        assert_eq!(b.n_bytes, 68);
        assert_eq!(b.offset, g.data_offset() + 256);
    }

    #[test]
    fn a_partial_copy_names_the_first_missing_bytes() {
        let g = GgufFile::parse(&sample()).unwrap();
        assert!(!g.is_partial());
        assert!(g.check_present("a", 0..u64::MAX).is_ok());
        // Held: 100..200 and 200..300 (touching, merged), 400..500; given out of order.
        let g = g.with_present_ranges(vec![400..500, 200..300, 100..200, 7..7]);
        assert!(g.is_partial());
        let gap = |r: std::ops::Range<u64>| match g.check_present("t", r) {
            Ok(()) => None,
            Err(ModelError::NotFetched {
                tensor, start, end, ..
            }) => {
                assert_eq!(tensor, "t");
                Some((start, end))
            }
            Err(e) => panic!("{e}"),
        };
        for held in [100..300, 150..250, 400..500, 120..121, 5..5] {
            assert_eq!(gap(held.clone()), None, "{held:?}");
        }
        assert_eq!(gap(50..150), Some((50, 100)));
        assert_eq!(gap(250..450), Some((300, 400)));
        assert_eq!(gap(450..600), Some((500, 600)));
        assert_eq!(gap(310..320), Some((310, 320)));
        assert_eq!(gap(0..1000), Some((0, 100)));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let img = sample();
        let g = GgufFile::parse(&img).unwrap();
        let needed = g.tensor("b").map(|t| t.offset + t.n_bytes).unwrap() as usize;
        for len in 0..needed {
            assert!(
                GgufFile::parse(&img[..len]).is_err(),
                "prefix of {len} bytes parsed"
            );
        }
    }

    #[test]
    fn wrong_magic_and_version_are_named() {
        let mut img = sample();
        img[0] = b'X';
        assert!(matches!(
            GgufFile::parse(&img),
            Err(ModelError::BadMagic { .. })
        ));
        let mut img = sample();
        img[4] = 9;
        assert!(matches!(
            GgufFile::parse(&img),
            Err(ModelError::UnsupportedVersion { version: 9, .. })
        ));
    }

    #[test]
    fn huge_counts_and_lengths_are_refused_before_allocation() {
        // 2^40 tensors.
        let mut img = sample();
        img[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let err = GgufFile::parse(&img).unwrap_err().to_string();
        assert!(err.contains("tensor count"), "{err}");
        // A 2^60-byte key string.
        let mut img = sample();
        img[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
        let err = GgufFile::parse(&img).unwrap_err().to_string();
        assert!(err.contains("cannot fit"), "{err}");
    }

    #[test]
    fn tensor_outside_the_file_is_named() {
        let img = Builder::default().tensor("w", &[32, 4], 0, 512).build();
        let cut = &img[..img.len() - 100];
        let err = GgufFile::parse(cut).unwrap_err();
        assert!(
            matches!(&err, ModelError::BadTensor { tensor, .. } if tensor == "w"),
            "{err}"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        #[test]
        fn mutated_headers_never_panic(
            flips in proptest::collection::vec((0usize..200, proptest::num::u8::ANY), 1..8)
        ) {
            let mut img = sample();
            for (at, byte) in flips {
                let n = img.len();
                img[at % n] = byte;
            }
            let _ = GgufFile::parse(&img);
        }
    }
}
