//! A coordinator with an expert split (`--experts`) and its nodes, for the MoE tests.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::{bin, run_with_timeout, Proc};

/// A coordinator with an expert split, and its nodes.
pub struct ExpertCluster {
    pub dir: tempfile::TempDir,
    pub coordinator: Proc,
    pub join: String,
    /// The operator's credential: the runs here pin stages to nodes.
    pub operator: String,
    pub nodes: Vec<Proc>,
    pub timeout: Duration,
}

impl ExpertCluster {
    pub fn start(model_path: &Path, experts: &str, timeout: Duration) -> Self {
        Self::start_with(model_path, Some(experts), timeout)
    }

    /// A coordinator with an expert split (`experts`), or without one: its ring stages then
    /// hold every expert of their layers.
    pub fn start_with(model_path: &Path, experts: Option<&str>, timeout: Duration) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut args: Vec<String> = vec![
            "coordinator".into(),
            "--model".into(),
            model_path.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            dir.path().join("coord").display().to_string(),
        ];
        if let Some(e) = experts {
            args.extend(["--experts".into(), e.into()]);
        }
        let mut coordinator = Proc::spawn_with_events("coordinator", &args, timeout);
        let join = coordinator.announced("join_token", "token");
        let operator = coordinator.announced("operator_token", "token");
        Self {
            dir,
            coordinator,
            join,
            operator,
            nodes: Vec::new(),
            timeout,
        }
    }

    pub fn add_node(&mut self, name: &str, extra: &[String]) {
        let mut args = super::node_args(self.dir.path(), name);
        args.extend(["--join".into(), self.join.clone()]);
        args.extend_from_slice(extra);
        let mut p = Proc::spawn_with_events(name, &args, self.timeout);
        p.wait_event(&[("event", "joined")]);
        self.nodes.push(p);
    }

    /// `tessera run --json` on a plan pinning ring stages to nodes; its messages.
    pub fn run_json(
        &self,
        stages: &[(&str, std::ops::Range<usize>)],
        extra: &[&str],
    ) -> Vec<Value> {
        let plan = self.dir.path().join("plan.json");
        let stages: Vec<Value> = stages
            .iter()
            .map(|(n, l)| serde_json::json!({"node": n, "layers": format!("{}..{}", l.start, l.end)}))
            .collect();
        std::fs::write(&plan, serde_json::json!({ "stages": stages }).to_string()).unwrap();
        let mut cmd = Command::new(bin());
        cmd.args(["run", "--coordinator", &self.operator, "--data-dir"])
            .arg(self.dir.path().join("client"))
            .arg("--plan")
            .arg(&plan)
            .args(["--json"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = run_with_timeout(cmd, self.timeout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

/// `ids` as an `--experts` group (`a+b+c`).
pub fn ids(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join("+")
}
