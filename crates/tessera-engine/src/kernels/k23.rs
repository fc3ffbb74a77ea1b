//! Q2_K and Q3_K: 256-value super-blocks of 16 sub-blocks of 16 with 2-bit codes (Q3_K: plus a
//! high bit from `hmask`) on Q8_K activations.
//!
//! GGML blocks: Q2_K (84 bytes) = 16 scale bytes (low nibble scale, high nibble min), 64 bytes of
//! codes, f16 `d`, f16 `dmin`; element `128n + 32s + l` is `(qs[32n + l] >> 2s) & 3`, of
//! sub-block `8n + 2s + l/16`, and decodes as `d·sc·q − dmin·m`. Q3_K (110 bytes) = 32 bytes of
//! `hmask`, the same 64 bytes of codes, 12 bytes packing 16 six-bit scales, f16 `d`; the element
//! is `q − 4` when bit `4n + s` of `hmask[l]` is clear (else `q`), times `d·(sc − 32)`.
//!
//! Interleaved layout per 16-row group and 256-column block: the 16 rows' `d` (and for Q2_K
//! `dmin`) as f16, the scales as `[sub-block][row]` bytes (Q2_K: unsigned scale, then mins;
//! Q3_K: signed `sc − 32`), then the code bytes in 16 runs of 64 (run `c`: bytes `4c..4c+4` of
//! each row), then for Q3_K the `hmask` bytes in 8 runs of 64 (run `c`: bytes `4c..4c+4`).
//! Q3_K's 3-bit code `u = q | 4·h` is unsigned; `Σ(u − 4)·y = Σ u·y − 4·Σy` with Q8_K's sums of
//! 16.
//!
//! Numerical contract (all instruction sets, bit for bit), llama.cpp's AVX2 `vec_dot` order
//! (the reference outputs are sensitive to it): 8 lanes per row; per block, for Q2_K first
//! `acc_L = fma(−dy·dmin, m_{2L}·bsum_{2L} + m_{2L+1}·bsum_{2L+1}, acc_L)`, then
//! `acc_L = fma(dy·d, lane_L, acc_L)` with lane `L` the exact integer sum of `sc·q·y` over the
//! elements with `(e % 32) / 4 == L`; the lanes summed as `hsum_float_8`.

use half::f16;

use super::matrix::GROUP;
use super::quant_acts::QuantizedActs;
use super::scalar::q8_0_lanes_sum;
use super::weight_buffer::WeightBuffer;

/// Layout of a type (`THREE`: Q3_K, else Q2_K).
pub(crate) const fn block_bytes(three: bool) -> usize {
    if three {
        110
    } else {
        84
    }
}
/// Offset of the `dmin` f16s (Q2_K).
pub(crate) const DMIN: usize = 2 * GROUP;
/// Offset of the scales `[sub-block][row]`.
pub(crate) const fn scales(three: bool) -> usize {
    if three {
        2 * GROUP
    } else {
        4 * GROUP
    }
}
/// Offset of the mins `[sub-block][row]` (Q2_K).
pub(crate) const MINS: usize = 4 * GROUP + 16 * GROUP;
/// Offset of the code runs.
pub(crate) const fn qs(three: bool) -> usize {
    if three {
        scales(true) + 16 * GROUP
    } else {
        MINS + 16 * GROUP
    }
}
/// Offset of the `hmask` runs (Q3_K).
pub(crate) const HMASK: usize = qs(true) + 1024;
/// Bytes of one interleaved 16-row block.
pub(crate) const fn x16(three: bool) -> usize {
    if three {
        HMASK + 512
    } else {
        qs(false) + 1024
    }
}

fn f16_at(b: &[u8], o: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32()
}

/// The 16 signed scales `sc − 32` of a Q3_K block (ggml's unpacking of its 12 bytes).
fn q3k_scales(b: &[u8]) -> [i8; 16] {
    let s = &b[96..108];
    let aux = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, tmp) = (aux(0), aux(1), aux(2));
    let (m1, m2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let words = [
        (a0 & m2) | ((tmp & m1) << 4),
        (a1 & m2) | (((tmp >> 2) & m1) << 4),
        ((a0 >> 4) & m2) | (((tmp >> 4) & m1) << 4),
        ((a1 >> 4) & m2) | (((tmp >> 6) & m1) << 4),
    ];
    std::array::from_fn(|j| (words[j / 4].to_le_bytes()[j % 4] as i8).wrapping_sub(32))
}

/// The signed value of element `e` of a GGML block's codes (`hm`: Q3_K's hmask, or empty).
fn code(qs: &[u8], hm: &[u8], e: usize) -> i32 {
    let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
    let q = ((qs[32 * n + l] >> (2 * s)) & 3) as i32;
    if hm.is_empty() || hm[l] & (1 << (4 * n + s)) != 0 {
        q
    } else {
        q - 4
    }
}

/// Decodes one GGML block into 256 floats (ggml's `dequantize_row_q2_K` / `_q3_K`).
pub(crate) fn dequantize_block(three: bool, b: &[u8], y: &mut [f32]) {
    if three {
        let d = f16_at(b, 108);
        let sc = q3k_scales(b);
        for (e, y) in y.iter_mut().enumerate().take(256) {
            let j = sub_block(e);
            *y = d * sc[j] as f32 * code(&b[32..96], &b[..32], e) as f32;
        }
    } else {
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for (e, y) in y.iter_mut().enumerate().take(256) {
            let sc = b[sub_block(e)];
            let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
            *y = dl * code(&b[16..80], &[], e) as f32 - ml;
        }
    }
}

/// The sub-block (0..16) of element `e` of a block.
fn sub_block(e: usize) -> usize {
    let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
    8 * n + 2 * s + l / 16
}

/// Element `e` (0..256) of row `r` of an interleaved block, decoded as [`dequantize_block`].
pub(crate) fn x16_value(three: bool, blk: &[u8], r: usize, e: usize) -> f32 {
    let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
    let byte = 32 * n + l;
    let q = (blk[qs(three) + 64 * (byte / 4) + 4 * r + byte % 4] >> (2 * s)) & 3;
    let j = sub_block(e);
    let d = f16_at(blk, 2 * r);
    if three {
        let h = blk[HMASK + 64 * (l / 4) + 4 * r + l % 4] & (1 << (4 * n + s)) != 0;
        let v = q as i32 - if h { 0 } else { 4 };
        d * blk[scales(true) + GROUP * j + r] as i8 as f32 * v as f32
    } else {
        let sc = blk[scales(false) + GROUP * j + r];
        let m = blk[MINS + GROUP * j + r];
        let (dl, ml) = (d * sc as f32, f16_at(blk, DMIN + 2 * r) * m as f32);
        dl * q as f32 - ml
    }
}

/// Repacks GGML rows into the interleaved layout (padding rows stay zero).
pub(crate) fn interleave(
    three: bool,
    src: &[u8],
    rows: usize,
    cols: usize,
    buf: WeightBuffer,
) -> WeightBuffer {
    let (bb, x16, qs) = (block_bytes(three), x16(three), qs(three));
    let nb = cols / 256;
    let row_bytes = nb * bb;
    let groups = rows.div_ceil(GROUP);
    let mut buf = buf.zeroed(groups * nb * x16);
    for (g, gdst) in buf.chunks_exact_mut(nb * x16).enumerate() {
        for r in 0..GROUP.min(rows - g * GROUP) {
            let row = &src[(g * GROUP + r) * row_bytes..(g * GROUP + r + 1) * row_bytes];
            for (b, dst) in gdst.chunks_exact_mut(x16).enumerate() {
                let s = &row[b * bb..(b + 1) * bb];
                let (codes, d_at) = if three {
                    (&s[32..96], 108)
                } else {
                    (&s[16..80], 80)
                };
                dst[2 * r..2 * r + 2].copy_from_slice(&s[d_at..d_at + 2]);
                if three {
                    for (j, sc) in q3k_scales(s).into_iter().enumerate() {
                        dst[scales(true) + GROUP * j + r] = sc as u8;
                    }
                    for c in 0..8 {
                        let o = HMASK + 64 * c + 4 * r;
                        dst[o..o + 4].copy_from_slice(&s[4 * c..4 * c + 4]);
                    }
                } else {
                    dst[DMIN + 2 * r..DMIN + 2 * r + 2].copy_from_slice(&s[82..84]);
                    for j in 0..16 {
                        dst[scales(false) + GROUP * j + r] = s[j] & 0xF;
                        dst[MINS + GROUP * j + r] = s[j] >> 4;
                    }
                }
                for c in 0..16 {
                    let o = qs + 64 * c + 4 * r;
                    dst[o..o + 4].copy_from_slice(&codes[4 * c..4 * c + 4]);
                }
            }
        }
    }
    buf
}

/// 16 rows × `nt` tokens of an interleaved group; `out[j*16 + r]` (the contract above).
pub(crate) fn k23_group<const THREE: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let nb = a.cols / 256;
    let (x16, qs, sc_at) = (x16(THREE), qs(THREE), scales(THREE));
    for j in 0..nt {
        let tok = t0 + j;
        let mut acc = [[0f32; 8]; GROUP];
        for b in 0..nb {
            let blk = &w[b * x16..(b + 1) * x16];
            let y = &a.qs[tok * a.cols + b * 256..][..256];
            let bsums = &a.bsums[(tok * a.cols + b * 256) / 16..][..16];
            let dy = a.f[tok * nb + b];
            for (r, acc) in acc.iter_mut().enumerate() {
                if !THREE {
                    // Q2_K's mins first: lane L takes sub-blocks 2L and 2L + 1.
                    let dmin = -dy * f16_at(blk, DMIN + 2 * r);
                    for (l, acc) in acc.iter_mut().enumerate() {
                        let m = |sub: usize| blk[MINS + GROUP * sub + r] as i32 * bsums[sub] as i32;
                        *acc = dmin.mul_add((m(2 * l) + m(2 * l + 1)) as f32, *acc);
                    }
                }
                let mut lanes = [0i32; 8];
                for n in 0..2 {
                    for s in 0..4 {
                        for h in 0..2 {
                            let sub = 8 * n + 2 * s + h;
                            let sc = if THREE {
                                blk[sc_at + GROUP * sub + r] as i8 as i32
                            } else {
                                blk[sc_at + GROUP * sub + r] as i32
                            };
                            for cc in 0..4 {
                                let mut dot = 0i32;
                                for i in 0..4 {
                                    let l = 16 * h + 4 * cc + i;
                                    let byte = 32 * n + l;
                                    let o = qs + 64 * (byte / 4) + 4 * r + byte % 4;
                                    let mut u = ((blk[o] >> (2 * s)) & 3) as i32;
                                    if THREE {
                                        let hm = blk[HMASK + 64 * (l / 4) + 4 * r + l % 4];
                                        u |= (((hm >> (4 * n + s)) & 1) as i32) << 2;
                                        u -= 4;
                                    }
                                    dot += u * y[128 * n + 32 * s + l] as i32;
                                }
                                lanes[4 * h + cc] += sc * dot;
                            }
                        }
                    }
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
