//! IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S: 256-value super-blocks whose weights are
//! magnitudes from a lattice codebook (`iq_grids/`; one index per 8 weights for IQ2, per 4 for
//! IQ3), a sign per weight and 4-bit scales `ls`, on Q8_K activations.
//!
//! GGML blocks (f16 `d` first in each):
//! - IQ2_XXS (66 bytes): per 32 values 8 bytes: 4 grid indices, then a u32 of 4 × 7 sign bits
//!   and `ls` in its top 4 bits; a 7-bit sign field gets its 8th bit from parity (an even number
//!   of minus signs per 8). Value = `d·(0.5 + ls)·0.25 · grid · ±1`.
//! - IQ2_XS (74): 32 u16 (9-bit index, 7 sign bits), then 8 scale bytes (low nibble for the
//!   first 16 values of a 32, high for the second 16); same value formula.
//! - IQ2_S (82): 32 low index bytes, 32 sign bytes, 8 `qh` bytes (2 high index bits per index),
//!   8 scale bytes as IQ2_XS.
//! - IQ3_XXS (98): 64 index bytes, then per 32 values a u32 of 4 × 7 sign bits and `ls`.
//!   Value = `d·(0.5 + ls)·0.5 · grid · ±1`.
//! - IQ3_S (110): 64 low index bytes, 8 `qh` bytes (bit `j` of byte `s`: 9th bit of index
//!   `8s + j`), 32 sign bytes, 4 scale bytes (a nibble per 32). Value = `d·(1 + 2ls) · grid · ±1`.
//!
//! Every type is decoded at load into one interleaved layout per 16-row group and 256-column
//! block ([`Layout`]): the 16 rows' `d` (f16), the integer scale multipliers `2ls + 1` as
//! `[scale][row]` bytes, the signs as one u64 per 4-value chunk `c` whose bit `4r + i` is the
//! sign of element `4c + i` of row `r` (an AVX-512 byte mask as it is), the low 8 bits of the
//! grid indices as `[index][row]` bytes, then the high index bits packed as in IQ2_S / IQ3_S
//! (`hb` bits per index) as `[byte][row]`. It holds the same information as the GGML bytes in
//! about as many (the 7-bit sign fields are stored with their parity bit).
//!
//! Numerical contract (all instruction sets, bit for bit), llama.cpp's AVX2 `vec_dot` order
//! (the only x86 path these types have there; its batched path is the same `vec_dot`): 8 lanes
//! per row, lane `L` the exact integer sum over the block of `(2ls + 1)·grid·±y` for the elements
//! with `(e % 32) / 4 == L`, then `acc_L = fma(d·dy, lane_L, acc_L)` per block, the lanes summed
//! as `hsum_float_8` (`scalar::q8_0_lanes_sum`), times the type's constant (0.125 for IQ2,
//! 0.25 for IQ3_XXS, 1 for IQ3_S). Q8_K quants lie in −127..=127, so negating one is exact.

use half::f16;
use tessera_model::GgmlType;

use super::iq_grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
use super::matrix::GROUP;
use super::quant_acts::QuantizedActs;
use super::scalar::q8_0_lanes_sum;
use super::weight_buffer::WeightBuffer;

/// Const-generic ids of the types (their GGML type ids).
pub(crate) const IQ2_XXS: u8 = 16;
pub(crate) const IQ2_XS: u8 = 17;
pub(crate) const IQ3_XXS: u8 = 18;
pub(crate) const IQ3_S: u8 = 21;
pub(crate) const IQ2_S: u8 = 22;

/// The shape of a type's codes and of its interleaved block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    id: u8,
    /// Weights per grid index (8 for IQ2, 4 for IQ3).
    pub(crate) per_index: usize,
    /// Index bits above the low 8.
    pub(crate) high_bits: usize,
    /// Scales per block (8: one per 32 values; 16: one per 16).
    pub(crate) n_scales: usize,
    /// What the lane sums are multiplied by at the end.
    pub(crate) factor: f32,
}

impl Layout {
    pub(crate) const fn of(id: u8) -> Self {
        let (per_index, high_bits, n_scales, factor) = match id {
            IQ2_XXS => (8, 0, 8, 0.125),
            IQ2_XS => (8, 1, 16, 0.125),
            IQ2_S => (8, 2, 16, 0.125),
            IQ3_XXS => (4, 0, 8, 0.25),
            IQ3_S => (4, 1, 8, 1.0),
            _ => panic!("not an IQ2/IQ3 type id"),
        };
        Self {
            id,
            per_index,
            high_bits,
            n_scales,
            factor,
        }
    }

    pub(crate) fn for_dtype(dtype: GgmlType) -> Self {
        Self::of(dtype.id() as u8)
    }

    /// Grid indices per block.
    pub(crate) const fn n_index(self) -> usize {
        256 / self.per_index
    }
    /// Offset of the scale multipliers `[scale][row]`.
    pub(crate) const fn scales(self) -> usize {
        2 * GROUP
    }
    /// Offset of the sign masks (a u64 per 4-value chunk, bit `4·row + i`).
    pub(crate) const fn signs(self) -> usize {
        self.scales() + GROUP * self.n_scales
    }
    /// Offset of the low index bytes `[index][row]`.
    pub(crate) const fn index(self) -> usize {
        self.signs() + GROUP * 32
    }
    /// Offset of the packed high index bits `[byte][row]`.
    pub(crate) const fn high(self) -> usize {
        self.index() + GROUP * self.n_index()
    }
    /// Bytes of one interleaved 16-row block.
    pub(crate) const fn x16(self) -> usize {
        self.high() + GROUP * self.n_index() * self.high_bits / 8
    }
    /// GGML bytes of one block.
    pub(crate) const fn block_bytes(self) -> usize {
        match self.id {
            IQ2_XXS => 66,
            IQ2_XS => 74,
            IQ2_S => 82,
            IQ3_XXS => 98,
            _ => 110,
        }
    }

    /// The grid entry of index `i` (IQ3: 4 bytes in the low half).
    pub(crate) fn grid(self, i: usize) -> u64 {
        match self.id {
            IQ2_XXS => IQ2XXS_GRID[i],
            IQ2_XS => IQ2XS_GRID[i],
            IQ2_S => IQ2S_GRID[i],
            IQ3_XXS => IQ3XXS_GRID[i] as u64,
            _ => IQ3S_GRID[i] as u64,
        }
    }

    /// The grid's first byte (for SIMD gathers of its 32-bit words).
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn grid_ptr(self) -> *const u8 {
        match self.id {
            IQ2_XXS => IQ2XXS_GRID.as_ptr() as *const u8,
            IQ2_XS => IQ2XS_GRID.as_ptr() as *const u8,
            IQ2_S => IQ2S_GRID.as_ptr() as *const u8,
            IQ3_XXS => IQ3XXS_GRID.as_ptr() as *const u8,
            _ => IQ3S_GRID.as_ptr() as *const u8,
        }
    }

    /// The sub-block scale of a 4-bit `ls`, computed as ggml's dequantization does.
    fn db(self, d: f32, ls: u8) -> f32 {
        match self.id {
            IQ3_S => d * (1 + 2 * ls as i32) as f32,
            IQ3_XXS => d * (0.5 + ls as f32) * 0.5,
            _ => d * (0.5 + ls as f32) * 0.25,
        }
    }

    /// The scale (0..n_scales) of element `e`.
    const fn scale_of(self, e: usize) -> usize {
        e * self.n_scales / 256
    }
}

/// A 7-bit sign field with its parity bit (the format keeps an even number of minus signs per
/// 8 weights; ggml tabulates this as `ksigns_iq2xs`).
fn full_signs(s7: u32) -> u8 {
    let s = (s7 & 127) as u8;
    s | (((s.count_ones() & 1) as u8) << 7)
}

/// One GGML block in a common form: `d`'s bits, grid indices, sign masks per 8 values, `ls`.
struct Decoded {
    d: [u8; 2],
    index: [u16; 64],
    signs: [u8; 32],
    ls: [u8; 16],
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn decode(lay: Layout, b: &[u8]) -> Decoded {
    let mut x = Decoded {
        d: [b[0], b[1]],
        index: [0; 64],
        signs: [0; 32],
        ls: [0; 16],
    };
    match lay.id {
        IQ2_XXS => {
            for s in 0..8 {
                let (a0, a1) = (u32_at(b, 2 + 8 * s), u32_at(b, 6 + 8 * s));
                for l in 0..4 {
                    x.index[4 * s + l] = ((a0 >> (8 * l)) & 0xFF) as u16;
                    x.signs[4 * s + l] = full_signs(a1 >> (7 * l));
                }
                x.ls[s] = (a1 >> 28) as u8;
            }
        }
        IQ2_XS => {
            for j in 0..32 {
                let q = u16::from_le_bytes([b[2 + 2 * j], b[3 + 2 * j]]);
                x.index[j] = q & 511;
                x.signs[j] = full_signs((q >> 9) as u32);
            }
            for s in 0..8 {
                x.ls[2 * s] = b[66 + s] & 0xF;
                x.ls[2 * s + 1] = b[66 + s] >> 4;
            }
        }
        IQ2_S => {
            for j in 0..32 {
                let hi = (b[66 + j / 4] >> (2 * (j % 4))) & 3;
                x.index[j] = b[2 + j] as u16 | (hi as u16) << 8;
                x.signs[j] = b[34 + j];
            }
            for s in 0..8 {
                x.ls[2 * s] = b[74 + s] & 0xF;
                x.ls[2 * s + 1] = b[74 + s] >> 4;
            }
        }
        IQ3_XXS => {
            for g in 0..64 {
                x.index[g] = b[2 + g] as u16;
            }
            for s in 0..8 {
                let a = u32_at(b, 66 + 4 * s);
                for l in 0..4 {
                    x.signs[4 * s + l] = full_signs(a >> (7 * l));
                }
                x.ls[s] = (a >> 28) as u8;
            }
        }
        _ => {
            for g in 0..64 {
                let hi = (b[66 + g / 8] >> (g % 8)) & 1;
                x.index[g] = b[2 + g] as u16 | (hi as u16) << 8;
            }
            x.signs.copy_from_slice(&b[74..106]);
            for s in 0..8 {
                x.ls[s] = (b[106 + s / 2] >> (4 * (s % 2))) & 0xF;
            }
        }
    }
    x
}

/// The weight of element `e` from its parts (ggml's float steps: `db · grid · ±1`).
fn value(lay: Layout, d: f32, ls: u8, index: usize, signs: u8, e: usize) -> f32 {
    let g = (lay.grid(index) >> (8 * (e % lay.per_index))) as u8;
    let sign = if signs & (1 << (e % 8)) != 0 {
        -1.0
    } else {
        1.0
    };
    lay.db(d, ls) * g as f32 * sign
}

fn f16_at(b: &[u8], o: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32()
}

/// Decodes one GGML block into 256 floats (ggml's `dequantize_row_iq2_xxs` etc.).
pub(crate) fn dequantize_block(dtype: GgmlType, b: &[u8], y: &mut [f32]) {
    let lay = Layout::for_dtype(dtype);
    let x = decode(lay, b);
    let d = f16::from_bits(u16::from_le_bytes(x.d)).to_f32();
    for (e, y) in y.iter_mut().enumerate().take(256) {
        let (ls, index) = (x.ls[lay.scale_of(e)], x.index[e / lay.per_index]);
        *y = value(lay, d, ls, index as usize, x.signs[e / 8], e);
    }
}

/// The sign mask of chunk `c` (elements `4c..4c + 4`) of an interleaved block: bit `4r + i`.
#[inline]
fn chunk_signs(lay: Layout, blk: &[u8], c: usize) -> u64 {
    let o = lay.signs() + 8 * c;
    u64::from_le_bytes(blk[o..o + 8].try_into().expect("8 bytes"))
}

/// Grid index `g` of row `r` of an interleaved block.
#[inline]
fn x16_index(lay: Layout, blk: &[u8], r: usize, g: usize) -> usize {
    let lo = blk[lay.index() + GROUP * g + r] as usize;
    if lay.high_bits == 0 {
        return lo;
    }
    let bit = g * lay.high_bits;
    let byte = blk[lay.high() + GROUP * (bit / 8) + r] as usize;
    lo | ((byte >> (bit % 8)) & ((1 << lay.high_bits) - 1)) << 8
}

/// Element `e` (0..256) of row `r` of an interleaved block, decoded as [`dequantize_block`].
pub(crate) fn x16_value(dtype: GgmlType, blk: &[u8], r: usize, e: usize) -> f32 {
    let lay = Layout::for_dtype(dtype);
    let m = blk[lay.scales() + GROUP * lay.scale_of(e) + r];
    let index = x16_index(lay, blk, r, e / lay.per_index);
    let neg = (chunk_signs(lay, blk, e / 4) >> (4 * r + e % 4)) & 1;
    // `value` takes the signs of the 8-value group; only element e's bit matters.
    let signs = (neg as u8) << (e % 8);
    // m = 2·ls + 1.
    value(lay, f16_at(blk, 2 * r), m >> 1, index, signs, e)
}

/// Repacks GGML rows into the interleaved layout (padding rows stay zero).
pub(crate) fn interleave(
    dtype: GgmlType,
    src: &[u8],
    rows: usize,
    cols: usize,
    buf: WeightBuffer,
) -> WeightBuffer {
    let lay = Layout::for_dtype(dtype);
    let (bb, x16) = (lay.block_bytes(), lay.x16());
    let nb = cols / 256;
    let row_bytes = nb * bb;
    let groups = rows.div_ceil(GROUP);
    let mut buf = buf.zeroed(groups * nb * x16);
    for (g, gdst) in buf.chunks_exact_mut(nb * x16).enumerate() {
        for r in 0..GROUP.min(rows - g * GROUP) {
            let row = &src[(g * GROUP + r) * row_bytes..(g * GROUP + r + 1) * row_bytes];
            for (b, dst) in gdst.chunks_exact_mut(x16).enumerate() {
                let x = decode(lay, &row[b * bb..(b + 1) * bb]);
                dst[2 * r..2 * r + 2].copy_from_slice(&x.d);
                for s in 0..lay.n_scales {
                    dst[lay.scales() + GROUP * s + r] = 2 * x.ls[s] + 1;
                }
                for (k, &sb) in x.signs.iter().enumerate() {
                    // Elements 8k..8k+4 are chunk 2k, 8k+4..8k+8 chunk 2k + 1.
                    let at = |c: usize| lay.signs() + 8 * c + r / 2;
                    dst[at(2 * k)] |= (sb & 0xF) << (4 * (r % 2));
                    dst[at(2 * k + 1)] |= (sb >> 4) << (4 * (r % 2));
                }
                for i in 0..lay.n_index() {
                    dst[lay.index() + GROUP * i + r] = x.index[i] as u8;
                    if lay.high_bits > 0 {
                        let bit = i * lay.high_bits;
                        let hi = (x.index[i] >> 8) as u8;
                        dst[lay.high() + GROUP * (bit / 8) + r] |= hi << (bit % 8);
                    }
                }
            }
        }
    }
    buf
}

/// 16 rows × `nt` tokens of an interleaved group; `out[j*16 + r]` (the contract above).
pub(crate) fn iq23_group<const ID: u8>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let lay = Layout::of(ID);
    let nb = a.cols / 256;
    let x16 = lay.x16();
    for j in 0..nt {
        let tok = t0 + j;
        let mut acc = [[0f32; 8]; GROUP];
        for b in 0..nb {
            let blk = &w[b * x16..(b + 1) * x16];
            let y = &a.qs[tok * a.cols + b * 256..][..256];
            let dy = a.f[tok * nb + b];
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut lanes = [0i32; 8];
                // Chunk c: elements 4c..4c+4, all in lane c % 8.
                for c in 0..64 {
                    let e = 4 * c;
                    let grid = lay.grid(x16_index(lay, blk, r, e / lay.per_index));
                    let grid = (grid >> (8 * (e % lay.per_index))) as u32;
                    let signs = (chunk_signs(lay, blk, c) >> (4 * r)) as u8;
                    let mut dot = 0i32;
                    for i in 0..4 {
                        let g = ((grid >> (8 * i)) & 0xFF) as i32;
                        let yv = y[e + i] as i32;
                        dot += g * if signs & (1 << i) != 0 { -yv } else { yv };
                    }
                    let m = blk[lay.scales() + GROUP * lay.scale_of(e) + r] as i32;
                    lanes[c % 8] += m * dot;
                }
                let d = f16_at(blk, 2 * r) * dy;
                for (acc, &l) in acc.iter_mut().zip(&lanes) {
                    *acc = d.mul_add(l as f32, *acc);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            out[j * GROUP + r] = lay.factor * q8_0_lanes_sum(acc);
        }
    }
}
