//! 4-bit codes read through a 16-entry table, 32 per block with one scale: MXFP4 (OCP
//! microscaling FP4, gpt-oss's experts: an E8M0 power-of-two scale, 17 bytes) and IQ4_NL (a
//! non-linear grid, an f16 scale, 18 bytes). The scale comes first, then 16 bytes whose low
//! nibbles are elements 0..16 and high nibbles 16..32.
//!
//! As in ggml, MXFP4 codes decode to *doubled* integers ([`KVALUES_MXFP4`], −12..12) and its
//! scale to half of `2^(e−127)` ([`e8m0_half`]); IQ4_NL codes to [`KVALUES_IQ4NL`] (−127..113).
//! A block's dot product with Q8_0 activations is then an exact integer sum times one float.
//!
//! Interleaved layout (as Q4_0's, see `matrix.rs`): per 16-row group and 32-column block, the 16
//! rows' scales (1 or 2 bytes each), then 4 runs of 64 bytes, run `k` holding quant bytes
//! `4k..4k+4` of each row.
//!
//! Numerical contract (all instruction sets, bit for bit): per row and block the exact integer
//! sum `Σ table[q]·y`, then `acc = fma(scale·dy, isum, acc)` in block order — llama.cpp's scalar
//! order with one accumulator per row (its AVX2 `vec_dot` splits the blocks over two 8-lane
//! accumulators; the difference is in the last bits).

use half::f16;
use tessera_model::GgmlType;

use super::matrix::GROUP;
use super::quant_acts::QuantizedActs;
use super::weight_buffer::WeightBuffer;

/// Doubled E2M1 values (ggml's `kvalues_mxfp4`).
pub(crate) const KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
/// IQ4_NL's grid (ggml's `kvalues_iq4nl`).
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The table and scale width of a type; `NL` selects IQ4_NL (else MXFP4).
pub(crate) const fn table(nl: bool) -> &'static [i8; 16] {
    if nl {
        &KVALUES_IQ4NL
    } else {
        &KVALUES_MXFP4
    }
}

/// Bytes of one row's scale.
pub(crate) const fn scale_bytes(nl: bool) -> usize {
    if nl {
        2
    } else {
        1
    }
}

/// Bytes of one interleaved 16-row block.
pub(crate) const fn x16(nl: bool) -> usize {
    GROUP * (16 + scale_bytes(nl))
}

/// Offset of the quant runs in an interleaved block.
pub(crate) const fn qs(nl: bool) -> usize {
    GROUP * scale_bytes(nl)
}

pub(crate) fn is_nl(dtype: GgmlType) -> bool {
    dtype == GgmlType::Iq4Nl
}

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

/// The scale stored at `b[0..]` (one row's scale bytes).
#[inline(always)]
fn scale<const NL: bool>(b: &[u8]) -> f32 {
    if NL {
        f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    } else {
        e8m0_half(b[0])
    }
}

/// Decodes one GGML block into 32 floats.
pub(crate) fn dequantize_block(nl: bool, b: &[u8], y: &mut [f32]) {
    let (d, t, s) = if nl {
        (scale::<true>(b), table(true), 2)
    } else {
        (scale::<false>(b), table(false), 1)
    };
    for j in 0..16 {
        y[j] = t[(b[s + j] & 0xF) as usize] as f32 * d;
        y[j + 16] = t[(b[s + j] >> 4) as usize] as f32 * d;
    }
}

/// Element `e` (0..32) of row `r` of an interleaved block, decoded.
pub(crate) fn x16_value(nl: bool, blk: &[u8], r: usize, e: usize) -> f32 {
    let j = e % 16;
    let q = blk[qs(nl) + 64 * (j / 4) + 4 * r + j % 4];
    let code = if e < 16 { q & 0xF } else { q >> 4 };
    let sb = scale_bytes(nl);
    let d = if nl {
        scale::<true>(&blk[sb * r..])
    } else {
        scale::<false>(&blk[sb * r..])
    };
    table(nl)[code as usize] as f32 * d
}

/// Repacks GGML rows into the interleaved layout (padding rows stay zero).
pub(crate) fn interleave(
    nl: bool,
    src: &[u8],
    rows: usize,
    cols: usize,
    buf: WeightBuffer,
) -> WeightBuffer {
    let (sb, x16, qs) = (scale_bytes(nl), x16(nl), qs(nl));
    let bb = 16 + sb;
    let nb = cols / 32;
    let row_bytes = nb * bb;
    let groups = rows.div_ceil(GROUP);
    let mut buf = buf.zeroed(groups * nb * x16);
    for (g, gdst) in buf.chunks_exact_mut(nb * x16).enumerate() {
        for r in 0..GROUP.min(rows - g * GROUP) {
            let row = &src[(g * GROUP + r) * row_bytes..(g * GROUP + r + 1) * row_bytes];
            for (b, dst) in gdst.chunks_exact_mut(x16).enumerate() {
                let s = &row[b * bb..(b + 1) * bb];
                dst[sb * r..sb * (r + 1)].copy_from_slice(&s[..sb]);
                for k in 0..4 {
                    let o = qs + 64 * k + 4 * r;
                    dst[o..o + 4].copy_from_slice(&s[sb + 4 * k..sb + 4 * k + 4]);
                }
            }
        }
    }
    buf
}

/// 16 rows × `nt` tokens of an interleaved group; `out[j*16 + r]` (the contract above).
pub(crate) fn lut4_group<const NL: bool>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let nb = a.cols / 32;
    let (x16, qs, sb, t) = (x16(NL), qs(NL), scale_bytes(NL), table(NL));
    for j in 0..nt {
        let tok = t0 + j;
        let mut acc = [0f32; GROUP];
        for b in 0..nb {
            let blk = &w[b * x16..(b + 1) * x16];
            let y = &a.qs[tok * a.cols + b * 32..][..32];
            let dy = a.f[tok * nb + b];
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for k in 0..4 {
                    for i in 0..4 {
                        let q = blk[qs + 64 * k + 4 * r + i];
                        isum += t[(q & 0xF) as usize] as i32 * y[4 * k + i] as i32
                            + t[(q >> 4) as usize] as i32 * y[16 + 4 * k + i] as i32;
                    }
                }
                *acc = (scale::<NL>(&blk[sb * r..]) * dy).mul_add(isum as f32, *acc);
            }
        }
        out[j * GROUP..(j + 1) * GROUP].copy_from_slice(&acc);
    }
}
