//! The bounds-checked cursor the header is parsed with: every length and count it reads is
//! checked against the bytes that remain before anything is allocated for it.

use std::path::Path;

use super::{MetaArray, MetaValue, MAX_ARRAY_DEPTH};
use crate::error::{ModelError, Result};

/// A bounds-checked little-endian cursor over the header bytes.
pub(super) struct Reader<'a> {
    pub(super) bytes: &'a [u8],
    pub(super) pos: usize,
    pub(super) path: &'a Path,
}

impl<'a> Reader<'a> {
    pub(super) fn corrupt(&self, what: impl Into<String>) -> ModelError {
        ModelError::Corrupt {
            path: self.path.to_owned(),
            offset: self.pos as u64,
            what: what.into(),
        }
    }

    pub(super) fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if (n as u64) > self.remaining() {
            return Err(self.corrupt(format!(
                "needs {n} more bytes, {} remain (truncated file?)",
                self.remaining()
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// Refuses a count whose minimal encoding could not fit in the remaining bytes.
    pub(super) fn check_count(&self, count: u64, min_bytes_each: u64, what: &str) -> Result<()> {
        match count.checked_mul(min_bytes_each) {
            Some(need) if need <= self.remaining() => Ok(()),
            _ => Err(self.corrupt(format!(
                "{what} {count} cannot fit in the {} remaining bytes",
                self.remaining()
            ))),
        }
    }

    pub(super) fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    pub(super) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    pub(super) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }

    pub(super) fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        if len > self.remaining() {
            return Err(self.corrupt(format!(
                "string of {len} bytes cannot fit in the {} remaining bytes",
                self.remaining()
            )));
        }
        let bytes = self.take(len as usize)?;
        // Token tables of some models hold invalid UTF-8 pieces; keep them lossily rather than
        // refusing the model.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    pub(super) fn value(&mut self, type_id: u32, depth: u32) -> Result<MetaValue> {
        Ok(match type_id {
            0 => MetaValue::U8(self.u8()?),
            1 => MetaValue::I8(self.u8()? as i8),
            2 => MetaValue::U16(self.u16()?),
            3 => MetaValue::I16(self.u16()? as i16),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(self.u32()? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32()?)),
            7 => match self.u8()? {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.corrupt(format!("bool byte {b} is neither 0 nor 1"))),
            },
            8 => MetaValue::String(self.string()?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.corrupt("arrays nested too deeply"));
                }
                let elem = self.u32()?;
                let len = self.u64()?;
                let min = min_value_bytes(elem)
                    .ok_or_else(|| self.corrupt(format!("array of unknown value type {elem}")))?;
                self.check_count(len, min, "array length")?;
                let n = len as usize;
                MetaValue::Array(match elem {
                    8 => MetaArray::Strings((0..n).map(|_| self.string()).collect::<Result<_>>()?),
                    6 => MetaArray::F32(
                        (0..n)
                            .map(|_| self.u32().map(f32::from_bits))
                            .collect::<Result<_>>()?,
                    ),
                    5 => MetaArray::I32(
                        (0..n)
                            .map(|_| self.u32().map(|v| v as i32))
                            .collect::<Result<_>>()?,
                    ),
                    4 => MetaArray::U32((0..n).map(|_| self.u32()).collect::<Result<_>>()?),
                    _ => MetaArray::Values(
                        (0..n)
                            .map(|_| self.value(elem, depth + 1))
                            .collect::<Result<_>>()?,
                    ),
                })
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(self.u64()? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64()?)),
            t => return Err(self.corrupt(format!("unknown metadata value type {t}"))),
        })
    }
}

/// The fewest bytes one value of a metadata type can take (for bounding array lengths).
fn min_value_bytes(type_id: u32) -> Option<u64> {
    Some(match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,  // a string's length prefix
        9 => 12, // an array's type + length
        10..=12 => 8,
        _ => return None,
    })
}
