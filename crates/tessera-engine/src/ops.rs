//! The small non-matmul operations of a transformer, written to follow ggml's CPU numerics
//! (`ggml-cpu/ops.cpp`): where ggml accumulates in double, so do we; where it rounds to f32, so
//! do we. Matmuls live in [`crate::kernels`].

use tessera_model::RopeScaling;

/// RMS norm of one row, in place, then multiplied element-wise by `weight` (ggml's `rms_norm`
/// followed by `mul`): the sum of squares is accumulated in f64, the scale is an f32.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    debug_assert_eq!(x.len(), weight.len());
    scale_row(x, sum_of_squares(x), Some(weight), eps);
}

/// [`rms_norm`] without a weight (ggml's `rms_norm` alone: Llama 4's query and key norm).
pub fn rms_norm_unweighted(x: &mut [f32], eps: f32) {
    scale_row(x, sum_of_squares(x), None, eps);
}

/// `Σ x²` accumulated in f64 in order (ggml's `ggml_float` sum).
#[inline(always)]
fn sum_of_squares(x: &[f32]) -> f64 {
    let mut sum = 0.0f64;
    for &v in x.iter() {
        sum += (v * v) as f64;
    }
    sum
}

/// [`rms_norm`] (or [`rms_norm_unweighted`] without `weight`) of every `width`-float row of
/// `rows`, in place, with the same bits row by row. Each row's sum of squares is a chain of f64
/// additions in order (ggml's numerics), so one row at a time waits on every addition's latency;
/// here [`NORM_ROWS`] rows' chains advance side by side.
pub fn rms_norm_rows(rows: &mut [f32], width: usize, weight: Option<&[f32]>, eps: f32) {
    assert!(width > 0 && rows.len().is_multiple_of(width));
    if let Some(w) = weight {
        assert_eq!(w.len(), width);
    }
    let mut blocks = rows.chunks_exact_mut(NORM_ROWS * width);
    for block in &mut blocks {
        let mut sum = [0.0f64; NORM_ROWS];
        for i in 0..width {
            for (r, s) in sum.iter_mut().enumerate() {
                let v = block[r * width + i];
                *s += (v * v) as f64;
            }
        }
        for (row, s) in block.chunks_exact_mut(width).zip(sum) {
            scale_row(row, s, weight, eps);
        }
    }
    for row in blocks.into_remainder().chunks_exact_mut(width) {
        scale_row(row, sum_of_squares(row), weight, eps);
    }
}

/// Rows of [`rms_norm_rows`] whose sums advance together: enough to cover an f64 addition's
/// latency several times over.
const NORM_ROWS: usize = 8;

/// The second half of [`rms_norm`] given the row's sum of squares.
#[inline(always)]
fn scale_row(row: &mut [f32], sum: f64, weight: Option<&[f32]>, eps: f32) {
    let mean = (sum / row.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    match weight {
        Some(w) => {
            for (v, &w) in row.iter_mut().zip(w) {
                *v = (*v * scale) * w;
            }
        }
        None => {
            for v in row.iter_mut() {
                *v *= scale;
            }
        }
    }
}

/// [`rms_norm`] of `src` written to `dst`.
pub fn rms_norm_into(dst: &mut [f32], src: &[f32], weight: &[f32], eps: f32) {
    dst.copy_from_slice(src);
    rms_norm(dst, weight, eps);
}

/// Per-position rotation factors for RoPE: `cos[p][i]`, `sin[p][i]` for pair `i < rope_dim/2`.
///
/// As ggml's rope cache: `theta_scale = base^(-2/d)` in f32, `theta_i = pos * theta_scale^i`
/// built by repeated f32 multiplication, then `cosf`/`sinf`.
#[derive(Debug, Default, Clone)]
pub struct RopeTable {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// Fills the table for `positions` (one row each), reusing the buffers.
    pub fn fill(&mut self, positions: impl Iterator<Item = usize>, rope_dim: usize, base: f32) {
        self.fill_scaled(positions, rope_dim, base, RopeScaling::None, None);
    }

    /// [`RopeTable::fill`] with the angles scaled as ggml's `rope_yarn` does: linear scaling
    /// multiplies each angle by `freq_scale = 1/factor`; YaRN mixes that with the unscaled
    /// angle by a ramp over the dimensions between its correction bounds and multiplies cos and
    /// sin by `mscale` (llama.cpp's `attn_factor` times `1 + 0.1·ln factor`). With
    /// `freq_factors` (llama3-style scaling, `rope_dim / 2` of them) pair `i`'s unscaled angle
    /// is divided by factor `i` first, as ggml's rope cache does.
    pub fn fill_scaled(
        &mut self,
        positions: impl Iterator<Item = usize>,
        rope_dim: usize,
        base: f32,
        scaling: RopeScaling,
        freq_factors: Option<&[f32]>,
    ) {
        self.half = rope_dim / 2;
        self.cos.clear();
        self.sin.clear();
        let theta_scale = base.powf(-2.0 / rope_dim as f32);
        let (freq_scale, yarn) = match scaling {
            RopeScaling::None => (1.0, None),
            RopeScaling::Linear { factor } => (1.0 / factor, None),
            RopeScaling::Yarn {
                factor,
                orig_ctx,
                beta_fast,
                beta_slow,
                attn_factor,
                log_mul,
            } => {
                let freq_scale = 1.0f32 / factor;
                // ggml_rope_yarn_corr_dims.
                let corr = |beta: f32| {
                    rope_dim as f32 * (orig_ctx as f32 / (beta * 2.0 * std::f32::consts::PI)).ln()
                        / (2.0 * base.ln())
                };
                let low = corr(beta_fast).floor().max(0.0);
                let high = corr(beta_slow).ceil().min(rope_dim as f32 - 1.0);
                // llama.cpp's context set-up: get_mscale(factor) cancelled by its inverse,
                // times the file's attn_factor; ggml then applies 1 + 0.1·ln(1/freq_scale).
                // With DeepSeek's log multiplier the context's factor is 1 instead of
                // get_mscale(factor) (llama.cpp's mscale / mscale_all_dim ratio), so the
                // rotation keeps magnitude attn_factor; the attention scale carries the rest.
                let m = if log_mul != 0.0 {
                    1.0
                } else {
                    0.1f32 * factor.ln() + 1.0
                };
                let attn = m * (1.0 / (1.0 + 0.1 * factor.ln())) * attn_factor;
                let mscale = attn * (1.0 + 0.1 * (1.0 / freq_scale).ln());
                (freq_scale, Some((low, high, mscale)))
            }
        };
        for p in positions {
            let mut theta_extrap = p as f32;
            for i in 0..self.half {
                let theta_extrap_i = freq_factors.map_or(theta_extrap, |f| theta_extrap / f[i]);
                let theta_interp = freq_scale * theta_extrap_i;
                let (theta, mscale) = match yarn {
                    None => (theta_interp, 1.0),
                    Some((low, high, mscale)) => {
                        let y = (i as f32 - low) / (high - low).max(0.001);
                        let mix = 1.0 - y.clamp(0.0, 1.0);
                        (theta_interp * (1.0 - mix) + theta_extrap_i * mix, mscale)
                    }
                };
                if yarn.is_some() {
                    self.cos.push(theta.cos() * mscale);
                    self.sin.push(theta.sin() * mscale);
                } else {
                    self.cos.push(theta.cos());
                    self.sin.push(theta.sin());
                }
                theta_extrap *= theta_scale;
            }
        }
    }

    /// Rotation factors of the `row`-th filled position.
    pub fn row(&self, row: usize) -> (&[f32], &[f32]) {
        let r = row * self.half..(row + 1) * self.half;
        (&self.cos[r.clone()], &self.sin[r])
    }
}

/// RoPE in GGML's normal order: rotates adjacent pairs `(2i, 2i+1)` of the first `2*cos.len()`
/// dimensions of one head.
pub fn rope_normal(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    with_fma(|| {
        for i in 0..cos.len() {
            let (x0, x1) = rotate(head[2 * i], head[2 * i + 1], cos[i], sin[i]);
            head[2 * i] = x0;
            head[2 * i + 1] = x1;
        }
    })
}

/// RoPE in NeoX order: rotates pairs `(i, i + d/2)` where `d = 2*cos.len()` is the rotated width.
pub fn rope_neox(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    with_fma(|| {
        for i in 0..half {
            let (x0, x1) = rotate(head[i], head[i + half], cos[i], sin[i]);
            head[i] = x0;
            head[i + half] = x1;
        }
    })
}

/// One RoPE rotation, rounded as llama.cpp's x86 build computes it: GCC contracts ggml's
/// `x0*cos - x1*sin` and `x0*sin + x1*cos` into one fused multiply-add each (the second product
/// rounded first). Plain multiplies differ in the last bit for ~1 in 9 elements, and such a bit
/// can tip a later 8-bit activation rounding and become visible (found by comparing tensor
/// dumps of llama.cpp against this engine on `small-qwen3moe-Q8_0`).
#[inline(always)]
fn rotate(x0: f32, x1: f32, cos: f32, sin: f32) -> (f32, f32) {
    (x0.mul_add(cos, -(x1 * sin)), x0.mul_add(sin, x1 * cos))
}

/// The logistic sigmoid `1 / (1 + e^-x)` with the C library's `expf` (ggml's
/// `ggml_vec_sigmoid_f32`).
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU, `x / (1 + e^-x)` with the C library's `expf` (ggml's scalar `ggml_silu_f32`).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// ggml's vector `expf` (its AVX-512 `ggml_v_expf`: a range reduction plus a degree-5
/// polynomial, accurate to ~1.5 ulp), emulated one lane at a time with fused multiply-adds so
/// that softmax and SwiGLU round as llama.cpp does on the reference machines.
#[inline(always)]
pub(crate) fn v_expf_lane(x: f32) -> f32 {
    let r = f32::from_bits(0x4B40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3FB8_AA3B), r); // 0x1.715476p+0 (log2 e)
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35BF_BE8E),                  // 0x1.7f7d1cp-20
        (-n).mul_add(f32::from_bits(0x3F31_7200), x), // 0x1.62e4p-1
    );
    let u = b * b;
    let p1 = f32::from_bits(0x3C07_2010).mul_add(b, f32::from_bits(0x3D2B_9F17));
    let p2 = f32::from_bits(0x3E2A_AF33).mul_add(b, f32::from_bits(0x3EFF_FEDB));
    let p3 = f32::from_bits(0x3F7F_FFF6).mul_add(b, 1.0);
    let j = p1.mul_add(u, p2).mul_add(u, p3);
    // scalef: j * 2^n, rounded once. `j` is within [0.5, 2], so `j * 2^a` with |a| <= 96 is
    // exact (normal, no rounding) and the second factor `2^b` rounds the product once: the
    // same bits as a product in f64, in 32-bit lanes (no conversions to f64 and back).
    // Branch-free (n is clamped, the out-of-range result selected after), so loops over lanes
    // vectorize; the clamped integer is read from the mantissa of `nc + 0x1.8p23` because a
    // saturating `as i32` compiles to a scalar conversion per lane.
    let nc = (n.clamp(-192.0, 192.0) + r).to_bits() as i32 - r.to_bits() as i32;
    let a = nc >> 1;
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    let scaled = j * pow2(a) * pow2(nc - a);
    let saturated = if n > 0.0 { f32::INFINITY } else { 0.0 };
    if n.abs() > 192.0 {
        saturated
    } else {
        scaled
    }
}

/// Runs `f` with FMA instructions enabled when the process runs AVX2 or better (`mul_add` is
/// otherwise a slow library call); the results are identical either way (`mul_add` is fused
/// in both), and a process capped to scalar kernels runs the library call like a CPU without
/// FMA would.
#[inline(always)]
fn with_fma<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "fma")]
        unsafe fn fma_on<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if crate::kernels::isa() >= crate::kernels::Isa::Avx2 {
            // SAFETY: `isa()` only returns instruction sets this CPU has; AVX2 includes FMA.
            return unsafe { fma_on(f) };
        }
    }
    f()
}

/// ggml's 16-lane horizontal float sum (`_mm512_reduce_add_ps`: halves folded 8, 4, 2, 1).
#[inline(always)]
fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t = [0.0f32; 8];
    for i in 0..8 {
        t[i] = v[i] + v[i + 8];
    }
    let t4 = [t[0] + t[4], t[1] + t[5], t[2] + t[6], t[3] + t[7]];
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// SwiGLU of rows of `width` in place: `gate[i] = silu(gate[i]) * up[i]`, row by row as ggml's
/// `ggml_vec_swiglu_f32`: blocks of 16 use the vector `expf`, a row's tail the C library's.
pub fn swiglu_rows(gate: &mut [f32], up: &[f32], width: usize) {
    for (g, u) in gate.chunks_mut(width).zip(up.chunks(width)) {
        swiglu(g, u);
    }
}

/// SwiGLU of one row in place (see [`swiglu_rows`]).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    with_fma(|| {
        let n16 = gate.len() / 16 * 16;
        for (g, &u) in gate[..n16].iter_mut().zip(&up[..n16]) {
            let x = *g;
            *g = (x / (1.0 + v_expf_lane(-x))) * u;
        }
        for (g, &u) in gate[n16..].iter_mut().zip(&up[n16..]) {
            *g = silu(*g) * u;
        }
    })
}

/// gpt-oss's clamped SwiGLU in place, as ggml's `swiglu_oai`: with `x = min(gate, limit)` and
/// `y = clamp(up, −limit, limit)`, `gate = x / (1 + expf(alpha·(−x))) · (y + 1)` (the C
/// library's `expf`, element by element).
pub fn swiglu_oai_rows(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = g.min(limit);
        let y = u.clamp(-limit, limit);
        *g = x / (1.0 + (alpha * -x).exp()) * (y + 1.0);
    }
}

/// Softmax in place, as ggml's `soft_max` op: max subtracted; blocks of 16 use the vector
/// `expf` and are summed as 16-lane vectors into an f64 total, the tail uses the C library's
/// `expf`; the result is scaled by the f32 reciprocal of the total. `pad16` treats the row as
/// padded with masked entries to a multiple of 16 (llama.cpp's KV cache is padded), so every
/// element takes the vector path.
pub fn softmax_ggml(x: &mut [f32], pad16: bool) {
    softmax_ggml_sink(x, pad16, None)
}

/// [`softmax_ggml`] with an optional sink logit (gpt-oss): a term of the normalisation
/// without an output, as ggml's `soft_max` with sinks (the maximum includes the sink, whose
/// `expf` is added to the f64 total after the row's).
pub fn softmax_ggml_sink(x: &mut [f32], pad16: bool, sink: Option<f32>) {
    let mut max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if let Some(s) = sink {
        max = max.max(s);
    }
    let mut sum = with_fma(|| {
        let mut sum = 0.0f64;
        let n = x.len();
        let nv = if pad16 { n } else { n / 16 * 16 };
        for chunk in x[..nv].chunks_mut(16) {
            let mut lanes = [0.0f32; 16];
            for (l, v) in lanes.iter_mut().zip(chunk.iter_mut()) {
                *v = v_expf_lane(*v - max);
                *l = *v;
            }
            sum += reduce16(&lanes) as f64;
        }
        for v in &mut x[nv..] {
            *v = (*v - max).exp();
            sum += *v as f64;
        }
        sum
    });
    if let Some(s) = sink {
        sum += (s - max).exp() as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Softmax in place (ggml numerics, unpadded row).
pub fn softmax(x: &mut [f32]) {
    softmax_ggml(x, false);
}

/// Dot product with 16 independent f32 lanes (vectorises without fast-math).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    const L: usize = 16;
    let mut acc = [0.0f32; L];
    let chunks = a.len() / L;
    for c in 0..chunks {
        let (x, y) = (&a[c * L..c * L + L], &b[c * L..c * L + L]);
        for j in 0..L {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0.0f32;
    for i in chunks * L..a.len() {
        tail += a[i] * b[i];
    }
    let mut s = 0.0f32;
    for v in acc {
        s += v;
    }
    s + tail
}

/// `y += a * x`.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `y += x`.
#[inline]
pub fn add_assign(y: &mut [f32], x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += x;
    }
}

/// ggml's F32 dot product (`ggml_vec_dot_f32`, AVX-512 build): four 16-lane FMA accumulators
/// over blocks of 64, folded (0+2, 1+3, 0+1) and reduced across lanes; the tail is added
/// sequentially.
#[inline(always)]
fn dot_ggml(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len();
    let np = n & !63;
    let mut acc = [[0.0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            let (xs, ys) = (
                &x[i + j * 16..i + j * 16 + 16],
                &y[i + j * 16..i + j * 16 + 16],
            );
            for l in 0..16 {
                a[l] = xs[l].mul_add(ys[l], a[l]);
            }
        }
    }
    let mut s = [0.0f32; 16];
    for l in 0..16 {
        s[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut sum = reduce16(&s);
    for i in np..n {
        sum += x[i] * y[i];
    }
    sum
}

/// One KV head's keys or values in a position-major cache: position `j`'s `width` floats start
/// at `data[j * stride + offset]`.
#[derive(Clone, Copy, Debug)]
pub struct HeadRows<'a> {
    pub data: &'a [f32],
    pub stride: usize,
    pub offset: usize,
    pub width: usize,
}

/// Causal attention of the query heads that share one KV head, over cached positions
/// `0..n_kv` (each key and value row is read once for the whole group).
///
/// `q` holds the group's heads back to back (`keys.width` each); `out` holds their outputs
/// (`values.width` each; keys and values may differ in width, as MLA's do). Per head this follows llama.cpp without flash attention: scores
/// `dot(q, k) * scale`, a softmax over the (16-padded) row (positions before `first` masked, as
/// a sliding window's are, and `sinks[h]` as head `h`'s sink logit), then each output dimension as
/// `ggml_vec_dot_f32` of the scores and the transposed values over the padded KV length (what a
/// single-token decode step runs; see `KV_PAD`).
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    out: &mut [f32],
    q: &[f32],
    keys: HeadRows<'_>,
    values: HeadRows<'_>,
    n_kv: usize,
    scale: f32,
    first: usize,
    sinks: Option<&[f32]>,
    scratch: &mut AttnScratch,
) {
    let d = keys.width;
    let g = q.len() / d;
    scratch.scores.resize(g * n_kv, 0.0);
    let (scores, lanes) = (&mut scratch.scores, &mut scratch.lanes);
    for h in 0..g {
        scores[h * n_kv..h * n_kv + first.min(n_kv)].fill(f32::NEG_INFINITY);
    }
    with_fma(|| {
        for j in first..n_kv {
            let at = j * keys.stride + keys.offset;
            let k = &keys.data[at..at + d];
            for h in 0..g {
                scores[h * n_kv + j] = dot_ggml(&q[h * d..(h + 1) * d], k) * scale;
            }
        }
    });
    for h in 0..g {
        let sink = sinks.map(|s| s[h]);
        softmax_ggml_sink(&mut scores[h * n_kv..(h + 1) * n_kv], true, sink);
    }
    // For a single token llama.cpp computes `kq · V` with `ggml_vec_dot_f32` (llamafile's
    // tinyBLAS refuses one-column products) over the padded KV length, a multiple of 64
    // (`KV_PAD`): position `j` in lane `j % 16` of accumulator `(j % 64) / 16`, the four combined
    // `(a0 + a2) + (a1 + a3)`, then [`reduce16`]. Masked cells add exact zeros.
    const _: () = assert!(KV_PAD.is_multiple_of(64));
    let v = ValueRows {
        data: values.data,
        stride: values.stride,
        offset: values.offset,
    };
    let d = values.width;
    if d.is_multiple_of(64) {
        attend_values::<64>(out, scores, n_kv, g, d, v);
    } else if d.is_multiple_of(16) {
        attend_values::<16>(out, scores, n_kv, g, d, v);
    } else {
        attend_values_lanes(out, scores, n_kv, g, d, v, lanes);
    }
}

/// One KV head's cached values: position `j`'s values start at `data[j * stride + offset]`.
#[derive(Clone, Copy)]
struct ValueRows<'a> {
    data: &'a [f32],
    stride: usize,
    offset: usize,
}

impl ValueRows<'_> {
    /// Values `from..from + len` of position `j`.
    fn get(&self, j: usize, from: usize, len: usize) -> &[f32] {
        let at = j * self.stride + self.offset + from;
        &self.data[at..at + len]
    }
}

/// The `kq · V` part of [`attend_group`] for any head size: every lane of every output kept in
/// `lanes` (g × 64 × d floats).
fn attend_values_lanes(
    out: &mut [f32],
    scores: &[f32],
    n_kv: usize,
    g: usize,
    d: usize,
    values: ValueRows<'_>,
    lanes: &mut Vec<f32>,
) {
    lanes.resize(g * 64 * d, 0.0);
    lanes.fill(0.0);
    with_fma(|| {
        for j in 0..n_kv {
            let v = values.get(j, 0, d);
            for h in 0..g {
                let p = scores[h * n_kv + j];
                let l = (h * 64 + j % 64) * d;
                for (a, &x) in lanes[l..l + d].iter_mut().zip(v) {
                    *a = x.mul_add(p, *a);
                }
            }
        }
    });
    for h in 0..g {
        for i in 0..d {
            let at = |l: usize| lanes[(h * 64 + l) * d + i];
            let v: [f32; 16] =
                std::array::from_fn(|l| (at(l) + at(l + 32)) + (at(l + 16) + at(l + 48)));
            out[h * d + i] = reduce16(&v);
        }
    }
}

/// The `kq · V` part of [`attend_group`] (same lanes, same order of operations) for a head size
/// that is a multiple of `H`: for each head and each `H` dimensions, lane `l`'s accumulators
/// (positions `l, l + 64, …`) are summed in registers, then the 64 lanes are combined as
/// ggml does, `H` outputs at a time.
fn attend_values<const H: usize>(
    out: &mut [f32],
    scores: &[f32],
    n_kv: usize,
    g: usize,
    d: usize,
    values: ValueRows<'_>,
) {
    let mut lane = [[0.0f32; H]; 64];
    with_fma(|| {
        for h in 0..g {
            let sc = &scores[h * n_kv..(h + 1) * n_kv];
            for c0 in (0..d).step_by(H) {
                for (l, lane) in lane.iter_mut().enumerate() {
                    let mut acc = [0.0f32; H];
                    for j in (l..n_kv).step_by(64) {
                        let v: &[f32; H] = values.get(j, c0, H).try_into().expect("H values");
                        let p = sc[j];
                        for i in 0..H {
                            acc[i] = v[i].mul_add(p, acc[i]);
                        }
                    }
                    *lane = acc;
                }
                // (lane l + lane l+32) + (lane l+16 + lane l+48) for l < 16, then ggml's
                // 16-lane reduction ([`reduce16`]): element-wise over the H outputs.
                let add = |a: &[f32; H], b: &[f32; H]| -> [f32; H] {
                    std::array::from_fn(|i| a[i] + b[i])
                };
                let s: [[f32; H]; 16] = std::array::from_fn(|l| {
                    add(
                        &add(&lane[l], &lane[l + 32]),
                        &add(&lane[l + 16], &lane[l + 48]),
                    )
                });
                let t: [[f32; H]; 8] = std::array::from_fn(|i| add(&s[i], &s[i + 8]));
                let t4: [[f32; H]; 4] = std::array::from_fn(|i| add(&t[i], &t[i + 4]));
                let r = add(&add(&t4[0], &t4[2]), &add(&t4[1], &t4[3]));
                out[h * d + c0..h * d + c0 + H].copy_from_slice(&r);
            }
        }
    });
}

/// The multiple of cells llama.cpp's KV view is padded to (`llama_kv_cache::get_n_kv`: 256 in
/// the reference build; modelling the older padding of 32, where short rows fall into
/// `ggml_vec_dot_f32`'s scalar remainder, matches the references worse).
const KV_PAD: usize = 256;

/// Reusable buffers for [`attend_group`].
#[derive(Debug, Default)]
pub struct AttnScratch {
    scores: Vec<f32>,
    lanes: Vec<f32>,
}

/// Log-softmax of one row of logits, in f64 (for reports and comparisons).
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&l| l as f64 - lse).collect()
}

pub use tessera_sampling::argmax;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocked_values_equal_the_lanes_path_bit_for_bit() {
        // attend_values keeps lanes in registers; attend_values_lanes is the direct transcription
        // of ggml's order. Both must give the same bits for every shape, short and long contexts.
        let mut seed = 7u32;
        let mut rnd = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        for (d, g) in [(128, 4), (64, 1), (32, 8), (256, 2)] {
            for n_kv in [1, 17, 63, 64, 65, 130, 300] {
                let (heads, off) = (3, d);
                let stride = heads * d;
                let values: Vec<f32> = (0..n_kv * stride).map(|_| rnd()).collect();
                let mut scores: Vec<f32> = (0..g * n_kv).map(|_| rnd().abs()).collect();
                for h in 0..g {
                    softmax_ggml(&mut scores[h * n_kv..(h + 1) * n_kv], true);
                }
                let v = ValueRows {
                    data: &values,
                    stride,
                    offset: off,
                };
                let mut want = vec![0.0; g * d];
                let mut lanes = Vec::new();
                attend_values_lanes(&mut want, &scores, n_kv, g, d, v, &mut lanes);
                let mut got64 = vec![0.0; g * d];
                let mut got16 = vec![0.0; g * d];
                if d % 64 == 0 {
                    attend_values::<64>(&mut got64, &scores, n_kv, g, d, v);
                } else {
                    got64.clone_from(&want);
                }
                attend_values::<16>(&mut got16, &scores, n_kv, g, d, v);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got64), bits(&want), "H=64 d={d} g={g} n_kv={n_kv}");
                assert_eq!(bits(&got16), bits(&want), "H=16 d={d} g={g} n_kv={n_kv}");
            }
        }
    }

    #[test]
    fn rms_norm_unit_weight_gives_unit_rms() {
        let mut x = vec![1.0, -2.0, 3.0, -4.0];
        rms_norm(&mut x, &[1.0; 4], 0.0);
        let rms: f32 = (x.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_at_position_zero_is_identity() {
        let mut t = RopeTable::default();
        t.fill([0usize].into_iter(), 8, 10000.0);
        let mut h: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let orig = h.clone();
        let (c, s) = t.row(0);
        rope_neox(&mut h, c, s);
        assert_eq!(h, orig);
        rope_normal(&mut h, c, s);
        assert_eq!(h, orig);
    }

    #[test]
    fn rope_preserves_pair_norms() {
        let mut t = RopeTable::default();
        t.fill([5usize].into_iter(), 4, 10000.0);
        let (c, s) = t.row(0);
        let mut h = vec![1.0, 2.0, 3.0, 4.0];
        rope_normal(&mut h, c, s);
        assert!(((h[0] * h[0] + h[1] * h[1]) - 5.0).abs() < 1e-5);
        assert!(((h[2] * h[2] + h[3] * h[3]) - 25.0).abs() < 1e-4);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -1.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0]);
    }

    #[test]
    fn branch_free_vector_expf_equals_the_branching_one() {
        // The form with an early return for |n| > 192 (before the kernel loops vectorized).
        fn branching(x: f32) -> f32 {
            let r = f32::from_bits(0x4B40_0000);
            let z = x.mul_add(f32::from_bits(0x3FB8_AA3B), r);
            let n = z - r;
            let b = (-n).mul_add(
                f32::from_bits(0x35BF_BE8E),
                (-n).mul_add(f32::from_bits(0x3F31_7200), x),
            );
            if n.abs() > 192.0 {
                return if n > 0.0 { f32::INFINITY } else { 0.0 };
            }
            let u = b * b;
            let p1 = f32::from_bits(0x3C07_2010).mul_add(b, f32::from_bits(0x3D2B_9F17));
            let p2 = f32::from_bits(0x3E2A_AF33).mul_add(b, f32::from_bits(0x3EFF_FEDB));
            let p3 = f32::from_bits(0x3F7F_FFF6).mul_add(b, 1.0);
            let j = p1.mul_add(u, p2).mul_add(u, p3);
            let scale = f64::from_bits(((n as i64 + 1023) as u64) << 52);
            (j as f64 * scale) as f32
        }
        let mut xs: Vec<f32> = (-2_000_000..2_000_000).map(|i| i as f32 * 1.0e-4).collect();
        xs.extend([
            -133.5,
            -133.0,
            133.0,
            134.0,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        for x in xs {
            let (a, b) = (with_fma(|| v_expf_lane(x)), with_fma(|| branching(x)));
            assert_eq!(a.to_bits(), b.to_bits(), "x = {x}");
        }
        assert!(v_expf_lane(f32::NAN).is_nan());
    }

    #[test]
    fn norms_of_many_rows_equal_one_row_at_a_time() {
        let width = 37;
        let x: Vec<f32> = (0..13 * width)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.013 - 6.0)
            .collect();
        let w: Vec<f32> = (0..width).map(|i| 0.5 + i as f32 * 0.03).collect();
        let (mut rows, mut bare) = (x.clone(), x.clone());
        rms_norm_rows(&mut rows, width, Some(&w), 1e-6);
        rms_norm_rows(&mut bare, width, None, 1e-6);
        for (i, row) in x.chunks_exact(width).enumerate() {
            let (mut one, mut one_bare) = (row.to_vec(), row.to_vec());
            rms_norm(&mut one, &w, 1e-6);
            rms_norm_unweighted(&mut one_bare, 1e-6);
            let at = i * width..(i + 1) * width;
            assert_eq!(rows[at.clone()], one[..], "row {i}");
            assert_eq!(bare[at], one_bare[..], "row {i}");
        }
    }

    #[test]
    fn vector_expf_is_close_to_expf() {
        for i in -2000..2000 {
            let x = i as f32 * 0.01;
            let (a, b) = (with_fma(|| v_expf_lane(x)), x.exp());
            assert!((a - b).abs() <= b * 4e-7, "{x}: {a} vs {b}");
        }
        assert_eq!(v_expf_lane(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 - i as f32 * 0.1).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-3);
    }
}
