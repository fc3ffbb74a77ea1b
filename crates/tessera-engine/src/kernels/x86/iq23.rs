//! AVX2 and AVX-512 kernels for interleaved IQ2/IQ3 groups (`kernels/iq23.rs` has the layout
//! and the numerical contract): one vector lane per row, each row's 4 grid bytes of a chunk
//! fetched by a gather, exact integer lane sums and the scalar kernel's float steps, hence
//! bit-identical results whatever the batch.
//!
//! One token (decode) applies the rows' signs to its broadcast activations. Several tokens
//! (prefill) decode the group's blocks once per call to 8-bit weights with their signs (64
//! chunks × 16 rows a block, 4 KiB, in a per-thread buffer; a call holds up to 64 tokens),
//! then run an 8-bit integer loop over the tokens: per chunk and token one `vpdpbusd` (AVX2:
//! sign, `maddubs`) and one multiply-add by the scale, each token's lane kept in a register
//! across the block's 8 sub-blocks.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::super::iq23::Layout;
use super::super::matrix::GROUP;
use super::super::quant_acts::QuantizedActs;

fn check_group(lay: Layout, w: &[u8], a: &QuantizedActs, t0: usize, nt: usize, out: &[f32]) {
    let nb = a.cols / 256;
    assert!(w.len() >= nb * lay.x16());
    assert!((t0 + nt) * a.cols <= a.qs.len() && (t0 + nt) * nb <= a.f.len());
    assert!(out.len() >= nt * GROUP);
}

/// The grid as 32-bit words (an IQ2 entry is two words: elements 0..4, then 4..8).
fn grid_words(lay: Layout) -> *const i32 {
    lay.grid_ptr() as *const i32
}

/// Byte shuffle spreading a broadcast u32 of 8 rows' 4 sign bits over 32 bytes: byte `j` takes
/// source byte `j / 8` (each 128-bit half holds all 4).
const SPREAD: [u8; 32] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
];
/// Each byte's own bit of the spread sign word (byte `j`: bit `j % 8`).
const BIT_OF_BYTE: [u8; 32] = [
    1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4,
    8, 16, 32, 64, 128,
];

/// Dword indices of two 16-dword vectors picking the even (then the odd) dwords of both.
const EVEN_ODD: [[u32; 16]; 2] = [
    [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30],
    [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31],
];

/// # Safety
/// Requires AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq23_group_avx2<const ID: u8>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let lay = Layout::of(ID);
    check_group(lay, w, a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        if nt == 1 {
            tile_avx2::<ID, 1>(w.as_ptr(), a, t0, out.as_mut_ptr());
            return;
        }
        multi_avx2::<ID>(w.as_ptr(), a, t0, nt, out.as_mut_ptr());
    }
}

thread_local! {
    /// The decoded blocks of the group a multi-token call works on (reused across calls).
    static DECODED_256: RefCell<Vec<__m256i>> = const { RefCell::new(Vec::new()) };
    static DECODED_512: RefCell<Vec<__m512i>> = const { RefCell::new(Vec::new()) };
}

/// Decoded vectors of one block, 8 rows (AVX2): 64 `|w|`, 64 signed, 16 scales.
const DEC256: usize = 144;
/// Decoded vectors of one block, 16 rows (AVX-512): 64 `w + 128`, 16 scales.
const DEC512: usize = 80;

/// What a pass over `K` tokens of one block reads (8 rows).
struct Block256<'a> {
    /// Chunk `c`'s grid bytes (`|w|`, 8 rows × 4).
    abs: &'a [__m256i; 64],
    /// Chunk `c`'s weights with their signs (`grid·±1`; only their signs are used).
    sgn: &'a [__m256i; 64],
    /// Per sub-block `s`, the scale multipliers of its first and second 16 values, as i16
    /// in both halves of each row's dword (madd: `m·(p0 + p1)`).
    m: &'a [__m256i; 16],
    /// Per token, `d · dy` of the 8 rows.
    d: &'a [__m256],
    /// Per token, its 256 activations of this block.
    y: &'a [*const i8],
}

/// Tokens `t..t + n` (`n >= 2`), 8 rows at a time: the rows' grid bytes of all 64 chunks of
/// every block are gathered once per call with their signs, then, 16 tokens at a time, each
/// token's chunk is one sign-applied broadcast, `maddubs` (exact: `2·62·127` fits i16) and one
/// `madd` by the scale: the same exact integer lanes as the one-token kernel, and its float
/// steps.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn multi_avx2<const ID: u8>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    n: usize,
    out: *mut f32,
) {
    let lay = Layout::of(ID);
    let nb = a.cols / 256;
    let x16 = lay.x16();
    let mut dec = DECODED_256.with(|c| c.take());
    // Every vector is written before it is read: grown, never cleared.
    if dec.len() < nb * DEC256 {
        dec.resize(nb * DEC256, _mm256_setzero_si256());
    }
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens
    // t..t + n.
    unsafe {
        let mut d = [_mm256_setzero_ps(); TILE];
        let mut y = [std::ptr::null::<i8>(); TILE];
        for h8 in 0..2 {
            for (b, dec) in dec[..nb * DEC256].chunks_exact_mut(DEC256).enumerate() {
                decode_avx2::<ID>(w, b * x16, h8, dec);
            }
            for j in (0..n).step_by(TILE) {
                let nn = TILE.min(n - j);
                let mut acc = [[_mm256_setzero_ps(); 8]; TILE];
                for (b, dec) in dec[..nb * DEC256].chunks_exact(DEC256).enumerate() {
                    let blk = b * x16;
                    let dw =
                        _mm256_cvtph_ps(_mm_loadu_si128(w.add(blk + 16 * h8) as *const __m128i));
                    for k in 0..nn {
                        let tk = t + j + k;
                        y[k] = a.qs.as_ptr().add(tk * a.cols + b * 256);
                        d[k] = _mm256_mul_ps(dw, _mm256_set1_ps(*a.f.get_unchecked(tk * nb + b)));
                    }
                    let blk = Block256 {
                        abs: dec[..64].try_into().expect("64"),
                        sgn: dec[64..128].try_into().expect("64"),
                        m: dec[128..].try_into().expect("16"),
                        d: &d,
                        y: &y,
                    };
                    let mut k = 0;
                    while k < nn {
                        k += match nn - k {
                            4.. => pass_avx2::<4>(&blk, k, &mut acc[k..]),
                            2.. => pass_avx2::<2>(&blk, k, &mut acc[k..]),
                            _ => pass_avx2::<1>(&blk, k, &mut acc[k..]),
                        };
                    }
                }
                for (k, acc) in acc.iter().enumerate().take(nn) {
                    let sum = lanes_sum!(_mm256_add_ps, acc);
                    let o = out.add((j + k) * GROUP + 8 * h8);
                    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_set1_ps(lay.factor), sum));
                }
            }
        }
    }
    DECODED_256.with(|c| c.replace(dec));
}

/// Rows `8·h8..8·h8 + 8` of the block at `blk`, decoded into `dec` ([`DEC256`] vectors): per
/// chunk the grid bytes, then the same with their signs, then the scale multipliers as i16 in
/// both halves of each row's dword.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_avx2<const ID: u8>(w: *const u8, blk: usize, h8: usize, dec: &mut [__m256i]) {
    let lay = Layout::of(ID);
    let grid = grid_words(lay);
    let high_mask = _mm256_set1_epi32((1 << lay.high_bits) - 1);
    let per_sub = 32 / lay.per_index;
    let (abs, rest) = dec.split_at_mut(64);
    let (sgn, m) = rest.split_at_mut(64);
    // SAFETY: the caller checked that w holds the block; grid indices are built from at most
    // the table's index bits.
    unsafe {
        let spread = _mm256_loadu_si256(SPREAD.as_ptr() as *const __m256i);
        let bits = _mm256_loadu_si256(BIT_OF_BYTE.as_ptr() as *const __m256i);
        let even_odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        let rows = |o: usize| _mm256_cvtepu8_epi32(_mm_loadl_epi64(w.add(o + 8 * h8) as _));
        let both = |v: __m256i| _mm256_or_si256(v, _mm256_slli_epi32::<16>(v));
        for s in 0..8 {
            m[2 * s] = both(rows(blk + lay.scales() + GROUP * (s * lay.n_scales / 8)));
            m[2 * s + 1] = if lay.n_scales == 16 {
                both(rows(blk + lay.scales() + GROUP * (2 * s + 1)))
            } else {
                m[2 * s]
            };
            for q in 0..per_sub {
                let g = s * per_sub + q;
                let mut idx = rows(blk + lay.index() + GROUP * g);
                if lay.high_bits > 0 {
                    let bit = g * lay.high_bits;
                    let hv = rows(blk + lay.high() + GROUP * (bit / 8));
                    let hv = _mm256_srlv_epi32(hv, _mm256_set1_epi32((bit % 8) as i32));
                    let hv = _mm256_slli_epi32::<8>(_mm256_and_si256(hv, high_mask));
                    idx = _mm256_or_si256(idx, hv);
                }
                let halves = if lay.per_index == 8 {
                    let g4 = |i: __m128i| {
                        let v = _mm256_i32gather_epi64::<8>(grid as _, i);
                        _mm256_permutevar8x32_epi32(v, even_odd)
                    };
                    let lo = g4(_mm256_castsi256_si128(idx));
                    let hi = g4(_mm256_extracti128_si256::<1>(idx));
                    [
                        _mm256_permute2x128_si256::<0x20>(lo, hi),
                        _mm256_permute2x128_si256::<0x31>(lo, hi),
                    ]
                } else {
                    [_mm256_i32gather_epi32::<4>(grid, idx), idx]
                };
                for (h, &wv) in halves.iter().enumerate().take(lay.per_index / 4) {
                    let c = 8 * s + q * (lay.per_index / 4) + h;
                    let sg =
                        (w.add(blk + lay.signs() + 8 * c + 4 * h8) as *const i32).read_unaligned();
                    let sg =
                        _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(sg), spread), bits);
                    let neg = _mm256_cmpeq_epi8(sg, bits);
                    abs[c] = wv;
                    sgn[c] = _mm256_sub_epi8(_mm256_xor_si256(wv, neg), neg);
                }
            }
        }
    }
}

/// Tokens `k0..k0 + K` of a block (8 rows): lane by lane, each token's lane in a register
/// across the 8 sub-blocks, then its float step.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pass_avx2<const K: usize>(
    blk: &Block256<'_>,
    k0: usize,
    acc: &mut [[__m256; 8]],
) -> usize {
    // SAFETY: each y pointer holds this block's 256 activations of its token.
    unsafe {
        for l in 0..8 {
            let mut lanes = [_mm256_setzero_si256(); K];
            for s in 0..8 {
                let c = 8 * s + l;
                let (wa, ws, m) = (blk.abs[c], blk.sgn[c], blk.m[2 * s + l / 4]);
                for (k, lane) in lanes.iter_mut().enumerate() {
                    let y = (blk.y[k0 + k].add(4 * c) as *const i32).read_unaligned();
                    let ys = _mm256_sign_epi8(_mm256_set1_epi32(y), ws);
                    let p = _mm256_maddubs_epi16(wa, ys);
                    *lane = _mm256_add_epi32(*lane, _mm256_madd_epi16(p, m));
                }
            }
            for (k, lane) in lanes.iter().enumerate() {
                let acc = &mut acc[k][l];
                *acc = _mm256_fmadd_ps(blk.d[k0 + k], _mm256_cvtepi32_ps(*lane), *acc);
            }
        }
    }
    K
}

/// `T` tokens sharing each gathered chunk (called with one: decode).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<const ID: u8, const T: usize>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    out: *mut f32,
) -> usize {
    let lay = Layout::of(ID);
    let nb = a.cols / 256;
    let x16 = lay.x16();
    let grid = grid_words(lay);
    let ones = _mm256_set1_epi16(1);
    let high_mask = _mm256_set1_epi32((1 << lay.high_bits) - 1);
    let per_sub = 32 / lay.per_index;
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold token t; grid
    // indices are built from at most the table's index bits.
    unsafe {
        let spread = _mm256_loadu_si256(SPREAD.as_ptr() as *const __m256i);
        let bits = _mm256_loadu_si256(BIT_OF_BYTE.as_ptr() as *const __m256i);
        // 4 rows' (low, high) dword pairs to the 4 lows, then the 4 highs.
        let even_odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        for h8 in 0..2 {
            let rows = |o: usize| _mm256_cvtepu8_epi32(_mm_loadl_epi64(w.add(o + 8 * h8) as _));
            let mut acc = [[_mm256_setzero_ps(); 8]; T];
            for b in 0..nb {
                let blk = b * x16;
                let y: [*const i8; T] =
                    std::array::from_fn(|k| a.qs.as_ptr().add((t + k) * a.cols + b * 256));
                let mut lanes = [[_mm256_setzero_si256(); 8]; T];
                for s in 0..8 {
                    // Scale multipliers as i16 in the low half of each lane (madd: m·dot).
                    let m0 = rows(blk + lay.scales() + GROUP * (s * lay.n_scales / 8));
                    let m1 = if lay.n_scales == 16 {
                        rows(blk + lay.scales() + GROUP * (2 * s + 1))
                    } else {
                        m0
                    };
                    for q in 0..per_sub {
                        let g = s * per_sub + q;
                        let mut idx = rows(blk + lay.index() + GROUP * g);
                        if lay.high_bits > 0 {
                            let bit = g * lay.high_bits;
                            let hv = rows(blk + lay.high() + GROUP * (bit / 8));
                            let hv = _mm256_srlv_epi32(hv, _mm256_set1_epi32((bit % 8) as i32));
                            let hv = _mm256_slli_epi32::<8>(_mm256_and_si256(hv, high_mask));
                            idx = _mm256_or_si256(idx, hv);
                        }
                        // IQ2: each row's whole 8-byte entry by two 4-row qword gathers, split
                        // into the chunks' 4-byte halves (half the loads of dword gathers).
                        let halves = if lay.per_index == 8 {
                            let g4 = |i: __m128i| {
                                let v = _mm256_i32gather_epi64::<8>(grid as _, i);
                                _mm256_permutevar8x32_epi32(v, even_odd)
                            };
                            let lo = g4(_mm256_castsi256_si128(idx));
                            let hi = g4(_mm256_extracti128_si256::<1>(idx));
                            [
                                _mm256_permute2x128_si256::<0x20>(lo, hi),
                                _mm256_permute2x128_si256::<0x31>(lo, hi),
                            ]
                        } else {
                            [_mm256_i32gather_epi32::<4>(grid, idx), idx]
                        };
                        for (h, &wv) in halves.iter().enumerate().take(lay.per_index / 4) {
                            let c = 8 * s + q * (lay.per_index / 4) + h;
                            let sg = (w.add(blk + lay.signs() + 8 * c + 4 * h8) as *const i32)
                                .read_unaligned();
                            let sg = _mm256_and_si256(
                                _mm256_shuffle_epi8(_mm256_set1_epi32(sg), spread),
                                bits,
                            );
                            let neg = _mm256_cmpeq_epi8(sg, bits);
                            let m = if c % 8 < 4 { m0 } else { m1 };
                            let l = c % 8;
                            for (y, lanes) in y.iter().zip(lanes.iter_mut()) {
                                let yv = _mm256_set1_epi32(
                                    (y.add(4 * c) as *const i32).read_unaligned(),
                                );
                                let ys = _mm256_sub_epi8(_mm256_xor_si256(yv, neg), neg);
                                let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, ys), ones);
                                lanes[l] = _mm256_add_epi32(lanes[l], _mm256_madd_epi16(dot, m));
                            }
                        }
                    }
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(w.add(blk + 16 * h8) as *const __m128i));
                for (k, (acc, lanes)) in acc.iter_mut().zip(&lanes).enumerate() {
                    let dy = *a.f.get_unchecked((t + k) * nb + b);
                    let d = _mm256_mul_ps(dw, _mm256_set1_ps(dy));
                    for (acc, l) in acc.iter_mut().zip(lanes) {
                        *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(*l), *acc);
                    }
                }
            }
            for (k, acc) in acc.iter().enumerate() {
                let sum = lanes_sum!(_mm256_add_ps, acc);
                let o = out.add(k * GROUP + 8 * h8);
                _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_set1_ps(lay.factor), sum));
            }
        }
    }
    T
}

/// Tokens whose accumulators a multi-token call keeps at once (its blocks are decoded once for
/// all its tokens).
const TILE: usize = 16;

/// # Safety
/// Requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn iq23_group_avx512<const ID: u8>(
    w: &[u8],
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let lay = Layout::of(ID);
    check_group(lay, w, a, t0, nt, out);
    // SAFETY: bounds checked above; features guaranteed by the caller.
    unsafe {
        if nt == 1 {
            token_avx512::<ID>(w.as_ptr(), a, t0, out.as_mut_ptr());
            return;
        }
        multi_avx512::<ID>(w.as_ptr(), a, t0, nt, out.as_mut_ptr());
    }
}

/// Gathers the 16 rows' grid bytes of grid indices `gs` of the block at `blk` into `wbuf`
/// (chunk `c`: the 4 bytes of each row, row-major).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gather_avx512<const ID: u8>(
    w: *const u8,
    blk: usize,
    gs: std::ops::Range<usize>,
    wbuf: &mut [__m512i; 64],
) {
    let lay = Layout::of(ID);
    let grid = grid_words(lay);
    let high_mask = _mm512_set1_epi32((1 << lay.high_bits) - 1);
    // SAFETY: the caller checked that w holds the block; grid indices are built from at most
    // the table's index bits.
    unsafe {
        let even = _mm512_loadu_si512(EVEN_ODD[0].as_ptr() as *const _);
        let odd = _mm512_loadu_si512(EVEN_ODD[1].as_ptr() as *const _);
        let rows = |o: usize| _mm512_cvtepu8_epi32(_mm_loadu_si128(w.add(o) as *const __m128i));
        for g in gs {
            let mut idx = rows(blk + lay.index() + GROUP * g);
            if lay.high_bits > 0 {
                let bit = g * lay.high_bits;
                let hv = rows(blk + lay.high() + GROUP * (bit / 8));
                let hv = _mm512_srlv_epi32(hv, _mm512_set1_epi32((bit % 8) as i32));
                let hv = _mm512_slli_epi32::<8>(_mm512_and_si512(hv, high_mask));
                idx = _mm512_or_si512(idx, hv);
            }
            if lay.per_index == 8 {
                // IQ2: each row's whole 8-byte entry by two 8-row qword gathers, split into
                // the two chunks' 4-byte halves (half the loads of dword gathers).
                let lo = _mm512_i32gather_epi64::<8>(_mm512_castsi512_si256(idx), grid as _);
                let hi =
                    _mm512_i32gather_epi64::<8>(_mm512_extracti64x4_epi64::<1>(idx), grid as _);
                wbuf[2 * g] = _mm512_permutex2var_epi32(lo, even, hi);
                wbuf[2 * g + 1] = _mm512_permutex2var_epi32(lo, odd, hi);
            } else {
                wbuf[g] = _mm512_i32gather_epi32::<4>(idx, grid);
            }
        }
    }
}

/// One token (decode): per chunk, the gathered grid bytes times the activations with the
/// rows' signs applied (a masked subtract), `vpdpbusd` then `vpdpwssd` by the scale.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn token_avx512<const ID: u8>(w: *const u8, a: &QuantizedActs, t: usize, out: *mut f32) {
    let lay = Layout::of(ID);
    let nb = a.cols / 256;
    let x16 = lay.x16();
    let zero = _mm512_setzero_si512();
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold token t.
    unsafe {
        let rows = |o: usize| _mm512_cvtepu8_epi32(_mm_loadu_si128(w.add(o) as *const __m128i));
        let mut acc = [_mm512_setzero_ps(); 8];
        let mut wbuf = [zero; 64];
        for b in 0..nb {
            let blk = b * x16;
            let y = a.qs.as_ptr().add(t * a.cols + b * 256);
            let mut lanes = [zero; 8];
            let per_sub = 32 / lay.per_index;
            for s in 0..8 {
                // Each sub-block's gathers just before its products (not all 64 chunks
                // first), so the core overlaps one sub-block's gathers with the previous
                // one's arithmetic.
                gather_avx512::<ID>(w, blk, s * per_sub..(s + 1) * per_sub, &mut wbuf);
                // Scale multipliers in the low i16 of each lane (vpdpwssd: m·dot).
                let m0 = rows(blk + lay.scales() + GROUP * (s * lay.n_scales / 8));
                let m1 = if lay.n_scales == 16 {
                    rows(blk + lay.scales() + GROUP * (2 * s + 1))
                } else {
                    m0
                };
                for (l, lane) in lanes.iter_mut().enumerate() {
                    let c = 8 * s + l;
                    let neg = (w.add(blk + lay.signs() + 8 * c) as *const u64).read_unaligned();
                    let yv = _mm512_set1_epi32((y.add(4 * c) as *const i32).read_unaligned());
                    let ys = _mm512_mask_sub_epi8(yv, neg, zero, yv);
                    // |dot| <= 4 * 62 * 127 fits the i16 vpdpwssd reads.
                    let dot = _mm512_dpbusd_epi32(zero, wbuf[c], ys);
                    *lane = _mm512_dpwssd_epi32(*lane, dot, if l < 4 { m0 } else { m1 });
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(w.add(blk) as *const __m256i));
            let d = _mm512_mul_ps(dw, _mm512_set1_ps(*a.f.get_unchecked(t * nb + b)));
            for (acc, l) in acc.iter_mut().zip(&lanes) {
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(*l), *acc);
            }
        }
        let sum = lanes_sum!(_mm512_add_ps, acc);
        _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_set1_ps(lay.factor), sum));
    }
}

/// What a pass over `K` tokens of one block reads: the decoded weights, the scales and the
/// tokens' corrections and float scales.
struct Block512<'a> {
    /// Chunk `c`'s 16 rows × 4 weights as `grid·±1 + 128` (vpdpbusd's unsigned operand).
    wu: &'a [__m512i; 64],
    /// Per sub-block `s`, the scale multipliers of its first and second 16 values.
    m: &'a [__m512i; 16],
    /// Per token, `−128 · Σ` of each chunk's 4 activations.
    corr: &'a [[i32; 64]],
    /// Per token, `d · dy`.
    d: &'a [__m512],
    /// Per token, its 256 activations of this block.
    y: &'a [*const i8],
}

/// Tokens `t..t + n` (`n >= 2`): the 16 rows' weights of all 64 chunks of every block are
/// decoded once per call to signed bytes (signs applied, plus 128), then, 16 tokens at a time,
/// each token's exact chunk dot is one `vpdpbusd` started from `−128·Σy` and one `vpdpwssd`
/// applies the scale, as in the one-token kernel; the float steps per token are those of one
/// token alone.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn multi_avx512<const ID: u8>(
    w: *const u8,
    a: &QuantizedActs,
    t: usize,
    n: usize,
    out: *mut f32,
) {
    let lay = Layout::of(ID);
    let nb = a.cols / 256;
    let x16 = lay.x16();
    let zero = _mm512_setzero_si512();
    let flip = _mm512_set1_epi8(-128);
    let mut dec = DECODED_512.with(|c| c.take());
    // Every vector is written before it is read: grown, never cleared.
    if dec.len() < nb * DEC512 {
        dec.resize(nb * DEC512, zero);
    }
    // SAFETY: the caller checked that w holds nb blocks of 16 rows and acts hold tokens
    // t..t + n.
    unsafe {
        let rows = |o: usize| _mm512_cvtepu8_epi32(_mm_loadu_si128(w.add(o) as *const __m128i));
        for (b, dec) in dec[..nb * DEC512].chunks_exact_mut(DEC512).enumerate() {
            let blk = b * x16;
            let (wu, m) = dec.split_at_mut(64);
            let wu: &mut [__m512i; 64] = wu.try_into().expect("64");
            gather_avx512::<ID>(w, blk, 0..lay.n_index(), wu);
            for (c, wu) in wu.iter_mut().enumerate() {
                let neg = (w.add(blk + lay.signs() + 8 * c) as *const u64).read_unaligned();
                *wu = _mm512_xor_si512(_mm512_mask_sub_epi8(*wu, neg, zero, *wu), flip);
            }
            for s in 0..8 {
                m[2 * s] = rows(blk + lay.scales() + GROUP * (s * lay.n_scales / 8));
                m[2 * s + 1] = if lay.n_scales == 16 {
                    rows(blk + lay.scales() + GROUP * (2 * s + 1))
                } else {
                    m[2 * s]
                };
            }
        }
        let mut corr = [[0i32; 64]; TILE];
        let mut d = [_mm512_setzero_ps(); TILE];
        let mut y = [std::ptr::null::<i8>(); TILE];
        for j in (0..n).step_by(TILE) {
            let nn = TILE.min(n - j);
            let mut acc = [[_mm512_setzero_ps(); 8]; TILE];
            for (b, dec) in dec[..nb * DEC512].chunks_exact(DEC512).enumerate() {
                let blk = b * x16;
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(w.add(blk) as *const __m256i));
                for k in 0..nn {
                    let tk = t + j + k;
                    y[k] = a.qs.as_ptr().add(tk * a.cols + b * 256);
                    d[k] = _mm512_mul_ps(dw, _mm512_set1_ps(*a.f.get_unchecked(tk * nb + b)));
                    for q in 0..4 {
                        let yv = _mm512_loadu_si512(y[k].add(64 * q) as *const _);
                        let s128 = _mm512_dpbusd_epi32(zero, flip, yv);
                        let neg = _mm512_sub_epi32(zero, s128);
                        _mm512_storeu_si512(corr[k].as_mut_ptr().add(16 * q) as *mut _, neg);
                    }
                }
                let blk = Block512 {
                    wu: dec[..64].try_into().expect("64"),
                    m: dec[64..].try_into().expect("16"),
                    corr: &corr,
                    d: &d,
                    y: &y,
                };
                let mut k = 0;
                while k < nn {
                    k += match nn - k {
                        8.. => pass_avx512::<8>(&blk, k, &mut acc[k..]),
                        4.. => pass_avx512::<4>(&blk, k, &mut acc[k..]),
                        2.. => pass_avx512::<2>(&blk, k, &mut acc[k..]),
                        _ => pass_avx512::<1>(&blk, k, &mut acc[k..]),
                    };
                }
            }
            for (k, acc) in acc.iter().enumerate().take(nn) {
                let sum = lanes_sum!(_mm512_add_ps, acc);
                let o = out.add((j + k) * GROUP);
                _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_set1_ps(lay.factor), sum));
            }
        }
    }
    DECODED_512.with(|c| c.replace(dec));
}

/// Tokens `k0..k0 + K` of a block: lane by lane, each token's lane in a register across the
/// 8 sub-blocks, then its float step.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pass_avx512<const K: usize>(
    blk: &Block512<'_>,
    k0: usize,
    acc: &mut [[__m512; 8]],
) -> usize {
    // SAFETY: each y pointer holds this block's 256 activations of its token.
    unsafe {
        for l in 0..8 {
            let mut lanes = [_mm512_setzero_si512(); K];
            for s in 0..8 {
                let c = 8 * s + l;
                let (wv, m) = (blk.wu[c], blk.m[2 * s + l / 4]);
                for (k, lane) in lanes.iter_mut().enumerate() {
                    let y = (blk.y[k0 + k].add(4 * c) as *const i32).read_unaligned();
                    let start = _mm512_set1_epi32(blk.corr[k0 + k][c]);
                    // Σ (w + 128)·y − 128·Σy: the exact dot, |dot| <= 4 * 62 * 127 (i16).
                    let dot = _mm512_dpbusd_epi32(start, wv, _mm512_set1_epi32(y));
                    *lane = _mm512_dpwssd_epi32(*lane, dot, m);
                }
            }
            for (k, lane) in lanes.iter().enumerate() {
                let acc = &mut acc[k][l];
                *acc = _mm512_fmadd_ps(blk.d[k0 + k], _mm512_cvtepi32_ps(*lane), *acc);
            }
        }
    }
    K
}
