//! AVX2 activation quantizers. Same IEEE operations as `quant_acts.rs` (max, one multiply,
//! round-half-even), so the quants and scales are identical to the scalar ones for finite input.

use std::arch::x86_64::*;

use half::f16;

/// Packs 4 × 8 i32 (each in i8 range after saturation) into 32 i8 in element order.
#[inline]
#[target_feature(enable = "avx2")]
fn pack32(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m256i {
    let ab = _mm256_packs_epi32(a, b); // a0-3 b0-3 | a4-7 b4-7
    let cd = _mm256_packs_epi32(c, d);
    let v = _mm256_packs_epi16(ab, cd); // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7
    _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

#[inline]
#[target_feature(enable = "avx2")]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)))
}

#[inline]
#[target_feature(enable = "avx2")]
fn load8(x: &[f32]) -> __m256 {
    let x: &[f32; 8] = x[..8].try_into().unwrap();
    // SAFETY: 8 readable floats.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

/// # Safety
/// Requires AVX2 (and FMA/F16C for the surrounding code).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in super::super) unsafe fn quantize_row_q8_0(
    x: &[f32],
    d: &mut [f32],
    qs: &mut [i8],
    sums: &mut [i32],
) {
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    const RND: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let v: [__m256; 4] = std::array::from_fn(|i| load8(&xb[8 * i..]));
        let m = v.iter().fold(_mm256_setzero_ps(), |m, &vi| {
            _mm256_max_ps(m, _mm256_and_ps(vi, abs))
        });
        let amax = hmax(m);
        d[b] = f16::from_f32(amax / 127.0).to_f32();
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            _mm256_cvtps_epi32(_mm256_round_ps::<RND>(_mm256_mul_ps(v[i], id)))
        });
        let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        sums[b] = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
        let out: &mut [i8; 32] = (&mut qs[32 * b..32 * b + 32]).try_into().unwrap();
        // SAFETY: 32 writable bytes.
        unsafe {
            _mm256_storeu_si256(
                out.as_mut_ptr() as *mut __m256i,
                pack32(q[0], q[1], q[2], q[3]),
            )
        };
    }
}

/// # Safety
/// Requires AVX2 (and FMA/F16C for the surrounding code).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in super::super) unsafe fn quantize_row_q8_k(
    x: &[f32],
    d: &mut [f32],
    qs: &mut [i8],
    bsums: &mut [i16],
) {
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    const RND: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (b, xb) in x.chunks_exact(256).enumerate() {
        let mut m = _mm256_setzero_ps();
        for c in xb.chunks_exact(8) {
            m = _mm256_max_ps(m, _mm256_and_ps(load8(c), abs));
        }
        let amax = hmax(m);
        let q = &mut qs[b * 256..(b + 1) * 256];
        if amax == 0.0 {
            d[b] = 0.0;
            q.fill(0);
            bsums[b * 16..(b + 1) * 16].fill(0);
            continue;
        }
        // The first element of largest magnitude sets the sign, as in the scalar scan. (With NaN
        // in the block no element may match: the output is garbage either way, but no panic.)
        let max = xb.iter().find(|v| v.abs() == amax).copied().unwrap_or(amax);
        let iscale = -127.0 / max;
        let is = _mm256_set1_ps(iscale);
        for (c, o) in xb.chunks_exact(32).zip(q.chunks_exact_mut(32)) {
            let v: [__m256i; 4] = std::array::from_fn(|i| {
                _mm256_cvtps_epi32(_mm256_round_ps::<RND>(_mm256_mul_ps(
                    load8(&c[8 * i..]),
                    is,
                )))
            });
            let o: &mut [i8; 32] = o.try_into().unwrap();
            // SAFETY: 32 writable bytes; packing saturates to 127 like the scalar min(127).
            unsafe {
                _mm256_storeu_si256(
                    o.as_mut_ptr() as *mut __m256i,
                    pack32(v[0], v[1], v[2], v[3]),
                )
            };
        }
        for (j, s) in bsums[b * 16..(b + 1) * 16].iter_mut().enumerate() {
            *s = q[j * 16..(j + 1) * 16].iter().map(|&v| v as i16).sum();
        }
        d[b] = 1.0 / iscale;
    }
}
