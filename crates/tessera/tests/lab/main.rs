//! The lab end to end: real `tessera serve` and `tessera node` processes on emulated hosts
//! (network namespaces joined by the lab's user-space switch), a greedy request through the
//! gateway's API, compared with one process.
//!
//! Needs root (namespaces, TUN devices). Without it the test says so and returns — except
//! under `CI=true`, where the machine is expected to be able to and the test fails instead.
//!
//! One test binary, a module per concept; this file holds what they share (starting a lab or
//! skipping, running a `tessera lab` command for its JSON):
//! - `ring`: a stage split over three hosts on 2 ms links, against one process;
//! - `mdns`: a node given only the token finds the coordinator across the switch;
//! - `failover`: a killed node and a partitioned host leave the text unchanged;
//! - `clean`: `tessera lab clean` removes what a killed lab left behind;
//! - `lab_run`: `tessera lab run` measures plans (ring, expert split, one node streaming,
//!   speculation, a scaling curve over hosts);
//! - `hop`: `tessera lab hop`, what a hop adds;
//! - `cpu_quota`: a host's CPU quota binds within milliseconds and lifts while nodes probe.

#[path = "../common/mod.rs"]
mod common;

mod clean;
mod cpu_quota;
mod failover;
mod hop;
mod lab_run;
mod mdns;
mod ring;

use std::time::Duration;

use tessera_lab::{HostSpec, Lab, LabError, LabSpec};

const PROMPT: &str = "Once upon a time";

/// Starts a lab, or returns `None` (with the reason on stderr) where this machine cannot make
/// one; under CI it must.
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

/// Whether this machine can build a lab (root, namespaces); where it cannot, `lab_or_skip`
/// skips the test (and fails it under CI).
fn lab_can_run() -> bool {
    let probe = LabSpec::new(vec![HostSpec::new("a"), HostSpec::new("b")]);
    lab_or_skip(&probe).is_some()
}

/// Runs `tessera` with `args` (a command printing JSON), failing the test with its standard
/// error if it fails or outlives `timeout`; its JSON output.
fn tessera_json<S: AsRef<std::ffi::OsStr>>(
    args: impl IntoIterator<Item = S>,
    timeout: Duration,
) -> serde_json::Value {
    let mut cmd = std::process::Command::new(common::bin());
    cmd.args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let out = common::run_with_timeout(cmd, timeout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
