//! Expert streaming benchmark (not a test: it times things and drops the page cache).
//!
//! `cargo run --release -p tessera-engine --example expert_stream_bench -- \
//!     [MODEL.gguf] [budget_MiB] [threads] [n_gen (96)] [no-full]`
//!
//! Environment (for tuning): `PREFETCH_MAX`, `PREFETCH_MIN_PROB`, `READ_PARALLELISM`,
//! `PREFETCH=0` override the [`ExpertStreaming`] defaults.
//!
//! Measures, on this machine: the disk read bandwidth of the expert pattern (random experts'
//! byte ranges, cold cache, read by the store's own reader — `O_DIRECT` where allowed — at queue
//! depths 1, 2, 4 and 8; also plain pread and mmap for comparison), streamed decode at batch 1
//! (tokens/s, hit rate, prefetch accuracy, missed-expert bytes per token, peak RSS vs budget)
//! against the disk-bound limit, and batch 1/2/4/8 decode with and without streaming.
//!
//! The disk-bound limit is `disk bandwidth / missed-expert bytes per token`, where missed-expert
//! bytes are the bytes of every expert that was not in memory before the token needed it (the
//! misses read on the critical path plus the prefetches that were then used: what any cache
//! with this hit rate must read), and the bandwidth is the best median the store's reader
//! reached at any of the queue depths tried (so reading several experts at once does not
//! flatter the fraction). Dropping the page cache needs root (`/proc/sys/vm/drop_caches`);
//! without it the figures say so.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use tessera_engine::bench::{current_rss_bytes, peak_rss_bytes};
use tessera_engine::expert_store::measure_read_bandwidth;
use tessera_engine::ops::argmax;
use tessera_engine::{ExpertStats, ExpertStreaming, KvCache, LoadSpec, Model};
use tessera_model::{GgufFile, ModelConfig};

const MIB: f64 = 1024.0 * 1024.0;

fn drop_caches() -> bool {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Resets VmHWM so the next peak is of the next phase only (Linux).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// CPU seconds (user + system) this process has used.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Byte ranges (offset, len) of `n` random experts' gate/up/down matrices.
fn expert_ranges(g: &GgufFile, cfg: &ModelConfig, n: usize) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for i in 0..n {
        let r = splitmix(i as u64);
        let layer = (r % cfg.n_layer as u64) as usize;
        let e = (r >> 20) % cfg.n_expert as u64;
        for w in [
            "ffn_gate_exps.weight",
            "ffn_up_exps.weight",
            "ffn_down_exps.weight",
        ] {
            let t = g
                .tensor(&format!("blk.{layer}.{w}"))
                .expect("expert tensor");
            let per = t.n_bytes / cfg.n_expert as u64;
            out.push((t.offset + per * e, per));
        }
    }
    out
}

/// Adds 3 cold-cache runs of the store's reader over `ranges` at each of `depths` (interleaved)
/// to `runs`; whether the reads were `O_DIRECT`.
fn read_runs(g: &GgufFile, ranges: &[(u64, u64)], depths: &[usize], runs: &mut [Vec<f64>]) -> bool {
    let mut direct = false;
    for _ in 0..3 {
        for (i, &qd) in depths.iter().enumerate() {
            drop_caches();
            let (gbs, d) = measure_read_bandwidth(g.path(), ranges, qd, true).expect("read");
            direct = d;
            runs[i].push(gbs);
        }
    }
    drop_caches();
    direct
}

/// GB/s of positioned reads of `ranges` into an owned buffer.
fn pread_bandwidth(path: &std::path::Path, ranges: &[(u64, u64)]) -> f64 {
    let f = File::open(path).expect("open");
    let mut buf = Vec::new();
    let t = Instant::now();
    let mut total = 0;
    for &(off, len) in ranges {
        buf.resize(len as usize, 0);
        f.read_exact_at(&mut buf, off).expect("read");
        total += len;
    }
    total as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// GB/s of the same ranges through the mapping (WILLNEED, then a copy out, as a build would).
fn mmap_bandwidth(g: &GgufFile, ranges: &[(u64, u64)]) -> f64 {
    let map = g.mapping().expect("mapped");
    let mut buf = Vec::new();
    let t = Instant::now();
    let mut total = 0;
    for &(off, len) in ranges {
        let (o, l) = (off as usize, len as usize);
        let page = o & !4095;
        // SAFETY: advice on a range of a live read-only mapping.
        unsafe {
            libc::madvise(
                map.as_ptr().add(page) as *mut libc::c_void,
                o + l - page,
                libc::MADV_WILLNEED,
            );
        }
        buf.clear();
        buf.extend_from_slice(&map[o..o + l]);
        total += len;
    }
    std::hint::black_box(&buf);
    let gbs = total as f64 / t.elapsed().as_secs_f64() / 1e9;
    // Unmap the touched pages again, or they stay resident (and in the page cache).
    for &(off, len) in ranges {
        let (o, l) = (off as usize, len as usize);
        let page = o & !4095;
        // SAFETY: the mapping is private and read-only; dropped pages refault from the file.
        unsafe {
            libc::madvise(
                map.as_ptr().add(page) as *mut libc::c_void,
                o + l - page,
                libc::MADV_DONTNEED,
            );
        }
    }
    gbs
}

/// GB/s of positioned reads of `ranges` by `n` threads at once (queue depth `n`).
fn pread_bandwidth_parallel(path: &std::path::Path, ranges: &[(u64, u64)], n: usize) -> f64 {
    let t = Instant::now();
    std::thread::scope(|s| {
        for i in 0..n {
            s.spawn(move || {
                let f = File::open(path).expect("open");
                let mut buf = Vec::new();
                for &(off, len) in ranges.iter().skip(i).step_by(n) {
                    buf.resize(len as usize, 0);
                    f.read_exact_at(&mut buf, off).expect("read");
                }
            });
        }
    });
    ranges.iter().map(|r| r.1).sum::<u64>() as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn prompt(cfg: &ModelConfig, n: usize, seed: u64) -> Vec<u32> {
    (0..n)
        .map(|i| (splitmix(seed * 1000 + i as u64) % cfg.vocab_size as u64) as u32)
        .collect()
}

fn delta(a: &ExpertStats, b: &ExpertStats) -> ExpertStats {
    ExpertStats {
        lookups: b.lookups - a.lookups,
        hits: b.hits - a.hits,
        misses: b.misses - a.misses,
        inflight_waits: b.inflight_waits - a.inflight_waits,
        bytes_read: b.bytes_read - a.bytes_read,
        miss_bytes_read: b.miss_bytes_read - a.miss_bytes_read,
        late_reads: b.late_reads - a.late_reads,
        window_reads: b.window_reads - a.window_reads,
        prefetch_issued: b.prefetch_issued - a.prefetch_issued,
        prefetch_useful: b.prefetch_useful - a.prefetch_useful,
        prefetch_resident: b.prefetch_resident - a.prefetch_resident,
        prefetch_dropped: b.prefetch_dropped - a.prefetch_dropped,
        read_wait_us: b.read_wait_us - a.read_wait_us,
        build_us: b.build_us - a.build_us,
        disk_busy_us: b.disk_busy_us - a.disk_busy_us,
        read_us: b.read_us - a.read_us,
        predicted: b.predicted - a.predicted,
        predicted_used: b.predicted_used - a.predicted_used,
        used_after_prediction: b.used_after_prediction - a.used_after_prediction,
        tokens: b.tokens - a.tokens,
        ..b.clone()
    }
}

/// Decode `steps` tokens in each of `batch` sequences (after a short prompt each); tokens/s.
fn batch_decode(m: &Model, batch: usize, steps: usize) -> f64 {
    let cfg = m.config();
    let mut kvs: Vec<KvCache> = (0..batch).map(|_| m.new_kv(64)).collect();
    let mut toks = Vec::new();
    for (i, kv) in kvs.iter_mut().enumerate() {
        let l = m.forward_last(&prompt(cfg, 4, i as u64 + 7), kv).unwrap();
        toks.push(argmax(l.last()) as u32);
    }
    let t = Instant::now();
    for _ in 0..steps {
        let mut seqs: Vec<(u32, &mut KvCache)> = toks.iter().copied().zip(kvs.iter_mut()).collect();
        let l = m.step(&mut seqs).unwrap();
        for (i, tok) in toks.iter_mut().enumerate() {
            *tok = argmax(l.row(i)) as u32;
        }
    }
    (batch * steps) as f64 / t.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .map_or("/work/benchmodels/bench-qwen3moe-q4_0.gguf", |s| s.as_str());
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let budget = arg(2, 200) as u64 * (1 << 20);
    let threads = arg(3, 2);
    let n_gen = arg(4, 96);
    let with_full = args.get(5).is_none_or(|s| s != "no-full");
    let g = GgufFile::open(path).expect("open model");
    let cfg = ModelConfig::from_gguf(&g).expect("config");
    let expert_file_bytes: u64 = g
        .tensors()
        .iter()
        .filter(|t| t.name.contains("_exps."))
        .map(|t| t.n_bytes)
        .sum();
    println!("model          {path}");
    println!(
        "experts        {} layers x {} experts (top {}), {:.1} MiB in the file; budget {:.1} MiB ({:.1}x smaller); {threads} threads",
        cfg.n_layer,
        cfg.n_expert,
        cfg.n_expert_used,
        expert_file_bytes as f64 / MIB,
        budget as f64 / MIB,
        expert_file_bytes as f64 / budget as f64
    );

    let mut streaming = ExpertStreaming::with_budget(budget);
    let env = |k: &str| std::env::var(k).ok();
    if let Some(v) = env("PREFETCH_MAX") {
        streaming.prefetch_max = v.parse().expect("PREFETCH_MAX");
    }
    if let Some(v) = env("PREFETCH_MIN_PROB") {
        streaming.prefetch_min_prob = v.parse().expect("PREFETCH_MIN_PROB");
    }
    if let Some(v) = env("READ_PARALLELISM") {
        streaming.read_parallelism = v.parse().expect("READ_PARALLELISM");
    }
    if env("PREFETCH").is_some_and(|v| v == "0") {
        streaming.prefetch = false;
    }
    println!(
        "settings       read_parallelism {}, prefetch {} (at most {} per layer, predicted probability >= {}), pinned share {}",
        streaming.read_parallelism,
        streaming.prefetch,
        streaming.prefetch_max,
        streaming.prefetch_min_prob,
        streaming.pinned_fraction
    );

    // 1. Disk bandwidth of the expert read pattern, cold cache each time: the store's reader at
    // several queue depths (3 runs each, interleaved; median per depth), plain pread and mmap.
    let ranges = expert_ranges(&g, &cfg, 160);
    let dropped = drop_caches();
    let depths = [1usize, 2, 4, 8];
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); depths.len()];
    let direct = read_runs(&g, &ranges, &depths, &mut runs);
    drop_caches();
    let pread_gbs = pread_bandwidth(g.path(), &ranges);
    drop_caches();
    let mmap_gbs = mmap_bandwidth(&g, &ranges);
    drop_caches();
    let par_gbs = pread_bandwidth_parallel(g.path(), &ranges, 4);
    drop_caches();
    let warm_gbs = {
        pread_bandwidth(g.path(), &ranges);
        pread_bandwidth(g.path(), &ranges)
    };
    drop_caches();
    // Raw bytes of one expert in the file (gate + up + down of layer 0).
    let raw_expert_bytes: u64 = [
        "ffn_gate_exps.weight",
        "ffn_up_exps.weight",
        "ffn_down_exps.weight",
    ]
    .iter()
    .map(|w| {
        g.tensor(&format!("blk.0.{w}"))
            .expect("expert tensor")
            .n_bytes
            / cfg.n_expert as u64
    })
    .sum();

    // 2. Streamed decode at batch 1.
    drop_caches();
    reset_peak_rss();
    let rss0 = current_rss_bytes().unwrap_or(0);
    let t = Instant::now();
    let m = Model::load_streaming(
        &g,
        LoadSpec::full(&cfg),
        streaming.clone(),
        threads,
        &mut |_, _| {},
    )
    .expect("load streaming");
    let load_s = t.elapsed().as_secs_f64();
    let dense_bytes = m.weights().resident_bytes() as u64;
    let rss_loaded = current_rss_bytes().unwrap_or(0);
    let mut kv = m.new_kv(n_gen + 64);
    let warm = 16.min(n_gen);
    let mut l = m.forward_last(&prompt(&cfg, 8, 1), &mut kv).unwrap();
    for _ in 0..warm {
        let tok = argmax(l.last()) as u32;
        l = m.forward_last(&[tok], &mut kv).unwrap();
    }
    let s0 = m.expert_stats().unwrap();
    // Decode steps fed a fixed pseudo-random token stream: a synthetic model's greedy output
    // repeats one token, which would route identically every step and flatter the cache.
    let stream = prompt(&cfg, n_gen, 99);
    let cpu0 = cpu_seconds();
    let t = Instant::now();
    for &tok in &stream {
        l = m.forward_last(&[tok], &mut kv).unwrap();
    }
    let dt = t.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    std::hint::black_box(&l);
    let s1 = m.expert_stats().unwrap();
    let d = delta(&s0, &s1);
    // The disk again, after the decode: a virtual disk's speed drifts, so the limit uses the
    // median of the runs before and after at each depth (the best depth's).
    read_runs(&g, &ranges, &depths, &mut runs);
    for r in &mut runs {
        r.sort_by(f64::total_cmp);
    }
    let medians: Vec<f64> = runs.iter().map(|r| r[r.len() / 2]).collect();
    let (best_i, &disk_gbs) = medians
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .expect("depths");
    let per_depth: Vec<String> = depths
        .iter()
        .zip(&runs)
        .map(|(qd, r)| {
            format!(
                "QD{qd} {:.3} ({:.3}-{:.3})",
                r[r.len() / 2],
                r[0],
                r[r.len() - 1]
            )
        })
        .collect();
    println!(
        "disk           random expert reads ({:.0} MiB, {} ranges of {:.0} KiB), cold cache {}",
        ranges.iter().map(|r| r.1).sum::<u64>() as f64 / MIB,
        ranges.len(),
        ranges[0].1 as f64 / 1024.0,
        if dropped {
            "(dropped)"
        } else {
            "(NOT dropped: not root?)"
        },
    );
    println!(
        "               store reader ({}), GB/s median (min-max) of 6, 3 before the decode and 3 after: {}",
        if direct {
            "O_DIRECT"
        } else {
            "buffered + fadvise DONTNEED"
        },
        per_depth.join(", ")
    );
    println!(
        "               for comparison: buffered pread {pread_gbs:.3} GB/s (1 thread), {par_gbs:.3} GB/s (4 threads); mmap+WILLNEED {mmap_gbs:.3} GB/s; page-cache-warm pread {warm_gbs:.2} GB/s"
    );
    println!(
        "               disk bandwidth used for the limit: {disk_gbs:.3} GB/s (the best median, at QD{})",
        depths[best_i]
    );
    let tok_s = n_gen as f64 / dt;
    let read_per_tok = d.bytes_read as f64 / n_gen as f64;
    let miss_per_tok = d.miss_bytes_read as f64 / n_gen as f64;
    // Every expert not in memory before a token needed it: misses, and prefetches then used.
    let needed_per_tok =
        (d.miss_bytes_read + d.prefetch_useful * raw_expert_bytes) as f64 / n_gen as f64;
    let bound = disk_gbs * 1e9 / needed_per_tok;
    let peak = peak_rss_bytes().unwrap_or(0);
    println!("stream load    {load_s:.2} s; non-expert weights {:.1} MiB; RSS before load {:.1} MiB, after load {:.1} MiB", dense_bytes as f64 / MIB, rss0 as f64 / MIB, rss_loaded as f64 / MIB);
    println!(
        "stream decode  {tok_s:.2} tok/s ({n_gen} random-token steps after {warm} greedy warm-up; {:.2} ms CPU per token); hit rate {:.1}% ({} hits / {} lookups, {} waited on a prefetch)",
        cpu * 1e3 / n_gen as f64,
        100.0 * d.hit_rate(),
        d.hits,
        d.lookups,
        d.inflight_waits
    );
    println!(
        "prefetch       accuracy {:.1}% (useful {} / issued {}; {} queued and dropped unread, {} predicted already resident); predictor (next layer's router applied early): precision {:.1}%, recall {:.1}%",
        100.0 * d.prefetch_accuracy(),
        d.prefetch_useful,
        d.prefetch_issued,
        d.prefetch_dropped,
        d.prefetch_resident,
        100.0 * d.prediction_precision(),
        100.0 * d.prediction_recall()
    );
    println!(
        "disk traffic   missed-expert bytes {:.2} MiB per token ({:.2} MiB read by misses on the critical path, {:.2} MiB read in all, {} reads); {} of {} misses read through the window, {} late",
        needed_per_tok / MIB,
        miss_per_tok / MIB,
        read_per_tok / MIB,
        if s1.direct_io { "O_DIRECT" } else { "buffered" },
        d.window_reads,
        d.misses,
        d.late_reads
    );
    println!(
        "waiting        {:.1} ms of the {:.1} ms decode ({:.0}%) waited for reads ({:.2} ms per token); building read experts took {:.2} ms per token",
        d.read_wait_us as f64 / 1e3,
        dt * 1e3,
        d.read_wait_us as f64 / 1e4 / dt,
        d.read_wait_us as f64 / 1e3 / n_gen as f64,
        d.build_us as f64 / 1e3 / n_gen as f64
    );
    println!(
        "disk busy      {:.0}% of the decode (a read in progress), {:.2} reads in flight on average then; {:.3} GB/s while busy",
        d.disk_busy_us as f64 / 1e4 / dt,
        d.read_us as f64 / d.disk_busy_us.max(1) as f64,
        d.bytes_read as f64 / (d.disk_busy_us.max(1) as f64 * 1e3)
    );
    println!(
        "disk-bound     {bound:.2} tok/s = {disk_gbs:.3} GB/s / {:.2} MiB per token; streaming reaches {:.0}% of it ({tok_s:.2} tok/s)",
        needed_per_tok / MIB,
        100.0 * tok_s / bound
    );
    println!(
        "memory         peak RSS {:.1} MiB vs budget {:.1} + non-expert weights {:.1} = {:.1} MiB (overhead {:.1} MiB); cache now {} experts {:.1} MiB + pinned {} experts {:.1} MiB",
        peak as f64 / MIB,
        budget as f64 / MIB,
        dense_bytes as f64 / MIB,
        (budget + dense_bytes) as f64 / MIB,
        (peak as f64 - (budget + dense_bytes) as f64) / MIB,
        s1.cached_experts,
        s1.cached_bytes as f64 / MIB,
        s1.pinned_experts,
        s1.pinned_bytes as f64 / MIB
    );
    println!(
        "stats json     {}",
        serde_json::to_string(&s1).unwrap_or_default()
    );
    drop(kv);

    // 3. Batch 1/2/4/8, streamed.
    let steps = 8;
    let mut line = String::from("batch streamed");
    for b in [1, 2, 4, 8] {
        let s_a = m.expert_stats().unwrap();
        let tps = batch_decode(&m, b, steps);
        let dd = delta(&s_a, &m.expert_stats().unwrap());
        line += &format!("  b{b}: {tps:.2} tok/s (hit {:.0}%)", 100.0 * dd.hit_rate());
    }
    println!("{line}");
    drop(m);

    // 4. Batch 1/2/4/8, fully loaded (RSS grows past the budget here).
    if with_full {
        let t = Instant::now();
        let full = Model::load_full(&g, threads).expect("load full");
        println!(
            "full load      {:.2} s; weights {:.1} MiB",
            t.elapsed().as_secs_f64(),
            full.resident_bytes() as f64 / MIB
        );
        // The same decode on the fully loaded model: the compute-bound rate.
        let mut kv = full.new_kv(n_gen + 64);
        let mut l = full.forward_last(&prompt(&cfg, 8, 1), &mut kv).unwrap();
        for _ in 0..warm {
            let tok = argmax(l.last()) as u32;
            l = full.forward_last(&[tok], &mut kv).unwrap();
        }
        let cpu0 = cpu_seconds();
        let t = Instant::now();
        for &tok in &stream {
            l = full.forward_last(&[tok], &mut kv).unwrap();
        }
        std::hint::black_box(&l);
        let compute_tok_s = n_gen as f64 / t.elapsed().as_secs_f64();
        let full_cpu_ms = (cpu_seconds() - cpu0) * 1e3 / n_gen as f64;
        let limit = compute_tok_s.min(bound);
        println!(
            "full decode    {compute_tok_s:.2} tok/s ({full_cpu_ms:.2} ms CPU per token; same steps, all experts in RAM: the compute-bound rate); streaming reaches {:.0}% of it; min(compute, disk-bound) {limit:.2} tok/s, streaming reaches {:.0}% of that",
            100.0 * tok_s / compute_tok_s,
            100.0 * tok_s / limit
        );
        let mut line = String::from("batch full    ");
        for b in [1, 2, 4, 8] {
            let tps = batch_decode(&full, b, steps);
            line += &format!("  b{b}: {tps:.2} tok/s");
        }
        println!("{line}");
    }
}
