//! The geometry and element type of a model's key/value cache: what a cache of a given
//! context costs, without computing anything. The engine's cache (`tessera_engine::kv`) stores
//! it; the coordinator and the planner size memory with it; the wire protocol names the type.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ModelConfig;

/// Element type of a KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvType {
    /// 4 bytes an element; attention equal to llama.cpp's non-flash path.
    F32,
    /// 2 bytes an element (llama.cpp's default); fused attention.
    #[default]
    F16,
    /// 34 bytes per 32 elements; fused attention. Needs head widths that are multiples of 32.
    Q8_0,
}

impl KvType {
    /// Bytes of cache for `elements` values (a multiple of 32 for Q8_0).
    pub const fn bytes_for(self, elements: usize) -> usize {
        match self {
            Self::F32 => elements * 4,
            Self::F16 => elements * 2,
            Self::Q8_0 => elements / 32 * 34,
        }
    }

    /// Bytes per position per layer for keys and values together.
    pub fn bytes_per_position(self, shape: KvShape) -> usize {
        self.bytes_for(shape.k_width()) + self.bytes_for(shape.v_width())
    }

    /// Whether this type can hold a cache of `shape` (Q8_0 needs whole blocks per head).
    pub fn check(self, shape: KvShape) -> Result<(), KvTypeUnfit> {
        // Shared values are read from the keys' blocks: only the keys must be whole blocks.
        let v_ok = shape.shared_v || shape.v_head_dim.is_multiple_of(32);
        if self == Self::Q8_0 && !(shape.k_head_dim.is_multiple_of(32) && v_ok) {
            return Err(KvTypeUnfit {
                kv_type: self,
                shape,
            });
        }
        Ok(())
    }

    pub const ALL: [Self; 3] = [Self::F32, Self::F16, Self::Q8_0];
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Q8_0 => "q8_0",
        })
    }
}

impl FromStr for KvType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            other => Err(format!(
                "unknown KV cache type '{other}' (expected f16, q8_0 or f32)"
            )),
        }
    }
}

/// Geometry of a layer's cache: KV heads and the width of each head's key and value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvShape {
    pub n_head_kv: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    /// Each head's value is the first `v_head_dim` floats of its key, not stored separately
    /// (MLA's latent).
    #[serde(default)]
    pub shared_v: bool,
}

impl KvShape {
    /// The cache `config`'s attention needs: its KV heads, keys `head_dim` wide, values
    /// [`ModelConfig::v_head_dim`] wide; with MLA in the absorbed layout one head per position,
    /// the key `[latent, rotated key]` and the value the latent (see
    /// [`ModelConfig::kv_cache_width`]).
    pub fn from_config(config: &ModelConfig) -> Self {
        match config.mla {
            Some(m) if m.absorbed => Self {
                n_head_kv: 1,
                k_head_dim: m.kv_lora_rank + config.rope_dim,
                v_head_dim: m.kv_lora_rank,
                shared_v: true,
            },
            _ => Self {
                n_head_kv: config.n_head_kv,
                k_head_dim: config.head_dim,
                v_head_dim: config.v_head_dim(),
                shared_v: false,
            },
        }
    }

    /// Key floats per position.
    pub fn k_width(self) -> usize {
        self.n_head_kv * self.k_head_dim
    }

    /// Value floats stored per position (none when the values are read from the keys).
    pub fn v_width(self) -> usize {
        if self.shared_v {
            0
        } else {
            self.n_head_kv * self.v_head_dim
        }
    }
}

/// A cache type that cannot hold a model's cache (Q8_0 needs head widths in whole blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "a {kv_type} KV cache needs head widths that are multiples of 32; this model's are {} (keys) \
     and {} (values): use f16 or f32",
    shape.k_head_dim,
    shape.v_head_dim
)]
pub struct KvTypeUnfit {
    pub kv_type: KvType,
    pub shape: KvShape,
}
