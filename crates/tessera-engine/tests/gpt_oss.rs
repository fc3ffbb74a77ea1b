//! gpt-oss on its committed synthetic fixture (MXFP4 experts by llama-quantize, window 16 on
//! the even layers): every pipeline cut and expert splits in 2 and 3 parts are bit-identical to
//! the whole model, and so is the model with its experts streamed from disk, over a sequence
//! long enough for the sliding window to drop positions. (Agreement with llama.cpp is checked
//! by `reference.rs`, which reads `reference/tiny-gpt-oss-MXFP4-public.json`.)

mod common;

use common::moe;
use tessera_model::{Architecture, ModelConfig, RopeScaling};

const MODEL: &str = "tiny-gpt-oss-MXFP4.gguf";

#[test]
fn fixture_has_gpt_oss_parts() {
    let g = common::open(MODEL);
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    assert_eq!(cfg.arch, Architecture::GptOss);
    assert_eq!((cfg.sliding_window, cfg.swa_pattern), (16, 2));
    let swa: Vec<bool> = (0..cfg.n_layer).map(|l| cfg.is_swa_layer(l)).collect();
    assert_eq!(swa, [true, false, true, false]);
    assert_eq!(cfg.attention_start(0, 40), 25);
    assert_eq!(cfg.attention_start(1, 40), 0);
    assert!(
        matches!(
            cfg.rope_scaling,
            RopeScaling::Yarn { factor, orig_ctx: 4096, .. } if factor == 32.0
        ),
        "{:?}",
        cfg.rope_scaling
    );
    let t = g.tensor("blk.0.ffn_gate_exps.weight").unwrap();
    assert_eq!(tessera_model::GgmlType::name_of_id(t.type_id), "MXFP4");
}

/// Over 20 prompt tokens and 6 decode steps ([`moe::PROMPT`]): past the fixture's window of 16.
#[test]
fn gpt_oss_pipeline_split_is_bit_identical_at_every_cut() {
    moe::pipeline_cuts_are_bit_identical(MODEL);
}

#[test]
fn gpt_oss_expert_split_in_2_and_3_is_bit_identical() {
    moe::expert_splits_are_bit_identical(MODEL);
}

#[test]
fn gpt_oss_streamed_experts_are_bit_identical() {
    // Room for a few experts of the 32: most reads miss and evict.
    moe::streamed_experts_are_bit_identical(MODEL, 200 << 10);
}

/// Free-running greedy generation from each reference prompt reproduces llama.cpp's 32 tokens, for
/// gpt-oss and for each new quant type's fixture (their teacher-forced log-probs are checked by
/// `reference.rs`).
#[test]
fn greedy_tokens_equal_llama_cpp_on_the_new_fixtures() {
    for name in [
        "tiny-gpt-oss-MXFP4",
        "small-qwen3-IQ4_NL",
        "small-qwen3-IQ4_XS",
        "small-qwen3-Q2_K",
        "small-qwen3-Q3_K_M",
        "small-qwen3-IQ2_XXS",
        "small-qwen3-IQ2_XS",
        "small-qwen3-IQ2_S",
        "small-qwen3-IQ3_XXS",
        "small-qwen3-IQ3_S",
        "small-qwen3moe-IQ2_XXS",
    ] {
        moe::greedy_tokens_equal_llama_cpp(name);
    }
}

#[test]
fn profile_counts_only_full_attention_layers_per_token_and_shows_the_parts() {
    let g = common::open(MODEL);
    let p = tessera_model::ModelProfile::from_gguf(&g).unwrap();
    let cfg = &p.config;
    // Layers 1 and 3 grow with the context; 0 and 2 keep a window of 16.
    assert_eq!(p.kv_bytes_per_token, (2 * 2 * cfg.kv_dim() * 4) as u64);
    // What `tessera inspect` prints names gpt-oss's parts.
    let shown = p.to_string();
    for part in [
        "gpt-oss",
        "window of 16 in layers 0,2",
        "sink",
        "Yarn",
        "SwigluOai",
    ] {
        assert!(shown.contains(part), "{part} missing from\n{shown}");
    }
}
