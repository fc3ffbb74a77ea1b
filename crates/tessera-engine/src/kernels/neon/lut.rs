//! NEON kernels for the 16-entry-table types: MXFP4 and IQ4_NL (layout and numerical contract
//! in `lut4.rs`) and IQ4_XS (`iq4xs.rs`). `tbl` maps 16 nibbles to their signed table values
//! in one instruction; the rest is Q4_0's (MXFP4, IQ4_NL) or Q6_K's (IQ4_XS) scheme: exact
//! integer sums, then the scalar kernel's float steps in its order.

use std::arch::aarch64::*;

use super::super::iq4xs::{QS as XS_QS, SCALES as XS_SCALES, X16 as XS_X16};
use super::super::lut4::{e8m0_half, qs, scale_bytes, table, x16, KVALUES_IQ4NL};
use super::super::matrix::GROUP;
use super::super::quant_acts::QuantizedActs;
use super::{dot4, f16x4, i8x4, lanes_sum, neon_and_dotprod, yword};

/// The 16 signed table values, for `tbl`.
#[inline(always)]
unsafe fn table_reg(t: &[i8; 16]) -> int8x16_t {
    // SAFETY: 16 readable bytes.
    unsafe { vld1q_s8(t.as_ptr()) }
}

/// The table values of the low and the high nibbles of 16 code bytes.
#[inline(always)]
unsafe fn lookup(t: int8x16_t, v: uint8x16_t) -> (int8x16_t, int8x16_t) {
    // SAFETY: register-only; every index is below 16.
    unsafe {
        (
            vqtbl1q_s8(t, vandq_u8(v, vdupq_n_u8(0x0F))),
            vqtbl1q_s8(t, vshrq_n_u8::<4>(v)),
        )
    }
}

neon_and_dotprod!(
    /// MXFP4 interleaved group × `nt` tokens.
    mxfp4_neon,
    mxfp4_dotprod,
    mxfp4_group
);

#[inline(always)]
unsafe fn mxfp4_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    // SAFETY: as `lut4_group`'s.
    unsafe { lut4_group::<false, DOT>(w, a, t0, nt, out) }
}

neon_and_dotprod!(
    /// IQ4_NL interleaved group × `nt` tokens.
    iq4nl_neon,
    iq4nl_dotprod,
    iq4nl_group
);

#[inline(always)]
unsafe fn iq4nl_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    // SAFETY: as `lut4_group`'s.
    unsafe { lut4_group::<true, DOT>(w, a, t0, nt, out) }
}

/// MXFP4 (`NL` = false) or IQ4_NL: per row and block `acc = fma(scale·dy, Σ table[q]·y, acc)`.
/// Table values times activations stay within i16 pairs (at most 2·127·128).
#[inline(always)]
unsafe fn lut4_group<const NL: bool, const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let nb = a.cols / 32;
    let (x16, qs, sb) = (x16(NL), qs(NL), scale_bytes(NL));
    assert!(w.len() >= nb * x16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * nb <= a.f.len());
    assert!(out.len() >= nt * GROUP);
    // SAFETY: bounds checked above; `dot4::<true>` only in the dotprod entries.
    unsafe {
        let t = table_reg(table(NL));
        for j in 0..nt {
            let tok = t0 + j;
            let mut acc = [vdupq_n_f32(0.0); 4];
            for b in 0..nb {
                let blk = w.as_ptr().add(b * x16);
                let y = a.qs.as_ptr().add(tok * a.cols + b * 32);
                let dy = *a.f.get_unchecked(tok * nb + b);
                let ylo: [int8x16_t; 4] = std::array::from_fn(|k| yword(y.add(4 * k)));
                let yhi: [int8x16_t; 4] = std::array::from_fn(|k| yword(y.add(16 + 4 * k)));
                for (q, acc) in acc.iter_mut().enumerate() {
                    let mut isum = vdupq_n_s32(0);
                    for k in 0..4 {
                        let (lo, hi) = lookup(t, vld1q_u8(blk.add(qs + 64 * k + 16 * q)));
                        isum = dot4::<DOT>(isum, lo, ylo[k]);
                        isum = dot4::<DOT>(isum, hi, yhi[k]);
                    }
                    let scale = if NL {
                        f16x4(blk.add(sb * 4 * q))
                    } else {
                        let e: [f32; 4] = std::array::from_fn(|i| e8m0_half(*blk.add(4 * q + i)));
                        vld1q_f32(e.as_ptr())
                    };
                    let d = vmulq_n_f32(scale, dy);
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
    /// IQ4_XS interleaved group × `nt` tokens.
    iq4xs_neon,
    iq4xs_dotprod,
    iq4xs_group
);

/// IQ4_XS: lane `k` (`k < 4`) takes the low nibbles of run `k` of every sub-block, lane
/// `4 + k` the high ones, each times the row's signed sub-block scale; one float step per lane
/// and block.
#[inline(always)]
unsafe fn iq4xs_group<const DOT: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * XS_X16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * nb <= a.f.len());
    assert!(out.len() >= nt * GROUP);
    // SAFETY: bounds checked above; `dot4::<true>` only in the dotprod entries.
    unsafe {
        let t = table_reg(&KVALUES_IQ4NL);
        for j in 0..nt {
            let tok = t0 + j;
            for q in 0..4 {
                let mut acc = [vdupq_n_f32(0.0); 8];
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * XS_X16);
                    let y = a.qs.as_ptr().add(tok * a.cols + b * 256);
                    let mut lanes = [vdupq_n_s32(0); 8];
                    for s in 0..8 {
                        let sc = i8x4(blk.add(XS_SCALES + GROUP * s + 4 * q));
                        for k in 0..4 {
                            let v = vld1q_u8(blk.add(XS_QS + 256 * s + 64 * k + 16 * q));
                            let (lo, hi) = lookup(t, v);
                            let yl = yword(y.add(32 * s + 4 * k));
                            let yh = yword(y.add(32 * s + 16 + 4 * k));
                            let pl = dot4::<DOT>(vdupq_n_s32(0), lo, yl);
                            let ph = dot4::<DOT>(vdupq_n_s32(0), hi, yh);
                            lanes[k] = vmlaq_s32(lanes[k], pl, sc);
                            lanes[4 + k] = vmlaq_s32(lanes[4 + k], ph, sc);
                        }
                    }
                    let d = vmulq_n_f32(f16x4(blk.add(8 * q)), *a.f.get_unchecked(tok * nb + b));
                    for (acc, &l) in acc.iter_mut().zip(&lanes) {
                        *acc = vfmaq_f32(*acc, d, vcvtq_f32_s32(l));
                    }
                }
                vst1q_f32(out.as_mut_ptr().add(j * GROUP + 4 * q), lanes_sum(&acc));
            }
        }
    }
}
