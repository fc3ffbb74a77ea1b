//! x86-64 kernels: AVX2 (+FMA, F16C) and AVX-512 (F/BW/VL + VNNI), chosen at run time.

/// The 8 per-row lane accumulators of a group summed as ggml's `hsum_float_8` (`$add`: the
/// vector width's add), the order every integer-dot kernel's float sums share. Defined before
/// the kernel modules, which use it.
macro_rules! lanes_sum {
    ($add:ident, $acc:expr) => {{
        let a = $acc;
        $add(
            $add($add(a[0], a[4]), $add(a[2], a[6])),
            $add($add(a[1], a[5]), $add(a[3], a[7])),
        )
    }};
}

mod avx2;
mod avx512;
mod float;
mod iq23;
mod iq4xs;
mod iq4xs_prep;
mod k23;
mod kquant_avx2;
mod kquant_avx512;
mod lut4;
pub(super) mod quant;

use tessera_model::GgmlType;

use super::iq23::{IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS};
use super::{GroupFn, Isa};

pub(super) use float::prepare_lane_major;

pub(super) fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

pub(super) fn has_avx512() -> bool {
    has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// The SIMD group kernel for `dtype` on `isa` (AVX2 or AVX-512) and the path it runs;
/// `None` where the type has none (it would run the portable kernel). Only SIMD kernels live
/// in this table, so `kernels::kernel_path` can report a scalar fallback honestly.
pub(super) fn kernel(isa: Isa, dtype: GgmlType) -> Option<(GroupFn, Isa)> {
    let avx512 = isa == Isa::Avx512;
    let pick = |a2: GroupFn, a5: GroupFn| {
        Some(if avx512 {
            (a5, Isa::Avx512)
        } else {
            (a2, Isa::Avx2)
        })
    };
    match dtype {
        GgmlType::Q4_0 => pick(avx2::q4_0_group, avx512::q4_0_group),
        // A Q5_0 matrix is held as Q8_0 (`Matrix::new`).
        GgmlType::Q8_0 | GgmlType::Q5_0 => pick(avx2::q8_0_group, avx512::q8_0_group),
        // Held widened (`matrix::Q1_X16`).
        GgmlType::Q4_1 | GgmlType::Q5_1 => pick(avx2::q1_group, avx512::q1_group),
        GgmlType::Q4K => pick(
            kquant_avx2::q45k_group::<false>,
            avx512::q45k_group::<false>,
        ),
        GgmlType::Q5K => pick(kquant_avx2::q45k_group::<true>, kquant_avx512::q5k_group),
        GgmlType::Q6K => pick(kquant_avx2::q6k_group, kquant_avx512::q6k_group),
        GgmlType::F32 => pick(float::f32_avx2, float::f32_avx512),
        GgmlType::F16 => pick(float::f16_avx2, float::f16_avx512),
        GgmlType::BF16 => pick(float::bf16_avx2, float::bf16_avx512),
        GgmlType::Mxfp4 => pick(
            lut4::lut4_group_avx2::<false>,
            lut4::lut4_group_avx512::<false>,
        ),
        GgmlType::Q2K => pick(k23::k23_group_avx2::<false>, k23::k23_group_avx512::<false>),
        GgmlType::Q3K => pick(k23::k23_group_avx2::<true>, k23::k23_group_avx512::<true>),
        GgmlType::Iq4Xs => pick(iq4xs::iq4xs_group_avx2, iq4xs::iq4xs_group_avx512),
        GgmlType::Iq2Xxs => pick(
            iq23::iq23_group_avx2::<{ IQ2_XXS }>,
            iq23::iq23_group_avx512::<{ IQ2_XXS }>,
        ),
        GgmlType::Iq2Xs => pick(
            iq23::iq23_group_avx2::<{ IQ2_XS }>,
            iq23::iq23_group_avx512::<{ IQ2_XS }>,
        ),
        GgmlType::Iq2S => pick(
            iq23::iq23_group_avx2::<{ IQ2_S }>,
            iq23::iq23_group_avx512::<{ IQ2_S }>,
        ),
        GgmlType::Iq3Xxs => pick(
            iq23::iq23_group_avx2::<{ IQ3_XXS }>,
            iq23::iq23_group_avx512::<{ IQ3_XXS }>,
        ),
        GgmlType::Iq3S => pick(
            iq23::iq23_group_avx2::<{ IQ3_S }>,
            iq23::iq23_group_avx512::<{ IQ3_S }>,
        ),
        GgmlType::Iq4Nl => pick(
            lut4::lut4_group_avx2::<true>,
            lut4::lut4_group_avx512::<true>,
        ),
    }
}

/// The AVX-512 prefill kernel for two neighbouring groups of float weights at once (`nt ≥ 3`
/// tokens; `out[(j · 2 + g) · 16 + r]`), where `isa` has one: each activation broadcast then
/// feeds both groups' columns.
pub(super) fn pair_kernel(isa: Isa, dtype: GgmlType) -> Option<GroupFn> {
    if isa != Isa::Avx512 {
        return None;
    }
    match dtype {
        GgmlType::F32 => Some(float::f32_two_avx512),
        GgmlType::F16 => Some(float::f16_two_avx512),
        GgmlType::BF16 => Some(float::bf16_two_avx512),
        _ => None,
    }
}
