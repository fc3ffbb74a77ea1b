//! Kernel tests: every dtype against an f64 reference, bit-identity across batch composition,
//! thread counts, row ranges and instruction sets, and Matrix validation.

use std::sync::Arc;

use half::{bf16, f16};
use tessera_model::GgmlType;

use super::matmul::matmul_rows_isa;
use super::*;

pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(crate) fn byte(&mut self) -> u8 {
        (self.next_u64() >> 32) as u8
    }
    /// Uniform in [-1, 1).
    pub(crate) fn f(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn push_f16(v: &mut Vec<u8>, x: f32) {
    v.extend_from_slice(&f16::from_f32(x).to_le_bytes());
}

/// Random but valid GGML bytes for a `rows` × `cols` matrix.
pub(crate) fn random_matrix(dtype: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let nblocks = rows * cols / dtype.block_size();
    let mut v = Vec::with_capacity(nblocks * dtype.block_bytes());
    for _ in 0..nblocks {
        match dtype {
            GgmlType::F32 => v.extend_from_slice(&rng.f().to_le_bytes()),
            GgmlType::F16 => push_f16(&mut v, rng.f()),
            GgmlType::BF16 => v.extend_from_slice(&bf16::from_f32(rng.f()).to_le_bytes()),
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
                push_f16(&mut v, rng.f() * 0.05);
                for _ in 0..dtype.block_bytes() - 2 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                push_f16(&mut v, rng.f().abs() * 0.05);
                push_f16(&mut v, rng.f() * 0.5);
                for _ in 0..dtype.block_bytes() - 4 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                push_f16(&mut v, rng.f().abs() * 0.01);
                push_f16(&mut v, rng.f().abs() * 0.01);
                for _ in 0..dtype.block_bytes() - 4 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Q2K => {
                for _ in 0..80 {
                    v.push(rng.byte());
                }
                push_f16(&mut v, rng.f().abs() * 0.01);
                push_f16(&mut v, rng.f().abs() * 0.01);
            }
            GgmlType::Q3K => {
                for _ in 0..108 {
                    v.push(rng.byte());
                }
                push_f16(&mut v, rng.f() * 0.001);
            }
            GgmlType::Iq4Xs => {
                push_f16(&mut v, rng.f() * 0.0005);
                for _ in 0..134 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Iq2Xxs
            | GgmlType::Iq2Xs
            | GgmlType::Iq2S
            | GgmlType::Iq3Xxs
            | GgmlType::Iq3S => {
                push_f16(&mut v, rng.f() * 0.001);
                for _ in 0..dtype.block_bytes() - 2 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Iq4Nl => {
                push_f16(&mut v, rng.f() * 0.002);
                for _ in 0..16 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Mxfp4 => {
                v.push(118 + rng.byte() % 8);
                for _ in 0..16 {
                    v.push(rng.byte());
                }
            }
            GgmlType::Q6K => {
                for _ in 0..208 {
                    v.push(rng.byte());
                }
                push_f16(&mut v, rng.f() * 0.001);
            }
        }
    }
    v
}

/// ggml's reference Q4_0 encoder (test helper): d = max/-8 of the signed value of largest
/// magnitude, q = min(15, trunc(x/d + 8.5)).
pub(crate) fn quantize_q4_0(x: &[f32]) -> Vec<u8> {
    let mut v = Vec::new();
    for xb in x.chunks_exact(32) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &e in xb {
            if e.abs() > amax {
                amax = e.abs();
                max = e;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        push_f16(&mut v, d);
        let q = |e: f32| ((e * id + 8.5) as i32).min(15) as u8;
        for j in 0..16 {
            v.push(q(xb[j]) | (q(xb[j + 16]) << 4));
        }
    }
    v
}

/// ggml's reference Q8_0 encoder (test helper).
pub(crate) fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut v = Vec::new();
    for xb in x.chunks_exact(32) {
        let amax = xb.iter().fold(0f32, |m, e| m.max(e.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        push_f16(&mut v, d);
        v.extend(xb.iter().map(|&e| (e * id).round() as i8 as u8));
    }
    v
}

const ALL: [GgmlType; 21] = [
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::Iq2Xxs,
    GgmlType::Iq2Xs,
    GgmlType::Iq2S,
    GgmlType::Iq3Xxs,
    GgmlType::Iq3S,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Iq4Xs,
    GgmlType::Iq4Nl,
    GgmlType::Mxfp4,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

fn isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.available()).collect()
}

fn cols_for(dtype: GgmlType) -> usize {
    match dtype {
        GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::Q8_0
        | GgmlType::Mxfp4
        | GgmlType::Iq4Nl => 320,
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
        | GgmlType::Iq3S => 512,
        // Lanes of 17 columns (the AVX2 prefill passes walk one lane at a time), with a
        // float tail.
        _ => 1100,
    }
}

fn random_x(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| rng.f() * 2.0).collect()
}

fn run(
    isa: Isa,
    pool: &ThreadPool,
    w: &Matrix,
    r: (usize, usize),
    x: &[f32],
    nt: usize,
) -> Vec<f32> {
    let acts = QuantizedActs::new(pool, w.dtype(), x, nt, w.cols());
    let mut out = vec![f32::NAN; nt * (r.1 - r.0)];
    matmul_rows_isa(isa, pool, w, r.0, r.1, &acts, &mut out);
    out
}

#[test]
fn matches_f64_reference() {
    let pool = ThreadPool::new(2);
    for dtype in ALL {
        let mut rng = Rng::new(dtype.id() as u64 + 7);
        let (rows, cols, nt) = (21, cols_for(dtype), 3);
        let bytes = random_matrix(dtype, rows, cols, &mut rng);
        let mut wf = vec![0f32; rows * cols];
        dequantize(dtype, &bytes, &mut wf);
        let x = random_x(nt * cols, &mut rng);
        let acts = QuantizedActs::new(&pool, dtype, &x, nt, cols);
        let xa = acts.dequantized();
        // Q4_1/Q5_1 use ggml's Q8_1 block sum `s`, rounded to f16: its error times the
        // block's offset `m` is allowed on top.
        let s_err = |t: usize, r: usize| -> f64 {
            if !matches!(dtype, GgmlType::Q4_1 | GgmlType::Q5_1) {
                return 0.0;
            }
            let (nb, bb) = (cols / 32, dtype.block_bytes());
            (0..nb)
                .map(|b| {
                    let m = scalar::f16_at(&bytes, (r * nb + b) * bb + 2) as f64;
                    let (dy, sum) = (acts.f[t * nb + b], acts.sums[t * nb + b]);
                    let s = acts.q8_1_s[t * nb + b] as f64;
                    m.abs() * (s - dy as f64 * sum as f64).abs()
                })
                .sum()
        };
        let w = Matrix::new(dtype, rows, cols, MatrixBytes::Owned(bytes.clone())).unwrap();
        for isa in isas() {
            let out = run(isa, &pool, &w, (0, rows), &x, nt);
            for t in 0..nt {
                for r in 0..rows {
                    let (mut exact, mut mag) = (0f64, 0f64);
                    for c in 0..cols {
                        let p = wf[r * cols + c] as f64 * xa[t * cols + c] as f64;
                        exact += p;
                        mag += p.abs();
                    }
                    let got = out[t * rows + r] as f64;
                    let tol = 2e-6 * mag + 1e-6 + s_err(t, r);
                    assert!(
                        (got - exact).abs() <= tol,
                        "{dtype} {isa:?} t{t} r{r}: got {got}, want {exact} (±{tol})"
                    );
                }
            }
        }
        // The kernels' inputs are close to the unquantized product too.
        let out = run(isa(), &pool, &w, (0, rows), &x, nt);
        for r in 0..rows {
            let exact: f64 = (0..cols)
                .map(|c| wf[r * cols + c] as f64 * x[c] as f64)
                .sum();
            let mag: f64 = (0..cols)
                .map(|c| (wf[r * cols + c] * x[c]).abs() as f64)
                .sum();
            assert!(
                (out[r] as f64 - exact).abs() <= 0.05 * mag + 1e-4,
                "{dtype} r{r}"
            );
        }
    }
}

#[test]
fn bit_identical_across_batches_threads_ranges_and_isas() {
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    for dtype in ALL {
        let mut rng = Rng::new(dtype.id() as u64 + 100);
        let (rows, cols) = (37, cols_for(dtype));
        let bytes = random_matrix(dtype, rows, cols, &mut rng);
        let w = Matrix::new(dtype, rows, cols, MatrixBytes::Owned(bytes)).unwrap();
        let n_all = 11;
        let x = random_x(n_all * cols, &mut rng);
        let tok = |t: usize| &x[t * cols..(t + 1) * cols];
        // Baseline: each token alone, one thread, scalar kernels.
        let base: Vec<Vec<f32>> = (0..n_all)
            .map(|t| run(Isa::Scalar, &pools[0], &w, (0, rows), tok(t), 1))
            .collect();
        for isa in isas() {
            for pool in &pools {
                // 20: past a 16-token tile of the IQ2/IQ3 AVX-512 kernels.
                for nt in [1, 2, 3, 5, 8, 11, 20] {
                    let start = (nt * 3) % n_all;
                    let ids: Vec<usize> = (0..nt).map(|i| (start + i) % n_all).collect();
                    let xb: Vec<f32> = ids.iter().flat_map(|&t| tok(t).to_vec()).collect();
                    for range in [(0, rows), (3, 20), (16, 37), (5, 6), (17, 17), (0, 16)] {
                        let out = run(isa, pool, &w, range, &xb, nt);
                        let n = range.1 - range.0;
                        for (j, &t) in ids.iter().enumerate() {
                            for r in range.0..range.1 {
                                let (got, want) = (out[j * n + r - range.0], base[t][r]);
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{dtype} {isa:?} threads {} nt {nt} range {range:?} \
                                     token {t} row {r}: {got} vs {want}",
                                    pool.n_threads()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The AVX2 float kernels' decode (1 or 2 tokens) walks the 64-column blocks a few at a time
/// per lane, then one at a time: widths with no whole block, fewer blocks than one step,
/// exactly one step, and steps plus single blocks, with and without a column tail, equal the
/// scalar kernel bit for bit on every ISA.
#[test]
fn float_decode_at_every_block_count_equals_scalar() {
    let pool = ThreadPool::new(2);
    for dtype in [GgmlType::F16, GgmlType::BF16, GgmlType::F32] {
        let mut rng = Rng::new(dtype.id() as u64 + 500);
        for cols in [40, 64, 130, 256, 300, 576, 704] {
            let rows = 19;
            let bytes = random_matrix(dtype, rows, cols, &mut rng);
            let w = Matrix::new(dtype, rows, cols, MatrixBytes::Owned(bytes)).unwrap();
            for nt in [1, 2] {
                let x = random_x(nt * cols, &mut rng);
                let want = run(Isa::Scalar, &pool, &w, (0, rows), &x, nt);
                for isa in isas() {
                    let got = run(isa, &pool, &w, (0, rows), &x, nt);
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            e.to_bits(),
                            "{dtype} {isa:?} cols {cols} nt {nt} output {i}: {g} vs {e}"
                        );
                    }
                }
            }
        }
    }
}

/// A random `rows` × `cols` matrix of `dtype` (random from `seed`) against tokens: for each
/// count of `counts`, the first that many tokens at once give, bit for bit, what each gives
/// alone on the scalar kernel, on every ISA and every pool of `pools`.
fn assert_batches_equal_each_token_alone(
    dtype: GgmlType,
    seed: u64,
    (rows, cols): (usize, usize),
    counts: &[usize],
    pools: &[ThreadPool],
) {
    let mut rng = Rng::new(seed);
    let most = counts.iter().copied().max().unwrap_or(0);
    let bytes = random_matrix(dtype, rows, cols, &mut rng);
    let w = Matrix::new(dtype, rows, cols, MatrixBytes::Owned(bytes)).unwrap();
    let x = random_x(most * cols, &mut rng);
    let alone: Vec<Vec<f32>> = (0..most)
        .map(|t| {
            run(
                Isa::Scalar,
                &pools[0],
                &w,
                (0, rows),
                &x[t * cols..][..cols],
                1,
            )
        })
        .collect();
    for &nt in counts {
        for isa in isas() {
            for pool in pools {
                let out = run(isa, pool, &w, (0, rows), &x[..nt * cols], nt);
                for (t, alone) in alone.iter().take(nt).enumerate() {
                    for r in 0..rows {
                        assert_eq!(
                            out[t * rows + r].to_bits(),
                            alone[r].to_bits(),
                            "{dtype} {isa:?} threads {} nt {nt} token {t} row {r}",
                            pool.n_threads()
                        );
                    }
                }
            }
        }
    }
}

/// The AVX2 float kernels' prefill tiles read a lane-major copy of the activations in blocks
/// of 64 tokens, and take 256 tokens per call: batches past both, split between tasks at
/// token counts that are not multiples of a tile (so some tiles stop at a block's end), equal
/// each token alone on the scalar kernel, bit for bit, on every ISA.
#[test]
fn float_prefill_past_a_token_block_equals_each_token_alone() {
    let pools = [ThreadPool::new(1), ThreadPool::new(3)];
    for dtype in [GgmlType::F16, GgmlType::BF16, GgmlType::F32] {
        // 21 rows: 2 groups, so 3 threads split the 300 tokens into tasks of 19.
        let seed = dtype.id() as u64 + 300;
        assert_batches_equal_each_token_alone(dtype, seed, (21, 1100), &[300], &pools);
    }
}

/// The AVX2 float prefill tiles take the tokens in slices of up to 6 from the start of each
/// block of 64: every token count from 1 to 13 and a few about a block's end, on one thread
/// (tiles from a slice's start) and on three (token tasks that start inside a slice), equal
/// each token alone on the scalar kernel, bit for bit, on every ISA.
#[test]
fn float_prefill_at_every_tile_remainder_equals_each_token_alone() {
    let pools = [ThreadPool::new(1), ThreadPool::new(3)];
    let counts: Vec<usize> = (1..=13).chain([62, 64, 65, 70]).collect();
    for_both_float_prefill_widths(|| {
        for dtype in [GgmlType::F16, GgmlType::BF16, GgmlType::F32] {
            // 21 rows: 2 groups, so 3 threads split the tokens; 200 columns: a tail past 192.
            let seed = dtype.id() as u64 + 700;
            assert_batches_equal_each_token_alone(dtype, seed, (21, 200), &counts, &pools);
        }
    });
}

/// Runs `f` with AVX-512 processes' F16/BF16 prefill on the AVX-512 tiles, then on the AVX2
/// ones (which a CPU that splits 512-bit operations runs), whatever this CPU would choose.
fn for_both_float_prefill_widths(f: impl Fn()) {
    #[cfg(target_arch = "x86_64")]
    for wide in [true, false] {
        super::x86::set_wide_float_prefill(Some(wide));
        f();
    }
    #[cfg(target_arch = "x86_64")]
    super::x86::set_wide_float_prefill(None);
    #[cfg(not(target_arch = "x86_64"))]
    f();
}

/// AVX-512 float prefill takes two neighbouring groups per kernel call where a task holds
/// both: 277 rows (18 groups, the last one of 5 rows) give one thread's tasks 3 groups each (a
/// pair and a single), at token counts about a tile's and a block's width, with a column tail;
/// each token equals itself alone on the scalar kernel, bit for bit, on every ISA, and a row
/// range that starts and ends inside groups equals those rows of the whole.
#[test]
fn float_prefill_of_neighbouring_groups_equals_each_token_alone() {
    for_both_float_prefill_widths(neighbouring_groups_equal_each_token_alone);
}

fn neighbouring_groups_equal_each_token_alone() {
    let pools = [ThreadPool::new(1), ThreadPool::new(3)];
    for dtype in [GgmlType::F16, GgmlType::BF16, GgmlType::F32] {
        let seed = dtype.id() as u64 + 900;
        let (rows, cols) = (277, 200);
        assert_batches_equal_each_token_alone(dtype, seed, (rows, cols), &[3, 7, 13, 70], &pools);
        let mut rng = Rng::new(seed + 1);
        let bytes = random_matrix(dtype, rows, cols, &mut rng);
        let w = Matrix::new(dtype, rows, cols, MatrixBytes::Owned(bytes)).unwrap();
        let nt = 13;
        let x = random_x(nt * cols, &mut rng);
        let (r0, r1) = (5, 250);
        for isa in isas() {
            let whole = run(isa, &pools[0], &w, (0, rows), &x, nt);
            let part = run(isa, &pools[0], &w, (r0, r1), &x, nt);
            for t in 0..nt {
                for r in r0..r1 {
                    assert_eq!(
                        part[t * (r1 - r0) + r - r0].to_bits(),
                        whole[t * rows + r].to_bits(),
                        "{dtype} {isa:?} token {t} row {r}"
                    );
                }
            }
        }
    }
}

/// The K-quant kernels take the tokens in tiles of 6 or 8 and then one tile of the tokens
/// left, and IQ4_XS's kernels tiles of 4 (AVX2, then single tokens) or 8 (AVX-512, then one
/// tile of those left), from weights unpacked once per call from two tiles on: every token
/// count from 1 to 23 (every remainder after one and two whole tiles) equals each token alone
/// on the scalar kernel, bit for bit, on every ISA.
#[test]
fn k_quant_tiles_at_every_remainder_equal_each_token_alone() {
    let pools = [ThreadPool::new(1)];
    let counts: Vec<usize> = (1..=23).collect();
    for dtype in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Iq4Xs] {
        let seed = dtype.id() as u64 + 900;
        assert_batches_equal_each_token_alone(dtype, seed, (21, 512), &counts, &pools);
    }
}

/// Q6_K takes up to 512 tokens per kernel call (its x86 tiles sum the weights' offsets once
/// per call): a batch past one call, split between three threads' tasks, equals each token
/// alone on the scalar kernel, bit for bit, on every ISA.
#[test]
fn q6k_prefill_past_one_kernel_call_equals_each_token_alone() {
    let pools = [ThreadPool::new(1), ThreadPool::new(3)];
    assert_batches_equal_each_token_alone(GgmlType::Q6K, 1300, (21, 512), &[530], &pools);
}

#[test]
fn public_entry_points_agree() {
    let pool = ThreadPool::new(2);
    let dtype = GgmlType::Q4_0;
    let mut rng = Rng::new(5);
    let (rows, cols, nt) = (48, 64, 4);
    let w = Matrix::new(
        dtype,
        rows,
        cols,
        MatrixBytes::Owned(random_matrix(dtype, rows, cols, &mut rng)),
    )
    .unwrap();
    let x = random_x(nt * cols, &mut rng);
    let mut full = vec![0f32; nt * rows];
    matmul(&pool, &w, &x, nt, &mut full);
    let mut part = vec![0f32; nt * 16];
    matmul_rows(&pool, &w, 16, 32, &x, nt, &mut part);
    let acts = QuantizedActs::new(&pool, dtype, &x, nt, cols);
    assert!(acts.fits(GgmlType::Q8_0) && !acts.fits(GgmlType::Q4K));
    let mut part_q = vec![0f32; nt * 16];
    matmul_rows_q(&pool, &w, 16, 32, &acts, &mut part_q);
    for t in 0..nt {
        for r in 16..32 {
            assert_eq!(
                full[t * rows + r].to_bits(),
                part[t * 16 + r - 16].to_bits()
            );
            assert_eq!(
                part[t * 16 + r - 16].to_bits(),
                part_q[t * 16 + r - 16].to_bits()
            );
        }
    }
}

#[test]
fn matmul_many_and_gather_match_single_calls() {
    let pool = ThreadPool::new(3);
    let mut rng = Rng::new(77);
    let mats: Vec<Matrix> = [
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::F16,
        GgmlType::Q6K,
    ]
    .into_iter()
    .map(|d| {
        let (rows, cols) = (40, 256);
        Matrix::new(
            d,
            rows,
            cols,
            MatrixBytes::Owned(random_matrix(d, rows, cols, &mut rng)),
        )
        .unwrap()
    })
    .collect();
    let nt = 6;
    let x = random_x(nt * 256, &mut rng);
    let acts: Vec<QuantizedActs> = mats
        .iter()
        .map(|m| QuantizedActs::new(&pool, m.dtype(), &x, nt, 256))
        .collect();
    let ranges = [(0, 40), (8, 24), (3, 17), (39, 40), (5, 40)];
    let mut outs: Vec<Vec<f32>> = ranges
        .iter()
        .map(|r| vec![0f32; nt * (r.1 - r.0)])
        .collect();
    let mut jobs: Vec<MatmulJob<'_>> = outs
        .iter_mut()
        .enumerate()
        .map(|(i, out)| MatmulJob {
            w: &mats[i],
            row_start: ranges[i].0,
            row_end: ranges[i].1,
            acts: &acts[i],
            out,
        })
        .collect();
    matmul_many(&pool, &mut jobs);
    for (i, m) in mats.iter().enumerate() {
        let want = run(isa(), &pool, m, ranges[i], &x, nt);
        assert_eq!(outs[i], want, "{}", m.dtype());
        // Gathered tokens give the same rows as the full batch (1 and 2 tokens: the decode
        // tiles, which read the gathered activations' extra sums).
        for picked in [&[4, 1, 1][..], &[2], &[5, 0]] {
            let g = acts[i].gather(picked);
            let mut out = vec![0f32; picked.len() * (ranges[i].1 - ranges[i].0)];
            matmul_rows_q(&pool, m, ranges[i].0, ranges[i].1, &g, &mut out);
            let n = ranges[i].1 - ranges[i].0;
            for (j, &t) in picked.iter().enumerate() {
                assert_eq!(out[j * n..(j + 1) * n], want[t * n..(t + 1) * n]);
            }
        }
    }
}

#[test]
fn repacked_q4k_equals_ggml_row_kernel() {
    let pool = ThreadPool::new(1);
    let mut rng = Rng::new(31);
    let (rows, cols, nt) = (19, 768, 3);
    let bytes = random_matrix(GgmlType::Q4K, rows, cols, &mut rng);
    let w = Matrix::new(GgmlType::Q4K, rows, cols, MatrixBytes::Owned(bytes.clone())).unwrap();
    let x = random_x(nt * cols, &mut rng);
    let acts = QuantizedActs::new(&pool, GgmlType::Q4K, &x, nt, cols);
    let rb = cols / 256 * 144;
    for isa in isas() {
        let out = run(isa, &pool, &w, (0, rows), &x, nt);
        for t in 0..nt {
            for r in 0..rows {
                let want = scalar::q4k_dot(&bytes[r * rb..(r + 1) * rb], &acts, t);
                assert_eq!(
                    out[t * rows + r].to_bits(),
                    want.to_bits(),
                    "{isa:?} t{t} r{r}"
                );
            }
        }
    }
}

#[test]
fn repacked_q6k_equals_ggml_row_kernel() {
    let pool = ThreadPool::new(1);
    let mut rng = Rng::new(32);
    let (rows, cols, nt) = (21, 512, 5);
    let bytes = random_matrix(GgmlType::Q6K, rows, cols, &mut rng);
    let w = Matrix::new(GgmlType::Q6K, rows, cols, MatrixBytes::Owned(bytes.clone())).unwrap();
    let x = random_x(nt * cols, &mut rng);
    let acts = QuantizedActs::new(&pool, GgmlType::Q6K, &x, nt, cols);
    let rb = cols / 256 * 210;
    for isa in isas() {
        let out = run(isa, &pool, &w, (0, rows), &x, nt);
        for t in 0..nt {
            for r in 0..rows {
                let want = scalar::q6k_dot(&bytes[r * rb..(r + 1) * rb], &acts, t);
                assert_eq!(
                    out[t * rows + r].to_bits(),
                    want.to_bits(),
                    "{isa:?} t{t} r{r}"
                );
            }
        }
    }
}

#[test]
fn repacked_q5k_equals_ggml_row_kernel() {
    let pool = ThreadPool::new(1);
    let mut rng = Rng::new(33);
    let (rows, cols, nt) = (18, 512, 6);
    let bytes = random_matrix(GgmlType::Q5K, rows, cols, &mut rng);
    let w = Matrix::new(GgmlType::Q5K, rows, cols, MatrixBytes::Owned(bytes.clone())).unwrap();
    let x = random_x(nt * cols, &mut rng);
    let acts = QuantizedActs::new(&pool, GgmlType::Q5K, &x, nt, cols);
    let rb = cols / 256 * 176;
    for isa in isas() {
        let out = run(isa, &pool, &w, (0, rows), &x, nt);
        for t in 0..nt {
            for r in 0..rows {
                let want = scalar::q5k_dot(&bytes[r * rb..(r + 1) * rb], &acts, t);
                assert_eq!(
                    out[t * rows + r].to_bits(),
                    want.to_bits(),
                    "{isa:?} t{t} r{r}"
                );
            }
        }
    }
}

#[test]
fn dequantize_row_matches_ggml_layout() {
    for dtype in ALL {
        let mut rng = Rng::new(dtype.id() as u64 + 50);
        let (rows, cols) = (19, cols_for(dtype));
        let bytes = random_matrix(dtype, rows, cols, &mut rng);
        let mut all = vec![0f32; rows * cols];
        dequantize(dtype, &bytes, &mut all);
        let shared: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(bytes.clone());
        let w = Matrix::new(
            dtype,
            rows,
            cols,
            MatrixBytes::Shared {
                bytes: shared,
                offset: 0,
                len: bytes.len(),
            },
        )
        .unwrap();
        assert!(w.resident_bytes() >= bytes.len());
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            w.dequantize_row(r, &mut row);
            assert_eq!(row, all[r * cols..(r + 1) * cols], "{dtype} row {r}");
        }
    }
}

#[test]
fn a_matrix_built_into_a_used_buffer_equals_a_fresh_one() {
    // Streamed experts are built into evicted experts' allocations: leftover bytes (here 0xAB,
    // in a larger buffer) must not show, not even in the padding rows of a last partial group.
    for dtype in ALL {
        let mut rng = Rng::new(dtype.id() as u64 + 70);
        let (rows, cols) = (19, cols_for(dtype));
        let bytes = random_matrix(dtype, rows, cols, &mut rng);
        let fresh = Matrix::new(dtype, rows, cols, MatrixBytes::Owned(bytes.clone())).unwrap();
        let used = vec![0xABu8; fresh.resident_bytes() + 100];
        let reused = Matrix::new_in(dtype, rows, cols, MatrixBytes::Owned(bytes), used).unwrap();
        assert_eq!(reused.resident_bytes(), fresh.resident_bytes(), "{dtype}");
        for g in 0..rows.div_ceil(matrix::GROUP) {
            assert_eq!(reused.group(g), fresh.group(g), "{dtype} group {g}");
        }
        let buf = reused.into_buffer();
        assert!(
            buf.capacity() >= fresh.resident_bytes() + 100,
            "{dtype}: allocation kept"
        );
    }
}

#[test]
fn encoders_round_trip() {
    let mut rng = Rng::new(9);
    let x: Vec<f32> = (0..256).map(|_| rng.f()).collect();
    for (dtype, bytes, tol) in [
        (GgmlType::Q4_0, quantize_q4_0(&x), 0.13), // max/8 at the clamped end
        (GgmlType::Q8_0, quantize_q8_0(&x), 0.005),
    ] {
        let mut y = vec![0f32; 256];
        dequantize(dtype, &bytes, &mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= tol, "{dtype}: {a} vs {b}");
        }
    }
}

#[test]
fn matrix_new_rejects_bad_input() {
    let e = Matrix::new(GgmlType::Q4_0, 2, 33, MatrixBytes::Owned(vec![0; 36]));
    assert!(matches!(e, Err(KernelError::BadCols { .. })));
    let e = Matrix::new(GgmlType::Q4_0, 2, 32, MatrixBytes::Owned(vec![0; 35]));
    assert!(matches!(e, Err(KernelError::BadLength { .. })));
    let e = Matrix::new(GgmlType::Q4K, 1, 256, MatrixBytes::Owned(vec![0; 144]));
    assert!(e.is_ok());
    let buf: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(vec![0u8; 100]);
    let e = Matrix::new(
        GgmlType::F32,
        1,
        20,
        MatrixBytes::Shared {
            bytes: buf,
            offset: 50,
            len: 80,
        },
    );
    assert!(matches!(e, Err(KernelError::BadRange)));
    let e = Matrix::new(GgmlType::F32, usize::MAX, 4, MatrixBytes::Owned(vec![]));
    assert!(matches!(e, Err(KernelError::TooLarge { .. })));
    let e = Matrix::new(GgmlType::F16, 0, 0, MatrixBytes::Owned(vec![]));
    assert!(e.is_err());
}

/// Real GGUF weights (the repository's small test models): every 2-D tensor type present,
/// through `MatrixBytes::Shared` on the file mapping, against the f64 reference, and all
/// instruction sets bit-identical. Skips files that are absent.
#[test]
fn real_gguf_tensors_match_reference() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/test");
    let pool = ThreadPool::new(2);
    let mut seen = std::collections::HashSet::new();
    for name in [
        "tiny-qwen3-Q4_0.gguf",
        "tiny-qwen3-f32.gguf",
        "small-qwen3-Q8_0.gguf",
        "small-qwen3-Q4_K.gguf",
        "small-qwen3-Q5_K.gguf",
        "small-qwen3-Q6_K.gguf",
        "small-qwen3-F16.gguf",
        "small-qwen3-BF16.gguf",
    ] {
        let Ok(gf) = tessera_model::GgufFile::open(dir.join(name)) else {
            continue;
        };
        let map: Arc<dyn AsRef<[u8]> + Send + Sync> = gf.mapping().unwrap().clone();
        let mut rng = Rng::new(name.len() as u64);
        for info in gf.tensors().iter().filter(|t| t.shape.len() == 2) {
            let Some(dtype) = GgmlType::from_id(info.type_id) else {
                continue;
            };
            // One tensor per (file, type, width) keeps the test quick.
            let (cols, rows) = (info.shape[0] as usize, info.shape[1] as usize);
            if !seen.insert((name, dtype, cols)) {
                continue;
            }
            let w = Matrix::new(
                dtype,
                rows,
                cols,
                MatrixBytes::Shared {
                    bytes: Arc::clone(&map),
                    offset: info.offset as usize,
                    len: info.n_bytes as usize,
                },
            )
            .unwrap();
            let n = rows.min(40);
            let mut wf = vec![0f32; n * cols];
            let rb = info.n_bytes as usize / rows;
            dequantize(dtype, &gf.tensor_bytes(info).unwrap()[..n * rb], &mut wf);
            let nt = 3;
            let x = random_x(nt * cols, &mut rng);
            let xa = QuantizedActs::new(&pool, dtype, &x, nt, cols).dequantized();
            let base = run(Isa::Scalar, &pool, &w, (0, n), &x, nt);
            for isa in isas() {
                let out = run(isa, &pool, &w, (0, n), &x, nt);
                assert_eq!(out, base, "{name} {} {isa:?}", info.name);
            }
            for t in 0..nt {
                for r in 0..n {
                    let (mut exact, mut mag) = (0f64, 0f64);
                    for c in 0..cols {
                        let p = wf[r * cols + c] as f64 * xa[t * cols + c] as f64;
                        exact += p;
                        mag += p.abs();
                    }
                    let got = base[t * n + r] as f64;
                    assert!(
                        (got - exact).abs() <= 2e-6 * mag + 1e-6,
                        "{name} {} t{t} r{r}: {got} vs {exact}",
                        info.name
                    );
                }
            }
        }
    }
    if dir.exists() {
        let types: std::collections::HashSet<_> = seen.iter().map(|s| s.1).collect();
        eprintln!("checked {} real tensors, types {types:?}", seen.len());
        assert!(
            types.len() >= 6,
            "expected most types in models/test, got {types:?}"
        );
    }
}

#[test]
fn mxfp4_every_scale_byte_decodes_as_ggml_and_simd_equals_scalar() {
    // ggml: half of 2^(e-127), with e = 0 and 1 as subnormals.
    for e in 0..=254u8 {
        let want = 2f64.powi(e as i32 - 128);
        assert_eq!(super::lut4::e8m0_half(e) as f64, want, "e = {e}");
    }
    // Every scale byte the SIMD kernels convert in-lane (subnormal ones included) gives the
    // scalar result; 16 rows × 9 blocks cover 0..=143.
    let pool = ThreadPool::new(1);
    let (rows, cols) = (16, 288);
    let mut rng = Rng::new(39);
    let mut bytes = random_matrix(GgmlType::Mxfp4, rows, cols, &mut rng);
    for (i, b) in bytes.chunks_exact_mut(17).enumerate() {
        b[0] = i as u8;
    }
    let w = Matrix::new(GgmlType::Mxfp4, rows, cols, MatrixBytes::Owned(bytes)).unwrap();
    let x = random_x(2 * cols, &mut rng);
    let base = run(Isa::Scalar, &pool, &w, (0, rows), &x, 2);
    for isa in isas() {
        let out = run(isa, &pool, &w, (0, rows), &x, 2);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out), bits(&base), "{isa:?}");
    }
}

#[test]
fn isa_names_parse_and_unknown_ones_are_refused() {
    for i in Isa::ALL {
        assert_eq!(i.as_str().parse::<Isa>(), Ok(i));
    }
    assert_eq!(
        "AVX2".parse::<Isa>(),
        Err(IsaError::Unknown("AVX2".to_string()))
    );
}

#[test]
fn a_cap_picks_the_best_available_isa_not_above_it() {
    assert_eq!(Isa::best_up_to(Isa::Scalar), Isa::Scalar);
    for cap in Isa::ALL {
        let got = Isa::best_up_to(cap);
        assert!(got <= cap && got.available());
        assert!(Isa::ALL
            .iter()
            .all(|&i| i <= got || i > cap || !i.available()));
    }
}

/// Once the kernels run, a cap that would change their path is refused; one that keeps it is
/// accepted (the process's results all come from one path).
#[test]
fn set_max_isa_cannot_change_the_active_isa() {
    let active = isa();
    assert_eq!(set_max_isa(active), Ok(active));
    if active != Isa::Scalar {
        assert_eq!(
            set_max_isa(Isa::Scalar),
            Err(IsaError::AlreadyChosen {
                active,
                cap: Isa::Scalar
            })
        );
    }
}

/// Issue #30: on an AVX2 (or AVX-512) process no weight type the model loader accepts falls to
/// the portable kernel; those stay the reference and the path of CPUs without AVX2.
#[cfg(target_arch = "x86_64")]
#[test]
fn no_weight_type_runs_the_scalar_kernel_on_avx2_or_avx512() {
    let supported: Vec<GgmlType> = (0..256).filter_map(GgmlType::from_id).collect();
    assert_eq!(supported.len(), ALL.len(), "a type missing from ALL");
    for dtype in supported {
        assert!(ALL.contains(&dtype), "{dtype} missing from ALL");
        assert_eq!(kernel_path_on(Isa::Scalar, dtype), Isa::Scalar, "{dtype}");
        assert_eq!(
            kernel_path_on(Isa::Avx2, dtype),
            Isa::Avx2,
            "{dtype} on avx2"
        );
        assert_eq!(
            kernel_path_on(Isa::Avx512, dtype),
            Isa::Avx512,
            "{dtype} on avx512"
        );
    }
}

/// Issue #30: on aarch64 the types real files use most take a NEON kernel, with the
/// dot-product extension for the integer ones where the process runs with it; the rest keep
/// the portable kernel, and `kernel_path` says so.
#[cfg(target_arch = "aarch64")]
#[test]
fn the_common_weight_types_run_neon_kernels_on_aarch64() {
    use GgmlType::*;
    let integer = [
        Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, Mxfp4, Iq4Nl, Iq4Xs,
    ];
    let float = [F16, BF16, F32];
    for dtype in ALL {
        let (neon, dot) = (
            kernel_path_on(Isa::Neon, dtype),
            kernel_path_on(Isa::Dotprod, dtype),
        );
        if integer.contains(&dtype) {
            assert_eq!((neon, dot), (Isa::Neon, Isa::Dotprod), "{dtype}");
        } else if float.contains(&dtype) {
            assert_eq!((neon, dot), (Isa::Neon, Isa::Neon), "{dtype}");
        } else {
            assert_eq!((neon, dot), (Isa::Scalar, Isa::Scalar), "{dtype}");
        }
    }
    // Every aarch64 CPU has NEON, so a process never runs the portable kernels unless capped.
    assert!(Isa::Neon.available());
}

/// Q4_1 and Q5_1 blocks built by hand decode to `code·d + m` with ggml's element order (low
/// nibbles first, Q5_1's high bit `e` on element `e`), through the GGML-layout decoder and
/// through a built matrix's row decoder.
#[test]
fn q4_1_and_q5_1_decode_as_ggml_lays_them_out() {
    let (d, m) = (0.5f32, -3.0f32);
    let mut q4_1 = Vec::new();
    push_f16(&mut q4_1, d);
    push_f16(&mut q4_1, m);
    // Byte j: low nibble j % 16, high nibble 15 - j % 16.
    q4_1.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let want4: Vec<f32> = (0..32)
        .map(|e| if e < 16 { e as f32 } else { (31 - e) as f32 })
        .map(|q| q * d + m)
        .collect();
    let mut q5_1 = Vec::new();
    push_f16(&mut q5_1, d);
    push_f16(&mut q5_1, m);
    // High bits set on elements 1, 16 and 31.
    let qh: u32 = (1 << 1) | (1 << 16) | (1 << 31);
    q5_1.extend_from_slice(&qh.to_le_bytes());
    q5_1.extend_from_slice(&q4_1[4..20]);
    let want5: Vec<f32> = (0..32)
        .map(|e| {
            let lo = if e < 16 { e as u32 } else { 31 - e as u32 };
            (lo + 16 * ((qh >> e) & 1)) as f32 * d + m
        })
        .collect();
    for (dtype, block, want) in [(GgmlType::Q4_1, q4_1, want4), (GgmlType::Q5_1, q5_1, want5)] {
        let mut got = vec![0f32; 32];
        dequantize(dtype, &block, &mut got);
        assert_eq!(got, want, "{dtype}");
        // Three rows of the same block: row 2 of a built (widened, interleaved) matrix.
        let rows: Vec<u8> = (0..3).flat_map(|_| block.clone()).collect();
        let w = Matrix::new(dtype, 3, 32, MatrixBytes::Owned(rows)).unwrap();
        let mut row = vec![0f32; 32];
        w.dequantize_row(2, &mut row);
        assert_eq!(row, want, "{dtype} row");
        // The kernels on every path: one-hot activations pick out single weights.
        let pool = ThreadPool::new(1);
        for e in [0, 1, 16, 31] {
            let mut x = vec![0f32; 32];
            x[e] = 1.0;
            for isa in isas() {
                let out = run(isa, &pool, &w, (0, 3), &x, 1);
                // The activation quantizes to 127 at e with d = f16(1/127), s = f16(127·d).
                let dy = f16::from_f32(1.0 / 127.0).to_f32();
                let s = f16::from_f32(dy * 127.0).to_f32();
                let exact = (want[e] - m) * dy * 127.0 + m * s;
                assert!(
                    (out[2] - exact).abs() < 1e-3,
                    "{dtype} {isa:?} e{e}: {} vs {exact}",
                    out[2]
                );
            }
        }
    }
}
