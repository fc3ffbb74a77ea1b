//! Guards batch invariance: a sequence's logits do not depend on what else is in its batch,
//! and prefill-then-decode equals re-prefilling the whole history (failover replays a request
//! from its history and must get the same tokens).

mod common;

use common::assert_bits_eq;
use tessera_engine::ops::argmax;
use tessera_engine::{Generator, KvCache, KvType, Model};
use tessera_sampling::SamplingParams;

const MODELS: [&str; 6] = [
    "stories260K.gguf",
    "tiny-qwen3moe-f32.gguf",
    "tiny-qwen3-Q8_0.gguf",
    "small-qwen3moe-Q4_K.gguf",
    // Latent attention: one cached latent per position read by every head.
    "test/tiny-deepseek2-mla-Q8_0.gguf",
    "test/tiny-deepseek2-mla-Q5_0.gguf",
];

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 403, 407, 261, 378],
        vec![1, 317, 391, 266, 267, 290, 301, 12, 99],
        vec![1, 291],
    ]
}

/// Every model of [`MODELS`] with each KV cache type its heads allow.
fn models() -> Vec<(String, Model)> {
    let mut out = Vec::new();
    for name in MODELS {
        let g = common::open(name);
        for t in common::kv_types(&g) {
            out.push((format!("{name} ({t} cache)"), common::full_kv(&g, 2, t)));
        }
    }
    out
}

fn prefill(m: &Model, p: &[u32]) -> (KvCache, u32) {
    let mut kv = common::kv_for(m);
    let l = m.forward_last(p, &mut kv).unwrap();
    (kv, argmax(l.last()) as u32)
}

#[test]
fn decode_alone_equals_decode_in_a_batch() {
    for (name, m) in models() {
        let mut seqs: Vec<(KvCache, u32)> = prompts().iter().map(|p| prefill(&m, p)).collect();
        for step in 0..4 {
            // Each sequence alone, on a copy of its cache.
            let alone: Vec<Vec<f32>> = seqs
                .iter()
                .map(|(kv, t)| {
                    let mut kv = kv.clone();
                    m.forward_last(&[*t], &mut kv).unwrap().data
                })
                .collect();
            // All together in one batch step (also in a different order).
            let mut reversed: Vec<(KvCache, u32)> = seqs.iter().rev().cloned().collect();
            let mut batch: Vec<(u32, &mut KvCache)> =
                seqs.iter_mut().map(|(kv, t)| (*t, kv)).collect();
            let together = m.step(&mut batch).unwrap();
            for (i, a) in alone.iter().enumerate() {
                assert_bits_eq(together.row(i), a, &format!("{name} step {step} seq {i}"));
            }
            let mut batch: Vec<(u32, &mut KvCache)> =
                reversed.iter_mut().map(|(kv, t)| (*t, kv)).collect();
            let rev = m.step(&mut batch).unwrap();
            for (i, a) in alone.iter().rev().enumerate() {
                assert_bits_eq(
                    rev.row(i),
                    a,
                    &format!("{name} step {step} reversed seq {i}"),
                );
            }
            for ((_, t), row) in seqs.iter_mut().zip(&alone) {
                *t = argmax(row) as u32;
            }
        }
    }
}

#[test]
fn prefill_then_decode_equals_reprefill() {
    for (name, m) in models() {
        let p = &prompts()[1];
        let (mut kv, mut t) = prefill(&m, p);
        let mut history = p.clone();
        for step in 0..5 {
            history.push(t);
            let decoded = m.forward_last(&[t], &mut kv).unwrap();
            let mut fresh = common::kv_for(&m);
            let replayed = m.forward_last(&history, &mut fresh).unwrap();
            assert_bits_eq(
                &decoded.data,
                &replayed.data,
                &format!("{name} step {step}"),
            );
            // Chunked prefill of the same history, too.
            let mut chunked = common::kv_for(&m);
            let mut last = None;
            for c in history.chunks(3) {
                last = Some(m.forward_last(c, &mut chunked).unwrap());
            }
            assert_bits_eq(
                &last.unwrap().data,
                &decoded.data,
                &format!("{name} step {step} chunked"),
            );
            t = argmax(decoded.last()) as u32;
        }
    }
}

#[test]
fn thread_count_does_not_change_results() {
    let g = common::open("small-qwen3moe-Q4_K.gguf");
    for t in KvType::ALL {
        let (m1, m2) = (common::full_kv(&g, 1, t), common::full_kv(&g, 2, t));
        let p = &prompts()[1];
        let a = m1.forward(p, &mut common::kv_for(&m1)).unwrap();
        let b = m2.forward(p, &mut common::kv_for(&m2)).unwrap();
        assert_bits_eq(&a.data, &b.data, &format!("1 vs 2 threads, {t} cache"));
    }
}

#[test]
fn sampled_generation_replays_identically() {
    let g = common::open("stories260K.gguf");
    let m = common::full(&g, 2);
    let params = SamplingParams {
        seed: 1234,
        ..SamplingParams::default()
    };
    let run = |prompt: &[u32], n: usize| {
        let mut gen = Generator::new(&m, params.clone(), 512);
        let mut out = Vec::new();
        gen.generate(prompt, n, &[], &mut |t| {
            out.push(t);
            true
        })
        .unwrap();
        out
    };
    let p = prompts()[0].clone();
    let first = run(&p, 24);
    assert_eq!(first.len(), 24);
    // Replay from the middle: the prompt plus the first 10 generated tokens as history.
    let mut history = p.clone();
    history.extend_from_slice(&first[..10]);
    let rest = run(&history, 14);
    assert_eq!(rest, first[10..].to_vec());
}

#[test]
fn mixed_prefill_and_decode_batch_equals_separate_runs() {
    for (name, m) in models() {
        let ps = prompts();
        let (kv0, t0) = prefill(&m, &ps[0]);
        let (kv2, t2) = prefill(&m, &ps[2]);
        // Separately: decode seq 0, prefill seq 1 whole, decode seq 2.
        let a = m.forward_last(&[t0], &mut kv0.clone()).unwrap();
        let b = m.forward_last(&ps[1], &mut common::kv_for(&m)).unwrap();
        let c = m.forward_last(&[t2], &mut kv2.clone()).unwrap();
        // Together in one pass.
        let (mut k0, mut k1, mut k2) = (kv0.clone(), common::kv_for(&m), kv2.clone());
        let together = m
            .step_mixed(&mut [
                (&[t0][..], &mut k0),
                (&ps[1][..], &mut k1),
                (&[t2][..], &mut k2),
            ])
            .unwrap();
        assert_eq!(together.n_tokens, 3);
        assert_bits_eq(together.row(0), a.last(), &format!("{name} decode 0"));
        assert_bits_eq(together.row(1), b.last(), &format!("{name} prefill 1"));
        assert_bits_eq(together.row(2), c.last(), &format!("{name} decode 2"));
        assert_eq!(k1.len(), ps[1].len());
    }
}
