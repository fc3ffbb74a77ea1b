//! AVX2 (+FMA, F16C) kernels for the interleaved Q4_K, Q5_K and Q6_K groups (layouts in
//! `matrix.rs`, numerical contract in `scalar::q45k_group` / `scalar::q6k_group`).
//!
//! A 256-bit load holds 4 quant bytes of 8 of the group's 16 rows, so each 16-row group runs
//! as two halves of 8 rows, one i32/f32 lane per row. AVX2 has no `vpdpbusd`: `pmaddubsw`
//! multiplies the unsigned quants by a broadcast activation word into exact i16 pair sums, and
//! `pmaddwd` with the row's sub-block scale (held as an `(s, s)` i16 pair per lane) multiplies
//! and adds each pair into an exact i32. Every integer sum is exact and the float steps per row
//! are the scalar kernel's, in its order, so the results equal the scalar and AVX-512 ones bit
//! for bit. Tiles of up to 6 or 8 tokens ([`Q4K_TILE`]) share each unpack of the weights
//! (prefill); a lone token (decode) runs the 1-token tile, the code it ran with tiles of 4.

use std::arch::x86_64::*;

use super::super::matrix::{
    kx16_bytes, kx16_qs, q6k_runs, GROUP, Q4K_DMIN, Q4K_MINS, Q4K_SCALES, Q5K_QH, Q6K_SCALES,
    Q6K_X16,
};
use super::super::quant_acts::QuantizedActs;

/// Tokens per tile, per kernel: the widest that measured fastest (1 thread, 64 tokens,
/// 1,024 × 1,024, alternated with the 4 of before: Q4_K 151 → 177 GFLOP/s at 6, 162 at 8;
/// Q5_K 109 → 122 at 8, 114 at 6; Q6_K 88 → 88–94 at 6, 88–91 at 8). Wider tiles share each
/// unpack of a block's weights among more tokens until their accumulators no longer fit the
/// registers. Q6_K's lanes later started at their weight offsets, which left 8 ahead of 6 by
/// 3–5% (`examples/prefill_bench.rs`, Zen 5 VM, thread CPU time, alternated): these tiles are
/// bound by the instructions they issue, about 4 per cycle, more than by the multiplies.
const Q4K_TILE: usize = 6;
const Q5K_TILE: usize = 8;
const Q6K_TILE: usize = 8;

/// Runs `$tile::<T, ..>` over `nt` tokens in tiles of `$n` (at most 8), then one tile of the
/// tokens left. Each token's sums are the same in a tile of any width.
macro_rules! tiles {
    ($tile:ident, $n:expr $(, $c:expr)?; $w:expr, $a:expr, $t0:expr, $nt:expr, $out:expr) => {{
        let (w, a, t0, nt, out) = ($w, $a, $t0, $nt, $out);
        let mut j = 0;
        while j + $n <= nt {
            $tile::<{ $n } $(, $c)?>(w.as_ptr(), a, t0 + j, out.as_mut_ptr().add(j * GROUP));
            j += $n;
        }
        let (t, o) = (t0 + j, out.as_mut_ptr().add(j * GROUP));
        match nt - j {
            0 => {}
            1 => $tile::<1 $(, $c)?>(w.as_ptr(), a, t, o),
            2 => $tile::<2 $(, $c)?>(w.as_ptr(), a, t, o),
            3 => $tile::<3 $(, $c)?>(w.as_ptr(), a, t, o),
            4 => $tile::<4 $(, $c)?>(w.as_ptr(), a, t, o),
            5 => $tile::<5 $(, $c)?>(w.as_ptr(), a, t, o),
            6 => $tile::<6 $(, $c)?>(w.as_ptr(), a, t, o),
            _ => $tile::<7 $(, $c)?>(w.as_ptr(), a, t, o),
        }
    }};
}

fn check_k(w: &[u8], x16: usize, a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * x16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * a.cols / 16 <= a.bsums.len());
    assert!((t0 + nt) * nb <= a.f.len() && out.len() >= nt * GROUP);
}

/// Blocks ahead that a decode tile prefetches (see [`prefetch_ahead`]).
pub(super) const PREFETCH_BLOCKS: usize = 2;

/// Decode (1–2 tokens) reads each weight once, from memory: the first row half's pass over a
/// group prefetches the block [`PREFETCH_BLOCKS`] on (past the group's end, the next group's,
/// which follows it in memory and is usually this task's next), one prefetch per cache line,
/// spread over the block's `parts` steps (this is step `part`'s share). The hardware
/// prefetcher alone left the Q6_K kernel waiting on its weight loads about half of its time
/// (`perf` of a Q6_K decode: the samples on the first loads of each run). Into L2, not L1: on a
/// Zen 4 capped to AVX2 the L1 hint left Q4_K_M decode of the dense bench model at 69–74 tok/s
/// and Q6_K at 45–47, the L2 hint 94–95 and 70–72 (2 threads, alternated; Q4_0 91–93 → 96–100,
/// IQ4_XS unchanged).
#[inline(always)]
pub(super) fn prefetch_ahead(blk: *const u8, block_bytes: usize, part: usize, parts: usize) {
    let lines = block_bytes.div_ceil(64 * parts);
    let ahead = blk.wrapping_add(PREFETCH_BLOCKS * block_bytes + 64 * lines * part);
    for line in 0..lines {
        // SAFETY: a prefetch does not fault, whatever the address; SSE is baseline on x86_64.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64 * line) as *const i8) };
    }
}

/// The activation word (4 i8) at `p`, broadcast.
#[inline(always)]
unsafe fn yword(p: *const i8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes and AVX.
    unsafe { _mm256_set1_epi32((p as *const i32).read_unaligned()) }
}

/// 8 unsigned 6-bit scales (one per row) at `p` as an `(s, s)` i16 pair per i32 lane.
#[inline(always)]
unsafe fn scales_u8(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 8 readable bytes and AVX2.
    unsafe {
        let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        _mm256_or_si256(v, _mm256_slli_epi32(v, 16))
    }
}

/// 8 signed scales (one per row) at `p` as an `(s, s)` i16 pair per i32 lane.
#[inline(always)]
unsafe fn scales_i8(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 8 readable bytes and AVX2.
    unsafe {
        let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i));
        _mm256_or_si256(
            _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)),
            _mm256_slli_epi32(v, 16),
        )
    }
}

/// Q4_K (`FIVE` = false) / Q5_K interleaved group × `nt` tokens.
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
    check_k(w, kx16_bytes(FIVE), a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        if FIVE {
            tiles!(q5k_tile, Q5K_TILE; w, a, t0, nt, out)
        } else {
            tiles!(q4k_tile, Q4K_TILE; w, a, t0, nt, out)
        }
    }
}

/// `T` tokens of a Q5_K group, lane by lane: lane `k`'s runs of the 4 chunks (whose high bits
/// share one load) are summed in registers and its float step taken at once, so no lane sum
/// goes through memory. The integer sums and the float steps (each lane's in block order) are
/// the scalar kernel's.
// `k` indexes the weight runs, the activation offsets and the lanes alike.
#[allow(clippy::needless_range_loop)]
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5k_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 256;
    let (x16, qs) = (kx16_bytes(true), kx16_qs(true));
    // SAFETY: the caller checked that w holds nb interleaved blocks and acts hold tokens
    // t..t+T; AVX2/FMA/F16C enabled.
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let one = _mm256_set1_epi8(1);
        let zero = _mm256_setzero_si256();
        for h8 in 0..2 {
            let mut acc = [[_mm256_setzero_ps(); 8]; T];
            let mut accm = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                let blk = w.add(b * x16);
                let ys: [*const i8; T] =
                    std::array::from_fn(|j| a.qs.as_ptr().add((t + j) * a.cols + b * 256));
                let sc: [[__m256i; 2]; 4] = std::array::from_fn(|c| {
                    [
                        scales_u8(blk.add(Q4K_SCALES + 32 * c + 8 * h8)),
                        scales_u8(blk.add(Q4K_SCALES + 32 * c + 16 + 8 * h8)),
                    ]
                });
                let dx = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h8) as *const __m128i));
                let d: [__m256; T] = std::array::from_fn(|j| {
                    _mm256_mul_ps(_mm256_set1_ps(*a.f.get_unchecked((t + j) * nb + b)), dx)
                });
                for k in 0..8 {
                    if h8 == 0 {
                        prefetch_ahead(blk, x16, k, 8);
                    }
                    let h =
                        _mm256_loadu_si256(blk.add(Q5K_QH + 64 * k + 32 * h8) as *const __m256i);
                    let mut lane = [zero; T];
                    for (c, sc) in sc.iter().enumerate() {
                        let v = _mm256_loadu_si256(
                            blk.add(qs + 512 * c + 64 * k + 32 * h8) as *const __m256i
                        );
                        // Bit 0 of each byte after a 16-bit shift by 2c / 2c+1 (< 8).
                        let sh_lo = _mm_cvtsi32_si128(2 * c as i32);
                        let sh_hi = _mm_cvtsi32_si128(2 * c as i32 + 1);
                        let bl = _mm256_and_si256(_mm256_srl_epi16(h, sh_lo), one);
                        let bh = _mm256_and_si256(_mm256_srl_epi16(h, sh_hi), one);
                        let lo = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_slli_epi16(bl, 4));
                        let hi = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                            _mm256_slli_epi16(bh, 4),
                        );
                        for (lane, y) in lane.iter_mut().zip(&ys) {
                            let pl = _mm256_maddubs_epi16(lo, yword(y.add(64 * c + 4 * k)));
                            let ph = _mm256_maddubs_epi16(hi, yword(y.add(64 * c + 32 + 4 * k)));
                            let p = _mm256_add_epi32(
                                _mm256_madd_epi16(pl, sc[0]),
                                _mm256_madd_epi16(ph, sc[1]),
                            );
                            *lane = _mm256_add_epi32(*lane, p);
                        }
                    }
                    for j in 0..T {
                        acc[j][k] = _mm256_fmadd_ps(d[j], _mm256_cvtepi32_ps(lane[j]), acc[j][k]);
                    }
                }
                let dmx = _mm256_cvtph_ps(_mm_loadu_si128(
                    blk.add(Q4K_DMIN + 16 * h8) as *const __m128i
                ));
                let mins: [__m256i; 8] =
                    std::array::from_fn(|s| scales_u8(blk.add(Q4K_MINS + 16 * s + 8 * h8)));
                for (j, accm) in accm.iter_mut().enumerate() {
                    let dy = *a.f.get_unchecked((t + j) * nb + b);
                    // Σ_s min_s · (bsum_2s + bsum_2s+1): the bsum pair read as one i32.
                    let bs = a.bsums.as_ptr().add(((t + j) * a.cols + b * 256) / 16);
                    let mut msum = zero;
                    for (s, &m) in mins.iter().enumerate() {
                        let pair =
                            _mm256_set1_epi32((bs.add(2 * s) as *const i32).read_unaligned());
                        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(m, pair));
                    }
                    // `summs += dmin * msum` in llama.cpp: product, then sum (not fused).
                    let dmin = _mm256_mul_ps(_mm256_set1_ps(-dy), dmx);
                    *accm = _mm256_add_ps(*accm, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(msum)));
                }
            }
            for j in 0..T {
                let r = _mm256_add_ps(lanes_sum!(_mm256_add_ps, acc[j]), accm[j]);
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h8), r);
            }
        }
    }
}

/// `T` tokens of a Q4_K group. Q4_K only needs each row's block sum (the scalar kernel adds
/// its 8 lanes as integers), so its nibble products are summed in i16 over a whole 64-element
/// chunk first (8 pairs of at most 2·15·128: exact) and scaled once.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 256;
    let (x16, qs) = (kx16_bytes(false), kx16_qs(false));
    // SAFETY: the caller checked that w holds nb interleaved blocks and acts hold tokens
    // t..t+T; AVX2/FMA/F16C enabled.
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let zero = _mm256_setzero_si256();
        for h8 in 0..2 {
            let mut acc = [_mm256_setzero_ps(); T];
            let mut accm = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                let blk = w.add(b * x16);
                let ys: [*const i8; T] =
                    std::array::from_fn(|j| a.qs.as_ptr().add((t + j) * a.cols + b * 256));
                // The block sum per token.
                let mut sums = [zero; T];
                for c in 0..4 {
                    if h8 == 0 {
                        prefetch_ahead(blk, x16, c, 4);
                    }
                    let sc_lo = scales_u8(blk.add(Q4K_SCALES + 32 * c + 8 * h8));
                    let sc_hi = scales_u8(blk.add(Q4K_SCALES + 32 * c + 16 + 8 * h8));
                    let mut s_lo = [zero; T];
                    let mut s_hi = [zero; T];
                    for k in 0..8 {
                        let v = _mm256_loadu_si256(
                            blk.add(qs + 512 * c + 64 * k + 32 * h8) as *const __m256i
                        );
                        let lo = _mm256_and_si256(v, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        for j in 0..T {
                            let pl = _mm256_maddubs_epi16(lo, yword(ys[j].add(64 * c + 4 * k)));
                            let ph =
                                _mm256_maddubs_epi16(hi, yword(ys[j].add(64 * c + 32 + 4 * k)));
                            s_lo[j] = _mm256_add_epi16(s_lo[j], pl);
                            s_hi[j] = _mm256_add_epi16(s_hi[j], ph);
                        }
                    }
                    for j in 0..T {
                        let p = _mm256_add_epi32(
                            _mm256_madd_epi16(s_lo[j], sc_lo),
                            _mm256_madd_epi16(s_hi[j], sc_hi),
                        );
                        sums[j] = _mm256_add_epi32(sums[j], p);
                    }
                }
                let dx = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h8) as *const __m128i));
                let dmx = _mm256_cvtph_ps(_mm_loadu_si128(
                    blk.add(Q4K_DMIN + 16 * h8) as *const __m128i
                ));
                let mins: [__m256i; 8] =
                    std::array::from_fn(|s| scales_u8(blk.add(Q4K_MINS + 16 * s + 8 * h8)));
                for j in 0..T {
                    let dy = *a.f.get_unchecked((t + j) * nb + b);
                    let dd = _mm256_mul_ps(dx, _mm256_set1_ps(dy));
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), dd, acc[j]);
                    // Σ_s min_s · (bsum_2s + bsum_2s+1): the bsum pair read as one i32.
                    let bs = a.bsums.as_ptr().add(((t + j) * a.cols + b * 256) / 16);
                    let mut msum = zero;
                    for (s, &m) in mins.iter().enumerate() {
                        let pair =
                            _mm256_set1_epi32((bs.add(2 * s) as *const i32).read_unaligned());
                        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(m, pair));
                    }
                    let dm = _mm256_mul_ps(dmx, _mm256_set1_ps(dy));
                    accm[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), dm, accm[j]);
                }
            }
            for j in 0..T {
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h8), _mm256_sub_ps(acc[j], accm[j]));
            }
        }
    }
}

/// Q6_K interleaved group × `nt` tokens.
///
/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    check_k(w, Q6K_X16, a, t0, nt, out);
    if nt < 3 {
        // SAFETY: bounds checked above; features guaranteed by the caller.
        return unsafe { tiles!(q6k_tile, Q6K_TILE; w, a, t0, nt, out) };
    }
    Q6K_PREP.with_borrow_mut(|prep| {
        let nb = a.cols / 256;
        prep.resize(nb * Q6K_PREP_VECS, [0; 8]);
        // SAFETY: bounds checked above (w holds nb blocks, `prep` nb · Q6K_PREP_VECS vectors;
        // tokens t0..t0+nt in `a`); features guaranteed by the caller.
        unsafe {
            let pv = prep.as_mut_ptr() as *mut __m256i;
            q6k_prepare(w.as_ptr(), nb, pv);
            let pv = pv as *const __m256i;
            let (w, o) = (w.as_ptr(), out.as_mut_ptr());
            let mut j = 0;
            while j + Q6K_TILE <= nt {
                q6k_tile_u8::<Q6K_TILE>(w, pv, a, t0 + j, o.add(j * GROUP));
                j += Q6K_TILE;
            }
            let (t, o) = (t0 + j, o.add(j * GROUP));
            match nt - j {
                0 => {}
                1 => q6k_tile::<1>(w, a, t, o),
                2 => q6k_tile::<2>(w, a, t, o),
                3 => q6k_tile_u8::<3>(w, pv, a, t, o),
                4 => q6k_tile_u8::<4>(w, pv, a, t, o),
                5 => q6k_tile_u8::<5>(w, pv, a, t, o),
                6 => q6k_tile_u8::<6>(w, pv, a, t, o),
                _ => q6k_tile_u8::<7>(w, pv, a, t, o),
            }
        }
    });
}

thread_local! {
    /// Each pool thread's buffer of a Q6_K group's prepared weights ([`q6k_prepare`]).
    static Q6K_PREP: std::cell::RefCell<Vec<[i32; 8]>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The 4 quant vectors `k` = 0..4 of a run position (n, l4) of 8 rows, as bytes 0..63 (`q +
/// 32` of the signed quant), from its `ql` bytes `qa`, `qb` and its `qh` bytes `h`.
#[inline(always)]
unsafe fn q6k_unpack(qa: __m256i, qb: __m256i, h: __m256i) -> [__m256i; 4] {
    // SAFETY: AVX2 enabled in every caller.
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let m3 = _mm256_set1_epi8(3);
        let hb = |x: __m256i| _mm256_slli_epi16(_mm256_and_si256(x, m3), 4);
        [
            _mm256_or_si256(_mm256_and_si256(qa, m4), hb(h)),
            _mm256_or_si256(_mm256_and_si256(qb, m4), hb(_mm256_srli_epi16(h, 2))),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(qa, 4), m4),
                hb(_mm256_srli_epi16(h, 4)),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                hb(_mm256_srli_epi16(h, 6)),
            ),
        ]
    }
}

/// Vectors [`q6k_prepare`] writes per block: per row half (`h8`), 8 lane offset sums, 64
/// quant vectors and 16 scale vectors.
const Q6K_PREP_VECS: usize = 2 * (8 + 64 + 16);

/// Where row half `h8` of block `b` starts in the prepared vectors.
#[inline(always)]
fn q6k_prep_at(b: usize, h8: usize) -> usize {
    (b * 2 + h8) * (Q6K_PREP_VECS / 2)
}

/// Per block `b` and row half `h8` of a Q6_K group, at [`q6k_prep_at`]`(b, h8)`: (0..8) per
/// lane `l4`, each row's `−128 · Σ scale · (q − 32)` over the lane's 8 runs, where
/// [`q6k_tile_u8`] starts each token's lane sum; (8..72) the signed quants `q − 32` of run
/// `(n, l4)`, quant `k` at `8 + (l4 · 2 + n) · 4 + k`; (72..88) sub-block `sub`'s scales as
/// `(s, s)` i16 pairs. Once per kernel call, for all its tokens: each tile of tokens then loads
/// the quants and scales as they are, where it unpacked them itself (~25 instructions per 4
/// quant vectors, a sixth of a tile of 8 tokens' work, paid by every tile of the call).
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_prepare(w: *const u8, nb: usize, prep: *mut __m256i) {
    // SAFETY: w holds nb interleaved blocks, prep nb · Q6K_PREP_VECS vectors (caller); AVX2
    // enabled.
    unsafe {
        let load = |p: *const u8| _mm256_loadu_si256(p as *const __m256i);
        let (c32, ones) = (_mm256_set1_epi8(32), _mm256_set1_epi8(1));
        let zero = _mm256_setzero_si256();
        for b in 0..nb {
            let blk = w.add(b * Q6K_X16);
            for h8 in 0..2 {
                let at = prep.add(q6k_prep_at(b, h8));
                let sc: [__m256i; 16] =
                    std::array::from_fn(|sub| scales_i8(blk.add(Q6K_SCALES + 16 * sub + 8 * h8)));
                for (sub, &v) in sc.iter().enumerate() {
                    at.add(72 + sub).write_unaligned(v);
                }
                for l4 in 0..8 {
                    let mut sum = _mm256_setzero_si256();
                    for n in 0..2 {
                        let run = blk.add(q6k_runs(n, l4) + 32 * h8);
                        let q = q6k_unpack(load(run), load(run.add(64)), load(run.add(128)));
                        for (k, &qk) in q.iter().enumerate() {
                            let qs = _mm256_sub_epi8(qk, c32);
                            at.add(8 + (l4 * 2 + n) * 4 + k).write_unaligned(qs);
                            // Pair sums of the signed quants (|4 · 32| fits an i16).
                            let p = _mm256_maddubs_epi16(ones, qs);
                            let s = sc[8 * n + 2 * k + l4 / 4];
                            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, s));
                        }
                    }
                    at.add(l4)
                        .write_unaligned(_mm256_sub_epi32(zero, _mm256_slli_epi32(sum, 7)));
                }
            }
        }
    }
}

/// `T ≥ 3` tokens of a Q6_K group with the activations made unsigned: `pmaddubsw` of `y + 128`
/// (each activation byte with its sign bit flipped) by the signed quants `q − 32` gives exact
/// i16 pairs (at most 2 · 255 · 32 in magnitude), so a lane's runs sum to `Σ scale · (q − 32)
/// · y` plus `128 · Σ scale · (q − 32)`, which depends on the weights alone: each lane starts
/// at its negation. That offset, the signed quants and the scales come ready from
/// [`q6k_prepare`] (once per call, for all its tiles). The same exact integer lane sums as [`q6k_tile`], so the same floats; where that kernel's per-lane
/// offsets took 4 `pmaddwd` and 4 broadcasts per lane and token (a fifth of its multiplies)
/// and the offsets of every block twice.
// `l4` indexes the prepared vectors, the activation offsets and the lanes alike.
#[allow(clippy::needless_range_loop)]
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_tile_u8<const T: usize>(
    w: *const u8,
    prep: *const __m256i,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
) {
    let nb = a.cols / 256;
    // SAFETY: the caller checked that w holds nb interleaved blocks, prep their prepared
    // vectors and acts hold tokens t..t+T; AVX2/FMA/F16C enabled.
    unsafe {
        let flip = _mm256_set1_epi8(-128);
        // The tile's activations of one block, sign bits flipped (`y + 128` as u8).
        let mut yu = [[0u8; 256]; T];
        // Both row halves per block (each lane's float steps still in block order), so each
        // block's activations are flipped once.
        let mut accs = [[[_mm256_setzero_ps(); 8]; T]; 2];
        for b in 0..nb {
            let blk = w.add(b * Q6K_X16);
            for (j, yu) in yu.iter_mut().enumerate() {
                let y = a.qs.as_ptr().add((t + j) * a.cols + b * 256);
                for v in 0..8 {
                    let yv = _mm256_loadu_si256(y.add(32 * v) as *const __m256i);
                    let p = yu.as_mut_ptr().add(32 * v) as *mut __m256i;
                    _mm256_storeu_si256(p, _mm256_xor_si256(yv, flip));
                }
            }
            for (h8, acc) in accs.iter_mut().enumerate() {
                let at = prep.add(q6k_prep_at(b, h8));
                let dx = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h8) as *const __m128i));
                let d: [__m256; T] = std::array::from_fn(|j| {
                    _mm256_mul_ps(_mm256_set1_ps(*a.f.get_unchecked((t + j) * nb + b)), dx)
                });
                for l4 in 0..8 {
                    // Each token's lane starts at minus the weights' offset sum (no subtraction
                    // per token after the runs).
                    let mut lane = [at.add(l4).read_unaligned(); T];
                    for n in 0..2 {
                        for k in 0..4 {
                            let qs = at.add(8 + (l4 * 2 + n) * 4 + k).read_unaligned();
                            let s = at.add(72 + 8 * n + 2 * k + l4 / 4).read_unaligned();
                            let o = 128 * n + 32 * k + 4 * l4;
                            for (lane, yu) in lane.iter_mut().zip(&yu) {
                                let yk = yword(yu.as_ptr().add(o) as *const i8);
                                let p = _mm256_maddubs_epi16(yk, qs);
                                *lane = _mm256_add_epi32(*lane, _mm256_madd_epi16(p, s));
                            }
                        }
                    }
                    for j in 0..T {
                        acc[j][l4] = _mm256_fmadd_ps(d[j], _mm256_cvtepi32_ps(lane[j]), acc[j][l4]);
                    }
                }
            }
        }
        for (h8, acc) in accs.iter().enumerate() {
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h8), lanes_sum!(_mm256_add_ps, acc));
            }
        }
    }
}

/// `T` ≤ 2 tokens of a Q6_K group (decode; [`q6k_tile_u8`] takes 3 or more): `pmaddubsw` of
/// the unsigned quants (q + 32) per 4-element run (exact i16 pairs of `(q + 32)·y`), less the
/// `pmaddubsw` of 32 by the same activations, times the row's sub-block scale into lane
/// `run % 8`: the integer lane sums of `scale · (q − 32) · y`, exact, so equal to the scalar
/// kernel's. (Taking the `32 · y` off per lane instead measured 1 token 56 → 52–53 and 2 tokens
/// 73 → 74–75 GFLOP/s, no better.) Lane by lane: a lane's 8 runs (2 halves × 4 quants) are
/// summed in registers and its float step taken at once, so no lane sum goes through memory
/// (the float steps are the scalar kernel's, each lane's in block order).
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 256;
    // SAFETY: the caller checked that w holds nb interleaved blocks and acts hold tokens
    // t..t+T; AVX2/FMA/F16C enabled.
    unsafe {
        let c32 = _mm256_set1_epi8(32);
        let zero = _mm256_setzero_si256();
        let load = |p: *const u8| _mm256_loadu_si256(p as *const __m256i);
        for h8 in 0..2 {
            let mut acc = [[_mm256_setzero_ps(); 8]; T];
            for b in 0..nb {
                let blk = w.add(b * Q6K_X16);
                let ys: [*const i8; T] =
                    std::array::from_fn(|j| a.qs.as_ptr().add((t + j) * a.cols + b * 256));
                let sc: [__m256i; 16] =
                    std::array::from_fn(|sub| scales_i8(blk.add(Q6K_SCALES + 16 * sub + 8 * h8)));
                let dx = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h8) as *const __m128i));
                let d: [__m256; T] = std::array::from_fn(|j| {
                    _mm256_mul_ps(_mm256_set1_ps(*a.f.get_unchecked((t + j) * nb + b)), dx)
                });
                for l4 in 0..8 {
                    if h8 == 0 {
                        prefetch_ahead(blk, Q6K_X16, l4, 8);
                    }
                    let mut lane = [zero; T];
                    for n in 0..2 {
                        let run = blk.add(q6k_runs(n, l4) + 32 * h8);
                        let q = q6k_unpack(load(run), load(run.add(64)), load(run.add(128)));
                        for (k, &qk) in q.iter().enumerate() {
                            let o = 128 * n + 32 * k + 4 * l4;
                            let s = sc[8 * n + 2 * k + l4 / 4];
                            for (lane, y) in lane.iter_mut().zip(&ys) {
                                let yk = yword(y.add(o));
                                let p = _mm256_sub_epi16(
                                    _mm256_maddubs_epi16(qk, yk),
                                    _mm256_maddubs_epi16(c32, yk),
                                );
                                *lane = _mm256_add_epi32(*lane, _mm256_madd_epi16(p, s));
                            }
                        }
                    }
                    for j in 0..T {
                        acc[j][l4] = _mm256_fmadd_ps(d[j], _mm256_cvtepi32_ps(lane[j]), acc[j][l4]);
                    }
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h8), lanes_sum!(_mm256_add_ps, acc));
            }
        }
    }
}
