//! x86-64 kernels: AVX2 (+FMA, F16C) and AVX-512 (F/BW/VL + VNNI), chosen at run time.

mod avx2;
mod avx512;
pub(super) mod quant;

use tessera_model::GgmlType;

use super::{GroupFn, Isa, Kernel, RowFn};

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

pub(super) fn kernel(isa: Isa, dtype: GgmlType) -> Kernel {
    let avx512 = isa == Isa::Avx512;
    let group = |a2: GroupFn, a5: GroupFn| Kernel::Group(if avx512 { a5 } else { a2 });
    let row = |f: RowFn| Kernel::Row(f);
    match dtype {
        GgmlType::Q4_0 => group(avx2::q4_0_group, avx512::q4_0_group),
        GgmlType::Q8_0 => group(avx2::q8_0_group, avx512::q8_0_group),
        GgmlType::Q4K => group(avx2::q45k_group::<false>, avx512::q45k_group::<false>),
        GgmlType::Q5K => group(avx2::q45k_group::<true>, avx512::q45k_group::<true>),
        GgmlType::Q6K => group(avx2::q6k_group, avx512::q6k_group),
        // Float row kernels: AVX2 on both ISAs (memory-bound at decode).
        GgmlType::F16 => row(avx2::f16_dot),
        GgmlType::BF16 => row(avx2::bf16_dot),
        GgmlType::F32 => row(avx2::f32_dot),
    }
}
