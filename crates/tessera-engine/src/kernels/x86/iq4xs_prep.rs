//! IQ4_XS prefill from weights unpacked once per kernel call (`iq4xs.rs` has the kernels that
//! unpack them per tile, and the decode): a call of several tiles of tokens first writes its
//! group's nibble values, their magnitudes and the sub-block scales into a per-thread buffer,
//! and each tile loads them as they are. The integer sums and float steps are those of
//! `iq4xs.rs`'s tiles, in the same order, so the results are the same bits.

use std::arch::x86_64::*;

use super::super::iq4xs::{QS, SCALES, X16};
use super::super::lut4::KVALUES_IQ4NL;
use super::super::matrix::GROUP;
use super::super::quant_acts::QuantizedActs;
use super::iq4xs::{tile_body_512, tile_body_avx2, TILE, TILE_512};

thread_local! {
    /// Each pool thread's buffer of a group's unpacked weights ([`prepare`]).
    static PREP: std::cell::RefCell<Vec<[i32; 8]>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `iq4xs_group_avx2`'s whole tiles of [`TILE`] tokens of `t0..t0 + nt` from [`prepare`]'s vectors; returns how
/// many tokens they took.
///
/// # Safety
/// As `iq4xs_group_avx2`, with its bounds checked.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn avx2_tiles(
    w: *const u8,
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: *mut f32,
) -> usize {
    PREP.with_borrow_mut(|prep| {
        let nb = a.cols / 256;
        prep.resize(nb * PREP_VECS, [0; 8]);
        let pv = prep.as_mut_ptr() as *mut __m256i;
        let mut j = 0;
        // SAFETY: w holds nb blocks, prep nb · PREP_VECS vectors, acts tokens t0..t0+nt, out
        // nt · GROUP floats (caller); features guaranteed by the caller.
        unsafe {
            prepare(w, nb, pv);
            while j + TILE <= nt {
                tile_prepared::<TILE>(w, pv, a, t0 + j, out.add(j * GROUP));
                j += TILE;
            }
        }
        j
    })
}

/// Vectors [`prepare`] writes per block: per row half, 4 per (lane pair `k`, sub-block `s`)
/// and 8 scale vectors.
const PREP_VECS: usize = 2 * (4 * 32 + 8);

/// The prepared vectors of sub-block `s`'s run `k` from a block's (or row half's) first one
/// `at`: its low and high nibble values, their magnitudes, and the sub-block's scales (the
/// order [`prepare`] and [`prepare_512`] write them in).
///
/// # Safety
/// `at` must point at a block's prepared vectors.
#[inline(always)]
unsafe fn sub_block<V: Copy>(at: *const V, k: usize, s: usize) -> [V; 5] {
    // SAFETY: within the block's vectors (caller).
    unsafe {
        let o = at.add(4 * (8 * k + s));
        [
            o.read_unaligned(),
            o.add(1).read_unaligned(),
            o.add(2).read_unaligned(),
            o.add(3).read_unaligned(),
            at.add(128 + s).read_unaligned(),
        ]
    }
}

/// Where row half `h` of block `b` starts in the prepared vectors.
#[inline(always)]
fn prep_at(b: usize, h: usize) -> usize {
    (b * 2 + h) * (PREP_VECS / 2)
}

/// Per block `b` and row half `h` of a group, at [`prep_at`]`(b, h)`: for lane pair `k` and
/// sub-block `s`, at `4 · (8k + s)`, the low and high nibbles' values (the IQ4_NL table's) and
/// their magnitudes; at `128 + s`, sub-block `s`'s scales as `(s, s)` i16 pairs. Once per kernel
/// call of several tiles: each tile then loads them as they are, where `iq4xs.rs`'s `tile_avx2` unpacks
/// them itself (7 instructions per 64 weights and 8 scale conversions per block and half,
/// a sixth of a 4-token tile's work).
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prepare(w: *const u8, nb: usize, prep: *mut __m256i) {
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: w holds nb blocks of 16 rows, prep nb · PREP_VECS vectors (caller).
    unsafe {
        let tbl =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        for b in 0..nb {
            let blk = w.add(b * X16);
            for h in 0..2 {
                let at = prep.add(prep_at(b, h));
                for s in 0..8 {
                    let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        blk.add(SCALES + GROUP * s + 8 * h) as *const __m128i,
                    ));
                    at.add(128 + s).write_unaligned(_mm256_or_si256(
                        _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)),
                        _mm256_slli_epi32(v, 16),
                    ));
                }
                for k in 0..4 {
                    for s in 0..8 {
                        let v = _mm256_loadu_si256(
                            blk.add(QS + 256 * s + 64 * k + 32 * h) as *const __m256i
                        );
                        let lo = _mm256_shuffle_epi8(tbl, _mm256_and_si256(v, m4));
                        let hi =
                            _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                        let o = at.add(4 * (8 * k + s));
                        o.write_unaligned(lo);
                        o.add(1).write_unaligned(hi);
                        o.add(2).write_unaligned(_mm256_abs_epi8(lo));
                        o.add(3).write_unaligned(_mm256_abs_epi8(hi));
                    }
                }
            }
        }
    }
}

/// `iq4xs.rs`'s `tile_avx2` with the weights and scales from [`prepare`]: the same integer and float
/// steps, in the same order.
// `k` indexes the lanes and the activation offsets alike.
#[allow(clippy::needless_range_loop)]
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_prepared<const T: usize>(
    w: *const u8,
    prep: *const __m256i,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
) {
    // SAFETY: the caller checked that w holds nb blocks of 16 rows, prep their prepared
    // vectors and acts hold tokens t..t+T; features enabled.
    unsafe {
        tile_body_avx2::<T, _>(
            w,
            a,
            t,
            out,
            |b, _, h| prep.add(prep_at(b, h)),
            |&at, _, k, s| sub_block(at, k, s),
        )
    }
}

thread_local! {
    /// Each pool thread's buffer of a group's unpacked weights ([`prepare_512`]).
    static PREP_512: std::cell::RefCell<Vec<[i32; 16]>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Vectors [`prepare_512`] writes per block: 4 per (lane pair `k`, sub-block `s`) and 8 scale
/// vectors.
const PREP_512_VECS: usize = 4 * 32 + 8;

/// `iq4xs_group_avx512`'s tiles of [`TILE_512`] tokens, then one of those left, from
/// [`prepare_512`]'s vectors.
///
/// # Safety
/// As `iq4xs_group_avx512`, with its bounds checked.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn avx512_tiles(
    w: *const u8,
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: *mut f32,
) {
    PREP_512.with_borrow_mut(|prep| {
        let nb = a.cols / 256;
        prep.resize(nb * PREP_512_VECS, [0; 16]);
        let pv = prep.as_mut_ptr() as *mut __m512i;
        // SAFETY: w holds nb blocks, prep nb · PREP_512_VECS vectors, acts tokens t0..t0+nt,
        // out nt · GROUP floats (caller); features guaranteed by the caller.
        unsafe {
            prepare_512(w, nb, pv);
            let mut j = 0;
            while j + TILE_512 <= nt {
                tile_512::<TILE_512>(w, pv, a, t0 + j, out.add(j * GROUP));
                j += TILE_512;
            }
            let (t, o) = (t0 + j, out.add(j * GROUP));
            match nt - j {
                0 => {}
                1 => tile_512::<1>(w, pv, a, t, o),
                2 => tile_512::<2>(w, pv, a, t, o),
                3 => tile_512::<3>(w, pv, a, t, o),
                4 => tile_512::<4>(w, pv, a, t, o),
                5 => tile_512::<5>(w, pv, a, t, o),
                6 => tile_512::<6>(w, pv, a, t, o),
                _ => tile_512::<7>(w, pv, a, t, o),
            }
        }
    })
}

/// Per block `b` of a group, from `b · PREP_512_VECS`, all 16 rows: for lane pair `k` and
/// sub-block `s`, at `4 · (8k + s)`, the low and high nibbles' values and their magnitudes; at
/// `128 + s`, sub-block `s`'s scales as `(s, s)` i16 pairs.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn prepare_512(w: *const u8, nb: usize, prep: *mut __m512i) {
    // SAFETY: w holds nb blocks of 16 rows, prep nb · PREP_512_VECS vectors (caller).
    unsafe {
        let m4 = _mm512_set1_epi8(0x0F);
        let tbl = _mm512_broadcast_i32x4(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        for b in 0..nb {
            let blk = w.add(b * X16);
            let at = prep.add(b * PREP_512_VECS);
            for s in 0..8 {
                let v = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                    blk.add(SCALES + GROUP * s) as *const __m128i
                ));
                let v = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF));
                at.add(128 + s)
                    .write_unaligned(_mm512_or_si512(v, _mm512_slli_epi32(v, 16)));
            }
            for k in 0..4 {
                for s in 0..8 {
                    let v = _mm512_loadu_si512(blk.add(QS + 256 * s + 64 * k) as *const _);
                    let lo = _mm512_shuffle_epi8(tbl, _mm512_and_si512(v, m4));
                    let hi =
                        _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                    let o = at.add(4 * (8 * k + s));
                    o.write_unaligned(lo);
                    o.add(1).write_unaligned(hi);
                    o.add(2).write_unaligned(_mm512_abs_epi8(lo));
                    o.add(3).write_unaligned(_mm512_abs_epi8(hi));
                }
            }
        }
    }
}

/// `iq4xs.rs`'s `tile_avx512` with the weights and scales from [`prepare_512`]: the same
/// integer and float steps, in the same order (each weight vector's sign mask taken from its
/// prepared values).
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_512<const T: usize>(
    w: *const u8,
    prep: *const __m512i,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
) {
    // SAFETY: the caller checked that w holds nb blocks of 16 rows, prep their prepared
    // vectors and acts hold tokens t..t+T; AVX-512 enabled.
    unsafe {
        tile_body_512::<T, _>(
            w,
            a,
            t,
            out,
            |b, _| prep.add(b * PREP_512_VECS),
            |&at, k, s| sub_block(at, k, s),
        )
    }
}
