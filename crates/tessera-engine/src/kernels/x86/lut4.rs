//! AVX2 and AVX-512 kernels for interleaved MXFP4 / IQ4_NL groups (`kernels/lut4.rs` has the
//! layout and the numerical contract). The integer block sums are exact and the float steps are
//! the scalar kernel's, one lane per row, so the results equal `lut4::lut4_group` bit for bit.

use std::arch::x86_64::*;

use super::super::lut4::{qs, table, x16};
use super::super::matrix::GROUP;
use super::super::quant_acts::QuantizedActs;

fn check_group(nl: bool, w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 32;
    assert!(w.len() >= nb * x16(nl));
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * nb <= a.sums.len());
    assert!((t0 + nt) * nb <= a.f.len());
    assert!(out.len() >= nt * GROUP);
}

/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn lut4_group_avx2<const NL: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(NL, w, a, t0, nt, out);
    let mut j = 0;
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        while j + 4 <= nt {
            tile_avx2::<NL, 4>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 4;
        }
        while j < nt {
            tile_avx2::<NL, 1>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 1;
        }
    }
}

/// The scales of 8 rows (`h`-th half of the group) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales8<const NL: bool>(blk: *const u8, h: usize) -> __m256 {
    // SAFETY: the caller passes a block holding 16 rows' scales.
    unsafe {
        if NL {
            _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i))
        } else {
            let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(blk.add(8 * h) as *const __m128i));
            let normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
            let tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
            let is_tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
            _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, is_tiny))
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<const NL: bool, const T: usize>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
) {
    let nb = a.cols / 32;
    let (x16, qs) = (x16(NL), qs(NL));
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens t..t+T.
    unsafe {
        let tbl =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(table(NL).as_ptr() as *const __m128i));
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                let blk = w.add(b * x16);
                let scale = scales8::<NL>(blk, h);
                let mut lo = [_mm256_setzero_si256(); 4];
                let mut hi = [_mm256_setzero_si256(); 4];
                for k in 0..4 {
                    let v = _mm256_loadu_si256(blk.add(qs + 64 * k + 32 * h) as *const __m256i);
                    lo[k] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(v, m4));
                    hi[k] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                }
                for (j, acc) in acc.iter_mut().enumerate() {
                    let y = a.qs.as_ptr().add((t + j) * a.cols + b * 32);
                    // |w| · (y with w's sign) for pmaddubsw: one pair is at most 2·127·127, so
                    // each product goes to i32 before it is added.
                    let dot = |wv: __m256i, o: usize| {
                        let yv = _mm256_set1_epi32((y.add(o) as *const i32).read_unaligned());
                        let p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(yv, wv));
                        _mm256_madd_epi16(p, ones)
                    };
                    let mut isum = _mm256_setzero_si256();
                    for k in 0..4 {
                        isum = _mm256_add_epi32(isum, dot(lo[k], 4 * k));
                        isum = _mm256_add_epi32(isum, dot(hi[k], 16 + 4 * k));
                    }
                    let dy = *a.f.get_unchecked((t + j) * nb + b);
                    let d = _mm256_mul_ps(scale, _mm256_set1_ps(dy));
                    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), *acc);
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h), *acc);
            }
        }
    }
}

/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn lut4_group_avx512<const NL: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(NL, w, a, t0, nt, out);
    let mut j = 0;
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        while j + 4 <= nt {
            tile_avx512::<NL, 4>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 4;
        }
        if j + 2 <= nt {
            tile_avx512::<NL, 2>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 2;
        }
        while j < nt {
            tile_avx512::<NL, 1>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 1;
        }
    }
}

/// The 16 rows' scales of a block as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn scales16<const NL: bool>(blk: *const u8) -> __m512 {
    // SAFETY: the caller passes a block holding 16 rows' scales.
    unsafe {
        if NL {
            _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i))
        } else {
            let e = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk as *const __m128i));
            let normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
            let tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
            let is_tiny = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
            _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_tiny, normal, tiny))
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_avx512<const NL: bool, const T: usize>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
) {
    let nb = a.cols / 32;
    let (x16, qs) = (x16(NL), qs(NL));
    let m4 = _mm512_set1_epi8(0x0F);
    // `vpdpbusd` multiplies unsigned bytes: the table is offset by 128 (the sign bit flipped)
    // and 128 × the activations' block sum comes off the integer sum.
    let biased: [u8; 16] = std::array::from_fn(|i| (table(NL)[i] as u8) ^ 0x80);
    let mut acc = [_mm512_setzero_ps(); T];
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens t..t+T.
    unsafe {
        let tbl = _mm512_broadcast_i32x4(_mm_loadu_si128(biased.as_ptr() as *const __m128i));
        for b in 0..nb {
            let blk = w.add(b * x16);
            let scale = scales16::<NL>(blk);
            let mut lo = [_mm512_setzero_si512(); 4];
            let mut hi = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                let v = _mm512_loadu_si512(blk.add(qs + 64 * k) as *const _);
                lo[k] = _mm512_shuffle_epi8(tbl, _mm512_and_si512(v, m4));
                hi[k] = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let y = a.qs.as_ptr().add((t + j) * a.cols + b * 32);
                let yw = |o: usize| _mm512_set1_epi32((y.add(o) as *const i32).read_unaligned());
                let mut s0 = _mm512_setzero_si512();
                let mut s1 = _mm512_setzero_si512();
                for k in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, lo[k], yw(4 * k));
                    s1 = _mm512_dpbusd_epi32(s1, hi[k], yw(16 + 4 * k));
                }
                let idx = (t + j) * nb + b;
                let isum = _mm512_sub_epi32(
                    _mm512_add_epi32(s0, s1),
                    _mm512_set1_epi32(128 * *a.sums.get_unchecked(idx)),
                );
                let d = _mm512_mul_ps(scale, _mm512_set1_ps(*a.f.get_unchecked(idx)));
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), *acc);
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(j * GROUP), *acc);
        }
    }
}
