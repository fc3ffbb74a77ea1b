//! NEON kernels for the interleaved Q4_K, Q5_K and Q6_K groups (layouts in `matrix.rs`,
//! numerical contract in `scalar::q45k_group` / `scalar::q6k_group`): each group runs as four
//! quads of rows, one i32/f32 lane per row, and every integer sum is exact, so the float steps
//! (the scalar kernel's, in its order) give its results bit for bit.

use std::arch::aarch64::*;

use super::super::matrix::{
    kx16_bytes, kx16_qs, q6k_runs, GROUP, Q4K_DMIN, Q4K_MINS, Q4K_SCALES, Q5K_QH, Q6K_SCALES,
    Q6K_X16,
};
use super::super::quant_acts::QuantizedActs;
use super::{dot4, f16x4, i8x4, lanes_sum, neon_and_dotprod, u8x4, yword};

fn check_k(w: &[u8], x16: usize, a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * x16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * a.cols / 16 <= a.bsums.len());
    assert!((t0 + nt) * nb <= a.f.len() && out.len() >= nt * GROUP);
}

/// Σ_s min_s · (bsum_2s + bsum_2s+1) for rows `4q..4q+4` of a Q4_K/Q5_K block (exact).
#[inline(always)]
unsafe fn min_sum(blk: *const u8, q: usize, bsums: *const i16) -> int32x4_t {
    // SAFETY: the caller guarantees a whole interleaved block and 16 bsums.
    unsafe {
        let mut msum = vdupq_n_s32(0);
        for s in 0..8 {
            let bs = *bsums.add(2 * s) as i32 + *bsums.add(2 * s + 1) as i32;
            msum = vmlaq_n_s32(msum, u8x4(blk.add(Q4K_MINS + 16 * s + 4 * q)), bs);
        }
        msum
    }
}

neon_and_dotprod!(
    /// Q4_K interleaved group × `nt` tokens.
    q4k_neon,
    q4k_dotprod,
    q4k_group
);

/// Q4_K only needs each row's block sum (the scalar kernel adds its 8 lanes as integers).
#[inline(always)]
unsafe fn q4k_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let (x16, qs) = (kx16_bytes(false), kx16_qs(false));
    check_k(w, x16, a, t0, nt, out);
    let nb = a.cols / 256;
    // SAFETY: bounds checked above; `dot4::<true>` only in the dotprod entry.
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        for j in 0..nt {
            let t = t0 + j;
            for q in 0..4 {
                let mut acc = vdupq_n_f32(0.0);
                let mut accm = vdupq_n_f32(0.0);
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * x16);
                    let y = a.qs.as_ptr().add(t * a.cols + b * 256);
                    let dy = *a.f.get_unchecked(t * nb + b);
                    let mut sums = vdupq_n_s32(0);
                    for c in 0..4 {
                        let (mut s_lo, mut s_hi) = (vdupq_n_s32(0), vdupq_n_s32(0));
                        for k in 0..8 {
                            let v = vld1q_u8(blk.add(qs + 512 * c + 64 * k + 16 * q));
                            let lo = vreinterpretq_s8_u8(vandq_u8(v, m4));
                            let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
                            s_lo = dot4::<DOT>(s_lo, lo, yword(y.add(64 * c + 4 * k)));
                            s_hi = dot4::<DOT>(s_hi, hi, yword(y.add(64 * c + 32 + 4 * k)));
                        }
                        let sc_lo = u8x4(blk.add(Q4K_SCALES + 32 * c + 4 * q));
                        let sc_hi = u8x4(blk.add(Q4K_SCALES + 32 * c + 16 + 4 * q));
                        sums = vmlaq_s32(vmlaq_s32(sums, s_lo, sc_lo), s_hi, sc_hi);
                    }
                    let bsums = a.bsums.as_ptr().add((t * a.cols + b * 256) / 16);
                    let msum = min_sum(blk, q, bsums);
                    let dd = vmulq_n_f32(f16x4(blk.add(8 * q)), dy);
                    acc = vfmaq_f32(acc, vcvtq_f32_s32(sums), dd);
                    let dm = vmulq_n_f32(f16x4(blk.add(Q4K_DMIN + 8 * q)), dy);
                    accm = vfmaq_f32(accm, vcvtq_f32_s32(msum), dm);
                }
                vst1q_f32(
                    out.as_mut_ptr().add(j * GROUP + 4 * q),
                    vsubq_f32(acc, accm),
                );
            }
        }
    }
}

neon_and_dotprod!(
    /// Q5_K interleaved group × `nt` tokens.
    q5k_neon,
    q5k_dotprod,
    q5k_group
);

/// Q5_K keeps 8 lanes per row: lane `k` sums the runs `k` of the 4 chunks (their high bits
/// share one load) and takes its float step at once.
#[inline(always)]
unsafe fn q5k_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let (x16, qs) = (kx16_bytes(true), kx16_qs(true));
    check_k(w, x16, a, t0, nt, out);
    let nb = a.cols / 256;
    // SAFETY: bounds checked above; `dot4::<true>` only in the dotprod entry.
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        let one = vdupq_n_u8(1);
        for j in 0..nt {
            let t = t0 + j;
            for q in 0..4 {
                let mut acc = [vdupq_n_f32(0.0); 8];
                let mut accm = vdupq_n_f32(0.0);
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * x16);
                    let y = a.qs.as_ptr().add(t * a.cols + b * 256);
                    let dy = *a.f.get_unchecked(t * nb + b);
                    let sc: [[int32x4_t; 2]; 4] = std::array::from_fn(|c| {
                        [
                            u8x4(blk.add(Q4K_SCALES + 32 * c + 4 * q)),
                            u8x4(blk.add(Q4K_SCALES + 32 * c + 16 + 4 * q)),
                        ]
                    });
                    let d = vmulq_n_f32(f16x4(blk.add(8 * q)), dy);
                    for (k, acc) in acc.iter_mut().enumerate() {
                        let h = vld1q_u8(blk.add(Q5K_QH + 64 * k + 16 * q));
                        let mut lane = vdupq_n_s32(0);
                        for (c, sc) in sc.iter().enumerate() {
                            let v = vld1q_u8(blk.add(qs + 512 * c + 64 * k + 16 * q));
                            // Bit 2c (low nibble) and 2c+1 (high) of the qh byte, as bit 4.
                            let bl = vandq_u8(vshlq_u8(h, vdupq_n_s8(-2 * c as i8)), one);
                            let bh = vandq_u8(vshlq_u8(h, vdupq_n_s8(-2 * c as i8 - 1)), one);
                            let lo = vorrq_u8(vandq_u8(v, m4), vshlq_n_u8::<4>(bl));
                            let hi = vorrq_u8(vshrq_n_u8::<4>(v), vshlq_n_u8::<4>(bh));
                            let yl = yword(y.add(64 * c + 4 * k));
                            let yh = yword(y.add(64 * c + 32 + 4 * k));
                            let pl = dot4::<DOT>(vdupq_n_s32(0), vreinterpretq_s8_u8(lo), yl);
                            let ph = dot4::<DOT>(vdupq_n_s32(0), vreinterpretq_s8_u8(hi), yh);
                            lane = vmlaq_s32(vmlaq_s32(lane, pl, sc[0]), ph, sc[1]);
                        }
                        *acc = vfmaq_f32(*acc, d, vcvtq_f32_s32(lane));
                    }
                    let bsums = a.bsums.as_ptr().add((t * a.cols + b * 256) / 16);
                    let msum = min_sum(blk, q, bsums);
                    // `summs += dmin * msum` in llama.cpp: product, then sum (not fused).
                    let dmin = vmulq_n_f32(f16x4(blk.add(Q4K_DMIN + 8 * q)), -dy);
                    accm = vaddq_f32(accm, vmulq_f32(dmin, vcvtq_f32_s32(msum)));
                }
                let r = vaddq_f32(lanes_sum(&acc), accm);
                vst1q_f32(out.as_mut_ptr().add(j * GROUP + 4 * q), r);
            }
        }
    }
}

neon_and_dotprod!(
    /// Q6_K interleaved group × `nt` tokens.
    q6k_neon,
    q6k_dotprod,
    q6k_group
);

/// Q6_K: the 6-bit quants rebuilt from their ql/qh runs, minus 32 (then signed bytes), times
/// the activation word, times the row's sub-block scale into lane `l4` (elements with
/// `(e % 32) / 4 == l4`); each lane's float step taken once per block.
#[inline(always)]
unsafe fn q6k_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_k(w, Q6K_X16, a, t0, nt, out);
    let nb = a.cols / 256;
    // SAFETY: bounds checked above; `dot4::<true>` only in the dotprod entry.
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        let m3 = vdupq_n_u8(3);
        let c32 = vdupq_n_u8(32);
        let hb = |x: uint8x16_t| vshlq_n_u8::<4>(vandq_u8(x, m3));
        for j in 0..nt {
            let t = t0 + j;
            for q in 0..4 {
                let mut acc = [vdupq_n_f32(0.0); 8];
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * Q6K_X16);
                    let y = a.qs.as_ptr().add(t * a.cols + b * 256);
                    let d = vmulq_n_f32(f16x4(blk.add(8 * q)), *a.f.get_unchecked(t * nb + b));
                    for (l4, acc) in acc.iter_mut().enumerate() {
                        let mut lane = vdupq_n_s32(0);
                        for n in 0..2 {
                            let run = blk.add(q6k_runs(n, l4) + 16 * q);
                            let (qa, qb) = (vld1q_u8(run), vld1q_u8(run.add(64)));
                            let h = vld1q_u8(run.add(128));
                            let quants = [
                                vorrq_u8(vandq_u8(qa, m4), hb(h)),
                                vorrq_u8(vandq_u8(qb, m4), hb(vshrq_n_u8::<2>(h))),
                                vorrq_u8(vshrq_n_u8::<4>(qa), hb(vshrq_n_u8::<4>(h))),
                                vorrq_u8(vshrq_n_u8::<4>(qb), hb(vshrq_n_u8::<6>(h))),
                            ];
                            for (k, &qk) in quants.iter().enumerate() {
                                // q − 32 wraps to the right signed byte (−32..31).
                                let qs = vreinterpretq_s8_u8(vsubq_u8(qk, c32));
                                let o = 128 * n + 32 * k + 4 * l4;
                                let p = dot4::<DOT>(vdupq_n_s32(0), qs, yword(y.add(o)));
                                let sub = 8 * n + 2 * k + l4 / 4;
                                let s = i8x4(blk.add(Q6K_SCALES + 16 * sub + 4 * q));
                                lane = vmlaq_s32(lane, p, s);
                            }
                        }
                        *acc = vfmaq_f32(*acc, d, vcvtq_f32_s32(lane));
                    }
                }
                vst1q_f32(out.as_mut_ptr().add(j * GROUP + 4 * q), lanes_sum(&acc));
            }
        }
    }
}
