//! aarch64 kernels: NEON (every aarch64 CPU has it) and NEON with the dot-product extension
//! (`sdot`, detected at run time), for the types listed in [`kernel`].
//!
//! A 128-bit register holds 4 quant bytes of 4 of a group's 16 rows (the interleaved layouts
//! of `matrix.rs`), so each group runs as four quads of rows, one i32/f32 lane per row. The
//! integer dot product of a row's 4 bytes with a broadcast activation word is one `sdot` lane,
//! or, without the extension, `smull` to exact i16 products, `addp` to exact i16 pair sums
//! (at most 2·128·127) and `sadalp` into the i32 lane. Integer sums are exact, so their order
//! is free; the float steps per row are the scalar kernel's, in its order, with fused
//! multiply-adds where it fuses — the results equal the scalar ones bit for bit.

mod float;
mod k23;
mod kquant;
mod lut;
mod quant;

use std::arch::aarch64::*;

use tessera_model::GgmlType;

use super::{GroupFn, Isa};

/// Whether this CPU has the dot-product extension (`sdot`).
pub(super) fn has_dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// The SIMD group kernel for `dtype` on `isa` (NEON or NEON + dotprod) and the instruction
/// set it is written for; `None` where the type has none (it runs the portable kernel), so
/// `kernels::kernel_path` reports that fallback honestly. The float types use no integer dot
/// product: their one kernel is NEON's on both paths.
pub(super) fn kernel(isa: Isa, dtype: GgmlType) -> Option<(GroupFn, Isa)> {
    let dot = match isa {
        Isa::Neon => false,
        Isa::Dotprod => true,
        _ => return None,
    };
    let pick = |plain: GroupFn, with_dot: GroupFn| {
        Some(if dot {
            (with_dot, Isa::Dotprod)
        } else {
            (plain, Isa::Neon)
        })
    };
    let neon = |f: GroupFn| Some((f, Isa::Neon));
    match dtype {
        GgmlType::Q4_0 => pick(quant::q4_0_neon, quant::q4_0_dotprod),
        // A Q5_0 matrix is held as Q8_0 (`Matrix::new`).
        GgmlType::Q8_0 | GgmlType::Q5_0 => pick(quant::q8_0_neon, quant::q8_0_dotprod),
        // Held widened (`matrix::Q1_X16`).
        GgmlType::Q4_1 | GgmlType::Q5_1 => pick(quant::q1_neon, quant::q1_dotprod),
        GgmlType::Q4K => pick(kquant::q4k_neon, kquant::q4k_dotprod),
        GgmlType::Q5K => pick(kquant::q5k_neon, kquant::q5k_dotprod),
        GgmlType::Q6K => pick(kquant::q6k_neon, kquant::q6k_dotprod),
        GgmlType::Q2K => pick(k23::q2k_neon, k23::q2k_dotprod),
        GgmlType::Q3K => pick(k23::q3k_neon, k23::q3k_dotprod),
        GgmlType::Mxfp4 => pick(lut::mxfp4_neon, lut::mxfp4_dotprod),
        GgmlType::Iq4Nl => pick(lut::iq4nl_neon, lut::iq4nl_dotprod),
        GgmlType::Iq4Xs => pick(lut::iq4xs_neon, lut::iq4xs_dotprod),
        GgmlType::F32 => neon(float::f32_group),
        GgmlType::F16 => neon(float::f16_group),
        GgmlType::BF16 => neon(float::bf16_group),
        _ => None,
    }
}

/// Defines a plain NEON entry point and a dotprod one for a group body generic over
/// `DOT` (whether it may use `sdot`). Only the dotprod entry enables the extension, so the
/// plain one runs on any aarch64 CPU.
macro_rules! neon_and_dotprod {
    ($(#[$doc:meta])* $neon:ident, $dotprod:ident, $body:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// None beyond the slices' own: NEON is part of every aarch64 target.
        pub(super) unsafe fn $neon(
            w: &[u8],
            a: &QuantizedActs,
            t0: usize,
            nt: usize,
            out: &mut [f32],
        ) {
            // SAFETY: `$body` checks its bounds; NEON is always there.
            unsafe { $body::<false>(w, a, t0, nt, out) }
        }

        $(#[$doc])*
        ///
        /// # Safety
        /// Requires the dot-product extension (`Isa::Dotprod.available()`).
        #[target_feature(enable = "dotprod")]
        pub(super) unsafe fn $dotprod(
            w: &[u8],
            a: &QuantizedActs,
            t0: usize,
            nt: usize,
            out: &mut [f32],
        ) {
            // SAFETY: `$body` checks its bounds; the caller guarantees the extension.
            unsafe { $body::<true>(w, a, t0, nt, out) }
        }
    };
}
use neon_and_dotprod;

/// `acc[i] += Σ_b w[4i+b]·y[4i+b]` (b < 4, i8 × i8): row `i`'s 4 quant bytes times the
/// activation word, exact. `sdot` when `DOT`, else `smull` + `addp` + `sadalp` (the i16 pair
/// sums are at most 2·128·127 in magnitude, so they cannot overflow).
#[inline(always)]
unsafe fn dot4<const DOT: bool>(acc: int32x4_t, w: int8x16_t, y: int8x16_t) -> int32x4_t {
    // SAFETY: register-only arithmetic; `sdot` only when the caller enabled the extension
    // (`DOT` is true only in the dotprod entry points).
    unsafe {
        if DOT {
            sdot(acc, w, y)
        } else {
            let p = vpaddq_s16(
                vmull_s8(vget_low_s8(w), vget_low_s8(y)),
                vmull_high_s8(w, y),
            );
            vpadalq_s16(acc, p)
        }
    }
}

/// `sdot`: Rust's `vdotq_s32` is not stable yet, so the instruction is written out.
#[inline]
#[target_feature(enable = "dotprod")]
unsafe fn sdot(mut acc: int32x4_t, w: int8x16_t, y: int8x16_t) -> int32x4_t {
    // SAFETY: register-only; the extension is enabled on this function.
    unsafe {
        std::arch::asm!(
            "sdot {acc:v}.4s, {w:v}.16b, {y:v}.16b",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            y = in(vreg) y,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// The activation word (4 i8) at `p`, in every 32-bit lane.
#[inline(always)]
unsafe fn yword(p: *const i8) -> int8x16_t {
    // SAFETY: the caller guarantees 4 readable bytes.
    unsafe { vreinterpretq_s8_s32(vdupq_n_s32((p as *const i32).read_unaligned())) }
}

/// 4 f16 at `p` (8 bytes, any alignment) as f32 (exact). `fcvtl` is base AdvSIMD, but Rust's
/// `vcvt_f32_f16` needs the unstable `f16` type, so the instruction is written out.
#[inline(always)]
unsafe fn f16x4(p: *const u8) -> float32x4_t {
    // SAFETY: the caller guarantees 8 readable bytes; the conversion is register-only.
    unsafe {
        let h = vreinterpret_u16_u8(vld1_u8(p));
        let out: float32x4_t;
        std::arch::asm!(
            "fcvtl {out:v}.4s, {h:v}.4h",
            out = lateout(vreg) out,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
        out
    }
}

/// 4 unsigned bytes at `p` as i32 lanes.
#[inline(always)]
unsafe fn u8x4(p: *const u8) -> int32x4_t {
    // SAFETY: the caller guarantees 4 readable bytes.
    unsafe {
        let v = vreinterpret_u8_u32(vdup_n_u32((p as *const u32).read_unaligned()));
        vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(v))))
    }
}

/// 4 signed bytes at `p` as i32 lanes.
#[inline(always)]
unsafe fn i8x4(p: *const u8) -> int32x4_t {
    // SAFETY: the caller guarantees 4 readable bytes.
    unsafe {
        let v = vreinterpret_s8_u32(vdup_n_u32((p as *const u32).read_unaligned()));
        vmovl_s16(vget_low_s16(vmovl_s8(v)))
    }
}

/// The 8 per-row lane accumulators summed as `scalar::q8_0_lanes_sum`.
#[inline(always)]
fn lanes_sum(a: &[float32x4_t; 8]) -> float32x4_t {
    // SAFETY: register-only arithmetic.
    unsafe {
        vaddq_f32(
            vaddq_f32(vaddq_f32(a[0], a[4]), vaddq_f32(a[2], a[6])),
            vaddq_f32(vaddq_f32(a[1], a[5]), vaddq_f32(a[3], a[7])),
        )
    }
}
