//! The enums and small types that describe an architecture: its family, RoPE style and
//! scaling, expert gating, latent attention, FFN activation and attention temperature.

use serde::{Deserialize, Serialize};

// Only the docs' links name it.
#[cfg(doc)]
use super::ModelConfig;

/// The model families Tessera runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama and Mixtral-style MoE (`ffn_*_exps` tensors under the `llama` architecture).
    Llama,
    /// Qwen2: biases on Q/K/V projections.
    Qwen2,
    /// Qwen3: RMS norm on each head's queries and keys.
    Qwen3,
    /// Qwen3-MoE: Qwen3 attention with a routed mixture of experts in every layer.
    Qwen3Moe,
    /// gpt-oss (`gpt-oss` in llama.cpp): biased attention with a learned sink per head,
    /// sliding-window attention in every other layer, a biased router whose top-k logits are
    /// softmaxed, biased experts with a clamped SwiGLU.
    #[serde(rename = "gpt-oss")]
    GptOss,
    /// DeepSeek-V2/V3 and Kimi K2 (`deepseek2` in llama.cpp): multi-head latent attention
    /// ([`Mla`]), leading dense layers, routed experts beside shared ones, sigmoid or softmax
    /// gating with a selection bias and group-limited routing.
    #[serde(rename = "deepseek2")]
    DeepSeek2,
    /// GLM-4.5/4.6 and GLM-4.5-Air (`glm4moe` in llama.cpp): grouped-query attention with
    /// Q/K/V biases and partial RoPE (NeoX order), leading dense layers, routed experts with a
    /// sigmoid gate and a selection bias beside a shared expert.
    #[serde(rename = "glm4moe")]
    Glm4Moe,
    /// Llama 4 Scout/Maverick (`llama4` in llama.cpp): MoE layers every
    /// [`ModelConfig::moe_layer_step`] layers beside dense ones, one shared expert beside
    /// top-k routed ones whose sigmoid weight scales the expert's input
    /// ([`ExpertGating::SigmoidInput`]), and iRoPE: three of every four layers use RoPE with
    /// chunked attention (and an unweighted RMS norm of queries and keys), the fourth has no
    /// position encoding and sees the whole context.
    #[serde(rename = "llama4")]
    Llama4,
}

impl Architecture {
    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3moe",
            Self::GptOss => "gpt-oss",
            Self::DeepSeek2 => "deepseek2",
            Self::Glm4Moe => "glm4moe",
            Self::Llama4 => "llama4",
        }
    }

    pub(super) fn from_gguf_name(name: &str) -> Option<Self> {
        Some(match name {
            "llama" => Self::Llama,
            "qwen2" => Self::Qwen2,
            "qwen3" => Self::Qwen3,
            "qwen3moe" => Self::Qwen3Moe,
            "gpt-oss" => Self::GptOss,
            "deepseek2" => Self::DeepSeek2,
            "glm4moe" => Self::Glm4Moe,
            "llama4" => Self::Llama4,
            _ => return None,
        })
    }
}

/// How RoPE pairs dimensions: GGML's "normal" rotates adjacent pairs (2i, 2i+1); "NeoX" rotates
/// (i, i + d/2). Llama GGUFs are converted for the normal order; Qwen uses NeoX.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    Normal,
    Neox,
}

/// How RoPE's rotation angles are scaled for a context longer than the training one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeScaling {
    #[default]
    None,
    /// Every angle divided by `factor`.
    Linear { factor: f32 },
    /// YaRN (gpt-oss): angles interpolated by `factor` below the dimensions `beta_fast`/`beta_slow`
    /// bound (computed from `orig_ctx`), kept above, and every rotation scaled by `mscale`.
    Yarn {
        factor: f32,
        orig_ctx: usize,
        beta_fast: f32,
        beta_slow: f32,
        /// llama.cpp's `attn_factor` (from `rope.scaling.attn_factor`, 1 by default).
        attn_factor: f32,
        /// DeepSeek's `mscale_all_dim` (`rope.scaling.yarn_log_multiplier` / 0.1, as llama.cpp
        /// reads it; 0 when absent). With it the rotation keeps magnitude `attn_factor` and the
        /// attention scores are scaled by `(attn_factor·(1 + 0.1·log_mul·ln factor))²` instead
        /// (see [`ModelConfig::attention_scale`]).
        #[serde(default)]
        log_mul: f32,
    },
}

/// How a router's logits become the selected experts and their weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertGating {
    /// Softmax over all experts, the top k by probability (renormalised when
    /// [`ModelConfig::norm_topk_weights`]).
    #[default]
    Softmax,
    /// The top k by logit, their weights the softmax of those k logits (gpt-oss).
    SoftmaxWeight,
    /// The sigmoid of each logit; the top k by sigmoid plus the selection bias
    /// (`exp_probs_b`, when the model has one), their weights the unbiased sigmoids
    /// (DeepSeek-V3).
    Sigmoid,
    /// Llama 4: the top k by logit, each weight the sigmoid of its logit, multiplied into the
    /// expert's input instead of its output (llama.cpp's `weight_before_ffn`).
    SigmoidInput,
}

/// DeepSeek's multi-head latent attention. Every head's key and value come from one compressed
/// latent per position, and each head's key is its own non-rotated part followed by one rotated
/// part shared by all heads:
///
/// ```text
/// q           = Wq_b · rms_norm(Wq_a · n) * q_a_norm        (or Wq · n without a q rank)
/// [c, k_rope] = Wkv_a · n                                   (c: kv_lora_rank wide)
/// c'          = rms_norm(c) * kv_a_norm
/// key_h       = [Wk_h · c', rope(k_rope)],   value_h = Wv_h · c',   query_h = [q_nope_h, rope(q_rope_h)]
/// ```
///
/// Files store `Wk_h`/`Wv_h` in one of two layouts: stacked row by row in `attn_kv_b` (older
/// converters), or, as current llama.cpp converters write, split into `attn_k_b` (each head's
/// `Wk_h` transposed: one row per latent dimension) and `attn_v_b` ([`Mla::absorbed`]); the
/// absorbed files describe one KV head of the latent's width and keep the per-head widths in
/// `key_length_mla`/`value_length_mla`. The config reads both the same way: [`ModelConfig::head_dim`]
/// is the per-head key width (`head_dim - rope_dim` non-rotated, then `rope_dim` rotated),
/// values are `v_head_dim` wide and [`ModelConfig::n_head_kv`] is the head count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mla {
    /// Rank of the query's low-rank projection (`attn_q_a`, `attn_q_b`); 0 for a plain
    /// `attn_q` (DeepSeek-V2-Lite).
    pub q_lora_rank: usize,
    /// Width of the compressed KV latent.
    pub kv_lora_rank: usize,
    /// Width of each head's value.
    pub v_head_dim: usize,
    /// The file holds `attn_k_b`/`attn_v_b` (the absorbed layout), not `attn_kv_b`.
    #[serde(default)]
    pub absorbed: bool,
}

/// The gated activation of the feed-forward blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnActivation {
    /// `silu(gate) * up`.
    #[default]
    Swiglu,
    /// gpt-oss: `x·σ(alpha·x)·(y + 1)` with `x = min(gate, limit)`, `y = clamp(up, ±limit)`.
    SwigluOai { alpha: f32, limit: f32 },
}

/// Llama 4's temperature tuning of NoPE layers' queries at long context (see
/// [`ModelConfig::attn_temperature`]); llama.cpp's constants, not read from the file.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttnTemperature {
    pub floor_scale: usize,
    pub scale: f32,
    pub offset: f32,
}

impl AttnTemperature {
    /// The factor a query at `pos` is multiplied by (computed as llama.cpp does: the floor in
    /// f32, the rest in f64, rounded to f32).
    pub fn factor(&self, pos: usize) -> f32 {
        let steps = ((pos as f32 + self.offset) / self.floor_scale as f32).floor();
        ((f64::from(steps) + 1.0).ln() * f64::from(self.scale) + 1.0) as f32
    }
}
