//! The [`Manifest`]: one GGUF file described by content — the blake3 hash of the whole file, the
//! header and, for each tensor, its place in the file and the blake3 hashes of its fixed-size
//! chunks — built from a GGUF file, validated, saved and loaded as JSON; and its chunk numbering
//! (header chunks first, then each tensor's), which maps tensors and byte ranges of them to the
//! chunks that hold them.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tessera_model::GgufFile;

use super::error::io_err;
use super::files::write_atomic;
use super::{ContentHash, Need, StoreError};

/// Chunk size of manifests built with [`Manifest::from_gguf`] (the coordinator's
/// `--chunk-size` chooses another).
pub const DEFAULT_CHUNK_SIZE: u32 = 1 << 20;
/// Largest chunk size a manifest may use (a chunk is held in memory whole).
pub const MAX_CHUNK_SIZE: u32 = 64 << 20;
/// Version of the [`Manifest`] JSON layout.
pub const MANIFEST_FORMAT: u32 = 1;

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

/// Chunk numbering of a manifest: section 0 is the header, section `i + 1` is tensor `i`.
#[derive(Debug)]
pub(super) struct Index {
    /// First chunk id of each section.
    pub(super) bases: Vec<u32>,
    by_name: HashMap<String, usize>,
    pub(super) n_chunks: u32,
}

impl Index {
    pub(super) fn new(m: &Manifest) -> Self {
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
    pub(super) fn locate(&self, id: u32) -> Option<(usize, u32)> {
        if id >= self.n_chunks {
            return None;
        }
        let sec = self.bases.partition_point(|&b| b <= id) - 1;
        Some((sec, id - self.bases[sec]))
    }

    /// Ids of the header's chunks and of every chunk overlapping a need, ascending, each once.
    pub(super) fn ids_for(&self, m: &Manifest, needs: &[Need]) -> Result<Vec<u32>, StoreError> {
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
    /// Builds the manifest of a GGUF file with [`DEFAULT_CHUNK_SIZE`] chunks.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::from_gguf_with(path, DEFAULT_CHUNK_SIZE, &mut |_, _| {})
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
        // A split model is described as the one file its parts make (its merged image).
        let gguf = GgufFile::open(path)?;
        let total = gguf.file_len();
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
                    progress: &mut dyn FnMut(u64, u64)|
         -> Result<(), StoreError> {
            let mut p = from;
            while p < to {
                let q = to.min(p + (16 << 20));
                hasher.update(&gguf.image_range(p..q)?);
                p = q;
                progress(p, total);
            }
            Ok(())
        };
        for &ri in &order {
            let (offset, len, ref name, _) = regions[ri];
            if offset < pos {
                return Err(StoreError::BadManifest(format!(
                    "{}: {name} at byte {offset} overlaps the previous region (ends at {pos})",
                    path.display()
                )));
            }
            feed(&mut file_hasher, pos, offset, progress)?;
            let bytes = gguf.image_range(offset..offset + len)?;
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
        feed(&mut file_hasher, pos, total, progress)?;
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

    pub(super) fn section(&self, sec: usize) -> &Section {
        if sec == 0 {
            &self.header
        } else {
            &self.tensors[sec - 1]
        }
    }

    pub(super) fn part(&self, sec: usize) -> Part {
        if sec == 0 {
            Part::Header
        } else {
            Part::Tensor(self.tensors[sec - 1].name.clone())
        }
    }

    pub(super) fn chunk_ref(&self, index: &Index, sec: usize, i: u32) -> ChunkRef {
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
    pub(super) fn same_layout(&self, other: &Self) -> bool {
        self.model_hash == other.model_hash
            && self.chunk_size == other.chunk_size
            && self.file_len == other.file_len
            && self.header.hash == other.header.hash
            && self.tensors.len() == other.tensors.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
