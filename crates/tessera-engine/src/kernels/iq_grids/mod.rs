//! The lattice codebooks of the IQ2/IQ3 types: data of the GGUF format, not code. Each entry is
//! the magnitudes of one group of weights, one byte per weight, lowest byte first (IQ2: 8
//! weights from {8, 25, 43}; IQ3_XXS: 4 from {4, 12, …, 52, 62}; IQ3_S: 4 odd values 1..15).
//! The values are those ggml defines as `iq2xxs_grid`, `iq2xs_grid`, `iq2s_grid`,
//! `iq3xxs_grid` and `iq3s_grid` in `ggml/src/ggml-common.h` (ggml 0.25.3, the version
//! `reference/` was recorded with); a GGUF file's IQ2/IQ3 codes are indices into them.
//!
//! One file per IQ2 type (`iq2_xxs`, `iq2_xs`, `iq2_s`; 256, 512 and 1024 entries) and one for
//! the IQ3 family (`iq3`: IQ3_XXS, IQ3_S).

mod iq2_s;
mod iq2_xs;
mod iq2_xxs;
mod iq3;

pub(crate) use iq2_s::IQ2S_GRID;
pub(crate) use iq2_xs::IQ2XS_GRID;
pub(crate) use iq2_xxs::IQ2XXS_GRID;
pub(crate) use iq3::{IQ3S_GRID, IQ3XXS_GRID};
