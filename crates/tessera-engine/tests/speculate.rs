//! Guards speculative decoding in one process: verifying k drafts in one pass gives the rows of
//! k one-token steps bit for bit, a rejection truncates the cache to the accepted prefix, and
//! generating with any draft source (prompt lookup, the model as its own draft, a smaller draft
//! model) yields the same tokens as without, greedy and seeded, dense and MoE.

mod common;

use std::sync::Arc;

use common::assert_bits_eq;
use tessera_engine::ops::argmax;
use tessera_engine::speculate::{check_same_vocabulary, keep_accepted, ModelDraft};
use tessera_engine::{Generator, Model};
use tessera_model::Tokenizer;
use tessera_sampling::speculate::{settle, AdaptiveK, DraftSource, PromptLookup};
use tessera_sampling::SamplingParams;

const MODELS: [&str; 4] = [
    "stories260K.gguf",
    "tiny-qwen3-Q8_0.gguf",
    "tiny-qwen3moe-f32.gguf",
    "small-qwen3moe-Q4_K.gguf",
];

const PROMPT: [u32; 5] = [1, 403, 407, 261, 378];

/// Greedy one-token decoding after `PROMPT`: the tokens and the logits row that chose each.
fn reference(m: &Model, n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut kv = common::kv_for(m);
    let mut row = m.forward_last(&PROMPT, &mut kv).unwrap().data;
    let (mut tokens, mut rows) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = argmax(&row) as u32;
        tokens.push(t);
        rows.push(row);
        row = m.forward_last(&[t], &mut kv).unwrap().data;
    }
    (tokens, rows)
}

#[test]
fn verifying_drafts_gives_the_rows_of_one_token_steps() {
    for name in MODELS {
        let g = common::open(name);
        let m = common::full(&g, 2);
        let (tokens, rows) = reference(&m, 7);
        let mut kv = common::kv_for(&m);
        m.forward_last(&PROMPT, &mut kv).unwrap();
        // The last accepted token and five drafts that all agree: six rows.
        let v = m.verify(tokens[0], &tokens[1..6], &mut kv).unwrap();
        assert_eq!(v.n_tokens, 6);
        for i in 0..6 {
            assert_bits_eq(v.row(i), &rows[i + 1], &format!("{name} row {i}"));
        }
        assert_eq!(kv.len(), PROMPT.len() + 6);
    }
}

#[test]
fn a_draft_that_always_agrees_is_accepted_in_full() {
    for name in MODELS {
        let g = common::open(name);
        let m = common::full(&g, 2);
        let (tokens, _) = reference(&m, 8);
        let mut kv = common::kv_for(&m);
        m.forward_last(&PROMPT, &mut kv).unwrap();
        let before = kv.len();
        let drafts = &tokens[1..6];
        let v = m.verify(tokens[0], drafts, &mut kv).unwrap();
        let mut drawn = Vec::new();
        let s = settle::<()>(drafts, |i| {
            let t = argmax(v.row(i)) as u32;
            drawn.push(t);
            Ok(Some(t))
        })
        .unwrap();
        assert_eq!(s.accepted, 5, "{name}");
        // Every draft plus the draw after the last one.
        assert_eq!(drawn, tokens[1..7].to_vec(), "{name}");
        keep_accepted(&mut kv, before, s.accepted);
        assert_eq!(kv.len(), before + 6);
    }
}

#[test]
fn a_wrong_draft_is_cut_at_the_right_position_and_the_cache_truncated() {
    for name in MODELS {
        let g = common::open(name);
        let m = common::full(&g, 2);
        let (tokens, rows) = reference(&m, 8);
        let mut kv = common::kv_for(&m);
        m.forward_last(&PROMPT, &mut kv).unwrap();
        let before = kv.len();
        // Drafts 1 and 2 right, draft 3 wrong, draft 4 right again (it must not count).
        let wrong = (tokens[3] + 1) % m.config().vocab_size as u32;
        let drafts = [tokens[1], tokens[2], wrong, tokens[4]];
        let v = m.verify(tokens[0], &drafts, &mut kv).unwrap();
        let mut drawn = Vec::new();
        let s = settle::<()>(&drafts, |i| {
            let t = argmax(v.row(i)) as u32;
            drawn.push(t);
            Ok(Some(t))
        })
        .unwrap();
        assert_eq!((s.accepted, s.judged), (2, 3), "{name}");
        // The draw at the rejected position is the token plain decoding chose.
        assert_eq!(drawn, tokens[1..4].to_vec(), "{name}");
        keep_accepted(&mut kv, before, s.accepted);
        // The last token and the two accepted drafts stay; the rest is dropped, not recomputed.
        assert_eq!(kv.len(), before + 3, "{name}");
        // Decoding goes on from the truncated cache exactly as plain decoding did.
        let next = m.forward_last(&[tokens[3]], &mut kv).unwrap();
        assert_bits_eq(next.last(), &rows[4], &format!("{name} after the cut"));
    }
}

/// Two stages, as a ring runs them: stage 0 embeds and runs its layers, stage 1 runs the rest
/// and the head. Verification is the same `k + 1` rows through both, and each stage's cache is
/// cut back the same way.
#[test]
fn a_stage_split_verifies_and_truncates_like_the_whole_model() {
    use tessera_engine::{LoadSpec, LocalExperts, SeqStep};
    use tessera_model::ModelConfig;
    for name in ["tiny-qwen3-Q8_0.gguf", "tiny-qwen3moe-f32.gguf"] {
        let g = common::open(name);
        let config = ModelConfig::from_gguf(&g).unwrap();
        let whole = common::full(&g, 2);
        let (tokens, rows) = reference(&whole, 8);
        let mid = config.n_layer / 2;
        let parts = [
            common::load(&g, LoadSpec::stage(&config, 0..mid), 2),
            common::load(&g, LoadSpec::stage(&config, mid..config.n_layer), 2),
        ];
        let ranges = [0..mid, mid..config.n_layer];
        let mut kvs: Vec<_> = parts.iter().map(common::kv_for).collect();
        let run = |tokens: &[u32], kvs: &mut [tessera_engine::KvCache]| {
            let step = [SeqStep {
                n_tokens: tokens.len(),
                start_pos: kvs[0].len(),
            }];
            let mut h = parts[0].embed(tokens).unwrap();
            for (i, part) in parts.iter().enumerate() {
                part.run_layers(
                    ranges[i].clone(),
                    &mut h,
                    &step,
                    &mut [&mut kvs[i]],
                    &mut LocalExperts(part),
                )
                .unwrap();
            }
            parts[1].head(&h).unwrap()
        };
        run(&PROMPT, &mut kvs);
        let before = kvs[0].len();
        let wrong = (tokens[2] + 1) % config.vocab_size as u32;
        let drafts = [tokens[1], wrong, tokens[3]];
        let mut verify = vec![tokens[0]];
        verify.extend_from_slice(&drafts);
        let v = run(&verify, &mut kvs);
        for i in 0..2 {
            assert_bits_eq(v.row(i), &rows[i + 1], &format!("{name} stage row {i}"));
        }
        let s = settle::<()>(&drafts, |i| Ok(Some(argmax(v.row(i)) as u32))).unwrap();
        assert_eq!(s.accepted, 1, "{name}");
        for kv in &mut kvs {
            keep_accepted(kv, before, s.accepted);
            assert_eq!(kv.len(), before + 2);
        }
        let next = run(&[tokens[2]], &mut kvs);
        assert_bits_eq(
            next.last(),
            &rows[3],
            &format!("{name} stage after the cut"),
        );
    }
}

fn generate(
    m: &Model,
    params: &SamplingParams,
    prompt: &[u32],
    n: usize,
    spec: Option<(Box<dyn DraftSource>, AdaptiveK)>,
) -> (Vec<u32>, tessera_engine::SpeculationStats) {
    let mut g = Generator::new(m, params.clone(), 256);
    g.prefill_chunk = 3;
    if let Some((source, k)) = spec {
        g = g.with_speculation(source, k);
    }
    let mut out = Vec::new();
    let stats = g
        .generate(prompt, n, &[], &mut |t| {
            out.push(t);
            true
        })
        .unwrap();
    (out, stats.speculation)
}

fn samplings() -> Vec<(&'static str, SamplingParams)> {
    vec![
        ("greedy", SamplingParams::greedy()),
        (
            "seeded",
            SamplingParams {
                temperature: 0.9,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.02,
                repeat_penalty: 1.1,
                seed: 7,
                ..SamplingParams::default()
            },
        ),
    ]
}

/// A prompt that repeats itself, so prompt lookup has something to propose.
fn copy_prompt() -> Vec<u32> {
    let mut p = PROMPT.to_vec();
    p.extend_from_slice(&[317, 391, 266, 267, 290, 301]);
    p.extend_from_slice(&PROMPT[1..]);
    p.extend_from_slice(&[317, 391, 266]);
    p
}

#[test]
fn speculation_never_changes_the_tokens() {
    for name in MODELS {
        let g = common::open(name);
        let m = Arc::new(common::full(&g, 2));
        let prompt = copy_prompt();
        for (how, params) in samplings() {
            let (plain, _) = generate(&m, &params, &prompt, 40, None);
            assert_eq!(plain.len(), 40);
            let sources: Vec<(&str, Box<dyn DraftSource>, AdaptiveK)> = vec![
                (
                    "lookup",
                    Box::new(PromptLookup::default()),
                    AdaptiveK::new(6),
                ),
                (
                    "lookup fixed",
                    Box::new(PromptLookup::default()),
                    AdaptiveK::fixed(3),
                ),
                (
                    "self",
                    Box::new(ModelDraft::new(m.clone(), 256)),
                    AdaptiveK::fixed(4),
                ),
            ];
            for (source_name, source, k) in sources {
                let (fast, stats) = generate(&m, &params, &prompt, 40, Some((source, k)));
                assert_eq!(fast, plain, "{name} {how} {source_name}");
                if source_name == "self" {
                    assert!(stats.drafted > 0, "{name} {how}: no drafts");
                    if how == "greedy" {
                        // The model's own greedy guess is what greedy decoding draws.
                        assert_eq!(stats.accepted, stats.drafted, "{name}");
                        assert!(stats.verifications < 40 / 2, "{name}: {stats:?}");
                    }
                }
            }
        }
    }
}

/// Regression: a prompt longer than the draft model's catch-up limit is fed whole on the first
/// draft, so the model as its own draft still agrees with every greedy token.
#[test]
fn the_model_as_its_own_draft_agrees_after_a_long_prompt() {
    for name in ["tiny-qwen3-Q8_0.gguf", "small-qwen3moe-Q4_K.gguf"] {
        let g = common::open(name);
        let m = Arc::new(common::full(&g, 2));
        let prompt: Vec<u32> = copy_prompt().iter().cycle().take(150).copied().collect();
        let greedy = SamplingParams::greedy();
        let (plain, _) = generate(&m, &greedy, &prompt, 30, None);
        let source = Box::new(ModelDraft::new(m.clone(), 256));
        let (fast, stats) = generate(
            &m,
            &greedy,
            &prompt,
            30,
            Some((source, AdaptiveK::fixed(4))),
        );
        assert_eq!(fast, plain, "{name}");
        assert!(stats.drafted > 0, "{name}");
        assert_eq!(stats.accepted, stats.drafted, "{name}: {stats:?}");
    }
}

#[test]
fn a_smaller_draft_model_with_the_same_vocabulary_keeps_the_tokens() {
    // The Q4_0 file is the same tiny model, quantized harder: a typical draft.
    let (tg, dg) = (
        common::open("tiny-qwen3-Q8_0.gguf"),
        common::open("tiny-qwen3-Q4_0.gguf"),
    );
    check_same_vocabulary(
        &Tokenizer::from_gguf(&tg).unwrap(),
        &Tokenizer::from_gguf(&dg).unwrap(),
    )
    .unwrap();
    let target = common::full(&tg, 2);
    let draft = Arc::new(common::full(&dg, 2));
    for (how, params) in samplings() {
        let (plain, _) = generate(&target, &params, &PROMPT, 48, None);
        let (fast, stats) = generate(
            &target,
            &params,
            &PROMPT,
            48,
            Some((
                Box::new(ModelDraft::new(draft.clone(), 256)),
                AdaptiveK::new(5),
            )),
        );
        assert_eq!(fast, plain, "{how}");
        assert!(stats.drafted > 0, "{how}");
    }
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    use tessera_model::{TokenizerKind, TokenizerParts};
    let vocab = |tokens: &[&str]| {
        Tokenizer::from_parts(TokenizerParts::new(
            TokenizerKind::Bpe,
            tokens.iter().map(|t| t.to_string()).collect(),
        ))
        .unwrap()
    };
    let target = vocab(&["a", "b", "c"]);
    assert!(check_same_vocabulary(&target, &vocab(&["a", "b", "c"])).is_ok());
    let e = check_same_vocabulary(&target, &vocab(&["a", "b"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 tokens, the target's 3"), "{e}");
    let e = check_same_vocabulary(&target, &vocab(&["a", "x", "c"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("token 1"), "{e}");
}
