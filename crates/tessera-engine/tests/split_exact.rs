//! Guards the central promise: split execution is bit-identical to unsplit execution.
//! Every layer cut point of a pipeline split, pipelines of 3 and more stages (every layer its
//! own stage) on every weight type (F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, the IQ2/IQ3
//! family), and MoE
//! experts split across 2 and 3 separately loaded parts, over a prefill and several decode
//! steps.

mod common;

use common::{assert_bits_eq, moe, run_local};
use tessera_engine::ops::argmax;
use tessera_engine::{
    ExpertExecutor, ExpertOutputs, ExpertSelection, Hidden, KvCache, KvType, LoadSpec, Model,
    PartExperts, Routing, SeqStep,
};
use tessera_model::{GgufFile, ModelConfig};

const PROMPT: [u32; 7] = [1, 403, 407, 261, 378, 300, 42];
const DECODE_STEPS: usize = 3;

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

fn check_pipeline_cuts(name: &str) {
    let g = common::open(name);
    for t in common::kv_types(&g) {
        check_pipeline_cuts_with(&g, &format!("{name} ({t} cache)"), t);
    }
}

fn check_pipeline_cuts_with(g: &GgufFile, name: &str, kv_type: KvType) {
    let cfg = ModelConfig::from_gguf(g).unwrap();
    let full = common::full_kv(g, 2, kv_type);
    let steps = steps(&full);
    let l = cfg.n_layer;
    for a in 1..l {
        let first = common::load_kv(g, LoadSpec::stage(&cfg, 0..a), 2, kv_type);
        let second = common::load_kv(g, LoadSpec::stage(&cfg, a..l), 1, kv_type);
        let mut kv_full = common::kv_for(&full);
        let mut kv_a = first.new_kv(cfg.context_length);
        let mut kv_b = second.new_kv(cfg.context_length);
        assert_eq!(kv_a.layers(), 0..a);
        let mut pos = 0;
        for (si, tokens) in steps.iter().enumerate() {
            let step = [SeqStep {
                n_tokens: tokens.len(),
                start_pos: pos,
            }];
            // Unsplit: all layers in one call.
            let mut h_full = full.embed(tokens).unwrap();
            run_local(&full, 0..l, &mut h_full, &step, &mut kv_full);
            let logits_full = full.head(&h_full).unwrap();
            // Split: stage one, then stage two, each with its own cache.
            let mut h = first.embed(tokens).unwrap();
            run_local(&first, 0..a, &mut h, &step, &mut kv_a);
            let mut h2 = h.clone();
            run_local(&second, a..l, &mut h2, &step, &mut kv_b);
            let logits = second.head(&h2).unwrap();
            let what = format!("{name} cut {a} step {si}");
            assert_bits_eq(&h2.data, &h_full.data, &format!("{what}: final hidden"));
            assert_bits_eq(&logits.data, &logits_full.data, &format!("{what}: logits"));
            pos += tokens.len();
        }
        // The intermediate hidden state is exactly what the full model has after layer a.
        let mut kv = common::kv_for(&full);
        let step = [SeqStep {
            n_tokens: PROMPT.len(),
            start_pos: 0,
        }];
        let mut h_full = full.embed(&PROMPT).unwrap();
        run_local(&full, 0..a, &mut h_full, &step, &mut kv);
        let mut kv1 = first.new_kv(64);
        let mut h = first.embed(&PROMPT).unwrap();
        run_local(&first, 0..a, &mut h, &step, &mut kv1);
        assert_bits_eq(
            &h.data,
            &h_full.data,
            &format!("{name} cut {a}: hidden at the cut"),
        );
    }
}

#[test]
fn pipeline_split_is_bit_identical_stories260k() {
    check_pipeline_cuts("stories260K.gguf");
}

#[test]
fn pipeline_split_is_bit_identical_tiny_qwen3moe() {
    check_pipeline_cuts("tiny-qwen3moe-f32.gguf");
}

#[test]
fn pipeline_split_is_bit_identical_quantized() {
    check_pipeline_cuts("tiny-qwen3-Q8_0.gguf");
    check_pipeline_cuts("tiny-qwen3moe-Q4_0.gguf");
}

/// A pipeline of separately loaded stages ending at `ends` (the last is `n_layer`): at every
/// step, the hidden state each stage hands on equals bit for bit the full model's after the
/// same layer, and the last stage's hidden state and logits equal one unsplit call's.
fn check_stages(name: &str, ends: &[usize]) {
    let g = common::open(name);
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let l = cfg.n_layer;
    assert_eq!(
        ends.last(),
        Some(&l),
        "{name}: the stages must end at layer {l}"
    );
    let full = common::full(&g, 2);
    let steps = steps(&full);
    let ranges: Vec<_> = std::iter::once(0)
        .chain(ends.iter().copied())
        .zip(ends.iter().copied())
        .collect();
    // Stages alternate between 1 and 2 threads: the split must not depend on either.
    let stages: Vec<Model> = ranges
        .iter()
        .enumerate()
        .map(|(i, &(a, b))| common::load(&g, LoadSpec::stage(&cfg, a..b), 1 + i % 2))
        .collect();
    let mut kvs: Vec<KvCache> = stages
        .iter()
        .map(|m| m.new_kv(cfg.context_length))
        .collect();
    let mut kv_full = common::kv_for(&full);
    let mut kv_piece = common::kv_for(&full);
    let mut pos = 0;
    for (si, tokens) in steps.iter().enumerate() {
        let step = [SeqStep {
            n_tokens: tokens.len(),
            start_pos: pos,
        }];
        let mut h_full = full.embed(tokens).unwrap();
        run_local(&full, 0..l, &mut h_full, &step, &mut kv_full);
        let logits_full = full.head(&h_full).unwrap();
        let mut h = stages[0].embed(tokens).unwrap();
        let mut h_piece = full.embed(tokens).unwrap();
        for ((&(a, b), stage), kv) in ranges.iter().zip(&stages).zip(&mut kvs) {
            run_local(stage, a..b, &mut h, &step, kv);
            run_local(&full, a..b, &mut h_piece, &step, &mut kv_piece);
            assert_bits_eq(
                &h.data,
                &h_piece.data,
                &format!("{name} {ends:?} step {si}: after layer {b}"),
            );
        }
        let what = format!("{name} stages ending {ends:?}, step {si}");
        assert_bits_eq(&h.data, &h_full.data, &format!("{what}: final hidden"));
        let logits = stages.last().unwrap().head(&h).unwrap();
        assert_bits_eq(&logits.data, &logits_full.data, &format!("{what}: logits"));
        pos += tokens.len();
    }
}

/// Every layer its own stage: as many stages as layers, every cut at once.
fn every_layer_a_stage(name: &str) {
    let l = ModelConfig::from_gguf(&common::open(name)).unwrap().n_layer;
    assert!(l >= 3, "{name} has {l} layers: not a 3-stage pipeline");
    check_stages(name, &(1..=l).collect::<Vec<_>>());
}

#[test]
fn pipelines_of_3_and_more_stages_are_bit_identical_f32() {
    every_layer_a_stage("stories260K.gguf");
    every_layer_a_stage("tiny-qwen3moe-f32.gguf");
    let l = ModelConfig::from_gguf(&common::open("stories260K.gguf"))
        .unwrap()
        .n_layer;
    check_stages("stories260K.gguf", &[1, l / 2 + 1, l]);
}

#[test]
fn pipelines_of_3_and_more_stages_are_bit_identical_f16_and_bf16() {
    every_layer_a_stage("small-qwen3-F16.gguf");
    every_layer_a_stage("small-qwen3-BF16.gguf");
}

#[test]
fn pipelines_of_3_and_more_stages_are_bit_identical_q4_0_and_q8_0() {
    every_layer_a_stage("tiny-qwen3-Q8_0.gguf");
    every_layer_a_stage("tiny-qwen3moe-Q4_0.gguf");
}

#[test]
fn pipelines_of_3_and_more_stages_are_bit_identical_k_quants() {
    every_layer_a_stage("small-qwen3-Q4_K.gguf");
    every_layer_a_stage("small-qwen3-Q5_K.gguf");
    every_layer_a_stage("small-qwen3-Q6_K.gguf");
    every_layer_a_stage("small-qwen3moe-Q4_K.gguf");
}

#[test]
fn pipelines_of_3_and_more_stages_are_bit_identical_iq2_and_iq3() {
    for t in ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"] {
        every_layer_a_stage(&format!("small-qwen3-{t}.gguf"));
    }
    every_layer_a_stage("small-qwen3moe-IQ2_XXS.gguf");
}

fn check_expert_split(name: &str) {
    let g = common::open(name);
    for t in common::kv_types(&g) {
        check_expert_split_with(&g, &format!("{name} ({t} cache)"), t);
    }
}

fn check_expert_split_with(g: &GgufFile, name: &str, kv_type: KvType) {
    let cfg = ModelConfig::from_gguf(g).unwrap();
    let full = common::full_kv(g, 2, kv_type);
    let steps = steps(&full);
    let reference = moe::run_with_parts(&[&full], &steps);
    let n = cfg.n_expert;
    let all: Vec<usize> = (0..n).collect();
    let splits: Vec<Vec<Vec<usize>>> = vec![
        vec![all[..n / 2].to_vec(), all[n / 2..].to_vec()],
        vec![
            all.iter().copied().filter(|e| e % 3 == 0).collect(),
            all.iter().copied().filter(|e| e % 3 == 1).collect(),
            all.iter().copied().filter(|e| e % 3 == 2).collect(),
        ],
    ];
    for sets in splits {
        let sel = |ids: &Vec<usize>| ExpertSelection::same_in_every_layer(ids, cfg.n_layer);
        let mut spec0 = LoadSpec::full(&cfg);
        spec0.experts = sel(&sets[0]);
        let mut models = vec![common::load_kv(g, spec0, 2, kv_type)];
        for ids in &sets[1..] {
            models.push(common::load(
                g,
                LoadSpec::experts_only(0..cfg.n_layer, sel(ids)),
                1,
            ));
        }
        assert!(models[1].resident_bytes() < full.resident_bytes() / 2);
        let parts: Vec<&Model> = models.iter().collect();
        let got = moe::run_with_parts(&parts, &steps);
        for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
            assert_bits_eq(a, b, &format!("{name} experts {sets:?} step {i}"));
        }
        // Leaving a part out is an error, not a silent wrong answer.
        let mut kv = common::kv_for(&models[0]);
        let mut h = models[0].embed(&PROMPT).unwrap();
        let err = models[0]
            .run_layers(
                0..cfg.n_layer,
                &mut h,
                &[SeqStep {
                    n_tokens: PROMPT.len(),
                    start_pos: 0,
                }],
                &mut [&mut kv],
                &mut PartExperts(vec![&models[0]]),
            )
            .unwrap_err();
        assert!(err.to_string().contains("was not computed"), "{err}");
    }
}

#[test]
fn expert_split_is_bit_identical_f32() {
    check_expert_split("tiny-qwen3moe-f32.gguf");
}

#[test]
fn expert_split_is_bit_identical_quantized() {
    check_expert_split("tiny-qwen3moe-Q4_0.gguf");
    check_expert_split("small-qwen3moe-Q6_K.gguf");
    // The low-bit lattice types big MoE models ship in.
    check_expert_split("small-qwen3moe-IQ2_XXS.gguf");
}

/// Sends each part only the hidden rows of the tokens routed to its experts, as a remote
/// executor would, and places the results back.
struct SubsetParts<'a>(Vec<&'a Model>);

impl ExpertExecutor for SubsetParts<'_> {
    fn run(
        &mut self,
        layer: usize,
        normed: &Hidden,
        routing: &Routing,
    ) -> tessera_engine::Result<Vec<ExpertOutputs>> {
        let mut out = Vec::new();
        for m in &self.0 {
            let owned = |e: usize| m.holds_expert(layer, e);
            let tokens = routing.tokens_for(&owned);
            let sub = m.moe_experts(
                layer,
                &normed.gather(&tokens),
                &routing.subset(&tokens),
                &owned,
            )?;
            out.push(sub.expand(&tokens, routing.n_tokens)?);
        }
        Ok(out)
    }
}

#[test]
fn expert_parts_fed_only_their_tokens_are_bit_identical() {
    let g = common::open("small-qwen3moe-Q4_K.gguf");
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let full = common::full(&g, 2);
    let steps = steps(&full);
    let reference = moe::run_with_parts(&[&full], &steps);
    let sel = |ids: &[usize]| ExpertSelection::same_in_every_layer(ids, cfg.n_layer);
    let mut spec = LoadSpec::full(&cfg);
    spec.experts = sel(&[0, 1, 2]);
    let main = common::load(&g, spec, 2);
    let b = common::load(
        &g,
        LoadSpec::experts_only(0..cfg.n_layer, sel(&[3, 4, 5])),
        1,
    );
    let c = common::load(&g, LoadSpec::experts_only(0..cfg.n_layer, sel(&[6, 7])), 1);
    let l = cfg.n_layer;
    let mut kv = common::kv_for(&main);
    let mut pos = 0;
    for (i, tokens) in steps.iter().enumerate() {
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
            &mut SubsetParts(vec![&main, &b, &c]),
        )
        .unwrap();
        let logits = main.head(&h).unwrap().data;
        assert_bits_eq(&logits, &reference[i], &format!("step {i}"));
        pos += tokens.len();
    }
}

#[test]
fn reduce_rejects_duplicate_and_missing_slots() {
    use tessera_engine::{reduce_expert_outputs, ExpertOutputs};
    let part = |slots: Vec<Option<Vec<f32>>>| ExpertOutputs {
        n_tokens: 1,
        k: 2,
        n_embd: 2,
        slots,
    };
    let a = part(vec![Some(vec![1.0, 2.0]), None]);
    let b = part(vec![None, Some(vec![0.5, 0.25])]);
    let sum = reduce_expert_outputs(&[b.clone(), a.clone()]).unwrap();
    assert_eq!(sum.data, vec![1.5, 2.25]);
    assert!(reduce_expert_outputs(std::slice::from_ref(&a)).is_err());
    assert!(reduce_expert_outputs(&[a.clone(), a, b]).is_err());
}
