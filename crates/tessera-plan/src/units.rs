//! Unit newtypes and the parsers for the human-readable figures in a cluster file
//! ("16GiB", "100GB/s", "1Gbit/s", "10TFLOPS", "20ms").

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign};

/// A number of bytes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Bytes(pub u64);

impl Bytes {
    pub const ZERO: Self = Self(0);
    pub const fn gib(n: u64) -> Self {
        Self(n << 30)
    }
    pub const fn mib(n: u64) -> Self {
        Self(n << 20)
    }
    /// Rounds a fractional byte count up.
    pub fn from_f64(x: f64) -> Self {
        Self(if x <= 0.0 { 0 } else { x.ceil() as u64 })
    }
    pub fn as_f64(self) -> f64 {
        self.0 as f64
    }
    pub fn as_gib(self) -> f64 {
        self.0 as f64 / (1u64 << 30) as f64
    }
}

impl Add for Bytes {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self(self.0.saturating_add(o.0))
    }
}
impl AddAssign for Bytes {
    fn add_assign(&mut self, o: Self) {
        self.0 = self.0.saturating_add(o.0);
    }
}
impl std::iter::Sum for Bytes {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::ZERO, |a, b| a + b)
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        if b >= (1u64 << 30) as f64 {
            write!(f, "{:.1} GiB", b / (1u64 << 30) as f64)
        } else if b >= (1u64 << 20) as f64 {
            write!(f, "{:.1} MiB", b / (1u64 << 20) as f64)
        } else if b >= 1024.0 {
            write!(f, "{:.1} KiB", b / 1024.0)
        } else {
            write!(f, "{} B", self.0)
        }
    }
}

/// A bandwidth in bytes per second.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BytesPerSec(pub f64);

impl BytesPerSec {
    pub fn gb_s(x: f64) -> Self {
        Self(x * 1e9)
    }
    pub fn gbit_s(x: f64) -> Self {
        Self(x * 1e9 / 8.0)
    }
    pub fn mb_s(x: f64) -> Self {
        Self(x * 1e6)
    }
    /// Seconds to move `bytes` at this rate (infinite when the rate is not positive).
    pub fn secs(self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            0.0
        } else if self.0 > 0.0 {
            bytes / self.0
        } else {
            f64::INFINITY
        }
    }
}

impl fmt::Display for BytesPerSec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 >= 1e9 {
            write!(f, "{:.1} GB/s", self.0 / 1e9)
        } else {
            write!(f, "{:.0} MB/s", self.0 / 1e6)
        }
    }
}

/// A compute rate in floating-point operations per second.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FlopsPerSec(pub f64);

impl FlopsPerSec {
    pub fn tflops(x: f64) -> Self {
        Self(x * 1e12)
    }
    pub fn gflops(x: f64) -> Self {
        Self(x * 1e9)
    }
    pub fn secs(self, flops: f64) -> f64 {
        if flops <= 0.0 {
            0.0
        } else if self.0 > 0.0 {
            flops / self.0
        } else {
            f64::INFINITY
        }
    }
}

impl fmt::Display for FlopsPerSec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 >= 1e12 {
            write!(f, "{:.1} TFLOPS", self.0 / 1e12)
        } else {
            write!(f, "{:.0} GFLOPS", self.0 / 1e9)
        }
    }
}

/// A figure that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot read {what} from {text:?}: {why}")]
pub struct UnitError {
    pub what: &'static str,
    pub text: String,
    pub why: String,
}

fn split_number(what: &'static str, s: &str) -> Result<(f64, String), UnitError> {
    let t = s.trim();
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(end);
    let num: String = num.chars().filter(|c| *c != '_').collect();
    let value: f64 = num.parse().map_err(|_| UnitError {
        what,
        text: s.to_string(),
        why: "expected a number followed by a unit".into(),
    })?;
    if !value.is_finite() || value < 0.0 {
        return Err(UnitError {
            what,
            text: s.to_string(),
            why: "must be a non-negative number".into(),
        });
    }
    Ok((value, unit.trim().to_ascii_lowercase()))
}

fn byte_multiplier(unit: &str) -> Option<f64> {
    Some(match unit {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "ki" | "kib" => 1024.0,
        "mi" | "mib" => 1024.0 * 1024.0,
        "gi" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "ti" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    })
}

/// "16GiB", "512 MiB", "8GB", "1.5TB", "1024" (bytes).
pub fn parse_bytes(s: &str) -> Result<Bytes, UnitError> {
    let (v, unit) = split_number("a size", s)?;
    let m = byte_multiplier(&unit).ok_or_else(|| UnitError {
        what: "a size",
        text: s.to_string(),
        why: format!("unknown unit {unit:?} (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"),
    })?;
    Ok(Bytes::from_f64(v * m))
}

/// "100GB/s", "25 GiB/s", "1Gbit/s", "1Gbps", "300Mbit/s".
pub fn parse_bandwidth(s: &str) -> Result<BytesPerSec, UnitError> {
    let (v, unit) = split_number("a bandwidth", s)?;
    let err = || UnitError {
        what: "a bandwidth",
        text: s.to_string(),
        why: format!("unknown unit {unit:?} (use e.g. GB/s, GiB/s, MB/s, Gbit/s, Mbit/s, Gbps)"),
    };
    let u = unit.as_str();
    let bits = |p: &str| -> Option<f64> {
        Some(match p {
            "" => 1.0,
            "k" => 1e3,
            "m" => 1e6,
            "g" => 1e9,
            "t" => 1e12,
            _ => return None,
        })
    };
    let value = if let Some(p) = u.strip_suffix("bit/s").or_else(|| u.strip_suffix("bps")) {
        v * bits(p).ok_or_else(err)? / 8.0
    } else if let Some(p) = u.strip_suffix("/s") {
        v * byte_multiplier(p).ok_or_else(err)?
    } else {
        return Err(err());
    };
    Ok(BytesPerSec(value))
}

/// "10TFLOPS", "500 GFLOPS", "2000000" (FLOPS).
pub fn parse_flops(s: &str) -> Result<FlopsPerSec, UnitError> {
    let (v, unit) = split_number("a compute rate", s)?;
    let m = match unit.as_str() {
        "" | "flops" => 1.0,
        "kflops" => 1e3,
        "mflops" => 1e6,
        "gflops" => 1e9,
        "tflops" => 1e12,
        "pflops" => 1e15,
        _ => {
            return Err(UnitError {
                what: "a compute rate",
                text: s.to_string(),
                why: format!("unknown unit {unit:?} (use GFLOPS or TFLOPS)"),
            })
        }
    };
    Ok(FlopsPerSec(v * m))
}

/// "20ms", "0.3 ms", "1s", "150us" -> seconds.
pub fn parse_duration_s(s: &str) -> Result<f64, UnitError> {
    let (v, unit) = split_number("a duration", s)?;
    let m = match unit.as_str() {
        "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        _ => {
            return Err(UnitError {
                what: "a duration",
                text: s.to_string(),
                why: format!("unknown unit {unit:?} (use s, ms, us)"),
            })
        }
    };
    Ok(v * m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes_rates_and_durations() {
        assert_eq!(parse_bytes("16GiB").unwrap(), Bytes::gib(16));
        assert_eq!(parse_bytes("512 MiB").unwrap(), Bytes::mib(512));
        assert_eq!(parse_bytes("8GB").unwrap(), Bytes(8_000_000_000));
        assert_eq!(parse_bytes("1.5 TB").unwrap(), Bytes(1_500_000_000_000));
        assert!(parse_bytes("16 parsecs").is_err());
        assert!(parse_bytes("lots").is_err());
        assert_eq!(parse_bandwidth("100GB/s").unwrap().0, 100e9);
        assert_eq!(parse_bandwidth("1Gbit/s").unwrap().0, 125e6);
        assert_eq!(parse_bandwidth("1Gbps").unwrap().0, 125e6);
        assert_eq!(
            parse_bandwidth("2 GiB/s").unwrap().0,
            2.0 * 1024.0 * 1024.0 * 1024.0
        );
        assert!(parse_bandwidth("100GB").is_err());
        assert_eq!(parse_flops("10TFLOPS").unwrap().0, 10e12);
        assert_eq!(parse_flops("500 gflops").unwrap().0, 500e9);
        assert!((parse_duration_s("20ms").unwrap() - 0.020).abs() < 1e-12);
        assert_eq!(Bytes::gib(5).to_string(), "5.0 GiB");
    }
}
