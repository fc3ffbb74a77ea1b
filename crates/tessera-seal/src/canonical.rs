//! The canonical byte encoding of headers and claims: what is authenticated (AEAD associated data)
//! or signed must have exactly one encoding, so these are written field by field in a fixed order
//! (big-endian integers, length-prefixed strings and lists) behind a domain tag, never as JSON
//! (whose key order and number forms vary between writers).
//!
//! The reader treats its input as hostile: every length is checked against the bytes left and a
//! cap before anything is allocated.

use crate::error::FormatError;

/// Longest string field (model names, features, kernel paths).
pub(crate) const MAX_STR: usize = 256;
/// Most items in a list field (models held, features).
pub(crate) const MAX_LIST: usize = 256;

/// Appends fields to a byte vector.
pub(crate) struct Writer(Vec<u8>);

impl Writer {
    /// Starts an encoding with its domain tag (a length-prefixed string).
    pub(crate) fn new(tag: &str) -> Self {
        let mut w = Self(Vec::with_capacity(128));
        w.str(tag);
        w
    }
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub(crate) fn fixed(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    /// A string: u32 length, then its UTF-8 bytes. Callers keep strings under [`MAX_STR`]
    /// (checked where the value is built, so the writer never fails).
    pub(crate) fn str(&mut self, s: &str) -> &mut Self {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    pub(crate) fn strs(&mut self, v: &[String]) -> &mut Self {
        self.u32(v.len() as u32);
        for s in v {
            self.str(s);
        }
        self
    }
    pub(crate) fn finish(self) -> Vec<u8> {
        self.0
    }
}

/// Reads fields back, refusing anything short, oversized or left over.
pub(crate) struct Reader<'a> {
    rest: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// Starts reading `what`, whose encoding must begin with `tag`.
    pub(crate) fn new(bytes: &'a [u8], tag: &str, what: &'static str) -> Result<Self, FormatError> {
        let mut r = Self { rest: bytes, what };
        let got = r.str()?;
        if got != tag {
            return Err(r.err(format!("domain tag {got:?}, expected {tag:?}")));
        }
        Ok(r)
    }
    fn err(&self, reason: String) -> FormatError {
        FormatError {
            what: self.what,
            reason,
        }
    }
    pub(crate) fn fixed<const N: usize>(&mut self) -> Result<[u8; N], FormatError> {
        if self.rest.len() < N {
            return Err(self.err(format!(
                "truncated: {N} bytes needed, {} left",
                self.rest.len()
            )));
        }
        let (head, tail) = self.rest.split_at(N);
        self.rest = tail;
        Ok(head.try_into().expect("split at N"))
    }
    pub(crate) fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(self.fixed::<1>()?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_be_bytes(self.fixed()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_be_bytes(self.fixed()?))
    }
    pub(crate) fn str(&mut self) -> Result<String, FormatError> {
        let n = self.u32()? as usize;
        if n > MAX_STR {
            return Err(self.err(format!("string of {n} bytes (at most {MAX_STR})")));
        }
        if self.rest.len() < n {
            return Err(self.err(format!(
                "truncated string: {n} bytes declared, {} left",
                self.rest.len()
            )));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        String::from_utf8(head.to_vec()).map_err(|_| self.err("string is not UTF-8".into()))
    }
    pub(crate) fn strs(&mut self) -> Result<Vec<String>, FormatError> {
        let n = self.u32()? as usize;
        if n > MAX_LIST {
            return Err(self.err(format!("list of {n} items (at most {MAX_LIST})")));
        }
        (0..n).map(|_| self.str()).collect()
    }
    /// Ends reading: trailing bytes would give one value two encodings.
    pub(crate) fn finish(self) -> Result<(), FormatError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(self.err(format!("{} trailing bytes", self.rest.len())))
        }
    }
}

/// Lowercase hex of `b`.
pub(crate) fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push(DIGITS[usize::from(x >> 4)] as char);
        s.push(DIGITS[usize::from(x & 15)] as char);
    }
    s
}

/// Parses hex of exactly `N` bytes.
pub(crate) fn unhex<const N: usize>(s: &str, what: &'static str) -> Result<[u8; N], FormatError> {
    let v = unhex_vec(s, what)?;
    let n = v.len();
    v.try_into().map_err(|_| FormatError {
        what,
        reason: format!("{n} bytes of hex, expected {N}"),
    })
}

/// Parses hex of any length.
pub(crate) fn unhex_vec(s: &str, what: &'static str) -> Result<Vec<u8>, FormatError> {
    let s = s.trim();
    if s.len() & 1 == 1 {
        return Err(FormatError {
            what,
            reason: "odd number of hex digits".into(),
        });
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    s.as_bytes()
        .chunks(2)
        .map(|p| match (digit(p[0]), digit(p[1])) {
            (Some(h), Some(l)) => Ok(h << 4 | l),
            _ => Err(FormatError {
                what,
                reason: "not a hex digit".into(),
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_value_reads_back_and_trailing_bytes_are_refused() {
        let mut w = Writer::new("tag");
        w.u8(7)
            .u32(9)
            .u64(11)
            .str("model")
            .strs(&["a".into(), "b".into()]);
        let mut bytes = w.finish();
        let mut r = Reader::new(&bytes, "tag", "test").unwrap();
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.u32().unwrap(), 9);
        assert_eq!(r.u64().unwrap(), 11);
        assert_eq!(r.str().unwrap(), "model");
        assert_eq!(r.strs().unwrap(), vec!["a".to_string(), "b".to_string()]);
        r.finish().unwrap();
        bytes.push(0);
        let mut r = Reader::new(&bytes, "tag", "test").unwrap();
        let _ = (r.u8(), r.u32(), r.u64(), r.str(), r.strs());
        assert!(r.finish().unwrap_err().reason.contains("1 trailing bytes"));
    }

    #[test]
    fn declared_lengths_are_capped_before_allocating() {
        let mut w = Writer::new("tag");
        w.u32(u32::MAX);
        let bytes = w.finish();
        let mut r = Reader::new(&bytes, "tag", "test").unwrap();
        assert!(r.str().unwrap_err().reason.contains("at most"));
        let mut r = Reader::new(&bytes, "tag", "test").unwrap();
        assert!(r.strs().unwrap_err().reason.contains("at most"));
        assert!(Reader::new(&bytes, "other", "test")
            .err()
            .unwrap()
            .reason
            .contains("domain tag"));
    }

    #[test]
    fn hex_round_trips_and_refuses_bad_digits() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(hex(&b), "0001abff");
        assert_eq!(unhex::<4>("0001ABff", "x").unwrap(), b);
        assert!(unhex::<4>("0001ab", "x").is_err());
        assert!(unhex::<2>("zz00", "x").is_err());
        assert!(unhex::<2>("abc", "x").is_err());
    }
}
