//! Quantized matrix kernels and the thread pool that runs them.
//!
//! Numerics follow ggml: activations are quantized to each weight type's `vec_dot_type`
//! ([`QuantizedActs`]), and the float accumulation of each type reproduces the order of the
//! llama.cpp x86 kernel that type runs through for a single token (Q4_0, Q4_K: repacked gemv;
//! Q8_0, Q6_K, Q5_K, F32, F16, BF16: `ggml_vec_dot_*`, Q8_0's order being the same as llamafile
//! tinyBLAS's), because small models amplify even last-bit differences. llama.cpp's numerics
//! depend on the batch (llamafile `tinyBLAS` and the repacked gemm only serve batches of two or
//! more tokens); a batch-invariant engine can match only one side, and follows the
//! single-token decode steps, which produce nearly all reference positions. Integer block sums are exact, and every output
//! element is computed by the same sequence of float operations whatever the batch, thread
//! count or row range, so results are batch-invariant and deterministic, and the scalar, AVX2
//! and AVX-512 paths agree bit for bit.
//!
//! Usage:
//! - Build each weight once with [`Matrix::new`] (it repacks into 16-row interleaved groups and
//!   owns the result; the source bytes, e.g. an mmap range, can be dropped afterwards).
//! - [`matmul()`] / [`matmul_rows`] quantize `x` and multiply. When several matrices read the same
//!   input (Q/K/V, gate/up, all experts of a layer), quantize once with [`QuantizedActs::new`]
//!   and run them together with [`matmul_many`] (one pool dispatch) or [`matmul_rows_q`].
//! - MoE: an expert tensor is one `Matrix` of `n_expert * rows` rows; expert `e` is rows
//!   `e*rows..(e+1)*rows`. [`QuantizedActs::gather`] picks the tokens routed to an expert.
//! - Outputs are token-major: `out[t * n_rows + r]`.
//!
//! The instruction set is chosen once per process ([`isa`]; `TESSERA_MAX_ISA` or [`set_max_isa`]
//! cap it, so one machine can play a scalar, AVX2 or AVX-512 node, or a scalar, NEON or
//! NEON + dotprod one). [`kernel_path`] says which kernel a type takes; the portable kernels
//! (`scalar.rs` and the types' own files) are the reference and every other path equals them
//! bit for bit. The kernel paths:
//! - x86-64 (`x86/`): every weight type has an AVX2 (+FMA, F16C) and an AVX-512 (F/BW/VL +
//!   VNNI) kernel; CPUs without AVX2 run the portable kernels.
//! - aarch64 (`neon/`): NEON kernels for Q4_0, Q8_0 (and Q5_0, held as Q8_0), Q4_1, Q5_1, Q2_K,
//!   Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS, each also built with the dot-product
//!   extension (`sdot`, taken when the CPU has it: path `dotprod`), and for F32, F16, BF16 (one
//!   NEON kernel, no integer dot products). The IQ2/IQ3 types run the portable kernels there
//!   (path `scalar`), as do the KV cache's attention and the activations' quantization. Tested
//!   bit for bit under qemu-user in CI (`.ci/aarch64`); no speed has been measured on ARM
//!   hardware.
//! - other targets: the portable kernels.
//!
//! GGML types Tessera does not run, and whether real files use them:
//! - IQ1_S, IQ1_M: yes, the smallest "1-bit" quants of very large models (e.g. the dynamic
//!   1.58-bit DeepSeek-R1 files mix them with IQ2/Q4_K).
//! - TQ1_0, TQ2_0 (ternary): a few BitNet / TriLM conversions.
//! - NVFP4: new; a few files.
//! - Q8_1, Q8_K: activation types only (ggml's `vec_dot_type`s), never stored in a model file.
//! - I8, I16, I32, I64, F64: integer/double tensors, not used for weight matrices.
//! - Q4_0_4_4, Q4_0_4_8, Q4_0_8_8, IQ4_NL_4_4 … (ids 31–33, 36–38): repacked layouts llama.cpp
//!   itself no longer loads from files.

mod iq23;
mod iq4xs;
mod iq_grids;
mod k23;
mod lut4;
mod matmul;
mod matrix;
#[cfg(target_arch = "aarch64")]
mod neon;
mod pool;
mod quant_acts;
mod scalar;
#[cfg(test)]
mod tests;
mod weight_buffer;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;

use tessera_model::GgmlType;

pub use matmul::{matmul, matmul_many, matmul_rows, matmul_rows_q, MatmulJob};
pub use matrix::{Matrix, MatrixBytes};
pub use pool::ThreadPool;
pub(crate) use pool::WORTH_SHARING;
pub(crate) use quant_acts::quantize_row_q8_0;
pub use quant_acts::QuantizedActs;
pub(crate) use weight_buffer::{SlotPool, WeightArena, WeightBuffer};

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{dtype} matrix with {cols} columns: must be a positive multiple of {block}")]
    BadCols {
        dtype: GgmlType,
        cols: usize,
        block: usize,
    },
    #[error("{dtype} matrix {rows}x{cols} needs {expected} bytes, got {got}")]
    BadLength {
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        expected: usize,
        got: usize,
    },
    #[error("matrix {rows}x{cols} is too large")]
    TooLarge { rows: usize, cols: usize },
    #[error("shared byte range lies outside its buffer")]
    BadRange,
}

/// Instruction set a kernel runs with; chosen once per process (see [`isa`]). Ordered from
/// least to most capable within each architecture, the aarch64 ones below the x86-64 ones, so
/// a cap is a `min` and one order serves both: on aarch64 a cap of `avx2` or `avx512` is above
/// everything the machine has (its best is used), on x86-64 a cap of `neon` or `dotprod` leaves
/// only the portable kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// aarch64 Advanced SIMD (every aarch64 CPU has it).
    Neon,
    /// NEON with the dot-product extension (`sdot`; Cortex-A55/A76 and later, Apple M1).
    Dotprod,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL + VNNI.
    Avx512,
}

/// The environment variable that caps the instruction set of a process (see [`isa`]).
pub const MAX_ISA_ENV: &str = "TESSERA_MAX_ISA";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsaError {
    #[error("unknown instruction set {0:?}: expected scalar, neon, dotprod, avx2 or avx512")]
    Unknown(String),
    /// The kernels already dispatched with another instruction set; the choice is made once
    /// per process so that every result of a process comes from one kernel path.
    #[error("the kernels already run with {active}; a cap of {cap} would change that")]
    AlreadyChosen { active: Isa, cap: Isa },
}

impl Isa {
    /// Every instruction set, least capable first.
    pub const ALL: [Self; 5] = [
        Self::Scalar,
        Self::Neon,
        Self::Dotprod,
        Self::Avx2,
        Self::Avx512,
    ];

    /// Whether this machine can run `self`.
    pub fn available(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => x86::has_avx2(),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => x86::has_avx512(),
            #[cfg(target_arch = "aarch64")]
            Self::Neon => true,
            #[cfg(target_arch = "aarch64")]
            Self::Dotprod => neon::has_dotprod(),
            _ => false,
        }
    }

    /// The most capable instruction set of this machine that is not above `cap`.
    pub fn best_up_to(cap: Self) -> Self {
        Self::ALL
            .into_iter()
            .rev()
            .find(|i| *i <= cap && i.available())
            .unwrap_or(Self::Scalar)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Neon => "neon",
            Self::Dotprod => "dotprod",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Isa {
    type Err = IsaError;

    fn from_str(s: &str) -> Result<Self, IsaError> {
        Self::ALL
            .into_iter()
            .find(|i| i.as_str() == s)
            .ok_or_else(|| IsaError::Unknown(s.to_string()))
    }
}

static ISA: OnceLock<Isa> = OnceLock::new();

/// The instruction set every kernel of this process runs with (so a node can report its path):
/// the best one of this machine, capped by [`set_max_isa`] if that ran first, else by
/// `TESSERA_MAX_ISA` (`scalar`, `neon`, `dotprod`, `avx2`, `avx512`). A cap above what the
/// machine has is no error (the machine's best is used). Fixed at the first call.
///
/// # Panics
/// At the first call, if `TESSERA_MAX_ISA` is set to anything else than those five names
/// (a misspelt cap must not silently run another path).
pub fn isa() -> Isa {
    *ISA.get_or_init(|| {
        let cap = match std::env::var(MAX_ISA_ENV) {
            Ok(v) => v
                .parse()
                .unwrap_or_else(|e| panic!("{MAX_ISA_ENV}={v:?}: {e}")),
            Err(_) => Isa::Avx512,
        };
        Isa::best_up_to(cap)
    })
}

/// Caps the instruction set of this process (overrides `TESSERA_MAX_ISA`) and returns the one
/// the kernels will use. Call it before the first kernel runs; afterwards it only succeeds
/// when the cap leaves the active instruction set unchanged.
pub fn set_max_isa(cap: Isa) -> Result<Isa, IsaError> {
    let want = Isa::best_up_to(cap);
    let active = *ISA.get_or_init(|| want);
    if active == want {
        Ok(active)
    } else {
        Err(IsaError::AlreadyChosen { active, cap })
    }
}

/// A `&mut [T]` handed to pool tasks that each write a disjoint part of it.
pub(crate) struct SharedMut<T>(*mut T, usize);

// SAFETY: tasks only write disjoint elements (each caller documents why), and the borrow the
// pointer came from outlives the `ThreadPool::run` that uses it.
unsafe impl<T: Send> Sync for SharedMut<T> {}
unsafe impl<T: Send> Send for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(v: &mut [T]) -> Self {
        Self(v.as_mut_ptr(), v.len())
    }

    /// # Safety
    /// No other task may access `start..start+len` at the same time.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.1, "SharedMut range out of bounds");
        // SAFETY: in bounds (checked) and exclusive (guaranteed by the caller).
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// A `Vec` of `len` elements that `fill` writes, each exactly once (pool tasks writing disjoint
/// ranges of it), with no zeroing first: a prompt's activation copies are megabytes, and
/// zeroing them was a serial `memset` before each parallel fill.
///
/// # Safety
/// `fill` must write every one of the `len` elements before it returns.
pub(crate) unsafe fn written_vec<T: Copy + Send>(
    len: usize,
    fill: impl FnOnce(&SharedMut<std::mem::MaybeUninit<T>>),
) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    fill(&SharedMut::new(&mut v.spare_capacity_mut()[..len]));
    // SAFETY: `fill` wrote all `len` elements (the caller's promise).
    unsafe { v.set_len(len) };
    v
}

/// 16 rows × `nt` tokens of an interleaved group (acts of tokens `t0..t0+nt`), written to
/// `out[j*16 + r]`.
pub(crate) type GroupFn = unsafe fn(&[u8], &QuantizedActs, usize, usize, &mut [f32]);

/// The group kernel for `dtype` on `isa`.
fn kernel(isa: Isa, dtype: GgmlType) -> GroupFn {
    kernel_and_path(isa, dtype).0
}

/// A kernel for two neighbouring groups at once (`out[(j*2 + g)*16 + r]`, 3 or more tokens)
/// where `isa` has one for `dtype`: float prefill on AVX-512.
fn pair_kernel(isa: Isa, dtype: GgmlType) -> Option<GroupFn> {
    #[cfg(target_arch = "x86_64")]
    return x86::pair_kernel(isa, dtype);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, dtype);
        None
    }
}

/// The group kernel for `dtype` on `isa` and the instruction set that kernel is written for:
/// `isa`'s own where the type has one, else the portable kernel ([`Isa::Scalar`]).
fn kernel_and_path(isa: Isa, dtype: GgmlType) -> (GroupFn, Isa) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        if let Some(picked) = x86::kernel(isa, dtype) {
            return picked;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa != Isa::Scalar {
        if let Some(picked) = neon::kernel(isa, dtype) {
            return picked;
        }
    }
    let _ = isa;
    let f: GroupFn = match dtype {
        GgmlType::Q4_0 => scalar::q4_0_group,
        // A Q5_0 matrix is held as Q8_0 (`Matrix::new`).
        GgmlType::Q8_0 | GgmlType::Q5_0 => scalar::q8_0_group,
        GgmlType::Q4_1 | GgmlType::Q5_1 => scalar::q1_group,
        GgmlType::Q4K => scalar::q45k_group::<false>,
        GgmlType::Q5K => scalar::q45k_group::<true>,
        GgmlType::Q6K => scalar::q6k_group,
        GgmlType::F16 => scalar::f16_group,
        GgmlType::BF16 => scalar::bf16_group,
        GgmlType::F32 => scalar::f32_group,
        GgmlType::Mxfp4 => lut4::lut4_group::<false>,
        GgmlType::Iq4Nl => lut4::lut4_group::<true>,
        GgmlType::Iq4Xs => iq4xs::iq4xs_group,
        GgmlType::Q2K => k23::k23_group::<false>,
        GgmlType::Q3K => k23::k23_group::<true>,
        GgmlType::Iq2Xxs => iq23::iq23_group::<{ iq23::IQ2_XXS }>,
        GgmlType::Iq2Xs => iq23::iq23_group::<{ iq23::IQ2_XS }>,
        GgmlType::Iq2S => iq23::iq23_group::<{ iq23::IQ2_S }>,
        GgmlType::Iq3Xxs => iq23::iq23_group::<{ iq23::IQ3_XXS }>,
        GgmlType::Iq3S => iq23::iq23_group::<{ iq23::IQ3_S }>,
    };
    (f, Isa::Scalar)
}

/// The kernel path a `dtype` weight matrix takes in this process: the instruction set of the
/// kernel it runs with under [`isa`]. [`Isa::Scalar`] on a SIMD machine means the type has
/// no kernel for it (slow); `tessera bench` and `tessera inspect` print this per type.
pub fn kernel_path(dtype: GgmlType) -> Isa {
    kernel_path_on(isa(), dtype)
}

/// [`kernel_path`] for a process running with `isa` (whether or not this machine has it).
pub fn kernel_path_on(isa: Isa, dtype: GgmlType) -> Isa {
    kernel_and_path(isa, dtype).1
}

/// One weight type of a model file and the kernel path its matrices take in this process.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TypePath {
    /// GGML's name of the type.
    pub dtype: String,
    /// Matrices of the type (tensors of two or more dimensions: weights, experts).
    pub matrices: usize,
    /// [`kernel_path`]'s instruction set (`avx512`, `avx2`, `dotprod`, `neon`, `scalar`), or
    /// `unsupported`.
    pub path: String,
}

/// The kernel path of each weight type among `tensors` (a file's tensor table), in order of
/// first appearance, so that a slow path is visible to a user.
pub fn type_paths(tensors: &[tessera_model::TensorInfo]) -> Vec<TypePath> {
    let mut out: Vec<TypePath> = Vec::new();
    for t in tensors.iter().filter(|t| t.shape.len() >= 2) {
        let dtype = GgmlType::name_of_id(t.type_id);
        match out.iter_mut().find(|p| p.dtype == dtype) {
            Some(p) => p.matrices += 1,
            None => out.push(TypePath {
                dtype: dtype.to_string(),
                matrices: 1,
                path: GgmlType::from_id(t.type_id)
                    .map_or("unsupported", |d| kernel_path(d).as_str())
                    .to_string(),
            }),
        }
    }
    out
}

impl std::fmt::Display for TypePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ({})", self.dtype, self.path, self.matrices)
    }
}

/// Decodes a whole slice of GGML blocks of `dtype` into `out` (reference dequantization).
///
/// # Panics
/// If `bytes` is not a whole number of blocks or `out` is shorter than the element count.
pub fn dequantize(dtype: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let (bs, bb) = (dtype.block_size(), dtype.block_bytes());
    assert!(
        bytes.len().is_multiple_of(bb),
        "not a whole number of {dtype} blocks"
    );
    let n = bytes.len() / bb * bs;
    assert!(out.len() >= n, "output too short");
    for (b, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bs)) {
        scalar::dequantize_block(dtype, b, y);
    }
}
