//! `tessera lab clean`: what a killed lab left behind (its network namespaces) is removed.

use std::time::Duration;

use crate::common;
use crate::lab_or_skip;
use tessera_lab::{HostSpec, LabSpec};

#[test]
fn tessera_lab_clean_removes_what_a_killed_lab_left_behind() {
    if tessera_lab::tun::check_supported().is_err() {
        // The same rule as every lab test: only where namespaces can be made, and always in CI.
        assert!(lab_or_skip(&LabSpec::new(vec![HostSpec::new("x")])).is_none());
        return;
    }
    // A selftest is a lab that runs for a while; kill it without warning once its hosts exist.
    let mut child = std::process::Command::new(common::bin())
        .args(["lab", "selftest"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let prefix = format!("{}{}-", tessera_lab::lab::PREFIX, child.id());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while tessera_lab::netns::list(&prefix).len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the selftest made no hosts"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !tessera_lab::netns::list(&prefix).is_empty(),
        "a killed lab cleans nothing itself"
    );

    let out = std::process::Command::new(common::bin())
        .args(["lab", "clean"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains(&prefix), "{said}");
    assert!(tessera_lab::netns::list(&prefix).is_empty(), "left: {said}");
}
