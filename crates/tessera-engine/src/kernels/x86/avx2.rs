//! AVX2 kernels for Q4_0, Q8_0 and the widened Q4_1/Q5_1. Same arithmetic as `scalar.rs`,
//! hence bit-identical results.

use std::arch::x86_64::*;

use super::super::matrix::{GROUP, Q1_MIN, Q1_QS, Q1_X16};
use super::super::quant_acts::QuantizedActs;
use super::kquant_avx2::prefetch_ahead;

/// Checks the bounds every group kernel relies on.
fn check_group(w: &[u8], bb: usize, a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 32;
    assert!(w.len() >= nb * GROUP * bb);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * nb <= a.sums.len());
    assert!(out.len() >= nt * GROUP);
}

/// Q4_0 interleaved group × `nt` tokens; tiles of 4 tokens share each weight unpack.
///
/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_0_group(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(w, 18, a, t0, nt, out);
    let mut j = 0;
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        while j + 4 <= nt {
            q4_0_tile::<4>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 4;
        }
        while j < nt {
            q4_0_tile::<1>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 1;
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 32;
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens t..t+T.
    unsafe {
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                let blk = w.add(b * GROUP * 18);
                let dx = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
                let mut lo = [_mm256_setzero_si256(); 4];
                let mut hi = [_mm256_setzero_si256(); 4];
                for k in 0..4 {
                    // Decode reads each weight once, from memory: the first half's pass
                    // prefetches ahead (the second finds the group's lines in cache).
                    if T == 1 && h == 0 {
                        prefetch_ahead(blk, GROUP * 18, k, 4);
                    }
                    let v = _mm256_loadu_si256(blk.add(32 + 64 * k + 32 * h) as *const __m256i);
                    lo[k] = _mm256_and_si256(v, m4);
                    hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
                for (j, acc) in acc.iter_mut().enumerate() {
                    let y = a.qs.as_ptr().add((t + j) * a.cols + b * 32);
                    // i16 lanes stay exact: 8 terms of at most 2*15*127.
                    let mut s = _mm256_setzero_si256();
                    for k in 0..4 {
                        let ylo = _mm256_set1_epi32((y.add(4 * k) as *const i32).read_unaligned());
                        let yhi =
                            _mm256_set1_epi32((y.add(16 + 4 * k) as *const i32).read_unaligned());
                        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[k], ylo));
                        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[k], yhi));
                    }
                    let idx = (t + j) * nb + b;
                    let isum = _mm256_sub_epi32(
                        _mm256_madd_epi16(s, ones),
                        _mm256_set1_epi32(8 * *a.sums.get_unchecked(idx)),
                    );
                    let d = _mm256_mul_ps(dx, _mm256_set1_ps(*a.f.get_unchecked(idx)));
                    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), *acc);
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h), *acc);
            }
        }
    }
}

/// Q8_0 interleaved group × `nt` tokens.
///
/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_0_group(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(w, 34, a, t0, nt, out);
    let mut j = 0;
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        while j + 4 <= nt {
            q8_0_tile::<4>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 4;
        }
        if j + 2 <= nt {
            q8_0_tile::<2>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 2;
        }
        if j < nt {
            q8_0_token(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
        }
    }
}

/// Q8_0 for `T` (2 or 4) tokens from `t`: [`q8_0_token`]'s lanes, chains and tree for each
/// token, `8 / T` of the lanes at a time (8 accumulators), so that each weight load and its
/// `abs` serve `T` tokens where the one-token kernel redoes them per token. (Tokens one at a
/// time, a 512-token dense prefill spent 80% of its samples in this kernel.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 32;
    let ones = _mm256_set1_epi16(1);
    let per = 8 / T;
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens
    // t..t+T.
    unsafe {
        for h in 0..2 {
            // lanes[j][k]: token j's lane k, as `q8_0_token`'s acc[k].
            let mut lanes = [[_mm256_setzero_ps(); 8]; T];
            for k0 in (0..8).step_by(per) {
                let mut acc = [[_mm256_setzero_ps(); 4]; T];
                for b in 0..nb {
                    let blk = w.add(b * GROUP * 34);
                    let dx = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
                    let d: [__m256; T] = std::array::from_fn(|j| {
                        _mm256_mul_ps(dx, _mm256_set1_ps(*a.f.get_unchecked((t + j) * nb + b)))
                    });
                    for kk in 0..per {
                        let k = k0 + kk;
                        let wk =
                            _mm256_loadu_si256(blk.add(32 + 64 * k + 32 * h) as *const __m256i);
                        let aw = _mm256_abs_epi8(wk);
                        for (j, acc) in acc.iter_mut().enumerate() {
                            let y = a.qs.as_ptr().add((t + j) * a.cols + b * 32 + 4 * k);
                            let yk = _mm256_set1_epi32((y as *const i32).read_unaligned());
                            let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(yk, wk));
                            let s = _mm256_madd_epi16(p, ones);
                            acc[kk] = _mm256_fmadd_ps(d[j], _mm256_cvtepi32_ps(s), acc[kk]);
                        }
                    }
                }
                for (lanes, acc) in lanes.iter_mut().zip(&acc) {
                    lanes[k0..k0 + per].copy_from_slice(&acc[..per]);
                }
            }
            for (j, l) in lanes.iter().enumerate() {
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h), q8_0_lanes_sum(l));
            }
        }
    }
}

/// Q8_0 for one token, in `scalar::q8_0_group`'s (llama.cpp's) 8-lanes-per-row order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_token(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 32;
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold token t.
    unsafe {
        for h in 0..2 {
            // acc[k]: lane k (elements 4k..4k+4 of every block) of 8 rows.
            let mut acc = [_mm256_setzero_ps(); 8];
            for b in 0..nb {
                let blk = w.add(b * GROUP * 34);
                let dx = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
                let d = _mm256_mul_ps(dx, _mm256_set1_ps(*a.f.get_unchecked(t * nb + b)));
                let y = a.qs.as_ptr().add(t * a.cols + b * 32);
                for (k, acc) in acc.iter_mut().enumerate() {
                    let wk = _mm256_loadu_si256(blk.add(32 + 64 * k + 32 * h) as *const __m256i);
                    let yk = _mm256_set1_epi32((y.add(4 * k) as *const i32).read_unaligned());
                    // |w|·(y·sign w): unsigned × signed for pmaddubsw; pairs ≤ 2*128*127.
                    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(wk), _mm256_sign_epi8(yk, wk));
                    let s = _mm256_madd_epi16(p, ones);
                    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), *acc);
                }
            }
            _mm256_storeu_ps(out.add(8 * h), q8_0_lanes_sum(&acc));
        }
    }
}

/// A row's 8 Q8_0 lanes (8 rows each) added in `scalar::q8_0_group`'s tree.
#[inline(always)]
unsafe fn q8_0_lanes_sum(l: &[__m256; 8]) -> __m256 {
    // SAFETY: AVX is enabled in every caller.
    unsafe {
        _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6])),
            _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7])),
        )
    }
}

/// Widened Q4_1/Q5_1 group × `nt` tokens, in `scalar::q1_group`'s (llama.cpp's) order.
/// (Prefetching two blocks ahead in the first half's pass for 1–2 tokens, as Q4_0 does,
/// measured 10% slower: dense bench geometry, 1 token, alternated in one process.)
///
/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q1_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    check_group(w, Q1_X16 / GROUP, a, t0, nt, out);
    assert!((t0 + nt) * (a.cols / 32) <= a.q8_1_s.len());
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        for j in 0..nt {
            q1_token(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q1_token(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 32;
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold token t.
    unsafe {
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut summs = _mm256_setzero_ps();
            for b in 0..nb {
                let blk = w.add(b * Q1_X16);
                let idx = t * nb + b;
                let dy = *a.f.get_unchecked(idx);
                let sy = *a.q8_1_s.get_unchecked(idx);
                let dx = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
                let mx =
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.add(Q1_MIN + 16 * h) as *const __m128i));
                let d = _mm256_mul_ps(dx, _mm256_set1_ps(dy));
                let y = a.qs.as_ptr().add(t * a.cols + b * 32);
                for (k, acc) in acc.iter_mut().enumerate() {
                    let wk = _mm256_loadu_si256(blk.add(Q1_QS + 64 * k + 32 * h) as *const __m256i);
                    let yk = _mm256_set1_epi32((y.add(4 * k) as *const i32).read_unaligned());
                    // Codes 0..31 unsigned: pairs at most 2·31·128, exact in i16.
                    let s = _mm256_madd_epi16(_mm256_maddubs_epi16(wk, yk), ones);
                    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), *acc);
                }
                summs = _mm256_fmadd_ps(mx, _mm256_set1_ps(sy), summs);
            }
            let r = _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
                _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])),
            );
            _mm256_storeu_ps(out.add(8 * h), _mm256_add_ps(r, summs));
        }
    }
}
