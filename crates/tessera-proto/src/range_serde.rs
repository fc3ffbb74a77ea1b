//! Serde for `Range<usize>` as `"start..end"`.

use std::ops::Range;

use serde::{Deserialize, Deserializer, Serializer};

pub fn serialize<S: Serializer>(r: &Range<usize>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{}..{}", r.start, r.end))
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Range<usize>, D::Error> {
    let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
    parse(&s).map_err(serde::de::Error::custom)
}

/// The same, but an empty range `"a..a"` is accepted too: the layers of an expert-only
/// node in an expert split, on the wire (never in a split or plan file).
pub mod or_empty {
    use std::ops::Range;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(r: &Range<usize>, s: S) -> Result<S::Ok, S::Error> {
        super::serialize(r, s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Range<usize>, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        if let Some((a, b)) = s.trim().split_once("..") {
            if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                if a == b {
                    return Ok(a..a);
                }
            }
        }
        super::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Parses `"a..b"` with `a < b`.
pub fn parse(s: &str) -> Result<Range<usize>, String> {
    let (a, b) = s
        .trim()
        .split_once("..")
        .ok_or_else(|| format!("layer range {s:?} must look like 0..3"))?;
    let a: usize = a
        .trim()
        .parse()
        .map_err(|_| format!("bad range start in {s:?}"))?;
    let b: usize = b
        .trim()
        .parse()
        .map_err(|_| format!("bad range end in {s:?}"))?;
    if a >= b {
        return Err(format!("layer range {s:?} is empty"));
    }
    Ok(a..b)
}
