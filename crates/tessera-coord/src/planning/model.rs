//! The planner's view of a GGUF model (the one conversion the CLI's `tessera plan` and the
//! coordinator's `--plan auto` both use).

use tessera_plan::{Bytes, LayerProfile, ModelError, ModelProfile};

/// The planner's view of a GGUF model, from the header profile `tessera inspect` prints: real
/// per-tensor bytes (the file's quantisation mix), KV bytes and FLOPs per token. `fallback_name`
/// names the model when its header does not.
pub fn planner_model(
    p: &tessera_model::ModelProfile,
    fallback_name: &str,
) -> Result<ModelProfile, ModelError> {
    let c = &p.config;
    let (h, q, kv) = (
        c.n_embd as u64,
        (c.n_head * c.head_dim) as u64,
        (c.n_head_kv * c.head_dim) as u64,
    );
    let n_layer = p.layers.len().max(1) as u64;
    let attn_params = h * q + 2 * h * kv + q * h;
    let layers = p
        .layers
        .iter()
        .map(|l| {
            let moe = !l.experts.is_empty();
            let expert_params = 3 * h * c.n_ff_expert as u64;
            let dense_params = if moe { 0 } else { 3 * h * c.n_ff as u64 };
            let router_params = if moe { h * c.n_expert as u64 } else { 0 };
            let used = if moe { c.n_expert_used as u64 } else { 0 };
            LayerProfile {
                attention: Bytes(l.attention),
                dense_ffn: Bytes(l.dense_ffn),
                router: Bytes(l.router),
                expert: Bytes(l.experts.first().copied().unwrap_or(0)),
                n_expert: if moe { l.experts.len() as u32 } else { 0 },
                n_expert_used: used as u32,
                kv_per_token: Bytes(p.kv_bytes_per_token / n_layer),
                flops_per_token: 2.0
                    * (attn_params + dense_params + router_params + used * expert_params) as f64,
                attn_flops_per_ctx_token: 4.0 * q as f64,
                expert_flops_per_token: if moe { 2.0 * expert_params as f64 } else { 0.0 },
            }
        })
        .collect();
    let head = if p.head_bytes == 0 {
        p.embedding_bytes
    } else {
        p.head_bytes
    };
    let profile = ModelProfile {
        name: p.name.clone().unwrap_or_else(|| fallback_name.to_string()),
        arch: c.arch.gguf_name().to_string(),
        quant: p.weight_type.parse().ok(),
        hidden_size: h,
        vocab_size: c.vocab_size as u64,
        embedding: Bytes(p.embedding_bytes),
        head: Bytes(head + p.output_norm_bytes),
        tied_embeddings: p.head_bytes == 0,
        head_flops_per_token: 2.0 * (c.vocab_size as u64 * h) as f64,
        n_expert: if c.is_moe() { c.n_expert as u32 } else { 0 },
        n_expert_used: if c.is_moe() {
            c.n_expert_used as u32
        } else {
            0
        },
        layers,
    };
    profile.validate()?;
    Ok(profile)
}
