//! Portable kernels and GGML block decoding.
//!
//! The dot kernels here define the arithmetic every SIMD path reproduces: integer block sums
//! are exact, and the float side is one `mul_add` per (row, token, block) in block order, so
//! the SIMD kernels give bit-identical results to these on any machine.

use half::{bf16, f16};
use tessera_model::GgmlType;

use super::matrix::{
    kx16_bytes, kx16_qs, q6k_x16_quant, GROUP, Q4K_DMIN, Q4K_MINS, Q4K_SCALES, Q5K_QH, Q6K_SCALES,
    Q6K_X16,
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
        GgmlType::F16 => y[0] = f16_at(b, 0),
        GgmlType::BF16 => y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        GgmlType::Q4_0 => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                y[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
                y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
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

/// 16 rows × `nt` tokens of a Q4_0 row group; `out[j*16 + r]`.
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

/// 16 rows × `nt` tokens of a Q8_0 row group; `out[j*16 + r]`.
pub(crate) fn q8_0_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 32;
    let stride = GROUP * 34;
    for j in 0..nt {
        let t = t0 + j;
        let mut acc = [0f32; GROUP];
        for b in 0..nb {
            let blk = &w[b * stride..(b + 1) * stride];
            let y = &a.qs[t * a.cols + b * 32..][..32];
            let dy = a.f[t * nb + b];
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for k in 0..8 {
                    for i in 0..4 {
                        let q = blk[2 * GROUP + 64 * k + 4 * r + i] as i8;
                        isum += q as i32 * y[4 * k + i] as i32;
                    }
                }
                *acc = (f16_at(blk, 2 * r) * dy).mul_add(isum as f32, *acc);
            }
        }
        out[j * GROUP..(j + 1) * GROUP].copy_from_slice(&acc);
    }
}

/// 16 rows × `nt` tokens of an interleaved Q4_K (`FIVE` = false) or Q5_K group;
/// `out[j*16 + r]`. Same integers and float updates as [`q4k_dot`] / [`q5k_dot`] on GGML rows.
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
        let mut acc = [0f32; GROUP];
        for b in 0..nb {
            let blk = &w[b * x16..(b + 1) * x16];
            let y = &a.qs[t * a.cols + b * 256..][..256];
            let bsums = &a.bsums[(t * a.cols + b * 256) / 16..][..16];
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for c in 0..4 {
                    let (mut s_lo, mut s_hi) = (0i32, 0i32);
                    for k in 0..8 {
                        for i in 0..4 {
                            let o = 64 * k + 4 * r + i;
                            let q = blk[qs + 512 * c + o];
                            let (mut lo, mut hi) = ((q & 0xF) as i32, (q >> 4) as i32);
                            if FIVE {
                                lo |= (((blk[Q5K_QH + o] >> (2 * c)) & 1) as i32) << 4;
                                hi |= (((blk[Q5K_QH + o] >> (2 * c + 1)) & 1) as i32) << 4;
                            }
                            s_lo += lo * y[64 * c + 4 * k + i] as i32;
                            s_hi += hi * y[64 * c + 32 + 4 * k + i] as i32;
                        }
                    }
                    isum += blk[Q4K_SCALES + 32 * c + r] as i32 * s_lo
                        + blk[Q4K_SCALES + 32 * c + 16 + r] as i32 * s_hi;
                }
                let msum: i32 = (0..8)
                    .map(|s| {
                        blk[Q4K_MINS + 16 * s + r] as i32
                            * (bsums[2 * s] as i32 + bsums[2 * s + 1] as i32)
                    })
                    .sum();
                *acc = k_update(
                    *acc,
                    f16_at(blk, 2 * r),
                    f16_at(blk, Q4K_DMIN + 2 * r),
                    a.f[t * nb + b],
                    isum,
                    msum,
                );
            }
        }
        out[j * GROUP..(j + 1) * GROUP].copy_from_slice(&acc);
    }
}

/// 16 rows × `nt` tokens of an interleaved Q6_K group; `out[j*16 + r]`. Same integers and
/// float updates as [`q6k_dot`] on the GGML row.
pub(crate) fn q6k_group(w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &mut [f32]) {
    let nb = a.cols / 256;
    for j in 0..nt {
        let t = t0 + j;
        let mut acc = [0f32; GROUP];
        for b in 0..nb {
            let blk = &w[b * Q6K_X16..(b + 1) * Q6K_X16];
            let y = &a.qs[t * a.cols + b * 256..][..256];
            for (r, acc) in acc.iter_mut().enumerate() {
                let isum: i32 = (0..256)
                    .map(|e| {
                        let sc = blk[Q6K_SCALES + 16 * (e / 16) + r] as i8 as i32;
                        sc * (q6k_x16_quant(blk, r, e) - 32) * y[e] as i32
                    })
                    .sum();
                *acc = (f16_at(blk, 2 * r) * a.f[t * nb + b]).mul_add(isum as f32, *acc);
            }
        }
        out[j * GROUP..(j + 1) * GROUP].copy_from_slice(&acc);
    }
}

// ---- K-quants, one GGML row at a time ----

/// Float update shared by all K-quant kernels: `acc += d*dy*isum - dmin*dy*msum`.
#[inline(always)]
pub(crate) fn k_update(acc: f32, d: f32, dmin: f32, dy: f32, isum: i32, msum: i32) -> f32 {
    let acc = (d * dy).mul_add(isum as f32, acc);
    (-(dmin * dy)).mul_add(msum as f32, acc)
}

/// Σ_j m_j × (sum of the 32 activation quants of sub-block j).
#[inline(always)]
#[cfg(test)]
pub(crate) fn k4_min_sum(mins: &[u8; 8], bsums: &[i16]) -> i32 {
    (0..8)
        .map(|j| mins[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32))
        .sum()
}

#[cfg(test)]
pub(crate) fn q4k_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    q45k_dot(row, a, t, false)
}

#[cfg(test)]
pub(crate) fn q5k_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    q45k_dot(row, a, t, true)
}

#[cfg(test)]
fn q45k_dot(row: &[u8], a: &QuantizedActs, t: usize, five: bool) -> f32 {
    let nb = a.cols / 256;
    let bb = if five { 176 } else { 144 };
    let mut acc = 0f32;
    for b in 0..nb {
        let blk = &row[b * bb..(b + 1) * bb];
        let y = &a.qs[t * a.cols + b * 256..][..256];
        let bsums = &a.bsums[(t * a.cols + b * 256) / 16..][..16];
        let (sc, mins) = scales_mins_k4(&blk[4..16]);
        let (qh, qs) = if five {
            (&blk[16..48], &blk[48..176])
        } else {
            (&blk[0..0], &blk[16..144])
        };
        let mut isum = 0i32;
        for c in 0..4 {
            let (mut s_lo, mut s_hi) = (0i32, 0i32);
            for l in 0..32 {
                let q = qs[32 * c + l];
                let (mut lo, mut hi) = ((q & 0xF) as i32, (q >> 4) as i32);
                if five {
                    lo += (((qh[l] >> (2 * c)) & 1) as i32) << 4;
                    hi += (((qh[l] >> (2 * c + 1)) & 1) as i32) << 4;
                }
                s_lo += lo * y[64 * c + l] as i32;
                s_hi += hi * y[64 * c + 32 + l] as i32;
            }
            isum += sc[2 * c] as i32 * s_lo + sc[2 * c + 1] as i32 * s_hi;
        }
        let msum = k4_min_sum(&mins, bsums);
        acc = k_update(
            acc,
            f16_at(blk, 0),
            f16_at(blk, 2),
            a.f[t * nb + b],
            isum,
            msum,
        );
    }
    acc
}

#[cfg(test)]
pub(crate) fn q6k_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    let nb = a.cols / 256;
    let mut acc = 0f32;
    for b in 0..nb {
        let blk = &row[b * 210..(b + 1) * 210];
        let y = &a.qs[t * a.cols + b * 256..][..256];
        let mut isum = 0i32;
        for n in 0..2 {
            let ql = &blk[64 * n..64 * n + 64];
            let qh = &blk[128 + 32 * n..128 + 32 * n + 32];
            let sc = &blk[192 + 8 * n..192 + 8 * n + 8];
            let mut s = [0i32; 8];
            for l in 0..32 {
                let q = q6k_quants(ql, qh, l);
                for (k, &qk) in q.iter().enumerate() {
                    s[2 * k + l / 16] += qk * y[128 * n + 32 * k + l] as i32;
                }
            }
            isum += (0..8).map(|i| (sc[i] as i8) as i32 * s[i]).sum::<i32>();
        }
        acc = (f16_at(blk, 208) * a.f[t * nb + b]).mul_add(isum as f32, acc);
    }
    acc
}

// ---- float weights ----

/// The canonical float dot: 32 lanes of `mul_add` over whole 32-element chunks, a fixed
/// reduction tree (the one the AVX2 kernel performs), then the tail in order.
#[inline(always)]
pub(crate) fn float_dot(n: usize, w: impl Fn(usize) -> f32, x: &[f32]) -> f32 {
    let n32 = n / 32 * 32;
    let mut acc = [0f32; 32];
    for i in (0..n32).step_by(32) {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = w(i + j).mul_add(x[i + j], *a);
        }
    }
    let mut r = reduce32(&acc);
    for (i, &xi) in x.iter().enumerate().take(n).skip(n32) {
        r = w(i).mul_add(xi, r);
    }
    r
}

#[inline(always)]
pub(crate) fn reduce32(acc: &[f32; 32]) -> f32 {
    let mut s = [0f32; 8];
    for j in 0..8 {
        s[j] = (acc[j] + acc[8 + j]) + (acc[16 + j] + acc[24 + j]);
    }
    let u: [f32; 4] = std::array::from_fn(|j| s[j] + s[j + 4]);
    let v0 = u[0] + u[2];
    let v1 = u[1] + u[3];
    v0 + v1
}

pub(crate) fn f32_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    let x = &a.f[t * a.cols..(t + 1) * a.cols];
    float_dot(
        a.cols,
        |i| f32::from_le_bytes(row[4 * i..4 * i + 4].try_into().unwrap()),
        x,
    )
}

pub(crate) fn f16_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    let x = &a.f[t * a.cols..(t + 1) * a.cols];
    float_dot(a.cols, |i| f16_at(row, 2 * i), x)
}

pub(crate) fn bf16_dot(row: &[u8], a: &QuantizedActs, t: usize) -> f32 {
    let x = &a.f[t * a.cols..(t + 1) * a.cols];
    float_dot(
        a.cols,
        |i| f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16),
        x,
    )
}
