//! NEON kernels for Q4_0, Q8_0 and the widened Q4_1/Q5_1 (layouts in `matrix.rs`, numerical
//! contract in `scalar::q4_0_group`, `scalar::q8_0_group` and `scalar::q1_group`).

use std::arch::aarch64::*;

use super::super::matrix::{GROUP, Q1_MIN, Q1_QS, Q1_X16};
use super::super::quant_acts::QuantizedActs;
use super::{dot4, f16x4, lanes_sum, neon_and_dotprod, yword};

/// Checks the bounds every group kernel relies on (`bb`: bytes per row and block).
fn check_group(w: &[u8], bb: usize, a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 32;
    assert!(w.len() >= nb * GROUP * bb);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * nb <= a.sums.len());
    assert!((t0 + nt) * nb <= a.f.len() && out.len() >= nt * GROUP);
}

neon_and_dotprod!(
    /// Q4_0 interleaved group × `nt` tokens.
    q4_0_neon,
    q4_0_dotprod,
    q4_0_group
);

#[inline(always)]
unsafe fn q4_0_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(w, 18, a, t0, nt, out);
    let nb = a.cols / 32;
    // SAFETY: bounds checked above; `dot4::<true>` only in the dotprod entry.
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        for j in 0..nt {
            let t = t0 + j;
            let mut acc = [vdupq_n_f32(0.0); 4];
            for b in 0..nb {
                let blk = w.as_ptr().add(b * GROUP * 18);
                let y = a.qs.as_ptr().add(t * a.cols + b * 32);
                let idx = t * nb + b;
                let dy = *a.f.get_unchecked(idx);
                let ysum8 = vdupq_n_s32(8 * *a.sums.get_unchecked(idx));
                let ylo: [int8x16_t; 4] = std::array::from_fn(|k| yword(y.add(4 * k)));
                let yhi: [int8x16_t; 4] = std::array::from_fn(|k| yword(y.add(16 + 4 * k)));
                for (q, acc) in acc.iter_mut().enumerate() {
                    let mut isum = vdupq_n_s32(0);
                    for k in 0..4 {
                        let v = vld1q_u8(blk.add(2 * GROUP + 64 * k + 16 * q));
                        let lo = vreinterpretq_s8_u8(vandq_u8(v, m4));
                        let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
                        isum = dot4::<DOT>(isum, lo, ylo[k]);
                        isum = dot4::<DOT>(isum, hi, yhi[k]);
                    }
                    isum = vsubq_s32(isum, ysum8);
                    let d = vmulq_n_f32(f16x4(blk.add(8 * q)), dy);
                    *acc = vfmaq_f32(*acc, d, vcvtq_f32_s32(isum));
                }
            }
            for (q, acc) in acc.iter().enumerate() {
                vst1q_f32(out.as_mut_ptr().add(j * GROUP + 4 * q), *acc);
            }
        }
    }
}

neon_and_dotprod!(
    /// Q8_0 interleaved group × `nt` tokens, in `scalar::q8_0_group`'s 8-lanes-per-row order.
    q8_0_neon,
    q8_0_dotprod,
    q8_0_group
);

#[inline(always)]
unsafe fn q8_0_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(w, 34, a, t0, nt, out);
    let nb = a.cols / 32;
    // SAFETY: bounds checked above; `dot4::<true>` only in the dotprod entry.
    unsafe {
        for j in 0..nt {
            let t = t0 + j;
            for q in 0..4 {
                // acc[k]: lane k (elements 4k..4k+4 of every block) of rows 4q..4q+4.
                let mut acc = [vdupq_n_f32(0.0); 8];
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * GROUP * 34);
                    let y = a.qs.as_ptr().add(t * a.cols + b * 32);
                    let d = vmulq_n_f32(f16x4(blk.add(8 * q)), *a.f.get_unchecked(t * nb + b));
                    for (k, acc) in acc.iter_mut().enumerate() {
                        let wk = vld1q_s8(blk.add(2 * GROUP + 64 * k + 16 * q) as *const i8);
                        let s = dot4::<DOT>(vdupq_n_s32(0), wk, yword(y.add(4 * k)));
                        *acc = vfmaq_f32(*acc, d, vcvtq_f32_s32(s));
                    }
                }
                vst1q_f32(out.as_mut_ptr().add(j * GROUP + 4 * q), lanes_sum(&acc));
            }
        }
    }
}

neon_and_dotprod!(
    /// Widened Q4_1/Q5_1 group × `nt` tokens, in `scalar::q1_group`'s order.
    q1_neon,
    q1_dotprod,
    q1_group
);

#[inline(always)]
unsafe fn q1_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(w, Q1_X16 / GROUP, a, t0, nt, out);
    let nb = a.cols / 32;
    assert!((t0 + nt) * nb <= a.q8_1_s.len());
    // SAFETY: bounds checked above; `dot4::<true>` only in the dotprod entry.
    unsafe {
        for j in 0..nt {
            let t = t0 + j;
            for q in 0..4 {
                let mut acc = [vdupq_n_f32(0.0); 8];
                let mut summs = vdupq_n_f32(0.0);
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * Q1_X16);
                    let idx = t * nb + b;
                    let dy = *a.f.get_unchecked(idx);
                    let sy = *a.q8_1_s.get_unchecked(idx);
                    let d = vmulq_n_f32(f16x4(blk.add(8 * q)), dy);
                    let y = a.qs.as_ptr().add(t * a.cols + b * 32);
                    for (k, acc) in acc.iter_mut().enumerate() {
                        // Codes 0..31: read as i8 they are the same non-negative numbers.
                        let wk = vld1q_s8(blk.add(Q1_QS + 64 * k + 16 * q) as *const i8);
                        let s = dot4::<DOT>(vdupq_n_s32(0), wk, yword(y.add(4 * k)));
                        *acc = vfmaq_f32(*acc, d, vcvtq_f32_s32(s));
                    }
                    // `summs += m·s`, fused, as the scalar kernel.
                    let mx = f16x4(blk.add(Q1_MIN + 8 * q));
                    summs = vfmaq_f32(summs, mx, vdupq_n_f32(sy));
                }
                let r = vaddq_f32(lanes_sum(&acc), summs);
                vst1q_f32(out.as_mut_ptr().add(j * GROUP + 4 * q), r);
            }
        }
    }
}
