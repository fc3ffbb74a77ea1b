//! Writing a GGUF header: magic, version, metadata and tensor index, padded to the data
//! alignment. Used to present gguf-split parts as one file (the header `gguf-split --merge`
//! would write) and by [`super::split::write_parts`] to write parts.
//!
//! The writer is the parser's inverse on values: a header written from what [`super::GgufFile`]
//! parsed parses back to the same metadata and tensor index.

use super::{MetaArray, MetaValue};

/// One tensor's entry in the index: what the header says, not where its bytes come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IndexEntry<'a> {
    pub(crate) name: &'a str,
    pub(crate) shape: &'a [u64],
    pub(crate) type_id: u32,
    /// Offset from the start of the data section (a multiple of the alignment).
    pub(crate) rel_offset: u64,
}

/// The header bytes, padded with zeros to a multiple of `alignment` (the data section starts
/// right after).
pub(crate) fn header_bytes(
    version: u32,
    metadata: &[(&str, &MetaValue)],
    tensors: &[IndexEntry<'_>],
    alignment: u64,
) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        put_str(&mut out, key);
        out.extend_from_slice(&type_id(value).to_le_bytes());
        put_value(&mut out, value);
    }
    for t in tensors {
        put_str(&mut out, t.name);
        out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for d in t.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.type_id.to_le_bytes());
        out.extend_from_slice(&t.rel_offset.to_le_bytes());
    }
    let padded = (out.len() as u64).div_ceil(alignment) * alignment;
    out.resize(padded as usize, 0);
    out
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// GGUF's value type id of a metadata value.
fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

/// The element type id of an array. A generic array's elements share the first one's type; an
/// empty one is written as bytes, which parses back to the same empty generic array.
fn element_type_id(a: &MetaArray) -> u32 {
    match a {
        MetaArray::Strings(_) => 8,
        MetaArray::F32(_) => 6,
        MetaArray::I32(_) => 5,
        MetaArray::U32(_) => 4,
        MetaArray::Values(v) => v.first().map_or(0, type_id),
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_bits().to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => put_str(out, s),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_bits().to_le_bytes()),
        MetaValue::Array(a) => {
            out.extend_from_slice(&element_type_id(a).to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            match a {
                MetaArray::Strings(v) => v.iter().for_each(|s| put_str(out, s)),
                MetaArray::F32(v) => v
                    .iter()
                    .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
                MetaArray::I32(v) => v
                    .iter()
                    .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
                MetaArray::U32(v) => v
                    .iter()
                    .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
                MetaArray::Values(v) => v.iter().for_each(|x| put_value(out, x)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgufFile;

    #[test]
    fn every_value_kind_parses_back_unchanged() {
        let values = [
            ("u8", MetaValue::U8(7)),
            ("i8", MetaValue::I8(-7)),
            ("u16", MetaValue::U16(700)),
            ("i16", MetaValue::I16(-700)),
            ("u32", MetaValue::U32(70_000)),
            ("i32", MetaValue::I32(-70_000)),
            ("f32", MetaValue::F32(1.5)),
            ("bool", MetaValue::Bool(true)),
            ("str", MetaValue::String("héllo".into())),
            ("u64", MetaValue::U64(1 << 40)),
            ("i64", MetaValue::I64(-(1 << 40))),
            ("f64", MetaValue::F64(-2.25)),
            (
                "strs",
                MetaValue::Array(MetaArray::Strings(vec!["a".into(), "".into()])),
            ),
            ("f32s", MetaValue::Array(MetaArray::F32(vec![0.5, -1.0]))),
            ("i32s", MetaValue::Array(MetaArray::I32(vec![-3, 4]))),
            ("u32s", MetaValue::Array(MetaArray::U32(vec![3, 4]))),
            ("empty", MetaValue::Array(MetaArray::Values(vec![]))),
            (
                "bytes",
                MetaValue::Array(MetaArray::Values(vec![MetaValue::U8(1), MetaValue::U8(2)])),
            ),
            (
                "nested",
                MetaValue::Array(MetaArray::Values(vec![MetaValue::Array(MetaArray::U32(
                    vec![9],
                ))])),
            ),
        ];
        let meta: Vec<(&str, &MetaValue)> = values.iter().map(|(k, v)| (*k, v)).collect();
        let shape = [32u64, 2];
        let index = [IndexEntry {
            name: "w",
            shape: &shape,
            type_id: 0,
            rel_offset: 0,
        }];
        let mut img = header_bytes(3, &meta, &index, 32);
        assert_eq!(img.len() % 32, 0);
        img.resize(img.len() + 256, 0);
        let g = GgufFile::parse(&img).unwrap();
        for (k, v) in &values {
            assert_eq!(g.meta(k), Some(v), "{k}");
        }
        let w = g.tensor("w").unwrap();
        assert_eq!((w.offset, w.n_bytes), (g.data_offset(), 256));
    }
}
