//! How much the lab's machine computes when its emulated hosts compute at once, measured with
//! the scenario's model: the lab's hosts are namespaces of one machine, so hosts busy together
//! divide its cores, and that machine's cores do not add up to their count.
//!
//! On this project's 2-core VM, two decoders at once each ran at 0.84× one alone, where
//! counting cores says 1.0× (`tessera generate`, one thread, 256 tokens, alternated). Whether
//! its two vCPUs share a physical core, its caches or something else the guest cannot see,
//! the machine's own figure is what it delivers, so that is what the lab measures: one
//! decoder alone, then one per host at once, each `tessera bench` with the scenario's threads,
//! alternated over a few rounds.
//! The engine's compute probe is no substitute: it splits one matmul over a thread pool, and
//! its all-threads over one-thread ratio read 1.18–1.90 in four runs of the same minute.

use std::path::Path;
use std::process::{Command, Stdio};

use serde::Serialize;

use crate::error::{LabError, Result};

/// Decode tokens each measurement decodes: long enough for copies started together to overlap
/// for nearly all of their run.
const TOKENS: &str = "96";

/// What the machine computed alone and with `copies` decoders at once.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Parallelism {
    /// One decoder alone, decode tokens/s.
    pub alone_tok_s: f64,
    /// The decoders at once, their tokens/s summed.
    pub together_tok_s: f64,
    pub copies: usize,
}

impl Parallelism {
    /// The machine's cores as one node counts them: what `copies` decoders at once deliver in
    /// units of one alone, times the threads each computes with. Never above the cores the
    /// copies asked for.
    pub fn effective_cores(&self, threads: usize) -> f64 {
        let ratio = self.together_tok_s / self.alone_tok_s;
        (ratio * threads as f64).min((self.copies * threads) as f64)
    }
}

/// Rounds of one decoder alone then the copies at once; the medians are kept. One reading of
/// each was not enough: on this VM a decoder alone read 62.0 tok/s at a run's start and 93.7
/// ten minutes later, and that one reading set the machine's cores for the cells (−19% after
/// calibration). Alternating puts the machine's drift on both sides alike.
const ROUNDS: usize = 3;

/// Measures one `tessera bench` decoder of `model` alone, then `copies` at once, each with
/// `threads` compute threads, alternating for [`ROUNDS`] rounds: the median of each.
pub fn measure(tessera: &Path, model: &Path, threads: usize, copies: usize) -> Result<Parallelism> {
    let copies = copies.max(1);
    let (mut alone, mut together) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        alone.push(run_together(tessera, model, threads, 1)?);
        together.push(run_together(tessera, model, threads, copies)?);
    }
    Ok(Parallelism {
        alone_tok_s: super::ring::median(alone),
        together_tok_s: super::ring::median(together),
        copies,
    })
}

/// `n` bench processes started together; their decode tokens/s summed.
fn run_together(tessera: &Path, model: &Path, threads: usize, n: usize) -> Result<f64> {
    let threads = threads.to_string();
    let mut children = Vec::with_capacity(n);
    for _ in 0..n {
        let child = Command::new(tessera)
            .args(["bench", "--json", "-p", "1", "-r", "1", "-n", TOKENS, "-t"])
            .arg(&threads)
            .arg("-m")
            .arg(model)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| LabError::io(format!("starting {}", tessera.display()), e))?;
        children.push(child);
    }
    let mut sum = 0.0;
    for child in children {
        let out = child
            .wait_with_output()
            .map_err(|e| LabError::io("waiting for tessera bench".to_string(), e))?;
        sum += decode_rate(&out)?;
    }
    Ok(sum)
}

/// The part of `tessera bench --json`'s report the machine measurement reads.
#[derive(serde::Deserialize)]
struct BenchReport {
    decode_tok_s: f64,
}

fn decode_rate(out: &std::process::Output) -> Result<f64> {
    let bench = "tessera bench (measuring the machine)";
    if !out.status.success() {
        return Err(LabError::ProcessFailed {
            process: bench.into(),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let unreadable = |message: &str| LabError::Unreadable {
        process: bench.into(),
        what: "report".into(),
        message: message.into(),
    };
    let line = String::from_utf8_lossy(&out.stdout);
    let report: BenchReport = line
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| unreadable("no JSON line with decode_tok_s"))?;
    Some(report.decode_tok_s)
        .filter(|r| *r > 0.0)
        .ok_or_else(|| unreadable("a decode rate of 0"))
}

#[cfg(test)]
mod tests {
    use super::Parallelism;

    #[test]
    fn effective_cores_are_what_the_copies_delivered_in_units_of_one_alone() {
        let p = Parallelism {
            alone_tok_s: 60.0,
            together_tok_s: 100.0,
            copies: 2,
        };
        assert!((p.effective_cores(1) - 100.0 / 60.0).abs() < 1e-9);
        assert!((p.effective_cores(2) - 200.0 / 60.0).abs() < 1e-9);
        // Noise can make copies look faster than one alone each: never more cores than asked.
        let fast = Parallelism {
            together_tok_s: 130.0,
            ..p
        };
        assert_eq!(fast.effective_cores(1), 2.0);
    }
}
