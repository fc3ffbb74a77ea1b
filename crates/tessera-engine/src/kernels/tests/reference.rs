//! Every weight type against ggml's arithmetic and layouts: an f64 reference, ggml's row
//! kernels for the repacked K-quants, its dequantized layouts and encoders, real GGUF tensors.

use super::*;

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
                    let (exact, mag) = exact_dot(&wf, &xa, cols, r, t);
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

/// A repacked K-quant matrix (`block` bytes per 256 columns) gives, on every ISA, bit for bit
/// what ggml's row kernel `dot` gives on the file's rows.
fn assert_repacked_equals_row_kernel(
    dtype: GgmlType,
    seed: u64,
    (rows, cols, nt): (usize, usize, usize),
    block: usize,
    dot: fn(&[u8], &QuantizedActs, usize) -> f32,
) {
    let pool = ThreadPool::new(1);
    let mut rng = Rng::new(seed);
    let bytes = random_matrix(dtype, rows, cols, &mut rng);
    let w = Matrix::new(dtype, rows, cols, MatrixBytes::Owned(bytes.clone())).unwrap();
    let x = random_x(nt * cols, &mut rng);
    let acts = QuantizedActs::new(&pool, dtype, &x, nt, cols);
    let rb = cols / 256 * block;
    for isa in isas() {
        let out = run(isa, &pool, &w, (0, rows), &x, nt);
        for t in 0..nt {
            for r in 0..rows {
                let want = dot(&bytes[r * rb..(r + 1) * rb], &acts, t);
                assert_eq!(
                    out[t * rows + r].to_bits(),
                    want.to_bits(),
                    "{dtype} {isa:?} t{t} r{r}"
                );
            }
        }
    }
}

#[test]
fn repacked_q4k_equals_ggml_row_kernel() {
    assert_repacked_equals_row_kernel(GgmlType::Q4K, 31, (19, 768, 3), 144, scalar::q4k_dot);
}

#[test]
fn repacked_q6k_equals_ggml_row_kernel() {
    assert_repacked_equals_row_kernel(GgmlType::Q6K, 32, (21, 512, 5), 210, scalar::q6k_dot);
}

#[test]
fn repacked_q5k_equals_ggml_row_kernel() {
    assert_repacked_equals_row_kernel(GgmlType::Q5K, 33, (18, 512, 6), 176, scalar::q5k_dot);
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
                    let (exact, mag) = exact_dot(&wf, &xa, cols, r, t);
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
