//! F32/F16/BF16 weights on the column-interleaved layout (`matrix.rs`): one load holds one
//! column of 4 of a group's 16 rows, multiplied by a broadcast activation, so each lane of an
//! accumulator is one row and each accumulator one of `scalar::float_row`'s lanes (same
//! columns, same fused steps, same combining tree). Results equal the scalar kernel's bit for
//! bit. One kernel per type serves both aarch64 paths (no integer dot products here).

use std::arch::aarch64::*;

use super::super::matrix::{float_column, GROUP};
use super::super::quant_acts::QuantizedActs;
use super::super::scalar::{FLOAT_BF16, FLOAT_F16, FLOAT_F32};
use super::f16x4;

const fn esize(k: u8) -> usize {
    if k == FLOAT_F32 {
        4
    } else {
        2
    }
}

/// The weights of rows `4q..4q+4` of the column stored `e`-th (`matrix::float_column`).
#[inline(always)]
unsafe fn load4<const K: u8>(w: *const u8, e: usize, q: usize) -> float32x4_t {
    // SAFETY: the caller guarantees column e is in bounds.
    unsafe {
        let p = w.add((e * GROUP + 4 * q) * esize(K));
        match K {
            FLOAT_F32 => vreinterpretq_f32_u8(vld1q_u8(p)),
            FLOAT_F16 => f16x4(p),
            // bf16 is the top half of an f32.
            _ => vreinterpretq_f32_u32(vshll_n_u16::<16>(vreinterpret_u16_u8(vld1_u8(p)))),
        }
    }
}

/// 16 lane accumulators over columns `base + off + (0..16 or 0..32)` for `base` stepping by
/// `period` up to `end`: one column per lane, or for BF16 one pair per lane, odd first.
#[inline(always)]
unsafe fn pass<const K: u8>(
    w: *const u8,
    x: *const f32,
    q: usize,
    end: usize,
    period: usize,
    off: usize,
) -> [float32x4_t; 16] {
    // SAFETY: columns below `end` are in bounds (caller).
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 16];
        // `end` is the group's columns in whole 64s: where `float_column` stores each.
        let mut fma = |e: usize, l: usize| {
            let at = float_column(K, e, end);
            acc[l] = vfmaq_n_f32(acc[l], load4::<K>(w, at, q), *x.add(e));
        };
        let mut base = 0;
        while base + period <= end {
            for l in 0..16 {
                if K == FLOAT_BF16 {
                    fma(base + off + 2 * l + 1, l);
                    fma(base + off + 2 * l, l);
                } else {
                    fma(base + off + l, l);
                }
            }
            base += period;
        }
        acc
    }
}

/// `scalar::reduce16`'s tree, lane-wise.
#[inline(always)]
fn reduce(a: &[float32x4_t; 16]) -> float32x4_t {
    // SAFETY: register-only arithmetic.
    unsafe {
        let s8: [float32x4_t; 8] = std::array::from_fn(|i| vaddq_f32(a[i], a[i + 8]));
        let s4: [float32x4_t; 4] = std::array::from_fn(|i| vaddq_f32(s8[i], s8[i + 4]));
        vaddq_f32(vaddq_f32(s4[0], s4[2]), vaddq_f32(s4[1], s4[3]))
    }
}

/// One token: the 16 rows of the group, four at a time, as `scalar::float_row`.
#[inline(always)]
unsafe fn token<const K: u8>(w: *const u8, x: &[f32], out: &mut [f32]) {
    let n = x.len();
    let xp = x.as_ptr();
    // Weight `e` of row `r`, for the scalar remainders.
    let wr = |e: usize, r: usize| -> f32 {
        // SAFETY: e < n and r < 16 lie inside the group.
        unsafe {
            let p = w.add((e * GROUP + r) * esize(K));
            match K {
                FLOAT_F32 => (p as *const f32).read_unaligned(),
                FLOAT_F16 => half::f16::from_bits((p as *const u16).read_unaligned()).to_f32(),
                _ => f32::from_bits(((p as *const u16).read_unaligned() as u32) << 16),
            }
        }
    };
    let np = n / 64 * 64;
    // SAFETY: the caller checked the group holds n columns.
    unsafe {
        for q in 0..4 {
            let o = &mut out[4 * q..4 * q + 4];
            if K == FLOAT_BF16 {
                let c0 = reduce(&pass::<K>(w, xp, q, np, 64, 0));
                let c1 = reduce(&pass::<K>(w, xp, q, np, 64, 32));
                let (mut s0, mut s1) = ([0f32; 4], [0f32; 4]);
                vst1q_f32(s0.as_mut_ptr(), c0);
                vst1q_f32(s1.as_mut_ptr(), c1);
                for (i, o) in o.iter_mut().enumerate() {
                    let mut s = s0[i] as f64 + s1[i] as f64;
                    for (e, &xe) in x.iter().enumerate().skip(np) {
                        s += (wr(e, 4 * q + i) * xe) as f64;
                    }
                    *o = s as f32;
                }
                continue;
            }
            let v: [float32x4_t; 16] = if K == FLOAT_F32 {
                let a: [[float32x4_t; 16]; 4] =
                    std::array::from_fn(|g| pass::<K>(w, xp, q, np, 64, 16 * g));
                std::array::from_fn(|i| {
                    vaddq_f32(vaddq_f32(a[0][i], a[2][i]), vaddq_f32(a[1][i], a[3][i]))
                })
            } else {
                pass::<K>(w, xp, q, np, 16, 0)
            };
            vst1q_f32(o.as_mut_ptr(), reduce(&v));
            for (i, o) in o.iter_mut().enumerate() {
                let r = 4 * q + i;
                if K == FLOAT_F32 {
                    // `ggml_vec_dot_f32` keeps its sum in f32 (the remainder fused).
                    for (e, &xe) in x.iter().enumerate().skip(np) {
                        *o = wr(e, r).mul_add(xe, *o);
                    }
                } else if np < n {
                    let mut s = *o as f64;
                    for (e, &xe) in x.iter().enumerate().skip(np) {
                        s += (wr(e, r) * xe) as f64;
                    }
                    *o = s as f32;
                }
            }
        }
    }
}

#[inline(always)]
fn group<const K: u8>(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let n = a.cols;
    assert!(w.len() >= n * GROUP * esize(K));
    assert!((t0 + nt) * n <= a.f.len() && out.len() >= nt * GROUP);
    for j in 0..nt {
        let x = &a.f[(t0 + j) * n..(t0 + j + 1) * n];
        // SAFETY: the group holds n columns (checked above).
        unsafe { token::<K>(w.as_ptr(), x, &mut out[j * GROUP..(j + 1) * GROUP]) }
    }
}

/// # Safety
/// None beyond the slices' own: NEON is part of every aarch64 target.
pub(super) unsafe fn f32_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    group::<FLOAT_F32>(w, a, t0, nt, out)
}

/// # Safety
/// None beyond the slices' own: NEON is part of every aarch64 target.
pub(super) unsafe fn f16_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    group::<FLOAT_F16>(w, a, t0, nt, out)
}

/// # Safety
/// None beyond the slices' own: NEON is part of every aarch64 target.
pub(super) unsafe fn bf16_group(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    group::<FLOAT_BF16>(w, a, t0, nt, out)
}
