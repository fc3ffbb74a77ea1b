//! AVX-512 float kernels: 16 rows per load; F32 decode by one sweep of the columns, prefill
//! by 16-row lane passes over the lane-major copies, one or two groups at a time.

use std::arch::x86_64::*;

use super::*;

/// The 16 rows' weights of column `e`.
#[inline(always)]
pub(super) unsafe fn load16<const K: u8>(w: *const u8, e: usize) -> __m512 {
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

/// F32's 16 lane accumulators over columns `base + off + (0..16)` for `base` stepping by 64 up
/// to `end`, in column order (F32 groups keep column order, `matrix::float_column`).
#[inline(always)]
unsafe fn pass_f32(w: *const u8, x: *const f32, end: usize, off: usize) -> [__m512; 16] {
    // SAFETY: columns below `end` are in bounds (caller); AVX-512 F enabled (caller).
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 16];
        let mut base = 0;
        while base + 64 <= end {
            for (l, acc) in acc.iter_mut().enumerate() {
                let e = base + off + l;
                *acc = _mm512_fmadd_ps(load16::<FLOAT_F32>(w, e), _mm512_set1_ps(*x.add(e)), *acc);
            }
            base += 64;
        }
        acc
    }
}

#[inline(always)]
pub(super) fn reduce(a: &[__m512; 16]) -> __m512 {
    // SAFETY: AVX-512 F is enabled in every caller.
    unsafe {
        let s8: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(a[i], a[i + 8]));
        let s4: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(s8[i], s8[i + 4]));
        _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3]))
    }
}

/// One token of an F32 group as `scalar::float_row` computes it: the four passes of 16 lanes
/// in one sweep of the columns, combined `(a0 + a2) + (a1 + a3)`, [`reduce`]d, the remainder
/// added with f32 FMAs. F16/BF16 decode runs the AVX2 chain passes instead (the `entry`s).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn token_f32(w: *const u8, x: &[f32], out: &mut [f32; GROUP]) {
    let n = x.len();
    let np = n / 64 * 64;
    // SAFETY: the caller checked the group holds n columns; features enabled.
    unsafe {
        let a: [[__m512; 16]; 4] = std::array::from_fn(|g| pass_f32(w, x.as_ptr(), np, 16 * g));
        let v: [__m512; 16] = std::array::from_fn(|i| {
            _mm512_add_ps(
                _mm512_add_ps(a[0][i], a[2][i]),
                _mm512_add_ps(a[1][i], a[3][i]),
            )
        });
        _mm512_storeu_ps(out.as_mut_ptr(), reduce(&v));
        for (r, o) in out.iter_mut().enumerate() {
            for (e, &xe) in x.iter().enumerate().skip(np) {
                let we = (w.add((e * GROUP + r) * 4) as *const f32).read_unaligned();
                *o = we.mul_add(xe, *o);
            }
        }
    }
}

macro_rules! entry {
    ($name:ident, $k:expr) => {
        /// # Safety
        /// Requires AVX-512 F/BW/VL, AVX2, FMA and F16C.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        pub(in super::super) unsafe fn $name(
            w: &[u8],
            a: &QuantizedActs,
            t0: usize,
            nt: usize,
            out: &mut [f32],
        ) {
            if nt >= 3 && ($k == FLOAT_F32 || super::super::wide_float_prefill()) {
                // SAFETY: this entry's features; prefill_avx512 checks the bounds.
                return unsafe { prefill_avx512::<{ $k }>(w, a, t0, nt, out) };
            }
            // F16/BF16 decode runs the AVX2 chain passes (and so does their prefill on a CPU
            // that splits 512-bit operations, `wide_float_prefill`), which prefetch the
            // weights ahead: on
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
                unsafe { token_f32(w.as_ptr(), x, o) };
            }
        }
    };
}

entry!(f32_avx512, FLOAT_F32);
entry!(f16_avx512, FLOAT_F16);
entry!(bf16_avx512, FLOAT_BF16);

/// Lanes per AVX-512 prefill pass: one [`reduce16_quarter`] leaf of F32 (lanes `i, 32 + i,
/// 16 + i, 48 + i`), a whole quarter of F16 (`q, q + 8, q + 4, q + 12`) or two leaves of one
/// of BF16 (`i, 16 + i` for two `i`), neighbours in [`lane_order`].
pub(super) const WIDE_LANES: usize = 4;

/// [`WIDE_LANES`] lanes at [`lane_order`] positions `p..p + 4` for `T` tokens, 16 rows a
/// register: `[lane][token]`. As [`lane_pass`] (each lane's chain over its columns in order),
/// but one 32-byte F16 load feeds `T` FMAs of all 16 rows, each with its activation broadcast
/// from memory by the FMA itself.
#[inline(always)]
pub(super) unsafe fn lanes_pass512<const K: u8, const T: usize>(
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
pub(super) unsafe fn quarter_by_pass512<const K: u8, const T: usize>(
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
        } else if K == FLOAT_F16 {
            // One pass: the quarter's four lanes, added as its tree adds them.
            let l = pass(0);
            let r = add(add(l[0], l[1]), add(l[2], l[3]));
            (r, r)
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
pub(super) type TwoAcc<const T: usize> = ([__m512; T], [__m512; T]);

/// One lane at [`lane_order`] position `p` for two whole slices' tokens (`x.0`, `x.1`), 16 rows
/// a register: one conversion of a weight column feeds 12 FMAs, where [`lanes_pass512`] feeds
/// 6 (in L1, on a Zen 5 core: ~230 against ~195 GFLOP/s at 16 columns a lane, 255 against 230
/// at 256).
#[inline(always)]
pub(super) unsafe fn lane_pair_pass512<const K: u8>(
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
pub(super) unsafe fn lane_two_pass512<const K: u8, const T: usize>(
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
pub(super) unsafe fn quarter_tree512<const K: u8, const T: usize>(
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
        // F16: the quarter's four lanes, `(q + q+8) + (q+4 + q+12)`; F32: four such leaves of
        // four lanes each.
        let mut leaf = |k: usize| {
            let l0 = lane(4 * k);
            let s01 = add(l0, lane(4 * k + 1));
            let l2 = lane(4 * k + 2);
            add(s01, add(l2, lane(4 * k + 3)))
        };
        if K == FLOAT_F16 {
            let r = leaf(0);
            return (r, r);
        }
        let s8a = add(leaf(0), leaf(1));
        let l2 = leaf(2);
        let r = add(s8a, add(l2, leaf(3)));
        (r, r)
    }
}

/// Stores `T` tokens' quarter sums `r` (per set) at `dst`: token `j`'s set `s` at `dst + (j ·
/// sets + s) · 16`.
#[inline(always)]
pub(super) unsafe fn store_quarter<const K: u8, const T: usize>(
    r: ([__m512; T], [__m512; T]),
    dst: *mut f32,
) {
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
pub(super) unsafe fn quarter_pair512<const K: u8>(
    w: &[u8],
    x: (TileActs, TileActs),
    q: usize,
    dst: *mut f32,
) {
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
pub(super) unsafe fn quarter_two512<const K: u8, const T: usize>(
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

/// [`group`]'s prefill by 16-row passes (`nt ≥ 3`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn prefill_avx512<const K: u8>(
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
    pub(super) static REORDERED2: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Two neighbouring groups × `nt ≥ 3` tokens from `t0` (`w`: both groups' bytes), written to
/// `out[(j · 2 + g) · 16 + r]`: [`prefill`]'s tiles with each activation broadcast feeding both
/// groups ([`quarter_two512`]). Each group's sums are the one-group kernel's, bit for bit.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn prefill_two_avx512<const K: u8>(
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
