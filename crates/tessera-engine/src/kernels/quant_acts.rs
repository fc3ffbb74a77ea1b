//! Activations converted to the type ggml pairs with each weight type (its `vec_dot_type`):
//! Q8_0 for Q4_0/Q8_0 weights (and Q4_1/Q5_1, which also read each block's Q8_1 sum `s`), Q8_K
//! for K-quants, F16/BF16-rounded floats for F16/BF16.

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use half::{bf16, f16};
use tessera_model::GgmlType;

use super::pool::ThreadPool;
use super::{written_vec, SharedMut};

/// Which activation encoding a weight type consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    Q8_0,
    Q8K,
    F16,
    BF16,
    F32,
}

impl ActKind {
    pub(crate) fn for_weights(dtype: GgmlType) -> Self {
        match dtype {
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Mxfp4
            | GgmlType::Iq4Nl => Self::Q8_0,
            GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::Iq4Xs
            | GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Iq2Xxs
            | GgmlType::Iq2Xs
            | GgmlType::Iq2S
            | GgmlType::Iq3Xxs
            | GgmlType::Iq3S => Self::Q8K,
            GgmlType::F16 => Self::F16,
            GgmlType::BF16 => Self::BF16,
            GgmlType::F32 => Self::F32,
        }
    }

    fn block(self) -> usize {
        match self {
            Self::Q8_0 => 32,
            Self::Q8K => 256,
            _ => 1,
        }
    }
}

/// Activations of `n_tokens` tokens quantized once for a weight type, reusable across several
/// matmuls with weights of a compatible type (e.g. all experts of an MoE layer).
#[derive(Clone, Debug)]
pub struct QuantizedActs {
    pub(crate) kind: ActKind,
    pub(crate) n_tokens: usize,
    pub(crate) cols: usize,
    /// Per-block scales (Q8_0: the f16-rounded d; Q8_K: d) or, for float kinds, the values.
    pub(crate) f: Vec<f32>,
    /// Quants, token-major (`cols` per token).
    pub(crate) qs: Vec<i8>,
    /// Q8_0: sum of the 32 quants of each block (folds the weights' zero point in exactly).
    pub(crate) sums: Vec<i32>,
    /// Q8_0: each block's `s` as ggml's `quantize_row_q8_1` stores it for Q4_1/Q5_1 weights,
    /// f16(d·Σq) with the *unrounded* d = amax/127. (From the f16-rounded d the product rounds
    /// to a neighbouring f16 in some blocks; the offset term `m·s` then moves a row's result by
    /// ~1e-4 of its size, enough to flip later 8-bit activation roundings: teacher-forced
    /// log-probs were 0.2 away from llama.cpp's.)
    pub(crate) q8_1_s: Vec<f32>,
    /// Q8_K: sums of each 16 quants, as ggml's `bsums`.
    pub(crate) bsums: Vec<i16>,
    /// Q8_0: 128 × the sum of each 4 quants (removes the +128 of unsigned weights per lane).
    pub(crate) corr4: Vec<i32>,
    /// Float kinds: `f` rearranged for the AVX2 float kernels' prefill tiles
    /// (`x86::float::lane_major`), built by the first kernel call that needs it.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) lane_major: OnceLock<Vec<f32>>,
}

impl QuantizedActs {
    /// Quantizes `x` (`n_tokens` rows of `cols` floats) for weights of type `weight_dtype`.
    ///
    /// # Panics
    /// If `x.len() != n_tokens * cols` or `cols` is not a multiple of the activation block size
    /// (32 for Q4_0/Q8_0 weights, 256 for K-quants).
    pub fn new(
        pool: &ThreadPool,
        weight_dtype: GgmlType,
        x: &[f32],
        n_tokens: usize,
        cols: usize,
    ) -> Self {
        let kind = ActKind::for_weights(weight_dtype);
        assert_eq!(x.len(), n_tokens * cols, "activation length mismatch");
        assert!(
            cols.is_multiple_of(kind.block()),
            "cols {cols} is not a multiple of {} for {weight_dtype} weights",
            kind.block()
        );
        let n = n_tokens * cols;
        let mut a = Self {
            kind,
            n_tokens,
            cols,
            f: Vec::new(),
            qs: Vec::new(),
            sums: Vec::new(),
            q8_1_s: Vec::new(),
            bsums: Vec::new(),
            corr4: Vec::new(),
            lane_major: OnceLock::new(),
        };
        match kind {
            ActKind::F32 => a.f = x.to_vec(),
            ActKind::F16 | ActKind::BF16 => {
                // Rounded through the weights' type, as ggml converts the activations.
                let fill = |f: &SharedMut<MaybeUninit<f32>>| {
                    par_tokens(pool, n_tokens, cols, |t| {
                        // SAFETY: each token writes only its own row.
                        let dst = unsafe { f.range(t * cols, cols) };
                        let src = dst.iter_mut().zip(&x[t * cols..(t + 1) * cols]);
                        if kind == ActKind::F16 {
                            src.for_each(|(d, &v)| _ = d.write(f16::from_f32(v).to_f32()));
                        } else {
                            src.for_each(|(d, &v)| _ = d.write(bf16::from_f32(v).to_f32()));
                        }
                    })
                };
                // SAFETY: the tokens' rows cover all `n` floats, each written once.
                a.f = unsafe { written_vec(n, fill) };
            }
            ActKind::Q8_0 => {
                a.f = vec![0.0; n / 32];
                a.qs = vec![0; n];
                a.sums = vec![0; n / 32];
                a.q8_1_s = vec![0.0; n / 32];
                let (f, qs, sums, q8_1_s) = (
                    SharedMut::new(&mut a.f),
                    SharedMut::new(&mut a.qs),
                    SharedMut::new(&mut a.sums),
                    SharedMut::new(&mut a.q8_1_s),
                );
                par_tokens(pool, n_tokens, cols, |t| {
                    let nb = cols / 32;
                    // SAFETY: each token writes only its own disjoint ranges.
                    let (d, q, s, s1) = unsafe {
                        (
                            f.range(t * nb, nb),
                            qs.range(t * cols, cols),
                            sums.range(t * nb, nb),
                            q8_1_s.range(t * nb, nb),
                        )
                    };
                    let xt = &x[t * cols..(t + 1) * cols];
                    quantize_q8_0(xt, d, q, s);
                    q8_1_block_sums(xt, s, s1);
                });
                a.corr4 =
                    a.qs.chunks_exact(4)
                        .map(|c| 128 * c.iter().map(|&v| v as i32).sum::<i32>())
                        .collect();
            }
            ActKind::Q8K => {
                a.f = vec![0.0; n / 256];
                a.qs = vec![0; n];
                a.bsums = vec![0; n / 16];
                let (f, qs, bs) = (
                    SharedMut::new(&mut a.f),
                    SharedMut::new(&mut a.qs),
                    SharedMut::new(&mut a.bsums),
                );
                par_tokens(pool, n_tokens, cols, |t| {
                    let nb = cols / 256;
                    // SAFETY: each token writes only its own disjoint ranges.
                    let (d, q, b) = unsafe {
                        (
                            f.range(t * nb, nb),
                            qs.range(t * cols, cols),
                            bs.range(t * cols / 16, cols / 16),
                        )
                    };
                    quantize_q8_k(&x[t * cols..(t + 1) * cols], d, q, b);
                });
            }
        }
        // The x86 float kernels' prefill layout (AVX-512 prefill runs the AVX2 tiles too),
        // built on the pool now rather than by the first kernel call on one thread (other
        // ISAs never read it).
        #[cfg(target_arch = "x86_64")]
        if matches!(super::isa(), super::Isa::Avx2 | super::Isa::Avx512) {
            super::x86::prepare_lane_major(pool, &a);
        }
        a
    }

    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The activations of `tokens` (in that order, repeats allowed), e.g. the tokens routed to
    /// one expert. Identical to quantizing those tokens' rows directly.
    ///
    /// # Panics
    /// If a token index is out of range.
    pub fn gather(&self, tokens: &[usize]) -> Self {
        let (c, kb) = (self.cols, self.cols / self.kind.block());
        let pick = |v: &[f32], per: usize| -> Vec<f32> {
            tokens
                .iter()
                .flat_map(|&t| &v[t * per..(t + 1) * per])
                .copied()
                .collect()
        };
        let mut g = Self {
            kind: self.kind,
            n_tokens: tokens.len(),
            cols: c,
            f: Vec::new(),
            qs: Vec::new(),
            sums: Vec::new(),
            q8_1_s: Vec::new(),
            bsums: Vec::new(),
            corr4: Vec::new(),
            lane_major: OnceLock::new(),
        };
        for &t in tokens {
            assert!(t < self.n_tokens, "token {t} out of {}", self.n_tokens);
        }
        match self.kind {
            ActKind::F32 | ActKind::F16 | ActKind::BF16 => g.f = pick(&self.f, c),
            _ => {
                g.f = pick(&self.f, kb);
                g.qs = tokens
                    .iter()
                    .flat_map(|&t| &self.qs[t * c..(t + 1) * c])
                    .copied()
                    .collect();
                g.sums = tokens
                    .iter()
                    .flat_map(|&t| self.sums.get(t * kb..(t + 1) * kb).unwrap_or(&[]))
                    .copied()
                    .collect();
                g.q8_1_s = tokens
                    .iter()
                    .flat_map(|&t| self.q8_1_s.get(t * kb..(t + 1) * kb).unwrap_or(&[]))
                    .copied()
                    .collect();
                g.corr4 = tokens
                    .iter()
                    .flat_map(|&t| self.corr4.get(t * c / 4..(t + 1) * c / 4).unwrap_or(&[]))
                    .copied()
                    .collect();
                g.bsums = tokens
                    .iter()
                    .flat_map(|&t| self.bsums.get(t * c / 16..(t + 1) * c / 16).unwrap_or(&[]))
                    .copied()
                    .collect();
            }
        }
        g
    }

    /// Whether these activations can feed a matmul with weights of `dtype`.
    pub fn fits(&self, dtype: GgmlType) -> bool {
        self.kind == ActKind::for_weights(dtype)
    }

    /// Dequantized activations (what the kernels effectively multiply with), for tests.
    #[cfg(test)]
    pub(crate) fn dequantized(&self) -> Vec<f32> {
        match self.kind {
            ActKind::F32 | ActKind::F16 | ActKind::BF16 => self.f.clone(),
            ActKind::Q8_0 => (0..self.qs.len())
                .map(|i| self.f[i / 32] * self.qs[i] as f32)
                .collect(),
            ActKind::Q8K => (0..self.qs.len())
                .map(|i| self.f[i / 256] * self.qs[i] as f32)
                .collect(),
        }
    }
}

/// Quantizing is cheap; only spread it over threads when there is real work.
fn par_tokens(pool: &ThreadPool, n_tokens: usize, cols: usize, f: impl Fn(usize) + Sync) {
    if n_tokens > 1 && n_tokens * cols >= super::WORTH_SHARING {
        pool.run(n_tokens, f);
    } else {
        (0..n_tokens).for_each(f);
    }
}

/// [`quantize_row_q8_0`] with the AVX2 version when the process runs AVX2 or better
/// (identical results).
fn quantize_q8_0(x: &[f32], d: &mut [f32], qs: &mut [i8], sums: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if super::isa() >= super::Isa::Avx2 {
        // SAFETY: `isa()` only returns instruction sets this CPU has (AVX2/FMA/F16C here).
        return unsafe { super::x86::quant::quantize_row_q8_0(x, d, qs, sums) };
    }
    quantize_row_q8_0(x, d, qs, sums)
}

/// [`quantize_row_q8_k`] with the AVX2 version when the process runs AVX2 or better
/// (identical results).
fn quantize_q8_k(x: &[f32], d: &mut [f32], qs: &mut [i8], bsums: &mut [i16]) {
    #[cfg(target_arch = "x86_64")]
    if super::isa() >= super::Isa::Avx2 {
        // SAFETY: `isa()` only returns instruction sets this CPU has (AVX2/FMA/F16C here).
        return unsafe { super::x86::quant::quantize_row_q8_k(x, d, qs, bsums) };
    }
    quantize_row_q8_k(x, d, qs, bsums)
}

/// ggml's `quantize_row_q8_0` as its x86 SIMD path computes it: d = amax/127 stored as f16,
/// quants = round-half-even(x * 127/amax). `sums` gets each block's quant sum.
pub(crate) fn quantize_row_q8_0(x: &[f32], d: &mut [f32], qs: &mut [i8], sums: &mut [i32]) {
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        d[b] = f16::from_f32(amax / 127.0).to_f32();
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut s = 0i32;
        for (q, &v) in qs[b * 32..(b + 1) * 32].iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
            s += *q as i32;
        }
        sums[b] = s;
    }
}

/// ggml's Q8_1 block sums (`quantize_row_q8_1`, every one of its paths): `s` = f16(d·Σq) with
/// d = amax/127 before its f16 rounding; `sums` are the blocks' quant sums.
fn q8_1_block_sums(x: &[f32], sums: &[i32], out: &mut [f32]) {
    for ((xb, &sum), s) in x.chunks_exact(32).zip(sums).zip(out) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *s = f16::from_f32(amax / 127.0 * sum as f32).to_f32();
    }
}

/// ggml's `quantize_row_q8_K` (reference): scale from the signed value of largest magnitude,
/// quants = min(127, round-half-even(x * -127/max)), d = 1/iscale, plus 16-element sums.
pub(crate) fn quantize_row_q8_k(x: &[f32], d: &mut [f32], qs: &mut [i8], bsums: &mut [i16]) {
    for (b, xb) in x.chunks_exact(256).enumerate() {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let q = &mut qs[b * 256..(b + 1) * 256];
        if amax == 0.0 {
            d[b] = 0.0;
            q.fill(0);
            bsums[b * 16..(b + 1) * 16].fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (o, &v) in q.iter_mut().zip(xb) {
            *o = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (j, s) in bsums[b * 16..(b + 1) * 16].iter_mut().enumerate() {
            *s = q[j * 16..(j + 1) * 16].iter().map(|&v| v as i16).sum();
        }
        d[b] = 1.0 / iscale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs AVX2 (every x86-64 machine this project runs on has it); on a CPU without it the
    /// test checks what it can: that the kernels never dispatch to AVX2 there.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_quantizers_match_scalar_on_an_avx2_cpu() {
        if !crate::kernels::Isa::Avx2.available() {
            assert_eq!(crate::kernels::isa(), crate::kernels::Isa::Scalar);
            return;
        }
        let mut seed = 12345u64;
        let mut x: Vec<f32> = (0..2048)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 7.0
            })
            .collect();
        x[300] = -x[301].abs() - 5.0; // a negative block maximum
        x[302] = -x[300]; // a tie in magnitude: the first one wins
        x[512..768].fill(0.0); // an all-zero Q8_K block
        x[64..96].fill(0.0); // an all-zero Q8_0 block
        x[100] = 0.5 * 127.0 / 3.0; // exact .5 after scaling in some blocks
        let (mut d1, mut q1, mut s1) = (vec![0.0; 64], vec![0i8; 2048], vec![0; 64]);
        let (mut d2, mut q2, mut s2) = (d1.clone(), q1.clone(), s1.clone());
        quantize_row_q8_0(&x, &mut d1, &mut q1, &mut s1);
        // SAFETY: AVX2 detected above.
        unsafe { crate::kernels::x86::quant::quantize_row_q8_0(&x, &mut d2, &mut q2, &mut s2) };
        assert_eq!((d1, q1, s1), (d2, q2, s2));
        let (mut d1, mut q1, mut b1) = (vec![0.0; 8], vec![0i8; 2048], vec![0i16; 128]);
        let (mut d2, mut q2, mut b2) = (d1.clone(), q1.clone(), b1.clone());
        quantize_row_q8_k(&x, &mut d1, &mut q1, &mut b1);
        // SAFETY: AVX2 detected above.
        unsafe { crate::kernels::x86::quant::quantize_row_q8_k(&x, &mut d2, &mut q2, &mut b2) };
        assert_eq!((d1, q1, b1), (d2, q2, b2));
    }

    /// Regression: Q4_1/Q5_1 weights read ggml's Q8_1 `s`, made from the scale *before* its
    /// f16 rounding. From the rounded scale `s` lands on a neighbouring f16 in some blocks, and
    /// teacher-forced log-probs of the llama-quantize Q4_1/Q5_1 fixtures were 0.2 away from
    /// llama.cpp's (`tests/reference.rs`).
    #[test]
    fn q8_1_block_sums_use_the_unrounded_scale() {
        let mut seed = 7u64;
        let x: Vec<f32> = (0..32 * 256)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.3
            })
            .collect();
        let pool = ThreadPool::new(1);
        let a = QuantizedActs::new(&pool, GgmlType::Q5_1, &x, 1, x.len());
        let mut differs = 0;
        for (b, xb) in x.chunks_exact(32).enumerate() {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let sum: i32 = a.qs[b * 32..(b + 1) * 32].iter().map(|&q| q as i32).sum();
            let ggml = f16::from_f32(amax / 127.0 * sum as f32).to_f32();
            assert_eq!(a.q8_1_s[b].to_bits(), ggml.to_bits(), "block {b}");
            let from_rounded = f16::from_f32(a.f[b] * sum as f32).to_f32();
            differs += usize::from(from_rounded != ggml);
        }
        // The input has blocks where the two differ, so the test tells them apart.
        assert!(differs > 0);
        // Picking rows of tokens keeps each token's sums.
        let two = QuantizedActs::new(&pool, GgmlType::Q4_1, &x, 2, x.len() / 2);
        let g = two.gather(&[1]);
        assert_eq!(g.q8_1_s, two.q8_1_s[128..]);
    }

    #[test]
    fn q8_0_round_trip_and_sums() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.31)
            .collect();
        let (mut d, mut q, mut s) = (vec![0.0; 2], vec![0i8; 64], vec![0; 2]);
        quantize_row_q8_0(&x, &mut d, &mut q, &mut s);
        for i in 0..64 {
            let err = (d[i / 32] * q[i] as f32 - x[i]).abs();
            assert!(err <= d[i / 32] * 0.51 + 1e-3, "{i}: {err}");
        }
        assert_eq!(s[0], q[..32].iter().map(|&v| v as i32).sum::<i32>());
        assert!(q.iter().all(|&v| v >= -127));
    }

    #[test]
    fn q8_k_round_trip_and_bsums() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 53 % 101) as f32 - 50.0) * 0.01)
            .collect();
        let (mut d, mut q, mut b) = (vec![0.0; 2], vec![0i8; 512], vec![0i16; 32]);
        quantize_row_q8_k(&x, &mut d, &mut q, &mut b);
        for i in 0..512 {
            let err = (d[i / 256] * q[i] as f32 - x[i]).abs();
            assert!(err <= d[i / 256].abs() * 0.51 + 1e-6, "{i}: {err}");
        }
        assert_eq!(b[3], q[48..64].iter().map(|&v| v as i16).sum::<i16>());
        let zeros = vec![0.0f32; 256];
        quantize_row_q8_k(&zeros, &mut d[..1], &mut q[..256], &mut b[..16]);
        assert_eq!(d[0], 0.0);
    }
}
