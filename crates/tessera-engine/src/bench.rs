//! `tessera bench`: load time, prefill and decode speed, memory, and the memory-bandwidth
//! bound on decode measured in the same run.

use std::fmt;
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tessera_model::{GgufFile, ModelProfile};

use crate::error::{EngineError, Result};
use crate::expert_store::{measure_read_bandwidth as measure_disk_bandwidth, ExpertStreaming};
use crate::kernels::{ThreadPool, WeightArena};
use crate::kv::{KvCache, KvType};
use crate::model::Model;
use crate::ops::argmax;
use crate::weights::LoadSpec;

/// Timed runs per test; their mean is reported (llama-bench reports a mean too).
pub const REPEATS: usize = 3;

/// What one benchmark run measured (speeds: the mean over [`REPEATS`] timed runs).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchReport {
    pub model: String,
    pub threads: usize,
    pub n_prompt: usize,
    pub n_gen: usize,
    /// Tokens of context before each test.
    #[serde(default)]
    pub depth: usize,
    #[serde(default)]
    pub kv_type: KvType,
    pub load_s: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Peak resident set (VmHWM), where the OS reports it.
    pub peak_rss_bytes: Option<u64>,
    /// Of the process's memory after the tests, what sits on transparent huge pages, and the
    /// kernel's setting for them (Linux): weights on 4 KiB pages decode slower
    /// (`kernels::weight_buffer`).
    #[serde(default)]
    pub huge_pages: Option<HugePages>,
    pub weight_resident_bytes: u64,
    pub kv_bytes: u64,
    /// Weight bytes read per decoded token (active experts only).
    pub active_bytes_per_token: u64,
    /// Memory read bandwidth measured in this run, with `threads` threads.
    pub mem_read_gb_s: f64,
    /// `mem_read_gb_s / (active_bytes_per_token + the KV cache at depth)`: decode cannot beat
    /// this.
    pub decode_bound_tok_s: f64,
    /// With an expert budget: how the streamed experts did in the decode test.
    #[serde(default)]
    pub streaming: Option<StreamingReport>,
    /// Each weight type of the file and the kernel path it took (`kernels::type_paths`).
    #[serde(default)]
    pub kernels: Vec<crate::kernels::TypePath>,
    /// With [`BenchConfig::timeline`]: the last decode run's timeline (`crate::timeline`).
    #[serde(skip)]
    pub timeline: Option<crate::TimelineRecord>,
}

/// Transparent huge pages in a benchmark's process.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HugePages {
    /// `AnonHugePages` of `/proc/self/smaps_rollup`.
    pub bytes: u64,
    /// The selected word of `/sys/kernel/mm/transparent_hugepage/enabled` (`always`,
    /// `madvise` or `never`), where it could be read.
    pub mode: Option<String>,
}

impl HugePages {
    /// This process's, where the OS reports them (Linux).
    pub fn of_this_process() -> Option<Self> {
        let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
        let kib = kib_field(&rollup, "AnonHugePages:")?;
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .ok()
            .and_then(|s| {
                let (_, rest) = s.split_once('[')?;
                Some(rest.split_once(']')?.0.to_string())
            });
        Some(Self {
            bytes: kib * 1024,
            mode,
        })
    }
}

/// Expert streaming in a benchmark's decode test (its last run).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StreamingReport {
    pub budget_bytes: u64,
    /// Expert lookups served from memory.
    pub hit_rate: f64,
    /// File bytes of the experts read because they were not in memory, per decoded token.
    pub missed_bytes_per_token: f64,
    /// The store's own read bandwidth (`O_DIRECT` where allowed, so the page cache does not
    /// flatter it), best of queue depths 1, 2, 4 and 8 over random experts' byte ranges.
    pub disk_gb_s: f64,
    /// `disk_gb_s / missed_bytes_per_token`: decode cannot beat this with this hit rate.
    pub disk_bound_tok_s: f64,
    /// Share of the decode with an expert read in progress.
    pub disk_busy: f64,
    /// Share of the decode the computation waited for reads.
    pub read_wait: f64,
    /// Milliseconds each decode step waited for reads, on average.
    #[serde(default)]
    pub read_wait_ms_per_step: f64,
    /// Milliseconds a decode step took, on average.
    #[serde(default)]
    pub step_ms: f64,
    /// Milliseconds per decode step the I/O thread spent building (repacking) read experts:
    /// one thread builds them all, so this bounds how fast misses can be served.
    #[serde(default)]
    pub build_ms_per_step: f64,
    /// Experts read on demand (the computation needed them and waited) per step.
    #[serde(default)]
    pub misses_per_step: f64,
    /// Experts read ahead by prefetch per step, and the share of them a computation then used:
    /// a wasted read takes disk time from the reads that count.
    #[serde(default)]
    pub prefetches_per_step: f64,
    #[serde(default)]
    pub prefetch_useful: f64,
    /// The next layer's predicted experts: the share the layer then used (precision), and the
    /// share of its used experts that had been predicted (recall).
    #[serde(default)]
    pub prediction_precision: f64,
    #[serde(default)]
    pub prediction_recall: f64,
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        writeln!(f, "model        {}", self.model)?;
        writeln!(
            f,
            "threads      {}, KV cache {}, depth {}",
            self.threads, self.kv_type, self.depth
        )?;
        writeln!(f, "load         {:.2} s", self.load_s)?;
        if !self.kernels.is_empty() {
            let paths: Vec<String> = self.kernels.iter().map(|p| p.to_string()).collect();
            writeln!(f, "kernels      {}", paths.join(", "))?;
        }
        if self.n_prompt > 0 {
            writeln!(
                f,
                "prefill      {:.1} tok/s ({} tokens)",
                self.prefill_tok_s, self.n_prompt
            )?;
        }
        if self.n_gen > 0 {
            writeln!(
                f,
                "decode       {:.1} tok/s ({} tokens); bandwidth bound {:.1} tok/s ({:.0}% of it)",
                self.decode_tok_s,
                self.n_gen,
                self.decode_bound_tok_s,
                100.0 * self.decode_tok_s / self.decode_bound_tok_s
            )?;
        }
        let huge = self.huge_pages.as_ref().map_or(String::new(), |h| {
            let mode = h.mode.as_deref().unwrap_or("setting unknown");
            let hint = if mode == "never" {
                // What it costs and how to change it, where the user is likely to look.
                " (weights on 4 KiB pages decode ~8-10% slower; as root: echo madvise > \
                 /sys/kernel/mm/transparent_hugepage/enabled)"
            } else {
                ""
            };
            format!(", {:.1} MiB on huge pages (THP {mode}){hint}", mib(h.bytes))
        });
        writeln!(
            f,
            "memory       weights {:.1} MiB, KV {:.2} MiB, peak RSS {}{huge}",
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
        )?;
        if let Some(s) = &self.streaming {
            write!(
                f,
                "\nstreaming    budget {:.1} MiB: hit rate {:.1}%, {:.2} MiB of missed experts per \
                 token, disk {:.2} GB/s; disk-bound {:.1} tok/s, decode reaches {:.0}% of it \
                 (disk busy {:.0}%, waiting for reads {:.0}% of the decode: {:.2} of each \
                 step's {:.2} ms; building read experts {:.2} ms a step); a step reads \
                 {:.1} experts on demand and {:.1} ahead ({:.0}% of them used; the next \
                 layer's prediction {:.0}% precise, recalls {:.0}%)",
                mib(s.budget_bytes),
                100.0 * s.hit_rate,
                s.missed_bytes_per_token / (1024.0 * 1024.0),
                s.disk_gb_s,
                s.disk_bound_tok_s,
                100.0 * self.decode_tok_s / s.disk_bound_tok_s,
                100.0 * s.disk_busy,
                100.0 * s.read_wait,
                s.read_wait_ms_per_step,
                s.step_ms,
                s.build_ms_per_step,
                s.misses_per_step,
                s.prefetches_per_step,
                100.0 * s.prefetch_useful,
                100.0 * s.prediction_precision,
                100.0 * s.prediction_recall
            )?;
        }
        Ok(())
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
    kib_field(&std::fs::read_to_string("/proc/self/status").ok()?, key)
}

/// The value of a `Key:   123 kB` line of a `/proc` file.
fn kib_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Read bandwidth of a buffer larger than the caches, read by `threads` threads (best of 3).
/// The buffer is held as the weights are (huge pages where the OS gives them), so the bound
/// derived from it is the one decode streams against.
pub fn measure_read_bandwidth(threads: usize) -> f64 {
    const BYTES: usize = 256 << 20;
    let mut mem = WeightArena::new().take(BYTES);
    for (i, w) in mem.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&(i as u64).to_ne_bytes());
    }
    let buf = &mem[..];
    let pool = ThreadPool::new(threads);
    let n_tasks = threads * 8;
    // Bytes per task, whole 64-byte lines.
    let chunk = BYTES / n_tasks / 64 * 64;
    let sink = std::sync::atomic::AtomicU64::new(0);
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        pool.run(n_tasks, |i| {
            let mut acc = [0u64; 8];
            for c in buf[i * chunk..(i + 1) * chunk].chunks_exact(64) {
                for (j, w) in c.chunks_exact(8).enumerate() {
                    let w = u64::from_ne_bytes(w.try_into().expect("8 bytes"));
                    acc[j] = acc[j].wrapping_add(w);
                }
            }
            sink.fetch_add(
                acc.iter().fold(0, |a, &b| a ^ b),
                std::sync::atomic::Ordering::Relaxed,
            );
        });
        let gbs = (chunk * n_tasks) as f64 / t.elapsed().as_secs_f64() / 1e9;
        best = best.max(gbs);
    }
    std::hint::black_box(sink.into_inner());
    best
}

/// What [`bench_config`] measures, as llama-bench's options: `-p`, `-n`, `-d`, `-ub`, `-r`,
/// `-ctk/-ctv`.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub threads: usize,
    /// Prompt tokens of the prefill test (0: no prefill test).
    pub n_prompt: usize,
    /// Decode steps of the decode test (0: no decode test).
    pub n_gen: usize,
    /// Tokens of context already in the cache when each test starts.
    pub depth: usize,
    /// Tokens per forward pass while prefilling (llama.cpp's micro-batch).
    pub ubatch: usize,
    /// Timed runs per test; their mean is reported (llama-bench reports a mean too).
    pub repetitions: usize,
    pub kv_type: KvType,
    /// Stream the experts through a cache of this many bytes.
    pub expert_budget: Option<u64>,
    /// Record a timeline of the last decode run (streamed experts only: the store records it).
    pub timeline: bool,
}

impl BenchConfig {
    pub fn new(threads: usize, n_prompt: usize, n_gen: usize) -> Self {
        Self {
            threads,
            n_prompt,
            n_gen,
            depth: 0,
            ubatch: 512,
            repetitions: REPEATS,
            kv_type: KvType::default(),
            expert_budget: None,
            timeline: false,
        }
    }
}

/// Loads `model_path` whole and measures it like llama-bench's pp/tg tests: a prompt of
/// `n_prompt` tokens, and `n_gen` greedy decode steps from an empty context.
pub fn bench(
    model_path: &Path,
    threads: usize,
    n_prompt: usize,
    n_gen: usize,
) -> Result<BenchReport> {
    bench_config(model_path, &BenchConfig::new(threads, n_prompt, n_gen))
}

/// [`bench`], with the experts streamed from disk through a cache of `expert_budget` bytes when
/// given (see [`bench_config`]).
pub fn bench_with(
    model_path: &Path,
    threads: usize,
    n_prompt: usize,
    n_gen: usize,
    expert_budget: Option<u64>,
) -> Result<BenchReport> {
    let mut c = BenchConfig::new(threads, n_prompt, n_gen);
    c.expert_budget = expert_budget;
    bench_config(model_path, &c)
}

/// Measures a model as `config` says. Each test starts from a cache holding `depth` tokens
/// (filled once, untimed, then copied), as llama-bench's `-d`. Streamed, the decode test feeds
/// a fixed pseudo-random token stream instead of its own greedy tokens: a synthetic model's
/// greedy output repeats one token, which would route the same way every step and flatter the
/// cache.
pub fn bench_config(model_path: &Path, config: &BenchConfig) -> Result<BenchReport> {
    let BenchConfig {
        threads,
        n_prompt,
        n_gen,
        depth,
        repetitions,
        kv_type,
        expert_budget,
        timeline,
        ..
    } = *config;
    let ubatch = config.ubatch.max(1);
    let t = Instant::now();
    let g = GgufFile::open(model_path)?;
    let model = match expert_budget {
        None => Model::load_full(&g, threads)?,
        Some(budget) => {
            let cfg = tessera_model::ModelConfig::from_gguf(&g)?;
            if cfg.n_expert == 0 {
                return Err(EngineError::BadInput(
                    "an expert budget needs a mixture-of-experts model".into(),
                ));
            }
            Model::load_streaming(
                &g,
                LoadSpec::full(&cfg),
                ExpertStreaming::with_budget(budget),
                threads,
                &mut |_, _| {},
            )?
        }
    };
    let model = model.with_kv_type(kv_type)?;
    // A streamed model's load ends when its cache holds what its budget allows (`fill.rs`):
    // the decode measures the budget, not a cold cache warming up.
    model.wait_experts_filled();
    let load_s = t.elapsed().as_secs_f64();
    let profile = ModelProfile::from_gguf(&g)?;
    let cfg = model.config().clone();
    let tokens = |n: usize, salt: u64| -> Vec<u32> {
        (0..n)
            .map(|i| {
                let r = tessera_sampling::splitmix64((salt << 40) + i as u64);
                (r % cfg.vocab_size as u64) as u32
            })
            .collect()
    };
    let needed = depth + n_prompt.max(n_gen);
    if needed > cfg.context_length {
        return Err(EngineError::ContextOverflow {
            needed,
            limit: cfg.context_length,
        });
    }
    let prefill = |kv: &mut KvCache, toks: &[u32]| -> Result<Option<u32>> {
        let mut last = None;
        for c in toks.chunks(ubatch) {
            last = Some(argmax(model.forward_last(c, kv)?.last()) as u32);
        }
        Ok(last)
    };

    // Warm up: touch every weight once.
    {
        let mut kv = model.new_kv(16);
        prefill(&mut kv, &tokens(8, 0))?;
    }
    // The context every test starts from.
    let mut base = model.new_kv(needed.max(1));
    let mut token = prefill(&mut base, &tokens(depth, 1))?.unwrap_or(1);
    let prompt = tokens(n_prompt, 2);
    // The mean of `repetitions` runs each, the statistic llama-bench reports, so the two
    // compare like for like (a best run flatters whichever side is noisier).
    let runs = repetitions.max(1);
    let (mut prefill_s, mut decode_s, mut kv_bytes) = (0.0f64, 0.0f64, base.bytes());
    let mut last_stats = None;
    let mut recorded = None;
    for rep in 0..runs {
        if n_prompt > 0 {
            // Back to the depth context: later positions are written over, so the test runs
            // in the one cache (a copy would count a second cache in the peak RSS).
            base.truncate(depth);
            let kv = &mut base;
            let t = Instant::now();
            let last = prefill(kv, &prompt)?;
            prefill_s += t.elapsed().as_secs_f64() / runs as f64;
            kv_bytes = kv_bytes.max(kv.bytes());
            if depth == 0 {
                token = last.unwrap_or(token);
            }
        }
        if n_gen == 0 {
            continue;
        }
        // Streamed: new tokens each run, so no run finds the previous one's experts waiting.
        let stream = tokens(n_gen, 3 + rep as u64);
        // Decode: n_gen greedy steps after `depth` tokens, as llama-bench's tg test.
        base.truncate(depth);
        let kv = &mut base;
        let mut tok = token;
        let before = model.expert_stats();
        let store = model.expert_store().filter(|_| timeline && rep + 1 == runs);
        if let Some(s) = store {
            s.start_timeline();
        }
        let t = Instant::now();
        for &next in &stream {
            let l = model.forward_last(&[tok], kv)?;
            tok = match expert_budget {
                None => argmax(l.last()) as u32,
                Some(_) => next,
            };
        }
        decode_s += t.elapsed().as_secs_f64() / runs as f64;
        if let Some(s) = store {
            recorded = Some(s.stop_timeline());
        }
        last_stats = before.zip(model.expert_stats());
        kv_bytes = kv_bytes.max(kv.bytes());
    }
    drop(base);
    let streaming = match (expert_budget, last_stats) {
        (Some(budget), Some((a, b))) => {
            Some(streaming_report(&g, &cfg, budget, &a, &b, n_gen, decode_s)?)
        }
        _ => None,
    };
    // Before the bandwidth test, whose buffer is not the model's memory.
    let peak_rss = peak_rss_bytes();
    let huge_pages = HugePages::of_this_process();
    let mem_read_gb_s = measure_read_bandwidth(threads);
    // A decode step reads the active weights and, at depth, the whole cache.
    let active = profile.active_bytes_per_token();
    let kv_read = if n_gen > 0 {
        model.kv_bytes_for(depth)
    } else {
        0
    };
    let rate = |n: usize, s: f64| if n == 0 { 0.0 } else { n as f64 / s };
    Ok(BenchReport {
        model: model_path.display().to_string(),
        threads,
        n_prompt,
        n_gen,
        depth,
        kv_type,
        load_s,
        prefill_tok_s: rate(n_prompt, prefill_s),
        decode_tok_s: rate(n_gen, decode_s),
        peak_rss_bytes: peak_rss,
        huge_pages,
        weight_resident_bytes: model.resident_bytes() as u64,
        kv_bytes: kv_bytes as u64,
        active_bytes_per_token: active,
        mem_read_gb_s,
        decode_bound_tok_s: mem_read_gb_s * 1e9 / (active + kv_read) as f64,
        streaming,
        kernels: crate::kernels::type_paths(g.tensors()),
        timeline: recorded,
    })
}

/// The streaming figures of a decode of `n_gen` tokens in `decode_s` seconds, from the store's
/// counters before (`a`) and after (`b`) it.
fn streaming_report(
    g: &GgufFile,
    cfg: &tessera_model::ModelConfig,
    budget: u64,
    a: &crate::ExpertStats,
    b: &crate::ExpertStats,
    n_gen: usize,
    decode_s: f64,
) -> Result<StreamingReport> {
    let n = n_gen.max(1) as f64;
    let lookups = (b.lookups - a.lookups).max(1) as f64;
    let hits = (b.hits - a.hits) as f64;
    // Every expert that was not in memory when a token needed it: the misses' bytes, and the
    // prefetches that were then used (read ahead, but read all the same).
    let ranges = expert_ranges(g, cfg, 96)?;
    let per_expert = ranges.iter().take(3).map(|r| r.1).sum::<u64>() as f64;
    let missed = (b.miss_bytes_read - a.miss_bytes_read) as f64
        + (b.prefetch_useful - a.prefetch_useful) as f64 * per_expert;
    let mut disk_gb_s: f64 = 0.0;
    for qd in [1, 2, 4, 8] {
        let (gbs, _) = measure_disk_bandwidth(g.path(), &ranges, qd, true)
            .map_err(|e| EngineError::BadInput(format!("measuring the disk: {e}")))?;
        disk_gb_s = disk_gb_s.max(gbs);
    }
    let missed_per_token = missed / n;
    Ok(StreamingReport {
        budget_bytes: budget,
        hit_rate: hits / lookups,
        missed_bytes_per_token: missed_per_token,
        disk_gb_s,
        disk_bound_tok_s: disk_gb_s * 1e9 / missed_per_token.max(1.0),
        disk_busy: (b.disk_busy_us - a.disk_busy_us) as f64 / 1e6 / decode_s,
        read_wait: (b.read_wait_us - a.read_wait_us) as f64 / 1e6 / decode_s,
        // The counters cover the last run; `decode_s` is the mean over runs, as is a step.
        read_wait_ms_per_step: (b.read_wait_us - a.read_wait_us) as f64 / 1e3 / n,
        step_ms: decode_s * 1e3 / n,
        build_ms_per_step: (b.build_us - a.build_us) as f64 / 1e3 / n,
        misses_per_step: (b.misses - a.misses) as f64 / n,
        prefetches_per_step: (b.prefetch_issued - a.prefetch_issued) as f64 / n,
        prefetch_useful: share(
            b.prefetch_useful - a.prefetch_useful,
            b.prefetch_issued - a.prefetch_issued,
        ),
        prediction_precision: share(
            b.predicted_used - a.predicted_used,
            b.predicted - a.predicted,
        ),
        prediction_recall: share(
            b.predicted_used - a.predicted_used,
            b.used_after_prediction - a.used_after_prediction,
        ),
    })
}

/// `part / whole`, 0 where nothing was counted.
fn share(part: u64, whole: u64) -> f64 {
    part as f64 / whole.max(1) as f64
}

/// File byte ranges (gate, up, down) of `n` pseudo-random experts of the model.
fn expert_ranges(
    g: &GgufFile,
    cfg: &tessera_model::ModelConfig,
    n: usize,
) -> Result<Vec<(u64, u64)>> {
    let mut out = Vec::with_capacity(3 * n);
    for i in 0..n {
        let r = tessera_sampling::splitmix64(i as u64);
        let layer = (r % cfg.n_layer as u64) as usize;
        let e = (r >> 20) % cfg.n_expert as u64;
        for w in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
            let t = g.require_tensor(&format!("blk.{layer}.{w}.weight"))?;
            let per = t.n_bytes / cfg.n_expert as u64;
            out.push((t.offset + per * e, per));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_fields_are_read_in_kib() {
        let rollup = "Rss:              311296 kB\nAnonHugePages:    270336 kB\n";
        assert_eq!(kib_field(rollup, "AnonHugePages:"), Some(270_336));
        assert_eq!(kib_field(rollup, "Swap:"), None);
    }

    #[test]
    fn the_memory_line_says_what_is_on_huge_pages() {
        let mut r = BenchReport {
            model: "m.gguf".into(),
            threads: 2,
            n_prompt: 0,
            n_gen: 0,
            depth: 0,
            kv_type: KvType::F16,
            load_s: 0.1,
            prefill_tok_s: 0.0,
            decode_tok_s: 0.0,
            peak_rss_bytes: Some(300 << 20),
            huge_pages: Some(HugePages {
                bytes: 264 << 20,
                mode: Some("madvise".into()),
            }),
            weight_resident_bytes: 254 << 20,
            kv_bytes: 0,
            active_bytes_per_token: 254 << 20,
            mem_read_gb_s: 30.0,
            decode_bound_tok_s: 110.0,
            streaming: None,
            kernels: Vec::new(),
            timeline: None,
        };
        let text = r.to_string();
        assert!(
            text.contains("peak RSS 300.0 MiB, 264.0 MiB on huge pages (THP madvise)"),
            "{text}"
        );
        assert!(!text.contains("as root"), "{text}");
        r.huge_pages = Some(HugePages {
            bytes: 0,
            mode: Some("never".into()),
        });
        let text = r.to_string();
        assert!(
            text.contains("0.0 MiB on huge pages (THP never) (weights on 4 KiB pages")
                && text.contains("echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"),
            "{text}"
        );
        r.huge_pages = None;
        assert!(!r.to_string().contains("huge pages"));
    }
}
