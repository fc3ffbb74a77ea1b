//! F32/F16/BF16 weights on the column-interleaved layout (AVX-512): one load holds one column
//! of 16 rows, multiplied by a broadcast activation, so each lane of an accumulator is one row
//! and each accumulator one of `scalar::float_row`'s lanes. Results equal the scalar kernel's
//! bit for bit. (AVX2 machines use the scalar kernel for float weights.)

use std::arch::x86_64::*;

use super::super::matrix::GROUP;
use super::super::quant_acts::QuantizedActs;
use super::super::scalar::{FLOAT_BF16, FLOAT_F16, FLOAT_F32};

const fn esize(k: u8) -> usize {
    if k == FLOAT_F32 {
        4
    } else {
        2
    }
}

/// The 16 rows' weights of column `e`.
#[inline(always)]
unsafe fn load16<const K: u8>(w: *const u8, e: usize) -> __m512 {
    // SAFETY: the caller guarantees column e is in bounds and AVX-512 F is enabled.
    unsafe {
        let p = w.add(e * GROUP * esize(K));
        match K {
            FLOAT_F32 => _mm512_loadu_ps(p as *const f32),
            FLOAT_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            _ => {
                let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
                _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
            }
        }
    }
}

/// 16 lane accumulators over columns `base + off + (0..16 or 0..32)` for `base` stepping by
/// `period` up to `end`: one column per lane, or for BF16 one pair per lane, odd first.
#[inline(always)]
unsafe fn pass<const K: u8>(
    w: *const u8,
    x: *const f32,
    end: usize,
    period: usize,
    off: usize,
) -> [__m512; 16] {
    // SAFETY: columns below `end` are in bounds (caller); AVX-512 F enabled (caller).
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 16];
        let mut fma = |e: usize, l: usize| {
            acc[l] = _mm512_fmadd_ps(load16::<K>(w, e), _mm512_set1_ps(*x.add(e)), acc[l]);
        };
        let mut base = 0;
        while base + period <= end {
            for l in 0..16 {
                if K == FLOAT_BF16 {
                    fma(base + off + 2 * l + 1, l);
                    fma(base + off + 2 * l, l);
                } else {
                    fma(base + off + l, l);
                }
            }
            base += period;
        }
        acc
    }
}

#[inline(always)]
fn reduce(a: &[__m512; 16]) -> __m512 {
    // SAFETY: AVX-512 F is enabled in every caller.
    unsafe {
        let s8: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(a[i], a[i + 8]));
        let s4: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(s8[i], s8[i + 4]));
        _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3]))
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn token<const K: u8>(w: *const u8, x: &[f32], out: &mut [f32; GROUP]) {
    let n = x.len();
    let xp = x.as_ptr();
    // Weight `e` of row `r`, for the scalar remainders.
    let wr = |e: usize, r: usize| -> f32 {
        // SAFETY: e < n and r < 16 lie inside the group.
        unsafe {
            let p = w.add((e * GROUP + r) * esize(K));
            match K {
                FLOAT_F32 => (p as *const f32).read_unaligned(),
                FLOAT_F16 => half::f16::from_bits((p as *const u16).read_unaligned()).to_f32(),
                _ => f32::from_bits(((p as *const u16).read_unaligned() as u32) << 16),
            }
        }
    };
    // SAFETY: the caller checked the group holds n columns; features enabled.
    unsafe {
        match K {
            FLOAT_F32 | FLOAT_F16 => {
                let np = n / 64 * 64;
                let a: [[__m512; 16]; 4] =
                    std::array::from_fn(|g| pass::<K>(w, xp, np, 64, 16 * g));
                let v: [__m512; 16] = std::array::from_fn(|i| {
                    _mm512_add_ps(
                        _mm512_add_ps(a[0][i], a[2][i]),
                        _mm512_add_ps(a[1][i], a[3][i]),
                    )
                });
                _mm512_storeu_ps(out.as_mut_ptr(), reduce(&v));
                if np < n && K == FLOAT_F32 {
                    for (r, o) in out.iter_mut().enumerate() {
                        for (e, &xe) in x.iter().enumerate().skip(np) {
                            *o = wr(e, r).mul_add(xe, *o);
                        }
                    }
                } else if np < n {
                    for (r, o) in out.iter_mut().enumerate() {
                        let mut s = *o as f64;
                        for (e, &xe) in x.iter().enumerate().skip(np) {
                            s += (wr(e, r) * xe) as f64;
                        }
                        *o = s as f32;
                    }
                }
            }
            _ => {
                let np = n / 64 * 64;
                let (mut c1, mut c2) = ([0f32; GROUP], [0f32; GROUP]);
                _mm512_storeu_ps(c1.as_mut_ptr(), reduce(&pass::<K>(w, xp, np, 64, 0)));
                _mm512_storeu_ps(c2.as_mut_ptr(), reduce(&pass::<K>(w, xp, np, 64, 32)));
                for (r, o) in out.iter_mut().enumerate() {
                    let mut s = c1[r] as f64 + c2[r] as f64;
                    for (e, &xe) in x.iter().enumerate().skip(np) {
                        s += (wr(e, r) * xe) as f64;
                    }
                    *o = s as f32;
                }
            }
        }
    }
}

macro_rules! entry {
    ($name:ident, $k:expr) => {
        /// # Safety
        /// Requires AVX-512 F/BW/VL, AVX2, FMA and F16C.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        pub(super) unsafe fn $name(
            w: &[u8],
            a: &QuantizedActs,
            t0: usize,
            nt: usize,
            out: &mut [f32],
        ) {
            let n = a.cols;
            assert!(w.len() >= n * GROUP * esize($k));
            assert!((t0 + nt) * n <= a.f.len() && out.len() >= nt * GROUP);
            for j in 0..nt {
                let x = &a.f[(t0 + j) * n..(t0 + j + 1) * n];
                let o: &mut [f32; GROUP] =
                    (&mut out[j * GROUP..(j + 1) * GROUP]).try_into().unwrap();
                // SAFETY: bounds checked above; features guaranteed by the caller.
                unsafe { token::<{ $k }>(w.as_ptr(), x, o) };
            }
        }
    };
}

entry!(f32_avx512, FLOAT_F32);
entry!(f16_avx512, FLOAT_F16);
entry!(bf16_avx512, FLOAT_BF16);

// ---- AVX2: 8 rows per load ----

/// The 8 rows `8·h8..8·h8 + 8` of column `e`.
#[inline(always)]
unsafe fn load8<const K: u8>(w: *const u8, e: usize, h8: usize) -> __m256 {
    // SAFETY: the caller guarantees column e is in bounds and AVX2/F16C are enabled.
    unsafe {
        let p = w.add((e * GROUP + 8 * h8) * esize(K));
        match K {
            FLOAT_F32 => _mm256_loadu_ps(p as *const f32),
            FLOAT_F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _ => {
                let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
            }
        }
    }
}

/// Lanes per row: `scalar::float_row`'s 4 × 16 (F32/F16: lane `L` takes the columns
/// `≡ L mod 64`) or 2 × 16 (BF16: lane `L` takes columns `2L + 1` then `2L` of each 64).
const fn n_lanes(k: u8) -> usize {
    if k == FLOAT_BF16 {
        32
    } else {
        64
    }
}

/// Every lane accumulator of both row halves over the first `np` columns (a multiple of 64):
/// `acc[h8][L]`. Computed 4 lanes × 2 halves at a time, so the 8 accumulators stay in
/// registers; each lane sees its columns in the scalar order.
#[inline(always)]
unsafe fn lanes_avx2<const K: u8>(w: *const u8, x: *const f32, np: usize) -> [[__m256; 64]; 2] {
    // SAFETY: columns below `np` are in bounds (caller); AVX2/FMA/F16C enabled (caller).
    unsafe {
        let mut out = [[_mm256_setzero_ps(); 64]; 2];
        for l0 in (0..n_lanes(K)).step_by(4) {
            let mut acc = [[_mm256_setzero_ps(); 4]; 2];
            let mut base = 0;
            while base < np {
                for i in 0..4 {
                    let l = l0 + i;
                    let cols = if K == FLOAT_BF16 {
                        [base + 2 * l + 1, base + 2 * l]
                    } else {
                        [base + l, usize::MAX]
                    };
                    for e in cols.into_iter().filter(|&e| e != usize::MAX) {
                        let xe = _mm256_set1_ps(*x.add(e));
                        for (h8, acc) in acc.iter_mut().enumerate() {
                            acc[i] = _mm256_fmadd_ps(load8::<K>(w, e, h8), xe, acc[i]);
                        }
                    }
                }
                base += 64;
            }
            for h8 in 0..2 {
                out[h8][l0..l0 + 4].copy_from_slice(&acc[h8]);
            }
        }
        out
    }
}

/// `scalar::reduce16` on 16 lane vectors.
#[inline(always)]
fn reduce_avx2(a: &[__m256]) -> __m256 {
    // SAFETY: AVX is enabled in every caller.
    unsafe {
        let s8: [__m256; 8] = std::array::from_fn(|i| _mm256_add_ps(a[i], a[i + 8]));
        let s4: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(s8[i], s8[i + 4]));
        _mm256_add_ps(_mm256_add_ps(s4[0], s4[2]), _mm256_add_ps(s4[1], s4[3]))
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn token_avx2<const K: u8>(w: *const u8, x: &[f32], out: &mut [f32; GROUP]) {
    let n = x.len();
    let np = n / 64 * 64;
    let wr = |e: usize, r: usize| -> f32 {
        // SAFETY: e < n and r < 16 lie inside the group.
        unsafe {
            let p = w.add((e * GROUP + r) * esize(K));
            match K {
                FLOAT_F32 => (p as *const f32).read_unaligned(),
                FLOAT_F16 => half::f16::from_bits((p as *const u16).read_unaligned()).to_f32(),
                _ => f32::from_bits(((p as *const u16).read_unaligned() as u32) << 16),
            }
        }
    };
    // SAFETY: the caller checked the group holds n columns; features enabled.
    unsafe {
        let acc = lanes_avx2::<K>(w, x.as_ptr(), np);
        if K == FLOAT_BF16 {
            let (mut c1, mut c2) = ([0f32; GROUP], [0f32; GROUP]);
            for (h8, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(c1.as_mut_ptr().add(8 * h8), reduce_avx2(&a[..16]));
                _mm256_storeu_ps(c2.as_mut_ptr().add(8 * h8), reduce_avx2(&a[16..32]));
            }
            for (r, o) in out.iter_mut().enumerate() {
                let mut s = c1[r] as f64 + c2[r] as f64;
                for (e, &xe) in x.iter().enumerate().skip(np) {
                    s += (wr(e, r) * xe) as f64;
                }
                *o = s as f32;
            }
            return;
        }
        for (h8, a) in acc.iter().enumerate() {
            let v: [__m256; 16] = std::array::from_fn(|i| {
                _mm256_add_ps(
                    _mm256_add_ps(a[i], a[32 + i]),
                    _mm256_add_ps(a[16 + i], a[48 + i]),
                )
            });
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * h8), reduce_avx2(&v));
        }
        if np < n && K == FLOAT_F32 {
            for (r, o) in out.iter_mut().enumerate() {
                for (e, &xe) in x.iter().enumerate().skip(np) {
                    *o = wr(e, r).mul_add(xe, *o);
                }
            }
        } else if np < n {
            for (r, o) in out.iter_mut().enumerate() {
                let mut s = *o as f64;
                for (e, &xe) in x.iter().enumerate().skip(np) {
                    s += (wr(e, r) * xe) as f64;
                }
                *o = s as f32;
            }
        }
    }
}

macro_rules! entry_avx2 {
    ($name:ident, $k:expr) => {
        /// # Safety
        /// Requires AVX2, FMA and F16C.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn $name(
            w: &[u8],
            a: &QuantizedActs,
            t0: usize,
            nt: usize,
            out: &mut [f32],
        ) {
            let n = a.cols;
            assert!(w.len() >= n * GROUP * esize($k));
            assert!((t0 + nt) * n <= a.f.len() && out.len() >= nt * GROUP);
            for j in 0..nt {
                let x = &a.f[(t0 + j) * n..(t0 + j + 1) * n];
                let o: &mut [f32; GROUP] =
                    (&mut out[j * GROUP..(j + 1) * GROUP]).try_into().unwrap();
                // SAFETY: bounds checked above; features guaranteed by the caller.
                unsafe { token_avx2::<{ $k }>(w.as_ptr(), x, o) };
            }
        }
    };
}

entry_avx2!(f32_avx2, FLOAT_F32);
entry_avx2!(f16_avx2, FLOAT_F16);
entry_avx2!(bf16_avx2, FLOAT_BF16);
