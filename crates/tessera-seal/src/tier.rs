//! Device tiers as policy classes. A phone on a battery and a server in a rack differ in how long
//! they are trusted to hold a job before it is handed on, how often their answers are checked on a
//! second worker, and whether they are expected to leave mid-job; a node states its tier in its
//! signed claims ([`crate::claims`]) and these figures follow from it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::FormatError;

/// The class of machine a node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceTier {
    Phone,
    Laptop,
    Workstation,
    Server,
}

/// What a tier means for scheduling and trust.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierPolicy {
    /// How long a dispatched job stays with the node without word from it (a progress report
    /// renews the lease): short where the node may vanish, so the job moves on quickly.
    pub lease_ms: u64,
    /// Share of its answers re-run on a second worker, in thousandths.
    pub verify_per_mille: u32,
    /// Whether the node is expected to leave mid-job (battery, lid, network change): a long
    /// job ([`LONG_JOB_POSITIONS`]) goes first to candidates that are not, and so do checks of
    /// other workers' answers.
    pub expected_to_leave: bool,
    /// Most KV positions (prompt plus new tokens) of a job sent to the node, whatever it
    /// claims room for: short jobs only where memory and battery are scarce.
    pub max_job_positions: Option<u64>,
}

/// A job at least this many positions long (prompt plus new tokens) is long: it is dispatched
/// first to candidates whose tier is not expected to leave mid-job.
pub const LONG_JOB_POSITIONS: u64 = 2048;

impl DeviceTier {
    pub const ALL: [Self; 4] = [Self::Phone, Self::Laptop, Self::Workstation, Self::Server];

    /// The tier's policy. The figures are starting points, not measurements: leases a few decode
    /// seconds long (renewed by progress), verification heavier where machines are many, cheap
    /// and anonymous.
    pub fn policy(self) -> TierPolicy {
        match self {
            Self::Phone => TierPolicy {
                lease_ms: 5_000,
                verify_per_mille: 200,
                expected_to_leave: true,
                max_job_positions: Some(4096),
            },
            Self::Laptop => TierPolicy {
                lease_ms: 10_000,
                verify_per_mille: 100,
                expected_to_leave: true,
                max_job_positions: None,
            },
            Self::Workstation => TierPolicy {
                lease_ms: 20_000,
                verify_per_mille: 50,
                expected_to_leave: false,
                max_job_positions: None,
            },
            Self::Server => TierPolicy {
                lease_ms: 30_000,
                verify_per_mille: 20,
                expected_to_leave: false,
                max_job_positions: None,
            },
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Phone => "phone",
            Self::Laptop => "laptop",
            Self::Workstation => "workstation",
            Self::Server => "server",
        }
    }

    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(c: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.code() == c)
    }
}

impl fmt::Display for DeviceTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DeviceTier {
    type Err = FormatError;
    fn from_str(s: &str) -> Result<Self, FormatError> {
        Self::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| FormatError {
                what: "device tier",
                reason: format!("{s:?} (use phone, laptop, workstation or server)"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn less_dependable_tiers_get_shorter_leases_and_more_verification() {
        for w in DeviceTier::ALL.windows(2) {
            let (a, b) = (w[0].policy(), w[1].policy());
            assert!(a.lease_ms < b.lease_ms, "{} vs {}", w[0], w[1]);
            assert!(
                a.verify_per_mille > b.verify_per_mille,
                "{} vs {}",
                w[0],
                w[1]
            );
            assert!(a.expected_to_leave >= b.expected_to_leave);
        }
        assert!(DeviceTier::Phone.policy().expected_to_leave);
        assert!(!DeviceTier::Server.policy().expected_to_leave);
    }

    #[test]
    fn tiers_parse_by_name_and_code() {
        for t in DeviceTier::ALL {
            assert_eq!(t.name().parse::<DeviceTier>().unwrap(), t);
            assert_eq!(DeviceTier::from_code(t.code()), Some(t));
        }
        assert!("tablet".parse::<DeviceTier>().is_err());
        assert_eq!(DeviceTier::from_code(9), None);
    }
}
