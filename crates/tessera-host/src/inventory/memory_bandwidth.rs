//! Memory bandwidth: read and copy tests over one buffer, single-threaded and across all
//! threads.
//!
//! The read test sums the buffer's 64-bit words; the copy test copies its first half onto its
//! second half and counts bytes read plus bytes written (the STREAM convention). The buffer
//! should be well above the last-level cache ([`ProbeOptions::memory_buffer_bytes`]); keeping
//! to one buffer halves the page-faulting set-up time, and filling it before timing keeps page
//! faults out of the timed passes. Each of the four tests keeps the best of up to
//! [`ProbeOptions::memory_reps`] passes within a quarter of the probe time limit.

use std::hint::black_box;
use std::time::{Duration, Instant};

use tessera_model::human_bytes;

use super::{ms, MemoryBandwidth, ProbeOptions};

fn read_words(words: &[u64]) -> u64 {
    // Eight independent accumulators so the adds do not serialise on one register.
    let mut acc = [0u64; 8];
    for c in words.chunks_exact(8) {
        acc[0] = acc[0].wrapping_add(c[0]);
        acc[1] = acc[1].wrapping_add(c[1]);
        acc[2] = acc[2].wrapping_add(c[2]);
        acc[3] = acc[3].wrapping_add(c[3]);
        acc[4] = acc[4].wrapping_add(c[4]);
        acc[5] = acc[5].wrapping_add(c[5]);
        acc[6] = acc[6].wrapping_add(c[6]);
        acc[7] = acc[7].wrapping_add(c[7]);
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

/// Runs `pass` until `reps` passes are done or `limit` has elapsed (at least one pass);
/// returns the best rate, bytes per pass / seconds, and the passes run.
fn best_rate(
    reps: u32,
    limit: Duration,
    bytes_per_pass: f64,
    mut pass: impl FnMut(),
) -> (f64, u32) {
    let start = Instant::now();
    let mut best = 0.0f64;
    let mut done = 0;
    while done < reps.max(1) {
        let t = Instant::now();
        pass();
        let secs = t.elapsed().as_secs_f64().max(1e-9);
        best = best.max(bytes_per_pass / secs);
        done += 1;
        if start.elapsed() >= limit {
            break;
        }
    }
    (best, done)
}

pub(super) fn probe_memory_bandwidth(
    opts: &ProbeOptions,
    threads: usize,
) -> Result<MemoryBandwidth, String> {
    let started = Instant::now();
    // One buffer: the read test sums all of it; the copy test copies its first half onto its
    // second half. Keeping the footprint to one buffer halves the page-faulting set-up time.
    let words = (opts.memory_buffer_bytes / 8).max(1 << 11) / 16 * 16;
    let bytes = (words * 8) as f64;
    // Filling with a non-zero value touches every page now, so page faults stay out of the
    // timed passes.
    let mut buf = Vec::new();
    buf.try_reserve_exact(words)
        .map_err(|e| format!("could not allocate {}: {e}", human_bytes(bytes as u64)))?;
    buf.resize(words, 0x0123_4567_89ab_cdefu64);

    let limit = opts.probe_time_limit / 4;
    let reps = opts.memory_reps;
    let half = words / 2;
    let per_thread_copy = half.div_ceil(threads).div_ceil(8) * 8;
    let per_thread_read = words.div_ceil(threads).div_ceil(8) * 8;

    let (copy1, p1) = best_rate(reps, limit, bytes, || {
        let (src, dst) = buf.split_at_mut(half);
        dst.copy_from_slice(src);
        black_box(dst);
    });
    let (read1, p2) = best_rate(reps, limit, bytes, || {
        black_box(read_words(black_box(&buf)));
    });
    let (copy_n, p3) = best_rate(reps, limit, bytes, || {
        let (src, dst) = buf.split_at_mut(half);
        std::thread::scope(|s| {
            for (d, sv) in dst
                .chunks_mut(per_thread_copy)
                .zip(src.chunks(per_thread_copy))
            {
                s.spawn(move || {
                    d.copy_from_slice(sv);
                    black_box(d);
                });
            }
        });
    });
    let (read_n, p4) = best_rate(reps, limit, bytes, || {
        std::thread::scope(|s| {
            for sv in buf.chunks(per_thread_read) {
                s.spawn(move || black_box(read_words(black_box(sv))));
            }
        });
    });

    Ok(MemoryBandwidth {
        copy_single_thread: copy1,
        read_single_thread: read1,
        copy_all_threads: copy_n,
        read_all_threads: read_n,
        threads,
        buffer_bytes: bytes as u64,
        passes: p1.min(p2).min(p3).min(p4),
        method: format!(
            "best of up to {reps} passes over a {} buffer: read = sum of its 64-bit words; copy = \
             copy_from_slice of its first half onto its second, counted as bytes read + written \
             (STREAM convention); all-threads tests split the work across {threads} threads",
            human_bytes(bytes as u64)
        ),
        duration_ms: ms(started.elapsed()),
    })
}
