//! Fused attention over an F16 or Q8_0 KV cache: the positions are walked in tiles of
//! [`TILE`] with an online softmax, so each key and value is read once per step for all the
//! query vectors that share its KV head (the heads of a GQA group, and a block of prompt rows),
//! and no score row as long as the context is ever materialised.
//!
//! # Numerical contract
//! Every query vector is computed by the same sequence of float operations whatever else is in
//! its item (which rows, which heads), on every instruction set — so results are
//! batch-invariant and the AVX-512, AVX2 and scalar builds agree bit for bit (tested):
//! - keys and values are converted exactly to f32 (F16), or dequantized as `q as f32 * d` (Q8_0);
//! - a score is `(Σ_i q[i]·k[i]) * scale`, the sum a chain of fused multiply-adds in dimension
//!   order starting from 0 (the SIMD builds put one *position* per lane, never split a sum);
//! - tiles are aligned to absolute positions (`TILE·t ..`), and a query vector visits only the
//!   tiles that hold a position of its span; per tile, with `m` the running maximum:
//!   `m' = max(m, max_j s_j)`, `c = exp(m - m')`, `p_j = exp(s_j - m')` for the positions in the
//!   span (others are skipped, not zeroed), `sum = sum·c + p_0 + p_1 + …` in position order,
//!   `acc = acc·c`, then `acc[i] = fma(v_j[i], p_j, acc[i])` in position order;
//! - `exp` is ggml's vector `expf` emulated per lane (`ops::v_expf_lane`);
//! - an attention sink (gpt-oss) is one more logit folded in after the last tile, without a
//!   value; the output is `acc · (1 / sum)`.
//!
//! The SIMD builds are this same Rust compiled with the target's features enabled
//! (`#[target_feature]` wrappers; only the exact F16 conversion names its instructions): Rust
//! never reassociates float operations and `mul_add` is always fused, so vectorising across
//! positions, dimensions and query vectors cannot change a bit.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::kernels::{isa, Isa};
use crate::kv::{KvShape, LayerView, TILE};
use crate::ops::v_expf_lane;

/// One KV head of one layer's cache (F16 or Q8_0 layout).
#[derive(Clone, Copy)]
pub(crate) struct HeadKv<'a> {
    pub view: LayerView<'a>,
    pub shape: KvShape,
    /// Which KV head.
    pub head: usize,
    /// Valid positions.
    pub len: usize,
}

/// Reusable buffers of [`attend_fused`].
#[derive(Debug, Default)]
pub struct FusedScratch {
    /// Key tile, transposed: `k_head_dim × TILE`.
    kt: Vec<f32>,
    /// Value tile: `TILE × v_head_dim`.
    vt: Vec<f32>,
    /// Per query vector: running max, running sum.
    m: Vec<f32>,
    s: Vec<f32>,
    /// Per query vector: `v_head_dim` accumulators.
    acc: Vec<f32>,
    row: Vec<f32>,
    /// The query vectors whose span meets the current tile, and their scores (then
    /// probabilities) against it: `TILE` each.
    live: Vec<usize>,
    p: Vec<f32>,
}

/// Attention of `spans.len()` query vectors (`q`: back to back, `k_head_dim` each) over one KV
/// head: vector `i` attends to positions `spans[i]` (causal end, sliding-window start), with
/// `sinks[i]` as an extra logit when given. Writes `v_head_dim` floats per vector to `out`.
pub(crate) fn attend_fused(
    out: &mut [f32],
    q: &[f32],
    spans: &[Range<usize>],
    sinks: Option<&[f32]>,
    kv: HeadKv<'_>,
    scale: f32,
    scratch: &mut FusedScratch,
) {
    attend_fused_on(isa(), out, q, spans, sinks, kv, scale, scratch)
}

/// [`attend_fused`] on a given instruction set (tests compare them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_fused_on(
    isa: Isa,
    out: &mut [f32],
    q: &[f32],
    spans: &[Range<usize>],
    sinks: Option<&[f32]>,
    kv: HeadKv<'_>,
    scale: f32,
    scratch: &mut FusedScratch,
) {
    let a = Args {
        out,
        q,
        spans,
        sinks,
        kv,
        scale,
        scratch,
    };
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: `isa` is only ever an instruction set this CPU has (see `Isa::available`).
        Isa::Avx512 if isa.available() => return unsafe { x86::avx512(a) },
        // SAFETY: as above.
        Isa::Avx2 if isa.available() => return unsafe { x86::avx2(a) },
        _ => {}
    }
    let _ = isa;
    attend_impl::<NARROW, SCALAR>(a)
}

struct Args<'a, 'b> {
    out: &'b mut [f32],
    q: &'b [f32],
    spans: &'b [Range<usize>],
    sinks: Option<&'b [f32]>,
    kv: HeadKv<'a>,
    scale: f32,
    scratch: &'b mut FusedScratch,
}

/// Register blocking of the tile loops: query vectors per block, and positions (scores) or
/// value dimensions (accumulation) held in registers per vector. Only the speed depends on it:
/// each score and each accumulator is its own chain of operations whatever the blocking.
/// 32 vector registers (AVX-512) hold 4 vectors × 64 floats; 16 (AVX2) hold 4 × 16.
#[cfg(target_arch = "x86_64")]
const WIDE: usize = 64;
const NARROW: usize = 16;

/// The instruction set an [`attend_impl`] is compiled for, as far as it uses intrinsics (the
/// F16 keys' and values' conversion, exact on every path).
const SCALAR: u8 = 0;
#[cfg(target_arch = "x86_64")]
const AVX2: u8 = 1;
#[cfg(target_arch = "x86_64")]
const AVX512: u8 = 2;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{attend_impl, Args, AVX2, AVX512, NARROW, WIDE};

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn avx512(a: Args<'_, '_>) {
        attend_impl::<WIDE, AVX512>(a)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2(a: Args<'_, '_>) {
        attend_impl::<NARROW, AVX2>(a)
    }
}

/// Query vectors per register block (see [`WIDE`]).
const NV: usize = 4;

#[inline(always)]
fn attend_impl<const R: usize, const L: u8>(a: Args<'_, '_>) {
    let Args {
        out,
        q,
        spans,
        sinks,
        kv,
        scale,
        scratch: sc,
    } = a;
    let (dk, dv) = (kv.shape.k_head_dim, kv.shape.v_head_dim);
    let nq = spans.len();
    debug_assert_eq!(q.len(), nq * dk);
    debug_assert_eq!(out.len(), nq * dv);
    sc.kt.resize(dk * TILE, 0.0);
    sc.vt.resize(TILE * dv, 0.0);
    sc.row.resize(dk.max(dv), 0.0);
    sc.m.clear();
    sc.m.resize(nq, f32::NEG_INFINITY);
    sc.s.clear();
    sc.s.resize(nq, 0.0);
    sc.acc.clear();
    sc.acc.resize(nq * dv, 0.0);
    sc.p.resize(nq * TILE, 0.0);
    let lo = spans.iter().map(|s| s.start).min().unwrap_or(0);
    let hi = spans.iter().map(|s| s.end).max().unwrap_or(0).min(kv.len);
    // The positions of the tile at `t0` in vector `i`'s span, relative to `t0`.
    let part = |i: usize, t0: usize| {
        let s = &spans[i];
        s.start.max(t0) - t0..s.end.min(kv.len).min(t0 + TILE) - t0
    };
    let mut t0 = lo / TILE * TILE;
    while t0 < hi {
        let valid = (hi - t0).min(TILE);
        load_tile::<L>(kv, t0, valid, &mut sc.kt, &mut sc.vt, &mut sc.row);
        sc.live.clear();
        sc.live.extend((0..nq).filter(|&i| {
            let s = &spans[i];
            s.start < t0 + TILE && s.end.min(kv.len) > t0 && s.start < s.end
        }));
        let live = &sc.live[..];
        let p = &mut sc.p[..live.len() * TILE];
        // Scores of the live vectors, a block of vectors at a time (each key row loaded once
        // per block).
        // Only the positions some vector of the block attends to are scored (the diagonal
        // tile of a prompt, a sliding window's first tile).
        for (b, p) in live.chunks(NV).zip(p.chunks_mut(NV * TILE)) {
            let qv = |k: usize| &q[b[k] * dk..(b[k] + 1) * dk];
            let first = b.iter().map(|&i| part(i, t0).start).min().unwrap_or(0);
            let end = b.iter().map(|&i| part(i, t0).end).max().unwrap_or(0);
            let js = first / R * R..end.div_ceil(R) * R;
            match b.len() {
                4 => tile_scores::<4, R>([qv(0), qv(1), qv(2), qv(3)], &sc.kt, p, js),
                3 => tile_scores::<3, R>([qv(0), qv(1), qv(2)], &sc.kt, p, js),
                2 => tile_scores::<2, R>([qv(0), qv(1)], &sc.kt, p, js),
                _ => tile_scores::<1, R>([qv(0)], &sc.kt, p, js),
            }
        }
        // Softmax steps and values, for runs of vectors with the same positions in this tile
        // (their sums' chains interleaved, each value row loaded once per run).
        let mut k = 0;
        while k < live.len() {
            let r = part(live[k], t0);
            let mut e = k + 1;
            while e < live.len() && e - k < NV && part(live[e], t0) == r {
                e += 1;
            }
            let (b, pb) = (&live[k..e], &mut p[k * TILE..e * TILE]);
            let st = State {
                m: &mut sc.m,
                s: &mut sc.s,
                acc: &mut sc.acc,
                dv,
            };
            match b.len() {
                4 => run_block::<4, R>(b, pb, r, scale, st, &sc.vt),
                3 => run_block::<3, R>(b, pb, r, scale, st, &sc.vt),
                2 => run_block::<2, R>(b, pb, r, scale, st, &sc.vt),
                _ => run_block::<1, R>(b, pb, r, scale, st, &sc.vt),
            }
            k = e;
        }
        t0 += TILE;
    }
    for i in 0..nq {
        let (mut m, mut s) = (sc.m[i], sc.s[i]);
        let acc = &mut sc.acc[i * dv..(i + 1) * dv];
        if let Some(sink) = sinks.map(|x| x[i]) {
            let m2 = m.max(sink);
            let c = v_expf_lane(m - m2);
            s = s * c + v_expf_lane(sink - m2);
            for x in acc.iter_mut() {
                *x *= c;
            }
            m = m2;
        }
        let _ = m;
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        for (o, &x) in out[i * dv..(i + 1) * dv].iter_mut().zip(acc.iter()) {
            *o = x * inv;
        }
    }
}

/// Converts positions `t0..t0 + valid` of the head into `kt` (transposed, `dk × TILE`) and `vt`
/// (`valid × dv`). Columns of `kt` past `valid` hold finite values (zeros or older entries) and
/// are never used.
#[inline(always)]
fn load_tile<const L: u8>(
    kv: HeadKv<'_>,
    t0: usize,
    valid: usize,
    kt: &mut [f32],
    vt: &mut [f32],
    row: &mut [f32],
) {
    let KvShape {
        n_head_kv: nkv,
        k_head_dim: dk,
        v_head_dim: dv,
        shared_v,
    } = kv.shape;
    let h = kv.head;
    match kv.view {
        LayerView::F16 { k_tiles, v_tiles } => {
            let at = ((t0 / TILE) * nkv + h) * dk * TILE;
            widen::<L>(&k_tiles[at..at + dk * TILE], kt);
            if !shared_v {
                let at = ((t0 / TILE) * nkv + h) * TILE * dv;
                widen::<L>(&v_tiles[at..at + valid * dv], &mut vt[..valid * dv]);
            }
        }
        LayerView::Q8_0 { kd, kq, vd, vq } => {
            for j in 0..TILE {
                if j < valid {
                    let at = ((t0 + j) * nkv + h) * dk;
                    dequantize_q8_0(
                        &kd[at / 32..(at + dk) / 32],
                        &kq[at..at + dk],
                        &mut row[..dk],
                    );
                    for (i, &x) in row[..dk].iter().enumerate() {
                        kt[i * TILE + j] = x;
                    }
                } else {
                    for i in 0..dk {
                        kt[i * TILE + j] = 0.0;
                    }
                }
            }
            for j in (0..valid).filter(|_| !shared_v) {
                let at = ((t0 + j) * nkv + h) * dv;
                dequantize_q8_0(
                    &vd[at / 32..(at + dv) / 32],
                    &vq[at..at + dv],
                    &mut vt[j * dv..(j + 1) * dv],
                );
            }
        }
        LayerView::F32 { .. } => unreachable!("the F32 cache uses ops::attend_group"),
    }
    if shared_v {
        // The values are the keys' first `dv` floats, already converted (exactly) above.
        for j in 0..valid {
            for (i, x) in vt[j * dv..(j + 1) * dv].iter_mut().enumerate() {
                *x = kt[i * TILE + j];
            }
        }
    }
}

/// `dst = src` as f32 (exact), 16 or 8 values per instruction on the SIMD paths (inlined into
/// them: the `half` crate's slice conversion is a call that converts 8 at a time).
#[inline(always)]
fn widen<const L: u8>(src: &[f16], dst: &mut [f32]) {
    let n = src.len();
    assert_eq!(dst.len(), n);
    #[allow(unused_mut)]
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
        if L == AVX512 {
            while i + 16 <= n {
                // SAFETY: i + 16 <= n for both slices; AVX-512 F is enabled in every caller
                // compiled with L = AVX512.
                unsafe {
                    let x = _mm256_loadu_si256(s.add(i) as *const __m256i);
                    _mm512_storeu_ps(d.add(i), _mm512_cvtph_ps(x));
                }
                i += 16;
            }
        }
        if L >= AVX2 {
            while i + 8 <= n {
                // SAFETY: i + 8 <= n for both slices; F16C and AVX are enabled in every caller
                // compiled with L >= AVX2.
                unsafe {
                    let x = _mm_loadu_si128(s.add(i) as *const __m128i);
                    _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(x));
                }
                i += 8;
            }
        }
    }
    src[i..].convert_to_f32_slice(&mut dst[i..]);
}

#[inline(always)]
fn dequantize_q8_0(d: &[f16], q: &[i8], out: &mut [f32]) {
    for ((o, q), d) in out.chunks_exact_mut(32).zip(q.chunks_exact(32)).zip(d) {
        let d = d.to_f32();
        for (o, &q) in o.iter_mut().zip(q) {
            *o = q as f32 * d;
        }
    }
}

/// Unscaled scores of `V` query vectors against a transposed key tile at positions `js` (a
/// range of whole steps), into `p` (`TILE` per vector): `P` positions at a time, each score a
/// chain of fused multiply-adds in dimension order.
#[inline(always)]
fn tile_scores<const V: usize, const P: usize>(
    q: [&[f32]; V],
    kt: &[f32],
    p: &mut [f32],
    js: Range<usize>,
) {
    for j0 in js.step_by(P) {
        let mut acc = [[0.0f32; P]; V];
        for i in 0..q[0].len() {
            let k: &[f32; P] = kt[i * TILE + j0..i * TILE + j0 + P]
                .try_into()
                .expect("P positions");
            for v in 0..V {
                let x = q[v][i];
                for j in 0..P {
                    acc[v][j] = x.mul_add(k[j], acc[v][j]);
                }
            }
        }
        for v in 0..V {
            p[v * TILE + j0..v * TILE + j0 + P].copy_from_slice(&acc[v]);
        }
    }
}

/// Every query vector's running softmax state: max, sum, and `dv` accumulators.
struct State<'a> {
    m: &'a mut [f32],
    s: &'a mut [f32],
    acc: &'a mut [f32],
    dv: usize,
}

/// One tile's online-softmax step and values for `V` query vectors `b` whose span covers the
/// same positions `r` of the tile: `p` holds their unscaled scores (`TILE` each), replaced by
/// their probabilities.
#[inline(always)]
fn run_block<const V: usize, const H: usize>(
    b: &[usize],
    p: &mut [f32],
    r: Range<usize>,
    scale: f32,
    st: State<'_>,
    vt: &[f32],
) {
    let dv = st.dv;
    let mut sum = [0.0f32; V];
    for v in 0..V {
        let i = b[v];
        let pv = &mut p[v * TILE..(v + 1) * TILE][r.clone()];
        for x in pv.iter_mut() {
            *x *= scale;
        }
        let m2 = st.m[i].max(max_of(pv));
        let c = v_expf_lane(st.m[i] - m2);
        sum[v] = st.s[i] * c;
        for x in pv.iter_mut() {
            *x = v_expf_lane(*x - m2);
        }
        st.m[i] = m2;
        for a in st.acc[i * dv..(i + 1) * dv].iter_mut() {
            *a *= c;
        }
    }
    // `sum = sum·c + p_0 + p_1 + …` in position order, the vectors' chains side by side.
    for j in r.clone() {
        for v in 0..V {
            sum[v] += p[v * TILE + j];
        }
    }
    for v in 0..V {
        st.s[b[v]] = sum[v];
    }
    accumulate_block::<V, H>(b, p, r, vt, st.acc, dv);
}

/// The largest of `xs` (`-inf` if empty), 16 lanes at a time. Any order gives the same
/// maximum, up to the sign of a zero, which no result depends on (`x - m` and `exp(m - m')`
/// are the same for either zero).
#[inline(always)]
fn max_of(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = xs.chunks_exact(16);
    for c in &mut chunks {
        for k in 0..16 {
            lanes[k] = if c[k] > lanes[k] { c[k] } else { lanes[k] };
        }
    }
    for &x in chunks.remainder() {
        lanes[0] = if x > lanes[0] { x } else { lanes[0] };
    }
    lanes
        .iter()
        .fold(f32::NEG_INFINITY, |a, &x| if x > a { x } else { a })
}

/// `acc[i] = fma(v_j[i], p_j, acc[i])` over the tile's positions `r` in order, for the `V` query
/// vectors `b` (probabilities `p`, `TILE` each), `H` value dimensions at a time.
#[inline(always)]
fn accumulate_block<const V: usize, const H: usize>(
    b: &[usize],
    p: &[f32],
    r: Range<usize>,
    vt: &[f32],
    acc: &mut [f32],
    dv: usize,
) {
    // The probabilities position-major (`V` per position), and the positions' value rows: one
    // slice each, so the loops below index nothing they must check.
    let mut pt = [[0.0f32; V]; TILE];
    for (j, pj) in pt[r.clone()].iter_mut().enumerate() {
        for v in 0..V {
            pj[v] = p[v * TILE + r.start + j];
        }
    }
    let (pt, rows) = (&pt[r.clone()], &vt[r.start * dv..r.end * dv]);
    let mut c0 = 0;
    while c0 + H <= dv {
        accumulate::<V, H>(b, pt, rows, acc, dv, c0);
        c0 += H;
    }
    while c0 < dv {
        accumulate::<V, 1>(b, pt, rows, acc, dv, c0);
        c0 += 1;
    }
}

#[inline(always)]
fn accumulate<const V: usize, const H: usize>(
    b: &[usize],
    pt: &[[f32; V]],
    rows: &[f32],
    acc: &mut [f32],
    dv: usize,
    c0: usize,
) {
    let mut a = [[0.0f32; H]; V];
    for v in 0..V {
        let at = b[v] * dv + c0;
        a[v].copy_from_slice(&acc[at..at + H]);
    }
    for (pj, row) in pt.iter().zip(rows.chunks_exact(dv)) {
        // One load of the row's `H` values for all `V` vectors.
        let x: [f32; H] = row[c0..c0 + H].try_into().expect("H values");
        for v in 0..V {
            for i in 0..H {
                a[v][i] = x[i].mul_add(pj[v], a[v][i]);
            }
        }
    }
    for v in 0..V {
        let at = b[v] * dv + c0;
        acc[at..at + H].copy_from_slice(&a[v]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvCache, KvType};

    struct Rng(u64);
    impl Rng {
        fn f(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        }
    }

    fn cache(t: KvType, shape: KvShape, n: usize, rng: &mut Rng) -> KvCache {
        let mut c = KvCache::with_shape(shape, 0..1, n + 7, t).unwrap();
        let k: Vec<f32> = (0..n * shape.k_width()).map(|_| rng.f()).collect();
        let v: Vec<f32> = (0..n * shape.v_width()).map(|_| rng.f()).collect();
        // In two steps, as a prefill then more.
        let split = n / 3;
        c.append(
            0,
            0,
            &k[..split * shape.k_width()],
            &v[..split * shape.v_width()],
        );
        c.append(
            0,
            split,
            &k[split * shape.k_width()..],
            &v[split * shape.v_width()..],
        );
        c
    }

    /// Naive softmax attention in f64, from the cache's own (rounded) keys and values.
    fn naive(
        kv: HeadKv<'_>,
        q: &[f32],
        span: Range<usize>,
        sink: Option<f32>,
        scale: f32,
    ) -> Vec<f64> {
        let (dk, dv) = (kv.shape.k_head_dim, kv.shape.v_head_dim);
        let mut kt = vec![0.0; dk * TILE];
        let mut vt = vec![0.0; TILE * dv];
        let mut row = vec![0.0; dk.max(dv)];
        let mut scores = Vec::new();
        let mut values = Vec::new();
        for p in span.clone() {
            let t0 = p / TILE * TILE;
            load_tile::<SCALAR>(kv, t0, (kv.len - t0).min(TILE), &mut kt, &mut vt, &mut row);
            let j = p - t0;
            let s: f64 = (0..dk).map(|i| q[i] as f64 * kt[i * TILE + j] as f64).sum();
            scores.push(s * scale as f64);
            values.push(vt[j * dv..(j + 1) * dv].to_vec());
        }
        let m = scores
            .iter()
            .copied()
            .chain(sink.map(f64::from))
            .fold(f64::NEG_INFINITY, f64::max);
        let mut z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
        z += sink.map_or(0.0, |x| (x as f64 - m).exp());
        let mut out = vec![0.0; dv];
        for (s, v) in scores.iter().zip(&values) {
            for (o, &x) in out.iter_mut().zip(v) {
                *o += (s - m).exp() / z * x as f64;
            }
        }
        out
    }

    fn isas() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }

    #[test]
    fn fused_attention_is_close_to_naive_and_equal_on_every_isa() {
        let mut rng = Rng(42);
        for t in [KvType::F16, KvType::Q8_0] {
            for shape in [
                KvShape {
                    n_head_kv: 2,
                    k_head_dim: 64,
                    v_head_dim: 64,
                    shared_v: false,
                },
                KvShape {
                    n_head_kv: 1,
                    k_head_dim: 96,
                    v_head_dim: 32,
                    shared_v: false,
                },
                KvShape {
                    n_head_kv: 3,
                    k_head_dim: 128,
                    v_head_dim: 128,
                    shared_v: false,
                },
            ] {
                for n in [1, 5, 64, 65, 200] {
                    let c = cache(t, shape, n, &mut rng);
                    let (view, len) = c.view(0);
                    let kv = HeadKv {
                        view,
                        shape,
                        head: shape.n_head_kv - 1,
                        len,
                    };
                    // Causal spans of a prompt block, a sliding window, and a lone decode row.
                    let spans: Vec<Range<usize>> = vec![
                        0..n,
                        0..n.div_ceil(2),
                        n.saturating_sub(70)..n,
                        (n - 1)..n,
                        0..1,
                    ];
                    let nq = spans.len();
                    let q: Vec<f32> = (0..nq * shape.k_head_dim).map(|_| rng.f()).collect();
                    let sinks: Vec<f32> = (0..nq).map(|_| rng.f()).collect();
                    let scale = 1.0 / (shape.k_head_dim as f32).sqrt();
                    for with_sinks in [false, true] {
                        let sk = with_sinks.then_some(&sinks[..]);
                        let mut outs = Vec::new();
                        for &isa in &isas() {
                            let mut out = vec![0.0; nq * shape.v_head_dim];
                            let mut sc = FusedScratch::default();
                            attend_fused_on(isa, &mut out, &q, &spans, sk, kv, scale, &mut sc);
                            outs.push((isa, out));
                        }
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        for (isa, o) in &outs[1..] {
                            assert_eq!(
                                bits(o),
                                bits(&outs[0].1),
                                "{isa:?} vs scalar: {t} {shape:?} n={n}"
                            );
                        }
                        let out = &outs[0].1;
                        let dv = shape.v_head_dim;
                        for (i, span) in spans.iter().enumerate() {
                            let want = naive(
                                kv,
                                &q[i * shape.k_head_dim..(i + 1) * shape.k_head_dim],
                                span.clone(),
                                sk.map(|s| s[i]),
                                scale,
                            );
                            for (d, (&g, &w)) in
                                out[i * dv..(i + 1) * dv].iter().zip(&want).enumerate()
                            {
                                assert!(
                                    (g as f64 - w).abs() < 1e-5 * (1.0 + w.abs()),
                                    "{t} {shape:?} n={n} span {span:?} dim {d}: {g} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_query_vector_gives_the_same_bits_alone_and_in_a_block() {
        // Batch invariance: a decode row alone equals the same row inside a prompt block whose
        // other rows reach further (more tiles loaded, longer spans).
        let mut rng = Rng(7);
        let shape = KvShape {
            n_head_kv: 2,
            k_head_dim: 64,
            v_head_dim: 64,
            shared_v: false,
        };
        for t in [KvType::F16, KvType::Q8_0] {
            let c = cache(t, shape, 190, &mut rng);
            let (view, len) = c.view(0);
            let kv = HeadKv {
                view,
                shape,
                head: 0,
                len,
            };
            let spans: Vec<Range<usize>> = (100..110).map(|p| 0..p + 1).collect();
            let q: Vec<f32> = (0..spans.len() * 64).map(|_| rng.f()).collect();
            let mut block = vec![0.0; spans.len() * 64];
            let mut sc = FusedScratch::default();
            attend_fused(&mut block, &q, &spans, None, kv, 0.125, &mut sc);
            for (i, span) in spans.iter().enumerate() {
                let mut alone = vec![0.0; 64];
                attend_fused(
                    &mut alone,
                    &q[i * 64..(i + 1) * 64],
                    std::slice::from_ref(span),
                    None,
                    kv,
                    0.125,
                    &mut sc,
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&alone),
                    bits(&block[i * 64..(i + 1) * 64]),
                    "{t} row {i}"
                );
            }
        }
    }

    #[test]
    fn shared_values_read_from_the_keys_equal_values_stored_apart() {
        // MLA's cache: one head whose value is the first 64 floats of its 96-float key. The
        // same keys with those floats also stored as values give the same bits (Q8_0 blocks of
        // the values are the keys' first blocks either way).
        let mut rng = Rng(11);
        let (dk, dv, n) = (96, 64, 150);
        let shared = KvShape {
            n_head_kv: 1,
            k_head_dim: dk,
            v_head_dim: dv,
            shared_v: true,
        };
        let apart = KvShape {
            shared_v: false,
            ..shared
        };
        assert_eq!(shared.v_width(), 0);
        let k: Vec<f32> = (0..n * dk).map(|_| rng.f()).collect();
        let v: Vec<f32> = k.chunks_exact(dk).flat_map(|r| &r[..dv]).copied().collect();
        let spans: Vec<Range<usize>> = vec![0..n, 0..1, 70..n, 0..65];
        let q: Vec<f32> = (0..spans.len() * dk).map(|_| rng.f()).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for t in [KvType::F16, KvType::Q8_0] {
            let outs: Vec<Vec<f32>> = [(shared, &[][..]), (apart, &v[..])]
                .into_iter()
                .map(|(shape, v)| {
                    let mut c = KvCache::with_shape(shape, 0..1, n, t).unwrap();
                    c.append(0, 0, &k, v);
                    let (view, len) = c.view(0);
                    let kv = HeadKv {
                        view,
                        shape,
                        head: 0,
                        len,
                    };
                    let mut out = vec![0.0; spans.len() * dv];
                    let mut sc = FusedScratch::default();
                    attend_fused(&mut out, &q, &spans, None, kv, 0.1, &mut sc);
                    out
                })
                .collect();
            assert_eq!(bits(&outs[0]), bits(&outs[1]), "{t}");
        }
    }
}
