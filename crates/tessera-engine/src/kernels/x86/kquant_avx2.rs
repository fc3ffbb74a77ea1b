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
/// registers.
const Q4K_TILE: usize = 6;
const Q5K_TILE: usize = 8;
const Q6K_TILE: usize = 6;

/// The 8 per-row lane accumulators summed as `scalar::q8_0_lanes_sum`.
macro_rules! lanes_sum {
    ($acc:expr) => {{
        let a = $acc;
        _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6])),
            _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7])),
        )
    }};
}

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
/// (`perf` of a Q6_K decode: the samples on the first loads of each run).
#[inline(always)]
pub(super) fn prefetch_ahead(blk: *const u8, block_bytes: usize, part: usize, parts: usize) {
    let lines = block_bytes.div_ceil(64 * parts);
    let ahead = blk.wrapping_add(PREFETCH_BLOCKS * block_bytes + 64 * lines * part);
    for line in 0..lines {
        // SAFETY: a prefetch does not fault, whatever the address; SSE is baseline on x86_64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8) };
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
                    if T <= 2 && h8 == 0 {
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
                let r = _mm256_add_ps(lanes_sum!(acc[j]), accm[j]);
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
                    if T <= 2 && h8 == 0 {
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
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe { tiles!(q6k_tile, Q6K_TILE; w, a, t0, nt, out) }
}

/// The offsets that Q6_K's `q − 32` adds to a lane, per token of a block of activations at
/// `ys[j]`: for each half `n`, pair `kp` of quants and lane `l4` (`[n · 2 + kp][l4]`), the
/// i16 pair `(32 · Σ y of run (n, 2kp, l4), 32 · Σ y of run (n, 2kp + 1, l4))` as one i32.
/// Per 32 activations: `pmaddubsw` by 32 and `pmaddwd` by 1 give each run's sum (at most
/// 32 · 4 · 128 = 2^14 in magnitude: an exact i16), one i32 per lane.
#[inline(always)]
unsafe fn q6k_offsets<const T: usize>(ys: &[*const i8; T]) -> [[[i32; 8]; 4]; T] {
    // SAFETY: each `ys[j]` holds 256 readable bytes (caller); AVX2 enabled (caller).
    unsafe {
        let (c32, one) = (_mm256_set1_epi8(32), _mm256_set1_epi16(1));
        let mut out = [[[0i32; 8]; 4]; T];
        for (o, y) in out.iter_mut().zip(ys) {
            // Runs (n, k, 0..8): activations 128n + 32k .. + 32.
            let run = |v: usize| {
                let yv = _mm256_loadu_si256(y.add(32 * v) as *const __m256i);
                _mm256_madd_epi16(_mm256_maddubs_epi16(c32, yv), one)
            };
            for (p, o) in o.iter_mut().enumerate() {
                let (lo, hi) = (run(2 * p), run(2 * p + 1));
                let pair = _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA);
                _mm256_storeu_si256(o.as_mut_ptr() as *mut __m256i, pair);
            }
        }
        out
    }
}

/// `T` tokens of a Q6_K group: `pmaddubsw` of the unsigned quants (q + 32) per 4-element run
/// (exact i16 pairs of `(q + 32)·y`), times the row's sub-block scale into lane `run % 8`,
/// with the `32 · y` of the `− 32` taken off either per run (`pmaddubsw` of 32 and a
/// subtraction) or, from 3 tokens on, per lane: each lane's `32 · Σ scale · y`
/// ([`q6k_offsets`], a `pmaddwd` for two runs). Both give the integer lane sums of
/// `scale · (q − 32) · y`, exact, so equal to the scalar kernel's. Per lane, the offsets cost
/// a block's activation sums and 4 broadcasts per lane and token, which only wider tiles
/// (prefill) win back: 1 thread, 256 × 1,024 in cache, 64 tokens 88–90 → 96–99 GFLOP/s, but
/// 1 token 56 → 52–53 and 2 tokens 73 → 74–75 per run (so decode takes them per run, as it
/// did before the wider tiles). Lane by lane: a lane's 8 runs (2 halves × 4 quants) are
/// summed in registers and its float step taken at once, so no lane sum goes through memory
/// (the float steps are the scalar kernel's, each lane's in block order).
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 256;
    // Per-lane offsets from 3 tokens on (see above); a constant per instantiation.
    let lane_offsets = T > 2;
    // SAFETY: the caller checked that w holds nb interleaved blocks and acts hold tokens
    // t..t+T; AVX2/FMA/F16C enabled.
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let m3 = _mm256_set1_epi8(3);
        let c32 = _mm256_set1_epi8(32);
        let zero = _mm256_setzero_si256();
        let load = |p: *const u8| _mm256_loadu_si256(p as *const __m256i);
        let hb = |x: __m256i| _mm256_slli_epi16(_mm256_and_si256(x, m3), 4);
        for h8 in 0..2 {
            let mut acc = [[_mm256_setzero_ps(); 8]; T];
            for b in 0..nb {
                let blk = w.add(b * Q6K_X16);
                let ys: [*const i8; T] =
                    std::array::from_fn(|j| a.qs.as_ptr().add((t + j) * a.cols + b * 256));
                let sc: [__m256i; 16] =
                    std::array::from_fn(|sub| scales_i8(blk.add(Q6K_SCALES + 16 * sub + 8 * h8)));
                // The scales of runs (n, 2kp, l4) and (n, 2kp + 1, l4), sub-blocks
                // 8n + 4kp + l4/4 and 2 on, as (s, s') pairs: `[l4 / 4][n · 2 + kp]`.
                let scp: [[__m256i; 4]; 2] = std::array::from_fn(|c| {
                    std::array::from_fn(|p| {
                        let sub = 4 * p + c;
                        _mm256_blend_epi16(sc[sub], sc[sub + 2], 0xAA)
                    })
                });
                let offsets = if lane_offsets {
                    q6k_offsets(&ys)
                } else {
                    [[[0; 8]; 4]; T]
                };
                let dx = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h8) as *const __m128i));
                let d: [__m256; T] = std::array::from_fn(|j| {
                    _mm256_mul_ps(_mm256_set1_ps(*a.f.get_unchecked((t + j) * nb + b)), dx)
                });
                for l4 in 0..8 {
                    if T <= 2 && h8 == 0 {
                        prefetch_ahead(blk, Q6K_X16, l4, 8);
                    }
                    let mut lane = [zero; T];
                    for n in 0..2 {
                        let run = blk.add(q6k_runs(n, l4) + 32 * h8);
                        let (qa, qb, h) = (load(run), load(run.add(64)), load(run.add(128)));
                        let q = [
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
                        ];
                        for (k, &qk) in q.iter().enumerate() {
                            let o = 128 * n + 32 * k + 4 * l4;
                            let s = sc[8 * n + 2 * k + l4 / 4];
                            for (lane, y) in lane.iter_mut().zip(&ys) {
                                let yk = yword(y.add(o));
                                let mut p = _mm256_maddubs_epi16(qk, yk);
                                if !lane_offsets {
                                    p = _mm256_sub_epi16(p, _mm256_maddubs_epi16(c32, yk));
                                }
                                *lane = _mm256_add_epi32(*lane, _mm256_madd_epi16(p, s));
                            }
                        }
                    }
                    if lane_offsets {
                        for (lane, off) in lane.iter_mut().zip(&offsets) {
                            for (p, &scp) in scp[l4 / 4].iter().enumerate() {
                                let o = _mm256_set1_epi32(off[p][l4]);
                                *lane = _mm256_sub_epi32(*lane, _mm256_madd_epi16(scp, o));
                            }
                        }
                    }
                    for j in 0..T {
                        acc[j][l4] = _mm256_fmadd_ps(d[j], _mm256_cvtepi32_ps(lane[j]), acc[j][l4]);
                    }
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(j * GROUP + 8 * h8), lanes_sum!(acc));
            }
        }
    }
}
