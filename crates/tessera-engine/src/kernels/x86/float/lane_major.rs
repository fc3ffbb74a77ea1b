//! The lane-major copies of a group's weights and of the activations that the prefill lane
//! passes read in order ([`lane_order`]), and where a tile finds its tokens in them.

use std::mem::MaybeUninit;

use super::*;

/// Lanes per row: `scalar::float_row`'s 4 × 16 (F32: lane `L` takes the columns `≡ L mod
/// 64`), 16 (F16: the columns `≡ L mod 16`) or 2 × 16 (BF16: columns `2L + 1` then `2L` of
/// each 64).
pub(super) const fn n_lanes(k: u8) -> usize {
    64 / float_lane_cols(k)
}

/// The lanes in the order the passes visit them (`matrix::float_lane_order`): the order of the
/// lanes in the [`lane_major_weights`] and [`lane_major`] layouts and of the stored F16/BF16
/// chunks, so that a tile's passes read each operand as one run of consecutive memory (which
/// the hardware prefetchers stream), not 64 short runs in a jumping order.
pub(super) const fn lane_order<const K: u8>() -> [u8; 64] {
    float_lane_order(K)
}

/// Where lane `l` sits in [`lane_order`].
#[inline(always)]
pub(super) fn lane_position<const K: u8>(l: usize) -> usize {
    float_lane_position(K, l)
}

/// Lane `l`'s chain steps at the 64-column block starting at `base` ([`float_lane_cols`] of
/// them): `f(column)` in the lane's order.
#[inline(always)]
pub(super) fn lane_columns<const K: u8>(base: usize, l: usize, mut f: impl FnMut(usize)) {
    if K == FLOAT_BF16 {
        f(base + 2 * l + 1);
        f(base + 2 * l);
    } else {
        // F32 `l`, F16 `l, 16 + l, 32 + l, 48 + l`: every `n_lanes`-th column from `l`.
        for k in 0..float_lane_cols(K) {
            f(base + n_lanes(K) * k + l);
        }
    }
}

/// A group's weights with their columns reordered for the lane passes: lane `l`'s `s`-th
/// column (in [`lane_columns`] order) as column `l · seg + s`, columns past the last whole 64
/// left out. Once per kernel call, for all its tiles: a lane's columns then follow each other
/// in memory, where in the group they lie a chunk apart (`matrix::float_column`; F32: 4 KiB,
/// the same L1 set).
#[inline(always)]
pub(super) unsafe fn lane_major_weights<const K: u8>(w: *const u8, np: usize, into: &mut Vec<u8>) {
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
                    let from = w.add(float_column(K, e, np) * col);
                    std::ptr::copy_nonoverlapping(from, o.add(at), col);
                    at += col;
                });
            }
        }
    }
}

thread_local! {
    /// Each pool thread's buffer for [`lane_major_weights`] (a group of a 3,072-column F32
    /// matrix takes 192 KiB, past what the allocator hands out without mapping fresh pages).
    pub(super) static REORDERED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Tokens per block of the [`lane_major`] layout. The matmul driver hands kernels 64 tokens at
/// a time (floats: 256) from a 64-aligned start unless it splits the tokens between tasks, so
/// tiles line up with blocks and with the [`TILE`]-wide slices within them.
pub(super) const BLOCK: usize = 64;

/// The slice of the [`lane_major`] layout that holds token `t` of `nt`: its first token and
/// width. Blocks of [`BLOCK`] tokens are cut into slices of [`TILE`] from the block's start,
/// the last slice of a block (or of the batch) narrower.
#[inline(always)]
pub(super) fn slice_of(t: usize, nt: usize) -> (usize, usize) {
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
pub(super) fn lane_major<const K: u8>(a: &QuantizedActs) -> &[f32] {
    a.lane_major.get_or_init(|| build_lane_major::<K>(a, None))
}

/// [`lane_major`] of `a`, on `pool` if given (one task per slice).
pub(super) fn build_lane_major<const K: u8>(
    a: &QuantizedActs,
    pool: Option<&ThreadPool>,
) -> Vec<f32> {
    let (n, nt) = (a.cols, a.n_tokens);
    let np = n / 64 * 64;
    // Slice i: block i / per_block, its (i % per_block)-th slice.
    let per_block = BLOCK.div_ceil(TILE);
    let task = |shared: &SharedMut<MaybeUninit<f32>>, i: usize| {
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
                        out[at].write(x[e]);
                        at += width;
                    });
                }
            }
        }
    };
    let tasks = nt.div_ceil(BLOCK) * per_block;
    // SAFETY: the slices cover every token, and a slice's task writes each of its `width · np`
    // floats once (`at` steps through them: its tokens side by side, every lane's columns).
    unsafe {
        written_vec(nt * np, |shared| match pool {
            Some(pool) => pool.run(tasks, |i| task(shared, i)),
            None => (0..tasks).for_each(|i| task(shared, i)),
        })
    }
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
pub(super) struct TileActs {
    /// The tile's first token's first column of lane 0.
    pub(super) p: *const f32,
    /// Floats between a lane's successive columns (the slice's width).
    pub(super) width: usize,
    /// Columns per lane.
    pub(super) seg: usize,
}

impl TileActs {
    /// # Safety
    /// `lanes` must be [`lane_major`] of `a`, and tokens `t..t + T` within one slice.
    pub(super) unsafe fn new<const K: u8>(lanes: &[f32], a: &QuantizedActs, t: usize) -> Self {
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
    pub(super) fn lane(self, l: usize) -> (*const f32, usize) {
        (self.p.wrapping_add(l * self.seg * self.width), self.width)
    }
}
