//! The processes of the fault tests (`chaos.rs`, `chaos_coordinator.rs`): a child process whose
//! stdout and stderr lines are collected with their arrival times, a coordinator with its nodes
//! on 127.0.0.1, the one-process reference text, and a client's JSON messages.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::events::{describe, event_in, JSON_LOGS};
use super::{bin, run_with_timeout};

pub const TIMEOUT: Duration = Duration::from_secs(120);
/// The node lease the tests run with: heartbeats every 750 ms, so a node on a busy 2-core CI
/// machine is not declared gone for a late heartbeat (1 s leases were).
const LEASE_MS: &str = "3000";

/// A child process whose stdout lines are collected (with the time each arrived); killed on
/// drop.
pub struct Proc {
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
    pub seen: Vec<(Instant, String)>,
    pub name: String,
}

impl Proc {
    pub fn spawn(name: &str, args: &[String]) -> Self {
        Self::start(name, args, false)
    }

    /// `tessera` with `args`, printing its events as JSON lines ([`Proc::wait_event`]).
    pub fn spawn_with_events(name: &str, args: &[String]) -> Self {
        Self::start(name, args, true)
    }

    fn start(name: &str, args: &[String], events: bool) -> Self {
        let mut cmd = Command::new(bin());
        if events {
            cmd.env(JSON_LOGS.0, JSON_LOGS.1);
        }
        let mut child = cmd
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let out = BufReader::new(child.stdout.take().unwrap());
        let err = BufReader::new(child.stderr.take().unwrap());
        let (tx, lines) = mpsc::channel();
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        // Stderr lines join the same stream (logs: "enrolled node", "epoch N is ready", ...),
        // and are echoed for a failing test's output.
        let who = name.to_string();
        std::thread::spawn(move || {
            for line in err.lines().map_while(Result::ok) {
                eprintln!("[{who}] {line}");
                if tx2.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
            name: name.to_string(),
        }
    }

    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {}", self.name);
    }

    /// Takes the lines that arrived so far.
    pub fn drain(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
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
        self.wait_event_where(fields, 1, |_| true)
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
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(e) = self
                .seen
                .iter()
                .filter_map(|(_, l)| event_in(l, fields))
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
                    self.seen.iter().map(|(_, l)| l).collect::<Vec<_>>()
                ),
            }
        }
    }

    /// The events seen so far whose fields have the given values (takes the lines arrived).
    pub fn events(&mut self, fields: &[(&str, &str)]) -> Vec<Value> {
        self.drain();
        self.seen
            .iter()
            .filter_map(|(_, l)| event_in(l, fields))
            .collect()
    }

    /// Waits for the process to exit; its status.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "{} did not exit", self.name);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process has exited (without waiting).
    pub fn exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// Waits for the exit and every stdout line.
    pub fn finish(&mut self) -> std::process::ExitStatus {
        let status = self.wait_exit();
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Ok(l) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.seen.push(l);
        }
        status
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A frozen process must be thawed to die cleanly.
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A coordinator and its nodes.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub coordinator: Proc,
    model: PathBuf,
    split: String,
    /// Extra coordinator flags (an expert split).
    extra: Vec<String>,
    pub join: String,
    /// The operator's credential, for clients.
    pub operator: String,
    pub nodes: Vec<Proc>,
}

impl Cluster {
    pub fn start(model_path: &Path, split: &str) -> Self {
        Self::start_with(model_path, split, &[])
    }

    pub fn start_with(model_path: &Path, split: &str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let mut coordinator =
            Self::spawn_coordinator(dir.path(), model_path, split, "127.0.0.1:0", &extra);
        let join = coordinator.announced("join_token", "token");
        let operator = coordinator.announced("operator_token", "token");
        Self {
            dir,
            coordinator,
            model: model_path.to_owned(),
            split: split.to_string(),
            extra,
            join,
            operator,
            nodes: Vec::new(),
        }
    }

    fn spawn_coordinator(
        dir: &Path,
        model_path: &Path,
        split: &str,
        listen: &str,
        extra: &[String],
    ) -> Proc {
        let mut args: Vec<String> = vec![
            "coordinator".into(),
            "--model".into(),
            model_path.display().to_string(),
            "--listen".into(),
            listen.into(),
            "--data-dir".into(),
            dir.join("coord").display().to_string(),
            "--split".into(),
            split.into(),
            "--lease-ms".into(),
            LEASE_MS.into(),
        ];
        args.extend_from_slice(extra);
        Proc::spawn_with_events("coordinator", &args)
    }

    /// The coordinator's `HOST:PORT`.
    pub fn addr(&self) -> String {
        self.join.rsplit_once('@').unwrap().1.to_string()
    }

    pub fn node_args(&self, name: &str) -> Vec<String> {
        super::node_args(self.dir.path(), name)
    }

    /// Starts a node that enrols with `join` (the coordinator's line, or one naming a proxy)
    /// and waits until it has joined.
    pub fn add_node_via(&mut self, name: &str, join: &str) {
        self.add_node_with(name, join, &[]);
    }

    /// [`Cluster::add_node_via`] with extra node flags.
    pub fn add_node_with(&mut self, name: &str, join: &str, extra: &[&str]) {
        let mut args = self.node_args(name);
        args.extend(["--join".to_string(), join.to_string()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut p = Proc::spawn_with_events(name, &args);
        p.wait_event(&[("event", "joined")]);
        self.nodes.push(p);
    }

    /// Starts a node that enrols with the coordinator, without waiting for it to join.
    pub fn start_node(&mut self, name: &str) {
        let mut args = self.node_args(name);
        args.extend(["--join".to_string(), self.join.clone()]);
        self.nodes.push(Proc::spawn_with_events(name, &args));
    }

    pub fn add_node(&mut self, name: &str) {
        let join = self.join.clone();
        self.add_node_via(name, &join);
    }

    /// Waits until the coordinator has placed every stage of the split (`--split` applies as
    /// soon as enough nodes joined).
    pub fn wait_ready(&mut self) {
        // Every node reports a `loaded` event for the initial split.
        let n = self.split.split(',').count();
        for p in self.nodes.iter_mut().take(n) {
            p.wait_event(&[("event", "loaded")]);
        }
    }

    /// Stops the coordinator (SIGTERM) and starts it again on the same address and data.
    pub fn restart_coordinator(&mut self) {
        self.coordinator.signal("-TERM");
        assert!(self.coordinator.wait_exit().success());
        self.coordinator = Self::spawn_coordinator(
            self.dir.path(),
            &self.model,
            &self.split,
            &self.addr(),
            &self.extra,
        );
        let join = self.coordinator.announced("join_token", "token");
        assert_eq!(join, self.join, "the token and address survive a restart");
        let operator = self.coordinator.announced("operator_token", "token");
        assert_eq!(operator, self.operator);
    }

    pub fn node(&mut self, name: &str) -> &mut Proc {
        self.nodes.iter_mut().find(|p| p.name == name).unwrap()
    }

    pub fn client(&self, name: &str, flags: &[&str]) -> Proc {
        let mut args: Vec<String> = vec![
            "run".into(),
            "--coordinator".into(),
            self.operator.clone(),
            "--data-dir".into(),
            self.dir.path().join("client").display().to_string(),
            "--json".into(),
        ];
        args.extend(flags.iter().map(|s| s.to_string()));
        Proc::spawn(name, &args)
    }
}

/// What `tessera generate` prints in one process for the same flags: the no-fault reference
/// (`tessera run` prints exactly this; cluster.rs checks it).
pub fn reference_text(path: &Path, flags: &[&str]) -> String {
    let mut cmd = Command::new(bin());
    cmd.args(["generate", "-t", "1", "-m"])
        .arg(path)
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let out = run_with_timeout(cmd, TIMEOUT);
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts one client per workload and waits until each has streamed its first tokens.
pub fn clients_under_way(c: &Cluster, loads: &[Vec<&str>]) -> Vec<Proc> {
    let mut clients: Vec<Proc> = loads
        .iter()
        .enumerate()
        .map(|(i, f)| c.client(&format!("client{i}"), f))
        .collect();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        for p in clients.iter_mut() {
            p.drain();
        }
        if clients.iter().all(|p| tokens_seen(p) >= 2) {
            return clients;
        }
        assert!(Instant::now() < deadline, "no tokens from every client");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits for every client; each must succeed with its one-process text. Returns each one's
/// messages.
pub fn finish_all(
    clients: &mut [Proc],
    loads: &[Vec<&str>],
    want: &[String],
) -> Vec<Vec<(Instant, Value)>> {
    clients
        .iter_mut()
        .enumerate()
        .map(|(i, p)| {
            let status = p.finish();
            let msgs = messages(p);
            assert!(
                status.success(),
                "client {i} failed: {:?}",
                msgs.iter().map(|(_, m)| m).collect::<Vec<_>>()
            );
            assert_eq!(text_of(loads[i][1], &msgs), want[i], "client {i}: text");
            msgs
        })
        .collect()
}

/// A client's JSON messages with their arrival times.
pub fn messages(p: &Proc) -> Vec<(Instant, Value)> {
    p.seen
        .iter()
        .filter_map(|(t, l)| serde_json::from_str(l).ok().map(|v| (*t, v)))
        .collect()
}

/// The text `tessera run` would print: the prompt, every token's text, a newline.
pub fn text_of(prompt: &str, msgs: &[(Instant, Value)]) -> String {
    let mut s = prompt.to_string();
    for (_, m) in msgs {
        if m["type"] == "token" {
            s.push_str(m["text"].as_str().unwrap_or(""));
        }
    }
    s.push('\n');
    s
}

/// Counts the generated tokens a client has seen so far.
pub fn tokens_seen(p: &Proc) -> usize {
    p.seen
        .iter()
        .filter(|(_, l)| l.starts_with("{\"type\":\"token\""))
        .count()
}

/// Runs one generation to the end; its messages.
pub fn run_to_end(c: &Cluster, name: &str, flags: &[&str]) -> Vec<(Instant, Value)> {
    let mut p = c.client(name, flags);
    let status = p.finish();
    let msgs = messages(&p);
    assert!(
        status.success(),
        "{name}: {:?}",
        p.seen.iter().map(|(_, l)| l).collect::<Vec<_>>()
    );
    msgs
}
