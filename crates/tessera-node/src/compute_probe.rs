//! The node's compute probe: a short run of the engine's own Q8_0 matmul, so the measured rate
//! is that of the kernel that will actually run the model.

use std::time::{Duration, Instant};

use tessera_engine::kernels::{matmul, Matrix, MatrixBytes, ThreadPool};
use tessera_model::GgmlType;

use crate::inventory::ComputeRate;

const ROWS: usize = 1024;
const COLS: usize = 1024;
const TOKENS: usize = 8;
const BUDGET: Duration = Duration::from_millis(150);

fn rate(threads: usize) -> f64 {
    // Q8_0: 32 weights per 34-byte block (f16 scale + 32 i8). A constant pattern is enough.
    let blocks = ROWS * COLS / 32;
    let mut bytes = Vec::with_capacity(blocks * 34);
    for b in 0..blocks {
        bytes.extend_from_slice(&half_one());
        bytes.extend((0..32).map(|i| ((i * 7 + b) % 255) as u8));
    }
    let Ok(w) = Matrix::new(GgmlType::Q8_0, ROWS, COLS, MatrixBytes::Owned(bytes)) else {
        return 0.0;
    };
    let pool = ThreadPool::new(threads);
    let x: Vec<f32> = (0..TOKENS * COLS).map(|i| (i % 13) as f32 * 0.1).collect();
    let mut out = vec![0.0f32; TOKENS * ROWS];
    matmul(&pool, &w, &x, TOKENS, &mut out); // warm-up
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed() < BUDGET || n < 2 {
        matmul(&pool, &w, &x, TOKENS, &mut out);
        n += 1;
    }
    (2 * ROWS * COLS * TOKENS) as f64 * n as f64 / t.elapsed().as_secs_f64()
}

fn half_one() -> [u8; 2] {
    // f16 1.0 = 0x3C00, little-endian.
    [0x00, 0x3C]
}

/// Measures the engine's Q8_0 matmul rate on all cores and on one (multiply-adds counted as 2
/// operations).
pub fn engine_matmul_rate() -> ComputeRate {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let all = rate(threads);
    let single = if threads > 1 {
        Some(rate(1))
    } else {
        Some(all)
    };
    ComputeRate {
        ops_per_s: all,
        single_thread_ops_per_s: single,
        threads,
        source: "engine q8_0 matmul".into(),
        detail: format!(
            "{ROWS}x{COLS} Q8_0 weights x {TOKENS} tokens, ~{} ms",
            BUDGET.as_millis()
        ),
    }
}
