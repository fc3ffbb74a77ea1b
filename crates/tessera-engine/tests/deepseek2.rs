//! deepseek2 (DeepSeek-V2/V3, Kimi K2) on its committed synthetic fixtures (Q8_0 by
//! llama-quantize): `tiny-deepseek2-Q8_0` has DeepSeek-V3's parts (low-rank queries, latent
//! KV, a dense first layer, sigmoid gating with a selection bias in 4 groups of which 2 are
//! used, normalised and scaled weights, a shared expert); `tiny-deepseek2-lite-Q8_0`
//! DeepSeek-V2-Lite's (a plain query projection, softmax gating, two shared experts);
//! `tiny-deepseek2-mla-Q8_0` is the first's weights in the absorbed layout current converters
//! write (`attn_k_b`/`attn_v_b`, one KV head over the latent); `tiny-deepseek2-mla-Q5_0` the
//! same file quantized to Q5_0 (the type llama-quantize gives `attn_k_b` in a Q4_K_M file,
//! whose 128-wide rows K-quants cannot hold).
//!
//! Each layout runs as llama.cpp runs it: the absorbed one caching one latent per position,
//! `attn_kv_b` files every head's expanded key and value.
//!
//! Greedy tokens equal llama.cpp's; every pipeline cut and routed experts split in 2 and 3
//! parts (the shared experts with the first part) are bit-identical to the whole model, and so
//! is the model with its routed experts streamed from disk. (Teacher-forced agreement with
//! llama.cpp is checked by `reference.rs`, which reads every file in `reference/`.)

mod common;

use common::moe;
use tessera_engine::{KvShape, KvType};
use tessera_model::{Architecture, ExpertGating, ModelConfig, RopeScaling};

const MODELS: [&str; 4] = [
    "tiny-deepseek2-Q8_0",
    "tiny-deepseek2-lite-Q8_0",
    "tiny-deepseek2-mla-Q8_0",
    "tiny-deepseek2-mla-Q5_0",
];
fn file(name: &str) -> String {
    format!("{name}.gguf")
}

#[test]
fn fixtures_have_deepseek2_parts() {
    let g = common::open(&file(MODELS[0]));
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    assert_eq!(cfg.arch, Architecture::DeepSeek2);
    let mla = cfg.mla.unwrap();
    assert_eq!(
        (mla.q_lora_rank, mla.kv_lora_rank, mla.v_head_dim),
        (64, 64, 32)
    );
    assert_eq!((cfg.head_dim, cfg.rope_dim, cfg.v_head_dim()), (48, 16, 32));
    assert_eq!((cfg.n_layer_dense_lead, cfg.n_expert_shared), (1, 1));
    assert_eq!(cfg.gating, ExpertGating::Sigmoid);
    assert!(cfg.expert_selection_bias && cfg.norm_topk_weights);
    assert_eq!(cfg.expert_weights_scale, 2.5);
    assert_eq!((cfg.expert_groups, cfg.expert_groups_used), (4, 2));
    // DeepSeek-V3's YaRN: factor 40 over 4096 positions, mscale_all_dim 1; the attention
    // scale carries (1 + 0.1·ln 40)² as llama.cpp's kq_scale does.
    assert!(
        matches!(
            cfg.rope_scaling,
            RopeScaling::Yarn { factor, orig_ctx: 4096, log_mul, .. } if factor == 40.0 && log_mul == 1.0
        ),
        "{:?}",
        cfg.rope_scaling
    );
    let m = 1.0 + 0.1 * 40f32.ln();
    assert!((cfg.attention_scale() - m * m / 48f32.sqrt()).abs() < 1e-6);
    let moe: Vec<bool> = (0..cfg.n_layer).map(|l| cfg.is_moe_layer(l)).collect();
    assert_eq!(moe, [false, true, true, true]);
    // As llama.cpp runs an attn_kv_b file: keys (48 wide) and values (32 wide) of every head
    // are expanded and cached.
    let m = common::full(&g, 1);
    let shape = m.kv_shape();
    assert_eq!(
        (shape.n_head_kv, shape.k_head_dim, shape.v_head_dim),
        (4, 48, 32)
    );
    assert!(!mla.absorbed && !shape.shared_v);

    // The absorbed file reads as the same model, and caches one latent per position: the
    // 64-wide latent and the 16 rotated dimensions, the values read from the latent.
    let g2 = common::open(&file(MODELS[2]));
    let cfg2 = ModelConfig::from_gguf(&g2).unwrap();
    assert!(cfg2.mla.unwrap().absorbed);
    let mut same = cfg2.clone();
    same.mla.as_mut().unwrap().absorbed = false;
    assert_eq!(same, cfg);
    let shape = common::full(&g2, 1).kv_shape();
    assert_eq!(
        (shape.n_head_kv, shape.k_head_dim, shape.v_head_dim),
        (1, 80, 64)
    );
    assert!(shape.shared_v && shape.v_width() == 0);
    assert_eq!(KvType::F16.bytes_per_position(shape), 80 * 2);

    let g = common::open(&file(MODELS[1]));
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    assert_eq!(cfg.mla.unwrap().q_lora_rank, 0);
    assert_eq!(cfg.gating, ExpertGating::Softmax);
    assert!(!cfg.expert_selection_bias && !cfg.norm_topk_weights);
    assert_eq!((cfg.expert_groups, cfg.n_expert_shared), (0, 2));
}

/// Free-running greedy generation from each reference prompt reproduces llama.cpp's 32 tokens.
#[test]
fn greedy_tokens_equal_llama_cpp() {
    for name in MODELS {
        moe::greedy_tokens_equal_llama_cpp(name);
    }
}

#[test]
fn deepseek2_pipeline_split_is_bit_identical_at_every_cut() {
    for name in MODELS {
        moe::pipeline_cuts_are_bit_identical(&file(name));
    }
}

#[test]
fn deepseek2_expert_split_in_2_and_3_is_bit_identical() {
    for name in MODELS {
        moe::expert_splits_are_bit_identical(&file(name));
    }
}

#[test]
fn deepseek2_streamed_experts_are_bit_identical() {
    for name in MODELS {
        // Room for a few of the routed experts: most reads miss and evict.
        moe::streamed_experts_are_bit_identical(&file(name), 100 << 10);
    }
}

#[test]
fn profile_counts_what_the_engine_caches_and_shows_the_parts() {
    // attn_kv_b: 4 heads' keys (48) and values (32); absorbed: the 64-wide latent and 16
    // rotated dimensions.
    for (name, layout, floats) in [
        (
            MODELS[0],
            "attn_kv_b, 320 cached per position",
            4 * (48 + 32),
        ),
        (
            MODELS[2],
            "attn_k_b/attn_v_b, 80 cached per position",
            64 + 16,
        ),
    ] {
        let g = common::open(&file(name));
        let p = tessera_model::ModelProfile::from_gguf(&g).unwrap();
        let cfg = &p.config;
        // At F32, as the profile counts, and as the engine's cache holds.
        assert_eq!(p.kv_bytes_per_token, (cfg.n_layer * floats * 4) as u64);
        let m = common::full(&g, 1).with_kv_type(KvType::F32).unwrap();
        assert_eq!(
            m.kv_bytes_for(64),
            p.kv_bytes_per_token * 64,
            "{name}: the engine's cache and the profile agree"
        );
        // What `tessera inspect` prints names deepseek2's parts.
        let shown = p.to_string();
        for part in [
            "deepseek2",
            "latent (MLA): KV latent of 64, keys 48 (16 rotated), values 32, queries through rank 64",
            layout,
            "1 dense first",
            "1 shared expert(s) of FFN 64",
            "Sigmoid gating, selection bias, best 2 of 4 groups, normalised, weights x2.5",
        ] {
            assert!(shown.contains(part), "{part} missing from\n{shown}");
        }
    }
}

/// A file that says it is in the absorbed layout (`key_length_mla`) but describes expanded
/// heads is refused by name rather than run as either layout.
#[test]
fn inconsistent_absorbed_mla_metadata_is_refused_by_name() {
    let bytes = std::fs::read(common::model_path(&file(MODELS[0]))).unwrap();
    // Three more key-value pairs after the header's counts (u64 key length, key, u32 type,
    // value): key_length_mla and value_length_mla as u32 (type 4) and a u8 (type 0) filler, 128
    // bytes in all, so the data section keeps its 32-byte alignment.
    let mut kv = Vec::new();
    let mut put = |key: &[u8], ty: u32, value: &[u8]| {
        kv.extend_from_slice(&(key.len() as u64).to_le_bytes());
        kv.extend_from_slice(key);
        kv.extend_from_slice(&ty.to_le_bytes());
        kv.extend_from_slice(value);
    };
    put(
        b"deepseek2.attention.key_length_mla",
        4,
        &48u32.to_le_bytes(),
    );
    put(
        b"deepseek2.attention.value_length_mla",
        4,
        &32u32.to_le_bytes(),
    );
    put(b"general.dummy", 0, &[0]);
    assert_eq!(kv.len(), 128);
    let mut edited = bytes[..24].to_vec();
    let n_kv = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
    edited[16..24].copy_from_slice(&(n_kv + 3).to_le_bytes());
    edited.extend_from_slice(&kv);
    edited.extend_from_slice(&bytes[24..]);
    let g = tessera_model::GgufFile::parse(&edited).unwrap();
    let err = ModelConfig::from_gguf(&g).unwrap_err().to_string();
    assert!(
        err.contains("head_count_kv") && err.contains("absorbed MLA layout"),
        "{err}"
    );
}

/// DeepSeek-V3's attention (61 layers, 128 heads, keys 192 wide with 64 rotated, values 128, a
/// latent of 512): the absorbed layout caches 576 values a layer per position, the planner's
/// figure for DeepSeek-V3's config.json; the `attn_kv_b` layout 128 heads' keys and values.
#[test]
fn deepseek_v3_caches_576_values_a_layer_in_the_absorbed_layout() {
    let g = common::open(&file(MODELS[2]));
    let mut cfg = ModelConfig::from_gguf(&g).unwrap();
    (cfg.n_layer, cfg.n_head, cfg.n_head_kv) = (61, 128, 128);
    (cfg.head_dim, cfg.rope_dim) = (192, 64);
    let m = cfg.mla.as_mut().unwrap();
    (m.kv_lora_rank, m.v_head_dim) = (512, 128);
    let per_token =
        |cfg: &ModelConfig| cfg.n_layer * KvType::F16.bytes_per_position(KvShape::from_config(cfg));
    assert_eq!(per_token(&cfg), 61 * 576 * 2); // 70,272 bytes a token at F16
    cfg.mla.as_mut().unwrap().absorbed = false;
    assert_eq!(per_token(&cfg), 61 * 128 * (192 + 128) * 2); // 4,997,120
}
