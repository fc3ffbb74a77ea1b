//! Disks in the lab: each emulated host reads its data at the rate of the disk it stands for.
//!
//! A host's cgroup caps the read bandwidth and read IOPS (cgroup v1 `blkio.throttle.*`, v2
//! `io.max`) on the block device that holds the lab's data ([`device`]: a directory's device
//! resolved to the whole disk the throttle applies to). The rates come from a [`DiskProfile`]
//! named in a scenario (`[[lab.node]] disk = "emmc"`). The throttle only slows reads down: a
//! profile faster than this machine's own disk cannot be emulated, and `tessera lab selftest`
//! ([`measure`]: `O_DIRECT` reads from inside a host's cgroup) says which are.
//!
//! The page cache a host fills is charged to its memory cgroup, so a host's memory cap also
//! bounds what it can cache; the selftest checks that too ([`measure::page_cache`]).

pub mod device;
pub mod emulated;
pub mod measure;
pub mod mounts;
pub mod selftest;

pub use device::{device_of, BlockDevice, DevId};

/// What a kind of disk reads at: sequential bandwidth and random 4 KiB IOPS. The figures are
/// estimates of typical parts (data sheets and published benchmarks), not measurements.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskProfile {
    /// The name a scenario uses.
    pub name: &'static str,
    /// What it stands for.
    pub about: &'static str,
    /// Sequential read bandwidth, bytes/s.
    pub read_bps: u64,
    /// Random read operations per second.
    pub read_iops: u64,
}

const MB: u64 = 1_000_000;

/// The profiles, fastest first. All figures are estimates for a typical part of each kind.
pub const PROFILES: [DiskProfile; 6] = [
    DiskProfile {
        name: "nvme-gen4",
        about: "NVMe SSD on PCIe 4.0 x4 (estimate: 7.0 GB/s, 1M IOPS)",
        read_bps: 7_000 * MB,
        read_iops: 1_000_000,
    },
    DiskProfile {
        name: "nvme-gen3",
        about: "NVMe SSD on PCIe 3.0 x4 (estimate: 3.5 GB/s, 500k IOPS)",
        read_bps: 3_500 * MB,
        read_iops: 500_000,
    },
    DiskProfile {
        name: "sata-ssd",
        about: "SATA III SSD (estimate: 550 MB/s, 90k IOPS)",
        read_bps: 550 * MB,
        read_iops: 90_000,
    },
    DiskProfile {
        name: "usb",
        about: "SSD in a USB 3.0 (5 Gbit/s, UAS) enclosure (estimate: 400 MB/s, 5k IOPS)",
        read_bps: 400 * MB,
        read_iops: 5_000,
    },
    DiskProfile {
        name: "emmc",
        about: "eMMC 5.1 module of an RK3588 board (estimate: 300 MB/s, 6k IOPS)",
        read_bps: 300 * MB,
        read_iops: 6_000,
    },
    DiskProfile {
        name: "sd",
        about: "UHS-I A2 microSD card of an RK3588 board (estimate: 90 MB/s, 3k IOPS)",
        read_bps: 90 * MB,
        read_iops: 3_000,
    },
];

impl DiskProfile {
    /// The profile called `name`.
    pub fn named(name: &str) -> Option<Self> {
        PROFILES.iter().copied().find(|p| p.name == name)
    }

    /// Every profile's name, for messages.
    pub fn names() -> String {
        PROFILES.map(|p| p.name).join(", ")
    }
}

/// The read caps a host's cgroup imposes, on each of `devices`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskCap {
    pub devices: Vec<DevId>,
    pub read_bps: u64,
    pub read_iops: u64,
}

impl DiskCap {
    /// The lines for v1 `blkio.throttle.read_bps_device` and `read_iops_device`, one per device
    /// (each written on its own: the kernel takes one rule per write).
    pub fn v1_rules(&self) -> (Vec<String>, Vec<String>) {
        let bps = self
            .devices
            .iter()
            .map(|d| format!("{d} {}", self.read_bps))
            .collect();
        let iops = self
            .devices
            .iter()
            .map(|d| format!("{d} {}", self.read_iops))
            .collect();
        (bps, iops)
    }

    /// The lines for v2 `io.max`, one per device.
    pub fn v2_rules(&self) -> Vec<String> {
        self.devices
            .iter()
            .map(|d| format!("{d} rbps={} riops={}", self.read_bps, self.read_iops))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_are_named_once_and_fastest_first() {
        for (i, p) in PROFILES.iter().enumerate() {
            assert_eq!(DiskProfile::named(p.name), Some(*p));
            assert!(PROFILES[..i].iter().all(|q| q.name != p.name));
            assert!(PROFILES[..i].iter().all(|q| q.read_bps >= p.read_bps));
            assert!(p.about.contains("estimate"), "{}", p.about);
        }
        assert_eq!(DiskProfile::named("floppy"), None);
    }

    #[test]
    fn a_cap_writes_one_rule_per_device_in_each_interface() {
        let cap = DiskCap {
            devices: vec![DevId::new(254, 0), DevId::new(8, 16)],
            read_bps: 300_000_000,
            read_iops: 6000,
        };
        let (bps, iops) = cap.v1_rules();
        assert_eq!(bps, ["254:0 300000000", "8:16 300000000"]);
        assert_eq!(iops, ["254:0 6000", "8:16 6000"]);
        assert_eq!(
            cap.v2_rules(),
            [
                "254:0 rbps=300000000 riops=6000",
                "8:16 rbps=300000000 riops=6000"
            ]
        );
    }
}
