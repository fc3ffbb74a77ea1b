//! AVX2 and AVX-512 kernels for interleaved Q2_K / Q3_K groups (`kernels/k23.rs` has the layout
//! and the numerical contract): exact integer sums, one lane per row, the scalar kernel's float
//! steps, hence bit-identical results.

use std::arch::x86_64::*;

use super::super::k23::{qs, scales, x16, DMIN, HMASK, MINS};
use super::super::matrix::GROUP;
use super::super::quant_acts::QuantizedActs;

fn check_group(three: bool, w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * x16(three));
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * nb <= a.f.len());
    assert!((t0 + nt) * a.cols / 16 <= a.bsums.len());
    assert!(out.len() >= nt * GROUP);
}

/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k23_group_avx2<const THREE: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(THREE, w, a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        for j in 0..nt {
            token_avx2::<THREE>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn token_avx2<const THREE: bool>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 256;
    let (x16, qs, sc_at) = (x16(THREE), qs(THREE), scales(THREE));
    let m3 = _mm256_set1_epi8(3);
    let m1 = _mm256_set1_epi8(1);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold token t.
    unsafe {
        for h8 in 0..2 {
            let mut acc = [_mm256_setzero_ps(); 8];
            for b in 0..nb {
                let blk = w.add(b * x16);
                let y = a.qs.as_ptr().add(t * a.cols + b * 256);
                let bs = a.bsums.as_ptr().add((t * a.cols + b * 256) / 16);
                let dy = *a.f.get_unchecked(t * nb + b);
                if !THREE {
                    let dm =
                        _mm256_cvtph_ps(_mm_loadu_si128(blk.add(DMIN + 16 * h8) as *const __m128i));
                    let dmin = _mm256_mul_ps(_mm256_set1_ps(-dy), dm);
                    let m = |sub: usize| {
                        let mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                            blk.add(MINS + GROUP * sub + 8 * h8) as *const __m128i,
                        ));
                        _mm256_mullo_epi32(mn, _mm256_set1_epi32(*bs.add(sub) as i32))
                    };
                    for (l, acc) in acc.iter_mut().enumerate() {
                        let p = _mm256_add_epi32(m(2 * l), m(2 * l + 1));
                        *acc = _mm256_fmadd_ps(dmin, _mm256_cvtepi32_ps(p), *acc);
                    }
                }
                let mut lanes = [_mm256_setzero_si256(); 8];
                for n in 0..2 {
                    for s in 0..4 {
                        for h in 0..2 {
                            let sub = 8 * n + 2 * s + h;
                            let scp = _mm_loadl_epi64(
                                blk.add(sc_at + GROUP * sub + 8 * h8) as *const __m128i
                            );
                            let sc = if THREE {
                                _mm256_cvtepi8_epi32(scp)
                            } else {
                                _mm256_cvtepu8_epi32(scp)
                            };
                            for cc in 0..4 {
                                let c = 8 * n + 4 * h + cc;
                                let v = _mm256_loadu_si256(
                                    blk.add(qs + 64 * c + 32 * h8) as *const __m256i
                                );
                                let mut u = _mm256_and_si256(
                                    _mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * s as i32)),
                                    m3,
                                );
                                if THREE {
                                    let hm = _mm256_loadu_si256(
                                        blk.add(HMASK + 64 * (4 * h + cc) + 32 * h8)
                                            as *const __m256i,
                                    );
                                    let bit = _mm256_and_si256(
                                        _mm256_srl_epi16(hm, _mm_cvtsi32_si128((4 * n + s) as i32)),
                                        m1,
                                    );
                                    u = _mm256_or_si256(u, _mm256_slli_epi16(bit, 2));
                                }
                                let o = 128 * n + 32 * s + 16 * h + 4 * cc;
                                let yv =
                                    _mm256_set1_epi32((y.add(o) as *const i32).read_unaligned());
                                let mut dot = _mm256_madd_epi16(_mm256_maddubs_epi16(u, yv), ones);
                                if THREE {
                                    // The 3-bit code is q + 4: 4 × these 4 activations come off.
                                    let ys = (0..4).map(|i| *y.add(o + i) as i32).sum::<i32>();
                                    dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(4 * ys));
                                }
                                let l = 4 * h + cc;
                                lanes[l] = _mm256_add_epi32(lanes[l], _mm256_mullo_epi32(sc, dot));
                            }
                        }
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h8) as *const __m128i));
                let d = _mm256_mul_ps(_mm256_set1_ps(dy), d);
                for (acc, l) in acc.iter_mut().zip(&lanes) {
                    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(*l), *acc);
                }
            }
            _mm256_storeu_ps(out.add(8 * h8), lanes_sum!(_mm256_add_ps, acc));
        }
    }
}

/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn k23_group_avx512<const THREE: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(THREE, w, a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        for j in 0..nt {
            token_avx512::<THREE>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn token_avx512<const THREE: bool>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
) {
    let nb = a.cols / 256;
    let (x16, qs, sc_at) = (x16(THREE), qs(THREE), scales(THREE));
    let m3 = _mm512_set1_epi8(3);
    let m1 = _mm512_set1_epi8(1);
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold token t.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 8];
        for b in 0..nb {
            let blk = w.add(b * x16);
            let y = a.qs.as_ptr().add(t * a.cols + b * 256);
            let bs = a.bsums.as_ptr().add((t * a.cols + b * 256) / 16);
            let dy = *a.f.get_unchecked(t * nb + b);
            if !THREE {
                let dm = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(DMIN) as *const __m256i));
                let dmin = _mm512_mul_ps(_mm512_set1_ps(-dy), dm);
                let m = |sub: usize| {
                    let mn = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                        blk.add(MINS + GROUP * sub) as *const __m128i
                    ));
                    _mm512_mullo_epi32(mn, _mm512_set1_epi32(*bs.add(sub) as i32))
                };
                for (l, acc) in acc.iter_mut().enumerate() {
                    let p = _mm512_add_epi32(m(2 * l), m(2 * l + 1));
                    *acc = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(p), *acc);
                }
            }
            let mut lanes = [_mm512_setzero_si512(); 8];
            for n in 0..2 {
                for s in 0..4 {
                    for h in 0..2 {
                        let sub = 8 * n + 2 * s + h;
                        let scp = _mm_loadu_si128(blk.add(sc_at + GROUP * sub) as *const __m128i);
                        let sc = if THREE {
                            _mm512_cvtepi8_epi32(scp)
                        } else {
                            _mm512_cvtepu8_epi32(scp)
                        };
                        for cc in 0..4 {
                            let c = 8 * n + 4 * h + cc;
                            let v = _mm512_loadu_si512(blk.add(qs + 64 * c) as *const _);
                            let mut u = _mm512_and_si512(
                                _mm512_srl_epi16(v, _mm_cvtsi32_si128(2 * s as i32)),
                                m3,
                            );
                            if THREE {
                                let hm = _mm512_loadu_si512(
                                    blk.add(HMASK + 64 * (4 * h + cc)) as *const _
                                );
                                let bit = _mm512_and_si512(
                                    _mm512_srl_epi16(hm, _mm_cvtsi32_si128((4 * n + s) as i32)),
                                    m1,
                                );
                                u = _mm512_or_si512(u, _mm512_slli_epi16(bit, 2));
                            }
                            let o = 128 * n + 32 * s + 16 * h + 4 * cc;
                            let yv = _mm512_set1_epi32((y.add(o) as *const i32).read_unaligned());
                            let mut dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, yv);
                            if THREE {
                                let ys = (0..4).map(|i| *y.add(o + i) as i32).sum::<i32>();
                                dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(4 * ys));
                            }
                            let l = 4 * h + cc;
                            lanes[l] = _mm512_add_epi32(lanes[l], _mm512_mullo_epi32(sc, dot));
                        }
                    }
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let d = _mm512_mul_ps(_mm512_set1_ps(dy), d);
            for (acc, l) in acc.iter_mut().zip(&lanes) {
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(*l), *acc);
            }
        }
        _mm512_storeu_ps(out, lanes_sum!(_mm512_add_ps, acc));
    }
}
