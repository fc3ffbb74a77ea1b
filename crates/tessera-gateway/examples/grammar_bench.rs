//! What structured output costs per token: the grammar mask (llguidance) at batch 1 and 16.
//!
//! ```text
//! cargo run --release -p tessera-gateway --example grammar_bench -- \
//!     [--vocab GGUF] [--model GGUF] [--tokens N]
//! ```
//!
//! Two measurements:
//!
//! 1. **Mask cost over a vocabulary** (`--vocab`, default stories260K's 512 tokens; pass a
//!    real vocabulary such as llama.cpp's `ggml-vocab-qwen2.gguf`, 151,936 tokens): 16
//!    sequences decode a JSON schema under the grammar from made-up logits; each step times
//!    `mask` (compute the allowed set, apply it to the logits row) and `accept`. Batch 1 is one
//!    sequence per step; batch 16 is 16 masks per step, computed one after another on the
//!    engine thread as the scheduler does.
//! 2. **End to end** (`--model`, default stories260K): the local backend at batch 1 and 16,
//!    greedy, with and without the grammar; decode tokens per second.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_engine::{Model, SamplingParams};
use tessera_gateway::grammar::{GrammarCompiler, GrammarSpec};
use tessera_gateway::{
    Backend, Event, GenerationRequest, LocalBackend, LocalConfig, SchedulerConfig,
};
use tessera_model::{GgufFile, Tokenizer};

fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
            "active": {"type": "boolean"}
        },
        "required": ["name", "age", "email", "tags", "active"],
        "additionalProperties": false
    })
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn default_model() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/stories260K.gguf").to_string()
}

/// Per-token mask+accept times of `batch` sequences decoded side by side.
fn mask_cost(tok: &Tokenizer, batch: usize, max_tokens: usize) -> (Vec<Duration>, usize) {
    let compiler = GrammarCompiler::new(tok).expect("indexing the vocabulary");
    let spec = GrammarSpec::JsonSchema(schema());
    let mut grammars: Vec<_> = (0..batch)
        .map(|_| compiler.compile(&spec).unwrap())
        .collect();
    let mut live = vec![true; batch];
    let mut per_step = Vec::new();
    let mut tokens = 0;
    let v = tok.vocab_size();
    let mut logits = vec![0f32; v];
    for step in 0..max_tokens as u32 {
        if !live.iter().any(|&l| l) {
            break;
        }
        let mut spent = Duration::ZERO;
        for (b, g) in grammars.iter_mut().enumerate() {
            if !live[b] {
                continue;
            }
            for (i, l) in logits.iter_mut().enumerate() {
                *l = (((i as u32).wrapping_mul(2_654_435_761) ^ step ^ (b as u32 * 7919)) % 1000)
                    as f32;
            }
            let t0 = Instant::now();
            g.mask(&mut logits).unwrap();
            spent += t0.elapsed();
            let t = tessera_engine::ops::argmax(&logits) as u32;
            if tok.is_end_of_generation(t) {
                live[b] = false;
                continue;
            }
            let t0 = Instant::now();
            g.accept(t).unwrap();
            spent += t0.elapsed();
            tokens += 1;
            if g.is_finished() {
                live[b] = false;
            }
        }
        per_step.push(spent);
    }
    (per_step, tokens)
}

fn end_to_end(model_path: &str, batch: usize, grammar: bool, max_tokens: usize) -> (usize, f64) {
    let gguf = GgufFile::open(model_path).unwrap();
    let model = Model::load_full(&gguf, 2).unwrap();
    let config = LocalConfig {
        scheduler: SchedulerConfig {
            max_active: batch,
            ..SchedulerConfig::default()
        },
        ..LocalConfig::default()
    };
    let backend = Arc::new(LocalBackend::start("m", &gguf, model, config).unwrap());
    let served = backend.model();
    let compiler = served.grammar_compiler().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let t0 = Instant::now();
    let handles: Vec<_> = (0..batch)
        .map(|i| {
            let prompt = served.tokenizer.encode(
                &format!("Person {i} likes {}", ["cats", "dogs"][i % 2]),
                true,
            );
            let mut req =
                GenerationRequest::new(i as u64, prompt, SamplingParams::greedy(), max_tokens);
            if grammar {
                req.grammar = Some(
                    compiler
                        .compile(&GrammarSpec::JsonSchema(schema()))
                        .unwrap(),
                );
            }
            backend.submit(req).unwrap()
        })
        .collect();
    let tokens: usize = rt.block_on(async {
        let mut total = 0;
        for mut h in handles {
            while let Some(e) = h.next_event().await {
                match e {
                    Event::Token(_) | Event::TokenLogprobs(_) => total += 1,
                    Event::Finished { .. } => break,
                    Event::Failed { message } => panic!("{message}"),
                }
            }
        }
        total
    });
    (tokens, t0.elapsed().as_secs_f64())
}

fn main() {
    let vocab_path = arg("--vocab").unwrap_or_else(default_model);
    let model_path = arg("--model").unwrap_or_else(default_model);
    let max_tokens: usize = arg("--tokens").and_then(|s| s.parse().ok()).unwrap_or(96);
    let tok = Tokenizer::from_gguf(&GgufFile::open(&vocab_path).unwrap()).unwrap();
    let t0 = Instant::now();
    GrammarCompiler::new(&tok).unwrap();
    println!(
        "vocabulary {} ({} tokens): indexed in {:.1} ms (once per served model)",
        vocab_path,
        tok.vocab_size(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    for batch in [1, 16] {
        let (steps, tokens) = mask_cost(&tok, batch, max_tokens);
        let total: Duration = steps.iter().sum();
        let mut sorted = steps.clone();
        sorted.sort();
        let pick = |q: f64| {
            let i = ((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1));
            sorted.get(i).copied().unwrap_or_default().as_secs_f64() * 1e6
        };
        println!(
            "mask+accept, batch {batch:2}: {:.1} us per token (mean); per step median {:.1} us, \
             p90 {:.1} us, max {:.1} us; {tokens} tokens in {} steps",
            total.as_secs_f64() * 1e6 / tokens.max(1) as f64,
            pick(0.5),
            pick(0.9),
            pick(1.0),
            steps.len()
        );
    }
    for batch in [1, 16] {
        for grammar in [false, true] {
            let (tokens, secs) = end_to_end(&model_path, batch, grammar, max_tokens);
            println!(
                "end to end {model_path}, batch {batch:2}, grammar {grammar:5}: {tokens} tokens, {:.0} tok/s",
                tokens as f64 / secs
            );
        }
    }
}
