//! The planner's view of a GGUF model (the one conversion the CLI's `tessera plan` and the
//! coordinator's `--plan auto` both use).

use tessera_model::kv::{KvShape, KvType};
use tessera_model::ModelConfig;
use tessera_plan::{Bytes, LayerProfile, ModelError, ModelProfile};

/// The planner's view of a GGUF model, from the header profile `tessera inspect` prints: real
/// per-tensor bytes (the file's quantisation mix), KV bytes and FLOPs per token. `fallback_name`
/// names the model when its header does not.
///
/// Each layer's cache is what the engine keeps in elements of `kv_type` (the nodes' `--kv-type`;
/// the header profile counts F32, twice what the default F16 cache holds): a sliding-window or
/// chunked layer (Llama 4) holds its window or chunk only, and multi-head latent attention in
/// the absorbed layout caches the compressed latent and the rotated key
/// (`kv_lora_rank + rope_dim` per position) and attends over it in the absorbed form.
pub fn planner_model(
    p: &tessera_model::ModelProfile,
    kv_type: KvType,
    fallback_name: &str,
) -> Result<ModelProfile, ModelError> {
    let c = &p.config;
    let h = c.n_embd as u64;
    let attn_params = attention_params(c);
    let kv_per_token = Bytes(kv_type.bytes_per_position(KvShape::from_config(c)) as u64);
    let attn_flops_ctx = attention_flops_per_ctx_token(c);
    let layers = p
        .layers
        .iter()
        .enumerate()
        .map(|(il, l)| {
            let moe = !l.experts.is_empty();
            let expert_params = 3 * h * c.n_ff_expert as u64;
            let dense_params = if moe {
                3 * h * (c.n_ff_expert * c.n_expert_shared) as u64
            } else {
                3 * h * c.n_ff as u64
            };
            let router_params = if moe { h * c.n_expert as u64 } else { 0 };
            let used = if moe { c.n_expert_used as u64 } else { 0 };
            LayerProfile {
                attention: Bytes(l.attention),
                dense_ffn: Bytes(l.dense_ffn),
                router: Bytes(l.router),
                expert: Bytes(l.experts.first().copied().unwrap_or(0)),
                n_expert: if moe { l.experts.len() as u32 } else { 0 },
                n_expert_used: used as u32,
                kv_per_token,
                kv_window: c.layer_window(il).map(|w| w as u64),
                flops_per_token: 2.0
                    * (attn_params + dense_params + router_params + used * expert_params) as f64,
                attn_flops_per_ctx_token: attn_flops_ctx,
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

/// Weights one token multiplies through in a layer's attention projections. With MLA the
/// per-head key and value matrices count once whichever way they are applied: to the latent
/// (`attn_kv_b` files) or, absorbed, to the query and the attended latent.
fn attention_params(c: &ModelConfig) -> u64 {
    let e = c.n_embd as u64;
    let out = c.attn_out_dim() as u64 * e;
    match c.mla {
        None => e * (c.q_dim() + c.kv_dim() + c.v_dim()) as u64 + out,
        Some(m) => {
            let (qr, kvr) = (m.q_lora_rank as u64, m.kv_lora_rank as u64);
            let q = if qr > 0 {
                e * qr + qr * c.q_dim() as u64
            } else {
                e * c.q_dim() as u64
            };
            let nope = (c.head_dim - c.rope_dim) as u64;
            let heads = c.n_head as u64 * kvr * (nope + m.v_head_dim as u64);
            q + e * (kvr + c.rope_dim as u64) + heads + out
        }
    }
}

/// Attention-score FLOPs per token of context (two per product of QKᵀ and of the weighted sum of
/// values). Absorbed MLA scores every head against the cached `[latent, rotated key]` and sums
/// latents; MLA from `attn_kv_b` files expands every head's key and value, as the engine does.
fn attention_flops_per_ctx_token(c: &ModelConfig) -> f64 {
    let heads = c.n_head as u64;
    let per_head = match c.mla {
        Some(m) if m.absorbed => 2 * m.kv_lora_rank as u64 + c.rope_dim as u64,
        _ => (c.head_dim + c.v_head_dim()) as u64,
    };
    (2 * heads * per_head) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_model::GgufFile;

    fn fixture(name: &str) -> ModelProfile {
        let path = format!("{}/../../models/test/{name}", env!("CARGO_MANIFEST_DIR"));
        let g = GgufFile::open(&path).unwrap();
        planner_model(
            &tessera_model::ModelProfile::from_gguf(&g).unwrap(),
            KvType::F32,
            name,
        )
        .unwrap()
    }

    #[test]
    fn gpt_oss_sliding_layers_hold_their_window() {
        let m = fixture("tiny-gpt-oss-MXFP4.gguf");
        let c = {
            let path = format!(
                "{}/../../models/test/tiny-gpt-oss-MXFP4.gguf",
                env!("CARGO_MANIFEST_DIR")
            );
            ModelConfig::from_gguf(&GgufFile::open(&path).unwrap()).unwrap()
        };
        let w = c.sliding_window as u64;
        assert!(w > 0 && c.n_layer >= 2);
        // Even layers slide (llama.cpp's gpt-oss pattern), odd ones see the whole context.
        for (il, l) in m.layers.iter().enumerate() {
            assert_eq!(l.kv_window, (il % 2 == 0).then_some(w), "layer {il}");
            assert_eq!(
                l.kv_per_token,
                Bytes((2 * c.n_head_kv * c.head_dim * 4) as u64)
            );
        }
        let per_pos = m.layers[0].kv_per_token.0;
        let (sliding, full) = (c.n_layer.div_ceil(2) as u64, (c.n_layer / 2) as u64);
        let ctx = 100 * w;
        assert_eq!(
            m.kv_bytes_at(ctx),
            Bytes(per_pos * (full * ctx + sliding * w))
        );
        // Below the window every layer holds every position.
        assert_eq!(
            m.kv_bytes_at(w / 2),
            Bytes(per_pos * c.n_layer as u64 * (w / 2))
        );
    }

    #[test]
    fn the_cache_is_sized_in_the_nodes_kv_type() {
        let path = format!(
            "{}/../../models/test/tiny-qwen3-Q8_0.gguf",
            env!("CARGO_MANIFEST_DIR")
        );
        let p = tessera_model::ModelProfile::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        let per_pos = |t: KvType| planner_model(&p, t, "m").unwrap().layers[0].kv_per_token.0;
        let c = &p.config;
        let elems = (2 * c.n_head_kv * c.head_dim) as u64;
        assert_eq!(per_pos(KvType::F32), elems * 4);
        assert_eq!(per_pos(KvType::F16), elems * 2, "the nodes' default");
        assert_eq!(per_pos(KvType::Q8_0), elems / 32 * 34);
        // Memory at a context follows: half of F32's for the default F16 cache.
        let at = |t: KvType| planner_model(&p, t, "m").unwrap().kv_bytes_at(4096).0;
        assert_eq!(2 * at(KvType::F16), at(KvType::F32));
    }

    #[test]
    fn llama4_chunked_layers_hold_a_chunk_and_dense_layers_alternate() {
        let m = fixture("tiny-llama4-Q8_0.gguf");
        let windows: Vec<Option<u64>> = m.layers.iter().map(|l| l.kv_window).collect();
        assert_eq!(windows, [Some(8192), Some(8192), Some(8192), None]);
        let moe: Vec<bool> = m.layers.iter().map(LayerProfile::is_moe).collect();
        assert_eq!(moe, [false, true, false, true]);
        // 2 KV heads of 32, K and V, F32: 512 bytes per position per layer; past a chunk
        // only the NoPE layer grows.
        assert_eq!(m.layers[0].kv_per_token, Bytes(512));
        assert_eq!(m.kv_bytes_at(100_000), Bytes(512 * (3 * 8192 + 100_000)));
        // The shared expert runs beside the routed one: in the MoE layers' dense FFN.
        assert!(m.layers[1].dense_ffn.0 > 0 && m.layers[1].n_expert_used == 1);
    }

    #[test]
    fn absorbed_mla_caches_the_latent_and_attends_over_it() {
        let path = format!(
            "{}/../../models/test/tiny-deepseek2-mla-Q8_0.gguf",
            env!("CARGO_MANIFEST_DIR")
        );
        let c = ModelConfig::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        let mla = c.mla.unwrap();
        assert!(mla.absorbed);
        let m = fixture("tiny-deepseek2-mla-Q8_0.gguf");
        let latent = (mla.kv_lora_rank + c.rope_dim) as u64;
        for l in &m.layers {
            assert_eq!(l.kv_per_token, Bytes(latent * 4));
            assert_eq!(l.kv_window, None);
            assert_eq!(
                l.attn_flops_per_ctx_token,
                (2 * c.n_head as u64 * (2 * mla.kv_lora_rank as u64 + c.rope_dim as u64)) as f64
            );
        }
        // Smaller than the expanded heads' keys and values the old layout caches.
        let expanded = fixture("tiny-deepseek2-Q8_0.gguf");
        assert!(m.kv_per_token().0 * 2 < expanded.kv_per_token().0);
        // Leading dense layers, then MoE layers with the shared expert in the dense FFN.
        assert_eq!(
            m.layers.iter().filter(|l| !l.is_moe()).count(),
            c.n_layer_dense_lead
        );
        let moe = m.layers.iter().find(|l| l.is_moe()).unwrap();
        assert!(moe.dense_ffn.0 > 0, "shared expert counted");
    }
}
