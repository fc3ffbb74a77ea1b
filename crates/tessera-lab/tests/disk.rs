//! Disks and the switch's floor on a real lab: the caps a host's cgroup is given, the page
//! cache held to a host's memory cap, and the floor taken off every delay. Behaviour only:
//! the rates themselves are measured by `tessera lab selftest`.
//!
//! Needs root (namespaces, TUN devices, cgroups). Without it the test says so and returns —
//! except under `CI=true`, where the machine is expected to be able to and the test fails.

use tessera_lab::cgroup::Limits;
use tessera_lab::disk::measure::{page_cache, TestFile};
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
            Ok(c)
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
