//! The disk part of `tessera lab selftest` (see [`crate::selftest`]): one host per profile,
//! each reading through its emulated disk ([`super::emulated`]), and one host with a memory
//! cap for the page cache, reading through a view too.

use std::path::Path;

use super::measure::{self, ReadLoad, TestFile};
use super::{DiskProfile, PROFILES};
use crate::cgroup::Limits;
use crate::error::{LabError, Result};
use crate::lab::{HostSpec, Lab, LabSpec};
use crate::selftest::Check;

/// The memory cap of the page cache check, and its two files.
const CACHE_CAP: u64 = 64 << 20;
const SMALL: u64 = 16 << 20;
const LARGE: u64 = 3 * CACHE_CAP;
/// The file the direct reads go over: larger than any read-ahead, small enough to write fast.
const READ_FILE: u64 = 256 << 20;
/// A rate is emulable when this disk, uncapped, reads faster than it by this margin: a cap
/// just under the disk's own rate is not a cap.
const HEADROOM: f64 = 1.15;
/// The burst read after a pause: a few experts' worth, as a ring stage reads them a token.
const BURST: u64 = 8 << 20;
/// The page cache host's disk: any profile (the check counts what its view served).
const CACHE_DISK: DiskProfile = super::PROFILES[2];
/// Within this of the requested rate.
const TOLERANCE: f64 = 0.10;

fn io(what: &str) -> impl Fn(std::io::Error) -> LabError + '_ {
    move |e| LabError::io(what.to_string(), e)
}

/// Measures the disk holding `dir` uncapped, each profile's cap, and the page cache.
pub fn run(dir: &Path, push: &mut impl FnMut(Check)) -> Result<()> {
    let mut hosts: Vec<HostSpec> = PROFILES
        .iter()
        .map(|p| HostSpec::new(p.name).disk(*p))
        .collect();
    let mut cache = HostSpec::new("cache").disk(CACHE_DISK);
    cache.limits = Limits {
        memory: Some(CACHE_CAP),
        ..Limits::default()
    };
    hosts.push(cache);
    let mut spec = LabSpec::new(hosts);
    spec.disk_paths = vec![dir.to_path_buf()];
    spec.disk_dirs = vec![dir.to_path_buf()];
    spec.compensate_switch = false;
    let lab = Lab::start(&spec)?;
    let disk = &lab.disks()[0];
    push(Check {
        what: "disk".into(),
        requested: dir.display().to_string(),
        measured: format!("{} ({})", disk.name, disk.id),
        tolerance: disk.how.clone(),
        ok: true,
        na: false,
    });
    let scratch = tempfile::Builder::new()
        .prefix("tlab-disk-")
        .tempdir_in(dir)
        .map_err(io("making a scratch directory"))?;
    let file = TestFile::create(&scratch.path().join("reads"), READ_FILE)
        .map_err(io("writing the test file"))?;
    let outside = || Ok(());
    let real = (file.path.as_path(), file.len);
    let bw = measure::direct_reads(real, &ReadLoad::bandwidth(), &outside)
        .map_err(io("reading the disk uncapped"))?;
    let ops = measure::direct_reads(real, &ReadLoad::iops(), &outside)
        .map_err(io("reading the disk uncapped"))?;
    push(Check {
        what: "disk uncapped".into(),
        requested: "none".into(),
        measured: format!(
            "{:.0} MB/s (1 MiB x4), {:.0} IOPS (4 KiB x8)",
            bw.bytes_per_s / 1e6,
            ops.ops_per_s
        ),
        tolerance: "what caps can go up to".into(),
        ok: true,
        na: false,
    });
    for (i, p) in PROFILES.iter().enumerate() {
        let cg = lab.cgroup(i).expect("a host with a disk has a cgroup");
        let enter = || cg.enter_thread();
        let seen = lab.through_disk(i, &file.path);
        let seen = (seen.as_path(), file.len);
        push(cap_check(
            p,
            "read bandwidth",
            p.read_bps as f64,
            bw.bytes_per_s,
            |mb| format!("{:.0} MB/s", mb / 1e6),
            || measure::direct_reads(seen, &ReadLoad::bandwidth(), &enter).map(|r| r.bytes_per_s),
        )?);
        // A real disk saves no credit while idle: a read after a pause takes as long as any
        // (the cgroup throttle alone let these run at this disk's own speed).
        push(cap_check(
            p,
            "burst after 0.4 s idle",
            p.read_bps as f64,
            bw.bytes_per_s,
            |mb| format!("{:.0} MB/s", mb / 1e6),
            || {
                measure::burst_after_idle(
                    seen,
                    BURST,
                    std::time::Duration::from_millis(400),
                    &enter,
                )
            },
        )?);
        push(cap_check(
            p,
            "read IOPS",
            p.read_iops as f64,
            ops.ops_per_s,
            |n| format!("{n:.0} IOPS"),
            || measure::direct_reads(seen, &ReadLoad::iops(), &enter).map(|r| r.ops_per_s),
        )?);
    }
    drop(file);
    let host = lab.host("cache")?;
    let cg = lab.cgroup(host).expect("the cache host has a cgroup");
    let small = TestFile::create(&scratch.path().join("small"), SMALL)
        .map_err(io("writing the test file"))?;
    let large = TestFile::create(&scratch.path().join("large"), LARGE)
        .map_err(io("writing the test file"))?;
    let pc = measure::page_cache(
        CACHE_CAP,
        &small,
        &large,
        |f| {
            let mut c = lab
                .command(host, "dd")
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            c.arg(format!("if={}", f.display()))
                .args(["of=/dev/null", "bs=1M", "status=none"]);
            let served = &lab
                .emulated_disk(host)
                .expect("the cache host has a disk")
                .stats;
            let before = served.bytes();
            measure::inblock_of(c)?;
            Ok(served.bytes() - before)
        },
        || cg.page_cache(),
    )
    .map_err(io("reading through the page cache"))?;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    push(Check {
        what: "page cache".into(),
        requested: format!("memory cap {:.0} MiB", mib(CACHE_CAP)),
        measured: format!(
            "from disk, 1st/2nd read: {:.0}/{:.0} of {:.0} MiB, {:.0}/{:.0} of {:.0} MiB; cached {}",
            mib(pc.small.first),
            mib(pc.small.again),
            mib(pc.small.len),
            mib(pc.large.first),
            mib(pc.large.again),
            mib(pc.large.len),
            pc.cached_after
                .map_or("?".into(), |c| format!("{:.0} MiB", mib(c)))
        ),
        tolerance: "cache within the cap".into(),
        ok: pc.bounded(),
        na: false,
    });
    Ok(())
}

/// One profile's cap on one figure: measured from inside the host, unless this disk is too
/// slow to show it.
fn cap_check(
    p: &DiskProfile,
    what: &str,
    requested: f64,
    uncapped: f64,
    show: impl Fn(f64) -> String,
    measure: impl FnOnce() -> std::io::Result<f64>,
) -> Result<Check> {
    let mut c = Check {
        what: format!("disk {} {what}", p.name),
        requested: show(requested),
        measured: String::new(),
        tolerance: format!("±{:.0}%", TOLERANCE * 100.0),
        ok: true,
        na: false,
    };
    if uncapped < requested * HEADROOM {
        c.measured = format!("not emulable: this disk reads {}", show(uncapped));
        c.na = true;
        return Ok(c);
    }
    let got = measure().map_err(io("reading from inside a host"))?;
    c.measured = format!("{} ({:+.1}%)", show(got), (got / requested - 1.0) * 100.0);
    c.ok = (got / requested - 1.0).abs() <= TOLERANCE;
    Ok(c)
}
