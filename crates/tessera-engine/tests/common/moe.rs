//! The harness the MoE architecture tests (deepseek2, glm4moe, gpt-oss) share: one prompt and
//! its greedy continuation, run by the whole model and then cut into two pipeline stages, with
//! the routed experts split over parts, or with them streamed from disk, compared bit for bit;
//! and free-running greedy generation against llama.cpp's recorded tokens.

use super::{
    assert_bits_eq, full, full_kv, kv_for, kv_types, load, load_kv, open, repo_root, run_local,
};
use tessera_engine::ops::argmax;
use tessera_engine::{
    ExpertSelection, ExpertStreaming, KvCache, KvType, LoadSpec, Model, PartExperts, SeqStep,
};
use tessera_model::ModelConfig;

/// 20 prompt tokens and 6 decode steps: past the gpt-oss fixture's window of 16.
pub const PROMPT: [u32; 20] = [
    1, 403, 407, 261, 378, 300, 42, 17, 99, 5, 260, 311, 290, 402, 356, 271, 284, 305, 330, 88,
];
pub const DECODE_STEPS: usize = 6;

/// The token steps of a run: the prompt, then greedy tokens of the full model.
pub fn steps(full: &Model) -> Vec<Vec<u32>> {
    let mut kv = kv_for(full);
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
pub fn run_with_parts(parts: &[&Model], steps: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let main = parts[0];
    let l = main.config().n_layer;
    let mut kv: KvCache = kv_for(main);
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

/// Every cut of a two-stage split of `file`, with each KV cache type its heads allow, gives
/// the whole model's logits bit for bit at every step.
pub fn pipeline_cuts_are_bit_identical(file: &str) {
    let g = open(file);
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    for t in kv_types(&g) {
        pipeline_cuts(&g, &cfg, t, file);
    }
}

fn pipeline_cuts(g: &tessera_model::GgufFile, cfg: &ModelConfig, t: KvType, file: &str) {
    let full = full_kv(g, 2, t);
    let steps = steps(&full);
    let reference = run_with_parts(&[&full], &steps);
    let l = cfg.n_layer;
    for a in 1..l {
        let first = load_kv(g, LoadSpec::stage(cfg, 0..a), 2, t);
        let second = load_kv(g, LoadSpec::stage(cfg, a..l), 1, t);
        let mut kv_a = kv_for(&first);
        let mut kv_b = kv_for(&second);
        let mut pos = 0;
        for (si, tokens) in steps.iter().enumerate() {
            let step = [SeqStep {
                n_tokens: tokens.len(),
                start_pos: pos,
            }];
            let mut h = first.embed(tokens).unwrap();
            run_local(&first, 0..a, &mut h, &step, &mut kv_a);
            run_local(&second, a..l, &mut h, &step, &mut kv_b);
            let logits = second.head(&h).unwrap();
            assert_bits_eq(
                &logits.data,
                &reference[si],
                &format!("{file} {t:?} cut {a} step {si}"),
            );
            pos += tokens.len();
        }
    }
}

/// `file`'s routed experts split in 2 and in 3 parts (the first part holding everything else,
/// shared experts included) give the whole model's logits bit for bit.
pub fn expert_splits_are_bit_identical(file: &str) {
    let g = open(file);
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let whole = full(&g, 2);
    let steps = steps(&whole);
    let reference = run_with_parts(&[&whole], &steps);
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
        let mut spec0 = LoadSpec::full(&cfg);
        spec0.experts = sel(&sets[0]);
        let mut models = vec![load(&g, spec0, 2)];
        for ids in &sets[1..] {
            let spec = LoadSpec::experts_only(0..cfg.n_layer, sel(ids));
            let part = load(&g, spec, 1);
            // An expert-only part holds no shared expert, no router, no attention.
            assert!(part.weights().layers.iter().all(|l| l.core.is_none()));
            models.push(part);
        }
        let parts: Vec<&Model> = models.iter().collect();
        let got = run_with_parts(&parts, &steps);
        for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
            assert_bits_eq(a, b, &format!("{file} experts {sets:?} step {i}"));
        }
    }
}

/// `file` with its routed experts streamed from disk through a cache of `budget` bytes (small
/// enough that reads miss and evict) gives the whole model's logits bit for bit.
pub fn streamed_experts_are_bit_identical(file: &str, budget: u64) {
    let g = open(file);
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let whole = full(&g, 2);
    let steps = steps(&whole);
    let reference = run_with_parts(&[&whole], &steps);
    let streaming = ExpertStreaming {
        prefetch: false,
        ..ExpertStreaming::with_budget(budget)
    };
    let s = Model::load_streaming(&g, LoadSpec::full(&cfg), streaming, 2, &mut |_, _| {}).unwrap();
    let got = run_with_parts(&[&s], &steps);
    for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
        assert_bits_eq(a, b, &format!("{file} streamed step {i}"));
    }
    let stats = s.expert_stats().unwrap();
    assert!(stats.misses > 0, "{stats:?}");
}

/// Free-running greedy generation from each prompt of `reference/{name}-public.json`
/// reproduces llama.cpp's tokens, on the reference's numerics (an F32 KV cache, llama.cpp's
/// non-flash attention).
pub fn greedy_tokens_equal_llama_cpp(name: &str) {
    let path = repo_root().join(format!("reference/{name}-public.json"));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let g = open(&format!("{name}.gguf"));
    let model = full_kv(&g, 2, KvType::F32);
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
        let mut kv = kv_for(&model);
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
