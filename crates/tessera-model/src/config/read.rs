//! Reading a [`ModelConfig`] from GGUF metadata: the per-architecture readers and the helpers
//! that fetch and check metadata values.

use std::path::Path;

use super::{
    names, Architecture, AttnTemperature, ExpertGating, FfnActivation, Mla, ModelConfig,
    RopeScaling, RopeStyle,
};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

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
