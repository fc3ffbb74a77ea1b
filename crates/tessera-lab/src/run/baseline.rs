//! The baseline a user would otherwise run: llama.cpp on the best single host, under that
//! host's caps (its cgroup's memory cap, page cache included, its disk's read cap and its CPU
//! share), memory-mapping the model as llama.cpp does by default (`llama-bench -lm mmap`).
//! Weight repacking is off (`--repack 0`): it copies every weight into anonymous memory, which
//! a host smaller than the model cannot hold (llama-bench was OOM-killed under a 384 MiB cap
//! with it), so llama.cpp's best chance on such a host is to page the file in and out.
//!
//! The machine's page cache is dropped first: the file read by earlier runs (charged to other
//! cgroups) would otherwise serve llama.cpp's page faults without touching the capped disk.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::lab::Lab;

/// llama.cpp's decode on one host, or why it has none.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Baseline {
    pub host: String,
    /// The command, as run on the host (in its namespace and cgroup).
    pub command: String,
    /// Mean decode tokens/s (llama-bench's `avg_ts` of its tg test), or why not measured.
    pub decode_tokens_per_s: Result<f64, String>,
}

/// One llama-bench result line (`-o json` prints an array of them).
#[derive(Deserialize)]
struct BenchLine {
    n_gen: u64,
    avg_ts: f64,
}

/// The decode rate in llama-bench's JSON output: the mean of its generation test.
pub fn decode_rate(json: &str) -> Result<f64, String> {
    let lines: Vec<BenchLine> =
        serde_json::from_str(json).map_err(|e| format!("llama-bench's JSON: {e}"))?;
    lines
        .iter()
        .find(|l| l.n_gen > 0)
        .map(|l| l.avg_ts)
        .filter(|r| r.is_finite() && *r > 0.0)
        .ok_or_else(|| "llama-bench reported no generation test".into())
}

/// Longest a baseline may take: a thrashing host decodes well under a token a second.
const LIMIT: Duration = Duration::from_secs(900);

/// Runs `llama_bench` on host `i` for `tokens` tokens with `threads` threads.
pub fn llama_cpp(
    lab: &Lab,
    i: usize,
    llama_bench: &Path,
    model: &Path,
    threads: usize,
    tokens: usize,
) -> Baseline {
    let args = [
        "-m".to_string(),
        model.display().to_string(),
        "-lm".into(),
        "mmap".into(),
        "--repack".into(),
        "0".into(),
        "-p".into(),
        "0".into(),
        "-n".into(),
        tokens.max(1).to_string(),
        "-t".into(),
        threads.max(1).to_string(),
        "-r".into(),
        "1".into(),
        "-o".into(),
        "json".into(),
    ];
    let command = format!("{} {}", llama_bench.display(), args.join(" "));
    let decode_tokens_per_s = run(lab, i, llama_bench, &args);
    Baseline {
        host: lab.name(i).to_string(),
        command,
        decode_tokens_per_s,
    }
}

fn run(lab: &Lab, i: usize, llama_bench: &Path, args: &[String]) -> Result<f64, String> {
    lab.set_cpu_quotas(true).map_err(|e| e.to_string())?;
    drop_page_cache()?;
    let mut cmd = lab.command(i, llama_bench).map_err(|e| e.to_string())?;
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("starting {}: {e}", llama_bench.display()))?;
    // Both pipes drained while it runs: llama.cpp's load log alone can fill a pipe's buffer,
    // and a child blocked on a full pipe would only end at the limit.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut text);
            }
            text
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if started.elapsed() > LIMIT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no result within {} s", LIMIT.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => return Err(format!("waiting for llama-bench: {e}")),
        }
    };
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    if !status.success() {
        let last = stderr.lines().last().unwrap_or("").trim();
        return Err(format!("llama-bench ended with {status}: {last}"));
    }
    decode_rate(&stdout)
}

/// Drops the machine's clean page cache (root only; the lab is root).
fn drop_page_cache() -> Result<(), String> {
    // Written back first, so that dirty pages do not stay cached.
    let _ = std::process::Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "1")
        .map_err(|e| format!("dropping the page cache: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_the_generation_tests_mean() {
        let json = r#"[
          {"n_prompt": 512, "n_gen": 0, "avg_ts": 140.5},
          {"n_prompt": 0, "n_gen": 32, "avg_ts": 0.48, "stddev_ts": 0.0}
        ]"#;
        assert_eq!(decode_rate(json), Ok(0.48));
        assert!(decode_rate(r#"[{"n_prompt": 512, "n_gen": 0, "avg_ts": 140.5}]"#).is_err());
        assert!(decode_rate("not json").is_err());
    }
}
