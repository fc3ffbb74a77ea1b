//! Kernel tests, and the helpers they share (random valid matrices of every type, ggml's Q4_0
//! and Q8_0 encoders, the matmul under test): every type against ggml's arithmetic
//! ([`reference`]), the same bits whatever runs beside a token ([`batches`]), `Matrix`
//! construction ([`construction`]), and the choice of instruction set ([`isa`]).

use std::sync::Arc;

use half::{bf16, f16};
use tessera_model::GgmlType;

use super::matmul::matmul_rows_isa;
use super::*;

mod batches;
mod construction;
mod isa;
mod reference;

pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(crate) fn byte(&mut self) -> u8 {
        (self.next_u64() >> 32) as u8
    }
    /// Uniform in [-1, 1).
    pub(crate) fn f(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn push_f16(v: &mut Vec<u8>, x: f32) {
    v.extend_from_slice(&f16::from_f32(x).to_le_bytes());
}

/// Random but valid GGML bytes for a `rows` × `cols` matrix.
pub(crate) fn random_matrix(dtype: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let nblocks = rows * cols / dtype.block_size();
    let mut v = Vec::with_capacity(nblocks * dtype.block_bytes());
    for _ in 0..nblocks {
        match dtype {
            GgmlType::F32 => v.extend_from_slice(&rng.f().to_le_bytes()),
            GgmlType::F16 => push_f16(&mut v, rng.f()),
            GgmlType::BF16 => v.extend_from_slice(&bf16::from_f32(rng.f()).to_le_bytes()),
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
                push_f16(&mut v, rng.f() * 0.05);
                for _ in 0..dtype.block_bytes() - 2 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                push_f16(&mut v, rng.f().abs() * 0.05);
                push_f16(&mut v, rng.f() * 0.5);
                for _ in 0..dtype.block_bytes() - 4 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                push_f16(&mut v, rng.f().abs() * 0.01);
                push_f16(&mut v, rng.f().abs() * 0.01);
                for _ in 0..dtype.block_bytes() - 4 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Q2K => {
                for _ in 0..80 {
                    v.push(rng.byte());
                }
                push_f16(&mut v, rng.f().abs() * 0.01);
                push_f16(&mut v, rng.f().abs() * 0.01);
            }
            GgmlType::Q3K => {
                for _ in 0..108 {
                    v.push(rng.byte());
                }
                push_f16(&mut v, rng.f() * 0.001);
            }
            GgmlType::Iq4Xs => {
                push_f16(&mut v, rng.f() * 0.0005);
                for _ in 0..134 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Iq2Xxs
            | GgmlType::Iq2Xs
            | GgmlType::Iq2S
            | GgmlType::Iq3Xxs
            | GgmlType::Iq3S => {
                push_f16(&mut v, rng.f() * 0.001);
                for _ in 0..dtype.block_bytes() - 2 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Iq4Nl => {
                push_f16(&mut v, rng.f() * 0.002);
                for _ in 0..16 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Mxfp4 => {
                v.push(118 + rng.byte() % 8);
                for _ in 0..16 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Q6K => {
                for _ in 0..208 {
                    v.push(rng.byte());
                }
                push_f16(&mut v, rng.f() * 0.001);
            }
        }
    }
    v
}

/// ggml's reference Q4_0 encoder (test helper): d = max/-8 of the signed value of largest
/// magnitude, q = min(15, trunc(x/d + 8.5)).
pub(crate) fn quantize_q4_0(x: &[f32]) -> Vec<u8> {
    let mut v = Vec::new();
    for xb in x.chunks_exact(32) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &e in xb {
            if e.abs() > amax {
                amax = e.abs();
                max = e;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        push_f16(&mut v, d);
        let q = |e: f32| ((e * id + 8.5) as i32).min(15) as u8;
        for j in 0..16 {
            v.push(q(xb[j]) | (q(xb[j + 16]) << 4));
        }
    }
    v
}

/// ggml's reference Q8_0 encoder (test helper).
pub(crate) fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut v = Vec::new();
    for xb in x.chunks_exact(32) {
        let amax = xb.iter().fold(0f32, |m, e| m.max(e.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        push_f16(&mut v, d);
        v.extend(xb.iter().map(|&e| (e * id).round() as i8 as u8));
    }
    v
}

const ALL: [GgmlType; 21] = [
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::Iq2Xxs,
    GgmlType::Iq2Xs,
    GgmlType::Iq2S,
    GgmlType::Iq3Xxs,
    GgmlType::Iq3S,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Iq4Xs,
    GgmlType::Iq4Nl,
    GgmlType::Mxfp4,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

fn isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.available()).collect()
}

fn cols_for(dtype: GgmlType) -> usize {
    match dtype {
        GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::Q8_0
        | GgmlType::Mxfp4
        | GgmlType::Iq4Nl => 320,
        GgmlType::Q4K
        | GgmlType::Q5K
        | GgmlType::Q6K
        | GgmlType::Iq4Xs
        | GgmlType::Q2K
        | GgmlType::Q3K
        | GgmlType::Iq2Xxs
        | GgmlType::Iq2Xs
        | GgmlType::Iq2S
        | GgmlType::Iq3Xxs
        | GgmlType::Iq3S => 512,
        // Lanes of 17 columns (the AVX2 prefill passes walk one lane at a time), with a
        // float tail.
        _ => 1100,
    }
}

/// Row `r` of the dequantized weights `wf` dotted with token `t` of the dequantized activations
/// `xa` (both `cols` wide) in f64, and the sum of the products' magnitudes (the scale of the
/// rounding a kernel's f32 sum may add).
fn exact_dot(wf: &[f32], xa: &[f32], cols: usize, r: usize, t: usize) -> (f64, f64) {
    let (mut exact, mut mag) = (0f64, 0f64);
    for c in 0..cols {
        let p = wf[r * cols + c] as f64 * xa[t * cols + c] as f64;
        exact += p;
        mag += p.abs();
    }
    (exact, mag)
}

fn random_x(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| rng.f() * 2.0).collect()
}

fn run(
    isa: Isa,
    pool: &ThreadPool,
    w: &Matrix,
    r: (usize, usize),
    x: &[f32],
    nt: usize,
) -> Vec<f32> {
    let acts = QuantizedActs::new(pool, w.dtype(), x, nt, w.cols());
    let mut out = vec![f32::NAN; nt * (r.1 - r.0)];
    matmul_rows_isa(isa, pool, w, r.0, r.1, &acts, &mut out);
    out
}
