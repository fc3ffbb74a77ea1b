//! MXFP4 (OCP microscaling FP4, gpt-oss's expert weights): blocks of 32 E2M1 values sharing an
//! E8M0 power-of-two scale, 17 bytes (`e`, then 16 bytes whose low nibbles are elements 0..16
//! and high nibbles 16..32).
//!
//! As in ggml, the E2M1 codes decode to *doubled* integers ([`KVALUES`], −12..12) and the scale
//! to half of `2^(e−127)` ([`e8m0_half`]), so a block's dot product with Q8_0 activations is an
//! exact integer sum times one float scale.
//!
//! Interleaved layout (as Q4_0's, see `matrix.rs`): per 16-row group and 32-column block, the 16
//! rows' `e` bytes, then 4 runs of 64 bytes, run `k` holding quant bytes `4k..4k+4` of each row.
//!
//! Numerical contract (all instruction sets, bit for bit): per row and block the exact integer
//! sum `Σ KVALUES[q]·y`, then `acc = fma(e8m0_half(e)·dy, isum, acc)` in block order — the order
//! of llama.cpp's scalar path, one accumulator per row (its AVX2 `vec_dot` splits blocks over
//! two 8-lane accumulators; the difference is in the last bits).

use super::matrix::GROUP;
use super::quant_acts::QuantizedActs;

/// Doubled E2M1 values (ggml's `kvalues_mxfp4`).
pub(crate) const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Bytes of one interleaved 16-row block.
pub(crate) const X16: usize = GROUP * 17;
/// Offset of the quant runs in an interleaved block.
pub(crate) const QS: usize = GROUP;

/// Half the E8M0 scale `2^(e−127)` as an f32 (ggml's `ggml_e8m0_to_fp32_half`, subnormals for
/// `e < 2` included).
#[inline(always)]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// Decodes one GGML MXFP4 block (17 bytes) into 32 floats.
pub(crate) fn dequantize_block(b: &[u8], y: &mut [f32]) {
    let d = e8m0_half(b[0]);
    for j in 0..16 {
        y[j] = KVALUES[(b[1 + j] & 0xF) as usize] as f32 * d;
        y[j + 16] = KVALUES[(b[1 + j] >> 4) as usize] as f32 * d;
    }
}

/// Element `e` (0..32) of row `r` of an interleaved block, decoded.
pub(crate) fn x16_value(blk: &[u8], r: usize, e: usize) -> f32 {
    let j = e % 16;
    let q = blk[QS + 64 * (j / 4) + 4 * r + j % 4];
    let code = if e < 16 { q & 0xF } else { q >> 4 };
    KVALUES[code as usize] as f32 * e8m0_half(blk[r])
}

/// Repacks GGML MXFP4 rows into the interleaved layout (padding rows stay zero).
pub(crate) fn interleave(src: &[u8], rows: usize, cols: usize, mut buf: Vec<u8>) -> Vec<u8> {
    let nb = cols / 32;
    let row_bytes = nb * 17;
    let groups = rows.div_ceil(GROUP);
    buf.clear();
    buf.resize(groups * nb * X16, 0);
    for (g, gdst) in buf.chunks_exact_mut(nb * X16).enumerate() {
        for r in 0..GROUP.min(rows - g * GROUP) {
            let row = &src[(g * GROUP + r) * row_bytes..(g * GROUP + r + 1) * row_bytes];
            for (b, dst) in gdst.chunks_exact_mut(X16).enumerate() {
                let s = &row[b * 17..(b + 1) * 17];
                dst[r] = s[0];
                for k in 0..4 {
                    let o = QS + 64 * k + 4 * r;
                    dst[o..o + 4].copy_from_slice(&s[1 + 4 * k..5 + 4 * k]);
                }
            }
        }
    }
    buf
}

/// 16 rows × `nt` tokens of an interleaved MXFP4 group; `out[j*16 + r]` (the contract above).
pub(crate) fn mxfp4_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 32;
    for j in 0..nt {
        let t = t0 + j;
        let mut acc = [0f32; GROUP];
        for b in 0..nb {
            let blk = &w[b * X16..(b + 1) * X16];
            let y = &a.qs[t * a.cols + b * 32..][..32];
            let dy = a.f[t * nb + b];
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for k in 0..4 {
                    for i in 0..4 {
                        let q = blk[QS + 64 * k + 4 * r + i];
                        isum += KVALUES[(q & 0xF) as usize] as i32 * y[4 * k + i] as i32
                            + KVALUES[(q >> 4) as usize] as i32 * y[16 + 4 * k + i] as i32;
                    }
                }
                *acc = (e8m0_half(blk[r]) * dy).mul_add(isum as f32, *acc);
            }
        }
        out[j * GROUP..(j + 1) * GROUP].copy_from_slice(&acc);
    }
}
