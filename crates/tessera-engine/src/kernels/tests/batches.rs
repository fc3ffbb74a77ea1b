//! The same bits whatever else runs beside a token: batch composition, thread counts, row
//! ranges, prefill tiles and their remainders, kernel calls, and instruction sets.

use super::*;

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
