//! glm4moe (GLM-4.5/4.6, GLM-4.5-Air) on its committed synthetic fixture
//! (`tiny-glm4moe-Q8_0`, Q8_0 by llama-quantize): Q/K/V biases, RoPE on the first half of each
//! head (NeoX order), a dense first layer, sigmoid gating with a selection bias, normalised and
//! scaled weights, a shared expert.
//!
//! Greedy tokens equal llama.cpp's; every pipeline cut and routed experts split in 2 and 3
//! parts (the shared expert with the first part) are bit-identical to the whole model, and so
//! is the model with its routed experts streamed from disk. (Teacher-forced agreement with
//! llama.cpp is checked by `reference.rs`, which reads every file in `reference/`.)

mod common;

use common::moe;
use tessera_model::{Architecture, ExpertGating, ModelConfig, RopeStyle};

const MODELS: [&str; 1] = ["tiny-glm4moe-Q8_0"];
fn file(name: &str) -> String {
    format!("{name}.gguf")
}

#[test]
fn fixture_has_glm4moe_parts() {
    let g = common::open(&file(MODELS[0]));
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    assert_eq!(cfg.arch, Architecture::Glm4Moe);
    assert!(cfg.has_qkv_bias() && !cfg.has_qk_norm());
    assert_eq!(cfg.rope_style, RopeStyle::Neox);
    assert_eq!((cfg.head_dim, cfg.rope_dim), (64, 32));
    assert_eq!((cfg.n_layer_dense_lead, cfg.n_expert_shared), (1, 1));
    assert_eq!(cfg.gating, ExpertGating::Sigmoid);
    assert!(cfg.expert_selection_bias && cfg.norm_topk_weights);
    assert_eq!(cfg.expert_weights_scale, 2.5);
    let moe: Vec<bool> = (0..cfg.n_layer).map(|l| cfg.is_moe_layer(l)).collect();
    assert_eq!(moe, [false, true, true, true]);
    assert!(g.tensor("blk.1.post_attention_norm.weight").is_some());
    let shown = tessera_model::ModelProfile::from_gguf(&g)
        .unwrap()
        .to_string();
    for part in [
        "glm4moe",
        "1 dense first",
        "1 shared expert(s) of FFN 64",
        "Sigmoid gating, selection bias, normalised, weights x2.5",
    ] {
        assert!(shown.contains(part), "{part} missing from\n{shown}");
    }
}

/// Free-running greedy generation from each reference prompt reproduces llama.cpp's 32 tokens.
#[test]
fn greedy_tokens_equal_llama_cpp() {
    for name in MODELS {
        moe::greedy_tokens_equal_llama_cpp(name);
    }
}

#[test]
fn glm4moe_pipeline_split_is_bit_identical_at_every_cut() {
    for name in MODELS {
        moe::pipeline_cuts_are_bit_identical(&file(name));
    }
}

#[test]
fn glm4moe_expert_split_in_2_and_3_is_bit_identical() {
    for name in MODELS {
        moe::expert_splits_are_bit_identical(&file(name));
    }
}

#[test]
fn glm4moe_streamed_experts_are_bit_identical() {
    for name in MODELS {
        // Room for a few of the routed experts: most reads miss and evict.
        moe::streamed_experts_are_bit_identical(&file(name), 100 << 10);
    }
}
