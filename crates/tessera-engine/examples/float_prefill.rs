//! Prefill GFLOP/s of the float kernels on one layer of the dense bench geometry (hidden 1024,
//! q 2048, kv 1024, FFN 3072), timed by the process's CPU clock so that other processes on
//! the cores inflate it less than a wall clock would.
//!
//! `cargo run --release -p tessera-engine --example float_prefill [-- DTYPE TOKENS THREADS
//! ROUNDS [ROWS COLS | layers N]]` (DTYPE f16, bf16 or f32; set `TESSERA_MAX_ISA=avx2` to cap
//! the path): one layer; or 16 matrices of one shape; or N layers of distinct weights, which
//! with 1 token streams them from memory as decode does.

mod support;

use std::hint::black_box;

use tessera_engine::kernels::{isa, matmul, Matrix, MatrixBytes, ThreadPool};
use tessera_model::GgmlType;

fn cpu_secs() -> f64 {
    support::cpu_seconds(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dtype = match args.first().map(String::as_str) {
        Some("bf16") | Some("BF16") => GgmlType::BF16,
        Some("f32") | Some("F32") => GgmlType::F32,
        _ => GgmlType::F16,
    };
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (nt, threads, rounds) = (arg(1, 512), arg(2, 1), arg(3, 5));
    let pool = ThreadPool::new(threads);
    let layer = [
        (2048, 1024),
        (1024, 1024),
        (1024, 1024),
        (1024, 2048),
        (3072, 1024),
        (3072, 1024),
        (1024, 3072),
    ];
    // One shape (ROWS COLS after the others), to time a kernel on data that stays in cache.
    // Or `layers N`: N layers of distinct weights, to stream more than the caches hold (decode).
    let shapes: Vec<(usize, usize)> = match (args.get(4).map(String::as_str), args.get(5)) {
        (Some("layers"), Some(_)) => layer.repeat(arg(5, 16)),
        (Some(_), Some(_)) => vec![(arg(4, 16), arg(5, 1024)); 16],
        _ => layer.to_vec(),
    };
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mats: Vec<Matrix> = shapes
        .iter()
        .map(|&(r, c)| {
            let es = if dtype == GgmlType::F32 { 4 } else { 2 };
            let b: Vec<u8> = (0..r * c * es / 2)
                .flat_map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    // Small finite values in any of the three encodings.
                    let v = half::f16::from_f32(((seed % 2001) as f32 - 1000.0) / 16000.0);
                    match dtype {
                        GgmlType::BF16 => half::bf16::from_f32(v.to_f32()).to_le_bytes(),
                        _ => v.to_le_bytes(),
                    }
                })
                .collect();
            let b = if dtype == GgmlType::F32 {
                b.chunks(2)
                    .flat_map(|h| {
                        half::f16::from_le_bytes([h[0], h[1]])
                            .to_f32()
                            .to_le_bytes()
                    })
                    .collect()
            } else {
                b
            };
            let b = if dtype == GgmlType::F32 {
                b[..r * c * 4].to_vec()
            } else {
                b
            };
            Matrix::new(dtype, r, c, MatrixBytes::Owned(b)).unwrap()
        })
        .collect();
    let flops: f64 = shapes.iter().map(|&(r, c)| 2.0 * (r * c * nt) as f64).sum();
    let xs: Vec<Vec<f32>> = [1024, 2048, 3072]
        .iter()
        .map(|&c| {
            (0..nt * c)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
                .collect()
        })
        .collect();
    let mut out = vec![0f32; nt * 3072];
    println!("{dtype} on {:?}, {nt} tokens, {threads} threads", isa());
    let mut best = 0f64;
    for _ in 0..rounds {
        let (c0, w0) = (cpu_secs(), std::time::Instant::now());
        for m in &mats {
            let x = xs.iter().find(|x| x.len() == nt * m.cols()).unwrap();
            matmul(&pool, m, x, nt, &mut out[..nt * m.rows()]);
        }
        black_box(&out);
        let (cpu, wall) = (cpu_secs() - c0, w0.elapsed().as_secs_f64());
        let g = flops / cpu * threads as f64 / 1e9;
        best = best.max(g);
        println!(
            "  cpu {:.1} ms wall {:.1} ms: {:.1} GFLOP/s per thread (cpu), {:.1} total (wall)",
            cpu * 1e3,
            wall * 1e3,
            g / threads as f64,
            flops / wall / 1e9
        );
    }
    println!(
        "best {:.1} GFLOP/s per thread (cpu clock)",
        best / threads as f64
    );
}
