//! The stage driven directly: rings of stages in one process against one model, prefix reuse,
//! grammars and log-probabilities, batching and the KV budget.

use super::*;
use std::collections::VecDeque;
use std::path::PathBuf;
use tessera_engine::{Generator, LoadSpec};
use tessera_model::{GgufFile, ModelConfig};
use tessera_proto::FinishReason;
use tessera_sampling::SamplingParams;
use tessera_sampling::TokenLogprobs;

fn model_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name)
}

fn assignment(
    stage: usize,
    n: usize,
    layers: std::ops::Range<usize>,
    last: usize,
) -> StageAssignment {
    StageAssignment {
        epoch: 1,
        model: crate::store::ContentHash([0; 32]),
        stage,
        n_stages: n,
        embed: layers.start == 0,
        head: layers.end == last,
        layers,
        next: None,
        prev: None,
        max_context: 256,
        kv_type: tessera_engine::KvType::default(),
        expert_budget: None,
    }
}

/// Runs a ring of in-process stages and returns the generated tokens.
fn run_ring(path: &str, cuts: &[usize], prompt: &[u32], n: usize, chunk: usize) -> Vec<u32> {
    let open = OpenSeq {
        seq: 1,
        epoch: 1,
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_new_tokens: n,
        eog: vec![],
        prefill_chunk: chunk,
        trace: false,
        grammar: None,
        logprobs: None,
        replayed: 0,
        speculate: 0,
        prediction: Vec::new(),
    };
    let (tokens, _) = ring(path, cuts, open);
    tokens.into_iter().map(|(t, _)| t).collect()
}

/// Runs `open` (as sequence 1) over a ring of in-process stages cut at `cuts`; the tokens
/// with their log-probabilities, and how the sequence finished.
fn ring(
    path: &str,
    cuts: &[usize],
    open: OpenSeq,
) -> (Vec<(u32, Option<TokenLogprobs>)>, Option<FinishReason>) {
    let mut stages = load_stages(path, cuts);
    drive(&mut stages, open, false)
}

/// In-process stages of `path` cut at `cuts`, in ring order.
fn load_stages(path: &str, cuts: &[usize]) -> Vec<Stage> {
    let g = GgufFile::open(model_path(path)).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(cfg.n_layer);
    let n_stages = bounds.len() - 1;
    (0..n_stages)
        .map(|i| {
            let a = assignment(i, n_stages, bounds[i]..bounds[i + 1], cfg.n_layer);
            let m = Model::load(
                &g,
                LoadSpec::stage(&cfg, a.layers.clone()),
                1,
                &mut |_, _| {},
            )
            .unwrap();
            let mut s = Stage::new(a, m, None);
            s.set_tokenizer(tessera_model::Tokenizer::from_gguf(&g).unwrap());
            s
        })
        .collect()
}

/// Runs `open` over `stages` as the coordinator does: opens it everywhere, starts it at
/// the fewest cached positions any stage reported, relays, closes (keeping the caches when
/// `keep`). The tokens with their log-probabilities, and how the sequence finished.
fn drive(
    stages: &mut [Stage],
    open: OpenSeq,
    keep: bool,
) -> (Vec<(u32, Option<TokenLogprobs>)>, Option<FinishReason>) {
    let (tokens, finish, _) = drive_with_stats(stages, open, keep);
    (tokens, finish)
}

/// The tokens with their log-probabilities, how the sequence finished, and each stage's
/// statistics of it.
type Driven = (
    Vec<(u32, Option<TokenLogprobs>)>,
    Option<FinishReason>,
    Vec<StageSeqStats>,
);

/// [`drive`], with each stage's statistics of the sequence.
fn drive_with_stats(stages: &mut [Stage], open: OpenSeq, keep: bool) -> Driven {
    let seq = open.seq;
    let n = open.max_new_tokens;
    let prompt = open.prompt.clone();
    let reuse = stages
        .iter_mut()
        .map(|s| s.open(open.clone()).unwrap())
        .min()
        .unwrap();
    // (stage index, output) queue.
    let mut queue: VecDeque<(usize, StageOutput)> = VecDeque::new();
    let mut tokens = Vec::new();
    let mut finish = None;
    stages[0]
        .start(seq, reuse, &mut |o| queue.push_back((0, o)))
        .unwrap();
    while let Some((from, o)) = queue.pop_front() {
        let mut out = Vec::new();
        let handler = match o {
            StageOutput::Hidden(h, d) => {
                stages[from + 1]
                    .handle_hidden(h, d, &mut |o| out.push(o))
                    .unwrap();
                from + 1
            }
            StageOutput::Token(t) => {
                stages[0].handle_token(t, &mut |o| out.push(o)).unwrap();
                0
            }
            StageOutput::Control(NodeToCoord::Token {
                token, logprobs, ..
            }) => {
                tokens.push((token, logprobs));
                continue;
            }
            StageOutput::Control(NodeToCoord::Finished { reason, .. }) => {
                finish = Some(reason);
                continue;
            }
            StageOutput::Control(_) => continue,
        };
        queue.extend(out.into_iter().map(|o| (handler, o)));
    }
    let fed: Vec<u32> = prompt
        .iter()
        .copied()
        .chain(tokens.iter().map(|(t, _)| *t))
        .collect();
    let mut all = Vec::new();
    for s in stages.iter_mut() {
        let stats = s.close(seq, if keep { &fed } else { &[] }).unwrap();
        assert!(stats.decode.steps > 0 || n <= 1);
        assert_eq!(
            stats.prefill.tokens as usize,
            prompt.len() - reuse,
            "only the positions past the reused prefix are prefilled"
        );
        assert_eq!(s.open_seqs(), 0);
        all.push(stats);
    }
    (tokens, finish, all)
}

/// A chat's next turn on a ring whose stages kept the first turn's caches: every stage
/// starts from the same prefix (the fewest positions any stage kept), prefills only the
/// rest, and the tokens equal one process computing everything from scratch.
#[test]
fn a_ring_reuses_kept_prefixes_and_answers_as_from_scratch() {
    let path = "test/tiny-qwen3-Q8_0.gguf";
    let mut stages = load_stages(path, &[1]);
    for s in &mut stages {
        s.set_prefix_cache(2);
    }
    let first: Vec<u32> = (0..40).map(|i| 1 + (i * 37) % 400).collect();
    let open = |seq: u64, prompt: &[u32]| OpenSeq {
        seq,
        epoch: 1,
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_new_tokens: 6,
        eog: vec![],
        prefill_chunk: 16,
        trace: false,
        grammar: None,
        logprobs: None,
        replayed: 0,
        speculate: 0,
        prediction: Vec::new(),
    };
    let ids = |r: (Vec<(u32, Option<TokenLogprobs>)>, _)| -> Vec<u32> {
        r.0.into_iter().map(|(t, _)| t).collect()
    };
    let answer = ids(drive(&mut stages, open(1, &first), true));
    assert_eq!(answer, reference(path, &first, 6, 16));
    assert!(stages.iter().all(|s| s.kept_caches() == 1));
    // The next turn: the first prompt, the answer but its last token (never fed), more.
    let mut second = first.clone();
    second.extend(&answer[..5]);
    second.extend([7, 8, 9, 10]);
    let cached: Vec<usize> = stages
        .iter_mut()
        .map(|s| s.open(open(2, &second)).unwrap())
        .collect();
    assert_eq!(cached, [45, 45], "the first turn's 40 + 5 fed positions");
    for s in &mut stages {
        s.close(2, &[]);
    }
    // That probe dropped the kept caches (taken, then closed without keeping): run the
    // first turn again, then let the second stage keep less than the first.
    ids(drive(&mut stages, open(3, &first), true));
    let got = ids(drive(&mut stages, open(4, &second), true));
    assert_eq!(got, reference(path, &second, 6, 16));
    let mut third = second.clone();
    third.extend(&got[..3]);
    third.push(11);
    let mut cut = stages[1].kept.pop_oldest().unwrap();
    cut.truncate(20);
    stages[1].kept.put(third[..20].to_vec(), cut);
    let got = ids(drive(&mut stages, open(5, &third), true));
    assert_eq!(
        got,
        reference(path, &third, 6, 16),
        "started at position 20"
    );
}

/// The sampling stage masks every draw with the sequence's grammar and reports
/// log-probabilities; a resumed attempt (prompt + the tokens so far, `replayed`) continues
/// with the same tokens, grammar state and log-probabilities.
#[test]
fn the_sampling_stage_follows_a_grammar_reports_logprobs_and_replays_both() {
    let path = "stories260K.gguf";
    let g = GgufFile::open(model_path(path)).unwrap();
    let tok = tessera_model::Tokenizer::from_gguf(&g).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"pet": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["pet", "n"],
        "additionalProperties": false
    });
    let prompt = tok.encode("Once upon a time", true);
    let open = OpenSeq {
        seq: 1,
        epoch: 1,
        prompt: prompt.clone(),
        sampling: SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..SamplingParams::greedy()
        },
        max_new_tokens: 60,
        eog: (0..tok.vocab_size() as u32)
            .filter(|&t| tok.is_end_of_generation(t))
            .collect(),
        prefill_chunk: 8,
        trace: false,
        grammar: Some(tessera_grammar::GrammarSpec::JsonSchema(schema)),
        logprobs: Some(2),
        replayed: 0,
        speculate: 0,
        prediction: Vec::new(),
    };
    let (whole, finish) = ring(path, &[2], open.clone());
    let ids: Vec<u32> = whole.iter().map(|(t, _)| *t).collect();
    let text = tok.decode(&ids);
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v["pet"] == "cat" || v["pet"] == "dog", "{v}");
    assert!((0..=99).contains(&v["n"].as_i64().unwrap()), "{v}");
    // The grammar ended the answer, not the length.
    assert_eq!(finish, Some(FinishReason::EndOfGeneration));
    for (t, lp) in &whole {
        let lp = lp.as_ref().expect("log-probabilities asked for");
        assert_eq!(lp.token, *t);
        assert!(lp.logprob <= 0.0 && lp.top.len() <= 2, "{lp:?}");
    }
    // Resume after 5 tokens, as the coordinator does after a failover.
    let k = 5;
    let mut resumed = open.clone();
    resumed.prompt.extend(&ids[..k]);
    resumed.max_new_tokens -= k;
    resumed.replayed = k;
    let (rest, finish2) = ring(path, &[2], resumed);
    assert_eq!(rest, whole[k..].to_vec());
    assert_eq!(finish2, finish);
    // Without replaying the grammar over those 5 tokens, it would restart the object.
    let mut wrong = open;
    wrong.prompt.extend(&ids[..k]);
    wrong.max_new_tokens -= k;
    let (other, _) = ring(path, &[2], wrong);
    assert_ne!(other, whole[k..].to_vec());
}

/// Speculation on the ring: the sampling stage drafts by prompt lookup, each token goes back
/// with its drafts, the ring runs them as one micro-batch, and the sampling stage keeps the
/// drafts its draws agree with. The tokens, log-probabilities and finish are those without
/// it (greedy and seeded, under a grammar, one stage and three), with drafts accepted and so
/// fewer ring turns; a cache kept after a speculative sequence serves the next turn as if
/// computed from scratch (the drafts' positions past the last agreement are not kept).
#[test]
fn speculation_on_the_ring_changes_no_token_logprob_or_kept_cache() {
    let path = "stories260K.gguf";
    let g = GgufFile::open(model_path(path)).unwrap();
    let tok = tessera_model::Tokenizer::from_gguf(&g).unwrap();
    // A story that begins again: prompt lookup finds what followed the first time.
    let prompt = tok.encode(
        "Once upon a time, there was a little girl named Lily. She liked to play outside. \
         Once upon a time, there was a little",
        true,
    );
    let eog: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&t| tok.is_end_of_generation(t))
        .collect();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"pet": {"enum": ["cat", "dog"]}},
        "required": ["pet"],
        "additionalProperties": false
    });
    let seeded = SamplingParams {
        temperature: 0.8,
        seed: 11,
        ..SamplingParams::greedy()
    };
    let cases = [
        (vec![], SamplingParams::greedy(), None),
        (vec![2, 4], SamplingParams::greedy(), None),
        (vec![2, 4], seeded, None),
        (
            vec![2, 4],
            SamplingParams::greedy(),
            Some(tessera_grammar::GrammarSpec::JsonSchema(schema)),
        ),
    ];
    for (i, (cuts, sampling, grammar)) in cases.into_iter().enumerate() {
        // Under the grammar, the prompt shows an answer for the lookup to copy from.
        let prompt = match grammar {
            Some(_) => tok.encode("Lily said {\"pet\": \"dog\"} and Tom said ", true),
            None => prompt.clone(),
        };
        let open = OpenSeq {
            seq: 1,
            epoch: 1,
            prompt,
            sampling,
            max_new_tokens: 48,
            eog: eog.clone(),
            prefill_chunk: 16,
            trace: false,
            grammar: grammar.clone(),
            logprobs: Some(2),
            replayed: 0,
            speculate: 0,
            prediction: Vec::new(),
        };
        let (plain, finish, plain_stats) =
            drive_with_stats(&mut load_stages(path, &cuts), open.clone(), false);
        let fast = OpenSeq {
            speculate: 4,
            ..open.clone()
        };
        // The client's prediction: the answer itself (drafted from its first token on), and a
        // wrong one (drafts rejected); neither changes a token.
        let answer: Vec<u32> = plain.iter().map(|t| t.0).collect();
        let wrong: Vec<u32> = answer.iter().rev().copied().collect();
        for (prediction, right) in [(answer, true), (wrong, false)] {
            let predicted = OpenSeq {
                speculate: 4,
                prediction,
                ..open.clone()
            };
            let (got, got_finish, stats) =
                drive_with_stats(&mut load_stages(path, &cuts), predicted, false);
            assert_eq!(got, plain, "case {i}: prediction {right}");
            assert_eq!(got_finish, finish, "case {i}: prediction {right}");
            let sampler = stats.last().unwrap();
            if right {
                // Every turn after the first token's verifies and every draft stands (but a
                // last one the sequence ends on: its draw ends the walk): 5 tokens a turn.
                assert!(sampler.drafted > 0, "case {i}");
                assert!(
                    sampler.drafted - sampler.drafts_accepted <= 1,
                    "case {i}: {sampler:?}"
                );
                assert!(
                    stats[0].decode.steps as usize <= (plain.len() - 1).div_ceil(5),
                    "case {i}: {} turns for {} tokens: {sampler:?}",
                    stats[0].decode.steps,
                    plain.len()
                );
            }
        }
        let (spec, spec_finish, stats) =
            drive_with_stats(&mut load_stages(path, &cuts), fast, false);
        assert_eq!(spec, plain, "case {i}: cut at {cuts:?}");
        assert_eq!(spec_finish, finish, "case {i}");
        let sampler = stats.last().unwrap();
        assert!(sampler.drafted > 0, "case {i}: nothing was drafted");
        if grammar.is_none() {
            assert!(
                sampler.drafts_accepted > 0,
                "case {i}: no draft agreed: {sampler:?}"
            );
            assert!(
                stats[0].decode.steps < plain_stats[0].decode.steps,
                "case {i}: as many ring turns with speculation ({} against {})",
                stats[0].decode.steps,
                plain_stats[0].decode.steps
            );
        }
    }
    // Kept after a speculative answer, the caches serve the next turn as from scratch: also
    // when the answer ended mid-step (the grammar completed), where the stages still hold the
    // positions of drafts the sampling stage did not keep.
    let json = tok.encode("Lily said {\"pet\": \"dog\"} and Tom said ", true);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"pet": {"enum": ["cat", "dog"]}},
        "required": ["pet"],
        "additionalProperties": false
    });
    let open = |seq: u64, prompt: &[u32], n: usize, grammar: bool| OpenSeq {
        seq,
        epoch: 1,
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_new_tokens: n,
        eog: vec![],
        prefill_chunk: 16,
        trace: false,
        grammar: grammar.then(|| tessera_grammar::GrammarSpec::JsonSchema(schema.clone())),
        logprobs: None,
        replayed: 0,
        speculate: 6,
        prediction: Vec::new(),
    };
    let ids = |r: (Vec<(u32, Option<TokenLogprobs>)>, _)| -> Vec<u32> {
        r.0.into_iter().map(|(t, _)| t).collect()
    };
    for (first, n, grammar) in [(&prompt, 12, false), (&json, 40, true)] {
        let mut stages = load_stages(path, &[3]);
        for s in &mut stages {
            s.set_prefix_cache(2);
        }
        let answer = ids(drive(&mut stages, open(1, first, n, grammar), true));
        let mut next = first.clone();
        next.extend(&answer);
        next.extend(tok.encode(" One day", false));
        let again = ids(drive(&mut stages, open(2, &next, 8, false), true));
        let fresh = ids(drive(
            &mut load_stages(path, &[3]),
            open(3, &next, 8, false),
            false,
        ));
        assert_eq!(again, fresh, "after {:?}", tok.decode(&answer));
    }
}

fn reference(path: &str, prompt: &[u32], n: usize, chunk: usize) -> Vec<u32> {
    let g = GgufFile::open(model_path(path)).unwrap();
    let m = Model::load_full(&g, 1).unwrap();
    let mut gen = Generator::new(&m, SamplingParams::greedy(), 256);
    gen.prefill_chunk = chunk;
    let mut out = Vec::new();
    gen.generate(prompt, n, &[], &mut |t| {
        out.push(t);
        true
    })
    .unwrap();
    out
}

#[test]
fn in_process_ring_equals_one_model() {
    let prompt = [1u32, 403, 407, 261, 378, 300, 42, 17, 99, 5];
    for (model, cuts) in [
        ("stories260K.gguf", vec![]),
        ("stories260K.gguf", vec![2]),
        ("stories260K.gguf", vec![1, 3]),
        ("test/tiny-qwen3-Q8_0.gguf", vec![1]),
    ] {
        let want = reference(model, &prompt, 6, 4);
        let got = run_ring(model, &cuts, &prompt, 6, 4);
        assert_eq!(got, want, "{model} cut at {cuts:?}");
    }
}

/// Two sequences decoded together (one batch per ring turn) give each its own tokens.
#[test]
fn batched_sequences_decode_as_if_alone() {
    let path = "test/tiny-qwen3-Q8_0.gguf";
    let g = GgufFile::open(model_path(path)).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let a = assignment(0, 1, 0..cfg.n_layer, cfg.n_layer);
    let m = Model::load(
        &g,
        LoadSpec::stage(&cfg, a.layers.clone()),
        1,
        &mut |_, _| {},
    )
    .unwrap();
    let mut st = Stage::new(a, m, None);
    let prompts = [vec![1u32, 403, 407, 261], vec![1u32, 17, 99, 5, 6, 7, 300]];
    for (i, p) in prompts.iter().enumerate() {
        st.open(OpenSeq {
            seq: i as u64,
            epoch: 1,
            prompt: p.clone(),
            sampling: SamplingParams::greedy(),
            max_new_tokens: 6,
            eog: vec![],
            prefill_chunk: 64,
            trace: false,
            grammar: None,
            logprobs: None,
            replayed: 0,
            speculate: 0,
            prediction: Vec::new(),
        })
        .unwrap();
    }
    let mut ring: Vec<RingToken> = Vec::new();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 2];
    let collect = |o: StageOutput, ring: &mut Vec<RingToken>, got: &mut Vec<Vec<u32>>| match o {
        StageOutput::Token(t) => ring.push(t),
        StageOutput::Control(NodeToCoord::Token { seq, token, .. }) => {
            got[seq as usize].push(token)
        }
        _ => {}
    };
    for i in 0..2 {
        st.start(i, 0, &mut |o| collect(o, &mut ring, &mut got))
            .unwrap();
    }
    while !ring.is_empty() {
        let batch = std::mem::take(&mut ring);
        assert!(batch.len() <= 2);
        let errs = st.handle_tokens(batch, &mut |o| collect(o, &mut ring, &mut got));
        assert!(errs.is_empty());
    }
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(got[i], reference(path, p, 6, 64), "sequence {i}");
    }
}

#[test]
fn kv_budget_refuses_a_sequence_that_does_not_fit() {
    let g = GgufFile::open(model_path("stories260K.gguf")).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let a = assignment(0, 1, 0..cfg.n_layer, cfg.n_layer);
    let m = Model::load(
        &g,
        LoadSpec::stage(&cfg, a.layers.clone()),
        1,
        &mut |_, _| {},
    )
    .unwrap();
    let mut st = Stage::new(a, m, Some(1000));
    let open = OpenSeq {
        seq: 3,
        epoch: 1,
        prompt: vec![1, 2, 3],
        sampling: SamplingParams::greedy(),
        max_new_tokens: 100,
        eog: vec![],
        prefill_chunk: 64,
        trace: false,
        grammar: None,
        logprobs: None,
        replayed: 0,
        speculate: 0,
        prediction: Vec::new(),
    };
    assert!(matches!(st.open(open), Err(StageError::OverBudget { .. })));
    assert!(matches!(
        st.handle_token(
            RingToken {
                seq: 3,
                pos: 0,
                token: 1,
                drafts: vec![],
            },
            &mut |_| {}
        ),
        Err(StageError::UnknownSeq(3))
    ));
}

#[test]
fn a_hidden_state_with_nan_or_infinity_fails_the_step_and_names_the_sender() {
    let g = GgufFile::open(model_path("stories260K.gguf")).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let a = assignment(1, 2, 2..cfg.n_layer, cfg.n_layer);
    let m = Model::load(
        &g,
        LoadSpec::stage(&cfg, a.layers.clone()),
        1,
        &mut |_, _| {},
    )
    .unwrap();
    let mut st = Stage::new(a, m, None);
    st.open(OpenSeq {
        seq: 7,
        epoch: 1,
        prompt: vec![1, 2],
        sampling: SamplingParams::greedy(),
        max_new_tokens: 4,
        eog: vec![],
        prefill_chunk: 64,
        trace: false,
        grammar: None,
        logprobs: None,
        replayed: 0,
        speculate: 0,
        prediction: Vec::new(),
    })
    .unwrap();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut data = vec![0.5f32; 2 * cfg.n_embd];
        data[3] = bad;
        let header = StepHeader {
            n_embd: cfg.n_embd as u32,
            entries: vec![tessera_proto::StepEntry {
                seq: 7,
                start_pos: 0,
                n_tokens: 2,
                flags: 0,
            }],
        };
        let mut out = Vec::new();
        let e = st
            .handle_hidden(header, data, &mut |o| out.push(o))
            .unwrap_err();
        assert!(matches!(e, StageError::NonFinite { count: 1, .. }), "{e}");
        assert!(e.to_string().contains("the previous stage"), "{e}");
        assert!(out.is_empty(), "nothing was computed or sampled");
    }
}
