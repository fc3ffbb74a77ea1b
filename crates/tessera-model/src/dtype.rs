//! GGML tensor element types: how many elements a block holds and how many bytes it takes.

use std::fmt;

/// The element types Tessera reads from GGUF files.
///
/// Quantized types store a row as consecutive *blocks*; a row of `n` elements takes
/// `n / block_size() * block_bytes()` bytes. Ids are GGML's `ggml_type` numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    /// 4-bit codes with an f16 scale and an f16 offset (min) per 32 values.
    Q4_1,
    /// 5-bit codes (4 bits + a high-bit mask) with an f16 scale per 32 values: what
    /// llama-quantize writes for Q4_K matrices whose rows are not a multiple of 256 wide (the
    /// absorbed MLA's `attn_k_b`).
    Q5_0,
    /// 5-bit codes (4 bits + a high-bit mask) with an f16 scale and an f16 offset per 32 values.
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    BF16,
    /// OCP microscaling FP4 (gpt-oss experts): an E8M0 power-of-two scale and 32 E2M1 values.
    Mxfp4,
    /// A non-linear 16-value grid with an f16 scale per 32 values.
    Iq4Nl,
    /// IQ4_NL's grid in 256-value super-blocks with 6-bit sub-block scales.
    Iq4Xs,
    /// 2-bit codes with 4-bit scales and mins per 16 values, 256 per block.
    Q2K,
    /// 3-bit codes (2 bits + a high-bit mask) with 6-bit scales per 16 values.
    Q3K,
    /// 2-bit lattice codes: 8 weights per grid index (256-entry grid), 7 sign bits and 4-bit
    /// scales per 32, 256 per block.
    Iq2Xxs,
    /// As IQ2_XXS with a 512-entry grid and a 4-bit scale per 16 values.
    Iq2Xs,
    /// As IQ2_XS with a 1024-entry grid and explicit 8-bit signs.
    Iq2S,
    /// 3-bit lattice codes: 4 weights per grid index (256-entry grid), 7 sign bits and a 4-bit
    /// scale per 32.
    Iq3Xxs,
    /// As IQ3_XXS with a 512-entry grid and explicit 8-bit signs.
    Iq3S,
}

impl GgmlType {
    /// Maps GGML's numeric type id; `None` for types Tessera does not support.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::BF16,
            10 => Self::Q2K,
            11 => Self::Q3K,
            20 => Self::Iq4Nl,
            23 => Self::Iq4Xs,
            39 => Self::Mxfp4,
            16 => Self::Iq2Xxs,
            17 => Self::Iq2Xs,
            22 => Self::Iq2S,
            18 => Self::Iq3Xxs,
            21 => Self::Iq3S,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::BF16 => 30,
            Self::Mxfp4 => 39,
            Self::Iq4Nl => 20,
            Self::Iq4Xs => 23,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Iq2Xxs => 16,
            Self::Iq2Xs => 17,
            Self::Iq2S => 22,
            Self::Iq3Xxs => 18,
            Self::Iq3S => 21,
        }
    }

    /// GGML's name for a type id, including ones Tessera cannot run (for error messages).
    pub fn name_of_id(id: u32) -> &'static str {
        match id {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            40 => "NVFP4",
            _ => "unknown",
        }
    }

    /// Elements per block (1 for plain float types).
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0
            | Self::Q4_1
            | Self::Q5_0
            | Self::Q5_1
            | Self::Q8_0
            | Self::Mxfp4
            | Self::Iq4Nl => 32,
            Self::Q4K
            | Self::Q5K
            | Self::Q6K
            | Self::Iq4Xs
            | Self::Q2K
            | Self::Q3K
            | Self::Iq2Xxs
            | Self::Iq2Xs
            | Self::Iq2S
            | Self::Iq3Xxs
            | Self::Iq3S => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,   // f16 scale + 16 bytes of nibbles
            Self::Q4_1 => 20,   // f16 scale, f16 min + 16 bytes of nibbles
            Self::Q5_0 => 22,   // f16 scale + 32 high bits + 16 bytes of nibbles
            Self::Q5_1 => 24,   // f16 scale, f16 min + 32 high bits + 16 bytes of nibbles
            Self::Q8_0 => 34,   // f16 scale + 32 i8
            Self::Q4K => 144,   // f16 d, f16 dmin, 12 bytes scales, 128 bytes nibbles
            Self::Q5K => 176,   // as Q4_K + 32 bytes of high bits
            Self::Q6K => 210,   // 128 low nibbles, 64 high bits, 16 i8 scales, f16 d
            Self::Mxfp4 => 17,  // E8M0 scale + 16 bytes of E2M1 nibbles
            Self::Iq4Nl => 18,  // f16 scale + 16 bytes of grid indices
            Self::Iq4Xs => 136, // f16 d, 2 + 4 bytes of 6-bit scales, 128 bytes of indices
            Self::Q2K => 84,    // 16 scale/min bytes, 64 bytes of codes, f16 d, f16 dmin
            Self::Q3K => 110,   // 32 bytes hmask, 64 bytes codes, 12 bytes scales, f16 d
            Self::Iq2Xxs => 66, // f16 d, 8 × (4 index bytes + 4 × 7 sign bits + 4-bit scale)
            Self::Iq2Xs => 74,  // f16 d, 32 u16 (9-bit index + 7 sign bits), 8 scale bytes
            Self::Iq2S => 82,   // f16 d, 32 index bytes, 32 sign bytes, 8 qh, 8 scale bytes
            Self::Iq3Xxs => 98, // f16 d, 64 index bytes, 8 × (4 × 7 sign bits + 4-bit scale)
            Self::Iq3S => 110,  // f16 d, 64 index bytes, 8 qh, 32 sign bytes, 4 scale bytes
        }
    }

    /// Bytes taken by `n_elements` elements, or `None` if `n_elements` is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(self.block_bytes() as u64)
    }

    /// Average bits per weight, for reports.
    pub fn bits_per_weight(self) -> f64 {
        self.block_bytes() as f64 * 8.0 / self.block_size() as f64
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(Self::name_of_id(self.id()))
    }
}
