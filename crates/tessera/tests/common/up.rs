//! A running `tessera up`: its coordinator, gateway and node processes on loopback, stopped
//! (and every node pid it printed killed) on drop.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use super::Proc;

const START_TIMEOUT: Duration = Duration::from_secs(180);

/// A running `tessera up`; stopped (and its nodes killed) on drop.
pub struct Up {
    pub proc: Proc,
    pub addr: String,
    pub node_pids: Vec<u32>,
    _dir: tempfile::TempDir,
}

impl Up {
    pub fn start(extra: &[&str]) -> Self {
        Self::start_nodes(3, extra)
    }

    pub fn start_nodes(nodes: usize, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
        cmd.args(["up", "--listen", "127.0.0.1:0", "--threads", "1"])
            .arg("--nodes")
            .arg(nodes.to_string())
            .arg("--run-dir")
            .arg(dir.path())
            .args(extra)
            .env(
                "TESSERA_CACHE_DIR",
                PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tessera-cache"),
            )
            .env("TESSERA_LOG", "warn")
            .env(super::JSON_LOGS.0, super::JSON_LOGS.1);
        let mut up = Self {
            proc: Proc::from_command("tessera up", cmd, START_TIMEOUT),
            addr: String::new(),
            node_pids: Vec::new(),
            _dir: dir,
        };
        let pids = up.proc.announced("nodes_started", "pids");
        up.node_pids = pids
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect();
        assert_eq!(up.node_pids.len(), nodes, "{pids}");
        up.addr = up.proc.announced("listening", "addr");
        up
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

pub fn alive(pid: u32) -> bool {
    // A zombie has exited; only a process still running counts.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
        for &p in &self.node_pids {
            if alive(p) {
                let _ = Command::new("kill")
                    .args(["-KILL", &p.to_string()])
                    .status();
            }
        }
    }
}
