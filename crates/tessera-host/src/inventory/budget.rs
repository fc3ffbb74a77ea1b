//! Memory budget: how much memory the operator lets this node use, and the refusal of work
//! beyond it.
//!
//! [`MemoryBudget`] parses "6GiB", "1.5 GiB", "512MiB", "8GB", "4096" (bytes) or "80%"; bare
//! K/M/G/T are refused as ambiguous between powers of 1024 and of 1000. A budget is resolved
//! against the node's usable RAM ([`Inventory::set_budget`]), and [`Inventory::accepts`]
//! checks work against it, or against the RAM available when measured if no budget is set; with
//! neither known the node refuses, since it cannot promise what it cannot measure. A
//! [`BudgetRefusal`] names the figures.

use std::fmt;
use std::str::FromStr;

use tessera_model::human_bytes;

use super::{Inventory, ResolvedBudget};

/// How much memory the operator lets this node use: an absolute size or a share of total RAM.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemoryBudget {
    Bytes(u64),
    /// Percent of total RAM, in (0, 100].
    PercentOfTotal(f64),
}

/// A budget string that does not parse, or a budget that does not fit the machine.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BudgetError {
    #[error(
        "empty memory budget: give a size such as \"6GiB\", \"512MiB\" or a share such as \"80%\""
    )]
    Empty,
    #[error("memory budget {input:?}: {what}")]
    Malformed { input: String, what: String },
    #[error(
        "memory budget {input:?}: unit {unit:?} is ambiguous; write {unit}iB (powers of 1024) \
         or {unit}B (powers of 1000)"
    )]
    AmbiguousUnit { input: String, unit: String },
    #[error("memory budget {input:?}: a share of RAM must be more than 0% and at most 100%")]
    PercentOutOfRange { input: String },
    #[error("memory budget {input:?}: zero bytes admits no work")]
    Zero { input: String },
    #[error(
        "memory budget {} ({budget} bytes) exceeds this node's total RAM, {} ({total} bytes)",
        human_bytes(*budget),
        human_bytes(*total)
    )]
    ExceedsTotal { budget: u64, total: u64 },
    #[error("memory budget {spec}: a share of RAM needs the total RAM, which this node could not measure; give an absolute size")]
    TotalUnknown { spec: String },
}

impl MemoryBudget {
    /// Parses "6GiB", "1.5 GiB", "512MiB", "8GB", "4096" (bytes), "80%". Binary units (KiB,
    /// MiB, GiB, TiB, or Ki/Mi/Gi/Ti) are powers of 1024, decimal ones (KB, MB, GB, TB) powers
    /// of 1000; bare K/M/G/T are refused as ambiguous. Units are case-insensitive.
    pub fn parse(input: &str) -> Result<Self, BudgetError> {
        let s = input.trim();
        if s.is_empty() {
            return Err(BudgetError::Empty);
        }
        let malformed = |what: &str| BudgetError::Malformed {
            input: input.to_string(),
            what: what.to_string(),
        };
        if let Some(num) = s.strip_suffix('%') {
            let p: f64 = num
                .trim()
                .parse()
                .map_err(|_| malformed("expected a number before '%'"))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(BudgetError::PercentOutOfRange {
                    input: input.to_string(),
                });
            }
            return Ok(Self::PercentOfTotal(p));
        }
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (num, unit) = (&s[..split], s[split..].trim());
        if num.is_empty() {
            return Err(malformed("expected a number, e.g. \"6GiB\" or \"80%\""));
        }
        let mult: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kib" | "ki" => 1 << 10,
            "mib" | "mi" => 1 << 20,
            "gib" | "gi" => 1 << 30,
            "tib" | "ti" => 1 << 40,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            "k" | "m" | "g" | "t" => {
                return Err(BudgetError::AmbiguousUnit {
                    input: input.to_string(),
                    unit: unit.to_ascii_uppercase(),
                })
            }
            _ => {
                return Err(malformed(&format!(
                    "unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB or %)"
                )))
            }
        };
        let bytes = if num.contains('.') {
            let v: f64 = num.parse().map_err(|_| malformed("not a number"))?;
            let b = (v * mult as f64).floor();
            if !b.is_finite() || b >= u64::MAX as f64 {
                return Err(malformed("too large"));
            }
            b as u64
        } else {
            num.parse::<u64>()
                .ok()
                .and_then(|n| n.checked_mul(mult))
                .ok_or_else(|| malformed("too large"))?
        };
        if bytes == 0 {
            return Err(BudgetError::Zero {
                input: input.to_string(),
            });
        }
        Ok(Self::Bytes(bytes))
    }

    /// The budget in bytes on a machine with `total_ram` bytes (`None`: unknown). An absolute
    /// budget above total RAM is refused; with total RAM unknown it is taken at its word, but
    /// a percentage cannot be resolved.
    pub fn resolve(&self, total_ram: Option<u64>) -> Result<u64, BudgetError> {
        match *self {
            Self::Bytes(b) => match total_ram {
                Some(total) if b > total => Err(BudgetError::ExceedsTotal { budget: b, total }),
                _ => Ok(b),
            },
            Self::PercentOfTotal(p) => {
                let total = total_ram.ok_or_else(|| BudgetError::TotalUnknown {
                    spec: self.to_string(),
                })?;
                Ok((total as f64 * p / 100.0).floor() as u64)
            }
        }
    }
}

impl FromStr for MemoryBudget {
    type Err = BudgetError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Bytes(b) => {
                for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
                    if b % (1u64 << shift) == 0 {
                        return write!(f, "{}{unit}", b >> shift);
                    }
                }
                write!(f, "{b}B")
            }
            Self::PercentOfTotal(p) => write!(f, "{p}%"),
        }
    }
}

/// The node refuses work beyond its budget; this says by how much and against which figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BudgetRefusal {
    /// Bytes the work needs.
    pub requested: u64,
    /// The limit it was checked against; `None` when there is none to check against.
    pub limit: Option<u64>,
    /// What the limit is, in words ("memory budget \"6GiB\"", "available RAM (no budget set)").
    pub limit_source: String,
    pub total_ram: Option<u64>,
    pub available_ram: Option<u64>,
}

impl fmt::Display for BudgetRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = |n: u64| format!("{} ({n} bytes)", human_bytes(n));
        let opt = |n: Option<u64>| n.map_or_else(|| "unknown".to_string(), human_bytes);
        write!(f, "node refuses work needing {}: ", b(self.requested))?;
        match self.limit {
            Some(limit) => write!(
                f,
                "its {} is {}, {} short",
                self.limit_source,
                b(limit),
                human_bytes(self.requested.saturating_sub(limit))
            )?,
            None => write!(f, "{}", self.limit_source)?,
        }
        write!(
            f,
            " (total RAM {}, available {})",
            opt(self.total_ram),
            opt(self.available_ram)
        )
    }
}

impl std::error::Error for BudgetRefusal {}

impl Inventory {
    /// Resolves `budget` against this node's usable RAM (total, lowered by a cgroup limit) and
    /// records it; returns the budget in bytes.
    pub fn set_budget(&mut self, budget: &MemoryBudget) -> Result<u64, BudgetError> {
        let bytes = budget.resolve(self.memory.usable_total_bytes())?;
        self.memory_budget = Some(ResolvedBudget {
            bytes,
            spec: budget.to_string(),
        });
        Ok(bytes)
    }

    /// [`Inventory::set_budget`], by value.
    pub fn with_budget(mut self, budget: &MemoryBudget) -> Result<Self, BudgetError> {
        self.set_budget(budget)?;
        Ok(self)
    }

    /// Whether this node takes on work needing `bytes` of memory. The limit is the memory budget
    /// when one is set; otherwise the RAM available when measured. With neither known, the
    /// node refuses: it cannot promise what it cannot measure.
    pub fn accepts(&self, bytes: u64) -> Result<(), BudgetRefusal> {
        let (limit, limit_source) = match (&self.memory_budget, self.memory.available_bytes) {
            (Some(b), _) => (Some(b.bytes), format!("memory budget \"{}\"", b.spec)),
            (None, Some(avail)) => (Some(avail), "available RAM (no budget set)".to_string()),
            (None, None) => (
                None,
                "no memory budget is set and available RAM is unknown".to_string(),
            ),
        };
        match limit {
            Some(limit) if bytes <= limit => Ok(()),
            _ => Err(BudgetRefusal {
                requested: bytes,
                limit,
                limit_source,
                total_ram: self.memory.total_bytes,
                available_ram: self.memory.available_bytes,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        let p = |s| MemoryBudget::parse(s).unwrap();
        assert_eq!(p("6GiB"), MemoryBudget::Bytes(6 << 30));
        assert_eq!(p("6 GiB"), MemoryBudget::Bytes(6 << 30));
        assert_eq!(p("6gib"), MemoryBudget::Bytes(6 << 30));
        assert_eq!(p("6Gi"), MemoryBudget::Bytes(6 << 30));
        assert_eq!(p("512MiB"), MemoryBudget::Bytes(512 << 20));
        assert_eq!(p("1.5GiB"), MemoryBudget::Bytes(3 << 29));
        assert_eq!(p("8GB"), MemoryBudget::Bytes(8_000_000_000));
        assert_eq!(p("2TiB"), MemoryBudget::Bytes(2 << 40));
        assert_eq!(p("4096"), MemoryBudget::Bytes(4096));
        assert_eq!(p("4096B"), MemoryBudget::Bytes(4096));
        assert_eq!(p(" 80% "), MemoryBudget::PercentOfTotal(80.0));
        assert_eq!(p("12.5%"), MemoryBudget::PercentOfTotal(12.5));
        assert_eq!("6GiB".parse::<MemoryBudget>().unwrap(), p("6GiB"));
    }

    #[test]
    fn display_round_trips() {
        for s in ["6GiB", "512MiB", "80%", "4097B", "3KiB"] {
            let b = MemoryBudget::parse(s).unwrap();
            assert_eq!(b.to_string(), s);
            assert_eq!(MemoryBudget::parse(&b.to_string()).unwrap(), b);
        }
    }

    #[test]
    fn rejects_bad_strings() {
        for s in [
            "",
            "  ",
            "GiB",
            "six GiB",
            "6 GiBs",
            "-1GiB",
            "6XB",
            "1.2.3GiB",
            "0",
            "0GiB",
            "0%",
            "101%",
            "-5%",
            "abc%",
            "%",
            "99999999999999999999",
            "20000000TiB",
            "6G",
            "6 m",
        ] {
            assert!(MemoryBudget::parse(s).is_err(), "{s:?} should not parse");
        }
        assert!(matches!(
            MemoryBudget::parse("6G"),
            Err(BudgetError::AmbiguousUnit { .. })
        ));
        let msg = MemoryBudget::parse("6G").unwrap_err().to_string();
        assert!(msg.contains("GiB") && msg.contains("GB"), "{msg}");
    }

    #[test]
    fn resolves_against_total() {
        let total = Some(16u64 << 30);
        assert_eq!(MemoryBudget::Bytes(6 << 30).resolve(total), Ok(6 << 30));
        assert_eq!(
            MemoryBudget::PercentOfTotal(50.0).resolve(total),
            Ok(8 << 30)
        );
        assert_eq!(
            MemoryBudget::PercentOfTotal(100.0).resolve(total),
            Ok(16 << 30)
        );
        let err = MemoryBudget::Bytes(32 << 30).resolve(total).unwrap_err();
        assert_eq!(
            err,
            BudgetError::ExceedsTotal {
                budget: 32 << 30,
                total: 16 << 30
            }
        );
        assert!(err.to_string().contains("32.00 GiB"), "{err}");
        assert!(err.to_string().contains("16.00 GiB"), "{err}");
        // Unknown total: an absolute budget is taken at its word, a share cannot be resolved.
        assert_eq!(MemoryBudget::Bytes(6 << 30).resolve(None), Ok(6 << 30));
        assert!(matches!(
            MemoryBudget::PercentOfTotal(80.0).resolve(None),
            Err(BudgetError::TotalUnknown { .. })
        ));
    }
}
