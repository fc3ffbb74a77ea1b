//! A Tessera cluster inside a lab: `tessera serve` (coordinator and gateway) on one host,
//! `tessera node` agents on others, each a real process in its host's namespace and cgroup,
//! joined over the switch. The gateway listens on the coordinator host's loopback; the lab
//! reaches it with sockets made inside that host.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

use crate::error::{LabError, Result};
use crate::http;
use crate::lab::Lab;
use crate::log_line::{self, Announced};

/// The coordinator's QUIC port on its host.
pub const COORDINATOR_PORT: u16 = 7070;
/// The gateway's HTTP port on the coordinator host's loopback.
pub const API_PORT: u16 = 8080;

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// The `tessera` binary.
    pub tessera: PathBuf,
    /// The GGUF model.
    pub model: PathBuf,
    /// Data directories and logs go here.
    pub dir: PathBuf,
    /// The host of the coordinator and gateway.
    pub coordinator: usize,
    /// The node hosts, in the order they are started (stages take nodes in join order).
    pub nodes: Vec<usize>,
    /// `--split` (default: even over the nodes).
    pub split: Option<String>,
    /// Compute threads per node.
    pub threads: usize,
    /// How long start-up (join, fetch, load, link) may take.
    pub timeout: Duration,
}

/// A running cluster; its processes are killed when dropped.
pub struct Cluster {
    coordinator_host: usize,
    children: Vec<(String, Child)>,
    /// `TOKEN@ADDR`.
    pub join: String,
    /// The model's name on the API.
    pub model: String,
    dir: PathBuf,
}

/// One completion: its text and when each streamed piece arrived.
#[derive(Debug, Clone)]
pub struct Completion {
    pub text: String,
    pub pieces: Vec<Instant>,
    pub started: Instant,
}

impl Completion {
    /// Mean time between streamed pieces after the first (the decode step), s.
    pub fn decode_step_s(&self) -> Option<f64> {
        let (a, b) = (self.pieces.first()?, self.pieces.last()?);
        (self.pieces.len() > 1).then(|| (*b - *a).as_secs_f64() / (self.pieces.len() - 1) as f64)
    }
}

fn log_tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

impl Cluster {
    /// Starts the coordinator, then the nodes, and waits until the gateway says it is serving.
    pub fn start(lab: &Lab, o: &ClusterOptions) -> Result<Self> {
        std::fs::create_dir_all(&o.dir)
            .map_err(|e| LabError::io(format!("creating {}", o.dir.display()), e))?;
        let coord_addr = SocketAddr::new(lab.addr(o.coordinator).into(), COORDINATOR_PORT);
        let mut cmd = lab.command(o.coordinator, &o.tessera)?;
        cmd.arg("serve")
            .arg("--model")
            .arg(&o.model)
            .args(["--nodes-expected", &o.nodes.len().to_string()])
            .args(["--coordinator-listen", &coord_addr.to_string()])
            .args(["--listen", &format!("127.0.0.1:{API_PORT}")])
            .arg("--data-dir")
            .arg(o.dir.join("coordinator"))
            .env("TESSERA_CACHE_DIR", o.dir.join("cache"))
            // The join token is read from its JSON announcement, not from wording.
            .env("TESSERA_LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(file(&o.dir.join("coordinator.log"))?);
        if let Some(s) = &o.split {
            cmd.args(["--split", s]);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| LabError::io(format!("starting {}", o.tessera.display()), e))?;
        let out = BufReader::new(child.stdout.take().expect("piped"));
        let mut cluster = Self {
            coordinator_host: o.coordinator,
            children: vec![("coordinator".into(), child)],
            join: String::new(),
            model: String::new(),
            dir: o.dir.clone(),
        };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(std::result::Result::ok) {
                if let Some(Ok(a)) = log_line::read::<Announced>(&line, "join_token") {
                    let _ = tx.send(a.token);
                }
            }
        });
        let wait = Duration::from_secs(60);
        cluster.join = rx.recv_timeout(wait).map_err(|_| LabError::Silent {
            process: "the coordinator".into(),
            what: "join token".into(),
            timeout: wait,
            detail: format!(":\n{}", log_tail(&o.dir.join("coordinator.log"))),
        })?;
        // Each node's probe measures its host unthrottled; the quotas bind once all joined.
        lab.set_cpu_quotas(false)?;
        for (k, &host) in o.nodes.iter().enumerate() {
            let name = lab.name(host).to_string();
            let listen = SocketAddr::new(lab.addr(host).into(), 0);
            let mut cmd = lab.command(host, &o.tessera)?;
            cmd.arg("node")
                .arg("--data-dir")
                .arg(o.dir.join(format!("node-{name}")))
                .args(["--join", &cluster.join, "--listen", &listen.to_string()])
                .args([
                    "--name",
                    &name,
                    "--threads",
                    &o.threads.to_string(),
                    "--quick-probe",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(file(&o.dir.join(format!("node-{name}.log")))?);
            let child = cmd
                .spawn()
                .map_err(|e| LabError::io(format!("starting node {name}"), e))?;
            cluster.children.push((name, child));
            // Stages take nodes in join order: let each join before the next starts.
            if k + 1 < o.nodes.len() {
                cluster.wait_joined(lab, k + 1, Duration::from_secs(60))?;
            }
        }
        cluster.wait_joined(lab, o.nodes.len(), Duration::from_secs(60))?;
        lab.set_cpu_quotas(true)?;
        cluster.wait_serving(lab, o.timeout)?;
        Ok(cluster)
    }

    fn check_alive(&mut self) -> Result<()> {
        for (name, c) in &mut self.children {
            if let Ok(Some(status)) = c.try_wait() {
                let log = if name == "coordinator" {
                    self.dir.join("coordinator.log")
                } else {
                    self.dir.join(format!("node-{name}.log"))
                };
                return Err(LabError::ProcessFailed {
                    process: name.clone(),
                    message: format!("exited ({status}):\n{}", log_tail(&log)),
                });
            }
        }
        Ok(())
    }

    /// Waits until the coordinator's status lists `n` nodes.
    fn wait_joined(&mut self, lab: &Lab, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_alive()?;
            let last = match self.get(lab, "/api/status") {
                // Not readable yet counts as none joined: the wait goes on, and says why at
                // its end.
                Ok(r) => match serde_json::from_str::<StatusAnswer>(&r.body) {
                    Ok(s) if s.cluster.nodes.len() >= n => return Ok(()),
                    Ok(_) => r.body,
                    Err(e) => format!("{} ({e})", r.body),
                },
                Err(e) => e.to_string(),
            };
            if Instant::now() > deadline {
                let (name, _) = &self.children[n];
                return Err(LabError::Silent {
                    process: "the coordinator".into(),
                    what: format!("{n} joined nodes"),
                    timeout,
                    detail: format!(
                        "; status: {last}\n{name}'s log:\n{}",
                        log_tail(&self.dir.join(format!("node-{name}.log")))
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `/health` answers 200.
    pub fn wait_serving(&mut self, lab: &Lab, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_alive()?;
            let last = match self.get(lab, "/health") {
                Ok(r) if r.status == 200 => {
                    let h: HealthAnswer =
                        serde_json::from_str(&r.body).map_err(|e| LabError::Unreadable {
                            process: "the gateway".into(),
                            what: "/health answer".into(),
                            message: format!("{:?}: {e}", r.body),
                        })?;
                    self.model = h.model;
                    return Ok(());
                }
                Ok(r) => r.body,
                Err(e) => e.to_string(),
            };
            if Instant::now() > deadline {
                return Err(LabError::Silent {
                    process: "the gateway".into(),
                    what: "healthy /health".into(),
                    timeout,
                    detail: format!(": {last}"),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn api(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], API_PORT))
    }

    /// `GET path` on the gateway.
    pub fn get(&self, lab: &Lab, path: &str) -> Result<http::Response> {
        let s = lab.connect(self.coordinator_host, self.api())?;
        http::request(s, "GET", path, None)
    }

    /// A greedy streamed completion of `prompt`, `max_tokens` long.
    pub fn complete(&self, lab: &Lab, prompt: &str, max_tokens: usize) -> Result<Completion> {
        let body = serde_json::to_string(&CompletionRequest {
            model: &self.model,
            prompt,
            max_tokens,
            temperature: 0,
            stream: true,
        })
        .expect("a completion request serializes");
        let s = lab.connect(self.coordinator_host, self.api())?;
        let started = Instant::now();
        let (status, events) = http::events(s, "/v1/completions", &body)?;
        if status != 200 {
            return Err(LabError::ProcessFailed {
                process: "the gateway".into(),
                message: format!("a completion answered HTTP {status}: {events:?}"),
            });
        }
        let mut text = String::new();
        let mut pieces = Vec::new();
        for (at, data) in events {
            if data == "[DONE]" {
                break;
            }
            let chunk: CompletionChunk =
                serde_json::from_str(&data).map_err(|e| LabError::Unreadable {
                    process: "the gateway".into(),
                    what: "completion event".into(),
                    message: format!("{data:?}: {e}"),
                })?;
            if let Some(t) = chunk.choices.into_iter().next().and_then(|c| c.text) {
                if !t.is_empty() {
                    text.push_str(&t);
                    pieces.push(at);
                }
            }
        }
        Ok(Completion {
            text,
            pieces,
            started,
        })
    }

    /// Kills the process called `name` (a node's host name, or `coordinator`).
    pub fn kill(&mut self, name: &str) -> Result<()> {
        let (_, c) = self
            .children
            .iter_mut()
            .find(|(n, _)| n == name)
            .ok_or_else(|| LabError::Spec(format!("no process {name:?}")))?;
        let _ = c.kill();
        let _ = c.wait();
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// What the lab asks the gateway, and its answers with only the fields the lab reads. The
// `/api/status` answer carries `tessera_api::ClusterStatus`, whose crate would bring the grammar
// compiler into the lab for one count, and whose every figure would have to read back for the
// count to be read; `/health` and the completion chunks and requests are untyped JSON in the
// gateway (the OpenAI format).

/// `/api/status`: the nodes the coordinator lists.
#[derive(Deserialize)]
struct StatusAnswer {
    cluster: StatusCluster,
}

#[derive(Deserialize)]
struct StatusCluster {
    nodes: Vec<IgnoredAny>,
}

/// `/health` when serving: the model's name on the API.
#[derive(Deserialize)]
struct HealthAnswer {
    model: String,
}

/// A greedy streamed `/v1/completions` request (OpenAI's format).
#[derive(Serialize)]
struct CompletionRequest<'a> {
    model: &'a str,
    prompt: &'a str,
    max_tokens: usize,
    temperature: u8,
    stream: bool,
}

/// One streamed `/v1/completions` chunk (OpenAI's format). A chunk without choices (the usage
/// one) carries no text.
#[derive(Deserialize)]
struct CompletionChunk {
    #[serde(default)]
    choices: Vec<CompletionChoice>,
}

#[derive(Deserialize)]
struct CompletionChoice {
    text: Option<String>,
}

fn file(path: &Path) -> Result<std::fs::File> {
    std::fs::File::create(path).map_err(|e| LabError::io(format!("creating {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateways_answers_are_read_for_what_the_lab_uses() {
        let status: StatusAnswer = serde_json::from_str(
            r#"{"model": "m", "cluster": {"model": "m", "nodes": [{"id": "a"}, {"id": "b"}],
                "plan": null}, "gateway": {}}"#,
        )
        .unwrap();
        assert_eq!(status.cluster.nodes.len(), 2);
        assert!(serde_json::from_str::<StatusAnswer>(r#"{"model": "m"}"#).is_err());
        let health: HealthAnswer =
            serde_json::from_str(r#"{"status": "ok", "model": "small", "plan_epoch": 3}"#).unwrap();
        assert_eq!(health.model, "small");
        let text = |data: &str| {
            serde_json::from_str::<CompletionChunk>(data)
                .unwrap()
                .choices
                .into_iter()
                .next()
                .and_then(|c| c.text)
        };
        let piece = r#"{"object": "text_completion", "choices": [{"index": 0, "text": " upon",
            "finish_reason": null}]}"#;
        assert_eq!(text(piece).as_deref(), Some(" upon"));
        assert_eq!(
            text(r#"{"choices": [], "usage": {"completion_tokens": 4}}"#),
            None
        );
        let ask = CompletionRequest {
            model: "small",
            prompt: "Once",
            max_tokens: 4,
            temperature: 0,
            stream: true,
        };
        assert_eq!(
            serde_json::to_value(&ask).unwrap(),
            serde_json::json!({"model": "small", "prompt": "Once", "max_tokens": 4,
                "temperature": 0, "stream": true})
        );
    }
}
