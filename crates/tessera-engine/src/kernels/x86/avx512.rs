//! AVX-512 VNNI kernels for the interleaved Q4_0/Q8_0 groups: one 64-byte load holds 4 quant
//! bytes of each of the 16 rows, and `vpdpbusd` with a broadcast activation word accumulates
//! one i32 per row. Integer sums are exact, so results equal the scalar/AVX2 ones bit for bit.

use std::arch::x86_64::*;

use super::super::matrix::{
    kx16_bytes, kx16_qs, GROUP, Q4K_DMIN, Q4K_MINS, Q4K_SCALES, Q5K_QH, Q6K_QH, Q6K_QL, Q6K_SCALES,
    Q6K_X16,
};
use super::super::quant_acts::QuantizedActs;

fn check_group(w: &[u8], bb: usize, a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 32;
    assert!(w.len() >= nb * GROUP * bb);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * nb <= a.sums.len());
    assert!(out.len() >= nt * GROUP);
}

macro_rules! tiles {
    ($tile:ident, $w:expr, $a:expr, $t0:expr, $nt:expr, $out:expr) => {{
        let (w, a, t0, nt, out) = ($w, $a, $t0, $nt, $out);
        let mut j = 0;
        while j + 8 <= nt {
            $tile::<8>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 8;
        }
        if j + 4 <= nt {
            $tile::<4>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 4;
        }
        while j < nt {
            $tile::<1>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 1;
        }
    }};
}

/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q4_0_group(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(w, 18, a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe { tiles!(q4_0_tile, w, a, t0, nt, out) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 32;
    let m4 = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); T];
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens t..t+T.
    unsafe {
        for b in 0..nb {
            let blk = w.add(b * GROUP * 18);
            let dx = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let mut lo = [_mm512_setzero_si512(); 4];
            let mut hi = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                let v = _mm512_loadu_si512(blk.add(32 + 64 * k) as *const _);
                lo[k] = _mm512_and_si512(v, m4);
                hi[k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let y = a.qs.as_ptr().add((t + j) * a.cols + b * 32);
                let yw = |o: usize| _mm512_set1_epi32((y.add(o) as *const i32).read_unaligned());
                // Two chains (low / high nibbles) halve the dpbusd latency chain.
                let mut s0 = _mm512_setzero_si512();
                let mut s1 = _mm512_setzero_si512();
                for k in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, lo[k], yw(4 * k));
                    s1 = _mm512_dpbusd_epi32(s1, hi[k], yw(16 + 4 * k));
                }
                let idx = (t + j) * nb + b;
                let isum = _mm512_sub_epi32(
                    _mm512_add_epi32(s0, s1),
                    _mm512_set1_epi32(8 * *a.sums.get_unchecked(idx)),
                );
                let d = _mm512_mul_ps(dx, _mm512_set1_ps(*a.f.get_unchecked(idx)));
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), *acc);
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(j * GROUP), *acc);
        }
    }
}

/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q8_0_group(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(w, 34, a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe { tiles!(q8_0_tile, w, a, t0, nt, out) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 32;
    let flip = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); T];
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens t..t+T.
    unsafe {
        for b in 0..nb {
            let blk = w.add(b * GROUP * 34);
            let dx = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            // vpdpbusd wants unsigned weights: w + 128 (xor of the sign bit); the extra
            // 128·Σy is removed with the block's activation sum.
            let mut wv = [_mm512_setzero_si512(); 8];
            for (k, wv) in wv.iter_mut().enumerate() {
                let v = _mm512_loadu_si512(blk.add(32 + 64 * k) as *const _);
                *wv = _mm512_xor_si512(v, flip);
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let y = a.qs.as_ptr().add((t + j) * a.cols + b * 32);
                let yw = |o: usize| _mm512_set1_epi32((y.add(o) as *const i32).read_unaligned());
                let mut s0 = _mm512_setzero_si512();
                let mut s1 = _mm512_setzero_si512();
                for k in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, wv[2 * k], yw(8 * k));
                    s1 = _mm512_dpbusd_epi32(s1, wv[2 * k + 1], yw(8 * k + 4));
                }
                let idx = (t + j) * nb + b;
                let isum = _mm512_sub_epi32(
                    _mm512_add_epi32(s0, s1),
                    _mm512_set1_epi32(128 * *a.sums.get_unchecked(idx)),
                );
                let d = _mm512_mul_ps(dx, _mm512_set1_ps(*a.f.get_unchecked(idx)));
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), *acc);
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(j * GROUP), *acc);
        }
    }
}

fn check_q45k(w: &[u8], x16: usize, a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * x16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * a.cols / 16 <= a.bsums.len());
    assert!((t0 + nt) * nb <= a.f.len() && out.len() >= nt * GROUP);
}

/// Q4_K (`FIVE` = false) / Q5_K interleaved group × `nt` tokens: per sub-block, `vpdpbusd`
/// gives one exact i32 dot per row, multiplied by that row's 6-bit scale; mins use the
/// activation 16-sums.
///
/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q45k_group<const FIVE: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_q45k(w, kx16_bytes(FIVE), a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        let mut j = 0;
        while j + 4 <= nt {
            q45k_tile::<4, FIVE>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 4;
        }
        while j < nt {
            q45k_tile::<1, FIVE>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 1;
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q45k_tile<const T: usize, const FIVE: bool>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
) {
    let nb = a.cols / 256;
    let (x16, qs) = (kx16_bytes(FIVE), kx16_qs(FIVE));
    let m4 = _mm512_set1_epi8(0x0F);
    let one = _mm512_set1_epi8(1);
    let mut acc = [_mm512_setzero_ps(); T];
    // SAFETY: the caller checked that w holds nb interleaved blocks and acts hold t..t+T.
    unsafe {
        let bytes16 = |p: *const u8| _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        for b in 0..nb {
            let blk = w.add(b * x16);
            let mut isum = [_mm512_setzero_si512(); T];
            for c in 0..4 {
                let sc_lo = bytes16(blk.add(Q4K_SCALES + 32 * c));
                let sc_hi = bytes16(blk.add(Q4K_SCALES + 32 * c + 16));
                let q = blk.add(qs + 512 * c);
                // 16-bit shifts by 2c / 2c+1 (< 8) then bit 0 of each byte: qh bit per byte.
                let (sh_lo, sh_hi) = (
                    _mm_cvtsi32_si128(2 * c as i32),
                    _mm_cvtsi32_si128(2 * c as i32 + 1),
                );
                let mut lo = [_mm512_setzero_si512(); 8];
                let mut hi = [_mm512_setzero_si512(); 8];
                for k in 0..8 {
                    let v = _mm512_loadu_si512(q.add(64 * k) as *const _);
                    lo[k] = _mm512_and_si512(v, m4);
                    hi[k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    if FIVE {
                        let h = _mm512_loadu_si512(blk.add(Q5K_QH + 64 * k) as *const _);
                        let bl = _mm512_and_si512(_mm512_srl_epi16(h, sh_lo), one);
                        let bh = _mm512_and_si512(_mm512_srl_epi16(h, sh_hi), one);
                        lo[k] = _mm512_or_si512(lo[k], _mm512_slli_epi16(bl, 4));
                        hi[k] = _mm512_or_si512(hi[k], _mm512_slli_epi16(bh, 4));
                    }
                }
                for (j, isum) in isum.iter_mut().enumerate() {
                    let y = a.qs.as_ptr().add((t + j) * a.cols + b * 256 + 64 * c);
                    let yw =
                        |o: usize| _mm512_set1_epi32((y.add(o) as *const i32).read_unaligned());
                    let mut s_lo = _mm512_setzero_si512();
                    let mut s_hi = _mm512_setzero_si512();
                    for k in 0..8 {
                        s_lo = _mm512_dpbusd_epi32(s_lo, lo[k], yw(4 * k));
                        s_hi = _mm512_dpbusd_epi32(s_hi, hi[k], yw(32 + 4 * k));
                    }
                    let p = _mm512_add_epi32(
                        _mm512_mullo_epi32(s_lo, sc_lo),
                        _mm512_mullo_epi32(s_hi, sc_hi),
                    );
                    *isum = _mm512_add_epi32(*isum, p);
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q4K_DMIN) as *const __m256i));
            for (j, acc) in acc.iter_mut().enumerate() {
                let tt = t + j;
                let bs = a.bsums.as_ptr().add((tt * a.cols + b * 256) / 16);
                let mut msum = _mm512_setzero_si512();
                for s in 0..8 {
                    let bj = *bs.add(2 * s) as i32 + *bs.add(2 * s + 1) as i32;
                    let mn = bytes16(blk.add(Q4K_MINS + 16 * s));
                    msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(mn, _mm512_set1_epi32(bj)));
                }
                let dy = _mm512_set1_ps(*a.f.get_unchecked(tt * nb + b));
                // acc + d·dy·isum − dmin·dy·msum, as scalar::k_update.
                let r = _mm512_fmadd_ps(_mm512_mul_ps(d, dy), _mm512_cvtepi32_ps(isum[j]), *acc);
                *acc = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dy), _mm512_cvtepi32_ps(msum), r);
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(j * GROUP), *acc);
        }
    }
}

/// Q6_K interleaved group × `nt` tokens: unsigned 6-bit quants (q + 32) through `vpdpbusd`
/// per 16-element sub-block, the +32 removed with the activation 16-sum, then the row scale.
///
/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q6k_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * Q6K_X16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * a.cols / 16 <= a.bsums.len());
    assert!((t0 + nt) * nb <= a.f.len() && out.len() >= nt * GROUP);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        let mut j = 0;
        while j + 4 <= nt {
            q6k_tile::<4>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 4;
        }
        while j < nt {
            q6k_tile::<1>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 1;
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 256;
    let m4 = _mm512_set1_epi8(0x0F);
    let m3 = _mm512_set1_epi8(3);
    let mut acc = [_mm512_setzero_ps(); T];
    // SAFETY: the caller checked that w holds nb interleaved blocks and acts hold t..t+T.
    unsafe {
        let load = |p: *const u8| _mm512_loadu_si512(p as *const _);
        let hb = |x: __m512i| _mm512_slli_epi16(_mm512_and_si512(x, m3), 4);
        for b in 0..nb {
            let blk = w.add(b * Q6K_X16);
            let mut isum = [_mm512_setzero_si512(); T];
            for n in 0..2 {
                for half in 0..2 {
                    // sacc[j][k]: sub-block 8n + 2k + half of token j.
                    let mut sacc = [[_mm512_setzero_si512(); 4]; T];
                    for l4 in 4 * half..4 * half + 4 {
                        let qa = load(blk.add(Q6K_QL + 64 * (16 * n + l4)));
                        let qb = load(blk.add(Q6K_QL + 64 * (16 * n + 8 + l4)));
                        let h = load(blk.add(Q6K_QH + 64 * (8 * n + l4)));
                        let q = [
                            _mm512_or_si512(_mm512_and_si512(qa, m4), hb(h)),
                            _mm512_or_si512(_mm512_and_si512(qb, m4), hb(_mm512_srli_epi16(h, 2))),
                            _mm512_or_si512(
                                _mm512_and_si512(_mm512_srli_epi16(qa, 4), m4),
                                hb(_mm512_srli_epi16(h, 4)),
                            ),
                            _mm512_or_si512(
                                _mm512_and_si512(_mm512_srli_epi16(qb, 4), m4),
                                hb(_mm512_srli_epi16(h, 6)),
                            ),
                        ];
                        for (j, sacc) in sacc.iter_mut().enumerate() {
                            let y =
                                a.qs.as_ptr()
                                    .add((t + j) * a.cols + b * 256 + 128 * n + 4 * l4);
                            for k in 0..4 {
                                let yk = _mm512_set1_epi32(
                                    (y.add(32 * k) as *const i32).read_unaligned(),
                                );
                                sacc[k] = _mm512_dpbusd_epi32(sacc[k], q[k], yk);
                            }
                        }
                    }
                    for k in 0..4 {
                        let s = 8 * n + 2 * k + half;
                        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                            blk.add(Q6K_SCALES + 16 * s) as *const __m128i,
                        ));
                        for (j, isum) in isum.iter_mut().enumerate() {
                            let bs = *a.bsums.get_unchecked(((t + j) * a.cols + b * 256) / 16 + s);
                            let v = _mm512_sub_epi32(sacc[j][k], _mm512_set1_epi32(32 * bs as i32));
                            *isum = _mm512_add_epi32(*isum, _mm512_mullo_epi32(v, sc));
                        }
                    }
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            for (j, acc) in acc.iter_mut().enumerate() {
                let dy = _mm512_set1_ps(*a.f.get_unchecked((t + j) * nb + b));
                *acc = _mm512_fmadd_ps(_mm512_mul_ps(d, dy), _mm512_cvtepi32_ps(isum[j]), *acc);
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(j * GROUP), *acc);
        }
    }
}
