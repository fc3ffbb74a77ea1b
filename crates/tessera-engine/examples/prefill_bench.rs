//! Quantized prefill kernels on one thread, timed by the thread's CPU clock: GFLOP/s per dtype
//! for the matmul shapes of the bench models' prefill (a dense layer's 512 tokens, an MoE
//! expert's ~64) and a decode step.
//!
//! `cargo run --release -p tessera-engine --example prefill_bench [-- DTYPE...]` (set
//! `TESSERA_MAX_ISA=avx2` to cap the path). The CPU clock of the calling thread (a 1-thread pool
//! runs its tasks on the caller) does not count the time other processes hold the core, so on a
//! shared machine two builds can be compared by alternating runs of this bench; the weights of
//! each shape fit the caches, as an expert's do. Times are the fastest of repeated calls.

mod support;

use support::{random_bytes, Rng};

use std::hint::black_box;

use tessera_engine::kernels::{isa, matmul, Matrix, MatrixBytes, ThreadPool};
use tessera_model::GgmlType;

const DTYPES: [GgmlType; 5] = [
    GgmlType::Q6K,
    GgmlType::Q5K,
    GgmlType::Q4K,
    GgmlType::Iq4Xs,
    GgmlType::Q4_1,
];

/// (rows, cols, tokens): dense FFN up and down at 512 tokens, an MoE expert's gate/up and down
/// at 64, and a decode step.
const SHAPES: [(usize, usize, usize); 5] = [
    (3072, 1024, 512),
    (1024, 3072, 512),
    (512, 1024, 64),
    (1024, 512, 64),
    (3072, 1024, 1),
];

/// CPU seconds the calling thread has used.
fn thread_cpu() -> f64 {
    support::cpu_seconds(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn main() {
    let only: Vec<String> = std::env::args().skip(1).collect();
    let pool = ThreadPool::new(1);
    println!(
        "kernel ISA: {:?} (1 thread, GFLOP/s by thread CPU time)",
        isa()
    );
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for dtype in DTYPES {
        let name = dtype.to_string();
        if !only.is_empty() && !only.iter().any(|s| s.eq_ignore_ascii_case(&name)) {
            continue;
        }
        let mut line = format!("{name:<7}");
        for (rows, cols, n_tok) in SHAPES {
            let b = random_bytes(dtype, rows, cols, &mut rng);
            let m = Matrix::new(dtype, rows, cols, MatrixBytes::Owned(b)).unwrap();
            let x: Vec<f32> = (0..n_tok * cols)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
                .collect();
            let mut out = vec![0f32; n_tok * rows];
            let flop = 2.0 * (rows * cols * n_tok) as f64;
            // About 0.4 CPU seconds per shape, the fastest call counted.
            let reps = ((2e10 / flop) as usize).clamp(5, 20_000);
            let mut best = f64::INFINITY;
            for _ in 0..reps {
                let t = thread_cpu();
                matmul(&pool, &m, &x, n_tok, &mut out);
                best = best.min(thread_cpu() - t);
                black_box(&out);
            }
            line += &format!("  {rows}x{cols}x{n_tok} {:6.1}", flop / best / 1e9);
        }
        println!("{line}");
    }
}
