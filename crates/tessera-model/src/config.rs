//! Hyperparameters of a supported architecture, read from GGUF metadata, and the tensor names
//! and shapes they imply.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

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

    fn from_gguf_name(name: &str) -> Option<Self> {
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

fn one() -> f32 {
    1.0
}

/// Tensor names, in one place.
pub mod names {
    pub const TOKEN_EMBD: &str = "token_embd.weight";
    pub const OUTPUT_NORM: &str = "output_norm.weight";
    pub const OUTPUT: &str = "output.weight";
    /// llama3-style RoPE frequency factors, one per rotated pair (optional).
    pub const ROPE_FREQS: &str = "rope_freqs.weight";

    /// The norm before a layer's feed-forward block: `ffn_norm` in most families,
    /// `post_attention_norm` in gpt-oss.
    pub fn ffn_norm(arch: super::Architecture) -> &'static str {
        match arch {
            super::Architecture::GptOss | super::Architecture::Glm4Moe => {
                "post_attention_norm.weight"
            }
            _ => "ffn_norm.weight",
        }
    }

    pub fn layer(i: usize, what: &str) -> String {
        format!("blk.{i}.{what}")
    }
}

impl ModelConfig {
    /// Reads the hyperparameters of a supported architecture and checks every tensor the
    /// architecture needs against them (presence and shape).
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let path = g.path();
        let arch_name = meta_str(g, "general.architecture")?;
        let arch = Architecture::from_gguf_name(arch_name).ok_or_else(|| {
            ModelError::UnsupportedArchitecture {
                path: path.to_owned(),
                arch: arch_name.to_string(),
            }
        })?;
        let a = arch.gguf_name();
        let key = |k: &str| format!("{a}.{k}");
        // GLM's multi-token-prediction layers follow the model's own (llama.cpp skips them too).
        let nextn = opt_usize(g, &key("nextn_predict_layers"))?.unwrap_or(0);
        let n_layer = meta_usize(g, &key("block_count"))?;
        let n_layer = match n_layer.checked_sub(nextn) {
            Some(n) if n > 0 => n,
            _ => {
                return Err(bad_meta(
                    path,
                    &key("nextn_predict_layers"),
                    format!("{nextn} prediction layers leave none of the {n_layer} blocks"),
                ))
            }
        };
        // Every layer has at least nine tensors (two norms, four attention projections, three
        // FFN matrices); refuse a count the file cannot back before building names for it.
        if n_layer.saturating_mul(9) > g.tensors().len() {
            return Err(bad_meta(
                path,
                &key("block_count"),
                format!(
                    "{n_layer} layers cannot fit in a file of {} tensors",
                    g.tensors().len()
                ),
            ));
        }
        let n_embd = meta_usize(g, &key("embedding_length"))?;
        let n_head = meta_usize(g, &key("attention.head_count"))?;
        let n_head_kv = opt_usize(g, &key("attention.head_count_kv"))?.unwrap_or(n_head);
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(bad_meta(
                path,
                &key("attention.head_count_kv"),
                format!("{n_head_kv} must be non-zero and divide the head count {n_head}"),
            ));
        }
        let head_dim = match opt_usize(g, &key("attention.key_length"))? {
            Some(d) => d,
            None if n_embd % n_head == 0 => n_embd / n_head,
            None => {
                return Err(bad_meta(
                    path,
                    &key("attention.head_count"),
                    format!("{n_head} does not divide the hidden size {n_embd}"),
                ))
            }
        };
        let n_expert = opt_usize(g, &key("expert_count"))?.unwrap_or(0);
        let n_expert_used = opt_usize(g, &key("expert_used_count"))?.unwrap_or(0);
        if n_expert > 0 && (n_expert_used == 0 || n_expert_used > n_expert) {
            return Err(bad_meta(
                path,
                &key("expert_used_count"),
                format!("{n_expert_used} must be between 1 and the expert count {n_expert}"),
            ));
        }
        let n_ff = opt_usize(g, &key("feed_forward_length"))?.unwrap_or(0);
        let n_ff_expert = match opt_usize(g, &key("expert_feed_forward_length"))? {
            Some(n) => n,
            None if n_expert > 0 => n_ff, // Mixtral-style files reuse feed_forward_length.
            None => 0,
        };
        let token_embd = g.require_tensor(names::TOKEN_EMBD)?;
        let vocab_size = match token_embd.shape.as_slice() {
            [_, v] => *v as usize,
            s => {
                return Err(ModelError::BadTensor {
                    path: path.to_owned(),
                    tensor: names::TOKEN_EMBD.into(),
                    what: format!("shape {s:?} is not a matrix"),
                })
            }
        };
        let context_length = opt_usize(g, &key("context_length"))?.unwrap_or(2048);
        let rope_theta = opt_f32(g, &key("rope.freq_base"))?.unwrap_or(10_000.0);
        let rope_dim = opt_usize(g, &key("rope.dimension_count"))?.unwrap_or(head_dim);
        let rms_eps = opt_f32(g, &key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6);
        let rope_style = match arch {
            Architecture::Llama | Architecture::DeepSeek2 | Architecture::Llama4 => {
                RopeStyle::Normal
            }
            _ => RopeStyle::Neox,
        };
        let gpt_oss = arch == Architecture::GptOss;
        let llama4 = arch == Architecture::Llama4;
        let l4 = if llama4 {
            read_llama4(g, &key, n_layer, n_expert)?
        } else {
            Llama4Attn::default()
        };
        let (sliding_window, swa_pattern) = if gpt_oss {
            let window = meta_usize(g, &key("attention.sliding_window"))?;
            let pattern = opt_usize(g, &key("attention.sliding_window_pattern"))?.unwrap_or(2);
            if pattern == 0 {
                return Err(bad_meta(
                    path,
                    &key("attention.sliding_window_pattern"),
                    "must be positive".into(),
                ));
            }
            (window, pattern)
        } else if llama4 {
            (0, l4.swa_pattern)
        } else {
            (0, 0)
        };
        let rope_scaling = read_rope_scaling(g, &key, context_length)?;
        let deepseek = arch == Architecture::DeepSeek2;
        // YaRN's log multiplier is DeepSeek's (llama.cpp reads it for deepseek2 only).
        if let RopeScaling::Yarn { log_mul, .. } = rope_scaling {
            if log_mul != 0.0 && !deepseek {
                return Err(bad_meta(
                    path,
                    &key("rope.scaling.yarn_log_multiplier"),
                    format!("YaRN with a log multiplier is supported for deepseek2, not {a}"),
                ));
            }
        }
        // MLA's config describes every head's own key and value whichever layout the file has.
        let (mla, head_dim, n_head_kv) = if deepseek {
            let (m, hd) = read_mla(g, &key, n_head, n_head_kv, head_dim)?;
            (Some(m), hd, n_head)
        } else {
            (None, head_dim, n_head_kv)
        };
        let n_layer_dense_lead = opt_usize(g, &key("leading_dense_block_count"))?.unwrap_or(0);
        if n_layer_dense_lead > n_layer {
            return Err(bad_meta(
                path,
                &key("leading_dense_block_count"),
                format!("{n_layer_dense_lead} is more than the {n_layer} layers"),
            ));
        }
        // Llama 4's one shared expert is not in the metadata: llama.cpp always loads it.
        let n_expert_shared = if llama4 {
            1
        } else {
            opt_usize(g, &key("expert_shared_count"))?.unwrap_or(0)
        };
        let expert_weights_scale = opt_f32(g, &key("expert_weights_scale"))?.unwrap_or(1.0);
        let (expert_groups, expert_groups_used) = read_expert_groups(g, &key, n_expert)?;
        let gating = match (arch, opt_usize(g, &key("expert_gating_func"))?) {
            (Architecture::GptOss, _) => ExpertGating::SoftmaxWeight,
            (Architecture::Llama4, _) => ExpertGating::SigmoidInput,
            (Architecture::Glm4Moe, None | Some(0)) => ExpertGating::Sigmoid,
            // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*: 1 softmax, 2 sigmoid (0/absent:
            // softmax, as older DeepSeek-V2 files have).
            (_, None | Some(0 | 1)) => ExpertGating::Softmax,
            (_, Some(2)) => ExpertGating::Sigmoid,
            (_, Some(other)) => {
                return Err(bad_meta(
                    path,
                    &key("expert_gating_func"),
                    format!("gating function {other} is not supported (1 softmax, 2 sigmoid)"),
                ))
            }
        };
        let norm_topk_weights = match g.meta(&key("expert_weights_norm")) {
            Some(v) => v.as_bool().ok_or_else(|| {
                bad_meta(path, &key("expert_weights_norm"), "is not a boolean".into())
            })?,
            None => matches!(arch, Architecture::Qwen3Moe | Architecture::Llama),
        };
        // Multimodal RoPE sections (GLM-4.5V) would rotate by more than the position.
        if g.meta(&key("rope.dimension_sections")).is_some() {
            return Err(bad_meta(
                path,
                &key("rope.dimension_sections"),
                "multimodal RoPE sections are not supported".into(),
            ));
        }
        let glm = arch == Architecture::Glm4Moe;
        let qkv_bias = glm && g.tensor(&names::layer(0, "attn_q.bias")).is_some();
        let qk_norm = glm && g.tensor(&names::layer(0, "attn_q_norm.weight")).is_some();
        let expert_selection_bias = n_expert > 0
            && g.tensor(&names::layer(n_layer - 1, "exp_probs_b.bias"))
                .is_some();
        // A different base for the sliding-window layers would need a second table: refuse it
        // rather than run them with the wrong one.
        if let Some(b) = opt_f32(g, &key("rope.freq_base_swa"))? {
            if b != rope_theta {
                return Err(bad_meta(
                    path,
                    &key("rope.freq_base_swa"),
                    format!("a separate base ({b}) for sliding-window layers is not supported"),
                ));
            }
        }
        let cfg = Self {
            arch,
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            n_expert,
            n_expert_used,
            n_ff_expert,
            vocab_size,
            context_length,
            rope_theta,
            rope_style,
            rope_dim,
            rms_eps,
            tied_embeddings: g.tensor(names::OUTPUT).is_none(),
            norm_topk_weights,
            sliding_window,
            swa_pattern,
            rope_scaling,
            gating,
            activation: if gpt_oss {
                // llama.cpp's constants for LLM_FFN_SWIGLU_OAI_MOE (not in the GGUF).
                FfnActivation::SwigluOai {
                    alpha: 1.702,
                    limit: 7.0,
                }
            } else {
                FfnActivation::Swiglu
            },
            mla,
            n_layer_dense_lead,
            n_expert_shared,
            expert_weights_scale,
            expert_selection_bias,
            expert_groups,
            expert_groups_used,
            qkv_bias,
            qk_norm,
            moe_layer_step: l4.moe_layer_step,
            attention_chunk: l4.chunk,
            no_rope_layer_step: l4.no_rope_layer_step,
            rope_qk_rms_norm: l4.rope_qk_rms_norm,
            attn_temperature: l4.temperature,
            // llama.cpp reads the factors for llama and llama4 (other families' files lack them).
            rope_freq_factors: matches!(arch, Architecture::Llama | Architecture::Llama4)
                && g.tensor(names::ROPE_FREQS).is_some(),
        };
        // MLA keys are a non-rotated part and a rotated part: both must be there.
        if rope_dim > head_dim || rope_dim % 2 != 0 || (mla.is_some() && rope_dim == head_dim) {
            return Err(bad_meta(
                path,
                &key("rope.dimension_count"),
                format!("{rope_dim} must be even and at most the head size {head_dim}"),
            ));
        }
        cfg.check_tensors(g)?;
        Ok(cfg)
    }

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

    /// Every tensor the architecture reads, with the shape (GGML order) the hyperparameters imply.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<u64>)> {
        let (e, q, kv) = (
            self.n_embd as u64,
            self.q_dim() as u64,
            self.kv_dim() as u64,
        );
        let mut out = vec![
            (
                names::TOKEN_EMBD.to_string(),
                vec![e, self.vocab_size as u64],
            ),
            (names::OUTPUT_NORM.to_string(), vec![e]),
        ];
        if self.rope_freq_factors {
            out.push((
                names::ROPE_FREQS.to_string(),
                vec![self.rope_dim as u64 / 2],
            ));
        }
        if !self.tied_embeddings {
            out.push((names::OUTPUT.to_string(), vec![e, self.vocab_size as u64]));
        }
        for i in 0..self.n_layer {
            let l = |w: &str| names::layer(i, w);
            out.push((l("attn_norm.weight"), vec![e]));
            if let Some(m) = self.mla {
                let (qr, kvr) = (m.q_lora_rank as u64, m.kv_lora_rank as u64);
                if qr > 0 {
                    out.push((l("attn_q_a.weight"), vec![e, qr]));
                    out.push((l("attn_q_a_norm.weight"), vec![qr]));
                    out.push((l("attn_q_b.weight"), vec![qr, q]));
                } else {
                    out.push((l("attn_q.weight"), vec![e, q]));
                }
                let (nope, nh) = ((self.head_dim - self.rope_dim) as u64, self.n_head as u64);
                let dv = m.v_head_dim as u64;
                out.push((
                    l("attn_kv_a_mqa.weight"),
                    vec![e, kvr + self.rope_dim as u64],
                ));
                out.push((l("attn_kv_a_norm.weight"), vec![kvr]));
                if m.absorbed {
                    out.push((l("attn_k_b.weight"), vec![nope, kvr, nh]));
                    out.push((l("attn_v_b.weight"), vec![kvr, dv, nh]));
                } else {
                    out.push((l("attn_kv_b.weight"), vec![kvr, nh * (nope + dv)]));
                }
                out.push((l("attn_output.weight"), vec![self.attn_out_dim() as u64, e]));
            } else {
                out.push((l("attn_q.weight"), vec![e, q]));
                out.push((l("attn_k.weight"), vec![e, kv]));
                out.push((l("attn_v.weight"), vec![e, kv]));
                out.push((l("attn_output.weight"), vec![q, e]));
            }
            if self.has_qkv_bias() {
                out.push((l("attn_q.bias"), vec![q]));
                out.push((l("attn_k.bias"), vec![kv]));
                out.push((l("attn_v.bias"), vec![kv]));
            }
            if self.has_oss_biases() {
                out.push((l("attn_output.bias"), vec![e]));
                out.push((l("attn_sinks.weight"), vec![self.n_head as u64]));
            }
            if self.has_qk_norm() {
                out.push((l("attn_q_norm.weight"), vec![self.head_dim as u64]));
                out.push((l("attn_k_norm.weight"), vec![self.head_dim as u64]));
            }
            out.push((l(names::ffn_norm(self.arch)), vec![e]));
            if self.is_moe_layer(i) {
                let (n, f) = (self.n_expert as u64, self.n_ff_expert as u64);
                out.push((l("ffn_gate_inp.weight"), vec![e, n]));
                out.push((l("ffn_gate_exps.weight"), vec![e, f, n]));
                out.push((l("ffn_up_exps.weight"), vec![e, f, n]));
                out.push((l("ffn_down_exps.weight"), vec![f, e, n]));
                if self.expert_selection_bias {
                    out.push((l("exp_probs_b.bias"), vec![n]));
                }
                if self.n_expert_shared > 0 {
                    let fs = f * self.n_expert_shared as u64;
                    out.push((l("ffn_gate_shexp.weight"), vec![e, fs]));
                    out.push((l("ffn_up_shexp.weight"), vec![e, fs]));
                    out.push((l("ffn_down_shexp.weight"), vec![fs, e]));
                }
                if self.has_oss_biases() {
                    out.push((l("ffn_gate_inp.bias"), vec![n]));
                    out.push((l("ffn_gate_exps.bias"), vec![f, n]));
                    out.push((l("ffn_up_exps.bias"), vec![f, n]));
                    out.push((l("ffn_down_exps.bias"), vec![e, n]));
                }
            } else {
                let f = self.n_ff as u64;
                out.push((l("ffn_gate.weight"), vec![e, f]));
                out.push((l("ffn_up.weight"), vec![e, f]));
                out.push((l("ffn_down.weight"), vec![f, e]));
            }
        }
        out
    }

    fn check_tensors(&self, g: &GgufFile) -> Result<()> {
        for (name, expected) in self.expected_tensors() {
            let t = g.require_tensor(&name)?;
            if t.shape != expected {
                return Err(ModelError::ShapeMismatch {
                    path: g.path().to_owned(),
                    tensor: name,
                    found: t.shape.clone(),
                    expected,
                });
            }
        }
        Ok(())
    }
}

/// `{arch}.attention.*` of DeepSeek's latent attention, in either layout (see [`Mla`]), and
/// the per-head key width. `head_dim` and `n_head_kv` are what the file says: in the absorbed
/// layout the latent's single KV head, which is checked against the latent's widths.
fn read_mla(
    g: &GgufFile,
    key: &dyn Fn(&str) -> String,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
) -> Result<(Mla, usize)> {
    let path = g.path();
    let kv_lora_rank = meta_usize(g, &key("attention.kv_lora_rank"))?;
    let q_lora_rank = opt_usize(g, &key("attention.q_lora_rank"))?.unwrap_or(0);
    let value_length = meta_usize(g, &key("attention.value_length"))?;
    let Some(k_mla) = opt_usize(g, &key("attention.key_length_mla"))? else {
        if n_head_kv != n_head {
            return Err(bad_meta(
                path,
                &key("attention.head_count_kv"),
                format!("MLA expands a key and value for every head: {n_head_kv} is not {n_head}"),
            ));
        }
        let mla = Mla {
            q_lora_rank,
            kv_lora_rank,
            v_head_dim: value_length,
            absorbed: false,
        };
        return Ok((mla, head_dim));
    };
    let v_mla = meta_usize(g, &key("attention.value_length_mla"))?;
    let rope = meta_usize(g, &key("rope.dimension_count"))?;
    // The absorbed layout attends as one KV head over [latent, rotated key], the values being
    // the latent: anything else is a layout this reading does not describe.
    let checks = [
        ("attention.head_count_kv", n_head_kv, 1),
        ("attention.key_length", head_dim, kv_lora_rank + rope),
        ("attention.value_length", value_length, kv_lora_rank),
    ];
    for (k, found, want) in checks {
        if found != want {
            return Err(bad_meta(
                path,
                &key(k),
                format!("{found} is not {want}, as the absorbed MLA layout (key_length_mla) has"),
            ));
        }
    }
    if k_mla <= rope {
        return Err(bad_meta(
            path,
            &key("attention.key_length_mla"),
            format!("{k_mla} leaves no non-rotated part beside the {rope} rotated dimensions"),
        ));
    }
    let mla = Mla {
        q_lora_rank,
        kv_lora_rank,
        v_head_dim: v_mla,
        absorbed: true,
    };
    Ok((mla, k_mla))
}

/// Llama 4's attention and layer pattern, as llama.cpp's `llama4` sets them up.
#[derive(Default)]
struct Llama4Attn {
    moe_layer_step: usize,
    swa_pattern: usize,
    chunk: usize,
    no_rope_layer_step: usize,
    rope_qk_rms_norm: bool,
    temperature: Option<AttnTemperature>,
}

/// Reads Llama 4's keys. llama.cpp ignores the file's chunk size: a `sliding_window` of 0
/// turns chunks (and the temperature) off, any other value or none means chunks of 8192 in
/// three of every four layers (`sliding_window_pattern`, 4 by default), and the fourth layers
/// have no RoPE. Keys and features this engine does not implement are refused.
fn read_llama4(
    g: &GgufFile,
    key: &dyn Fn(&str) -> String,
    n_layer: usize,
    n_expert: usize,
) -> Result<Llama4Attn> {
    let path = g.path();
    if n_expert == 0 {
        return Err(bad_meta(
            path,
            &key("expert_count"),
            "llama4 needs experts (llama.cpp refuses a model without)".into(),
        ));
    }
    let moe_layer_step = meta_usize(g, &key("interleave_moe_layer_step"))?;
    for k in ["attention.scale", "attention.temperature_scale"] {
        if let Some(v) = opt_f32(g, &key(k))? {
            if v != 0.0 {
                return Err(bad_meta(path, &key(k), format!("{v} is not supported")));
            }
        }
    }
    let chunked = opt_usize(g, &key("attention.sliding_window"))? != Some(0);
    if !chunked {
        // llama.cpp: "always use rope", by a step of n_layer (so its last layer has none).
        return Ok(Llama4Attn {
            moe_layer_step,
            no_rope_layer_step: n_layer,
            rope_qk_rms_norm: n_expert != 128,
            ..Llama4Attn::default()
        });
    }
    let pattern = opt_usize(g, &key("attention.sliding_window_pattern"))?.unwrap_or(4);
    if pattern == 0 {
        return Err(bad_meta(
            path,
            &key("attention.sliding_window_pattern"),
            "must be positive".into(),
        ));
    }
    Ok(Llama4Attn {
        moe_layer_step,
        swa_pattern: pattern,
        chunk: 8192,
        no_rope_layer_step: 4,
        rope_qk_rms_norm: n_expert != 128,
        temperature: Some(AttnTemperature {
            floor_scale: 8192,
            scale: 0.1,
            offset: 1.0,
        }),
    })
}

/// `{arch}.expert_group_count` / `expert_group_used_count` (group-limited routing), checked as
/// llama.cpp checks them: groups divide the experts, and fewer groups are used than exist.
fn read_expert_groups(
    g: &GgufFile,
    key: &dyn Fn(&str) -> String,
    n_expert: usize,
) -> Result<(usize, usize)> {
    let groups = opt_usize(g, &key("expert_group_count"))?.unwrap_or(0);
    let used = opt_usize(g, &key("expert_group_used_count"))?.unwrap_or(0);
    if groups <= 1 {
        return Ok((0, 0));
    }
    if n_expert == 0 || !n_expert.is_multiple_of(groups) || groups >= n_expert {
        return Err(bad_meta(
            g.path(),
            &key("expert_group_count"),
            format!("{groups} groups do not divide the {n_expert} experts"),
        ));
    }
    if used == 0 || used >= groups {
        return Err(bad_meta(
            g.path(),
            &key("expert_group_used_count"),
            format!("{used} must be between 1 and the group count {groups} (exclusive)"),
        ));
    }
    Ok((groups, used))
}

/// `{arch}.rope.scaling.*`: none (also when the type is absent or the factor is 1), linear or
/// YaRN; other kinds, and YaRN's DeepSeek log multiplier, are refused by name.
fn read_rope_scaling(
    g: &GgufFile,
    key: &dyn Fn(&str) -> String,
    context_length: usize,
) -> Result<RopeScaling> {
    let path = g.path();
    let kind = match g.meta(&key("rope.scaling.type")) {
        None => "linear",
        Some(v) => v
            .as_str()
            .ok_or_else(|| bad_meta(path, &key("rope.scaling.type"), "is not a string".into()))?,
    };
    let factor = opt_f32(g, &key("rope.scaling.factor"))?.unwrap_or(1.0);
    match kind {
        "none" => Ok(RopeScaling::None),
        "linear" if factor == 1.0 => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor }),
        "yarn" => {
            // The converter stores 0.1·mscale_all_dim; llama.cpp divides the factor out.
            let log_mul =
                opt_f32(g, &key("rope.scaling.yarn_log_multiplier"))?.map_or(0.0, |m| m / 0.1);
            let orig_ctx = opt_usize(g, &key("rope.scaling.original_context_length"))?
                .unwrap_or(context_length);
            Ok(RopeScaling::Yarn {
                factor,
                orig_ctx,
                beta_fast: opt_f32(g, &key("rope.scaling.yarn_beta_fast"))?.unwrap_or(32.0),
                beta_slow: opt_f32(g, &key("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
                attn_factor: opt_f32(g, &key("rope.scaling.attn_factor"))?.unwrap_or(1.0),
                log_mul,
            })
        }
        other => Err(bad_meta(
            path,
            &key("rope.scaling.type"),
            format!("RoPE scaling {other:?} is not supported"),
        )),
    }
}

fn bad_meta(path: &Path, key: &str, what: String) -> ModelError {
    ModelError::BadMetadata {
        path: path.to_owned(),
        key: key.to_string(),
        what,
    }
}

fn meta_str<'a>(g: &'a GgufFile, key: &str) -> Result<&'a str> {
    g.meta(key)
        .ok_or_else(|| bad_meta(g.path(), key, "is missing".into()))?
        .as_str()
        .ok_or_else(|| bad_meta(g.path(), key, "is not a string".into()))
}

/// Upper bound for any count or size read from metadata, so arithmetic on them cannot overflow.
const MAX_DIM: u64 = 1 << 24;

fn opt_usize(g: &GgufFile, key: &str) -> Result<Option<usize>> {
    match g.meta(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= MAX_DIM => Ok(Some(n as usize)),
            Some(n) => Err(bad_meta(g.path(), key, format!("{n} is implausibly large"))),
            None => Err(bad_meta(g.path(), key, "is not an integer".into())),
        },
    }
}

fn meta_usize(g: &GgufFile, key: &str) -> Result<usize> {
    match opt_usize(g, key)? {
        Some(n) if n > 0 => Ok(n),
        Some(_) => Err(bad_meta(g.path(), key, "must be positive".into())),
        None => Err(bad_meta(g.path(), key, "is missing".into())),
    }
}

fn opt_f32(g: &GgufFile, key: &str) -> Result<Option<f32>> {
    match g.meta(key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x as f32)),
            _ => Err(bad_meta(g.path(), key, "is not a positive number".into())),
        },
    }
}
