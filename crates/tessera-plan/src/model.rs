//! The planner's view of a model: weight bytes per layer and per expert, KV bytes per token and FLOPs
//! per token. Built from a Hugging Face `config.json` plus a quantisation choice (so a user can plan
//! before downloading), or converted from a GGUF header profile by the caller.

use crate::units::Bytes;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A weight quantisation, with its average storage cost in bits per weight (GGUF block formats,
/// scales included).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Quant {
    Q4_0,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    F16,
    BF16,
    F32,
}

impl Quant {
    pub const ALL: [Self; 8] = [
        Self::Q4_0,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::Q8_0,
        Self::F16,
        Self::BF16,
        Self::F32,
    ];

    /// Bits per weight: Q4_0 4.5, Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625, Q8_0 8.5, F16/BF16 16, F32 32.
    pub fn bits_per_weight(self) -> f64 {
        match self {
            Self::Q4_0 | Self::Q4_K => 4.5,
            Self::Q5_K => 5.5,
            Self::Q6_K => 6.5625,
            Self::Q8_0 => 8.5,
            Self::F16 | Self::BF16 => 16.0,
            Self::F32 => 32.0,
        }
    }

    /// Bytes for `params` weights in this format.
    pub fn bytes(self, params: u64) -> Bytes {
        Bytes::from_f64(params as f64 * self.bits_per_weight() / 8.0)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
            Self::Q8_0 => "Q8_0",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::F32 => "F32",
        }
    }
}

impl fmt::Display for Quant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Quant {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, ModelError> {
        let u = s.trim().to_ascii_uppercase();
        let u = u
            .strip_suffix("_M")
            .or_else(|| u.strip_suffix("_S"))
            .unwrap_or(&u);
        Self::ALL
            .into_iter()
            .find(|q| q.name() == u)
            .ok_or_else(|| ModelError::UnknownQuant(s.to_string()))
    }
}

/// Errors building a model profile.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("config.json is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error(
        "unsupported model_type {0:?} (supported: llama, qwen2, qwen3, qwen3_moe, mixtral, \
         gpt_oss, deepseek_v2, deepseek_v3, kimi_k2, glm4_moe, llama4)"
    )]
    UnsupportedArch(String),
    #[error("config.json lacks {0:?}")]
    Missing(&'static str),
    #[error("config.json field {0:?} has an impossible value")]
    Invalid(&'static str),
    #[error("unknown quantisation {0:?} (known: Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, F16, BF16, F32)")]
    UnknownQuant(String),
    #[error("model profile is inconsistent: {0}")]
    Inconsistent(String),
}

/// One transformer block, as bytes and FLOPs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerProfile {
    /// Attention projections, their norms and biases, and the block's input/post-attention norms.
    pub attention: Bytes,
    /// Dense FFN (zero for a layer whose FFN is all experts).
    pub dense_ffn: Bytes,
    /// MoE router (gate) weights; zero for a dense layer.
    pub router: Bytes,
    /// Bytes of one expert (gate, up and down); zero for a dense layer.
    pub expert: Bytes,
    /// Experts in this layer (0 for a dense layer).
    pub n_expert: u32,
    /// Experts each token uses in this layer.
    pub n_expert_used: u32,
    /// KV-cache bytes this layer stores per token of context (with latent attention, the
    /// compressed latent and the rotary key).
    pub kv_per_token: Bytes,
    /// A sliding-window layer's window in tokens: it caches and attends to at most this many
    /// positions, however long the context. `None`: the whole context.
    #[serde(default)]
    pub kv_window: Option<u64>,
    /// Matrix FLOPs per token for this layer's active weights (2 per active weight), excluding the
    /// context-dependent attention scores.
    pub flops_per_token: f64,
    /// Attention-score FLOPs per token per token of context (QK^T and AV; with latent attention
    /// in the absorbed form, both over the latent).
    pub attn_flops_per_ctx_token: f64,
    /// FLOPs per token of one expert.
    pub expert_flops_per_token: f64,
}

impl LayerProfile {
    pub fn is_moe(&self) -> bool {
        self.n_expert > 0
    }
    /// Everything in the layer that is not an expert: attention, router and dense FFN.
    pub fn non_expert(&self) -> Bytes {
        self.attention + self.router + self.dense_ffn
    }
    /// All the layer's weights.
    pub fn resident(&self) -> Bytes {
        self.non_expert() + Bytes(self.expert.0 * u64::from(self.n_expert))
    }
    /// Weight bytes read per token at batch 1.
    pub fn active(&self) -> Bytes {
        self.non_expert() + Bytes(self.expert.0 * u64::from(self.n_expert_used))
    }
    /// Positions this layer caches at `ctx_tokens` of context.
    pub fn kv_tokens(&self, ctx_tokens: u64) -> u64 {
        self.kv_window.map_or(ctx_tokens, |w| ctx_tokens.min(w))
    }
    /// KV-cache bytes this layer holds for one sequence at `ctx_tokens` of context.
    pub fn kv_bytes_at(&self, ctx_tokens: u64) -> Bytes {
        Bytes(self.kv_per_token.0 * self.kv_tokens(ctx_tokens))
    }
}

/// The planner's model input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    pub name: String,
    pub arch: String,
    /// The quantisation the byte figures assume, if uniform.
    pub quant: Option<Quant>,
    pub hidden_size: u64,
    pub vocab_size: u64,
    /// Token embedding matrix.
    pub embedding: Bytes,
    /// Output head (final norm and output projection). With tied embeddings this is the embedding
    /// matrix again: a stage that holds the head but not the embedding must still load it.
    pub head: Bytes,
    pub tied_embeddings: bool,
    /// FLOPs per token of the output head.
    pub head_flops_per_token: f64,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub layers: Vec<LayerProfile>,
}

impl ModelProfile {
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
    pub fn is_moe(&self) -> bool {
        self.layers.iter().any(LayerProfile::is_moe)
    }
    pub fn moe_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.is_moe()).count()
    }
    /// All weight bytes (the head counted once when tied).
    pub fn total_weights(&self) -> Bytes {
        let layers: Bytes = self.layers.iter().map(LayerProfile::resident).sum();
        layers
            + self.embedding
            + if self.tied_embeddings {
                Bytes::ZERO
            } else {
                self.head
            }
    }
    /// Weight bytes read per token at batch 1.
    pub fn active_weights(&self) -> Bytes {
        self.layers.iter().map(LayerProfile::active).sum::<Bytes>() + self.head
    }
    /// KV bytes per cached position summed over the layers (sliding-window layers included: see
    /// [`Self::kv_bytes_at`] for what a context actually holds).
    pub fn kv_per_token(&self) -> Bytes {
        self.layers.iter().map(|l| l.kv_per_token).sum()
    }
    /// KV-cache bytes of one sequence at `ctx_tokens` of context, sliding-window layers holding
    /// at most their window.
    pub fn kv_bytes_at(&self, ctx_tokens: u64) -> Bytes {
        self.layers.iter().map(|l| l.kv_bytes_at(ctx_tokens)).sum()
    }
    /// Bytes of one token's hidden state on the wire (f32).
    pub fn hidden_wire_bytes(&self) -> f64 {
        self.hidden_size as f64 * 4.0
    }

    /// Checks the invariants the planner relies on.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Inconsistent(m));
        if self.layers.is_empty() {
            return bad("no layers".into());
        }
        if self.hidden_size == 0 {
            return bad("hidden_size is 0".into());
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.is_moe() && (l.n_expert_used == 0 || l.n_expert_used > l.n_expert) {
                return bad(format!(
                    "layer {i}: uses {} of {} experts",
                    l.n_expert_used, l.n_expert
                ));
            }
            if l.is_moe() && (l.n_expert != self.n_expert || l.n_expert_used != self.n_expert_used)
            {
                return bad(format!("layer {i}: expert counts differ from the model's"));
            }
        }
        Ok(())
    }

    /// Builds a profile from a Hugging Face `config.json` (llama, qwen2, qwen3, qwen3_moe, mixtral,
    /// gpt_oss, deepseek_v2/v3 and kimi_k2, glm4_moe) with every matrix stored in `quant`; norms,
    /// biases, sinks and the MoE router are counted as F32, as GGUF converters keep them. The KV
    /// cache is F16; multi-head latent attention (DeepSeek) caches one compressed latent and
    /// rotary key per token and layer and attends in the absorbed form (scores and values over
    /// the latent, as llama.cpp does). Shared experts count as the MoE layer's dense FFN (they
    /// run where the layer's attention does). Sliding-window layers (`layer_types` entries
    /// `sliding_attention`, or gpt-oss's even layers when the list is absent) hold and attend
    /// to `sliding_window` positions.
    pub fn from_hf_config(config_json: &str, quant: Quant) -> Result<Self, ModelError> {
        let top: serde_json::Value = serde_json::from_str(config_json)?;
        let mut arch = top
            .get("model_type")
            .and_then(|x| x.as_str())
            .ok_or(ModelError::Missing("model_type"))?
            .to_string();
        // Llama 4's checkpoints nest the language model's config in `text_config` (beside the
        // vision encoder's, which is not planned).
        let v = match (arch.as_str(), top.get("text_config")) {
            ("llama4", Some(text)) => {
                let mut text = text.clone();
                if let (Some(t), Some(name)) = (text.as_object_mut(), top.get("_name_or_path")) {
                    t.insert("_name_or_path".into(), name.clone());
                }
                text
            }
            _ => top.clone(),
        };
        if arch == "llama4_text" {
            arch = "llama4".into();
        }
        if !matches!(
            arch.as_str(),
            "llama"
                | "qwen2"
                | "qwen3"
                | "qwen3_moe"
                | "mixtral"
                | "gpt_oss"
                | "deepseek_v2"
                | "deepseek_v3"
                | "kimi_k2"
                | "glm4_moe"
                | "llama4"
        ) {
            return Err(ModelError::UnsupportedArch(arch));
        }
        let deepseek = matches!(arch.as_str(), "deepseek_v2" | "deepseek_v3" | "kimi_k2");
        let llama4 = arch == "llama4";
        let shared_style = deepseek || arch == "glm4_moe";
        let get = |k: &'static str| v.get(k).and_then(serde_json::Value::as_u64);
        let need = |k: &'static str| get(k).ok_or(ModelError::Missing(k));
        let hidden = need("hidden_size")?;
        let n_layers = need("num_hidden_layers")?;
        let n_head = need("num_attention_heads")?;
        let n_kv = get("num_key_value_heads").unwrap_or(n_head);
        let vocab = need("vocab_size")?;
        if hidden == 0 || n_layers == 0 || n_head == 0 || n_kv == 0 || vocab == 0 {
            return Err(ModelError::Invalid(
                "hidden_size/num_hidden_layers/heads/vocab_size",
            ));
        }
        let head_dim = get("head_dim").unwrap_or(hidden / n_head);
        if head_dim == 0 {
            return Err(ModelError::Invalid("head_dim"));
        }
        let tied = v
            .get("tie_word_embeddings")
            .and_then(|x| x.as_bool())
            .unwrap_or(false);

        let (n_expert, n_used, expert_ffn, dense_ffn) = match arch.as_str() {
            "gpt_oss" => (
                get("num_local_experts")
                    .or(get("num_experts"))
                    .ok_or(ModelError::Missing("num_local_experts"))?,
                get("num_experts_per_tok")
                    .or(get("experts_per_token"))
                    .ok_or(ModelError::Missing("num_experts_per_tok"))?,
                need("intermediate_size")?,
                0,
            ),
            _ if shared_style => (
                need("n_routed_experts")?,
                need("num_experts_per_tok")?,
                need("moe_intermediate_size")?,
                need("intermediate_size")?,
            ),
            "qwen3_moe" => (
                need("num_experts")?,
                need("num_experts_per_tok")?,
                need("moe_intermediate_size")?,
                get("intermediate_size").unwrap_or(0),
            ),
            "mixtral" => (
                need("num_local_experts")?,
                need("num_experts_per_tok")?,
                need("intermediate_size")?,
                0,
            ),
            // Llama 4: `intermediate_size` is an expert's, `intermediate_size_mlp` the dense
            // layers'.
            "llama4" => (
                need("num_local_experts")?,
                need("num_experts_per_tok")?,
                need("intermediate_size")?,
                need("intermediate_size_mlp")?,
            ),
            _ => (0, 0, 0, need("intermediate_size")?),
        };
        if n_expert > 0 && (n_used == 0 || n_used > n_expert || expert_ffn == 0) {
            return Err(ModelError::Invalid("num_experts_per_tok"));
        }
        let sparse_step = if llama4 {
            get("interleave_moe_layer_step").unwrap_or(1).max(1)
        } else {
            get("decoder_sparse_step").unwrap_or(1).max(1)
        };
        let mlp_only: Vec<u64> = v
            .get("mlp_only_layers")
            .and_then(|x| x.as_array())
            .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();

        let f32b = |n: u64| Bytes(n * 4);
        let q_dim = n_head * head_dim;
        let kv_dim = n_kv * head_dim;
        let bias = v
            .get("attention_bias")
            .and_then(|x| x.as_bool())
            .unwrap_or(false);
        let mut attn_params = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden;
        let mut attn_small = 2 * hidden; // input + post-attention norms
        let mut kv_per_token = Bytes(2 * kv_dim * 2); // K and V, f16
        let mut attn_flops_ctx = (4 * q_dim) as f64;
        if arch == "qwen2" || bias {
            attn_small += q_dim + 2 * kv_dim; // q, k, v biases
        }
        if arch.starts_with("qwen3")
            || (arch == "glm4_moe" && v.get("use_qk_norm").and_then(|x| x.as_bool()) == Some(true))
        {
            attn_small += 2 * head_dim; // q_norm, k_norm
        }
        if arch == "gpt_oss" {
            attn_small += hidden + n_head; // output bias, one sink per head
        }
        if deepseek {
            // Multi-head latent attention: queries through a low-rank q_a/q_b pair (or one
            // projection), keys and values from one compressed latent of kv_lora_rank plus a
            // shared rotary key.
            let q_lora = get("q_lora_rank").unwrap_or(0);
            let kv_lora = need("kv_lora_rank")?;
            let nope = need("qk_nope_head_dim")?;
            let rope = need("qk_rope_head_dim")?;
            let v_dim = need("v_head_dim")?;
            let q_head = nope + rope;
            let q_params = if q_lora > 0 {
                hidden * q_lora + q_lora * n_head * q_head
            } else {
                hidden * n_head * q_head
            };
            attn_params = q_params
                + hidden * (kv_lora + rope)
                + kv_lora * n_head * (nope + v_dim)
                + n_head * v_dim * hidden;
            attn_small = 2 * hidden + q_lora + kv_lora;
            kv_per_token = Bytes((kv_lora + rope) * 2);
            // Absorbed: each head's query meets the latent and rotary key (kv_lora + rope wide)
            // and its output is a weighted sum of latents (kv_lora wide), 2 FLOPs per product.
            attn_flops_ctx = (2 * n_head * (2 * kv_lora + rope)) as f64;
        }
        let window = if llama4 {
            chunked_layers(&v, n_layers)?
        } else {
            sliding_layers(&v, &arch, n_layers)?
        };
        let attention = quant.bytes(attn_params) + f32b(attn_small);
        // Dense first layers (DeepSeek, GLM) and shared experts beside the routed ones.
        let first_dense = if shared_style {
            get("first_k_dense_replace").unwrap_or(0)
        } else {
            0
        };
        let shared_ffn = if shared_style {
            get("n_shared_experts").unwrap_or(0) * expert_ffn
        } else if llama4 {
            expert_ffn // one shared expert as wide as a routed one
        } else {
            0
        };
        // Router bias (gpt-oss) or selection-correction bias (DeepSeek, GLM), and gpt-oss's
        // per-expert biases.
        let router_bias = if arch == "gpt_oss" || shared_style {
            n_expert
        } else {
            0
        };
        let expert_bias = if arch == "gpt_oss" {
            2 * expert_ffn + hidden
        } else {
            0
        };

        let mut layers = Vec::with_capacity(n_layers as usize);
        for i in 0..n_layers {
            let moe = n_expert > 0
                && !mlp_only.contains(&i)
                && (i + 1) % sparse_step == 0
                && i >= first_dense;
            let (dffn, router, expert, ne, nu) = if moe {
                (
                    3 * hidden * shared_ffn,
                    hidden * n_expert,
                    3 * hidden * expert_ffn,
                    n_expert as u32,
                    n_used as u32,
                )
            } else {
                if dense_ffn == 0 {
                    return Err(ModelError::Missing("intermediate_size"));
                }
                (3 * hidden * dense_ffn, 0, 0, 0, 0)
            };
            let active_params = attn_params + dffn + router + expert * u64::from(nu);
            let (router_b, expert_b) = if moe {
                (router_bias, expert_bias)
            } else {
                (0, 0)
            };
            layers.push(LayerProfile {
                attention,
                dense_ffn: quant.bytes(dffn),
                router: f32b(router + router_b),
                expert: quant.bytes(expert) + f32b(expert_b),
                n_expert: ne,
                n_expert_used: nu,
                kv_per_token,
                kv_window: window.get(i as usize).copied().flatten(),
                flops_per_token: 2.0 * active_params as f64,
                attn_flops_per_ctx_token: attn_flops_ctx,
                expert_flops_per_token: 2.0 * expert as f64,
            });
        }
        let name = v
            .get("_name_or_path")
            .and_then(|x| x.as_str())
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .unwrap_or_else(|| format!("{arch}-{n_layers}L-{hidden}h"));
        let emb = quant.bytes(vocab * hidden);
        let profile = Self {
            name,
            arch,
            quant: Some(quant),
            hidden_size: hidden,
            vocab_size: vocab,
            embedding: emb,
            head: emb + f32b(hidden),
            tied_embeddings: tied,
            head_flops_per_token: 2.0 * (vocab * hidden) as f64,
            n_expert: n_expert as u32,
            n_expert_used: n_used as u32,
            layers,
        };
        profile.validate()?;
        Ok(profile)
    }
}

/// Llama 4's chunked layers, each holding `attention_chunk_size` positions: those whose
/// `layer_types` entry is `chunked_attention`, or else those that use RoPE (`no_rope_layers`
/// entry 1; by default all but every fourth layer), as `transformers` decides.
fn chunked_layers(v: &serde_json::Value, n_layers: u64) -> Result<Vec<Option<u64>>, ModelError> {
    let Some(chunk) = v
        .get("attention_chunk_size")
        .and_then(serde_json::Value::as_u64)
        .filter(|&c| c > 0)
    else {
        return Ok(vec![None; n_layers as usize]);
    };
    let flags: Vec<bool> = if let Some(t) = v.get("layer_types").and_then(|x| x.as_array()) {
        t.iter()
            .map(|x| x.as_str() == Some("chunked_attention"))
            .collect()
    } else if let Some(t) = v.get("no_rope_layers").and_then(|x| x.as_array()) {
        t.iter().map(|x| x.as_u64() == Some(1)).collect()
    } else {
        (0..n_layers).map(|i| (i + 1) % 4 != 0).collect()
    };
    if flags.len() as u64 != n_layers {
        return Err(ModelError::Invalid("layer_types"));
    }
    Ok(flags.into_iter().map(|c| c.then_some(chunk)).collect())
}

/// Each layer's sliding window (`None` for full attention), from `sliding_window` and
/// `layer_types`; gpt-oss without `layer_types` slides on even layers (llama.cpp's pattern).
fn sliding_layers(
    v: &serde_json::Value,
    arch: &str,
    n_layers: u64,
) -> Result<Vec<Option<u64>>, ModelError> {
    let window = v.get("sliding_window").and_then(serde_json::Value::as_u64);
    let types = v.get("layer_types").and_then(|x| x.as_array());
    let off = v
        .get("use_sliding_window")
        .and_then(serde_json::Value::as_bool)
        == Some(false);
    let Some(w) = window.filter(|&w| w > 0 && !off) else {
        if arch == "gpt_oss" {
            return Err(ModelError::Missing("sliding_window"));
        }
        return Ok(vec![None; n_layers as usize]);
    };
    match types {
        Some(t) => {
            if t.len() as u64 != n_layers {
                return Err(ModelError::Invalid("layer_types"));
            }
            Ok(t.iter()
                .map(|x| (x.as_str() == Some("sliding_attention")).then_some(w))
                .collect())
        }
        None if arch == "gpt_oss" => Ok((0..n_layers).map(|i| (i % 2 == 0).then_some(w)).collect()),
        // Other families name a window without saying which layers use it (Qwen2's
        // `use_sliding_window` is off in the released models): full attention everywhere.
        None => Ok(vec![None; n_layers as usize]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub const QWEN3_30B_A3B: &str = r#"{"model_type":"qwen3_moe","hidden_size":2048,"num_hidden_layers":48,
        "num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,"intermediate_size":6144,
        "moe_intermediate_size":768,"num_experts":128,"num_experts_per_tok":8,"vocab_size":151936,
        "tie_word_embeddings":false,"decoder_sparse_step":1,"mlp_only_layers":[]}"#;

    #[test]
    fn qwen3_30b_a3b_at_q4_k_is_about_17_gib_with_3b_active() {
        let m = ModelProfile::from_hf_config(QWEN3_30B_A3B, Quant::Q4_K).unwrap();
        assert_eq!(m.n_layers(), 48);
        assert_eq!(m.moe_layers(), 48);
        let gib = m.total_weights().as_gib();
        assert!((15.0..18.0).contains(&gib), "{gib}");
        // ~3.3 B active parameters at 4.5 bits.
        let active = m.active_weights().as_gib();
        assert!((1.5..2.2).contains(&active), "{active}");
        // 48 layers x K,V x 4 heads x 128 x 2 bytes.
        assert_eq!(m.kv_per_token(), Bytes(48 * 2 * 4 * 128 * 2));
    }

    #[test]
    fn quant_names_parse() {
        assert_eq!("q4_k_m".parse::<Quant>().unwrap(), Quant::Q4_K);
        assert_eq!("BF16".parse::<Quant>().unwrap(), Quant::BF16);
        assert!("Q3_K".parse::<Quant>().is_err());
    }

    /// Parameter counts (F32 bytes / 4) of a bundled config, in billions: (total, active).
    fn params_b(config: &str) -> (f64, f64) {
        let m = ModelProfile::from_hf_config(config, Quant::F32).unwrap();
        (
            m.total_weights().0 as f64 / 4e9,
            m.active_weights().0 as f64 / 4e9,
        )
    }

    #[test]
    fn bundled_moe_configs_have_their_published_sizes() {
        // gpt-oss-120b: 116.8 B total, 5.1 B active.
        let (t, a) = params_b(include_str!("../models/gpt-oss-120b.config.json"));
        assert!(
            (116.0..118.0).contains(&t) && (5.0..5.3).contains(&a),
            "{t} {a}"
        );
        // DeepSeek-V3: 671 B total, 37 B active (the multi-token-prediction layer not counted).
        let (t, a) = params_b(include_str!("../models/deepseek-v3.config.json"));
        assert!(
            (665.0..675.0).contains(&t) && (36.0..38.5).contains(&a),
            "{t} {a}"
        );
        // GLM-4.5: 355 B total, 32 B active (its next-token-prediction layer not counted).
        let (t, a) = params_b(include_str!("../models/glm-4.5.config.json"));
        assert!(
            (348.0..358.0).contains(&t) && (31.0..34.0).contains(&a),
            "{t} {a}"
        );
    }

    #[test]
    fn latent_attention_caches_the_compressed_latent() {
        let m = ModelProfile::from_hf_config(
            include_str!("../models/deepseek-v3.config.json"),
            Quant::Q4_K,
        )
        .unwrap();
        // 61 layers x (512 latent + 64 rotary) x 2 bytes, not 128 heads of K and V.
        assert_eq!(m.kv_per_token(), Bytes(61 * 576 * 2));
        assert_eq!(m.layers.iter().filter(|l| !l.is_moe()).count(), 3);
    }

    #[test]
    fn latent_attention_flops_follow_the_absorbed_form() {
        let m = ModelProfile::from_hf_config(
            include_str!("../models/deepseek-v3.config.json"),
            Quant::Q4_K,
        )
        .unwrap();
        // 128 heads x 2 FLOPs x (576 wide scores + 512 wide value sums) per context token.
        for l in &m.layers {
            assert_eq!(l.attn_flops_per_ctx_token, (2 * 128 * (576 + 512)) as f64);
            assert_eq!(l.kv_window, None);
        }
        // At 128K of context one sequence holds 61 x 576 x 2 bytes per token: about 8.6 GiB.
        assert_eq!(m.kv_bytes_at(131_072), Bytes(61 * 576 * 2 * 131_072));
    }

    #[test]
    fn gpt_oss_sliding_layers_hold_a_window_of_kv() {
        let m = ModelProfile::from_hf_config(
            include_str!("../models/gpt-oss-120b.config.json"),
            Quant::Q4_K,
        )
        .unwrap();
        let sliding: Vec<usize> = (0..36)
            .filter(|i| m.layers[*i].kv_window.is_some())
            .collect();
        assert_eq!(sliding, (0..36).step_by(2).collect::<Vec<_>>());
        assert!(m.layers.iter().all(|l| l.kv_window.unwrap_or(128) == 128));
        // K and V, 8 heads of 64, f16: 2,048 bytes per position per layer.
        let per_pos = 2 * 8 * 64 * 2;
        assert_eq!(m.kv_per_token(), Bytes(36 * per_pos));
        // At 128K: 18 full layers hold every position, 18 sliding ones hold 128.
        assert_eq!(
            m.kv_bytes_at(131_072),
            Bytes(per_pos * (18 * 131_072 + 18 * 128))
        );
        // Short contexts fit in the window: every layer holds every position.
        assert_eq!(m.kv_bytes_at(100), Bytes(per_pos * 36 * 100));
    }

    #[test]
    fn gpt_oss_without_layer_types_slides_on_even_layers() {
        let mut v: serde_json::Value =
            serde_json::from_str(include_str!("../models/gpt-oss-120b.config.json")).unwrap();
        v.as_object_mut().unwrap().remove("layer_types");
        let m = ModelProfile::from_hf_config(&v.to_string(), Quant::Q8_0).unwrap();
        for (i, l) in m.layers.iter().enumerate() {
            assert_eq!(l.kv_window, (i % 2 == 0).then_some(128), "layer {i}");
        }
        v.as_object_mut().unwrap().remove("sliding_window");
        let e = ModelProfile::from_hf_config(&v.to_string(), Quant::Q8_0).unwrap_err();
        assert!(matches!(e, ModelError::Missing("sliding_window")), "{e}");
    }

    #[test]
    fn glm_4_5_attends_to_the_whole_context_with_grouped_heads() {
        let m = ModelProfile::from_hf_config(
            include_str!("../models/glm-4.5.config.json"),
            Quant::Q4_K,
        )
        .unwrap();
        assert_eq!(m.n_layers(), 92);
        assert_eq!(m.layers.iter().filter(|l| !l.is_moe()).count(), 3);
        // 8 KV heads of 128, K and V, f16; no window.
        assert!(m.layers.iter().all(|l| l.kv_window.is_none()));
        assert_eq!(m.kv_bytes_at(1000), Bytes(92 * 2 * 8 * 128 * 2 * 1000));
        assert_eq!(m.layers[0].attn_flops_per_ctx_token, (4 * 96 * 128) as f64);
    }

    #[test]
    fn bundled_llama_4_configs_have_their_published_sizes() {
        // Scout: 109 B total with its vision encoder (~1 B, not planned), 17 B active.
        let (t, a) = params_b(include_str!("../models/llama-4-scout.config.json"));
        assert!(
            (105.0..110.0).contains(&t) && (15.5..17.5).contains(&a),
            "{t} {a}"
        );
        // Maverick: 400 B total, 17 B active; MoE every second layer, dense ones between.
        let (t, a) = params_b(include_str!("../models/llama-4-maverick.config.json"));
        assert!(
            (395.0..402.0).contains(&t) && (15.5..17.5).contains(&a),
            "{t} {a}"
        );
        let m = ModelProfile::from_hf_config(
            include_str!("../models/llama-4-maverick.config.json"),
            Quant::Q4_K,
        )
        .unwrap();
        assert_eq!(m.name, "meta-llama/Llama-4-Maverick-17B-128E-Instruct");
        let moe: Vec<bool> = m.layers.iter().map(LayerProfile::is_moe).collect();
        assert_eq!(moe, (0..48).map(|i| i % 2 == 1).collect::<Vec<_>>());
        assert!(m.layers.iter().all(|l| l.n_expert_used <= 1));
    }

    #[test]
    fn llama_4_chunked_layers_hold_a_chunk_and_nope_layers_the_context() {
        let m = ModelProfile::from_hf_config(
            include_str!("../models/llama-4-scout.config.json"),
            Quant::Q4_K,
        )
        .unwrap();
        // Three of every four layers are chunked (8192); every fourth (NoPE) sees everything.
        for (i, l) in m.layers.iter().enumerate() {
            assert_eq!(l.kv_window, ((i + 1) % 4 != 0).then_some(8192), "layer {i}");
        }
        // 8 KV heads of 128, K and V, f16: 4 KiB per position per layer. At 1M tokens of
        // context 12 layers hold every position and 36 hold a chunk.
        let per_pos = 2 * 8 * 128 * 2;
        assert_eq!(
            m.kv_bytes_at(1 << 20),
            Bytes(per_pos * (12 * (1 << 20) + 36 * 8192))
        );
        // `layer_types` (newer configs) decides the same way.
        let mut v: serde_json::Value =
            serde_json::from_str(include_str!("../models/llama-4-scout.config.json")).unwrap();
        let types: Vec<&str> = (0..48)
            .map(|i| {
                if i % 2 == 0 {
                    "chunked_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        v["text_config"]["layer_types"] = serde_json::json!(types);
        let m = ModelProfile::from_hf_config(&v.to_string(), Quant::Q4_K).unwrap();
        assert_eq!(m.layers[0].kv_window, Some(8192));
        assert_eq!(m.layers[1].kv_window, None);
    }

    #[test]
    fn rejects_unknown_arch() {
        let e = ModelProfile::from_hf_config(r#"{"model_type":"gpt2"}"#, Quant::F16).unwrap_err();
        assert!(matches!(e, ModelError::UnsupportedArch(_)));
    }
}
