//! AVX-512 (F/BW/VL + VNNI) prefill tiles for the interleaved Q5_K and Q6_K groups (layouts in
//! `matrix.rs`, numerical contract in `scalar::q45k_group` / `scalar::q6k_group`).
//!
//! One 512-bit load holds 4 quant bytes of all 16 rows of a group, so a tile runs the whole
//! group at once, one i32/f32 lane per row. As in the AVX2 tiles (`kquant_avx2.rs`), each
//! unpack of the weights serves the `T` tokens of a tile: `vpmaddubsw` by a broadcast
//! activation word gives exact i16 pairs, and `vpdpwssd` with the row's sub-block scale (an
//! `(s, s)` i16 pair per lane) multiplies, adds the pair and accumulates into an exact i32 in
//! one instruction, where AVX2 takes `pmaddwd` and an add. The multiplies are what bounds
//! these kernels (two per 32 products on AVX2, two per 64 here). Every integer lane sum is
//! exact and the float steps per row are the scalar kernel's, in its order, so the results
//! equal the scalar and AVX2 ones bit for bit.
//!
//! A single token (decode) keeps `avx512.rs`'s one-token kernels, which stream each block
//! once; a Q6_K tile first computes its weights' offset sums, which one token does not repay.

use std::arch::x86_64::*;

use super::super::matrix::{
    kx16_bytes, kx16_qs, q6k_runs, GROUP, Q4K_DMIN, Q4K_MINS, Q4K_SCALES, Q5K_QH, Q6K_SCALES,
    Q6K_X16,
};
use super::super::quant_acts::QuantizedActs;

/// Tokens per tile: each unpack of a block's weights serves this many tokens. On a Zen 5 VM
/// (1 thread, thread CPU time, the shapes of `examples/prefill_bench.rs`) 4, 6 and 8 came
/// within a few percent of each other, about 300 GFLOP/s for both types, 8 slightly ahead for
/// Q6_K: the multiplies bound the tiles, not the unpacks.
const Q6K_TILE: usize = 8;
const Q5K_TILE: usize = 8;

fn check_k(w: &[u8], x16: usize, a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * x16);
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * a.cols / 16 <= a.bsums.len());
    assert!((t0 + nt) * nb <= a.f.len() && out.len() >= nt * GROUP);
}

/// Runs `$tile::<T>($($arg,)* t, out)` over `nt` tokens in tiles of `$n` (at most 8), then one
/// tile of the tokens left. Each token's sums are the same in a tile of any width.
macro_rules! tiles {
    ($tile:ident, $n:expr; $t0:expr, $nt:expr, $out:expr; $($arg:expr),*) => {{
        let (t0, nt, out): (usize, usize, *mut f32) = ($t0, $nt, $out);
        let mut j = 0;
        while j + $n <= nt {
            $tile::<{ $n }>($($arg,)* t0 + j, out.add(j * GROUP));
            j += $n;
        }
        let (t, o) = (t0 + j, out.add(j * GROUP));
        match nt - j {
            0 => {}
            1 => $tile::<1>($($arg,)* t, o),
            2 => $tile::<2>($($arg,)* t, o),
            3 => $tile::<3>($($arg,)* t, o),
            4 => $tile::<4>($($arg,)* t, o),
            5 => $tile::<5>($($arg,)* t, o),
            6 => $tile::<6>($($arg,)* t, o),
            _ => $tile::<7>($($arg,)* t, o),
        }
    }};
}

/// The 8 per-row lane accumulators summed as `scalar::q8_0_lanes_sum`.
#[inline(always)]
unsafe fn lanes_sum(a: &[__m512; 8]) -> __m512 {
    // SAFETY: AVX-512F enabled in every caller.
    unsafe {
        _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
            _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])),
        )
    }
}

/// The activation word (4 i8) at `p`, broadcast.
#[inline(always)]
unsafe fn yword(p: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 4 readable bytes and AVX-512F.
    unsafe { _mm512_set1_epi32((p as *const i32).read_unaligned()) }
}

/// 16 scales (one per row) at `p`, unsigned (`SIGNED` = false) or signed bytes, as an `(s, s)`
/// i16 pair per i32 lane.
#[inline(always)]
unsafe fn scale_pairs<const SIGNED: bool>(p: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 16 readable bytes and AVX-512F.
    unsafe {
        let b = _mm_loadu_si128(p as *const __m128i);
        let v = if SIGNED {
            _mm512_and_si512(_mm512_cvtepi8_epi32(b), _mm512_set1_epi32(0xFFFF))
        } else {
            _mm512_cvtepu8_epi32(b)
        };
        _mm512_or_si512(v, _mm512_slli_epi32(v, 16))
    }
}

/// The 4 quant vectors `k` = 0..4 of a Q6_K run position (n, l4) of the 16 rows, as signed
/// bytes `q − 32`, from its `ql` bytes `qa`, `qb` and its `qh` bytes `h`.
#[inline(always)]
unsafe fn q6k_unpack(qa: __m512i, qb: __m512i, h: __m512i) -> [__m512i; 4] {
    // SAFETY: AVX-512F/BW enabled in every caller.
    unsafe {
        let m4 = _mm512_set1_epi8(0x0F);
        let m3 = _mm512_set1_epi8(3);
        let c32 = _mm512_set1_epi8(32);
        let hb = |x: __m512i| _mm512_slli_epi16(_mm512_and_si512(x, m3), 4);
        let q = |lo: __m512i, hi: __m512i| _mm512_sub_epi8(_mm512_or_si512(lo, hi), c32);
        [
            q(_mm512_and_si512(qa, m4), hb(h)),
            q(_mm512_and_si512(qb, m4), hb(_mm512_srli_epi16(h, 2))),
            q(
                _mm512_and_si512(_mm512_srli_epi16(qa, 4), m4),
                hb(_mm512_srli_epi16(h, 4)),
            ),
            q(
                _mm512_and_si512(_mm512_srli_epi16(qb, 4), m4),
                hb(_mm512_srli_epi16(h, 6)),
            ),
        ]
    }
}

thread_local! {
    /// Each pool thread's buffer of a Q6_K group's prepared weights ([`q6k_prepare`]).
    static Q6K_PREP: std::cell::RefCell<Vec<[i32; 16]>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Q6_K interleaved group × `nt` tokens: a lone token runs `avx512.rs`'s kernel, more run
/// tiles.
///
/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q6k_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    if nt < 2 {
        // SAFETY: features guaranteed by the caller; that kernel checks its bounds.
        return unsafe { super::avx512::q6k_group(w, a, t0, nt, out) };
    }
    check_k(w, Q6K_X16, a, t0, nt, out);
    Q6K_PREP.with_borrow_mut(|prep| {
        let nb = a.cols / 256;
        prep.resize(nb * Q6K_PREP_VECS, [0; 16]);
        // SAFETY: bounds checked above (w holds nb blocks, `prep` nb · Q6K_PREP_VECS vectors;
        // tokens t0..t0+nt in `a`); features guaranteed by the caller.
        unsafe {
            q6k_prepare(w.as_ptr(), nb, prep.as_mut_ptr() as *mut __m512i);
            let (w, pv) = (w.as_ptr(), prep.as_ptr() as *const __m512i);
            tiles!(q6k_tile, Q6K_TILE; t0, nt, out.as_mut_ptr(); w, pv, a)
        }
    });
}

/// Vectors [`q6k_prepare`] writes per block: 8 lane offset sums, 64 quant vectors and 16
/// scale vectors.
const Q6K_PREP_VECS: usize = 8 + 64 + 16;

/// Per block `b` of a Q6_K group, from `b · Q6K_PREP_VECS`: (0..8) per lane `l4`, each row's
/// `−128 · Σ scale · (q − 32)` over the lane's 8 runs, where [`q6k_tile`] starts each token's
/// lane sum; (8..72) the signed quants `q − 32` of run `(n, l4)`, quant `k` at
/// `8 + (l4 · 2 + n) · 4 + k`; (72..88) sub-block `sub`'s scales as `(s, s)` i16 pairs. Once per
/// kernel call, for all its tokens: each tile then loads them as they are, where it unpacked
/// them itself (as in `kquant_avx2`'s `q6k_prepare`).
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_prepare(w: *const u8, nb: usize, prep: *mut __m512i) {
    // SAFETY: w holds nb interleaved blocks, prep nb · Q6K_PREP_VECS vectors (caller); AVX-512
    // enabled.
    unsafe {
        let load = |p: *const u8| _mm512_loadu_si512(p as *const _);
        let ones = _mm512_set1_epi8(1);
        for b in 0..nb {
            let blk = w.add(b * Q6K_X16);
            let at = prep.add(b * Q6K_PREP_VECS);
            let sc: [__m512i; 16] =
                std::array::from_fn(|sub| scale_pairs::<true>(blk.add(Q6K_SCALES + 16 * sub)));
            for (sub, &v) in sc.iter().enumerate() {
                at.add(72 + sub).write_unaligned(v);
            }
            for l4 in 0..8 {
                let mut sum = _mm512_setzero_si512();
                for n in 0..2 {
                    let run = blk.add(q6k_runs(n, l4));
                    let q = q6k_unpack(load(run), load(run.add(64)), load(run.add(128)));
                    for (k, &qk) in q.iter().enumerate() {
                        at.add(8 + (l4 * 2 + n) * 4 + k).write_unaligned(qk);
                        // Pair sums of the signed quants (|4 · 32| fits an i16).
                        let p = _mm512_maddubs_epi16(ones, qk);
                        sum = _mm512_dpwssd_epi32(sum, p, sc[8 * n + 2 * k + l4 / 4]);
                    }
                }
                at.add(l4).write_unaligned(_mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_slli_epi32(sum, 7),
                ));
            }
        }
    }
}

/// `T` tokens of a Q6_K group with the activations made unsigned, as `kquant_avx2`'s
/// `q6k_tile_u8`: `vpmaddubsw` of `y + 128` by the signed quants `q − 32` gives exact i16
/// pairs (at most 2 · 255 · 32), so a lane's runs sum to `Σ scale · (q − 32) · y` plus the
/// weights' `128 · Σ scale · (q − 32)`: each lane starts at its negation, which comes ready
/// with the signed quants and the scales from [`q6k_prepare`].
// `l4` indexes the weight runs, the activation offsets and the lanes alike.
#[allow(clippy::needless_range_loop)]
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_tile<const T: usize>(
    w: *const u8,
    prep: *const __m512i,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
) {
    let nb = a.cols / 256;
    // SAFETY: the caller checked that w holds nb interleaved blocks, prep their prepared
    // vectors and acts hold tokens t..t+T; AVX-512 enabled.
    unsafe {
        let flip = _mm512_set1_epi8(-128);
        let load = |p: *const u8| _mm512_loadu_si512(p as *const _);
        // The tile's activations of one block, sign bits flipped (`y + 128` as u8).
        let mut yu = [[0u8; 256]; T];
        let mut acc = [[_mm512_setzero_ps(); 8]; T];
        for b in 0..nb {
            let blk = w.add(b * Q6K_X16);
            let at = prep.add(b * Q6K_PREP_VECS);
            for (j, yu) in yu.iter_mut().enumerate() {
                let y = a.qs.as_ptr().add((t + j) * a.cols + b * 256) as *const u8;
                for v in 0..4 {
                    let p = yu.as_mut_ptr().add(64 * v);
                    _mm512_storeu_si512(p as *mut _, _mm512_xor_si512(load(y.add(64 * v)), flip));
                }
            }
            let dx = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let d: [__m512; T] = std::array::from_fn(|j| {
                _mm512_mul_ps(_mm512_set1_ps(*a.f.get_unchecked((t + j) * nb + b)), dx)
            });
            for l4 in 0..8 {
                // Each token's lane starts at minus the weights' offset sum.
                let mut lane = [at.add(l4).read_unaligned(); T];
                for n in 0..2 {
                    for k in 0..4 {
                        let qk = at.add(8 + (l4 * 2 + n) * 4 + k).read_unaligned();
                        // Lanes 0..4 take the even sub-blocks' scales, lanes 4..8 the odd ones'.
                        let s = at.add(72 + 8 * n + 2 * k + l4 / 4).read_unaligned();
                        let o = 128 * n + 32 * k + 4 * l4;
                        for (lane, yu) in lane.iter_mut().zip(&yu) {
                            let p = _mm512_maddubs_epi16(yword(yu.as_ptr().add(o)), qk);
                            *lane = _mm512_dpwssd_epi32(*lane, p, s);
                        }
                    }
                }
                for j in 0..T {
                    acc[j][l4] = _mm512_fmadd_ps(d[j], _mm512_cvtepi32_ps(lane[j]), acc[j][l4]);
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(j * GROUP), lanes_sum(acc));
        }
    }
}

/// Q5_K interleaved group × `nt` tokens: a lone token runs `avx512.rs`'s kernel, more run
/// tiles.
///
/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q5k_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    if nt < 2 {
        // SAFETY: features guaranteed by the caller; that kernel checks its bounds.
        return unsafe { super::avx512::q45k_group::<true>(w, a, t0, nt, out) };
    }
    check_k(w, kx16_bytes(true), a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe { tiles!(q5k_tile, Q5K_TILE; t0, nt, out.as_mut_ptr(); w.as_ptr(), a) }
}

/// `T` tokens of a Q5_K group, as `kquant_avx2`'s `q5k_tile` on all 16 rows: lane `k`'s runs
/// of the 4 chunks are summed in registers (`vpmaddubsw` of the unsigned 5-bit quants by the
/// activations, at most 2 · 31 · 128 per pair, then `vpdpwssd` by the sub-block scale), its
/// float step taken at once; the mins from the activations' 16-sums.
// `k` indexes the weight runs, the activation offsets and the lanes alike.
#[allow(clippy::needless_range_loop)]
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5k_tile<const T: usize>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let nb = a.cols / 256;
    let (x16, qs) = (kx16_bytes(true), kx16_qs(true));
    // SAFETY: the caller checked that w holds nb interleaved blocks and acts hold tokens
    // t..t+T; AVX-512 enabled.
    unsafe {
        let load = |p: *const u8| _mm512_loadu_si512(p as *const _);
        let m4 = _mm512_set1_epi8(0x0F);
        let one = _mm512_set1_epi8(1);
        let zero = _mm512_setzero_si512();
        let mut acc = [[_mm512_setzero_ps(); 8]; T];
        let mut accm = [_mm512_setzero_ps(); T];
        for b in 0..nb {
            let blk = w.add(b * x16);
            let ys: [*const u8; T] =
                std::array::from_fn(|j| a.qs.as_ptr().add((t + j) * a.cols + b * 256) as *const u8);
            let sc: [[__m512i; 2]; 4] = std::array::from_fn(|c| {
                [
                    scale_pairs::<false>(blk.add(Q4K_SCALES + 32 * c)),
                    scale_pairs::<false>(blk.add(Q4K_SCALES + 32 * c + 16)),
                ]
            });
            let dx = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let d: [__m512; T] = std::array::from_fn(|j| {
                _mm512_mul_ps(_mm512_set1_ps(*a.f.get_unchecked((t + j) * nb + b)), dx)
            });
            for k in 0..8 {
                let h = load(blk.add(Q5K_QH + 64 * k));
                let mut lane = [zero; T];
                for (c, sc) in sc.iter().enumerate() {
                    let v = load(blk.add(qs + 512 * c + 64 * k));
                    // Bit 0 of each byte after a 16-bit shift by 2c / 2c+1 (< 8).
                    let sh_lo = _mm_cvtsi32_si128(2 * c as i32);
                    let sh_hi = _mm_cvtsi32_si128(2 * c as i32 + 1);
                    let bl = _mm512_and_si512(_mm512_srl_epi16(h, sh_lo), one);
                    let bh = _mm512_and_si512(_mm512_srl_epi16(h, sh_hi), one);
                    let lo = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_slli_epi16(bl, 4));
                    let hi = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16(v, 4), m4),
                        _mm512_slli_epi16(bh, 4),
                    );
                    for (lane, y) in lane.iter_mut().zip(&ys) {
                        let pl = _mm512_maddubs_epi16(lo, yword(y.add(64 * c + 4 * k)));
                        let ph = _mm512_maddubs_epi16(hi, yword(y.add(64 * c + 32 + 4 * k)));
                        *lane =
                            _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(*lane, pl, sc[0]), ph, sc[1]);
                    }
                }
                for j in 0..T {
                    acc[j][k] = _mm512_fmadd_ps(d[j], _mm512_cvtepi32_ps(lane[j]), acc[j][k]);
                }
            }
            let dmx = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q4K_DMIN) as *const __m256i));
            let mins: [__m512i; 8] =
                std::array::from_fn(|s| scale_pairs::<false>(blk.add(Q4K_MINS + 16 * s)));
            for (j, accm) in accm.iter_mut().enumerate() {
                let dy = *a.f.get_unchecked((t + j) * nb + b);
                // Σ_s min_s · (bsum_2s + bsum_2s+1): the bsum pair read as one i32.
                let bs = a.bsums.as_ptr().add(((t + j) * a.cols + b * 256) / 16);
                let mut msum = zero;
                for (s, &m) in mins.iter().enumerate() {
                    let pair = _mm512_set1_epi32((bs.add(2 * s) as *const i32).read_unaligned());
                    msum = _mm512_dpwssd_epi32(msum, m, pair);
                }
                // `summs += dmin * msum` in llama.cpp: product, then sum (not fused).
                let dmin = _mm512_mul_ps(_mm512_set1_ps(-dy), dmx);
                *accm = _mm512_add_ps(*accm, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(msum)));
            }
        }
        for j in 0..T {
            let r = _mm512_add_ps(lanes_sum(&acc[j]), accm[j]);
            _mm512_storeu_ps(out.add(j * GROUP), r);
        }
    }
}
