//! F32/F16/BF16 weights on the column-interleaved layout: one load holds one column of 16 rows
//! (AVX-512) or of 8 (AVX2), multiplied by a broadcast activation, so each lane of an
//! accumulator is one row and each accumulator one of `scalar::float_row`'s lanes. Results
//! equal the scalar kernel's bit for bit.

use std::arch::x86_64::*;

use super::super::matrix::GROUP;
use super::super::pool::ThreadPool;
use super::super::quant_acts::{ActKind, QuantizedActs};
use super::super::scalar::{FLOAT_BF16, FLOAT_F16, FLOAT_F32};
use super::super::SharedMut;

const fn esize(k: u8) -> usize {
    if k == FLOAT_F32 {
        4
    } else {
        2
    }
}

/// The 16 rows' weights of column `e`.
#[inline(always)]
unsafe fn load16<const K: u8>(w: *const u8, e: usize) -> __m512 {
    // SAFETY: the caller guarantees column e is in bounds and AVX-512 F is enabled.
    unsafe {
        let p = w.add(e * GROUP * esize(K));
        match K {
            FLOAT_F32 => _mm512_loadu_ps(p as *const f32),
            FLOAT_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            _ => {
                let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
                _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
            }
        }
    }
}

/// 16 lane accumulators over columns `base + off + (0..16 or 0..32)` for `base` stepping by
/// `period` up to `end`: one column per lane, or for BF16 one pair per lane, odd first.
#[inline(always)]
unsafe fn pass<const K: u8>(
    w: *const u8,
    x: *const f32,
    end: usize,
    period: usize,
    off: usize,
) -> [__m512; 16] {
    // SAFETY: columns below `end` are in bounds (caller); AVX-512 F enabled (caller).
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 16];
        let mut fma = |e: usize, l: usize| {
            acc[l] = _mm512_fmadd_ps(load16::<K>(w, e), _mm512_set1_ps(*x.add(e)), acc[l]);
        };
        let mut base = 0;
        while base + period <= end {
            for l in 0..16 {
                if K == FLOAT_BF16 {
                    fma(base + off + 2 * l + 1, l);
                    fma(base + off + 2 * l, l);
                } else {
                    fma(base + off + l, l);
                }
            }
            base += period;
        }
        acc
    }
}

#[inline(always)]
fn reduce(a: &[__m512; 16]) -> __m512 {
    // SAFETY: AVX-512 F is enabled in every caller.
    unsafe {
        let s8: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(a[i], a[i + 8]));
        let s4: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(s8[i], s8[i + 4]));
        _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3]))
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn token<const K: u8>(w: *const u8, x: &[f32], out: &mut [f32; GROUP]) {
    let n = x.len();
    let xp = x.as_ptr();
    // Weight `e` of row `r`, for the scalar remainders.
    let wr = |e: usize, r: usize| -> f32 {
        // SAFETY: e < n and r < 16 lie inside the group.
        unsafe {
            let p = w.add((e * GROUP + r) * esize(K));
            match K {
                FLOAT_F32 => (p as *const f32).read_unaligned(),
                FLOAT_F16 => half::f16::from_bits((p as *const u16).read_unaligned()).to_f32(),
                _ => f32::from_bits(((p as *const u16).read_unaligned() as u32) << 16),
            }
        }
    };
    // SAFETY: the caller checked the group holds n columns; features enabled.
    unsafe {
        match K {
            FLOAT_F32 | FLOAT_F16 => {
                let np = n / 64 * 64;
                let a: [[__m512; 16]; 4] =
                    std::array::from_fn(|g| pass::<K>(w, xp, np, 64, 16 * g));
                let v: [__m512; 16] = std::array::from_fn(|i| {
                    _mm512_add_ps(
                        _mm512_add_ps(a[0][i], a[2][i]),
                        _mm512_add_ps(a[1][i], a[3][i]),
                    )
                });
                _mm512_storeu_ps(out.as_mut_ptr(), reduce(&v));
                if np < n && K == FLOAT_F32 {
                    for (r, o) in out.iter_mut().enumerate() {
                        for (e, &xe) in x.iter().enumerate().skip(np) {
                            *o = wr(e, r).mul_add(xe, *o);
                        }
                    }
                } else if np < n {
                    for (r, o) in out.iter_mut().enumerate() {
                        let mut s = *o as f64;
                        for (e, &xe) in x.iter().enumerate().skip(np) {
                            s += (wr(e, r) * xe) as f64;
                        }
                        *o = s as f32;
                    }
                }
            }
            _ => {
                let np = n / 64 * 64;
                let (mut c1, mut c2) = ([0f32; GROUP], [0f32; GROUP]);
                _mm512_storeu_ps(c1.as_mut_ptr(), reduce(&pass::<K>(w, xp, np, 64, 0)));
                _mm512_storeu_ps(c2.as_mut_ptr(), reduce(&pass::<K>(w, xp, np, 64, 32)));
                for (r, o) in out.iter_mut().enumerate() {
                    let mut s = c1[r] as f64 + c2[r] as f64;
                    for (e, &xe) in x.iter().enumerate().skip(np) {
                        s += (wr(e, r) * xe) as f64;
                    }
                    *o = s as f32;
                }
            }
        }
    }
}

macro_rules! entry {
    ($name:ident, $k:expr) => {
        /// # Safety
        /// Requires AVX-512 F/BW/VL, AVX2, FMA and F16C.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        pub(super) unsafe fn $name(
            w: &[u8],
            a: &QuantizedActs,
            t0: usize,
            nt: usize,
            out: &mut [f32],
        ) {
            if nt >= 3 {
                // SAFETY: this entry's features; prefill_avx512 checks the bounds.
                return unsafe { prefill_avx512::<{ $k }>(w, a, t0, nt, out) };
            }
            // F16/BF16 decode runs the AVX2 chain passes, which prefetch the weights ahead: on
            // a Zen 5 VM (`examples/float_prefill`, 1 token, 2 threads, the dense bench
            // geometry's matmuls over 0.5-1 GB of weights, alternated) F16 19.0-19.6 ->
            // 26.9-27.2 GFLOP/s a thread, BF16 16.0 -> 30.1, where F32 fell 15-19 -> 10-11
            // (its passes read half the lanes at a time) and keeps the one-token sweep.
            if $k != FLOAT_F32 {
                // SAFETY: AVX2, FMA and F16C come with this entry's features; group_avx2
                // checks the bounds.
                return unsafe { group_avx2::<{ $k }>(w, a, t0, nt, out) };
            }
            let n = a.cols;
            assert!(w.len() >= n * GROUP * esize($k));
            assert!((t0 + nt) * n <= a.f.len() && out.len() >= nt * GROUP);
            for j in 0..nt {
                let x = &a.f[(t0 + j) * n..(t0 + j + 1) * n];
                let o: &mut [f32; GROUP] =
                    (&mut out[j * GROUP..(j + 1) * GROUP]).try_into().unwrap();
                // SAFETY: bounds checked above; features guaranteed by the caller.
                unsafe { token::<{ $k }>(w.as_ptr(), x, o) };
            }
        }
    };
}

entry!(f32_avx512, FLOAT_F32);
entry!(f16_avx512, FLOAT_F16);
entry!(bf16_avx512, FLOAT_BF16);

// ---- AVX2: 8 rows per load ----
//
// A row's 64 (BF16: 32) lane sums are independent chains, each over every 64th column in
// column order, so they may be computed in any order; only each chain's own order and the
// final combination are fixed (`scalar::float_row`). AVX-512 holds 16 lanes of 16 rows in
// registers and walks the columns once. AVX2 has half the registers of half the width:
// - prefill (3 or more tokens): one lane at a time ("a lane pass", `lane_pass`) for both
//   8-row halves and a tile of up to `TILE` tokens, so each weight load feeds `TILE` FMAs
//   per half instead of one. A pass reads a lane's columns, every 64th, so both operands are
//   first copied lane by lane into consecutive memory: each group's weights once per kernel
//   call (`lane_major_weights`), the activations once per matmul in slices of a tile's tokens
//   (`lane_major`, built on the pool by `QuantizedActs::new` when AVX2 or AVX-512 is the
//   active ISA). AVX-512 prefill runs the same tiles over the same copies with all 16 rows in
//   one register, each FMA broadcasting its activation from memory, and takes two neighbouring
//   groups per call where the matmul driver has them (`prefill_two_avx512`): a pass is one
//   lane of both groups for a slice's tokens (`quarter_two512`), so each activation feeds two
//   weight columns; a lone group's pass is one lane of two whole slices (`quarter_pair512`)
//   or, for a slice alone, four lanes (`quarter_by_pass512`). F16/BF16 decode on AVX-512 runs
//   the AVX2 chain passes below.
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
//   once. A pass reads two cache lines (F16) of every 2 KiB block, so the weights are streamed by
//   prefetches instead: during each pass its share of the next group, in address order (the group
//   then sits in L2 when its passes begin), and the lines two passes on in this group (the first
//   group of a task, which nothing prefetched). Measured on the dense bench geometry's matmuls (28
//   layers, F16, 1 token, the old sweep and the passes alternated in one process, median of 10
//   passes each, AMD EPYC Zen 3 under load 4.3–4.7): 1 thread 9.6–10.4 → 12.1–12.6 tok/s of
//   matmuls, 2 tokens 17.5 → 21.6.

/// Tokens per prefill tile: 2 halves × 6 tokens = 12 accumulators, plus two weight registers
/// and a broadcast, within AVX2's 16.
const TILE: usize = 6;

/// The 8 rows `8·h8..8·h8 + 8` of column `e`.
#[inline(always)]
unsafe fn load8<const K: u8>(w: *const u8, e: usize, h8: usize) -> __m256 {
    // SAFETY: the caller guarantees column e is in bounds and AVX2/F16C are enabled.
    unsafe {
        let p = w.add((e * GROUP + 8 * h8) * esize(K));
        match K {
            FLOAT_F32 => _mm256_loadu_ps(p as *const f32),
            FLOAT_F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _ => {
                let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
            }
        }
    }
}

/// Lanes per row: `scalar::float_row`'s 4 × 16 (F32/F16: lane `L` takes the columns
/// `≡ L mod 64`) or 2 × 16 (BF16: lane `L` takes columns `2L + 1` then `2L` of each 64).
const fn n_lanes(k: u8) -> usize {
    if k == FLOAT_BF16 {
        32
    } else {
        64
    }
}

/// The lanes in the order the prefill passes visit them ([`quarter_lanes`] for quarters 0 to 3):
/// the order of the lanes in the [`lane_major_weights`] and [`lane_major`] layouts, so that a
/// tile's passes read each operand as one run of consecutive memory (which the hardware
/// prefetchers stream), not 64 short runs in a jumping order. F32/F16: for `i` in `q, q + 8, q +
/// 4, q + 12`, lanes `i, 32 + i, 16 + i, 48 + i`; BF16: lanes `i, 16 + i` (the first 32).
const fn lane_order<const K: u8>() -> [u8; 64] {
    let mut o = [0u8; 64];
    let mut at = 0;
    let mut q = 0;
    while q < 4 {
        let offs = [0, 8, 4, 12];
        let mut k = 0;
        while k < 4 {
            let i = (q + offs[k]) as u8;
            if K == FLOAT_BF16 {
                o[at] = i;
                o[at + 1] = 16 + i;
                at += 2;
            } else {
                o[at] = i;
                o[at + 1] = 32 + i;
                o[at + 2] = 16 + i;
                o[at + 3] = 48 + i;
                at += 4;
            }
            k += 1;
        }
        q += 1;
    }
    o
}

/// Where lane `l` sits in [`lane_order`].
#[inline(always)]
fn lane_position<const K: u8>(l: usize) -> usize {
    const fn inverse(o: [u8; 64], n: usize) -> [u8; 64] {
        let mut p = [0u8; 64];
        let mut i = 0;
        while i < n {
            p[o[i] as usize] = i as u8;
            i += 1;
        }
        p
    }
    let pos: [u8; 64] = const { inverse(lane_order::<K>(), n_lanes(K)) };
    pos[l] as usize
}

/// Lane `l`'s chain step at the 64-column block starting at `base`: `f(column)` in the
/// lane's order.
#[inline(always)]
fn lane_columns<const K: u8>(base: usize, l: usize, mut f: impl FnMut(usize)) {
    if K == FLOAT_BF16 {
        f(base + 2 * l + 1);
        f(base + 2 * l);
    } else {
        f(base + l);
    }
}

/// One lane's accumulators of both row halves for `T` tokens over its `seg` columns:
/// `[token][h8]`. `w` is the group's weights in the [`lane_major_weights`] layout, the lane's
/// first column at index `col` of it; `x` points at the tile's first token's activation for
/// the lane's first column in the [`lane_major`] layout (the tile's tokens side by side, the
/// lane's next column `stride` floats on).
#[inline(always)]
unsafe fn lane_pass<const K: u8, const T: usize>(
    (w, col): (*const u8, usize),
    (x, stride): (*const f32, usize),
    seg: usize,
) -> [[__m256; 2]; T] {
    // SAFETY: the lane's `seg` columns are in bounds of `w` and, for the tile's tokens, of `x`
    // (caller); AVX2/FMA/F16C enabled (caller).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        let mut xp = x;
        for e in col..col + seg {
            let w0 = load8::<K>(w, e, 0);
            let w1 = load8::<K>(w, e, 1);
            for (j, acc) in acc.iter_mut().enumerate() {
                let xe = _mm256_broadcast_ss(&*xp.add(j));
                acc[0] = _mm256_fmadd_ps(w0, xe, acc[0]);
                acc[1] = _mm256_fmadd_ps(w1, xe, acc[1]);
            }
            xp = xp.add(stride);
        }
        acc
    }
}

/// A group's weights with their columns reordered for the lane passes: lane `l`'s `s`-th
/// column (in [`lane_columns`] order) as column `l · seg + s`, columns past the last whole 64
/// left out. Once per kernel call, for all its tiles: a lane's columns then follow each other
/// in memory, where in the group they lie 2 KiB apart (F32: 4 KiB, the same L1 set).
#[inline(always)]
unsafe fn lane_major_weights<const K: u8>(w: *const u8, np: usize, into: &mut Vec<u8>) {
    let col = GROUP * esize(K);
    // Every byte is written below: only growth needs filling.
    into.resize(np * col, 0);
    let o = into.as_mut_ptr();
    // SAFETY: columns below np are in the group (caller); `into` holds np columns, each
    // written once.
    unsafe {
        let mut at = 0;
        for &l in &lane_order::<K>()[..n_lanes(K)] {
            for base in (0..np).step_by(64) {
                lane_columns::<K>(base, l as usize, |e| {
                    std::ptr::copy_nonoverlapping(w.add(e * col), o.add(at), col);
                    at += col;
                });
            }
        }
    }
}

thread_local! {
    /// Each pool thread's buffer for [`lane_major_weights`] (a group of a 3,072-column F32
    /// matrix takes 192 KiB, past what the allocator hands out without mapping fresh pages).
    static REORDERED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Tokens per block of the [`lane_major`] layout. The matmul driver hands kernels 64 tokens at
/// a time (floats: 256) from a 64-aligned start unless it splits the tokens between tasks, so
/// tiles line up with blocks and with the [`TILE`]-wide slices within them.
const BLOCK: usize = 64;

/// The slice of the [`lane_major`] layout that holds token `t` of `nt`: its first token and
/// width. Blocks of [`BLOCK`] tokens are cut into slices of [`TILE`] from the block's start,
/// the last slice of a block (or of the batch) narrower.
#[inline(always)]
fn slice_of(t: usize, nt: usize) -> (usize, usize) {
    let b0 = t / BLOCK * BLOCK;
    let s0 = b0 + (t - b0) / TILE * TILE;
    (s0, TILE.min(nt.min(b0 + BLOCK) - s0))
}

/// The activations rearranged so that a lane pass reads them in order: tokens in slices of up
/// to [`TILE`] ([`slice_of`]), a slice of `width` tokens from `s0` at `s0 · np`, and within it
/// lane `l`'s `s`-th column of token `j` (in [`lane_columns`] order) at
/// `(l · seg + s) · width + j`, where `seg` is a lane's column count. A tile's tokens then sit
/// side by side behind one pointer, and a whole lane pass reads one run of consecutive floats,
/// where the plain layout puts every token a row apart and every column of a lane 64 floats on
/// (an L1 line per broadcast). Slices of a whole block of 64 tokens, as before (a tile's floats
/// a quarter of each line it reads, the rest read again by the block's other tiles), measured
/// 8% slower at 1,024 columns and a third slower at 3,072 (1 thread, 256 tokens, F16,
/// alternated). Columns past the last whole 64 are not held (the tails read `a.f`). Built once
/// per set of activations and shared by every group and thread.
fn lane_major<const K: u8>(a: &QuantizedActs) -> &[f32] {
    a.lane_major.get_or_init(|| build_lane_major::<K>(a, None))
}

/// [`lane_major`] of `a`, on `pool` if given (one task per slice).
fn build_lane_major<const K: u8>(a: &QuantizedActs, pool: Option<&ThreadPool>) -> Vec<f32> {
    let (n, nt) = (a.cols, a.n_tokens);
    let np = n / 64 * 64;
    let mut v = vec![0f32; nt * np];
    let shared = SharedMut::new(&mut v);
    // Slice i: block i / per_block, its (i % per_block)-th slice.
    let per_block = BLOCK.div_ceil(TILE);
    let task = |i: usize| {
        let s0 = i / per_block * BLOCK + i % per_block * TILE;
        if s0 >= nt {
            return;
        }
        let (_, width) = slice_of(s0, nt);
        // SAFETY: each slice's task writes only its own floats.
        let out = unsafe { shared.range(s0 * np, width * np) };
        for j in 0..width {
            let x = &a.f[(s0 + j) * n..(s0 + j + 1) * n];
            let mut at = j;
            for &l in &lane_order::<K>()[..n_lanes(K)] {
                for base in (0..np).step_by(64) {
                    lane_columns::<K>(base, l as usize, |e| {
                        out[at] = x[e];
                        at += width;
                    });
                }
            }
        }
    };
    let tasks = nt.div_ceil(BLOCK) * per_block;
    match pool {
        Some(pool) => pool.run(tasks, task),
        None => (0..tasks).for_each(task),
    }
    v
}

/// Builds the [`lane_major`] layout of float activations on `pool` ahead of the matmuls
/// (rather than on one thread inside the first kernel call while the others wait). Only for
/// batches that the AVX2 kernels run as prefill tiles.
pub(crate) fn prepare_lane_major(pool: &ThreadPool, a: &QuantizedActs) {
    if a.n_tokens < 3 {
        return;
    }
    let v = match a.kind {
        ActKind::F16 => build_lane_major::<FLOAT_F16>(a, Some(pool)),
        ActKind::BF16 => build_lane_major::<FLOAT_BF16>(a, Some(pool)),
        ActKind::F32 => build_lane_major::<FLOAT_F32>(a, Some(pool)),
        _ => return,
    };
    // Nothing can have set it yet: `a` is still being built.
    let _ = a.lane_major.set(v);
}

/// Where a prefill tile of tokens `t..` (within one slice of [`slice_of`]) finds lane `l`'s
/// activations in the [`lane_major`] layout, and their stride.
#[derive(Clone, Copy)]
struct TileActs {
    /// The tile's first token's first column of lane 0.
    p: *const f32,
    /// Floats between a lane's successive columns (the slice's width).
    width: usize,
    /// Columns per lane.
    seg: usize,
}

impl TileActs {
    /// # Safety
    /// `lanes` must be [`lane_major`] of `a`, and tokens `t..t + T` within one slice.
    unsafe fn new<const K: u8>(lanes: &[f32], a: &QuantizedActs, t: usize) -> Self {
        let np = a.cols / 64 * 64;
        let (s0, width) = slice_of(t, a.n_tokens);
        Self {
            // SAFETY: s0·np + (t - s0) is inside the slice (caller).
            p: unsafe { lanes.as_ptr().add(s0 * np + (t - s0)) },
            width,
            seg: np / n_lanes(K),
        }
    }

    /// The first column of the lane at position `l` ([`lane_order`]).
    #[inline(always)]
    fn lane(self, l: usize) -> (*const f32, usize) {
        (self.p.wrapping_add(l * self.seg * self.width), self.width)
    }
}

/// Every lane's accumulators of both row halves for `T` tokens: `[lane][token][h8]`.
type LaneAcc<const T: usize> = [[[__m256; 2]; T]; 64];

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

/// What `scalar::float_row` makes of its lanes, each lane's accumulators `lane(l)` computed
/// once: the four quarters' partial sums ([`quarter_lanes`], in the scalar tree's order: each
/// `f(i)` once, few partial sums alive) added by the top of the tree ([`reduce16_top`]). F32/F16
/// the row sums of `(lane i + lane 32+i) + (lane 16+i + lane 48+i)` (twice); BF16 the two
/// partial sums of lanes `i` and `16 + i`, which the scalar kernel adds in f64.
#[inline(always)]
unsafe fn reduce_lanes<const K: u8, const T: usize>(
    mut lane: impl FnMut(usize) -> [[__m256; 2]; T],
) -> Reduced<T> {
    // SAFETY: AVX is enabled in every caller.
    unsafe {
        let q: [Reduced<T>; 4] = std::array::from_fn(|q| quarter_lanes::<K, T>(q, &mut lane));
        let first = reduce16_top(q.map(|r| r.0), add_acc::<T>);
        if K == FLOAT_BF16 {
            (first, reduce16_top(q.map(|r| r.1), add_acc::<T>))
        } else {
            (first, first)
        }
    }
}

/// Lane accumulators added token by token and row half by row half.
#[inline(always)]
fn add_acc<const T: usize>(a: [[__m256; 2]; T], b: [[__m256; 2]; T]) -> [[__m256; 2]; T] {
    // SAFETY: AVX is enabled in every caller (this is only inlined into them).
    std::array::from_fn(|j| std::array::from_fn(|h| unsafe { _mm256_add_ps(a[j][h], b[j][h]) }))
}

/// Quarter `q` of [`reduce_lanes`]: its tree's partial sum over the lanes `q + 4k` (and, F32/F16,
/// `16 + q + 4k`, `32 + q + 4k`, `48 + q + 4k`; BF16 `16 + q + 4k`) for `k` = 0..4, as
/// [`reduce16_quarter`] adds them (F32/F16 once, BF16 the two partial sums).
#[inline(always)]
unsafe fn quarter_lanes<const K: u8, const T: usize>(
    q: usize,
    mut lane: impl FnMut(usize) -> [[__m256; 2]; T],
) -> Reduced<T> {
    let add = add_acc::<T>;
    if K == FLOAT_BF16 {
        reduce16_quarter(
            q,
            |i| (lane(i), lane(16 + i)),
            |a, b| (add(a.0, b.0), add(a.1, b.1)),
        )
    } else {
        let r = reduce16_quarter(
            q,
            |i| add(add(lane(i), lane(32 + i)), add(lane(16 + i), lane(48 + i))),
            add,
        );
        (r, r)
    }
}

/// Floats per token of a prefill quarter's partial sums: BF16 two sets of 16 rows, else one.
const fn sets(k: u8) -> usize {
    if k == FLOAT_BF16 {
        2
    } else {
        1
    }
}

/// Quarter `q` ([`quarter_lanes`]) of `T` tokens by one lane pass per lane, stored at `dst`:
/// token `j`'s set `s` at `dst + (j · sets + s) · 16`. `w`: the group's [`lane_major_weights`].
#[inline(always)]
unsafe fn quarter_by_pass<const K: u8, const T: usize>(
    w: &[u8],
    x: TileActs,
    q: usize,
    dst: *mut f32,
) {
    let seg = x.seg;
    debug_assert_eq!(w.len(), n_lanes(K) * seg * GROUP * esize(K));
    // SAFETY: as `lane_pass`: lane l's weights are columns l·seg..(l+1)·seg of `w`; `dst`
    // holds T tokens' sets (caller).
    unsafe {
        let (r1, r2) = quarter_lanes::<K, T>(q, |l| {
            let p = lane_position::<K>(l);
            lane_pass::<K, T>((w.as_ptr(), p * seg), x.lane(p), seg)
        });
        for j in 0..T {
            for h8 in 0..2 {
                let o = dst.add(j * sets(K) * GROUP + 8 * h8);
                _mm256_storeu_ps(o, r1[j][h8]);
                if K == FLOAT_BF16 {
                    _mm256_storeu_ps(o.add(GROUP), r2[j][h8]);
                }
            }
        }
    }
}

/// Lanes per AVX-512 prefill pass: one [`reduce16_quarter`] leaf of F32/F16 (lanes `i, 32 + i,
/// 16 + i, 48 + i`) or two of BF16 (`i, 16 + i` for two `i`), neighbours in [`lane_order`].
const WIDE_LANES: usize = 4;

/// [`WIDE_LANES`] lanes at [`lane_order`] positions `p..p + 4` for `T` tokens, 16 rows a
/// register: `[lane][token]`. As [`lane_pass`] (each lane's chain over its columns in order),
/// but one 32-byte F16 load feeds `T` FMAs of all 16 rows, each with its activation broadcast
/// from memory by the FMA itself.
#[inline(always)]
unsafe fn lanes_pass512<const K: u8, const T: usize>(
    w: *const u8,
    x: TileActs,
    p: usize,
) -> [[__m512; T]; WIDE_LANES] {
    let seg = x.seg;
    // SAFETY: lanes p..p+4 have `seg` columns each in `w` (the group's lane-major weights)
    // and, for the tile's tokens, in `x` (caller); AVX-512 F enabled (caller).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); T]; WIDE_LANES];
        let xs: [(*const f32, usize); WIDE_LANES] = std::array::from_fn(|l| x.lane(p + l));
        let stride = xs[0].1;
        for s in 0..seg {
            for (l, acc) in acc.iter_mut().enumerate() {
                let wv = load16::<K>(w, (p + l) * seg + s);
                let xp = xs[l].0.add(s * stride);
                for (j, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_fmadd_ps(wv, _mm512_set1_ps(*xp.add(j)), *acc);
                }
            }
        }
        acc
    }
}

/// [`quarter_by_pass`] by 16-row passes of [`WIDE_LANES`] lanes ([`lanes_pass512`]): the same
/// partial sums, added in the same order. Its own features (not inlined): [`prefill`]'s tile
/// loop runs in closures, which take no features from the AVX-512 entry they are inlined into.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn quarter_by_pass512<const K: u8, const T: usize>(
    w: &[u8],
    x: TileActs,
    q: usize,
    dst: *mut f32,
) {
    let per_q = n_lanes(K) / 4;
    debug_assert_eq!(w.len(), n_lanes(K) * x.seg * GROUP * esize(K));
    let add = |a: [__m512; T], b: [__m512; T]| -> [__m512; T] {
        std::array::from_fn(|j| _mm512_add_ps(a[j], b[j]))
    };
    // SAFETY: the quarter's lanes lie in `w` and `x` (caller); `dst` holds T tokens' sets.
    unsafe {
        let pass = |k: usize| lanes_pass512::<K, T>(w.as_ptr(), x, q * per_q + k * WIDE_LANES);
        // Per set, the quarter's sum: [`reduce16_quarter`] over its four leaves.
        let (r1, r2) = if K == FLOAT_BF16 {
            // Each pass: leaves (lanes 0, 1) and (lanes 2, 3), added as the tree's first or
            // second pair.
            let a = pass(0);
            let b = pass(1);
            (
                add(add(a[0], a[2]), add(b[0], b[2])),
                add(add(a[1], a[3]), add(b[1], b[3])),
            )
        } else {
            let leaf = |k: usize| {
                let l = pass(k);
                add(add(l[0], l[1]), add(l[2], l[3]))
            };
            let s8a = add(leaf(0), leaf(1));
            let r = add(s8a, add(leaf(2), leaf(3)));
            (r, r)
        };
        for j in 0..T {
            let o = dst.add(j * sets(K) * GROUP);
            _mm512_storeu_ps(o, r1[j]);
            if K == FLOAT_BF16 {
                _mm512_storeu_ps(o.add(GROUP), r2[j]);
            }
        }
    }
}

/// One lane's accumulators of two token sets or two groups: `(first, second)`, each `[token]`.
type TwoAcc<const T: usize> = ([__m512; T], [__m512; T]);

/// One lane at [`lane_order`] position `p` for two whole slices' tokens (`x.0`, `x.1`), 16 rows
/// a register: one conversion of a weight column feeds 12 FMAs, where [`lanes_pass512`] feeds
/// 6 (in L1, on a Zen 5 core: ~230 against ~195 GFLOP/s at 16 columns a lane, 255 against 230
/// at 256).
#[inline(always)]
unsafe fn lane_pair_pass512<const K: u8>(
    w: *const u8,
    x: (TileActs, TileActs),
    p: usize,
) -> TwoAcc<TILE> {
    let seg = x.0.seg;
    // SAFETY: lane p has `seg` columns in `w` and, for both slices' tokens, in `x` (caller);
    // AVX-512 F enabled (caller).
    unsafe {
        let mut acc = ([_mm512_setzero_ps(); TILE], [_mm512_setzero_ps(); TILE]);
        let (xa, stride) = x.0.lane(p);
        let (xb, _) = x.1.lane(p);
        for s in 0..seg {
            let wv = load16::<K>(w, p * seg + s);
            let (pa, pb) = (xa.add(s * stride), xb.add(s * stride));
            for j in 0..TILE {
                acc.0[j] = _mm512_fmadd_ps(wv, _mm512_set1_ps(*pa.add(j)), acc.0[j]);
                acc.1[j] = _mm512_fmadd_ps(wv, _mm512_set1_ps(*pb.add(j)), acc.1[j]);
            }
        }
        acc
    }
}

/// One lane at [`lane_order`] position `p` of two groups (`w.0`, `w.1`: their lane-major
/// weights) for `T` tokens of one slice: each broadcast activation feeds both groups' columns,
/// so a pass reads half the activations per FMA (in L1, on a Zen 5 core: 2 groups × 6 tokens
/// ~245 GFLOP/s against ~200-230 for one group × 12 tokens at 16 columns a lane).
#[inline(always)]
unsafe fn lane_two_pass512<const K: u8, const T: usize>(
    w: (*const u8, *const u8),
    x: TileActs,
    p: usize,
) -> TwoAcc<T> {
    let seg = x.seg;
    // SAFETY: lane p has `seg` columns in both groups' weights and, for the tile's tokens, in
    // `x` (caller); AVX-512 F enabled (caller).
    unsafe {
        let mut acc = ([_mm512_setzero_ps(); T], [_mm512_setzero_ps(); T]);
        let (xp, stride) = x.lane(p);
        for s in 0..seg {
            let wa = load16::<K>(w.0, p * seg + s);
            let wb = load16::<K>(w.1, p * seg + s);
            let xs = xp.add(s * stride);
            for j in 0..T {
                let xe = _mm512_set1_ps(*xs.add(j));
                acc.0[j] = _mm512_fmadd_ps(wa, xe, acc.0[j]);
                acc.1[j] = _mm512_fmadd_ps(wb, xe, acc.1[j]);
            }
        }
        acc
    }
}

/// Quarter `q`'s partial sums ([`quarter_lanes`]'s tree) from lane passes that each give one
/// lane's [`TwoAcc`] (`lane(k)` for the quarter's `k`-th position in [`lane_order`]), both
/// halves of the pair added alike: per set (BF16: two, else the same twice) a [`TwoAcc`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn quarter_tree512<const K: u8, const T: usize>(
    mut lane: impl FnMut(usize) -> TwoAcc<T>,
) -> (TwoAcc<T>, TwoAcc<T>) {
    let add = |a: TwoAcc<T>, b: TwoAcc<T>| -> TwoAcc<T> {
        (
            std::array::from_fn(|j| _mm512_add_ps(a.0[j], b.0[j])),
            std::array::from_fn(|j| _mm512_add_ps(a.1[j], b.1[j])),
        )
    };
    if K == FLOAT_BF16 {
        // Lanes 0..4: leaves (0, 1) and (2, 3), the tree's first pair; lanes 4..8 its second.
        let (l0, l1) = (lane(0), lane(1));
        let a0 = add(l0, lane(2));
        let a1 = add(l1, lane(3));
        let (l4, l5) = (lane(4), lane(5));
        let b0 = add(l4, lane(6));
        let b1 = add(l5, lane(7));
        (add(a0, b0), add(a1, b1))
    } else {
        let mut leaf = |k: usize| {
            let l0 = lane(4 * k);
            let s01 = add(l0, lane(4 * k + 1));
            let l2 = lane(4 * k + 2);
            add(s01, add(l2, lane(4 * k + 3)))
        };
        let s8a = add(leaf(0), leaf(1));
        let l2 = leaf(2);
        let r = add(s8a, add(l2, leaf(3)));
        (r, r)
    }
}

/// Stores `T` tokens' quarter sums `r` (per set) at `dst`: token `j`'s set `s` at `dst + (j ·
/// sets + s) · 16`.
#[inline(always)]
unsafe fn store_quarter<const K: u8, const T: usize>(r: ([__m512; T], [__m512; T]), dst: *mut f32) {
    // SAFETY: `dst` holds T tokens' sets (caller); AVX-512 F enabled (caller).
    unsafe {
        for j in 0..T {
            let o = dst.add(j * sets(K) * GROUP);
            _mm512_storeu_ps(o, r.0[j]);
            if K == FLOAT_BF16 {
                _mm512_storeu_ps(o.add(GROUP), r.1[j]);
            }
        }
    }
}

/// [`quarter_by_pass512`] for two whole slices at once ([`lane_pair_pass512`], a lane a
/// pass): the same partial sums, added in the same order; token `j` of the pair at `dst + (j ·
/// sets + s) · 16`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn quarter_pair512<const K: u8>(w: &[u8], x: (TileActs, TileActs), q: usize, dst: *mut f32) {
    let per_q = n_lanes(K) / 4;
    debug_assert_eq!(w.len(), n_lanes(K) * x.0.seg * GROUP * esize(K));
    // SAFETY: the quarter's lanes lie in `w` and `x` (caller); `dst` holds 12 tokens' sets.
    unsafe {
        let (r1, r2) =
            quarter_tree512::<K, TILE>(|k| lane_pair_pass512::<K>(w.as_ptr(), x, q * per_q + k));
        store_quarter::<K, TILE>((r1.0, r2.0), dst);
        store_quarter::<K, TILE>((r1.1, r2.1), dst.add(TILE * sets(K) * GROUP));
    }
}

/// [`quarter_by_pass512`] of two groups at once ([`lane_two_pass512`], a lane a pass): each
/// group's partial sums as its own, stored at `dst.0` and `dst.1`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn quarter_two512<const K: u8, const T: usize>(
    w: (&[u8], &[u8]),
    x: TileActs,
    q: usize,
    dst: (*mut f32, *mut f32),
) {
    let per_q = n_lanes(K) / 4;
    debug_assert_eq!(w.0.len(), n_lanes(K) * x.seg * GROUP * esize(K));
    debug_assert_eq!(w.1.len(), w.0.len());
    // SAFETY: the quarter's lanes lie in both groups' weights and in `x` (caller); `dst.0` and
    // `dst.1` each hold T tokens' sets.
    unsafe {
        let wp = (w.0.as_ptr(), w.1.as_ptr());
        let (r1, r2) = quarter_tree512::<K, T>(|k| lane_two_pass512::<K, T>(wp, x, q * per_q + k));
        store_quarter::<K, T>((r1.0, r2.0), dst.0);
        store_quarter::<K, T>((r1.1, r2.1), dst.1);
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
            for q in 0..4 {
                let mut j = 0;
                while j < nt {
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

/// `T ≤ 2` tokens by chain passes over `4 / T` neighbouring lanes (F32: `2 / T`) at a time: each
/// lane's whole chain (every block, in column order, as `scalar::float_row` runs it) with its
/// accumulators in registers, its sums stored once, then combined and reduced ([`reduce_lanes`]).
/// Meanwhile the next group (`gbytes` on: the groups of a matrix follow each other) is prefetched
/// in address order, a pass's share at a time spread over its blocks, and the lines this group's
/// pass two on will read (for a task's first group).
#[inline(always)]
unsafe fn lanes_by_chain<const K: u8, const T: usize>(
    w: *const u8,
    xs: &[*const f32; T],
    np: usize,
    gbytes: usize,
) -> Reduced<T> {
    let mut acc = std::mem::MaybeUninit::<LaneAcc<T>>::uninit();
    let p = acc.as_mut_ptr() as *mut [[__m256; 2]; T];
    // Lanes per pass: 128 bytes of each block's F16/BF16 weights (8 accumulators: 4 lanes ×
    // 2 halves for 1 token, 2 × 2 × 2 for 2), as many bytes of F32 (half the lanes).
    let ls = 8 / (T * esize(K));
    let passes = n_lanes(K) / ls;
    let nb = np / 64;
    let lines = gbytes / 64;
    let per_pass = lines.div_ceil(passes);
    let per_block = per_pass.div_ceil(nb.max(1));
    // Bytes of a pass's columns within a block (its lanes' columns are neighbours).
    let set_bytes = 64 / n_lanes(K) * ls * GROUP * esize(K);
    let line = |q: *const u8| {
        // SAFETY: a prefetch never faults; SSE is enabled in every caller.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(q as *const i8) }
    };
    // SAFETY: as `lane_pass`; each pass writes its lanes before `reduce_lanes` reads them,
    // and the passes cover every lane.
    unsafe {
        let next = w.wrapping_add(gbytes);
        for pass in 0..passes {
            let l0 = pass * ls;
            let mut a = [[[_mm256_setzero_ps(); 2]; T]; 4];
            let mut ahead = next.wrapping_add(pass * per_pass * 64);
            let ahead_end = next.wrapping_add(((pass + 1) * per_pass).min(lines) * 64);
            let later = w.wrapping_add((pass + 2) * set_bytes);
            for b in 0..nb {
                let base = 64 * b;
                for _ in 0..per_block {
                    if ahead < ahead_end {
                        line(ahead);
                        ahead = ahead.wrapping_add(64);
                    }
                }
                if pass + 2 < passes {
                    let q = later.wrapping_add(base * GROUP * esize(K));
                    for off in (0..set_bytes).step_by(64) {
                        line(q.wrapping_add(off));
                    }
                }
                for (li, a) in a.iter_mut().enumerate().take(ls) {
                    lane_columns::<K>(base, l0 + li, |e| {
                        let w0 = load8::<K>(w, e, 0);
                        let w1 = load8::<K>(w, e, 1);
                        for (a, x) in a.iter_mut().zip(xs) {
                            let xe = _mm256_broadcast_ss(&*x.add(e));
                            a[0] = _mm256_fmadd_ps(w0, xe, a[0]);
                            a[1] = _mm256_fmadd_ps(w1, xe, a[1]);
                        }
                    });
                }
            }
            for (li, a) in a.iter().enumerate().take(ls) {
                p.add(l0 + li).write(*a);
            }
        }
        reduce_lanes::<K, T>(|l| (acc.as_ptr() as *const [[__m256; 2]; T]).add(l).read())
    }
}

/// `T ≤ 2` tokens of a group ([`lanes_by_chain`]): `out[j*16 + r]` for token `t + j`.
#[inline(always)]
unsafe fn tile_avx2<const K: u8, const T: usize>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    out: &mut [f32],
) {
    let n = a.cols;
    let np = n / 64 * 64;
    // SAFETY: the caller checked the group holds n columns and that tokens t..t+T are in
    // `a.f`; features enabled.
    unsafe {
        let xs: [*const f32; T] = std::array::from_fn(|j| a.f.as_ptr().add((t + j) * n));
        let (v, c2) = lanes_by_chain::<K, T>(w, &xs, np, n * GROUP * esize(K));
        for j in 0..T {
            let mut s = [[0f32; GROUP]; 2];
            for h8 in 0..2 {
                _mm256_storeu_ps(s[0].as_mut_ptr().add(8 * h8), v[j][h8]);
                if K == FLOAT_BF16 {
                    _mm256_storeu_ps(s[1].as_mut_ptr().add(8 * h8), c2[j][h8]);
                }
            }
            let o: &mut [f32; GROUP] = (&mut out[j * GROUP..(j + 1) * GROUP]).try_into().unwrap();
            finish::<K>(w, &a.f[(t + j) * n..(t + j + 1) * n], np, &s, o);
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
    REORDERED.with_borrow_mut(|reordered| {
        // Prefill tiles read lane-major copies: the activations' (built once for `a`, by
        // the first call that needs it) and this group's weights'.
        let lanes: &[f32] = if nt >= 3 {
            // SAFETY: the group holds n columns (checked above); features enabled (caller).
            unsafe { lane_major_weights::<K>(wp, np, reordered) };
            lane_major::<K>(a)
        } else {
            &[]
        };
        let copies = (&reordered[..], lanes);
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

/// [`group`] on AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2<const K: u8>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    // SAFETY: features enabled; `group` checks the bounds.
    unsafe { group::<K, false>(w, a, t0, nt, out) }
}

/// [`group`]'s prefill by 16-row passes (`nt ≥ 3`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn prefill_avx512<const K: u8>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    // SAFETY: features enabled; `group` checks the bounds.
    unsafe { group::<K, true>(w, a, t0, nt, out) }
}

thread_local! {
    /// Each pool thread's buffer for the second group's [`lane_major_weights`]
    /// ([`prefill_two_avx512`]).
    static REORDERED2: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Two neighbouring groups × `nt ≥ 3` tokens from `t0` (`w`: both groups' bytes), written to
/// `out[(j · 2 + g) · 16 + r]`: [`prefill`]'s tiles with each activation broadcast feeding both
/// groups ([`quarter_two512`]). Each group's sums are the one-group kernel's, bit for bit.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn prefill_two_avx512<const K: u8>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let n = a.cols;
    let gb = n * GROUP * esize(K);
    assert!(nt >= 3 && w.len() >= 2 * gb);
    assert!((t0 + nt) * n <= a.f.len() && out.len() >= nt * 2 * GROUP);
    let np = n / 64 * 64;
    let w0 = w.as_ptr();
    let w1 = w[gb..].as_ptr();
    REORDERED.with_borrow_mut(|r0| {
        REORDERED2.with_borrow_mut(|r1| {
            // SAFETY: both groups hold n columns (checked above); features enabled (caller).
            unsafe {
                lane_major_weights::<K>(w0, np, r0);
                lane_major_weights::<K>(w1, np, r1);
                let lanes = lane_major::<K>(a);
                prefill::<K, true, 2>([w0, w1], a, ([&r0[..], &r1[..]], lanes), t0, nt, out)
            }
        })
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
            // lane 3's second column; token 62 (block 0's last slice, from 60, 4 wide). Lanes
            // sit in `lane_order`: lane 3 (quarter 3's first) at position 48.
            let np = cols / 64 * 64;
            if dtype == GgmlType::F16 {
                assert_eq!(slice_of(65, nt), (64, TILE));
                assert_eq!(slice_of(62, nt), (60, 4));
                assert_eq!(slice_of(67, 68), (64, 4), "the batch's last slice");
                let seg = np / 64;
                let p3 = lane_position::<FLOAT_F16>(3);
                assert_eq!(p3, 48);
                let want = a.f[65 * cols + 64 + 3];
                assert_eq!(lazy[64 * np + (p3 * seg + 1) * TILE + 1], want);
                assert_eq!(
                    lazy[60 * np + (p3 * seg + 1) * 4 + 2],
                    a.f[62 * cols + 64 + 3]
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
