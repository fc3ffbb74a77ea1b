//! AVX-512 VNNI kernels for the interleaved Q4_0/Q8_0 groups: one 64-byte load holds 4 quant
//! bytes of each of the 16 rows, and `vpdpbusd` with a broadcast activation word accumulates
//! one i32 per row. Integer sums are exact, so results equal the scalar/AVX2 ones bit for bit.

use std::arch::x86_64::*;

use super::super::matrix::{
    kx16_bytes, kx16_qs, q6k_runs, GROUP, Q1_MIN, Q1_QS, Q1_X16, Q4K_DMIN, Q4K_MINS, Q4K_SCALES,
    Q5K_QH, Q6K_SCALES, Q6K_X16,
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
        // Small batches (batched decode) also share each weight load.
        if j + 2 <= nt {
            $tile::<2>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 2;
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
    unsafe {
        let mut j = 0;
        while j + 2 <= nt {
            q8_0_tile::<2>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 2;
        }
        if j < nt {
            q8_0_tile::<1>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
        }
    }
}

/// Q8_0 in `scalar::q8_0_group`'s (llama.cpp's) order: per row, lane `k` accumulates the dot
/// of elements `4k..4k+4` of each block. `vpdpbusd` wants unsigned weights, so it multiplies
/// w + 128 (the sign bit flipped) and the activations' `128·Σ` of those 4 elements comes off.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 32;
    let zero = _mm512_setzero_si512();
    let flip = _mm512_set1_epi8(-128);
    let mut acc = [[_mm512_setzero_ps(); 8]; T];
    assert!((t + T) * a.cols / 4 <= a.corr4.len());
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens t..t+T.
    unsafe {
        for b in 0..nb {
            let blk = w.add(b * GROUP * 34);
            let dx = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let mut wu = [zero; 8];
            for (k, wu) in wu.iter_mut().enumerate() {
                let v = _mm512_loadu_si512(blk.add(32 + 64 * k) as *const _);
                *wu = _mm512_xor_si512(v, flip);
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let y = a.qs.as_ptr().add((t + j) * a.cols + b * 32);
                let corr = a.corr4.as_ptr().add(((t + j) * a.cols + b * 32) / 4);
                let d = _mm512_mul_ps(dx, _mm512_set1_ps(*a.f.get_unchecked((t + j) * nb + b)));
                for k in 0..8 {
                    let yk = _mm512_set1_epi32((y.add(4 * k) as *const i32).read_unaligned());
                    let s = _mm512_sub_epi32(
                        _mm512_dpbusd_epi32(zero, wu[k], yk),
                        _mm512_set1_epi32(*corr.add(k)),
                    );
                    acc[k] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), acc[k]);
                }
            }
        }
        for (j, a) in acc.iter().enumerate() {
            let r = _mm512_add_ps(
                _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])),
            );
            _mm512_storeu_ps(out.add(j * GROUP), r);
        }
    }
}

fn check_q45k(w: &[u8], x16: usize, a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * x16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * a.cols / 16 <= a.bsums.len());
    assert!((t0 + nt) * nb <= a.f.len() && out.len() >= nt * GROUP);
}

/// Q4_K (`FIVE` = false) / Q5_K interleaved group × `nt` tokens in `scalar::q45k_group`'s
/// (llama.cpp's) order: per 4-byte run `k`, `vpdpbusd` gives each row's exact dot of the
/// low / high nibbles, times the row's sub-block scale, into lane `k`; mins from the activation
/// 32-sums.
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
    for j in 0..nt {
        // SAFETY: bounds checked above; features guaranteed by the caller.
        unsafe { q45k_token::<FIVE>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP)) };
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q45k_token<const FIVE: bool>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 256;
    let (x16, qs) = (kx16_bytes(FIVE), kx16_qs(FIVE));
    let m4 = _mm512_set1_epi8(0x0F);
    let one = _mm512_set1_epi8(1);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); 8];
    let mut accm = [_mm512_setzero_ps(); 4];
    // SAFETY: the caller checked that w holds nb interleaved blocks and acts hold token t.
    unsafe {
        let bytes16 = |p: *const u8| _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        for b in 0..nb {
            let blk = w.add(b * x16);
            let y = a.qs.as_ptr().add(t * a.cols + b * 256);
            let yw = |o: usize| _mm512_set1_epi32((y.add(o) as *const i32).read_unaligned());
            let mut lanes = [zero; 8];
            for c in 0..4 {
                let sc_lo = bytes16(blk.add(Q4K_SCALES + 32 * c));
                let sc_hi = bytes16(blk.add(Q4K_SCALES + 32 * c + 16));
                // 16-bit shifts by 2c / 2c+1 (< 8) then bit 0 of each byte: qh bit per byte.
                let sh_lo = _mm_cvtsi32_si128(2 * c as i32);
                let sh_hi = _mm_cvtsi32_si128(2 * c as i32 + 1);
                for (k, lane) in lanes.iter_mut().enumerate() {
                    let v = _mm512_loadu_si512(blk.add(qs + 512 * c + 64 * k) as *const _);
                    let mut lo = _mm512_and_si512(v, m4);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    if FIVE {
                        let h = _mm512_loadu_si512(blk.add(Q5K_QH + 64 * k) as *const _);
                        let bl = _mm512_and_si512(_mm512_srl_epi16(h, sh_lo), one);
                        let bh = _mm512_and_si512(_mm512_srl_epi16(h, sh_hi), one);
                        lo = _mm512_or_si512(lo, _mm512_slli_epi16(bl, 4));
                        hi = _mm512_or_si512(hi, _mm512_slli_epi16(bh, 4));
                    }
                    let s_lo = _mm512_dpbusd_epi32(zero, lo, yw(64 * c + 4 * k));
                    let s_hi = _mm512_dpbusd_epi32(zero, hi, yw(64 * c + 32 + 4 * k));
                    let p = _mm512_add_epi32(
                        _mm512_mullo_epi32(s_lo, sc_lo),
                        _mm512_mullo_epi32(s_hi, sc_hi),
                    );
                    *lane = _mm512_add_epi32(*lane, p);
                }
            }
            let dy = *a.f.get_unchecked(t * nb + b);
            let dx = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let dmx = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q4K_DMIN) as *const __m256i));
            let d = _mm512_mul_ps(_mm512_set1_ps(dy), dx);
            let dmin = _mm512_mul_ps(_mm512_set1_ps(-dy), dmx);
            if FIVE {
                for (acc, &l) in acc.iter_mut().zip(&lanes) {
                    *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(l), *acc);
                }
            } else {
                let isum = lanes.iter().fold(zero, |s, &l| _mm512_add_epi32(s, l));
                let dd = _mm512_mul_ps(dx, _mm512_set1_ps(dy));
                acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dd, acc[0]);
            }
            let bs = a.bsums.as_ptr().add((t * a.cols + b * 256) / 16);
            let prod: [__m512i; 4] = std::array::from_fn(|p| {
                let term = |s: usize| {
                    let bj = *bs.add(2 * s) as i32 + *bs.add(2 * s + 1) as i32;
                    _mm512_mullo_epi32(bytes16(blk.add(Q4K_MINS + 16 * s)), _mm512_set1_epi32(bj))
                };
                _mm512_add_epi32(term(2 * p), term(2 * p + 1))
            });
            let msum = _mm512_add_epi32(
                _mm512_add_epi32(prod[0], prod[1]),
                _mm512_add_epi32(prod[2], prod[3]),
            );
            if FIVE {
                // `summs += dmin * msum` in llama.cpp: product, then sum (not fused).
                accm[0] = _mm512_add_ps(accm[0], _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(msum)));
            } else {
                let dm = _mm512_mul_ps(dmx, _mm512_set1_ps(dy));
                accm[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), dm, accm[0]);
            }
        }
        let r = if FIVE {
            let r = _mm512_add_ps(
                _mm512_add_ps(_mm512_add_ps(acc[0], acc[4]), _mm512_add_ps(acc[2], acc[6])),
                _mm512_add_ps(_mm512_add_ps(acc[1], acc[5]), _mm512_add_ps(acc[3], acc[7])),
            );
            _mm512_add_ps(r, accm[0])
        } else {
            _mm512_sub_ps(acc[0], accm[0])
        };
        _mm512_storeu_ps(out, r);
    }
}

/// Q6_K interleaved group × `nt` tokens in `scalar::q6k_group`'s (llama.cpp's) lane order:
/// `vpdpbusd` of the unsigned quants (q + 32) per 4-element run, the +32 removed with the run's
/// activation sum, times the row's sub-block scale, into lane `run % 8`.
///
/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q6k_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * Q6K_X16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * nb <= a.f.len());
    assert!(out.len() >= nt * GROUP);
    for j in 0..nt {
        // SAFETY: bounds checked above; features guaranteed by the caller.
        unsafe { q6k_token(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP)) };
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_token(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 256;
    let m4 = _mm512_set1_epi8(0x0F);
    let m3 = _mm512_set1_epi8(3);
    let c32 = _mm512_set1_epi8(32);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); 8];
    // SAFETY: the caller checked that w holds nb interleaved blocks and acts hold token t.
    unsafe {
        let load = |p: *const u8| _mm512_loadu_si512(p as *const _);
        let hb = |x: __m512i| _mm512_slli_epi16(_mm512_and_si512(x, m3), 4);
        for b in 0..nb {
            let blk = w.add(b * Q6K_X16);
            let y = a.qs.as_ptr().add(t * a.cols + b * 256);
            let mut lanes = [zero; 8];
            for n in 0..2 {
                for (l4, lane) in lanes.iter_mut().enumerate() {
                    let qa = load(blk.add(q6k_runs(n, l4)));
                    let qb = load(blk.add(q6k_runs(n, l4) + 64));
                    let h = load(blk.add(q6k_runs(n, l4) + 128));
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
                    for (k, &qk) in q.iter().enumerate() {
                        let o = 128 * n + 32 * k + 4 * l4;
                        let yk = _mm512_set1_epi32((y.add(o) as *const i32).read_unaligned());
                        let s = _mm512_sub_epi32(
                            _mm512_dpbusd_epi32(zero, qk, yk),
                            _mm512_dpbusd_epi32(zero, c32, yk),
                        );
                        let sub = 8 * n + 2 * k + l4 / 4;
                        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                            blk.add(Q6K_SCALES + 16 * sub) as *const __m128i,
                        ));
                        *lane = _mm512_add_epi32(*lane, _mm512_mullo_epi32(s, sc));
                    }
                }
            }
            let dx = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let d = _mm512_mul_ps(_mm512_set1_ps(*a.f.get_unchecked(t * nb + b)), dx);
            for (acc, &l) in acc.iter_mut().zip(&lanes) {
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(l), *acc);
            }
        }
        let r = _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(acc[0], acc[4]), _mm512_add_ps(acc[2], acc[6])),
            _mm512_add_ps(_mm512_add_ps(acc[1], acc[5]), _mm512_add_ps(acc[3], acc[7])),
        );
        _mm512_storeu_ps(out, r);
    }
}

/// Widened Q4_1/Q5_1 group × `nt` tokens, in `scalar::q1_group`'s (llama.cpp's) order: the
/// codes are unsigned bytes, so `vpdpbusd` takes them as they are.
///
/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q1_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    check_group(w, Q1_X16 / GROUP, a, t0, nt, out);
    assert!((t0 + nt) * (a.cols / 32) <= a.q8_1_s.len());
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        let mut j = 0;
        while j + 2 <= nt {
            q1_tile::<2>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += 2;
        }
        if j < nt {
            q1_tile::<1>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q1_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 32;
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); 8]; T];
    let mut summs = [_mm512_setzero_ps(); T];
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens t..t+T.
    unsafe {
        for b in 0..nb {
            let blk = w.add(b * Q1_X16);
            let dx = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let mx = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q1_MIN) as *const __m256i));
            let wk: [__m512i; 8] =
                std::array::from_fn(|k| _mm512_loadu_si512(blk.add(Q1_QS + 64 * k) as *const _));
            for j in 0..T {
                let idx = (t + j) * nb + b;
                let dy = *a.f.get_unchecked(idx);
                let sy = *a.q8_1_s.get_unchecked(idx);
                let y = a.qs.as_ptr().add((t + j) * a.cols + b * 32);
                let d = _mm512_mul_ps(dx, _mm512_set1_ps(dy));
                for (k, acc) in acc[j].iter_mut().enumerate() {
                    let yk = _mm512_set1_epi32((y.add(4 * k) as *const i32).read_unaligned());
                    let s = _mm512_dpbusd_epi32(zero, wk[k], yk);
                    *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), *acc);
                }
                summs[j] = _mm512_fmadd_ps(mx, _mm512_set1_ps(sy), summs[j]);
            }
        }
        for (j, a) in acc.iter().enumerate() {
            let r = _mm512_add_ps(
                _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])),
            );
            _mm512_storeu_ps(out.add(j * GROUP), _mm512_add_ps(r, summs[j]));
        }
    }
}
