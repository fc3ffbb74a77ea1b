//! F32/F16/BF16 weights on the column-interleaved layout: one load holds one column of 16 rows
//! (AVX-512) or of 8 (AVX2), multiplied by a broadcast activation, so each lane of an
//! accumulator is one row and each accumulator one of `scalar::float_row`'s lanes. Results
//! equal the scalar kernel's bit for bit. The AVX2 kernels are in `avx2`, the AVX-512 ones in
//! `avx512`, the lane-major copies both prefill paths read in `lane_major`; the prefill tile
//! loop, the final sums and the entries for the dispatch table here.

use std::arch::x86_64::*;

use super::super::matrix::{
    float_chunk, float_column, float_lane_cols, float_lane_order, float_lane_position,
    float_lane_start, GROUP,
};
use super::super::pool::ThreadPool;
use super::super::quant_acts::{ActKind, QuantizedActs};
use super::super::scalar::{FLOAT_BF16, FLOAT_F16, FLOAT_F32};
use super::super::{written_vec, SharedMut};

mod avx2;
mod avx512;
mod lane_major;

use avx2::*;
use avx512::*;
use lane_major::*;

pub(super) use avx512::{bf16_avx512, f16_avx512, f32_avx512};
pub(crate) use lane_major::prepare_lane_major;

// The design (AVX2: 8 rows per load; AVX-512 prefill shares its copies and tile loop):
//
// A row's 64 (F16: 16, BF16: 32) lane sums are independent chains, each over its columns of
// every 64-column block in column order (F32 one, F16 four, BF16 two: `float_lane_cols`), so
// they may be computed in any order; only each chain's own order and the final combination
// are fixed (`scalar::float_row`). AVX-512 holds 16 lanes of 16 rows in registers and walks
// the columns once. AVX2 has half the registers of half the width:
// - prefill (3 or more tokens): one lane at a time ("a lane pass", `lane_pass`) for both
//   8-row halves and a tile of up to `TILE` tokens, so each weight load feeds `TILE` FMAs
//   per half instead of one. A pass reads a lane's columns of every block, so both operands
//   are read lane by lane from consecutive memory: F16/BF16 weights in place (a lane's
//   columns of each block a chunk apart, `matrix::float_column`: in place of a per-call copy, 64-token
//   F16 matmuls +3-5% on a Zen 4 capped to AVX2), F32's and AVX-512's from a copy made once
//   per kernel call (`lane_major_weights`), the activations from one made once per matmul in
//   slices of a tile's tokens (`lane_major`, built on the pool by `QuantizedActs::new` when
//   AVX2 or AVX-512 is the active ISA). AVX-512 prefill runs the same tiles over the same copies with all 16 rows in
//   one register, each FMA broadcasting its activation from memory, and takes two neighbouring
//   groups per call where the matmul driver has them (`prefill_two_avx512`): a pass is one
//   lane of both groups for a slice's tokens (`quarter_two512`), so each activation feeds two
//   weight columns; a lone group's pass is one lane of two whole slices (`quarter_pair512`)
//   or, for a slice alone, four lanes (`quarter_by_pass512`). F16/BF16 decode on AVX-512 runs
//   the AVX2 chain passes below, and so does their prefill where the CPU splits 512-bit
//   operations into halves (`x86::wide_float_prefill`). F16's 16 lanes make each pass four
//   times longer than F32's 64 do for the same setup and combining (a dense layer's F16
//   matmuls at 512 tokens, 1 thread, Zen 4 capped to AVX2, alternated: 85-87 → 92-95
//   GFLOP/s with the activations' software prefetch, which these longer runs no longer
//   need, removed).
//   Both copies hold the lanes in the order the passes visit them (`lane_order`), so a tile's
//   passes read each operand as one sequential run. The passes go a quarter of the lanes
//   (`quarter_lanes`) at a time over every tile (`prefill_avx2`), each quarter's lanes
//   combined and reduced as soon as its passes end, the quarters' sums added by the top of
//   the tree at the end. Measured with `kernel_bench` (1 thread, 64 tokens, F16, old and new
//   binaries alternated): 88–99 GFLOP/s before the copies, 103–119 after, against ~143 for a
//   loop of bare FMAs on the same 2-core AMD EPYC when quiet; on a busier AMD EPYC (Zen 3)
//   where bare FMAs ran at ~104, 61–68 (3,072 columns: 53) with the activations in slices of
//   64 tokens, 70–75 with slices of a tile's width. On an AMD EPYC Zen 5 capped to AVX2 (bare
//   FMAs ~130, the same pass from L1 ~127), 512 tokens of the dense bench shapes: 96–99 →
//   102–104 with the lanes in visiting order;
// - decode (1 or 2 tokens): chain passes (`lanes_by_chain`): 4 neighbouring lanes (2 tokens: 2;
//   F32 half as many) at a time, each lane's whole chain over every block in column order with its
//   accumulators in registers (no buffer of every lane's sums read and written along the way,
//   which bound the earlier block-by-block sweep on loads and stores), the lanes' sums stored
//   once. F16 and BF16 groups store each pass's columns of every block together, pass after
//   pass (`matrix::float_column`), so a group is read front to back; during each pass its share
//   of the next group is prefetched into L2, in address order (the group then sits in L2 when
//   its passes begin; into L1 it evicted the lines the current passes were about to read where
//   L1 is 32 KiB, a group's size). Measured on the dense bench geometry's matmuls (28 layers,
//   F16, 1 token, the old sweep and the passes alternated in one process, median of 10 passes
//   each, AMD EPYC Zen 3 under load 4.3–4.7): 1 thread 9.6–10.4 → 12.1–12.6 tok/s of matmuls,
//   2 tokens 17.5 → 21.6. Reading 128 bytes of every 2 KiB instead (columns in order), with the
//   lines two passes on prefetched into L1, measured 25.2 / 31.2 tok/s of matmuls on 1 / 2
//   threads of a Zen 4 capped to AVX2 (`kernel_bench --model F16`), against 26.7–27.8 /
//   33.5–33.8 front to back.

const fn esize(k: u8) -> usize {
    if k == FLOAT_F32 {
        4
    } else {
        2
    }
}

/// Tokens per prefill tile: 2 halves × 6 tokens = 12 accumulators, plus two weight registers
/// and a broadcast, within AVX2's 16.
const TILE: usize = 6;

/// Per token and row half, what `scalar::reduce16` makes of the lanes: F32/F16 the row sums
/// (twice), BF16 the two partial sums that the scalar kernel adds in f64.
type Reduced<const T: usize> = ([[__m256; 2]; T], [[__m256; 2]; T]);

/// Quarter `i` (0..4) of `scalar::reduce16`'s tree: `(f(i) + f(i + 8)) + (f(i + 4) + f(i +
/// 12))`, `f` called in that order.
#[inline(always)]
fn reduce16_quarter<X: Copy>(
    i: usize,
    mut f: impl FnMut(usize) -> X,
    add: impl Fn(X, X) -> X,
) -> X {
    let a = f(i);
    let s8a = add(a, f(i + 8));
    let b = f(i + 4);
    add(s8a, add(b, f(i + 12)))
}

/// The top of `scalar::reduce16`'s tree over its four quarters ([`reduce16_quarter`]).
#[inline(always)]
fn reduce16_top<X: Copy>(s4: [X; 4], add: impl Fn(X, X) -> X) -> X {
    add(add(s4[0], s4[2]), add(s4[1], s4[3]))
}

/// Floats per token of a prefill quarter's partial sums: BF16 two sets of 16 rows, else one.
const fn sets(k: u8) -> usize {
    if k == FLOAT_BF16 {
        2
    } else {
        1
    }
}

thread_local! {
    /// Each pool thread's buffer for the prefill quarters' partial sums ([`prefill_avx2`]).
    static QUARTERS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `nt ≥ 3` tokens of a group from `t0`, a quarter of the lanes at a time ([`quarter_lanes`]):
/// every tile's passes over one quarter's lanes, then the next quarter's, the quarters' partial
/// sums kept in a buffer and added by the top of the tree at the end. A quarter's weights
/// (`np / 4` columns: 24 KiB of F16 at 3,072) stay in L1 across the tiles, where all the
/// group's (96 KiB) were read again from L2 by every tile.
#[inline(always)]
unsafe fn prefill<const K: u8, const WIDE: bool, const G: usize>(
    w: [*const u8; G],
    a: &QuantizedActs,
    (reordered, lanes): ([&[u8]; G], &[f32]),
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let n = a.cols;
    let np = n / 64 * 64;
    let per = sets(K) * GROUP;
    QUARTERS.with_borrow_mut(|parts| {
        // Every float is written before it is read: only growth needs filling.
        parts.resize(G * 4 * nt * per, 0.0);
        // Group `gi`'s quarter `q` for token `j`.
        let at = |gi: usize, q: usize, j: usize| ((gi * 4 + q) * nt + j) * per;
        // SAFETY: the caller checked the groups hold n columns, that tokens t0..t0+nt are in
        // `a.f`, and built `reordered` and `lanes`; each tile lies within one slice of `lanes`
        // and writes its own tokens' floats of `parts`; features enabled.
        unsafe {
            // Quarter `q` of the tile from token `j`; the tokens it took.
            let mut tile = |q: usize, j: usize| -> usize {
                let t = t0 + j;
                let (s0, width) = slice_of(t, a.n_tokens);
                let take = TILE.min(nt - j).min(s0 + width - t);
                let x = TileActs::new::<K>(lanes, a, t);
                let dst = parts.as_mut_ptr().add(at(0, q, j));
                if G == 2 {
                    let dst2 = (dst, parts.as_mut_ptr().add(at(G - 1, q, j)));
                    let w2 = (reordered[0], reordered[G - 1]);
                    match take {
                        1 => quarter_two512::<K, 1>(w2, x, q, dst2),
                        2 => quarter_two512::<K, 2>(w2, x, q, dst2),
                        3 => quarter_two512::<K, 3>(w2, x, q, dst2),
                        4 => quarter_two512::<K, 4>(w2, x, q, dst2),
                        5 => quarter_two512::<K, 5>(w2, x, q, dst2),
                        _ => quarter_two512::<K, TILE>(w2, x, q, dst2),
                    }
                    return take;
                }
                let reordered = reordered[0];
                // AVX-512: two whole slices in one tile where the next is whole too.
                if WIDE && take == TILE && j + 2 * TILE <= nt {
                    let t2 = t + TILE;
                    let (s2, w2) = slice_of(t2, a.n_tokens);
                    if s2 == t2 && w2 == TILE {
                        let x2 = TileActs::new::<K>(lanes, a, t2);
                        quarter_pair512::<K>(reordered, (x, x2), q, dst);
                        return 2 * TILE;
                    }
                }
                macro_rules! quarter {
                    ($t:expr) => {
                        if WIDE {
                            quarter_by_pass512::<K, { $t }>(reordered, x, q, dst)
                        } else {
                            quarter_by_pass::<K, { $t }>(reordered, x, q, dst)
                        }
                    };
                }
                match take {
                    1 => quarter!(1),
                    2 => quarter!(2),
                    3 => quarter!(3),
                    4 => quarter!(4),
                    5 => quarter!(5),
                    _ => quarter!(TILE),
                }
                take
            };
            // AVX2: the next group's weights (the matmul driver's next call; the groups of a
            // matrix follow each other) are prefetched into L2 a share per tile, so that its
            // first reads (F32: its `lane_major_weights` copy, a lane's columns 4 KiB apart)
            // find them there instead of waiting on memory for each line (the copy's loads
            // took ~2% of a 512-token dense prefill's samples in `perf`, nearly all stalled).
            let gbytes = n * GROUP * esize(K);
            let (mut ahead, ahead_end) = (w[0].wrapping_add(gbytes), w[0].wrapping_add(2 * gbytes));
            let per_tile = if WIDE || G > 1 {
                0
            } else {
                (gbytes / 64).div_ceil(4 * nt.div_ceil(TILE))
            };
            for q in 0..4 {
                let mut j = 0;
                while j < nt {
                    for _ in 0..per_tile {
                        if ahead < ahead_end {
                            // A prefetch never faults; SSE is enabled in every caller.
                            _mm_prefetch::<_MM_HINT_T1>(ahead as *const i8);
                            ahead = ahead.wrapping_add(64);
                        }
                    }
                    j += tile(q, j);
                }
            }
            let pp = parts.as_ptr();
            for j in 0..nt {
                for (gi, &w) in w.iter().enumerate() {
                    let mut s = [[0f32; GROUP]; 2];
                    for (set, s) in s.iter_mut().enumerate().take(sets(K)) {
                        for h8 in 0..2 {
                            let part = |q: usize| {
                                _mm256_loadu_ps(pp.add(at(gi, q, j) + set * GROUP + 8 * h8))
                            };
                            let v = reduce16_top([part(0), part(1), part(2), part(3)], |x, y| {
                                _mm256_add_ps(x, y)
                            });
                            _mm256_storeu_ps(s.as_mut_ptr().add(8 * h8), v);
                        }
                    }
                    let k = (j * G + gi) * GROUP;
                    let o: &mut [f32; GROUP] = (&mut out[k..k + GROUP]).try_into().unwrap();
                    finish::<K>(w, &a.f[(t0 + j) * n..(t0 + j + 1) * n], np, &s, o);
                }
            }
        }
    });
}

/// A token's row sums from what the lanes reduced to (`s[0]`; BF16 the two partial sums `s[0]`
/// and `s[1]`), with `scalar::float_row`'s remainder past the last whole 64 columns of `x`.
#[inline(always)]
unsafe fn finish<const K: u8>(
    w: *const u8,
    x: &[f32],
    np: usize,
    s: &[[f32; GROUP]; 2],
    o: &mut [f32; GROUP],
) {
    // SAFETY: the group holds x.len() columns (caller).
    unsafe {
        if K == FLOAT_BF16 {
            for (r, o) in o.iter_mut().enumerate() {
                let mut v = s[0][r] as f64 + s[1][r] as f64;
                for (e, &xe) in x.iter().enumerate().skip(np) {
                    v += (weight::<K>(w, e, r) * xe) as f64;
                }
                *o = v as f32;
            }
            return;
        }
        *o = s[0];
        if np < x.len() && K == FLOAT_F32 {
            for (r, o) in o.iter_mut().enumerate() {
                for (e, &xe) in x.iter().enumerate().skip(np) {
                    *o = weight::<K>(w, e, r).mul_add(xe, *o);
                }
            }
        } else if np < x.len() {
            for (r, o) in o.iter_mut().enumerate() {
                let mut v = *o as f64;
                for (e, &xe) in x.iter().enumerate().skip(np) {
                    v += (weight::<K>(w, e, r) * xe) as f64;
                }
                *o = v as f32;
            }
        }
    }
}

/// Weight `e` of row `r` of a group, for the scalar remainders.
#[inline(always)]
unsafe fn weight<const K: u8>(w: *const u8, e: usize, r: usize) -> f32 {
    // SAFETY: the caller guarantees e < n and r < 16 lie inside the group.
    unsafe {
        let p = w.add((e * GROUP + r) * esize(K));
        match K {
            FLOAT_F32 => (p as *const f32).read_unaligned(),
            FLOAT_F16 => half::f16::from_bits((p as *const u16).read_unaligned()).to_f32(),
            _ => f32::from_bits(((p as *const u16).read_unaligned() as u32) << 16),
        }
    }
}

/// A group × `nt` tokens in tiles of [`TILE`], the last tile as wide as the tokens left;
/// prefill's quarters by 16-row passes (`WIDE`, AVX-512) or by 8-row halves.
#[inline(always)]
unsafe fn group<const K: u8, const WIDE: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let n = a.cols;
    assert!(w.len() >= n * GROUP * esize(K));
    assert!((t0 + nt) * n <= a.f.len() && out.len() >= nt * GROUP);
    let wp = w.as_ptr();
    let np = n / 64 * 64;
    // AVX2 reads F16/BF16 groups in place (their chunks are in lane order).
    let in_place = !WIDE && K != FLOAT_F32;
    REORDERED.with_borrow_mut(|reordered| {
        // Prefill tiles read lane-major copies: the activations' (built once for `a`, by
        // the first call that needs it) and, but in place, this group's weights'.
        let lanes: &[f32] = if nt >= 3 {
            if !in_place {
                // SAFETY: the group holds n columns (checked above); features enabled (caller).
                unsafe { lane_major_weights::<K>(wp, np, reordered) };
            }
            lane_major::<K>(a)
        } else {
            &[]
        };
        let weights = if in_place {
            &w[..np * GROUP * esize(K)]
        } else {
            &reordered[..]
        };
        let copies = (weights, lanes);
        // SAFETY: bounds checked above; features guaranteed by the caller.
        unsafe {
            if nt >= 3 {
                return prefill::<K, WIDE, 1>([wp], a, ([copies.0], copies.1), t0, nt, out);
            }
            let mut j = 0;
            while j < nt {
                let o = &mut out[j * GROUP..];
                let t = t0 + j;
                match nt - j {
                    1 => tile_avx2::<K, 1>(wp, a, t, o),
                    _ => tile_avx2::<K, 2>(wp, a, t, o),
                }
                j += 2;
            }
        }
    });
}

/// One entry per element type (`$name = $k`) of the kernel `$kernel::<$k>`, behind the
/// features it needs, as the dispatch table calls it.
macro_rules! entries {
    ($kernel:ident, $features:literal, $needs:literal: $($name:ident = $k:expr),+) => {$(
        #[doc = concat!("# Safety\nRequires ", $needs, ".")]
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name(
            w: &[u8],
            a: &QuantizedActs,
            t0: usize,
            nt: usize,
            out: &mut [f32],
        ) {
            // SAFETY: this entry's features (the caller's promise); the kernel checks the bounds.
            unsafe { $kernel::<{ $k }>(w, a, t0, nt, out) }
        }
    )+};
}

entries!(prefill_two_avx512, "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    "AVX-512 F/BW/VL, AVX2, FMA and F16C":
    f32_two_avx512 = FLOAT_F32, f16_two_avx512 = FLOAT_F16, bf16_two_avx512 = FLOAT_BF16);
entries!(group_avx2, "avx2,fma,f16c", "AVX2, FMA and F16C":
    f32_avx2 = FLOAT_F32, f16_avx2 = FLOAT_F16, bf16_avx2 = FLOAT_BF16);

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_model::GgmlType;

    /// The layout built ahead on the pool (when AVX2 is the active ISA) is the one the kernels
    /// build for themselves otherwise: blocks of 64 tokens cut into slices of `TILE` (the last
    /// of a block, or of the batch, narrower), and a column tail past the last whole 64 left
    /// out.
    #[test]
    fn lane_major_built_on_the_pool_equals_the_one_built_in_a_kernel() {
        let pool = ThreadPool::new(3);
        for (dtype, nt, cols) in [
            (GgmlType::F16, 70, 1100),
            (GgmlType::BF16, 3, 128),
            (GgmlType::F32, 130, 64),
        ] {
            let x: Vec<f32> = (0..nt * cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let a = QuantizedActs::new(&pool, dtype, &x, nt, cols);
            let (lazy, ahead) = match dtype {
                GgmlType::F16 => (
                    build_lane_major::<FLOAT_F16>(&a, None),
                    build_lane_major::<FLOAT_F16>(&a, Some(&pool)),
                ),
                GgmlType::BF16 => (
                    build_lane_major::<FLOAT_BF16>(&a, None),
                    build_lane_major::<FLOAT_BF16>(&a, Some(&pool)),
                ),
                _ => (
                    build_lane_major::<FLOAT_F32>(&a, None),
                    build_lane_major::<FLOAT_F32>(&a, Some(&pool)),
                ),
            };
            assert_eq!(lazy, ahead, "{dtype}");
            // Spot checks of the layout itself: token 65 (block 1's first slice, 6 wide),
            // lane 3's second column (19) and fifth (block 1's first, 67); token 62 (block 0's
            // last slice, from 60, 4 wide). Lanes sit in `lane_order`: lane 3 (quarter 3's
            // first) at position 12.
            let np = cols / 64 * 64;
            if dtype == GgmlType::F16 {
                assert_eq!(slice_of(65, nt), (64, TILE));
                assert_eq!(slice_of(62, nt), (60, 4));
                assert_eq!(slice_of(67, 68), (64, 4), "the batch's last slice");
                let seg = np / 16;
                let p3 = lane_position::<FLOAT_F16>(3);
                assert_eq!(p3, 12);
                let want = a.f[65 * cols + 16 + 3];
                assert_eq!(lazy[64 * np + (p3 * seg + 1) * TILE + 1], want);
                let want = a.f[65 * cols + 64 + 3];
                assert_eq!(lazy[64 * np + (p3 * seg + 4) * TILE + 1], want);
                assert_eq!(
                    lazy[60 * np + (p3 * seg + 1) * 4 + 2],
                    a.f[62 * cols + 16 + 3]
                );
            }
            if dtype == GgmlType::BF16 {
                // Lane 5 takes column 11, then 10, of each 64; one slice of 3 tokens. It sits at
                // position 12 (quarter 1 from position 8: lanes 1, 17, 9, 25, 5, ...).
                let seg = np / 32;
                let p5 = lane_position::<FLOAT_BF16>(5);
                assert_eq!(p5, 12);
                assert_eq!(lazy[(p5 * seg) * nt + 2], a.f[2 * cols + 11]);
                assert_eq!(lazy[(p5 * seg + 1) * nt + 2], a.f[2 * cols + 10]);
            }
        }
    }
}
