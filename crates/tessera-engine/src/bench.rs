//! `tessera bench`: load time, prefill and decode speed, memory, and the memory-bandwidth
//! bound on decode measured in the same run.

use std::fmt;
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tessera_model::{GgufFile, ModelProfile};

use crate::error::Result;
use crate::kernels::ThreadPool;
use crate::model::Model;
use crate::ops::argmax;

/// Timed runs per test; the best is reported.
pub const REPEATS: usize = 3;

/// What one benchmark run measured (speeds: best of [`REPEATS`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchReport {
    pub model: String,
    pub threads: usize,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub load_s: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Peak resident set (VmHWM), where the OS reports it.
    pub peak_rss_bytes: Option<u64>,
    pub weight_resident_bytes: u64,
    pub kv_bytes: u64,
    /// Weight bytes read per decoded token (active experts only).
    pub active_bytes_per_token: u64,
    /// Memory read bandwidth measured in this run, with `threads` threads.
    pub mem_read_gb_s: f64,
    /// `mem_read_gb_s / active_bytes_per_token`: decode cannot beat this.
    pub decode_bound_tok_s: f64,
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        writeln!(f, "model        {}", self.model)?;
        writeln!(f, "threads      {}", self.threads)?;
        writeln!(f, "load         {:.2} s", self.load_s)?;
        writeln!(
            f,
            "prefill      {:.1} tok/s ({} tokens)",
            self.prefill_tok_s, self.n_prompt
        )?;
        writeln!(
            f,
            "decode       {:.1} tok/s ({} tokens); bandwidth bound {:.1} tok/s ({:.0}% of it)",
            self.decode_tok_s,
            self.n_gen,
            self.decode_bound_tok_s,
            100.0 * self.decode_tok_s / self.decode_bound_tok_s
        )?;
        writeln!(
            f,
            "memory       weights {:.1} MiB, KV {:.2} MiB, peak RSS {}",
            mib(self.weight_resident_bytes),
            mib(self.kv_bytes),
            self.peak_rss_bytes
                .map_or("n/a".into(), |b| format!("{:.1} MiB", mib(b)))
        )?;
        write!(
            f,
            "bandwidth    {:.1} GB/s read; {:.1} MiB active weights per token",
            self.mem_read_gb_s,
            mib(self.active_bytes_per_token)
        )
    }
}

/// Peak resident set size from `/proc/self/status` (Linux); `None` elsewhere.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_kib("VmHWM:").map(|k| k * 1024)
}

/// Current resident set size from `/proc/self/status` (Linux); `None` elsewhere.
pub fn current_rss_bytes() -> Option<u64> {
    proc_status_kib("VmRSS:").map(|k| k * 1024)
}

fn proc_status_kib(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Read bandwidth of a buffer larger than the caches, read by `threads` threads (best of 3).
pub fn measure_read_bandwidth(threads: usize) -> f64 {
    const BYTES: usize = 256 << 20;
    let buf: Vec<u64> = (0..BYTES / 8).map(|i| i as u64).collect();
    let pool = ThreadPool::new(threads);
    let n_tasks = threads * 8;
    let chunk = buf.len() / n_tasks;
    let sink = std::sync::atomic::AtomicU64::new(0);
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        pool.run(n_tasks, |i| {
            let mut acc = [0u64; 8];
            for c in buf[i * chunk..(i + 1) * chunk].chunks_exact(8) {
                for j in 0..8 {
                    acc[j] = acc[j].wrapping_add(c[j]);
                }
            }
            sink.fetch_add(
                acc.iter().fold(0, |a, &b| a ^ b),
                std::sync::atomic::Ordering::Relaxed,
            );
        });
        let gbs = (chunk * n_tasks * 8) as f64 / t.elapsed().as_secs_f64() / 1e9;
        best = best.max(gbs);
    }
    std::hint::black_box(sink.into_inner());
    best
}

/// Loads `model_path` whole and measures it like llama-bench's pp/tg tests: a prompt of
/// `n_prompt` tokens in one forward, and `n_gen` greedy decode steps from an empty context.
pub fn bench(
    model_path: &Path,
    threads: usize,
    n_prompt: usize,
    n_gen: usize,
) -> Result<BenchReport> {
    let t = Instant::now();
    let g = GgufFile::open(model_path)?;
    let model = Model::load_full(&g, threads)?;
    let load_s = t.elapsed().as_secs_f64();
    let profile = ModelProfile::from_gguf(&g)?;
    let cfg = model.config().clone();
    let prompt: Vec<u32> = (0..n_prompt.max(1))
        .map(|i| (crate::sampling::splitmix64(i as u64) % cfg.vocab_size as u64) as u32)
        .collect();

    // Warm up: touch every weight once.
    {
        let mut kv = model.new_kv(16);
        model.forward_last(&prompt[..prompt.len().min(8)], &mut kv)?;
    }
    // Best of REPEATS runs each (the machines are shared and noisy).
    let (mut prefill_s, mut decode_s, mut kv_bytes) = (f64::INFINITY, f64::INFINITY, 0);
    for _ in 0..REPEATS {
        // Prefill: one forward over the prompt.
        let mut kv = model.new_kv(prompt.len());
        let t = Instant::now();
        let logits = model.forward_last(&prompt, &mut kv)?;
        prefill_s = prefill_s.min(t.elapsed().as_secs_f64());
        kv_bytes = kv_bytes.max(kv.bytes());
        drop(kv);
        // Decode: n_gen greedy steps from an empty context, as llama-bench's tg test.
        let mut token = argmax(logits.last()) as u32;
        let mut kv = model.new_kv(n_gen.max(1));
        let t = Instant::now();
        for _ in 0..n_gen {
            let l = model.forward_last(&[token], &mut kv)?;
            token = argmax(l.last()) as u32;
        }
        decode_s = decode_s.min(t.elapsed().as_secs_f64());
        kv_bytes = kv_bytes.max(kv.bytes());
    }
    let mem_read_gb_s = measure_read_bandwidth(threads);
    let active = profile.active_bytes_per_token();
    Ok(BenchReport {
        model: model_path.display().to_string(),
        threads,
        n_prompt: prompt.len(),
        n_gen,
        load_s,
        prefill_tok_s: prompt.len() as f64 / prefill_s,
        decode_tok_s: n_gen as f64 / decode_s,
        peak_rss_bytes: peak_rss_bytes(),
        weight_resident_bytes: model.resident_bytes() as u64,
        kv_bytes: kv_bytes as u64,
        active_bytes_per_token: active,
        mem_read_gb_s,
        decode_bound_tok_s: mem_read_gb_s * 1e9 / active as f64,
    })
}
