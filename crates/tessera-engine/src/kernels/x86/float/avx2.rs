//! AVX2 float kernels: 8 rows per load; prefill by lane passes over the lane-major copies,
//! decode by chain passes (the overview is in the parent module).

use std::arch::x86_64::*;

use super::*;

/// The 8 rows `8·h8..8·h8 + 8` of the column stored `e`-th (`matrix::float_column`).
#[inline(always)]
pub(super) unsafe fn load8<const K: u8>(w: *const u8, e: usize, h8: usize) -> __m256 {
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

/// One lane's accumulators of both row halves for `T` tokens over its `seg` columns:
/// `[token][h8]`. `w` holds the lane's columns from index `col`, its columns of each block
/// ([`float_lane_cols`], side by side) `step` columns after the last block's: in the
/// [`lane_major_weights`] layout (F32) a run of `seg` (`step` the lane's columns of a block),
/// in a stored F16/BF16 group a chunk apart (`float_lane_start`); `x`
/// points at the tile's first token's activation for the lane's first column in the
/// [`lane_major`] layout (the tile's tokens side by side, the lane's next column `stride`
/// floats on).
#[inline(always)]
pub(super) unsafe fn lane_pass<const K: u8, const T: usize>(
    (w, col, step): (*const u8, usize, usize),
    (x, stride): (*const f32, usize),
    seg: usize,
) -> [[__m256; 2]; T] {
    let cpl = float_lane_cols(K);
    // SAFETY: the lane's `seg` columns are in bounds of `w` and, for the tile's tokens, of `x`
    // (caller); AVX2/FMA/F16C enabled (caller).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        let mut xp = x;
        // Block by block, the lane's columns of each (a constant count, unrolled) at fixed
        // offsets: no column index to compute per step.
        let mut wp = w.add(col * GROUP * esize(K));
        for _ in 0..seg / cpl {
            for c in 0..cpl {
                let w0 = load8::<K>(wp, c, 0);
                let w1 = load8::<K>(wp, c, 1);
                for (j, acc) in acc.iter_mut().enumerate() {
                    let xe = _mm256_broadcast_ss(&*xp.add(j));
                    acc[0] = _mm256_fmadd_ps(w0, xe, acc[0]);
                    acc[1] = _mm256_fmadd_ps(w1, xe, acc[1]);
                }
                xp = xp.add(stride);
            }
            wp = wp.add(step * GROUP * esize(K));
        }
        acc
    }
}

/// Every lane's accumulators of both row halves for `T` tokens: `[lane][token][h8]` (F16 and
/// BF16 use the first 16 and 32).
pub(super) type LaneAcc<const T: usize> = [[[__m256; 2]; T]; 64];

/// What `scalar::float_row` makes of its lanes, each lane's accumulators `lane(l)` computed
/// once: the four quarters' partial sums ([`quarter_lanes`], in the scalar tree's order: each
/// `f(i)` once, few partial sums alive) added by the top of the tree ([`reduce16_top`]). F32/F16
/// the row sums (twice); BF16 the two partial sums of lanes `i` and `16 + i`, which the scalar
/// kernel adds in f64.
#[inline(always)]
pub(super) unsafe fn reduce_lanes<const K: u8, const T: usize>(
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
pub(super) fn add_acc<const T: usize>(
    a: [[__m256; 2]; T],
    b: [[__m256; 2]; T],
) -> [[__m256; 2]; T] {
    // SAFETY: AVX is enabled in every caller (this is only inlined into them).
    std::array::from_fn(|j| std::array::from_fn(|h| unsafe { _mm256_add_ps(a[j][h], b[j][h]) }))
}

/// Quarter `q` of [`reduce_lanes`]: its tree's partial sum over the lanes `q + 4k` (and, F32,
/// `16 + q + 4k`, `32 + q + 4k`, `48 + q + 4k`; BF16 `16 + q + 4k`) for `k` = 0..4, as
/// [`reduce16_quarter`] adds them (F32/F16 once, BF16 the two partial sums).
#[inline(always)]
pub(super) unsafe fn quarter_lanes<const K: u8, const T: usize>(
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
        let r = if K == FLOAT_F16 {
            reduce16_quarter(q, lane, add)
        } else {
            reduce16_quarter(
                q,
                |i| add(add(lane(i), lane(32 + i)), add(lane(16 + i), lane(48 + i))),
                add,
            )
        };
        (r, r)
    }
}

/// Quarter `q` ([`quarter_lanes`]) of `T` tokens by one lane pass per lane, stored at `dst`:
/// token `j`'s set `s` at `dst + (j · sets + s) · 16`. `w`: the stored F16/BF16 group, read in
/// place (a quarter of its lanes is a quarter of its bytes), or F32's
/// [`lane_major_weights`].
#[inline(always)]
pub(super) unsafe fn quarter_by_pass<const K: u8, const T: usize>(
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
            let at = match float_chunk(K) {
                0 => (p * seg, float_lane_cols(K)),
                chunk => (float_lane_start(K, p, seg * n_lanes(K) / 64), chunk),
            };
            lane_pass::<K, T>((w.as_ptr(), at.0, at.1), x.lane(p), seg)
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

/// `T ≤ 2` tokens by chain passes over `4 / T` neighbouring lanes (F32: `2 / T`) at a time: each
/// lane's whole chain (every block, in column order, as `scalar::float_row` runs it) with its
/// accumulators in registers, its sums stored once, then combined and reduced ([`reduce_lanes`]).
/// F16/BF16 passes read their chunk of every block ([`float_column`]), one run of memory.
/// Meanwhile, but for F16, the next group (`gbytes` on: the groups of a matrix follow each other) is prefetched
/// into L2 in address order, a pass's share at a time spread over its blocks. Into L2 only: a
/// group of 1,024 F16 columns is 32 KiB, a Zen 2–4 core's whole L1, and the next one brought
/// into L1 evicted the lines the current passes were about to read (on a Zen 4 capped to AVX2,
/// F16 decode of the dense bench model on one thread 16.6–16.9 → 22.5–23.5 tok/s).
#[inline(always)]
pub(super) unsafe fn lanes_by_chain<const K: u8, const T: usize>(
    w: *const u8,
    xs: &[*const f32; T],
    np: usize,
    gbytes: usize,
) -> Reduced<T> {
    let mut acc = std::mem::MaybeUninit::<LaneAcc<T>>::uninit();
    let p = acc.as_mut_ptr() as *mut [[__m256; 2]; T];
    // Lanes per pass: 8 accumulators (4 lanes × 2 halves for 1 token, 2 × 2 × 2 for 2; F32
    // half the lanes): a chunk of each block's F16/BF16 weights (512 or 256 bytes), or half of
    // one for 2 tokens.
    let ls = 8 / (T * esize(K));
    let passes = n_lanes(K) / ls;
    let nb = np / 64;
    // F16's passes (4 of 16 lanes, each a quarter of the group in one run) need no help:
    // without the next group's prefetch, the dense bench model's F16 decode on a Zen 4 capped
    // to AVX2 (alternated, 4 rounds) ran 33.3 against 29.8 tok/s on 2 threads, 24.1 against
    // 21.2 on one.
    let lines = if K == FLOAT_F16 { 0 } else { gbytes / 64 };
    let per_pass = lines.div_ceil(passes);
    let per_block = per_pass.div_ceil(nb.max(1));
    let chunk = float_chunk(K);
    // SAFETY: as `lane_pass`; each pass writes its lanes before `reduce_lanes` reads them,
    // and the passes cover every lane.
    unsafe {
        let next = w.wrapping_add(gbytes);
        for pass in 0..passes {
            // The lanes at positions p0..p0 + ls of `lane_order`: one chunk of every block
            // (`float_column`), or half of one for 2 tokens.
            let p0 = pass * ls;
            let lanes: [usize; 4] =
                std::array::from_fn(|li| lane_order::<K>()[(p0 + li) % 64] as usize);
            // Where each lane's columns start (F16/BF16; F32 reads columns in order).
            let starts: [usize; 4] = std::array::from_fn(|li| {
                if chunk == 0 {
                    0
                } else {
                    float_lane_start(K, p0 + li, nb)
                }
            });
            let mut a = [[[_mm256_setzero_ps(); 2]; T]; 4];
            let mut ahead = next.wrapping_add(pass * per_pass * 64);
            let ahead_end = next.wrapping_add(((pass + 1) * per_pass).min(lines) * 64);
            for b in 0..nb {
                let base = 64 * b;
                for _ in 0..per_block {
                    if ahead < ahead_end {
                        _mm_prefetch::<_MM_HINT_T1>(ahead as *const i8);
                        ahead = ahead.wrapping_add(64);
                    }
                }
                for (li, a) in a.iter_mut().enumerate().take(ls) {
                    let mut second = 0;
                    lane_columns::<K>(base, lanes[li], |e| {
                        let at = if chunk == 0 {
                            e
                        } else {
                            starts[li] + b * chunk + second
                        };
                        second += 1;
                        debug_assert_eq!(at, float_column(K, e, np));
                        let w0 = load8::<K>(w, at, 0);
                        let w1 = load8::<K>(w, at, 1);
                        for (a, x) in a.iter_mut().zip(xs) {
                            let xe = _mm256_broadcast_ss(&*x.add(e));
                            a[0] = _mm256_fmadd_ps(w0, xe, a[0]);
                            a[1] = _mm256_fmadd_ps(w1, xe, a[1]);
                        }
                    });
                }
            }
            for (li, a) in a.iter().enumerate().take(ls) {
                p.add(lanes[li]).write(*a);
            }
        }
        reduce_lanes::<K, T>(|l| (acc.as_ptr() as *const [[__m256; 2]; T]).add(l).read())
    }
}

/// `T ≤ 2` tokens of a group ([`lanes_by_chain`]): `out[j*16 + r]` for token `t + j`.
#[inline(always)]
pub(super) unsafe fn tile_avx2<const K: u8, const T: usize>(
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

/// [`group`] on AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group_avx2<const K: u8>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    // SAFETY: features enabled; `group` checks the bounds.
    unsafe { group::<K, false>(w, a, t0, nt, out) }
}
