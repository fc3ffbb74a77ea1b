//! The processes of one placement: a `tessera coordinator` on the lab's first host and one
//! `tessera node` per scenario node, and greedy `tessera run` clients against them.
//!
//! A session is started per coordinator configuration (`--plan auto` to measure the graph, no
//! plan for single-node and stage rings named by each client, `--plan FILE [--experts SPEC]`
//! for an expert split or cells, which the coordinator holds for every run). The coordinator's and the
//! nodes' data directories are kept between sessions, so a restarted node keeps its key, its
//! enrolment and its fetched model.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::de::{DeserializeOwned, IgnoredAny};
use tessera_proto::{CoordToClient, RunReport};

use crate::error::{LabError, Result};
use crate::lab::Lab;
use crate::log_line::{self, Announced};
use crate::scenario::Scenario;

/// Where a session's processes run: host 0 the coordinator's (and clients'), host `i` the
/// scenario's node `i - 1`.
pub(crate) trait Hosts {
    /// A command that runs `program` on host `i`.
    fn command(&self, i: usize, program: &Path) -> Result<std::process::Command>;
    /// Host `i`'s address.
    fn addr(&self, i: usize) -> std::net::Ipv4Addr;
    /// Imposes (`on`) or lifts the hosts' CPU quotas ([`Lab::set_cpu_quotas`]).
    fn set_cpu_quotas(&self, on: bool) -> Result<()>;
}

impl Hosts for Lab {
    fn command(&self, i: usize, program: &Path) -> Result<std::process::Command> {
        Self::command(self, i, program)
    }
    fn addr(&self, i: usize) -> std::net::Ipv4Addr {
        Self::addr(self, i)
    }
    fn set_cpu_quotas(&self, on: bool) -> Result<()> {
        Self::set_cpu_quotas(self, on)
    }
}

/// Every host is this machine's loopback: processes started as they are, on 127.0.0.1.
pub(crate) struct Loopback;

impl Hosts for Loopback {
    fn command(&self, _: usize, program: &Path) -> Result<std::process::Command> {
        Ok(std::process::Command::new(program))
    }
    fn addr(&self, _: usize) -> std::net::Ipv4Addr {
        std::net::Ipv4Addr::LOCALHOST
    }
    fn set_cpu_quotas(&self, _: bool) -> Result<()> {
        Ok(())
    }
}

/// A child whose stdout lines are collected; killed on drop.
pub(super) struct Proc {
    child: Child,
    rx: mpsc::Receiver<String>,
    name: String,
}

impl Proc {
    fn spawn(name: &str, mut cmd: std::process::Command, log: &Path) -> Result<Self> {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| LabError::io(format!("opening {}", log.display()), e))?;
        let mut child = cmd
            .env("TESSERA_LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| LabError::io(format!("starting {name}"), e))?;
        let out = BufReader::new(child.stdout.take().expect("piped"));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in out.lines().map_while(std::result::Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            rx,
            name: name.into(),
        })
    }

    /// Waits for the child's JSON event `event` (it runs with `TESSERA_LOG_FORMAT=json`).
    pub(super) fn wait_event(&mut self, event: &str, timeout: Duration) -> Result<()> {
        self.wait_for::<IgnoredAny>(event, timeout).map(drop)
    }

    /// Waits for the child's JSON event `event` and reads its line as `T` (the fields the lab
    /// uses of it); the event without them is [`LabError::Unreadable`].
    fn wait_for<T: DeserializeOwned>(&mut self, event: &str, timeout: Duration) -> Result<T> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(l) => match log_line::read::<T>(&l, event) {
                    None => {}
                    Some(Ok(v)) => return Ok(v),
                    Some(Err(e)) => {
                        return Err(LabError::Unreadable {
                            process: self.name.clone(),
                            what: format!("{event:?} event"),
                            message: format!("{l}: {e}"),
                        })
                    }
                },
                Err(_) => {
                    return Err(LabError::Silent {
                        process: self.name.clone(),
                        what: format!("{event:?} event"),
                        timeout,
                        detail: String::new(),
                    })
                }
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one timed client read.
pub(super) struct TimedRun {
    /// Its `done` message.
    pub(super) report: RunReport,
    /// When each generated token was read.
    pub(super) arrivals: Vec<Instant>,
    /// The generated text (the tokens' text in order).
    pub(super) text: String,
    /// The generated tokens.
    pub(super) tokens: Vec<u32>,
}

/// How the coordinator of a session places the model.
pub(super) enum Mode {
    /// `--plan auto`: plan from the nodes' measured inventory (writes `plan-auto.json`), with
    /// a calibrated graph's rates in place of the measured ones when given (`--calibrated`).
    Auto(Option<PathBuf>),
    /// No plan: every client names its stages.
    ByClient,
    /// `--plan FILE [--experts SPEC]`: a placement the coordinator holds for every run (a home
    /// ring and its expert split, or cells); clients name no stages, so the coordinator routes
    /// each request (to a cell).
    Fixed {
        plan: PathBuf,
        experts: Option<String>,
        /// Nodes given `--expert-budget BYTES`: each keeps that much of its experts in memory
        /// and streams the rest from its disk (the one-host baseline, a ring's stages).
        expert_budgets: Vec<(String, u64)>,
    },
}

/// A running coordinator and its nodes.
pub(super) struct Session {
    pub(super) coordinator: Proc,
    /// Dropped (killed) before the coordinator.
    nodes: Vec<Proc>,
    /// The operator's credential: clients here name stages.
    pub(super) operator: String,
    tessera: PathBuf,
    dir: PathBuf,
    /// The coordinator holds a placement: clients name no stages.
    fixed: bool,
}

/// The nodes' copies of the model under a run's directory, removed when this is dropped (the
/// run ended, or failed): each node fetches its own, the whole model for a node that may run
/// any plan, and a scenario of four nodes left gigabytes behind every run. Logs, keys and
/// every other file stay.
pub(crate) struct NodeModelCopies(PathBuf);

impl NodeModelCopies {
    /// Removes the copies under `dir` at the end of the run that holds this.
    pub(crate) fn removed_at_end(dir: &Path) -> Self {
        Self(dir.to_path_buf())
    }
}

impl Drop for NodeModelCopies {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(&self.0) else {
            return;
        };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("node-") {
                // The node's store (`tessera_host::ShardStore`) keeps models under `models/`.
                let _ = std::fs::remove_dir_all(e.path().join("models"));
            }
        }
    }
}

/// Where the coordinator keeps its state (kept between sessions).
pub(super) fn coordinator_dir(dir: &Path) -> PathBuf {
    dir.join("coordinator")
}

impl Session {
    /// Starts the coordinator, then every node, and waits until each has joined.
    pub(super) fn start(
        lab: &impl Hosts,
        tessera: &Path,
        scenario: &Scenario,
        dir: &Path,
        mode: &Mode,
    ) -> Result<Self> {
        let n = scenario.graph.nodes.len();
        // Port 0: the join token names the port the coordinator got.
        let listen = format!("{}:0", lab.addr(0));
        let mut cmd = lab.command(0, tessera)?;
        let context = scenario.graph.policy.context_tokens.to_string();
        cmd.args([
            "coordinator",
            "--listen",
            &listen,
            "--max-context",
            &context,
        ])
        .arg("--model")
        .arg(&scenario.model)
        .arg("--data-dir")
        .arg(coordinator_dir(dir));
        match mode {
            Mode::Auto(calibrated) => {
                cmd.args(["--plan", "auto", "--nodes-expected", &n.to_string()]);
                if let Some(c) = calibrated {
                    cmd.arg("--calibrated").arg(c);
                }
            }
            Mode::ByClient => {}
            Mode::Fixed { plan, experts, .. } => {
                cmd.arg("--plan").arg(plan);
                if let Some(x) = experts {
                    cmd.args(["--experts", x]);
                }
            }
        }
        let mut coordinator = Proc::spawn("coordinator", cmd, &dir.join("coordinator.log"))?;
        let join = token(&mut coordinator, "join_token")?;
        let operator = token(&mut coordinator, "operator_token")?;
        // The nodes' probes measure the hosts unthrottled; the quotas bind once all have
        // joined (and the lab scales what they measured by each quota).
        lab.set_cpu_quotas(false)?;
        let mut nodes = Vec::new();
        for (i, node) in scenario.graph.nodes.iter().enumerate() {
            let host = i + 1;
            let mut cmd = lab.command(host, tessera)?;
            cmd.args([
                "node",
                "--join",
                &join,
                "--name",
                &node.name,
                "--quick-probe",
            ])
            .args(["--threads", &scenario.threads.to_string()])
            .args(["--listen", &format!("{}:0", lab.addr(host)), "--data-dir"])
            .arg(dir.join(format!("node-{}", node.name)));
            // The measured graph counts a node's budget plus the process's own overhead: give
            // the node the declared budget less that overhead, so both describe the same machine.
            if let Some(b) = node.memory_budget {
                let own =
                    b.0.saturating_sub(tessera_plan::RUNTIME_OVERHEAD_RAM.0)
                        .max(1 << 20);
                cmd.args(["--memory-budget", &own.to_string()]);
            }
            if let Mode::Fixed { expert_budgets, .. } = mode {
                if let Some((_, bytes)) = expert_budgets.iter().find(|(n, _)| *n == node.name) {
                    cmd.args(["--expert-budget", &bytes.to_string()]);
                }
            }
            let mut p = Proc::spawn(
                &node.name,
                cmd,
                &dir.join(format!("node-{}.log", node.name)),
            )?;
            p.wait_event("joined", Duration::from_secs(120))?;
            nodes.push(p);
        }
        lab.set_cpu_quotas(true)?;
        Ok(Self {
            coordinator,
            nodes,
            operator,
            tessera: tessera.to_path_buf(),
            dir: dir.to_path_buf(),
            fixed: matches!(mode, Mode::Fixed { .. }),
        })
    }

    /// `count` greedy clients at once (each with its own key under `dir`), each asking for
    /// `tokens` with `plan`'s stages (or the coordinator's own placement, in a fixed session);
    /// their reports.
    pub(super) fn clients(
        &self,
        lab: &impl Hosts,
        plan: &Path,
        prompt: &str,
        tokens: usize,
        count: usize,
    ) -> Result<Vec<RunReport>> {
        let mut running = Vec::new();
        for i in 0..count.max(1) {
            running.push(self.spawn_client(lab, plan, prompt, tokens, i, Ask::default())?);
        }
        running.into_iter().map(report).collect()
    }

    /// Like [`Session::clients`], one client per prompt of `prompts`, and what each client read:
    /// the instant each `token` message was read from its output, and the text they carried.
    pub(super) fn timed_clients(
        &self,
        lab: &impl Hosts,
        plan: &Path,
        prompts: &[&str],
        tokens: usize,
    ) -> Result<Vec<TimedRun>> {
        self.timed(lab, plan, prompts, tokens, Ask::default())
    }

    /// Like [`Session::timed_clients`] with one prompt, the client speculating with `k` drafts
    /// a ring turn (`tessera run --speculate k`), by prompt lookup or from the answer
    /// `prediction` (`--prediction-tokens`).
    pub(super) fn timed_speculating(
        &self,
        lab: &impl Hosts,
        plan: &Path,
        prompt: &str,
        tokens: usize,
        k: usize,
        prediction: Option<&[u32]>,
    ) -> Result<TimedRun> {
        let prediction = match prediction {
            None => None,
            Some(ids) => {
                let p = self.dir.join("prediction-tokens.json");
                let json = serde_json::to_string(ids).expect("token ids serialize");
                std::fs::write(&p, json)
                    .map_err(|e| LabError::io(format!("writing {}", p.display()), e))?;
                Some(p)
            }
        };
        let ask = Ask {
            chunk: None,
            speculate: k,
            prediction,
        };
        Ok(self.timed(lab, plan, &[prompt], tokens, ask)?.remove(0))
    }

    fn timed(
        &self,
        lab: &impl Hosts,
        plan: &Path,
        prompts: &[&str],
        tokens: usize,
        ask: Ask,
    ) -> Result<Vec<TimedRun>> {
        let mut readers = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let ask = ask.clone();
            let mut child = self.spawn_client(lab, plan, prompt, tokens, i, ask)?;
            let out = BufReader::new(child.stdout.take().expect("piped"));
            readers.push((
                child,
                std::thread::spawn(move || {
                    let (mut arrivals, mut text, mut tokens, mut done) =
                        (Vec::new(), String::new(), Vec::new(), None);
                    for l in out.lines().map_while(std::result::Result::ok) {
                        let now = Instant::now();
                        match serde_json::from_str::<CoordToClient>(&l) {
                            Ok(CoordToClient::Token { text: t, token, .. }) => {
                                arrivals.push(now);
                                text.push_str(&t);
                                tokens.push(token);
                            }
                            Ok(CoordToClient::Done(r)) => done = Some(*r),
                            _ => {}
                        }
                    }
                    (done, arrivals, text, tokens)
                }),
            ));
        }
        readers
            .into_iter()
            .map(|(child, reader)| {
                let (done, arrivals, text, tokens) =
                    reader
                        .join()
                        .unwrap_or((None, Vec::new(), String::new(), Vec::new()));
                let out = child
                    .wait_with_output()
                    .map_err(|e| LabError::io("waiting for tessera run", e))?;
                if !out.status.success() {
                    return Err(run_failed(&out));
                }
                let report = done.ok_or_else(no_report)?;
                Ok(TimedRun {
                    report,
                    arrivals,
                    text,
                    tokens,
                })
            })
            .collect()
    }

    /// One greedy client with prompt tokens per prefill step `chunk`; its report.
    pub(super) fn one_with(
        &self,
        lab: &impl Hosts,
        plan: &Path,
        prompt: &str,
        tokens: usize,
        chunk: usize,
    ) -> Result<RunReport> {
        let ask = Ask {
            chunk: Some(chunk),
            ..Ask::default()
        };
        report(self.spawn_client(lab, plan, prompt, tokens, 0, ask)?)
    }

    /// Starts client `i` (its own key under the session's directory), stdout piped.
    fn spawn_client(
        &self,
        lab: &impl Hosts,
        plan: &Path,
        prompt: &str,
        tokens: usize,
        i: usize,
        ask: Ask,
    ) -> Result<Child> {
        {
            let mut cmd = lab.command(0, &self.tessera)?;
            cmd.args(["run", "--coordinator", &self.operator, "--json"])
                .args([
                    "--temperature",
                    "0",
                    "-p",
                    prompt,
                    "-n",
                    &tokens.to_string(),
                ])
                .arg("--data-dir")
                .arg(self.dir.join(format!("client-{i}")))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if !self.fixed {
                cmd.arg("--plan").arg(plan);
            }
            if let Some(c) = ask.chunk {
                cmd.args(["--prefill-chunk", &c.to_string()]);
            }
            if ask.speculate > 0 {
                cmd.args(["--speculate", &ask.speculate.to_string()]);
            }
            if let Some(p) = &ask.prediction {
                cmd.arg("--prediction-tokens").arg(p);
            }
            cmd.spawn()
                .map_err(|e| LabError::io("starting tessera run", e))
        }
    }
}

/// What a client asks beyond greedy decoding.
#[derive(Debug, Clone, Default)]
struct Ask {
    /// Prompt tokens per prefill step (the coordinator's default when `None`).
    chunk: Option<usize>,
    /// Drafts per ring turn, by prompt lookup; 0 = none.
    speculate: usize,
    /// A file of the predicted answer's token ids to draft from.
    prediction: Option<PathBuf>,
}

impl Drop for Session {
    fn drop(&mut self) {
        // Nodes first: a node that outlives its coordinator only retries.
        self.nodes.clear();
    }
}

/// The token the coordinator announces as `event`.
fn token(coordinator: &mut Proc, event: &str) -> Result<String> {
    let a: Announced = coordinator.wait_for(event, Duration::from_secs(60))?;
    Ok(a.token)
}

/// A finished `tessera run --json`'s report (its `done` message).
fn report(child: Child) -> Result<RunReport> {
    let out = child
        .wait_with_output()
        .map_err(|e| LabError::io("waiting for tessera run", e))?;
    if !out.status.success() {
        return Err(run_failed(&out));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| match serde_json::from_str::<CoordToClient>(l) {
            Ok(CoordToClient::Done(r)) => Some(*r),
            _ => None,
        })
        .ok_or_else(no_report)
}

fn run_failed(out: &std::process::Output) -> LabError {
    LabError::ProcessFailed {
        process: "tessera run".into(),
        message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    }
}

fn no_report() -> LabError {
    LabError::Unreadable {
        process: "tessera run".into(),
        what: "output".into(),
        message: "no report (a `done` line)".into(),
    }
}
