//! AVX2 kernels. Same arithmetic as `scalar.rs` (exact integer block sums, one FMA per
//! row/token/block in block order), hence bit-identical results.

use std::arch::x86_64::*;

use super::super::matrix::{
    kx16_bytes, kx16_qs, GROUP, Q4K_DMIN, Q4K_MINS, Q4K_SCALES, Q5K_QH, Q6K_QH, Q6K_QL, Q6K_SCALES,
    Q6K_X16,
};
use super::super::quant_acts::QuantizedActs;
use super::super::scalar::f16_at;

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
        while j < nt {
            q8_0_tile::<1>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 1;
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 32;
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens t..t+T.
    unsafe {
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                let blk = w.add(b * GROUP * 34);
                let dx = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
                let mut wv = [_mm256_setzero_si256(); 8];
                for (k, wv) in wv.iter_mut().enumerate() {
                    *wv = _mm256_loadu_si256(blk.add(32 + 64 * k + 32 * h) as *const __m256i);
                }
                for (j, acc) in acc.iter_mut().enumerate() {
                    let y = a.qs.as_ptr().add((t + j) * a.cols + b * 32);
                    let mut s = _mm256_setzero_si256();
                    for (k, &wk) in wv.iter().enumerate() {
                        let yk = _mm256_set1_epi32((y.add(4 * k) as *const i32).read_unaligned());
                        // |w|·(y·sign w): unsigned × signed for pmaddubsw; pairs ≤ 2*128*127.
                        let p = _mm256_maddubs_epi16(_mm256_abs_epi8(wk), _mm256_sign_epi8(yk, wk));
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
                    }
                    let idx = (t + j) * nb + b;
                    let d = _mm256_mul_ps(dx, _mm256_set1_ps(*a.f.get_unchecked(idx)));
                    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), *acc);
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h), *acc);
            }
        }
    }
}

const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

/// The canonical float dot of `scalar::float_dot`, 4 × 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_dot<const K: u8>(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    let n = a.cols;
    let esz = if K == F32 { 4 } else { 2 };
    assert!(row.len() >= n * esz && (t + 1) * n <= a.f.len());
    let x = &a.f[t * n..(t + 1) * n];
    let wp = row.as_ptr();
    let load = |i: usize| -> __m256 {
        // SAFETY: i + 8 <= n (callers iterate whole 32-element chunks), row holds n elements.
        unsafe {
            match K {
                F32 => _mm256_loadu_ps(wp.add(4 * i) as *const f32),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(wp.add(2 * i) as *const __m128i)),
                _ => {
                    let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(wp.add(2 * i) as *const __m128i));
                    _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
                }
            }
        }
    };
    let n32 = n / 32 * 32;
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < n32 {
        for (k, acc) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8k + 8 <= n32 <= x.len().
            let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(i + 8 * k)) };
            *acc = _mm256_fmadd_ps(load(i + 8 * k), xv, *acc);
        }
        i += 32;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let u = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    let v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    let mut r = _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
    for (i, &xi) in x.iter().enumerate().skip(n32) {
        let wi = match K {
            F32 => f32::from_le_bytes(row[4 * i..4 * i + 4].try_into().unwrap()),
            F16 => f16_at(row, 2 * i),
            _ => f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16),
        };
        r = wi.mul_add(xi, r);
    }
    r
}

/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f32_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    // SAFETY: same features.
    unsafe { float_dot::<F32>(row, a, t) }
}

/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    // SAFETY: same features.
    unsafe { float_dot::<F16>(row, a, t) }
}

/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn bf16_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    // SAFETY: same features.
    unsafe { float_dot::<BF16>(row, a, t) }
}

/// Q4_K (`FIVE` = false) / Q5_K interleaved group × `nt` tokens on 8-row halves: `pmaddubsw`
/// sums stay exact in i16 over 4 runs (4 terms of at most 2·31·127), then `pmaddwd` widens
/// them to one i32 per row.
///
/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q45k_group<const FIVE: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * kx16_bytes(FIVE));
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * a.cols / 16 <= a.bsums.len());
    assert!((t0 + nt) * nb <= a.f.len() && out.len() >= nt * GROUP);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        let mut j = 0;
        while j + 2 <= nt {
            q45k_tile::<2, FIVE>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 2;
        }
        while j < nt {
            q45k_tile::<1, FIVE>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 1;
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45k_tile<const T: usize, const FIVE: bool>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
) {
    let nb = a.cols / 256;
    let (x16, qs) = (kx16_bytes(FIVE), kx16_qs(FIVE));
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller checked that w holds nb interleaved blocks and acts hold t..t+T.
    unsafe {
        let bytes8 = |p: *const u8| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                let blk = w.add(b * x16);
                let mut isum = [_mm256_setzero_si256(); T];
                for c in 0..4 {
                    let q = blk.add(qs + 512 * c + 32 * h);
                    let sh_lo = _mm_cvtsi32_si128(2 * c as i32);
                    let sh_hi = _mm_cvtsi32_si128(2 * c as i32 + 1);
                    let mut s_lo = [_mm256_setzero_si256(); T];
                    let mut s_hi = [_mm256_setzero_si256(); T];
                    let mut w_lo = [_mm256_setzero_si256(); T];
                    let mut w_hi = [_mm256_setzero_si256(); T];
                    for k in 0..8 {
                        let v = _mm256_loadu_si256(q.add(64 * k) as *const __m256i);
                        let mut lo = _mm256_and_si256(v, m4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        if FIVE {
                            // 16-bit shifts by 2c / 2c+1 (< 8), then bit 0 of each byte.
                            let hq = blk.add(Q5K_QH + 64 * k + 32 * h) as *const __m256i;
                            let hv = _mm256_loadu_si256(hq);
                            let bl = _mm256_and_si256(_mm256_srl_epi16(hv, sh_lo), one);
                            let bh = _mm256_and_si256(_mm256_srl_epi16(hv, sh_hi), one);
                            lo = _mm256_or_si256(lo, _mm256_slli_epi16(bl, 4));
                            hi = _mm256_or_si256(hi, _mm256_slli_epi16(bh, 4));
                        }
                        for j in 0..T {
                            let y = a.qs.as_ptr().add((t + j) * a.cols + b * 256 + 64 * c);
                            let yl =
                                _mm256_set1_epi32((y.add(4 * k) as *const i32).read_unaligned());
                            let yh = _mm256_set1_epi32(
                                (y.add(32 + 4 * k) as *const i32).read_unaligned(),
                            );
                            s_lo[j] = _mm256_add_epi16(s_lo[j], _mm256_maddubs_epi16(lo, yl));
                            s_hi[j] = _mm256_add_epi16(s_hi[j], _mm256_maddubs_epi16(hi, yh));
                            if k % 4 == 3 {
                                w_lo[j] =
                                    _mm256_add_epi32(w_lo[j], _mm256_madd_epi16(s_lo[j], ones));
                                w_hi[j] =
                                    _mm256_add_epi32(w_hi[j], _mm256_madd_epi16(s_hi[j], ones));
                                s_lo[j] = _mm256_setzero_si256();
                                s_hi[j] = _mm256_setzero_si256();
                            }
                        }
                    }
                    let sc_lo = bytes8(blk.add(Q4K_SCALES + 32 * c + 8 * h));
                    let sc_hi = bytes8(blk.add(Q4K_SCALES + 32 * c + 16 + 8 * h));
                    for j in 0..T {
                        let p = _mm256_add_epi32(
                            _mm256_mullo_epi32(w_lo[j], sc_lo),
                            _mm256_mullo_epi32(w_hi[j], sc_hi),
                        );
                        isum[j] = _mm256_add_epi32(isum[j], p);
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
                let dmin =
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.add(Q4K_DMIN + 16 * h) as *const __m128i));
                for (j, acc) in acc.iter_mut().enumerate() {
                    let tt = t + j;
                    let bs = a.bsums.as_ptr().add((tt * a.cols + b * 256) / 16);
                    let mut msum = _mm256_setzero_si256();
                    for s in 0..8 {
                        let bj = *bs.add(2 * s) as i32 + *bs.add(2 * s + 1) as i32;
                        let mn = bytes8(blk.add(Q4K_MINS + 16 * s + 8 * h));
                        msum =
                            _mm256_add_epi32(msum, _mm256_mullo_epi32(mn, _mm256_set1_epi32(bj)));
                    }
                    let dy = _mm256_set1_ps(*a.f.get_unchecked(tt * nb + b));
                    // acc + d·dy·isum − dmin·dy·msum, as scalar::k_update.
                    let r =
                        _mm256_fmadd_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(isum[j]), *acc);
                    *acc = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dy), _mm256_cvtepi32_ps(msum), r);
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h), *acc);
            }
        }
    }
}

/// Q6_K interleaved group × `nt` tokens on 8-row halves (one token at a time; the AVX-512
/// kernel is the fast path).
///
/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * Q6K_X16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * a.cols / 16 <= a.bsums.len());
    assert!((t0 + nt) * nb <= a.f.len() && out.len() >= nt * GROUP);
    let m4 = _mm256_set1_epi8(0x0F);
    let m3 = _mm256_set1_epi8(3);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        let load = |p: *const u8| _mm256_loadu_si256(p as *const __m256i);
        let hb = |x: __m256i| _mm256_slli_epi16(_mm256_and_si256(x, m3), 4);
        for j in 0..nt {
            let t = t0 + j;
            for h in 0..2 {
                let mut acc = _mm256_setzero_ps();
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * Q6K_X16);
                    let mut isum = _mm256_setzero_si256();
                    for n in 0..2 {
                        for half in 0..2 {
                            let mut sacc = [_mm256_setzero_si256(); 4];
                            for l4 in 4 * half..4 * half + 4 {
                                let qa = load(blk.add(Q6K_QL + 64 * (16 * n + l4) + 32 * h));
                                let qb = load(blk.add(Q6K_QL + 64 * (16 * n + 8 + l4) + 32 * h));
                                let hh = load(blk.add(Q6K_QH + 64 * (8 * n + l4) + 32 * h));
                                let q = [
                                    _mm256_or_si256(_mm256_and_si256(qa, m4), hb(hh)),
                                    _mm256_or_si256(
                                        _mm256_and_si256(qb, m4),
                                        hb(_mm256_srli_epi16(hh, 2)),
                                    ),
                                    _mm256_or_si256(
                                        _mm256_and_si256(_mm256_srli_epi16(qa, 4), m4),
                                        hb(_mm256_srli_epi16(hh, 4)),
                                    ),
                                    _mm256_or_si256(
                                        _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                                        hb(_mm256_srli_epi16(hh, 6)),
                                    ),
                                ];
                                let y = a.qs.as_ptr().add(t * a.cols + b * 256 + 128 * n + 4 * l4);
                                for k in 0..4 {
                                    let yk = _mm256_set1_epi32(
                                        (y.add(32 * k) as *const i32).read_unaligned(),
                                    );
                                    // Pairs ≤ 2·63·127 fit i16; widen each to i32 at once.
                                    let p = _mm256_maddubs_epi16(q[k], yk);
                                    sacc[k] = _mm256_add_epi32(sacc[k], _mm256_madd_epi16(p, ones));
                                }
                            }
                            for (k, &sk) in sacc.iter().enumerate() {
                                let s = 8 * n + 2 * k + half;
                                let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                    blk.add(Q6K_SCALES + 16 * s + 8 * h) as *const __m128i,
                                ));
                                let bs = *a.bsums.get_unchecked((t * a.cols + b * 256) / 16 + s);
                                let v = _mm256_sub_epi32(sk, _mm256_set1_epi32(32 * bs as i32));
                                isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(v, sc));
                            }
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
                    let dy = _mm256_set1_ps(*a.f.get_unchecked(t * nb + b));
                    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(isum), acc);
                }
                _mm256_storeu_ps(out.as_mut_ptr().add(j * GROUP + 8 * h), acc);
            }
        }
    }
}
