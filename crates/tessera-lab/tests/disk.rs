//! Disks and the switch's floor on a real lab: the caps a host's cgroup is given, the page
//! cache held to a host's memory cap, and the floor taken off every delay. Behaviour only:
//! the rates themselves are measured by `tessera lab selftest`.
//!
//! Needs root (namespaces, TUN devices, cgroups). Without it the test says so and returns —
//! except under `CI=true`, where the machine is expected to be able to and the test fails.

use tessera_lab::cgroup::Limits;
use tessera_lab::disk::measure::{inblock_of, page_cache, TestFile};
use tessera_lab::disk::DiskProfile;
use tessera_lab::{HostSpec, Lab, LabError, LabSpec};

fn lab_or_skip(spec: &LabSpec) -> Option<Lab> {
    match Lab::start(spec) {
        Ok(lab) => Some(lab),
        Err(LabError::Unsupported(why)) if std::env::var("CI").as_deref() != Ok("true") => {
            eprintln!("lab test not run: {why}");
            None
        }
        Err(e) => panic!("starting the lab: {e}"),
    }
}

#[test]
fn a_host_with_a_disk_is_capped_at_its_profiles_rates_on_the_disk_holding_its_data() {
    let sd = DiskProfile::named("sd").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = LabSpec::new(vec![HostSpec::new("board").disk(sd), HostSpec::new("free")]);
    spec.disk_paths = vec![dir.path().to_path_buf()];
    let Some(lab) = lab_or_skip(&spec) else {
        return;
    };
    let disk = &lab.disks()[0];
    assert!(!disk.how.is_empty());
    let caps = lab.cgroup(0).unwrap().read_caps().expect("read caps");
    for want in [sd.read_bps, sd.read_iops] {
        assert!(
            caps.contains(&format!("{} {want}", disk.id))
                || caps.contains(&format!("{} rbps={}", disk.id, sd.read_bps)),
            "{caps}"
        );
    }
    // The other host reads at the disk's own rate.
    assert!(lab.cgroup(1).is_none());
}

#[test]
fn the_page_cache_a_host_fills_is_held_to_its_memory_cap() {
    let cap = 32 << 20;
    let mut host = HostSpec::new("small");
    host.limits = Limits {
        memory: Some(cap),
        ..Limits::default()
    };
    let Some(lab) = lab_or_skip(&LabSpec::new(vec![host])) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let small = TestFile::create(&dir.path().join("small"), 8 << 20).unwrap();
    let large = TestFile::create(&dir.path().join("large"), 3 * cap).unwrap();
    let cg = lab.cgroup(0).unwrap();
    let pc = page_cache(
        cap,
        &small,
        &large,
        |f| {
            let mut c = lab
                .command(0, "dd")
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            c.arg(format!("if={}", f.display()))
                .args(["of=/dev/null", "bs=1M", "status=none"]);
            inblock_of(c)
        },
        || cg.page_cache(),
    )
    .unwrap();
    assert!(pc.bounded(), "{pc:?}");
}

#[test]
fn a_labs_links_are_shortened_by_the_switchs_own_round_trip() {
    let spec = LabSpec::new(vec![HostSpec::new("a"), HostSpec::new("b")]);
    let Some(lab) = lab_or_skip(&spec) else {
        return;
    };
    let floor = lab.switch_floor().expect("two hosts: a floor");
    assert!(floor > std::time::Duration::ZERO);
    assert_eq!(lab.switch().compensation(), floor / 2);
    drop(lab);
    let mut spec = spec;
    spec.compensate_switch = false;
    let Some(lab) = lab_or_skip(&spec) else {
        return;
    };
    assert_eq!(lab.switch_floor(), None);
    assert_eq!(lab.switch().compensation(), std::time::Duration::ZERO);
}

/// Runs `dd` on host `i` over `file` (`O_DIRECT` when `direct`) to its successful end.
fn dd(lab: &Lab, i: usize, file: &std::path::Path, direct: bool) {
    let mut c = lab.command(i, "dd").unwrap();
    c.arg(format!("if={}", file.display()))
        .args(["of=/dev/null", "bs=1M", "status=none"]);
    if direct {
        c.arg("iflag=direct");
    }
    let status = c.status().unwrap();
    assert!(status.success(), "dd on host {i}: {status}");
}

#[test]
fn a_host_with_a_disk_uses_its_disk_dirs_through_its_own_emulated_disk() {
    let sd = DiskProfile::named("sd").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let len: u64 = 4 << 20;
    let file = TestFile::create(&dir.path().join("model"), len).unwrap();
    let mut spec = LabSpec::new(vec![
        HostSpec::new("board").disk(sd),
        HostSpec::new("other").disk(sd),
        HostSpec::new("free"),
    ]);
    spec.disk_dirs = vec![dir.path().to_path_buf()];
    let Some(lab) = lab_or_skip(&spec) else {
        return;
    };
    let served = |i: usize| lab.emulated_disk(i).unwrap().stats.bytes();
    // Each disk host has a disk of its own; the host without a disk reads the real file.
    for i in 0..2 {
        assert_eq!(lab.emulated_disk(i).unwrap().views().len(), 1);
    }
    assert!(lab.emulated_disk(2).is_none());
    // The host's processes read the same path, and every byte comes through its disk and
    // takes the disk's time at least (the view answers no read before the clock says so).
    let t = std::time::Instant::now();
    dd(&lab, 0, &file.path, true);
    let took = t.elapsed();
    assert_eq!((served(0), served(1)), (len, 0));
    let floor = std::time::Duration::from_secs_f64(len as f64 / sd.read_bps as f64);
    assert!(
        took >= floor,
        "{took:?} for {len} bytes at {} B/s",
        sd.read_bps
    );
    // Buffered reads fill the host's own page cache: the second pass is served from it.
    dd(&lab, 1, &file.path, false);
    let first = served(1);
    assert!(first >= len, "{first}");
    dd(&lab, 1, &file.path, false);
    assert_eq!(served(1), first);
    // What the host writes there lands in the real directory (and is read back through the
    // disk).
    let mut c = lab.command(1, "sh").unwrap();
    c.arg("-c").arg(format!(
        "mkdir -p {0}/d && echo hi > {0}/d/t && mv {0}/d/t {0}/d/u && ln {0}/d/u {0}/d/v && rm {0}/d/u && cat {0}/d/v",
        dir.path().display()
    ));
    let out = c.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(out.stdout, b"hi\n");
    assert_eq!(std::fs::read(dir.path().join("d/v")).unwrap(), b"hi\n");
    assert!(!dir.path().join("d/u").exists());
    // The disk's free space is the real file system's (a node plans its store on it).
    let out = lab
        .command(1, "stat")
        .unwrap()
        .args(["-f", "-c", "%b"])
        .arg(dir.path())
        .output()
        .unwrap();
    let blocks: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(blocks > 0, "{out:?}");
    let first = served(1);
    // Neither disk saw the free host's reads; this process still sees the real directory.
    dd(&lab, 2, &file.path, true);
    assert_eq!((served(0), served(1)), (len, first));
    assert_eq!(lab.through_disk(2, &file.path), file.path);
    let view = lab.emulated_disk(0).unwrap().views()[0].mount_point.clone();
    assert_eq!(
        lab.through_disk(0, &file.path),
        view.join("model"),
        "the lab's own threads reach host 0's disk by its mount point"
    );
    drop(lab);
    assert!(
        !tessera_lab::disk::mounts::leftover_views().contains(&view),
        "the view is unmounted with its lab"
    );
}

/// A disk showing the temp directory (where the lab mounts its views) and a directory inside
/// it: the host reads that directory's files through their own view, each byte once, and a
/// command started inside a viewed directory reads through the view too. Before, the inner
/// view was bound by its mount point's name after the temp directory's view was bound, so it
/// was reached through the outer view, whose disk thread then waited on its own queue: `lab
/// exec --disk emmc -- env X=1 /tmp/tessera bench …` hung in the kernel until the views went.
#[test]
fn a_view_inside_another_views_directory_is_read_through_once() {
    let nvme = DiskProfile::named("nvme-gen4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    assert!(dir.path().starts_with(std::env::temp_dir()));
    let len: u64 = 2 << 20;
    let file = TestFile::create(&dir.path().join("model"), len).unwrap();
    let mut spec = LabSpec::new(vec![HostSpec::new("board").disk(nvme)]);
    spec.disk_dirs = vec![std::env::temp_dir(), dir.path().to_path_buf()];
    let Some(lab) = lab_or_skip(&spec) else {
        return;
    };
    let served = || lab.emulated_disk(0).unwrap().stats.bytes();
    let finishes = |mut c: std::process::Command| {
        let mut child = c.spawn().unwrap();
        // A hang is what this checks for: the guard is far above the 2 MiB's few milliseconds.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(std::time::Instant::now() < until, "the read hung");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let mut c = lab.command(0, "dd").unwrap();
    c.arg(format!("if={}", file.path.display())).args([
        "of=/dev/null",
        "bs=1M",
        "status=none",
        "iflag=direct",
    ]);
    assert!(finishes(c).success());
    assert_eq!(served(), len, "every byte served once, by the inner view");
    assert_eq!(
        lab.through_disk(0, &file.path),
        lab.emulated_disk(0).unwrap().views()[1]
            .mount_point
            .join("model"),
        "the lab's own threads read it through the inner view too"
    );
    let mut c = lab.command(0, "dd").unwrap();
    c.current_dir(dir.path()).args([
        "if=model",
        "of=/dev/null",
        "bs=1M",
        "status=none",
        "iflag=direct",
    ]);
    assert!(finishes(c).success());
    assert_eq!(served(), 2 * len, "a relative path from inside the view");
}
