//! Choosing the instruction set: names, caps, the active path, and which kernel path each
//! weight type takes (issue #30: none falls to the portable kernel on AVX2 or NEON).

use super::*;

#[test]
fn isa_names_parse_and_unknown_ones_are_refused() {
    for i in Isa::ALL {
        assert_eq!(i.as_str().parse::<Isa>(), Ok(i));
    }
    assert_eq!(
        "AVX2".parse::<Isa>(),
        Err(IsaError::Unknown("AVX2".to_string()))
    );
}

#[test]
fn a_cap_picks_the_best_available_isa_not_above_it() {
    assert_eq!(Isa::best_up_to(Isa::Scalar), Isa::Scalar);
    for cap in Isa::ALL {
        let got = Isa::best_up_to(cap);
        assert!(got <= cap && got.available());
        assert!(Isa::ALL
            .iter()
            .all(|&i| i <= got || i > cap || !i.available()));
    }
}

/// Once the kernels run, a cap that would change their path is refused; one that keeps it is
/// accepted (the process's results all come from one path).
#[test]
fn set_max_isa_cannot_change_the_active_isa() {
    let active = isa();
    assert_eq!(set_max_isa(active), Ok(active));
    if active != Isa::Scalar {
        assert_eq!(
            set_max_isa(Isa::Scalar),
            Err(IsaError::AlreadyChosen {
                active,
                cap: Isa::Scalar
            })
        );
    }
}

/// Issue #30: on an AVX2 (or AVX-512) process no weight type the model loader accepts falls to
/// the portable kernel; those stay the reference and the path of CPUs without AVX2.
#[cfg(target_arch = "x86_64")]
#[test]
fn no_weight_type_runs_the_scalar_kernel_on_avx2_or_avx512() {
    let supported: Vec<GgmlType> = (0..256).filter_map(GgmlType::from_id).collect();
    assert_eq!(supported.len(), ALL.len(), "a type missing from ALL");
    for dtype in supported {
        assert!(ALL.contains(&dtype), "{dtype} missing from ALL");
        assert_eq!(kernel_path_on(Isa::Scalar, dtype), Isa::Scalar, "{dtype}");
        assert_eq!(
            kernel_path_on(Isa::Avx2, dtype),
            Isa::Avx2,
            "{dtype} on avx2"
        );
        assert_eq!(
            kernel_path_on(Isa::Avx512, dtype),
            Isa::Avx512,
            "{dtype} on avx512"
        );
    }
}

/// Issue #30: on aarch64 the types real files use most take a NEON kernel, with the
/// dot-product extension for the integer ones where the process runs with it; the rest keep
/// the portable kernel, and `kernel_path` says so.
#[cfg(target_arch = "aarch64")]
#[test]
fn the_common_weight_types_run_neon_kernels_on_aarch64() {
    use GgmlType::*;
    let integer = [
        Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, Mxfp4, Iq4Nl, Iq4Xs,
    ];
    let float = [F16, BF16, F32];
    for dtype in ALL {
        let (neon, dot) = (
            kernel_path_on(Isa::Neon, dtype),
            kernel_path_on(Isa::Dotprod, dtype),
        );
        if integer.contains(&dtype) {
            assert_eq!((neon, dot), (Isa::Neon, Isa::Dotprod), "{dtype}");
        } else if float.contains(&dtype) {
            assert_eq!((neon, dot), (Isa::Neon, Isa::Neon), "{dtype}");
        } else {
            assert_eq!((neon, dot), (Isa::Scalar, Isa::Scalar), "{dtype}");
        }
    }
    // Every aarch64 CPU has NEON, so a process never runs the portable kernels unless capped.
    assert!(Isa::Neon.available());
}
