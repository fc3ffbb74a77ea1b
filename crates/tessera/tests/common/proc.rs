//! The `tessera` binary, model paths, and a child process whose stdout lines are collected.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::events::{describe, event_in, JSON_LOGS};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_tessera")
}

/// Arguments of a `tessera node` on loopback keeping its data in `dir/name`: one compute
/// thread and quick probes (the caller adds `--join` and any other flag).
pub fn node_args(dir: &Path, name: &str) -> Vec<String> {
    vec![
        "node".into(),
        "--data-dir".into(),
        dir.join(name).display().to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--name".into(),
        name.into(),
        "--threads".into(),
        "1".into(),
        "--quick-probe".into(),
    ]
}

pub fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name)
}

/// A child process whose stdout lines are collected; killed on drop. Every wait gives up after
/// `timeout`.
pub struct Proc {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
    pub name: String,
    pub timeout: Duration,
}

impl Proc {
    /// `tessera` with `args`.
    pub fn spawn(name: &str, args: &[String], timeout: Duration) -> Self {
        let mut cmd = Command::new(bin());
        cmd.args(args);
        Self::from_command(name, cmd, timeout)
    }

    /// `tessera` with `args`, printing its events as JSON lines ([`Proc::wait_event`]).
    pub fn spawn_with_events(name: &str, args: &[String], timeout: Duration) -> Self {
        let mut cmd = Command::new(bin());
        cmd.args(args).env(JSON_LOGS.0, JSON_LOGS.1);
        Self::from_command(name, cmd, timeout)
    }

    /// Starts `cmd` with stdout collected and stderr inherited.
    pub fn from_command(name: &str, mut cmd: Command, timeout: Duration) -> Self {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
            name: name.to_string(),
            timeout,
        }
    }

    /// The field `field` of the first `event` announced on stdout (`listening`, `join_token`,
    /// `operator_token`: what the command prints for people to go on with, as JSON).
    pub fn announced(&mut self, event: &str, field: &str) -> String {
        let e = self.wait_event(&[("event", event)]);
        e[field]
            .as_str()
            .unwrap_or_else(|| panic!("{event} has no {field}: {e}"))
            .to_string()
    }

    /// Waits for an event (a JSON line) whose fields have the given values; the event.
    pub fn wait_event(&mut self, fields: &[(&str, &str)]) -> Value {
        self.wait_event_nth(fields, 1)
    }

    /// Waits until `n` events whose fields have the given values have been seen; the n-th.
    pub fn wait_event_nth(&mut self, fields: &[(&str, &str)], n: usize) -> Value {
        self.wait_event_where(fields, n, |_| true)
    }

    /// Waits until `n` events whose fields have the given values and that satisfy `pred` have
    /// been seen; the n-th.
    pub fn wait_event_where(
        &mut self,
        fields: &[(&str, &str)],
        n: usize,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(e) = self
                .seen
                .iter()
                .filter_map(|l| event_in(l, fields))
                .filter(|e| pred(e))
                .nth(n - 1)
            {
                return e;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!(
                    "{}: fewer than {n} events {}; saw {:?}",
                    self.name,
                    describe(fields),
                    self.seen
                ),
            }
        }
    }

    /// The events seen so far whose fields have the given values (takes the lines arrived).
    pub fn events(&mut self, fields: &[(&str, &str)]) -> Vec<Value> {
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
        }
        self.seen
            .iter()
            .filter_map(|l| event_in(l, fields))
            .collect()
    }

    /// Asks the process to stop (SIGTERM) and waits for it.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        self.wait_exit()
    }

    /// Waits for the process to exit; its status.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "{} did not exit", self.name);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
