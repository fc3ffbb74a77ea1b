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

/// Where an AVX-512 process runs the F16/BF16 prefill tiles: `Some(true)` the AVX-512 ones,
/// `Some(false)` the AVX2 ones (their decode runs the AVX2 chain passes already), `None` (0)
/// as [`cpu_splits_512_bit_ops`] says. Either gives the same bits; tests set it to run both.
static WIDE_FLOAT_PREFILL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Overrides the choice of [`wide_float_prefill`] (`None`: by this CPU again).
#[cfg(test)]
pub(crate) fn set_wide_float_prefill(wide: Option<bool>) {
    let v = match wide {
        None => 0,
        Some(true) => 1,
        Some(false) => 2,
    };
    WIDE_FLOAT_PREFILL.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// Whether F16/BF16 prefill on AVX-512 runs the 512-bit tiles: not where the CPU executes
/// 512-bit operations as two 256-bit halves. On such a CPU (a 2-core Zen 4 VM,
/// `examples/float_prefill`, one dense layer at 512 tokens, one thread, alternated) the AVX2
/// tiles run F16 at 91-94 GFLOP/s against 83 for the AVX-512 ones, BF16 89-91 against 81-83;
/// F32 keeps its AVX-512 tiles (90 against 85). On a Zen 5 VM with whole 512-bit units the
/// AVX-512 tiles ran 128-131 GFLOP/s against the AVX2 tiles' 92-94.
pub(crate) fn wide_float_prefill() -> bool {
    match WIDE_FLOAT_PREFILL.load(std::sync::atomic::Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => !cpu_splits_512_bit_ops(),
    }
}

/// AMD family 19h with AVX-512 (Zen 4), whose vector units are 256 bits wide; Zen 5 (1Ah) and
/// Intel's server cores execute 512-bit operations whole.
fn cpu_splits_512_bit_ops() -> bool {
    static SPLITS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SPLITS.get_or_init(|| {
        use std::arch::x86_64::__cpuid;
        let (vendor, leaf1) = (__cpuid(0), __cpuid(1));
        let amd = (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163);
        let base = (leaf1.eax >> 8) & 0xf;
        let family = if base == 0xf {
            base + ((leaf1.eax >> 20) & 0xff)
        } else {
            base
        };
        amd && family == 0x19 && has_avx512()
    })
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
        GgmlType::F16 if wide_float_prefill() => Some(float::f16_two_avx512),
        GgmlType::BF16 if wide_float_prefill() => Some(float::bf16_two_avx512),
        _ => None,
    }
}
