//! Expert streaming benchmark (not a test: it times things and drops the page cache).
//!
//! `cargo run --release -p tessera-engine --example expert_stream_bench -- \
//!     [MODEL.gguf] [budget_MiB] [threads] [n_gen] [no-full]`
//!
//! Measures, on this machine: the disk read bandwidth of the expert pattern (positioned reads of
//! random experts' byte ranges after dropping the page cache, vs. the same through mmap +
//! madvise), streamed decode at batch 1 (tokens/s, hit rate, prefetch accuracy, bytes read per
//! token, peak RSS) against the disk-bound limit, and batch 1/2/4/8 decode with and without
//! streaming. Dropping the page cache needs root (`/proc/sys/vm/drop_caches`); without it the
//! figures say so.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use tessera_engine::bench::{current_rss_bytes, peak_rss_bytes};
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
        prefetch_issued: b.prefetch_issued - a.prefetch_issued,
        prefetch_useful: b.prefetch_useful - a.prefetch_useful,
        prefetch_resident: b.prefetch_resident - a.prefetch_resident,
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
    let n_gen = arg(4, 48);
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

    // 1. Disk bandwidth of the expert read pattern, pread vs mmap, cold cache each time.
    let ranges = expert_ranges(&g, &cfg, 160);
    let dropped = drop_caches();
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
    let disk_gbs = pread_gbs;
    println!(
        "disk           random expert reads ({:.0} MiB, {} ranges of {:.0} KiB), cold cache {}: pread {:.3} GB/s (1 thread), {:.3} GB/s (4 threads); mmap+WILLNEED {:.3} GB/s; page-cache-warm pread {:.2} GB/s",
        ranges.iter().map(|r| r.1).sum::<u64>() as f64 / MIB,
        ranges.len(),
        ranges[0].1 as f64 / 1024.0,
        if dropped { "(dropped)" } else { "(NOT dropped: not root?)" },
        pread_gbs,
        par_gbs,
        mmap_gbs,
        warm_gbs
    );

    // 2. Streamed decode at batch 1.
    drop_caches();
    reset_peak_rss();
    let rss0 = current_rss_bytes().unwrap_or(0);
    let t = Instant::now();
    let m = Model::load_streaming(
        &g,
        LoadSpec::full(&cfg),
        ExpertStreaming::with_budget(budget),
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
    let t = Instant::now();
    for &tok in &stream {
        l = m.forward_last(&[tok], &mut kv).unwrap();
    }
    let dt = t.elapsed().as_secs_f64();
    std::hint::black_box(&l);
    let s1 = m.expert_stats().unwrap();
    let d = delta(&s0, &s1);
    let tok_s = n_gen as f64 / dt;
    let read_per_tok = d.bytes_read as f64 / n_gen as f64;
    let miss_per_tok = d.miss_bytes_read as f64 / n_gen as f64;
    let needed_per_tok = ((d.misses + d.prefetch_useful) * s1.expert_bytes) as f64 / n_gen as f64;
    let bound = disk_gbs * 1e9 / read_per_tok;
    let bound_needed = disk_gbs * 1e9 / needed_per_tok;
    let peak = peak_rss_bytes().unwrap_or(0);
    println!("stream load    {load_s:.2} s; non-expert weights {:.1} MiB; RSS before load {:.1} MiB, after load {:.1} MiB", dense_bytes as f64 / MIB, rss0 as f64 / MIB, rss_loaded as f64 / MIB);
    println!(
        "stream decode  {tok_s:.2} tok/s ({n_gen} random-token steps after {warm} greedy warm-up); hit rate {:.1}% ({} hits / {} lookups, {} waited on a prefetch)",
        100.0 * d.hit_rate(),
        d.hits,
        d.lookups,
        d.inflight_waits
    );
    println!(
        "prefetch       issued {} useful {} ({:.1}% accuracy); predictor (next layer's router applied early): precision {:.1}%, recall {:.1}%",
        d.prefetch_issued,
        d.prefetch_useful,
        100.0 * d.prefetch_accuracy(),
        100.0 * d.prediction_precision(),
        100.0 * d.prediction_recall()
    );
    println!(
        "disk traffic   {:.1} MiB read per token ({:.1} MiB by misses on the critical path); disk-bound limit {:.2} tok/s at {:.2} GB/s; achieved {:.0}% of it",
        read_per_tok / MIB,
        miss_per_tok / MIB,
        bound,
        disk_gbs,
        100.0 * tok_s / bound
    );
    println!(
        "               missed experts (misses + useful prefetches) {:.1} MiB per token: disk-bound limit {:.2} tok/s; achieved {:.0}% of it",
        needed_per_tok / MIB,
        bound_needed,
        100.0 * tok_s / bound_needed
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
        let t = Instant::now();
        for &tok in &stream {
            l = full.forward_last(&[tok], &mut kv).unwrap();
        }
        std::hint::black_box(&l);
        let compute_tok_s = n_gen as f64 / t.elapsed().as_secs_f64();
        let limit = compute_tok_s.min(bound_needed);
        println!(
            "full decode    {compute_tok_s:.2} tok/s (same steps, all experts in RAM): streaming reaches {:.0}% of it; limit min(compute, disk-bound) {limit:.2} tok/s, streaming reaches {:.0}% of that",
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
