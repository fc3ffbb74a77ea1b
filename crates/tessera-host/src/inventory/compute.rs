//! Compute: the built-in f32 FMA loop.
//!
//! Used when the caller supplies no compute probe of its own
//! ([`ProbeOptions::compute_probe`](super::ProbeOptions::compute_probe)).
//! With AVX2 and FMA detected at runtime it runs `vfmadd` on 8-lane f32 vectors with ten
//! independent accumulators (enough to cover the FMA latency); otherwise a portable f32
//! multiply then add. Single-threaded, then on every thread, each for about half the probe
//! time limit. The figure is labelled [`FALLBACK_COMPUTE_SOURCE`]: an estimate of peak f32
//! arithmetic, an upper bound on what real kernels reach, not a measure of the engine's
//! quantized kernels.

use std::hint::black_box;
use std::time::{Duration, Instant};

use super::{ComputeRate, FALLBACK_COMPUTE_SOURCE};

/// Iterations per timed block of the FMA kernels.
const FMA_BLOCK_ITERS: u64 = 50_000;

/// One block of the kernel; returns (flops done, a value to keep the work observable).
type FmaKernel = fn(u64) -> (f64, f32);

fn fma_block_portable(iters: u64) -> (f64, f32) {
    let mut acc = [1.0f32; 16];
    let (m, a) = (black_box(0.999_999f32), black_box(1e-6f32));
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = *x * m + a;
        }
    }
    (iters as f64 * 16.0 * 2.0, acc.iter().sum())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,avx2,fma")]
#[allow(unused_unsafe)]
unsafe fn fma_block_avx2_inner(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: the caller checked that the CPU has AVX2 and FMA.
    unsafe {
        let m = _mm256_set1_ps(black_box(0.999_999));
        let a = _mm256_set1_ps(black_box(1e-6));
        // Ten independent accumulators cover the FMA latency (4 cycles) on two ports.
        let (mut x0, mut x1, mut x2, mut x3, mut x4) = (m, m, m, m, m);
        let (mut x5, mut x6, mut x7, mut x8, mut x9) = (m, m, m, m, m);
        for _ in 0..iters {
            x0 = _mm256_fmadd_ps(x0, m, a);
            x1 = _mm256_fmadd_ps(x1, m, a);
            x2 = _mm256_fmadd_ps(x2, m, a);
            x3 = _mm256_fmadd_ps(x3, m, a);
            x4 = _mm256_fmadd_ps(x4, m, a);
            x5 = _mm256_fmadd_ps(x5, m, a);
            x6 = _mm256_fmadd_ps(x6, m, a);
            x7 = _mm256_fmadd_ps(x7, m, a);
            x8 = _mm256_fmadd_ps(x8, m, a);
            x9 = _mm256_fmadd_ps(x9, m, a);
        }
        let s = _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)),
            _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(x4, x5), _mm256_add_ps(x6, x7)),
                _mm256_add_ps(x8, x9),
            ),
        );
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }
}

#[cfg(target_arch = "x86_64")]
fn fma_block_avx2(iters: u64) -> (f64, f32) {
    // SAFETY: only selected by `fma_kernel` after runtime detection of AVX2 and FMA.
    let v = unsafe { fma_block_avx2_inner(iters) };
    (iters as f64 * 10.0 * 8.0 * 2.0, v)
}

fn fma_kernel() -> (FmaKernel, &'static str) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return (
            fma_block_avx2,
            "AVX2 FMA (vfmadd on 8-lane f32 vectors, 10 independent accumulators)",
        );
    }
    (
        fma_block_portable,
        "portable f32 multiply then add (not fused; vectorised only if the compiler manages)",
    )
}

/// Runs the kernel for about `time`; returns (flops, elapsed).
fn fma_run(kernel: FmaKernel, time: Duration) -> (f64, Duration) {
    let start = Instant::now();
    let mut flops = 0.0;
    loop {
        let (f, v) = kernel(black_box(FMA_BLOCK_ITERS));
        black_box(v);
        flops += f;
        if start.elapsed() >= time {
            return (flops, start.elapsed());
        }
    }
}

pub(super) fn fma_loop_rate(threads: usize, limit: Duration) -> ComputeRate {
    let (kernel, how) = fma_kernel();
    let each = (limit / 2).max(Duration::from_millis(5));
    let (f1, t1) = fma_run(kernel, each);
    let single = f1 / t1.as_secs_f64().max(1e-9);
    let start = Instant::now();
    let total: f64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| s.spawn(move || fma_run(kernel, each).0))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    });
    let all = total / start.elapsed().as_secs_f64().max(1e-9);
    ComputeRate {
        ops_per_s: all,
        single_thread_ops_per_s: Some(single),
        threads,
        source: FALLBACK_COMPUTE_SOURCE.into(),
        detail: format!(
            "{how}; {} ms per test; an estimate of peak f32 arithmetic, not of the engine's \
             quantized kernels",
            each.as_millis()
        ),
    }
}
