//! The AVX2 and AVX-512 kernels for interleaved IQ4_XS groups (`kernels/iq4xs.rs` has the
//! layout and the numerical contract): exact integer lane sums, one vector lane per row, the
//! scalar kernel's float steps, hence bit-identical results. On AVX-512 CPUs a lone token runs
//! the AVX2 decode (an AVX-512 one this file had swept the weights token by token, with no
//! prefetch, and measured slower on a Zen 5 VM: 94 against 117 tok/s), and prefill runs
//! AVX-512 tiles that take all 16 rows of a group at once ([`iq4xs_group_avx512`]).

use std::arch::x86_64::*;

use super::super::iq4xs::{QS, SCALES, X16};
use super::super::lut4::KVALUES_IQ4NL;
use super::super::matrix::GROUP;
use super::super::quant_acts::QuantizedActs;
use super::iq4xs_prep;
use super::kquant_avx2::prefetch_ahead;

fn check_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * X16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * nb <= a.f.len());
    assert!(out.len() >= nt * GROUP);
}

/// Tokens per AVX2 tile: each unpack of the weights (two table lookups and their magnitudes
/// per 32 bytes) serves this many tokens.
pub(super) const TILE: usize = 4;

/// # Safety
/// Requires AVX2, FMA and F16C.
// Not inlined into [`iq4xs_group_avx512`]'s decode, so that runs this very code.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq4xs_group_avx2(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    check_group(w, a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        let (w, out) = (w.as_ptr(), out.as_mut_ptr());
        // Several tiles: the weights unpacked once for all of them, in a function of its own
        // (inlined here, it measured the decode of a lone token 8% slower).
        let mut j = if nt >= 2 * TILE {
            iq4xs_prep::avx2_tiles(w, a, t0, nt, out)
        } else {
            0
        };
        while j + TILE <= nt {
            tile_avx2::<TILE>(w, a, t0 + j, out.add(j * GROUP));
            j += TILE;
        }
        // Single tokens (decode) keep a sub-block-outer walk over the weights in address
        // order: this tile's lane-pair-outer walk measured 40% slower for one token.
        while j < nt {
            token_avx2(w, a, t0 + j, out.add(j * GROUP));
            j += 1;
        }
    }
}

/// `T` tokens of a group, lane pair by lane pair (lane `k` takes the low nibbles of each
/// sub-block's 4-byte run `k`, lane `4 + k` the high ones): a lane's 8 sub-blocks are summed
/// in registers, `pmaddwd` with the sub-block scale as an `(s, s)` i16 pair per row adding each
/// product pair into an exact i32 (the same integer as `pmaddwd` by ones, then `pmulld` by
/// `s`), and the float steps are the scalar kernel's, each lane's in block order.
// `k` indexes the weight runs, the activation offsets and the lanes alike.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens
    // t..t+T; features enabled.
    unsafe {
        let tbl =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        tile_body_avx2::<T, _>(
            w,
            a,
            t,
            out,
            |_, blk, h| {
                // Signed 6-bit scales (one per row) as (s, s) i16 pairs per i32 lane.
                let sc: [__m256i; 8] = std::array::from_fn(|s| {
                    let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        blk.add(SCALES + GROUP * s + 8 * h) as *const __m128i,
                    ));
                    _mm256_or_si256(
                        _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)),
                        _mm256_slli_epi32(v, 16),
                    )
                });
                (blk, sc)
            },
            |&(blk, sc), h, k, s| {
                let v =
                    _mm256_loadu_si256(blk.add(QS + 256 * s + 64 * k + 32 * h) as *const __m256i);
                let lo = _mm256_shuffle_epi8(tbl, _mm256_and_si256(v, m4));
                let hi = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                [lo, hi, _mm256_abs_epi8(lo), _mm256_abs_epi8(hi), sc[s]]
            },
        )
    }
}

/// The tile loop both AVX2 prefill tiles share (this file's, which unpacks the weights as it
/// goes, and `iq4xs_prep`'s, which reads them unpacked once per call): `T` tokens, lane pair
/// by lane pair (lane `k` takes the low nibbles of each sub-block's 4-byte run `k`, lane `4 +
/// k` the high ones), each lane's 8 sub-blocks summed in registers, `pmaddwd` with the
/// sub-block scale as an `(s, s)` i16 pair per row adding each product pair into an exact i32,
/// and the scalar kernel's float steps, each lane's in block order. Per row half `h` and block
/// `b` (its bytes `blk`) `block(b, blk, h)` gives what `sub(.., h, k, s)` reads: the values of
/// the sub-block `s`'s run `k` (low and high nibbles), their magnitudes and the scales.
///
/// # Safety
/// `w` holds `cols / 256` blocks of 16 rows, `a` tokens `t..t + T`, `out` `T · 16` floats;
/// AVX2, FMA and F16C enabled.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub(super) unsafe fn tile_body_avx2<const T: usize, B>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
    mut block: impl FnMut(usize, *const u8, usize) -> B,
    mut sub: impl FnMut(&B, usize, usize, usize) -> [__m256i; 5],
) {
    let nb = a.cols / 256;
    // SAFETY: as the caller promises.
    unsafe {
        for h in 0..2 {
            let mut acc = [[_mm256_setzero_ps(); 8]; T];
            for b in 0..nb {
                let blk = w.add(b * X16);
                let src = block(b, blk, h);
                let ys: [*const i8; T] =
                    std::array::from_fn(|j| a.qs.as_ptr().add((t + j) * a.cols + b * 256));
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
                let d: [__m256; T] = std::array::from_fn(|j| {
                    _mm256_mul_ps(d, _mm256_set1_ps(*a.f.get_unchecked((t + j) * nb + b)))
                });
                for k in 0..4 {
                    let mut lo_sum = [_mm256_setzero_si256(); T];
                    let mut hi_sum = [_mm256_setzero_si256(); T];
                    for s in 0..8 {
                        let [lo, hi, alo, ahi, sc] = sub(&src, h, k, s);
                        for j in 0..T {
                            let yw = |o: usize| {
                                _mm256_set1_epi32((ys[j].add(o) as *const i32).read_unaligned())
                            };
                            let pl =
                                _mm256_maddubs_epi16(alo, _mm256_sign_epi8(yw(32 * s + 4 * k), lo));
                            let ph = _mm256_maddubs_epi16(
                                ahi,
                                _mm256_sign_epi8(yw(32 * s + 16 + 4 * k), hi),
                            );
                            lo_sum[j] = _mm256_add_epi32(lo_sum[j], _mm256_madd_epi16(pl, sc));
                            hi_sum[j] = _mm256_add_epi32(hi_sum[j], _mm256_madd_epi16(ph, sc));
                        }
                    }
                    for j in 0..T {
                        acc[j][k] = _mm256_fmadd_ps(d[j], _mm256_cvtepi32_ps(lo_sum[j]), acc[j][k]);
                        acc[j][4 + k] =
                            _mm256_fmadd_ps(d[j], _mm256_cvtepi32_ps(hi_sum[j]), acc[j][4 + k]);
                    }
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h), lanes_sum!(_mm256_add_ps, acc));
            }
        }
    }
}

/// One token of a group, sub-block by sub-block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn token_avx2(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 256;
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold token t.
    unsafe {
        let tbl =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); 8];
            for b in 0..nb {
                let blk = w.add(b * X16);
                let y = a.qs.as_ptr().add(t * a.cols + b * 256);
                let mut lanes = [_mm256_setzero_si256(); 8];
                for s in 0..8 {
                    // Decode reads each weight once, from memory: the first half's pass
                    // prefetches two blocks ahead, as the K-quant tiles do.
                    if h == 0 {
                        prefetch_ahead(blk, X16, s, 8);
                    }
                    let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        blk.add(SCALES + GROUP * s + 8 * h) as *const __m128i,
                    ));
                    let dot = |wv: __m256i, o: usize| {
                        let yv = _mm256_set1_epi32((y.add(o) as *const i32).read_unaligned());
                        let p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(yv, wv));
                        _mm256_mullo_epi32(sc, _mm256_madd_epi16(p, ones))
                    };
                    for k in 0..4 {
                        let v = _mm256_loadu_si256(
                            blk.add(QS + 256 * s + 64 * k + 32 * h) as *const __m256i
                        );
                        let lo = _mm256_shuffle_epi8(tbl, _mm256_and_si256(v, m4));
                        let hi =
                            _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                        lanes[k] = _mm256_add_epi32(lanes[k], dot(lo, 32 * s + 4 * k));
                        lanes[4 + k] = _mm256_add_epi32(lanes[4 + k], dot(hi, 32 * s + 16 + 4 * k));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
                let d = _mm256_mul_ps(d, _mm256_set1_ps(*a.f.get_unchecked(t * nb + b)));
                for (acc, l) in acc.iter_mut().zip(&lanes) {
                    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(*l), *acc);
                }
            }
            _mm256_storeu_ps(out.add(8 * h), lanes_sum!(_mm256_add_ps, acc));
        }
    }
}

/// Tokens per AVX-512 tile: 8 measured 3-6% ahead of 4 on the dense shapes of
/// `examples/prefill_bench.rs` (Zen 5 VM, thread CPU time, alternated), the same on 64 tokens.
pub(super) const TILE_512: usize = 8;

/// A lone token runs [`iq4xs_group_avx2`]'s decode; more run AVX-512 tiles of [`TILE_512`].
///
/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn iq4xs_group_avx512(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    if nt < 2 {
        // SAFETY: features guaranteed by the caller; that kernel checks its bounds.
        return unsafe { iq4xs_group_avx2(w, a, t0, nt, out) };
    }
    check_group(w, a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
        if nt >= 2 * TILE_512 {
            // Several tiles: the weights unpacked once for all of them.
            return iq4xs_prep::avx512_tiles(wp, a, t0, nt, op);
        }
        let mut j = 0;
        while j + TILE_512 <= nt {
            tile_avx512::<TILE_512>(wp, a, t0 + j, op.add(j * GROUP));
            j += TILE_512;
        }
        match nt - j {
            0 => {}
            1 => tile_avx512::<1>(wp, a, t0 + j, op.add(j * GROUP)),
            2 => tile_avx512::<2>(wp, a, t0 + j, op.add(j * GROUP)),
            3 => tile_avx512::<3>(wp, a, t0 + j, op.add(j * GROUP)),
            4 => tile_avx512::<4>(wp, a, t0 + j, op.add(j * GROUP)),
            5 => tile_avx512::<5>(wp, a, t0 + j, op.add(j * GROUP)),
            6 => tile_avx512::<6>(wp, a, t0 + j, op.add(j * GROUP)),
            _ => tile_avx512::<7>(wp, a, t0 + j, op.add(j * GROUP)),
        }
    }
}

/// [`tile_avx2`] on all 16 rows of a group: AVX-512 has no `vpsignb`, so each weight vector's
/// signs are kept as a mask and each token's activation word is negated under it
/// (`vpsubb` with a mask) before `vpmaddubsw` by the weights' magnitudes; `vpdpwssd` by the
/// sub-block scale adds each product pair into the lane's exact i32.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_avx512<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens
    // t..t+T; AVX-512 enabled.
    unsafe {
        let m4 = _mm512_set1_epi8(0x0F);
        let tbl = _mm512_broadcast_i32x4(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        tile_body_512::<T, _>(
            w,
            a,
            t,
            out,
            |_, blk| {
                // Signed 6-bit scales (one per row) as (s, s) i16 pairs per i32 lane.
                let sc: [__m512i; 8] = std::array::from_fn(|s| {
                    let v = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                        blk.add(SCALES + GROUP * s) as *const __m128i
                    ));
                    let v = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF));
                    _mm512_or_si512(v, _mm512_slli_epi32(v, 16))
                });
                (blk, sc)
            },
            |&(blk, sc), k, s| {
                let v = _mm512_loadu_si512(blk.add(QS + 256 * s + 64 * k) as *const _);
                let lo = _mm512_shuffle_epi8(tbl, _mm512_and_si512(v, m4));
                let hi = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                [lo, hi, _mm512_abs_epi8(lo), _mm512_abs_epi8(hi), sc[s]]
            },
        )
    }
}

/// [`tile_body_avx2`] on AVX-512, all 16 rows at once: `block(b, blk)` and `sub(.., k, s)` as
/// there, the activations' signs applied by masked subtraction and the products added by VNNI
/// `vpdpwssd` (the same exact i32 sums).
///
/// # Safety
/// As [`tile_body_avx2`], with AVX-512 F/BW/VL and VNNI enabled.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub(super) unsafe fn tile_body_512<const T: usize, B>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
    mut block: impl FnMut(usize, *const u8) -> B,
    mut sub: impl FnMut(&B, usize, usize) -> [__m512i; 5],
) {
    let nb = a.cols / 256;
    // SAFETY: as the caller promises.
    unsafe {
        let zero = _mm512_setzero_si512();
        let mut acc = [[_mm512_setzero_ps(); 8]; T];
        for b in 0..nb {
            let blk = w.add(b * X16);
            let src = block(b, blk);
            let ys: [*const i8; T] =
                std::array::from_fn(|j| a.qs.as_ptr().add((t + j) * a.cols + b * 256));
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let d: [__m512; T] = std::array::from_fn(|j| {
                _mm512_mul_ps(d, _mm512_set1_ps(*a.f.get_unchecked((t + j) * nb + b)))
            });
            for k in 0..4 {
                let mut lo_sum = [zero; T];
                let mut hi_sum = [zero; T];
                for s in 0..8 {
                    let [lo, hi, alo, ahi, sc] = sub(&src, k, s);
                    let (nlo, nhi) = (_mm512_movepi8_mask(lo), _mm512_movepi8_mask(hi));
                    for j in 0..T {
                        let yw = |o: usize| {
                            _mm512_set1_epi32((ys[j].add(o) as *const i32).read_unaligned())
                        };
                        let yl = yw(32 * s + 4 * k);
                        let yh = yw(32 * s + 16 + 4 * k);
                        let pl = _mm512_maddubs_epi16(alo, _mm512_mask_sub_epi8(yl, nlo, zero, yl));
                        let ph = _mm512_maddubs_epi16(ahi, _mm512_mask_sub_epi8(yh, nhi, zero, yh));
                        lo_sum[j] = _mm512_dpwssd_epi32(lo_sum[j], pl, sc);
                        hi_sum[j] = _mm512_dpwssd_epi32(hi_sum[j], ph, sc);
                    }
                }
                for j in 0..T {
                    acc[j][k] = _mm512_fmadd_ps(d[j], _mm512_cvtepi32_ps(lo_sum[j]), acc[j][k]);
                    acc[j][4 + k] =
                        _mm512_fmadd_ps(d[j], _mm512_cvtepi32_ps(hi_sum[j]), acc[j][4 + k]);
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(j * GROUP), lanes_sum!(_mm512_add_ps, acc));
        }
    }
}
