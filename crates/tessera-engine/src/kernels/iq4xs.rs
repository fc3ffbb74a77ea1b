//! IQ4_XS: IQ4_NL's grid in 256-value super-blocks (136 bytes: f16 `d`, 6-bit scales of the 8
//! sub-blocks of 32 split into `scales_h` (u16) and `scales_l` (4 bytes), then 128 bytes of
//! codes, each sub-block's 16 bytes holding elements 0..16 low and 16..32 high). Sub-block `s`
//! decodes as `d · (ls_s − 32) · KVALUES_IQ4NL[code]`; activations are Q8_K.
//!
//! Interleaved layout per 16-row group and 256-column block ([`X16`] bytes): the 16 rows' `d`
//! (f16), the signed scales `ls − 32` as `[sub-block][row]` i8, then per sub-block the 4 runs of
//! 64 bytes of `lut4.rs` (run `k`: code bytes `4k..4k+4` of each row).
//!
//! Numerical contract (all instruction sets, bit for bit), llama.cpp's AVX2 `vec_dot` order
//! (the reference outputs are sensitive to it): 8 lanes per row, lane `L` the exact integer sum
//! over the block of `(ls − 32)·table[q]·y` for the elements with `(e % 32) / 4 == L`, then
//! `acc_L = fma(d·dy, lane_L, acc_L)` per block and the lanes summed as `hsum_float_8`
//! (`scalar::q8_0_lanes_sum`).

use half::f16;

use super::lut4::KVALUES_IQ4NL;
use super::matrix::GROUP;
use super::quant_acts::QuantizedActs;
use super::scalar::q8_0_lanes_sum;
use super::weight_buffer::WeightBuffer;

pub(crate) const BLOCK_BYTES: usize = 136;
pub(crate) const SCALES: usize = 2 * GROUP;
pub(crate) const QS: usize = SCALES + 8 * GROUP;
pub(crate) const X16: usize = QS + 8 * 256;

/// The signed scales `ls − 32` of the 8 sub-blocks of a GGML block.
fn scales(b: &[u8]) -> [i8; 8] {
    let h = u16::from_le_bytes([b[2], b[3]]);
    std::array::from_fn(|ib| {
        let ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | ((((h >> (2 * ib)) & 3) as u8) << 4);
        ls as i8 - 32
    })
}

/// Decodes one GGML block into 256 floats (ggml's `dequantize_row_iq4_xs`).
pub(crate) fn dequantize_block(b: &[u8], y: &mut [f32]) {
    let d = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    for (ib, sc) in scales(b).into_iter().enumerate() {
        let dl = d * sc as f32;
        let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
        for j in 0..16 {
            y[32 * ib + j] = dl * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
            y[32 * ib + 16 + j] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
        }
    }
}

/// Element `e` (0..256) of row `r` of an interleaved block, decoded as [`dequantize_block`].
pub(crate) fn x16_value(blk: &[u8], r: usize, e: usize) -> f32 {
    let (s, j) = (e / 32, e % 16);
    let q = blk[QS + 256 * s + 64 * (j / 4) + 4 * r + j % 4];
    let code = if e % 32 < 16 { q & 0xF } else { q >> 4 };
    let d = f16::from_bits(u16::from_le_bytes([blk[2 * r], blk[2 * r + 1]])).to_f32();
    let dl = d * blk[SCALES + GROUP * s + r] as i8 as f32;
    dl * KVALUES_IQ4NL[code as usize] as f32
}

/// Repacks GGML rows into the interleaved layout (padding rows stay zero).
pub(crate) fn interleave(src: &[u8], rows: usize, cols: usize, buf: WeightBuffer) -> WeightBuffer {
    let nb = cols / 256;
    let row_bytes = nb * BLOCK_BYTES;
    let groups = rows.div_ceil(GROUP);
    let mut buf = buf.zeroed(groups * nb * X16);
    for (g, gdst) in buf.chunks_exact_mut(nb * X16).enumerate() {
        for r in 0..GROUP.min(rows - g * GROUP) {
            let row = &src[(g * GROUP + r) * row_bytes..(g * GROUP + r + 1) * row_bytes];
            for (b, dst) in gdst.chunks_exact_mut(X16).enumerate() {
                let s = &row[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                dst[2 * r..2 * r + 2].copy_from_slice(&s[..2]);
                for (ib, sc) in scales(s).into_iter().enumerate() {
                    dst[SCALES + GROUP * ib + r] = sc as u8;
                    for k in 0..4 {
                        let o = QS + 256 * ib + 64 * k + 4 * r;
                        let from = 8 + 16 * ib + 4 * k;
                        dst[o..o + 4].copy_from_slice(&s[from..from + 4]);
                    }
                }
            }
        }
    }
    buf
}

/// 16 rows × `nt` tokens of an interleaved IQ4_XS group; `out[j*16 + r]` (the contract above).
pub(crate) fn iq4xs_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 256;
    let t = &KVALUES_IQ4NL;
    for j in 0..nt {
        let tok = t0 + j;
        let mut acc = [[0f32; 8]; GROUP];
        for b in 0..nb {
            let blk = &w[b * X16..(b + 1) * X16];
            let y = &a.qs[tok * a.cols + b * 256..][..256];
            let dy = a.f[tok * nb + b];
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut lanes = [0i32; 8];
                for s in 0..8 {
                    let sc = blk[SCALES + GROUP * s + r] as i8 as i32;
                    for k in 0..4 {
                        let (mut lo, mut hi) = (0i32, 0i32);
                        for i in 0..4 {
                            let q = blk[QS + 256 * s + 64 * k + 4 * r + i];
                            lo += t[(q & 0xF) as usize] as i32 * y[32 * s + 4 * k + i] as i32;
                            hi += t[(q >> 4) as usize] as i32 * y[32 * s + 16 + 4 * k + i] as i32;
                        }
                        lanes[k] += sc * lo;
                        lanes[4 + k] += sc * hi;
                    }
                }
                let d = f16::from_bits(u16::from_le_bytes([blk[2 * r], blk[2 * r + 1]])).to_f32();
                let d = d * dy;
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
