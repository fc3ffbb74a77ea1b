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

use common::assert_bits_eq;
use tessera_engine::ops::argmax;
use tessera_engine::{
    ExpertSelection, ExpertStreaming, KvCache, KvType, LoadSpec, LocalExperts, Model, PartExperts,
    SeqStep,
};
use tessera_model::{Architecture, ExpertGating, ModelConfig, RopeStyle};

const MODELS: [&str; 1] = ["tiny-glm4moe-Q8_0"];
const PROMPT: [u32; 20] = [
    1, 403, 407, 261, 378, 300, 42, 17, 99, 5, 260, 311, 290, 402, 356, 271, 284, 305, 330, 88,
];
const DECODE_STEPS: usize = 6;

fn file(name: &str) -> String {
    format!("{name}.gguf")
}

/// The token steps of a run: the prompt, then greedy tokens of the full model.
fn steps(full: &Model) -> Vec<Vec<u32>> {
    let mut kv = common::kv_for(full);
    let mut out = vec![PROMPT.to_vec()];
    let mut logits = full.forward_last(&PROMPT, &mut kv).unwrap();
    for _ in 0..DECODE_STEPS {
        let t = argmax(logits.last()) as u32;
        out.push(vec![t]);
        logits = full.forward_last(&[t], &mut kv).unwrap();
    }
    out
}

/// Logits of every step with `parts` computing the routed experts (`parts[0]` holds the rest).
fn run_with_parts(parts: &[&Model], steps: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let main = parts[0];
    let l = main.config().n_layer;
    let mut kv: KvCache = common::kv_for(main);
    let mut out = Vec::new();
    let mut pos = 0;
    for tokens in steps {
        let mut h = main.embed(tokens).unwrap();
        let step = [SeqStep {
            n_tokens: tokens.len(),
            start_pos: pos,
        }];
        main.run_layers(
            0..l,
            &mut h,
            &step,
            &mut [&mut kv],
            &mut PartExperts(parts.to_vec()),
        )
        .unwrap();
        out.push(main.head(&h).unwrap().data);
        pos += tokens.len();
    }
    out
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
        let path = common::repo_root().join(format!("reference/{name}-public.json"));
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let g = common::open(&file(name));
        // The reference's numerics: an F32 KV cache, llama.cpp's non-flash attention.
        let model = common::full_kv(&g, 2, KvType::F32);
        let eos = g
            .meta("tokenizer.ggml.eos_token_id")
            .and_then(|v| v.as_u64())
            .unwrap() as usize;
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        for (ri, r) in doc["results"].as_array().unwrap().iter().enumerate() {
            let prompt = ids(&r["prompt_token_ids"]);
            let want = ids(&r["generated_token_ids"]);
            let mut kv = common::kv_for(&model);
            let mut logits = model.forward_last(&prompt, &mut kv).unwrap();
            let mut got = Vec::new();
            for _ in 0..want.len() {
                // The reference ran with `ignore_eos`: llama.cpp never picks the end token.
                let mut row = logits.last().to_vec();
                row[eos] = f32::NEG_INFINITY;
                let t = argmax(&row) as u32;
                got.push(t);
                logits = model.forward_last(&[t], &mut kv).unwrap();
            }
            assert_eq!(got, want, "{name} prompt {ri}");
        }
    }
}

#[test]
fn glm4moe_pipeline_split_is_bit_identical_at_every_cut() {
    for name in MODELS {
        let g = common::open(&file(name));
        let cfg = ModelConfig::from_gguf(&g).unwrap();
        for t in common::kv_types(&g) {
            pipeline_cuts(&g, &cfg, t);
        }
    }
}

/// Every cut of a two-stage split, each stage with a KV cache of type `t`.
fn pipeline_cuts(g: &tessera_model::GgufFile, cfg: &ModelConfig, t: KvType) {
    let full = common::full_kv(g, 2, t);
    let steps = steps(&full);
    let reference = run_with_parts(&[&full], &steps);
    let l = cfg.n_layer;
    for a in 1..l {
        let first = common::load_kv(g, LoadSpec::stage(cfg, 0..a), 2, t);
        let second = common::load_kv(g, LoadSpec::stage(cfg, a..l), 1, t);
        let mut kv_a = common::kv_for(&first);
        let mut kv_b = common::kv_for(&second);
        let mut pos = 0;
        for (si, tokens) in steps.iter().enumerate() {
            let step = [SeqStep {
                n_tokens: tokens.len(),
                start_pos: pos,
            }];
            let mut h = first.embed(tokens).unwrap();
            first
                .run_layers(
                    0..a,
                    &mut h,
                    &step,
                    &mut [&mut kv_a],
                    &mut LocalExperts(&first),
                )
                .unwrap();
            second
                .run_layers(
                    a..l,
                    &mut h,
                    &step,
                    &mut [&mut kv_b],
                    &mut LocalExperts(&second),
                )
                .unwrap();
            let logits = second.head(&h).unwrap();
            assert_bits_eq(
                &logits.data,
                &reference[si],
                &format!("{t:?} cut {a} step {si}"),
            );
            pos += tokens.len();
        }
    }
}

#[test]
fn glm4moe_expert_split_in_2_and_3_is_bit_identical() {
    for name in MODELS {
        let g = common::open(&file(name));
        let cfg = ModelConfig::from_gguf(&g).unwrap();
        let full = common::full(&g, 2);
        let steps = steps(&full);
        let reference = run_with_parts(&[&full], &steps);
        let n = cfg.n_expert;
        let all: Vec<usize> = (0..n).collect();
        let splits: Vec<Vec<Vec<usize>>> = vec![
            vec![all[..n / 2].to_vec(), all[n / 2..].to_vec()],
            (0..3)
                .map(|r| all.iter().copied().filter(|e| e % 3 == r).collect())
                .collect(),
        ];
        for sets in splits {
            let sel = |ids: &Vec<usize>| ExpertSelection::same_in_every_layer(ids, cfg.n_layer);
            // The first part holds the dense weights, the shared experts and its routed set.
            let mut spec0 = LoadSpec::full(&cfg);
            spec0.experts = sel(&sets[0]);
            let mut models = vec![common::load(&g, spec0, 2)];
            for ids in &sets[1..] {
                let spec = LoadSpec::experts_only(0..cfg.n_layer, sel(ids));
                let part = common::load(&g, spec, 1);
                // An expert-only part holds no shared expert, no router, no attention.
                assert!(part.weights().layers.iter().all(|l| l.core.is_none()));
                models.push(part);
            }
            let parts: Vec<&Model> = models.iter().collect();
            let got = run_with_parts(&parts, &steps);
            for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
                assert_bits_eq(a, b, &format!("{name} experts {sets:?} step {i}"));
            }
        }
    }
}

#[test]
fn glm4moe_streamed_experts_are_bit_identical() {
    for name in MODELS {
        let g = common::open(&file(name));
        let cfg = ModelConfig::from_gguf(&g).unwrap();
        let full = common::full(&g, 2);
        let steps = steps(&full);
        let reference = run_with_parts(&[&full], &steps);
        // Room for a few of the routed experts: most reads miss and evict.
        let streaming = ExpertStreaming {
            prefetch: false,
            ..ExpertStreaming::with_budget(100 << 10)
        };
        let s =
            Model::load_streaming(&g, LoadSpec::full(&cfg), streaming, 2, &mut |_, _| {}).unwrap();
        let got = run_with_parts(&[&s], &steps);
        for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
            assert_bits_eq(a, b, &format!("{name} streamed step {i}"));
        }
        let stats = s.expert_stats().unwrap();
        assert!(stats.misses > 0, "{stats:?}");
    }
}
