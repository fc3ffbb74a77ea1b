//! Running a command under a deadline, reading a client's JSON messages, the greedy tokens
//! of one process, and the hidden-state hashes a ring's stages report (`--trace`) beside
//! those of one process.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_engine::{Generator, KvCache, KvType, LocalExperts, Model, SeqStep};
use tessera_model::{GgufFile, ModelConfig, Tokenizer};
use tessera_sampling::SamplingParams;

/// Runs `cmd` to the end; panics (with its stderr) if it takes longer than `timeout`.
pub fn run_with_timeout(mut cmd: Command, timeout: Duration) -> Output {
    let mut child = cmd.spawn().expect("spawning");
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("timed out: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn tokens_of(msgs: &[Value]) -> Vec<u32> {
    msgs.iter()
        .filter(|m| m["type"] == "token" && m["token"].as_u64() != Some(u64::from(u32::MAX)))
        .map(|m| m["token"].as_u64().unwrap() as u32)
        .collect()
}

pub fn report_of(msgs: &[Value]) -> &Value {
    msgs.iter()
        .find(|m| m["type"] == "done")
        .unwrap_or_else(|| panic!("no report in {msgs:?}"))
}

/// Greedy tokens of one process, as `tessera generate` computes them.
pub fn reference_tokens(path: &Path, prompt: &[u32], n: usize, chunk: usize) -> Vec<u32> {
    let g = GgufFile::open(path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let mut eog: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&t| tok.is_end_of_generation(t))
        .collect();
    eog.extend(tok.bos_id());
    let m = Model::load_full(&g, 1).unwrap();
    let mut gen = Generator::new(&m, SamplingParams::greedy(), prompt.len() + n);
    gen.prefill_chunk = chunk;
    let mut out = Vec::new();
    gen.generate(prompt, n, &eog, &mut |t| {
        out.push(t);
        true
    })
    .unwrap();
    out
}

/// `(after_layer, start_pos, n_tokens) -> hash` of the hidden state after each boundary in
/// `ends`, for the steps a ring runs: prompt chunks, then each generated token but the last.
pub fn reference_boundaries(
    path: &Path,
    prompt: &[u32],
    generated: &[u32],
    chunk: usize,
    ends: &[usize],
) -> Vec<(usize, usize, usize, String)> {
    reference_boundaries_from(path, prompt, generated, chunk, ends, 0)
}

/// [`reference_boundaries`] of a ring that starts at prompt position `from` (the positions
/// before it reused from kept caches): those are computed here too, in one step not reported.
pub fn reference_boundaries_from(
    path: &Path,
    prompt: &[u32],
    generated: &[u32],
    chunk: usize,
    ends: &[usize],
    from: usize,
) -> Vec<(usize, usize, usize, String)> {
    let g = GgufFile::open(path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let m = Model::load_full(&g, 1).unwrap();
    let mut kv = KvCache::new(
        &cfg,
        0..cfg.n_layer,
        prompt.len() + generated.len(),
        KvType::default(),
    )
    .unwrap();
    let mut steps: Vec<(usize, Vec<u32>)> = Vec::new();
    if from > 0 {
        steps.push((0, prompt[..from].to_vec()));
    }
    for (i, c) in prompt[from..].chunks(chunk).enumerate() {
        steps.push((from + i * chunk, c.to_vec()));
    }
    for (i, &t) in generated
        .iter()
        .enumerate()
        .take(generated.len().saturating_sub(1))
    {
        steps.push((prompt.len() + i, vec![t]));
    }
    let mut out = Vec::new();
    for (pos, tokens) in steps {
        let reused = from > 0 && pos == 0;
        let step = [SeqStep {
            n_tokens: tokens.len(),
            start_pos: pos,
        }];
        let mut h = m.embed(&tokens).unwrap();
        let mut from = 0;
        for &end in ends {
            m.run_layers(
                from..end,
                &mut h,
                &step,
                &mut [&mut kv],
                &mut LocalExperts(&m),
            )
            .unwrap();
            if !reused {
                out.push((end, pos, tokens.len(), tessera_proto::hash_f32s(&h.data)));
            }
            from = end;
        }
    }
    out.sort();
    out
}

pub fn traces_of(msgs: &[Value]) -> Vec<(usize, usize, usize, String)> {
    let mut v: Vec<_> = msgs
        .iter()
        .filter(|m| m["type"] == "trace")
        .map(|m| {
            (
                m["after_layer"].as_u64().unwrap() as usize,
                m["start_pos"].as_u64().unwrap() as usize,
                m["n_tokens"].as_u64().unwrap() as usize,
                m["hash"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    v.sort();
    v
}
