//! Scenario tests of the fabric with real processes: a `tessera coordinator`, `tessera node`
//! agents and `tessera run` clients on 127.0.0.1 (port 0, printed addresses), each with its own
//! temporary data directory, all killed when a test ends.
//!
//! The reference for every cluster run is the same engine in this test process: the greedy
//! tokens of `Generator` (what `tessera generate` runs), and the hidden state after each stage
//! boundary computed by one full model, hashed exactly as the stages hash what they send.
//!
//! One test binary, a module per concept; this file holds the harness they share (a
//! coordinator with its nodes, and the `tessera run` client):
//! - `rings`: stage rings of one to three nodes, and concurrent and seeded runs, against one
//!   process;
//! - `speculation`: speculative decoding on a three-stage ring;
//! - `loading`: what each node fetches, reads locally and keeps across restarts, and the
//!   memory budget;
//! - `enrolment`: nodes refused for a wrong token or a name that belongs to another key;
//! - `wire`: in-process clients over the real transport (cancel, unenrolled keys, malformed
//!   frames).

#[path = "../common/mod.rs"]
mod common;

mod enrolment;
mod loading;
mod rings;
mod speculation;
mod wire;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{bin, run_with_timeout, Proc};
use serde_json::Value;

const TIMEOUT: Duration = Duration::from_secs(60);

/// A coordinator and its nodes.
struct Cluster {
    dir: tempfile::TempDir,
    coordinator: Proc,
    model: PathBuf,
    join: String,
    /// The operator's credential: clients here name stages.
    operator: String,
    nodes: Vec<Proc>,
}

impl Cluster {
    fn start(model_path: &Path) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut coordinator = Self::spawn_coordinator(dir.path(), model_path, "127.0.0.1:0");
        let join = coordinator.announced("join_token", "token");
        let operator = coordinator.announced("operator_token", "token");
        Self {
            dir,
            coordinator,
            model: model_path.to_owned(),
            join,
            operator,
            nodes: Vec::new(),
        }
    }

    fn spawn_coordinator(dir: &Path, model_path: &Path, listen: &str) -> Proc {
        Proc::spawn_with_events(
            "coordinator",
            &[
                "coordinator".into(),
                "--model".into(),
                model_path.display().to_string(),
                "--listen".into(),
                listen.into(),
                "--data-dir".into(),
                dir.join("coord").display().to_string(),
            ],
            TIMEOUT,
        )
    }

    /// Stops the coordinator cleanly and starts it again on the same address and data.
    fn restart_coordinator(&mut self) {
        assert!(self.coordinator.terminate().success());
        let addr = self.join.rsplit_once('@').unwrap().1.to_string();
        self.coordinator = Self::spawn_coordinator(self.dir.path(), &self.model, &addr);
        let join = self.coordinator.announced("join_token", "token");
        assert_eq!(join, self.join, "the token and address survive a restart");
        let operator = self.coordinator.announced("operator_token", "token");
        assert_eq!(operator, self.operator);
    }

    fn node_args(&self, name: &str, extra: &[&str]) -> Vec<String> {
        let mut a = common::node_args(self.dir.path(), name);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    /// Starts a node that enrols with the token and waits until it has joined.
    fn add_node(&mut self, name: &str, extra: &[&str]) {
        let mut args = self.node_args(name, extra);
        args.extend(["--join".to_string(), self.join.clone()]);
        let mut p = Proc::spawn_with_events(name, &args, TIMEOUT);
        p.wait_event(&[("event", "joined")]);
        self.nodes.push(p);
    }

    /// Runs `tessera run --json` and returns its messages.
    fn run_json(&self, extra: &[&str]) -> (Output, Vec<Value>) {
        let out = self.run(&[&["--json"], extra].concat());
        let msgs = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        (out, msgs)
    }

    fn run(&self, extra: &[&str]) -> Output {
        run_client(&self.operator, &self.dir.path().join("client"), extra)
    }
}

/// Runs `tessera run` against the coordinator `join`, with its key in `client_dir`.
fn run_client(join: &str, client_dir: &Path, extra: &[&str]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(["run", "--coordinator", join, "--data-dir"])
        .arg(client_dir)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    run_with_timeout(cmd, TIMEOUT)
}
