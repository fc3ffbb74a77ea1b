//! NEON kernels for Q2_K and Q3_K (layout and numerical contract in `k23.rs`): per quad of rows
//! the 2-bit codes (Q3_K: with their `hmask` bit, minus 4) times the activation words, exact
//! integer sums per lane, then the scalar kernel's float steps in its order.

use std::arch::aarch64::*;

use super::super::k23::{qs, scales, x16, DMIN, HMASK, MINS};
use super::super::matrix::GROUP;
use super::super::quant_acts::QuantizedActs;
use super::{dot4, f16x4, i8x4, lanes_sum, neon_and_dotprod, u8x4, yword};

neon_and_dotprod!(
    /// Q2_K interleaved group × `nt` tokens.
    q2k_neon,
    q2k_dotprod,
    q2k_group
);

#[inline(always)]
unsafe fn q2k_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    // SAFETY: as `k23_group`'s.
    unsafe { k23_group::<false, DOT>(w, a, t0, nt, out) }
}

neon_and_dotprod!(
    /// Q3_K interleaved group × `nt` tokens.
    q3k_neon,
    q3k_dotprod,
    q3k_group
);

#[inline(always)]
unsafe fn q3k_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    // SAFETY: as `k23_group`'s.
    unsafe { k23_group::<true, DOT>(w, a, t0, nt, out) }
}

/// Q2_K (`THREE` = false) or Q3_K. Element `128n + 32s + 16h + 4cc + i` of a row is bits
/// `2s..2s+2` of its code byte `32n + 16h + 4cc + i` (run `8n + 4h + cc`), of sub-block
/// `8n + 2s + h`, and goes to lane `4h + cc`; Q3_K adds bit `4n + s` of `hmask` byte
/// `16h + 4cc + i` (run `4h + cc`) as bit 2 and subtracts 4.
#[inline(always)]
unsafe fn k23_group<const THREE: bool, const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let nb = a.cols / 256;
    let (x16, qs, sc_at) = (x16(THREE), qs(THREE), scales(THREE));
    assert!(w.len() >= nb * x16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * a.cols / 16 <= a.bsums.len());
    assert!((t0 + nt) * nb <= a.f.len() && out.len() >= nt * GROUP);
    // SAFETY: bounds checked above; `dot4::<true>` only in the dotprod entries.
    unsafe {
        let m3 = vdupq_n_u8(3);
        let one = vdupq_n_u8(1);
        let four = vdupq_n_u8(4);
        for j in 0..nt {
            let tok = t0 + j;
            for q in 0..4 {
                let mut acc = [vdupq_n_f32(0.0); 8];
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * x16);
                    let y = a.qs.as_ptr().add(tok * a.cols + b * 256);
                    let dy = *a.f.get_unchecked(tok * nb + b);
                    if !THREE {
                        // Q2_K's mins first: lane L takes sub-blocks 2L and 2L + 1.
                        let bsums = a.bsums.as_ptr().add((tok * a.cols + b * 256) / 16);
                        let dmin = vmulq_n_f32(f16x4(blk.add(DMIN + 8 * q)), -dy);
                        for (l, acc) in acc.iter_mut().enumerate() {
                            let m = |sub: usize| {
                                vmulq_n_s32(
                                    u8x4(blk.add(MINS + GROUP * sub + 4 * q)),
                                    *bsums.add(sub) as i32,
                                )
                            };
                            let ms = vaddq_s32(m(2 * l), m(2 * l + 1));
                            *acc = vfmaq_f32(*acc, dmin, vcvtq_f32_s32(ms));
                        }
                    }
                    let sc: [int32x4_t; 16] = std::array::from_fn(|sub| {
                        let p = blk.add(sc_at + GROUP * sub + 4 * q);
                        if THREE {
                            i8x4(p)
                        } else {
                            u8x4(p)
                        }
                    });
                    let mut lanes = [vdupq_n_s32(0); 8];
                    for n in 0..2 {
                        for h in 0..2 {
                            for cc in 0..4 {
                                let v = vld1q_u8(blk.add(qs + 64 * (8 * n + 4 * h + cc) + 16 * q));
                                let hm = if THREE {
                                    vld1q_u8(blk.add(HMASK + 64 * (4 * h + cc) + 16 * q))
                                } else {
                                    vdupq_n_u8(0)
                                };
                                let lane = &mut lanes[4 * h + cc];
                                for s in 0..4 {
                                    let mut u = vandq_u8(vshlq_u8(v, vdupq_n_s8(-2 * s as i8)), m3);
                                    if THREE {
                                        let shift = vdupq_n_s8(-((4 * n + s) as i8));
                                        let bit = vandq_u8(vshlq_u8(hm, shift), one);
                                        // (u | 4·bit) − 4 wraps to the right signed byte.
                                        u = vsubq_u8(vorrq_u8(u, vshlq_n_u8::<2>(bit)), four);
                                    }
                                    let yw = yword(y.add(128 * n + 32 * s + 16 * h + 4 * cc));
                                    let p = dot4::<DOT>(vdupq_n_s32(0), vreinterpretq_s8_u8(u), yw);
                                    *lane = vmlaq_s32(*lane, p, sc[8 * n + 2 * s + h]);
                                }
                            }
                        }
                    }
                    let d = vmulq_n_f32(f16x4(blk.add(8 * q)), dy);
                    for (acc, &l) in acc.iter_mut().zip(&lanes) {
                        *acc = vfmaq_f32(*acc, d, vcvtq_f32_s32(l));
                    }
                }
                vst1q_f32(out.as_mut_ptr().add(j * GROUP + 4 * q), lanes_sum(&acc));
            }
        }
    }
}
