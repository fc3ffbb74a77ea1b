//! Portable kernels and GGML block decoding.
//!
//! The dot kernels here define the arithmetic every SIMD path reproduces (each type's float
//! order is llama.cpp's x86 one, see the kernel docs): integer block sums are exact, so the
//! SIMD kernels give bit-identical results to these on any machine.

use half::{bf16, f16};
use tessera_model::GgmlType;

use super::matrix::{
    float_column, kx16_bytes, kx16_qs, q6k_x16_quant, GROUP, Q1_MIN, Q1_QS, Q1_X16, Q4K_DMIN,
    Q4K_MINS, Q4K_SCALES, Q5K_QH, Q6K_SCALES, Q6K_X16,
};
use super::quant_acts::QuantizedActs;

#[inline]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K.
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// All 8 (scale, min) pairs of a Q4_K/Q5_K block.
#[inline]
pub(crate) fn scales_mins_k4(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut s, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        (s[j], m[j]) = scale_min_k4(j, q);
    }
    (s, m)
}

/// Decodes one GGML block of `dtype` (`dtype.block_bytes()` bytes) into `block_size` floats.
pub(crate) fn dequantize_block(dtype: GgmlType, b: &[u8], y: &mut [f32]) {
    match dtype {
        GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::Mxfp4 => super::lut4::dequantize_block(false, b, y),
        GgmlType::Iq4Nl => super::lut4::dequantize_block(true, b, y),
        GgmlType::Iq4Xs => super::iq4xs::dequantize_block(b, y),
        GgmlType::Q2K => super::k23::dequantize_block(false, b, y),
        GgmlType::Q3K => super::k23::dequantize_block(true, b, y),
        GgmlType::Iq2Xxs | GgmlType::Iq2Xs | GgmlType::Iq2S | GgmlType::Iq3Xxs | GgmlType::Iq3S => {
            super::iq23::dequantize_block(dtype, b, y)
        }
        GgmlType::F16 => y[0] = f16_at(b, 0),
        GgmlType::BF16 => y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        GgmlType::Q4_0 => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                y[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
                y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let codes = q1_codes(dtype == GgmlType::Q5_1, b);
            for (y, &q) in y.iter_mut().zip(&codes) {
                *y = q as f32 * d + m;
            }
        }
        GgmlType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let lo = (b[6 + j] & 0xF) as u32 | ((qh >> j) & 1) << 4;
                let hi = (b[6 + j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
                y[j] = (lo as i32 - 16) as f32 * d;
                y[j + 16] = (hi as i32 - 16) as f32 * d;
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = b[2 + j] as i8 as f32 * d;
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let sc = &b[4..16];
            let (qh, qs) = if dtype == GgmlType::Q5K {
                (&b[16..48], &b[48..176])
            } else {
                (&b[0..0], &b[16..144])
            };
            for c in 0..4 {
                let (s1, m1) = scale_min_k4(2 * c, sc);
                let (s2, m2) = scale_min_k4(2 * c + 1, sc);
                let (d1, d2) = (d * s1 as f32, d * s2 as f32);
                let (m1, m2) = (dmin * m1 as f32, dmin * m2 as f32);
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    let (mut lo, mut hi) = ((q & 0xF) as u32, (q >> 4) as u32);
                    if !qh.is_empty() {
                        lo += (((qh[l] >> (2 * c)) & 1) as u32) << 4;
                        hi += (((qh[l] >> (2 * c + 1)) & 1) as u32) << 4;
                    }
                    y[64 * c + l] = d1 * lo as f32 - m1;
                    y[64 * c + 32 + l] = d2 * hi as f32 - m2;
                }
            }
        }
        GgmlType::Q6K => {
            let d = f16_at(b, 208);
            for n in 0..2 {
                let ql = &b[64 * n..64 * n + 64];
                let qh = &b[128 + 32 * n..128 + 32 * n + 32];
                let sc = &b[192 + 8 * n..192 + 8 * n + 8];
                for l in 0..32 {
                    let q = q6k_quants(ql, qh, l);
                    let is = l / 16;
                    for (k, &qk) in q.iter().enumerate() {
                        y[128 * n + 32 * k + l] = d * (sc[is + 2 * k] as i8) as f32 * qk as f32;
                    }
                }
            }
        }
    }
}

/// The 32 unsigned codes of a GGML Q4_1 (`five` = false: f16 `d`, f16 `m`, 16 bytes of
/// nibbles) or Q5_1 block (`d`, `m`, 32 high bits, nibbles), in element order: element `j < 16`
/// is the low nibble of byte `j`, element `16 + j` its high nibble; Q5_1 adds bit `e` of the
/// high bits as bit 4 of element `e`.
pub(crate) fn q1_codes(five: bool, b: &[u8]) -> [u8; 32] {
    let (qh, qs) = if five {
        (u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24])
    } else {
        (0, &b[4..20])
    };
    std::array::from_fn(|e| {
        let nib = if e < 16 { qs[e] & 0xF } else { qs[e - 16] >> 4 };
        nib | (((qh >> e) & 1) as u8) << 4
    })
}

/// The four signed 6-bit quants at offsets l, l+32, l+64, l+96 of a Q6_K half-block.
#[inline]
fn q6k_quants(ql: &[u8], qh: &[u8], l: usize) -> [i32; 4] {
    let h = qh[l];
    [
        ((ql[l] & 0xF) | ((h & 3) << 4)) as i32 - 32,
        ((ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) as i32 - 32,
        ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i32 - 32,
        ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i32 - 32,
    ]
}

// ---- Q4_0 / Q8_0 on the row-interleaved layout (see matrix.rs) ----

/// 16 rows × `nt` tokens of a Q4_0 row group; `out[j*16 + r]`. One `fma(dx·dy, isum, acc)`
/// per block with the exact integer block sum, as llama.cpp's repacked `ggml_gemv_q4_0_8x8_q8_0`.
pub(crate) fn q4_0_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 32;
    let stride = GROUP * 18;
    for j in 0..nt {
        let t = t0 + j;
        let mut acc = [0f32; GROUP];
        for b in 0..nb {
            let blk = &w[b * stride..(b + 1) * stride];
            let y = &a.qs[t * a.cols + b * 32..][..32];
            let (dy, ysum) = (a.f[t * nb + b], a.sums[t * nb + b]);
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for k in 0..4 {
                    for i in 0..4 {
                        let q = blk[2 * GROUP + 64 * k + 4 * r + i];
                        isum += (q & 0xF) as i32 * y[4 * k + i] as i32
                            + (q >> 4) as i32 * y[16 + 4 * k + i] as i32;
                    }
                }
                isum -= 8 * ysum;
                *acc = (f16_at(blk, 2 * r) * dy).mul_add(isum as f32, *acc);
            }
        }
        out[j * GROUP..(j + 1) * GROUP].copy_from_slice(&acc);
    }
}

/// The final sum of a Q8_0 row's 8 lane accumulators, in llama.cpp's `hsum(__m256)` order.
#[inline(always)]
pub(crate) fn q8_0_lanes_sum(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// 16 rows × `nt` tokens of a Q8_0 row group; `out[j*16 + r]`.
///
/// Q8_0 follows llama.cpp's x86 path for Q8_0 weights (llamafile's `tinyBLAS_Q0_AVX`) exactly,
/// because the reference outputs are that sensitive: 8 lanes per row, lane `k` accumulating
/// `fma(dx·dy, Σ of elements 4k..4k+4, lane)` over blocks, then [`q8_0_lanes_sum`].
pub(crate) fn q8_0_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 32;
    let stride = GROUP * 34;
    for j in 0..nt {
        let t = t0 + j;
        let mut acc = [[0f32; 8]; GROUP];
        for b in 0..nb {
            let blk = &w[b * stride..(b + 1) * stride];
            let y = &a.qs[t * a.cols + b * 32..][..32];
            let dy = a.f[t * nb + b];
            for (r, acc) in acc.iter_mut().enumerate() {
                let d = f16_at(blk, 2 * r) * dy;
                for (k, acc) in acc.iter_mut().enumerate() {
                    let s: i32 = (0..4)
                        .map(|i| {
                            blk[2 * GROUP + 64 * k + 4 * r + i] as i8 as i32 * y[4 * k + i] as i32
                        })
                        .sum();
                    *acc = d.mul_add(s as f32, *acc);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            out[j * GROUP + r] = q8_0_lanes_sum(acc);
        }
    }
}

/// 16 rows × `nt` tokens of a (widened) Q4_1/Q5_1 row group; `out[j*16 + r]`.
///
/// Follows llama.cpp's AVX2 `ggml_vec_dot_q4_1_q8_1` / `ggml_vec_dot_q5_1_q8_1`: 8 lanes per
/// row, lane `k` accumulating `fma(dx·dy, Σ of elements 4k..4k+4, lane)` over blocks, the
/// offsets as `summs = fma(m, s, summs)` (gcc contracts ggml's `summs += m*s` into one FMA:
/// `vfmadd231ss` in the reference build's `libggml-cpu.so`), and
/// `q8_0_lanes_sum(lanes) + summs`. `s` is ggml's Q8_1 block sum (`QuantizedActs::q8_1_s`).
pub(crate) fn q1_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 32;
    for j in 0..nt {
        let t = t0 + j;
        let mut acc = [[0f32; 8]; GROUP];
        let mut summs = [0f32; GROUP];
        for b in 0..nb {
            let blk = &w[b * Q1_X16..(b + 1) * Q1_X16];
            let y = &a.qs[t * a.cols + b * 32..][..32];
            let dy = a.f[t * nb + b];
            let sy = a.q8_1_s[t * nb + b];
            for r in 0..GROUP {
                let d = f16_at(blk, 2 * r) * dy;
                for (k, acc) in acc[r].iter_mut().enumerate() {
                    let s: i32 = (0..4)
                        .map(|i| blk[Q1_QS + 64 * k + 4 * r + i] as i32 * y[4 * k + i] as i32)
                        .sum();
                    *acc = d.mul_add(s as f32, *acc);
                }
                summs[r] = f16_at(blk, Q1_MIN + 2 * r).mul_add(sy, summs[r]);
            }
        }
        for r in 0..GROUP {
            out[j * GROUP + r] = q8_0_lanes_sum(&acc[r]) + summs[r];
        }
    }
}

/// Final value of a Q4_K/Q5_K row. Q5_K: the 8 scale lanes as [`q8_0_lanes_sum`] plus the
/// running min sum `m[0]`. Q4_K: `acc[0] − m[0]` (one accumulator each).
#[inline(always)]
pub(crate) fn k45_finish<const FIVE: bool>(acc: &[f32; 8], m: &[f32; 4]) -> f32 {
    if FIVE {
        q8_0_lanes_sum(acc) + m[0]
    } else {
        acc[0] - m[0]
    }
}

/// 16 rows × `nt` tokens of an interleaved Q4_K (`FIVE` = false) or Q5_K group;
/// `out[j*16 + r]`.
///
/// Follows the llama.cpp x86 kernels these types run through. Q4_K (repacked
/// `ggml_gemv_q4_K_8x8_q8_K`): per block `acc = fma(isum, dx·dy, acc)` and
/// `accm = fma(msum, dmin·dy, accm)` with the exact integer sums, result `acc − accm`.
/// Q5_K (`ggml_vec_dot_q5_K_q8_K`): 8 lanes per row, lane `L` the exact integer sum of
/// `scale·q·y` over elements with `(e % 32) / 4 == L`, `fma(dx·dy, lane, acc_L)` per block, and
/// `summs += (−dy·dmin)·msum`; then [`k45_finish`].
pub(crate) fn q45k_group<const FIVE: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let nb = a.cols / 256;
    let (x16, qs) = (kx16_bytes(FIVE), kx16_qs(FIVE));
    for j in 0..nt {
        let t = t0 + j;
        let mut acc = [[0f32; 8]; GROUP];
        let mut accm = [[0f32; 4]; GROUP];
        for b in 0..nb {
            let blk = &w[b * x16..(b + 1) * x16];
            let y = &a.qs[t * a.cols + b * 256..][..256];
            let bsums = &a.bsums[(t * a.cols + b * 256) / 16..][..16];
            let dy = a.f[t * nb + b];
            for r in 0..GROUP {
                let mut lanes = [0i32; 8];
                for c in 0..4 {
                    let sc_lo = blk[Q4K_SCALES + 32 * c + r] as i32;
                    let sc_hi = blk[Q4K_SCALES + 32 * c + 16 + r] as i32;
                    for (k, lane) in lanes.iter_mut().enumerate() {
                        for i in 0..4 {
                            let o = 64 * k + 4 * r + i;
                            let q = blk[qs + 512 * c + o];
                            let (mut lo, mut hi) = ((q & 0xF) as i32, (q >> 4) as i32);
                            if FIVE {
                                lo |= (((blk[Q5K_QH + o] >> (2 * c)) & 1) as i32) << 4;
                                hi |= (((blk[Q5K_QH + o] >> (2 * c + 1)) & 1) as i32) << 4;
                            }
                            *lane += sc_lo * lo * y[64 * c + 4 * k + i] as i32
                                + sc_hi * hi * y[64 * c + 32 + 4 * k + i] as i32;
                        }
                    }
                }
                let d = dy * f16_at(blk, 2 * r);
                let dmin = -dy * f16_at(blk, Q4K_DMIN + 2 * r);
                if FIVE {
                    for (acc, &l) in acc[r].iter_mut().zip(&lanes) {
                        *acc = d.mul_add(l as f32, *acc);
                    }
                } else {
                    let isum: i32 = lanes.iter().sum();
                    acc[r][0] = (isum as f32).mul_add(f16_at(blk, 2 * r) * dy, acc[r][0]);
                }
                let prod: [i32; 4] = std::array::from_fn(|p| {
                    (0..2)
                        .map(|h| {
                            let s = 2 * p + h;
                            let bs = bsums[2 * s] as i32 + bsums[2 * s + 1] as i32;
                            blk[Q4K_MINS + 16 * s + r] as i32 * bs
                        })
                        .sum()
                });
                let msum = (prod[0] + prod[1]) + (prod[2] + prod[3]);
                if FIVE {
                    // `summs += dmin * msum` in llama.cpp: product, then sum (not fused).
                    accm[r][0] += dmin * msum as f32;
                } else {
                    let dm = f16_at(blk, Q4K_DMIN + 2 * r) * dy;
                    accm[r][0] = (msum as f32).mul_add(dm, accm[r][0]);
                }
            }
        }
        for r in 0..GROUP {
            out[j * GROUP + r] = k45_finish::<FIVE>(&acc[r], &accm[r]);
        }
    }
}

/// 16 rows × `nt` tokens of an interleaved Q6_K group; `out[j*16 + r]`.
///
/// Follows llama.cpp's AVX2 `ggml_vec_dot_q6_K_q8_K` exactly: 8 lanes per row, lane `L`
/// holding the exact integer sum over the block of `scale·(q−32)·y` for the elements with
/// `(e % 32) / 4 == L`, then `fma(dx·dy, lane, acc_L)` per block and [`q8_0_lanes_sum`].
pub(crate) fn q6k_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 256;
    for j in 0..nt {
        let t = t0 + j;
        let mut acc = [[0f32; 8]; GROUP];
        for b in 0..nb {
            let blk = &w[b * Q6K_X16..(b + 1) * Q6K_X16];
            let y = &a.qs[t * a.cols + b * 256..][..256];
            let dy = a.f[t * nb + b];
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut lanes = [0i32; 8];
                for (e, &ye) in y.iter().enumerate() {
                    let sc = blk[Q6K_SCALES + 16 * (e / 16) + r] as i8 as i32;
                    lanes[(e % 32) / 4] += sc * (q6k_x16_quant(blk, r, e) - 32) * ye as i32;
                }
                let d = dy * f16_at(blk, 2 * r);
                for (acc, &l) in acc.iter_mut().zip(&lanes) {
                    *acc = d.mul_add(l as f32, *acc);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            out[j * GROUP + r] = q8_0_lanes_sum(acc);
        }
    }
}

// ---- K-quants, one GGML row at a time: the tests' cross-check of the repacked kernels ----

#[cfg(test)]
pub(crate) fn q4k_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    q45k_dot::<false>(row, a, t)
}

#[cfg(test)]
pub(crate) fn q5k_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    q45k_dot::<true>(row, a, t)
}

/// `q45k_group`'s arithmetic on a GGML row (cross-checks the repack).
#[cfg(test)]
fn q45k_dot<const FIVE: bool>(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    let nb = a.cols / 256;
    let bb = if FIVE { 176 } else { 144 };
    let (mut acc, mut accm) = ([0f32; 8], [0f32; 4]);
    for b in 0..nb {
        let blk = &row[b * bb..(b + 1) * bb];
        let y = &a.qs[t * a.cols + b * 256..][..256];
        let bsums = &a.bsums[(t * a.cols + b * 256) / 16..][..16];
        let (sc, mins) = scales_mins_k4(&blk[4..16]);
        let (qh, qs) = if FIVE {
            (&blk[16..48], &blk[48..176])
        } else {
            (&blk[0..0], &blk[16..144])
        };
        let mut lanes = [0i32; 8];
        for c in 0..4 {
            for l in 0..32 {
                let q = qs[32 * c + l];
                let (mut lo, mut hi) = ((q & 0xF) as i32, (q >> 4) as i32);
                if FIVE {
                    lo += (((qh[l] >> (2 * c)) & 1) as i32) << 4;
                    hi += (((qh[l] >> (2 * c + 1)) & 1) as i32) << 4;
                }
                lanes[l / 4] += sc[2 * c] as i32 * lo * y[64 * c + l] as i32
                    + sc[2 * c + 1] as i32 * hi * y[64 * c + 32 + l] as i32;
            }
        }
        let dy = a.f[t * nb + b];
        let (d, dmin) = (dy * f16_at(blk, 0), -dy * f16_at(blk, 2));
        if FIVE {
            for (acc, &l) in acc.iter_mut().zip(&lanes) {
                *acc = d.mul_add(l as f32, *acc);
            }
        } else {
            let isum: i32 = lanes.iter().sum();
            acc[0] = (isum as f32).mul_add(f16_at(blk, 0) * dy, acc[0]);
        }
        let prod: [i32; 4] = std::array::from_fn(|p| {
            (2 * p..2 * p + 2)
                .map(|s| mins[s] as i32 * (bsums[2 * s] as i32 + bsums[2 * s + 1] as i32))
                .sum()
        });
        let msum = (prod[0] + prod[1]) + (prod[2] + prod[3]);
        if FIVE {
            accm[0] += dmin * msum as f32;
        } else {
            accm[0] = (msum as f32).mul_add(f16_at(blk, 2) * dy, accm[0]);
        }
    }
    k45_finish::<FIVE>(&acc, &accm)
}

#[cfg(test)]
pub(crate) fn q6k_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    let nb = a.cols / 256;
    let mut acc = [0f32; 8];
    for b in 0..nb {
        let blk = &row[b * 210..(b + 1) * 210];
        let y = &a.qs[t * a.cols + b * 256..][..256];
        let mut lanes = [0i32; 8];
        for n in 0..2 {
            let ql = &blk[64 * n..64 * n + 64];
            let qh = &blk[128 + 32 * n..128 + 32 * n + 32];
            let sc = &blk[192 + 8 * n..192 + 8 * n + 8];
            for l in 0..32 {
                let q = q6k_quants(ql, qh, l);
                for (k, &qk) in q.iter().enumerate() {
                    let s = (sc[2 * k + l / 16] as i8) as i32;
                    lanes[l / 4] += s * qk * y[128 * n + 32 * k + l] as i32;
                }
            }
        }
        let d = a.f[t * nb + b] * f16_at(blk, 208);
        for (acc, &l) in acc.iter_mut().zip(&lanes) {
            *acc = d.mul_add(l as f32, *acc);
        }
    }
    q8_0_lanes_sum(&acc)
}

// ---- float weights (column-interleaved groups, see matrix.rs) ----

/// A float weight at byte offset `o` of an interleaved group.
#[inline(always)]
fn float_at<const ES: usize>(w: &[u8], o: usize, bf16: bool) -> f32 {
    match ES {
        4 => f32::from_le_bytes([w[o], w[o + 1], w[o + 2], w[o + 3]]),
        _ if bf16 => f32::from_bits((u16::from_le_bytes([w[o], w[o + 1]]) as u32) << 16),
        _ => f16_at(w, o),
    }
}

/// `_mm512_reduce_add_ps`'s tree: halves, then quarters, then pairs.
#[inline(always)]
pub(crate) fn reduce16(a: &[f32; 16]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|i| a[i] + a[i + 8]);
    let s4: [f32; 4] = std::array::from_fn(|i| s8[i] + s8[i + 4]);
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// One float row · activations, in one order that every ISA path reproduces bit for bit:
/// - F32: llama.cpp's x86 AVX-512 order (`ggml_vec_dot_f32`), which the reference outputs
///   are sensitive to (an F32 router's last bits pick the experts of the random-weight MoE
///   fixtures): 4 × 16 lanes over 64-element steps, combined `(a0 + a2) + (a1 + a3)`, then
///   [`reduce16`] (the tree of `_mm512_reduce_add_ps`); the remainder added with f32 FMAs.
///   llama.cpp only takes llamafile `tinyBLAS` for batches of two or more tokens
///   (`llamafile_sgemm` refuses `n < 2`), so every single-token decode step of the reference
///   runs `ggml_vec_dot_*`; a batch-invariant engine follows that order.
/// - F16: 16 lanes, lane `l` a chain of fused steps over the columns `≡ l mod 16` in order,
///   up to the last whole 64; the lanes summed by [`reduce16`]; the remainder added in f64.
///   llama.cpp's AVX-512 `ggml_vec_dot_f16` runs F32's 64 lanes, and so did this engine;
///   16 make each chain four times longer, so a prefill pass of the AVX2 kernels (one lane of
///   16 rows × 6 tokens in registers) runs four times the steps for the same setup and
///   combining. The rows differ from llama.cpp's in the last bits, as its own prompt rows
///   (tinyBLAS) differ from its decode rows; the F16 fixtures stay within the teacher-forcing
///   tolerance.
/// - BF16 (`ggml_vec_dot_bf16`, `vdpbf16ps`): two 16-lane accumulators for the halves of each
///   64-element step, lane `p` taking the odd then the even element of pair `p`; the two
///   [`reduce16`] sums and the remainder added in f64.
pub(crate) fn float_row(kind: u8, n: usize, w: impl Fn(usize) -> f32, x: &[f32]) -> f32 {
    match kind {
        FLOAT_F32 | FLOAT_F16 => {
            let np = n / 64 * 64;
            let v: [f32; 16] = if kind == FLOAT_F32 {
                let mut a = [[0f32; 16]; 4];
                for (e, &xe) in x.iter().enumerate().take(np) {
                    let (g, l) = ((e % 64) / 16, e % 16);
                    a[g][l] = w(e).mul_add(xe, a[g][l]);
                }
                std::array::from_fn(|i| (a[0][i] + a[2][i]) + (a[1][i] + a[3][i]))
            } else {
                let mut v = [0f32; 16];
                for (e, &xe) in x.iter().enumerate().take(np) {
                    v[e % 16] = w(e).mul_add(xe, v[e % 16]);
                }
                v
            };
            if kind == FLOAT_F32 {
                // `ggml_vec_dot_f32` keeps its sum in f32 (the remainder contracted to FMAs).
                let mut s = reduce16(&v);
                for (e, &xe) in x.iter().enumerate().take(n).skip(np) {
                    s = w(e).mul_add(xe, s);
                }
                return s;
            }
            let mut s = reduce16(&v) as f64;
            for (e, &xe) in x.iter().enumerate().take(n).skip(np) {
                s += (w(e) * xe) as f64;
            }
            s as f32
        }
        _ => {
            let np = n / 64 * 64;
            let mut c = [[0f32; 16]; 2];
            for base in (0..np).step_by(64) {
                for (h, c) in c.iter_mut().enumerate() {
                    for (p, c) in c.iter_mut().enumerate() {
                        let e = base + 32 * h + 2 * p;
                        *c = w(e + 1).mul_add(x[e + 1], *c);
                        *c = w(e).mul_add(x[e], *c);
                    }
                }
            }
            let mut s = reduce16(&c[0]) as f64 + reduce16(&c[1]) as f64;
            for (e, &xe) in x.iter().enumerate().take(n).skip(np) {
                s += (w(e) * xe) as f64;
            }
            s as f32
        }
    }
}

pub(crate) const FLOAT_F32: u8 = 0;
pub(crate) const FLOAT_F16: u8 = 1;
pub(crate) const FLOAT_BF16: u8 = 2;

/// The `FLOAT_*` kind of a float weight type (F32 for any other).
pub(crate) const fn float_kind(dtype: GgmlType) -> u8 {
    match dtype {
        GgmlType::F16 => FLOAT_F16,
        GgmlType::BF16 => FLOAT_BF16,
        _ => FLOAT_F32,
    }
}

/// 16 rows × `nt` tokens of float weights, each row as [`float_row`].
fn float_group<const ES: usize>(
    kind: u8,
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let np = a.cols / 64 * 64;
    for j in 0..nt {
        let x = &a.f[(t0 + j) * a.cols..(t0 + j + 1) * a.cols];
        for r in 0..GROUP {
            let wr = |e: usize| {
                let at = float_column(kind, e, np) * GROUP + r;
                float_at::<ES>(w, at * ES, kind == FLOAT_BF16)
            };
            out[j * GROUP + r] = float_row(kind, a.cols, wr, x);
        }
    }
}

pub(crate) fn f32_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    float_group::<4>(FLOAT_F32, w, a, t0, nt, out)
}

pub(crate) fn f16_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    float_group::<2>(FLOAT_F16, w, a, t0, nt, out)
}

pub(crate) fn bf16_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    float_group::<2>(FLOAT_BF16, w, a, t0, nt, out)
}
