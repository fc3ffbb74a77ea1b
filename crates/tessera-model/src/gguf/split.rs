//! llama.cpp's gguf-split format: a model written as `NAME-00001-of-00003.gguf`,
//! `NAME-00002-of-00003.gguf`, … Each part is a GGUF file of its own (header, tensor index,
//! data). The first holds the model's metadata; every part holds `split.no` (0-based),
//! `split.count` and `split.tensors.count` (the tensors of all parts together).
//!
//! Opened through [`GgufFile::open`], the parts are presented as the one file
//! `gguf-split --merge` would write: a header synthesized from the first part's metadata (the
//! `split.*` keys dropped) and every part's tensor index, then each tensor's bytes in part order,
//! padded to the alignment. Offsets everywhere (the tensor index, a node's byte ranges, the
//! store's manifest) are offsets in that merged image; its bytes are read from the parts'
//! mappings, so nothing is copied. Parts that do not belong together are refused: a missing
//! part, a part numbered for another split, a tensor count that disagrees, a tensor twice.
//!
//! [`write_parts`] writes the format (test fixtures, and splitting a model by hand).

use std::borrow::Cow;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::write::{header_bytes, IndexEntry};
use super::{Backing, GgufFile, MetaValue, DEFAULT_ALIGNMENT};
use crate::error::{ModelError, Result};

/// Metadata key: this part's number, from 0.
pub const KEY_SPLIT_NO: &str = "split.no";
/// Metadata key: how many parts the model has.
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// Metadata key: how many tensors all parts hold together.
pub const KEY_SPLIT_TENSORS: &str = "split.tensors.count";
/// The part numbers in a name have five digits.
const MAX_PARTS: u32 = 99_999;

/// What a part's file name says: `PREFIX-00002-of-00003.gguf` is part 2 (from 1) of 3.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartName {
    /// The path without `-NNNNN-of-NNNNN.gguf`.
    pub prefix: PathBuf,
    /// From 1, as in the name.
    pub number: u32,
    pub count: u32,
}

impl PartName {
    /// Parses a part's path; `None` if its name is not `…-NNNNN-of-NNNNN.gguf` with
    /// `1 <= NNNNN <= count`.
    pub fn parse(path: &Path) -> Option<Self> {
        let name = path.file_name()?.to_str()?;
        let stem = name.strip_suffix(".gguf")?;
        // "-00001-of-00003" is 15 bytes of ASCII at the end.
        let cut = stem.len().checked_sub(15)?;
        let (prefix, tail) = (stem.get(..cut)?, stem.get(cut..)?);
        let digits = |s: &str| {
            (s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<u32>().ok())
                .flatten()
        };
        let number = digits(tail.strip_prefix('-')?.get(..5)?)?;
        let count = digits(tail.get(6..)?.strip_prefix("-of-")?)?;
        if prefix.is_empty() || number == 0 || number > count {
            return None;
        }
        Some(Self {
            prefix: path.with_file_name(prefix),
            number,
            count,
        })
    }

    /// The path of part `number` (from 1) of `count`.
    pub fn path(prefix: &Path, number: u32, count: u32) -> PathBuf {
        let name = prefix
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        prefix.with_file_name(format!("{name}-{number:05}-of-{count:05}.gguf"))
    }
}

/// The merged image's bytes: the synthesized header, then each tensor's bytes in its part.
pub(super) struct SplitImage {
    header: Vec<u8>,
    parts: Vec<(PathBuf, Arc<Mmap>)>,
    /// One per tensor, sorted by `start`, disjoint; the bytes between them are zero padding.
    segments: Vec<Segment>,
    len: u64,
}

/// Where one tensor's bytes of the merged image lie in its part.
struct Segment {
    start: u64,
    end: u64,
    part: usize,
    part_offset: u64,
}

impl SplitImage {
    pub(super) fn part_paths(&self) -> impl Iterator<Item = &Path> {
        self.parts.iter().map(|(p, _)| p.as_path())
    }

    /// The part mapping and the offset in it of `range`, which must lie inside one tensor.
    pub(super) fn locate(&self, range: &Range<u64>) -> Option<(&Arc<Mmap>, usize)> {
        let i = self.segments.partition_point(|s| s.end <= range.start);
        let s = self.segments.get(i)?;
        if s.start > range.start || range.end > s.end {
            return None;
        }
        let at = s.part_offset + (range.start - s.start);
        Some((&self.parts[s.part].1, at as usize))
    }

    /// The image's bytes `range`: borrowed when they lie in the header or in one tensor, else
    /// assembled (a range across padding). `None` past the end.
    pub(super) fn range(&self, range: Range<u64>) -> Option<Cow<'_, [u8]>> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        let header_len = self.header.len() as u64;
        if range.end <= header_len {
            return Some(Cow::Borrowed(
                &self.header[range.start as usize..range.end as usize],
            ));
        }
        if let Some((map, at)) = self.locate(&range) {
            return Some(Cow::Borrowed(
                &map[at..at + (range.end - range.start) as usize],
            ));
        }
        let mut out = vec![0u8; (range.end - range.start) as usize];
        let mut copy = |from: u64, bytes: &[u8]| {
            // `bytes` hold the image's bytes from `from`; copy the part that overlaps `range`.
            let lo = from.max(range.start);
            let hi = (from + bytes.len() as u64).min(range.end);
            if lo < hi {
                out[(lo - range.start) as usize..(hi - range.start) as usize]
                    .copy_from_slice(&bytes[(lo - from) as usize..(hi - from) as usize]);
            }
        };
        copy(0, &self.header);
        let first = self.segments.partition_point(|s| s.end <= range.start);
        for s in self.segments[first..]
            .iter()
            .take_while(|s| s.start < range.end)
        {
            let map = &self.parts[s.part].1;
            let at = s.part_offset as usize;
            copy(s.start, &map[at..at + (s.end - s.start) as usize]);
        }
        Some(Cow::Owned(out))
    }
}

/// `(number from 0, count)` if `g`'s metadata says it is one part of several.
fn membership(g: &GgufFile) -> Result<Option<(u64, u64)>> {
    let Some(count) = g.meta(KEY_SPLIT_COUNT) else {
        return Ok(None);
    };
    let bad = |key: &str, what: &str| ModelError::BadMetadata {
        path: g.path.clone(),
        key: key.into(),
        what: what.into(),
    };
    let count = count
        .as_u64()
        .filter(|&c| c <= u64::from(MAX_PARTS))
        .ok_or_else(|| bad(KEY_SPLIT_COUNT, "must be a part count up to 99999"))?;
    // `gguf-split --merge` leaves `split.count = 0` in the file it writes: a whole model.
    if count <= 1 {
        return Ok(None);
    }
    let number = g
        .meta(KEY_SPLIT_NO)
        .and_then(MetaValue::as_u64)
        .filter(|&n| n < count)
        .ok_or_else(|| bad(KEY_SPLIT_NO, "must be present and below split.count"))?;
    Ok(Some((number, count)))
}

/// `g` as a whole model: itself if it is not a part, else the merged view of its parts (`g`
/// must then be the first).
pub(super) fn assemble(first: GgufFile) -> Result<GgufFile> {
    let Some((number, count)) = membership(&first)? else {
        return Ok(first);
    };
    let path = first.path.clone();
    let refuse = |what: String| ModelError::Split {
        path: path.clone(),
        what,
    };
    let name = PartName::parse(&path);
    if number != 0 {
        let hint = name.as_ref().map_or(String::new(), |n| {
            format!(
                ": open the first, {}",
                PartName::path(&n.prefix, 1, n.count).display()
            )
        });
        return Err(refuse(format!(
            "is part {} of {count} of a split model{hint}",
            number + 1
        )));
    }
    let Some(name) = name.filter(|n| u64::from(n.count) == count && n.number == 1) else {
        return Err(refuse(format!(
            "is the first of {count} parts, but its name does not end in -00001-of-{count:05}.gguf, \
             so the other parts cannot be found"
        )));
    };
    let tensors_expected = first
        .meta(KEY_SPLIT_TENSORS)
        .and_then(MetaValue::as_u64)
        .ok_or_else(|| refuse(format!("lacks {KEY_SPLIT_TENSORS}")))?;

    let mut parts = vec![first];
    for k in 2..=name.count {
        let part_path = PartName::path(&name.prefix, k, name.count);
        if !part_path.exists() {
            return Err(refuse(format!(
                "part {k} of {count}, {}, is missing",
                part_path.display()
            )));
        }
        let part = GgufFile::open_one(&part_path)?;
        let says = membership(&part)?;
        if says != Some((u64::from(k) - 1, count)) {
            let says = says.map_or("not a part".into(), |(n, c)| {
                format!("part {} of {c}", n + 1)
            });
            return Err(refuse(format!(
                "{} says it is {says}, not part {k} of {count}: parts of different models?",
                part_path.display()
            )));
        }
        let tensors = part.meta(KEY_SPLIT_TENSORS).and_then(MetaValue::as_u64);
        if tensors != Some(tensors_expected) {
            return Err(refuse(format!(
                "{} belongs to a model of {tensors:?} tensors, the first part to one of \
                 {tensors_expected}: parts of different models?",
                part_path.display()
            )));
        }
        parts.push(part);
    }
    let held: u64 = parts.iter().map(|p| p.tensors.len() as u64).sum();
    if held != tensors_expected {
        return Err(refuse(format!(
            "the {count} parts hold {held} tensors, but the first part says the model has \
             {tensors_expected}"
        )));
    }
    merge(parts)
}

/// The merged view of validated parts, in order.
fn merge(parts: Vec<GgufFile>) -> Result<GgufFile> {
    let first = &parts[0];
    let alignment = first
        .meta("general.alignment")
        .and_then(MetaValue::as_u64)
        .unwrap_or(DEFAULT_ALIGNMENT);
    let metadata: Vec<(&str, &MetaValue)> = first
        .metadata
        .iter()
        .filter(|(k, _)| ![KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS].contains(&k.as_str()))
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let mut index = Vec::new();
    let mut sources = Vec::new();
    let mut data_len = 0u64;
    for (p, part) in parts.iter().enumerate() {
        for t in &part.tensors {
            index.push(IndexEntry {
                name: &t.name,
                shape: &t.shape,
                type_id: t.type_id,
                rel_offset: data_len,
            });
            sources.push((p, t.offset, t.n_bytes));
            data_len = data_len
                .checked_add(t.n_bytes.div_ceil(alignment) * alignment)
                .ok_or_else(|| ModelError::Split {
                    path: first.path.clone(),
                    what: "the parts' sizes overflow".into(),
                })?;
        }
    }
    let header = header_bytes(first.version, &metadata, &index, alignment);
    let len = header.len() as u64 + data_len;
    let mut merged = GgufFile::parse_header(&header, first.path.clone(), len)?;
    let segments = merged
        .tensors
        .iter()
        .zip(&sources)
        .map(|(t, &(part, part_offset, n_bytes))| {
            debug_assert_eq!(t.n_bytes, n_bytes, "same shape and type, same size");
            Segment {
                start: t.offset,
                end: t.offset + t.n_bytes,
                part,
                part_offset,
            }
        })
        .collect();
    let parts = parts
        .into_iter()
        .map(|p| match p.backing {
            Backing::File(map) => Ok((p.path, map)),
            _ => Err(ModelError::Split {
                path: p.path,
                what: "a part is not a mapped file".into(),
            }),
        })
        .collect::<Result<Vec<_>>>()?;
    merged.backing = Backing::Split(Arc::new(SplitImage {
        header,
        parts,
        segments,
        len,
    }));
    Ok(merged)
}

/// How [`write_parts`] splits a model.
#[derive(Clone, Copy, Debug)]
pub struct SplitOptions {
    /// At most this many tensors in a part (gguf-split's `--split-max-tensors`).
    pub max_tensors: usize,
    /// The first part holds metadata only (gguf-split's `--no-tensor-first-split`).
    pub metadata_only_first: bool,
}

/// Writes `model` as gguf-split parts `{out_prefix}-0000k-of-0000n.gguf`, laid out as
/// llama.cpp's `gguf-split --split` lays them out; returns their paths in order.
pub fn write_parts(
    model: &GgufFile,
    out_prefix: &Path,
    options: SplitOptions,
) -> Result<Vec<PathBuf>> {
    let per_part = options.max_tensors.max(1);
    let mut groups: Vec<&[super::TensorInfo]> = Vec::new();
    if options.metadata_only_first {
        groups.push(&[]);
    }
    groups.extend(model.tensors.chunks(per_part));
    if groups.is_empty() {
        groups.push(&[]);
    }
    let count = groups.len() as u32;
    if count > MAX_PARTS {
        return Err(ModelError::Split {
            path: model.path.clone(),
            what: format!("{count} parts: more than {MAX_PARTS}"),
        });
    }
    let n_tensors = model.tensors.len() as i32;
    let mut paths = Vec::with_capacity(groups.len());
    for (i, group) in groups.into_iter().enumerate() {
        let split_keys = [
            (KEY_SPLIT_NO, MetaValue::U16(i as u16)),
            (KEY_SPLIT_COUNT, MetaValue::U16(count as u16)),
            (KEY_SPLIT_TENSORS, MetaValue::I32(n_tensors)),
        ];
        let mut metadata: Vec<(&str, &MetaValue)> = Vec::new();
        if i == 0 {
            metadata.extend(model.metadata.iter().map(|(k, v)| (k.as_str(), v)));
        }
        metadata.extend(split_keys.iter().map(|(k, v)| (*k, v)));
        let alignment = if i == 0 {
            model
                .meta("general.alignment")
                .and_then(MetaValue::as_u64)
                .unwrap_or(DEFAULT_ALIGNMENT)
        } else {
            DEFAULT_ALIGNMENT
        };
        let mut index = Vec::with_capacity(group.len());
        let mut at = 0u64;
        for t in group {
            index.push(IndexEntry {
                name: &t.name,
                shape: &t.shape,
                type_id: t.type_id,
                rel_offset: at,
            });
            at += t.n_bytes.div_ceil(alignment) * alignment;
        }
        let mut bytes = header_bytes(model.version, &metadata, &index, alignment);
        for t in group {
            bytes.extend_from_slice(model.tensor_bytes(t)?);
            bytes.resize(
                bytes.len().div_ceil(alignment as usize) * alignment as usize,
                0,
            );
        }
        let path = PartName::path(out_prefix, i as u32 + 1, count);
        std::fs::write(&path, &bytes).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        paths.push(path);
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_names_parse_and_print() {
        let n = PartName::parse(Path::new("/m/Qwen3-8B-Q4_K_M-00002-of-00003.gguf")).unwrap();
        assert_eq!(n.prefix, Path::new("/m/Qwen3-8B-Q4_K_M"));
        assert_eq!((n.number, n.count), (2, 3));
        assert_eq!(
            PartName::path(&n.prefix, 3, 3),
            Path::new("/m/Qwen3-8B-Q4_K_M-00003-of-00003.gguf")
        );
        for not_a_part in [
            "model.gguf",
            "-00001-of-00002.gguf",
            "m-00000-of-00002.gguf",
            "m-00003-of-00002.gguf",
            "m-0001-of-00002.gguf",
            "m-00001-of-00002.bin",
            "m-00001_of-00002.gguf",
            "m-0000a-of-00002.gguf",
        ] {
            assert_eq!(PartName::parse(Path::new(not_a_part)), None, "{not_a_part}");
        }
    }
}
