//! Hyperparameters of a supported architecture, read from GGUF metadata, and the tensor names
//! and shapes they imply.

mod kinds;
pub mod names;
mod read;
mod tensors;

use serde::{Deserialize, Serialize};

pub use kinds::{
    Architecture, AttnTemperature, ExpertGating, FfnActivation, Mla, RopeScaling, RopeStyle,
};

/// Everything the forward pass needs to know about a model's geometry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Dense FFN width (0 when every layer is MoE).
    pub n_ff: usize,
    /// Experts per MoE layer (0 for dense models).
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Width of one expert's FFN.
    pub n_ff_expert: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    /// Dimensions of each head that RoPE rotates (usually `head_dim`).
    pub rope_dim: usize,
    pub rms_eps: f32,
    /// The output head reuses the token embedding (no `output.weight`).
    pub tied_embeddings: bool,
    /// Renormalise the selected experts' router weights to sum to one.
    pub norm_topk_weights: bool,
    /// Positions a sliding-window layer attends to (itself and the `sliding_window - 1` before
    /// it); 0 when no layer has a window.
    #[serde(default)]
    pub sliding_window: usize,
    /// With a window: layer `il` slides iff `il % swa_pattern < swa_pattern - 1` (llama.cpp's
    /// pattern; gpt-oss: 2, every even layer).
    #[serde(default)]
    pub swa_pattern: usize,
    #[serde(default)]
    pub gating: ExpertGating,
    #[serde(default)]
    pub activation: FfnActivation,
    #[serde(default)]
    pub rope_scaling: RopeScaling,
    /// Multi-head latent attention (DeepSeek).
    #[serde(default)]
    pub mla: Option<Mla>,
    /// The first `n_layer_dense_lead` layers have a dense FFN (`n_ff` wide) in a MoE model.
    #[serde(default)]
    pub n_layer_dense_lead: usize,
    /// Shared experts of each MoE layer, run on every token beside the routed ones, as one
    /// dense FFN `n_expert_shared * n_ff_expert` wide.
    #[serde(default)]
    pub n_expert_shared: usize,
    /// Routed experts' weights are multiplied by this (after any renormalisation).
    #[serde(default = "one")]
    pub expert_weights_scale: f32,
    /// A selection bias per expert (`exp_probs_b`), added to the gate's outputs to choose the
    /// experts but not to weigh them.
    #[serde(default)]
    pub expert_selection_bias: bool,
    /// Group-limited routing: experts are split into `expert_groups` equal groups, each
    /// scored by the sum of its two best selection scores, and only the `expert_groups_used`
    /// best groups are chosen from (0: no groups).
    #[serde(default)]
    pub expert_groups: usize,
    #[serde(default)]
    pub expert_groups_used: usize,
    /// glm4moe: whether the file has Q/K/V biases and per-head Q/K norms (other families'
    /// are fixed by the architecture; see [`ModelConfig::has_qkv_bias`],
    /// [`ModelConfig::has_qk_norm`]).
    #[serde(default)]
    pub qkv_bias: bool,
    #[serde(default)]
    pub qk_norm: bool,
    /// Llama 4: a MoE layer every `moe_layer_step` layers (layer `il` routes iff
    /// `(il + 1) % moe_layer_step == 0`), dense ones between; 0 or 1: every layer past the
    /// leading dense ones.
    #[serde(default)]
    pub moe_layer_step: usize,
    /// Llama 4's chunked attention: a query at `pos` of a [`Self::is_swa_layer`] layer attends
    /// to the positions of its own chunk of `attention_chunk` (from `pos / chunk * chunk`); 0:
    /// no chunks.
    #[serde(default)]
    pub attention_chunk: usize,
    /// Layer `il` has no position encoding (NoPE) iff `(il + 1) % no_rope_layer_step == 0`
    /// (Llama 4; 0: every layer uses RoPE).
    #[serde(default)]
    pub no_rope_layer_step: usize,
    /// Llama 4: the RoPE layers' queries and keys are RMS-normed per head, without a weight,
    /// after RoPE (llama.cpp's `use_kq_norm`, on for all but the 128-expert Maverick).
    #[serde(default)]
    pub rope_qk_rms_norm: bool,
    /// Llama 4's attention temperature on NoPE layers: queries at `pos` are multiplied by
    /// `ln(floor((pos + offset) / floor_scale) + 1) · scale + 1`.
    #[serde(default)]
    pub attn_temperature: Option<AttnTemperature>,
    /// The file has `rope_freqs.weight` (`rope_dim / 2` factors, llama3-style RoPE scaling as
    /// converters write it for Llama 3.1+ and Llama 4): pair `i`'s angle is divided by factor
    /// `i`, as ggml's rope does with `freq_factors`.
    #[serde(default)]
    pub rope_freq_factors: bool,
}

fn one() -> f32 {
    1.0
}

impl ModelConfig {
    pub fn is_moe(&self) -> bool {
        self.n_expert > 0
    }

    /// The factor attention scores are multiplied by: `1/√head_dim`, and for DeepSeek with
    /// YaRN `mscale²/√head_dim` (llama.cpp's deepseek2 `kq_scale`, computed as it does).
    pub fn attention_scale(&self) -> f32 {
        let d = (self.head_dim as f32).sqrt();
        match self.rope_scaling {
            RopeScaling::Yarn {
                factor,
                attn_factor,
                log_mul,
                ..
            } if self.arch == Architecture::DeepSeek2 => {
                // llama.cpp: the context's attn_factor has (1 + 0.1·ln factor) divided out; the
                // graph multiplies it back, then applies the log multiplier.
                let freq_scale = 1.0 / factor;
                let ctx_attn = attn_factor * (1.0 / (1.0 + 0.1 * (1.0 / freq_scale).ln()));
                let org = ctx_attn * (1.0 + 0.1 * (1.0 / freq_scale).ln());
                let mscale = org * (1.0 + 0.1 * log_mul * (1.0 / freq_scale).ln());
                1.0 * mscale * mscale / d
            }
            _ => 1.0 / d,
        }
    }

    /// Whether layer `il` routes to experts (a MoE model's leading dense layers do not, nor
    /// Llama 4's dense layers between MoE ones).
    pub fn is_moe_layer(&self, il: usize) -> bool {
        self.is_moe()
            && il >= self.n_layer_dense_lead
            && (self.moe_layer_step <= 1 || (il + 1).is_multiple_of(self.moe_layer_step))
    }

    /// Whether MoE and dense layers alternate (Llama 4 with a step above 1), so the MoE
    /// layers of a range are not one contiguous run.
    pub fn interleaves_moe(&self) -> bool {
        self.is_moe() && self.moe_layer_step > 1
    }

    /// The layers of `layers` that route to experts, when they are contiguous (the leading
    /// dense layers are a prefix); with interleaved MoE layers ([`Self::interleaves_moe`]),
    /// the span from the first to the last of them.
    pub fn moe_layers(&self, layers: std::ops::Range<usize>) -> std::ops::Range<usize> {
        let mut moe = layers.clone().filter(|&l| self.is_moe_layer(l));
        match moe.next() {
            None => layers.end..layers.end,
            Some(first) => first..moe.next_back().unwrap_or(first) + 1,
        }
    }

    /// Whether layer `il` attends through a sliding window (gpt-oss) or in chunks (Llama 4).
    pub fn is_swa_layer(&self, il: usize) -> bool {
        (self.sliding_window > 0 || self.attention_chunk > 0)
            && self.swa_pattern > 0
            && il % self.swa_pattern < self.swa_pattern - 1
    }

    /// The most positions layer `il` attends to and needs cached at any context: its window
    /// or chunk (`None`: the whole context).
    pub fn layer_window(&self, il: usize) -> Option<usize> {
        if !self.is_swa_layer(il) {
            None
        } else if self.attention_chunk > 0 {
            Some(self.attention_chunk)
        } else {
            Some(self.sliding_window)
        }
    }

    /// The first position that a query at `pos` of layer `il` attends to.
    pub fn attention_start(&self, il: usize, pos: usize) -> usize {
        if !self.is_swa_layer(il) {
            return 0;
        }
        match pos.checked_div(self.attention_chunk) {
            Some(chunk) => chunk * self.attention_chunk,
            None => (pos + 1).saturating_sub(self.sliding_window),
        }
    }

    /// Whether layer `il` rotates queries and keys (all but Llama 4's NoPE layers).
    pub fn uses_rope(&self, il: usize) -> bool {
        // `is_multiple_of(0)` holds only for 0: with no step every layer rotates.
        !(il + 1).is_multiple_of(self.no_rope_layer_step)
    }

    /// Biases on the Q/K/V projections (Qwen2, gpt-oss; glm4moe when the file has them).
    pub fn has_qkv_bias(&self) -> bool {
        match self.arch {
            Architecture::Qwen2 | Architecture::GptOss => true,
            Architecture::Glm4Moe => self.qkv_bias,
            _ => false,
        }
    }

    /// A per-head RMS norm of queries and keys (Qwen3; glm4moe when the file has one).
    pub fn has_qk_norm(&self) -> bool {
        match self.arch {
            Architecture::Qwen3 | Architecture::Qwen3Moe => true,
            Architecture::Glm4Moe => self.qk_norm,
            _ => false,
        }
    }

    /// gpt-oss's extras: a bias on the attention output, a learned sink logit per head, a
    /// router bias and per-expert biases.
    pub fn has_oss_biases(&self) -> bool {
        self.arch == Architecture::GptOss
    }

    /// Width of the query projection output.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of the keys of one position (all KV heads).
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Width of one head's value: `head_dim`, except with MLA.
    pub fn v_head_dim(&self) -> usize {
        self.mla.map_or(self.head_dim, |m| m.v_head_dim)
    }

    /// Width of the values of one position (all KV heads).
    pub fn v_dim(&self) -> usize {
        self.n_head_kv * self.v_head_dim()
    }

    /// Floats one attention layer caches per position: the keys and values of every KV head,
    /// or with MLA in the absorbed layout the normed latent and the rotated key part, from which
    /// every head's key and value are made (llama.cpp's MLA cache; llama.cpp expands the heads
    /// of `attn_kv_b` files, and so does this engine).
    pub fn kv_cache_width(&self) -> usize {
        match self.mla {
            Some(m) if m.absorbed => m.kv_lora_rank + self.rope_dim,
            _ => self.kv_dim() + self.v_dim(),
        }
    }

    /// Width of the attention's output (all query heads' values), the output projection's input.
    pub fn attn_out_dim(&self) -> usize {
        self.n_head * self.v_head_dim()
    }
}
