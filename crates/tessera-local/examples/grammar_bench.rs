//! What structured output costs per token: the grammar mask (llguidance) at batch 1 and 16.
//!
//! ```text
//! cargo run --release -p tessera-local --example grammar_bench -- \
//!     [--vocab GGUF] [--model GGUF] [--tokens N]
//! ```
//!
//! Two measurements, each with and without the grammar in the same run:
//!
//! 1. **The sampling step over a vocabulary** (`--vocab`, default stories260K's 512 tokens;
//!    pass a real vocabulary such as llama.cpp's `ggml-vocab-qwen2.gguf`, 151,936 tokens):
//!    sequences decode a JSON schema from made-up logits through the step both backends run
//!    (`choose`: penalties, mask, draw), timing on the same logits row the draw without the
//!    grammar, and with it split in its parts: the grammar's own work (`mask`: compute the
//!    allowed set and apply it; `accept`) and the draw from the masked row. Batch 1 is one
//!    sequence per step; batch 16 is 16 draws per step, one after another on the sampling
//!    thread as the scheduler and the ring's last stage do.
//! 2. **End to end** (`--model`, default stories260K): the local backend at batch 1 and 16,
//!    greedy, with and without the grammar; milliseconds per generated token.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_api::{Backend, Event, GenerationRequest};
use tessera_engine::Model;
use tessera_gateway::grammar::{GrammarCompiler, GrammarSpec};
use tessera_gateway::SchedulerConfig;
use tessera_local::{LocalBackend, LocalConfig};
use tessera_model::{GgufFile, Tokenizer};
use tessera_sampling::SamplingParams;
use tessera_sampling::{process_logits, sample_processed};

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

/// Times of one decode step of a batch, summed over its sequences.
#[derive(Default)]
struct StepTimes {
    /// Penalties and draw from the unmasked row (`choose` without a grammar).
    plain: Duration,
    /// The grammar's work: `mask` and `accept`.
    grammar: Duration,
    /// Penalties and draw from the masked row.
    masked_draw: Duration,
}

/// Per step of `batch` sequences decoded side by side, what each part took; and the tokens
/// drawn. The parts are `tessera_grammar::choose`'s, timed one by one.
fn step_cost(tok: &Tokenizer, batch: usize, max_tokens: usize) -> (Vec<StepTimes>, usize) {
    let compiler = GrammarCompiler::new(tok).expect("indexing the vocabulary");
    let spec = GrammarSpec::JsonSchema(schema());
    let mut grammars: Vec<_> = (0..batch)
        .map(|_| compiler.compile(&spec).unwrap())
        .collect();
    let mut histories: Vec<Vec<u32>> = vec![vec![1]; batch];
    let params = SamplingParams::default();
    let mut live = vec![true; batch];
    let mut steps = Vec::new();
    let mut tokens = 0;
    let v = tok.vocab_size();
    let mut logits = vec![0f32; v];
    for step in 0..max_tokens as u32 {
        if !live.iter().any(|&l| l) {
            break;
        }
        let mut st = StepTimes::default();
        for (b, g) in grammars.iter_mut().enumerate() {
            if !live[b] {
                continue;
            }
            for (i, l) in logits.iter_mut().enumerate() {
                *l = (((i as u32).wrapping_mul(2_654_435_761) ^ step ^ (b as u32 * 7919)) % 1000)
                    as f32
                    / 100.0;
            }
            let h = &histories[b];
            let pos = h.len() as u64;
            let t0 = Instant::now();
            let mut row = logits.clone();
            process_logits(&mut row, &params, h);
            std::hint::black_box(sample_processed(&row, &params, pos));
            st.plain += t0.elapsed();
            let t0 = Instant::now();
            let mut row = logits.clone();
            process_logits(&mut row, &params, h);
            st.masked_draw += t0.elapsed();
            let t0 = Instant::now();
            g.mask(&mut row).unwrap();
            st.grammar += t0.elapsed();
            let t0 = Instant::now();
            let t = sample_processed(&row, &params, pos);
            st.masked_draw += t0.elapsed();
            let end = tok.is_end_of_generation(t);
            let t0 = Instant::now();
            if !end {
                g.accept(t).unwrap();
            }
            st.grammar += t0.elapsed();
            if end {
                live[b] = false;
                continue;
            }
            histories[b].push(t);
            tokens += 1;
            if g.is_finished() {
                live[b] = false;
            }
        }
        steps.push(st);
    }
    (steps, tokens)
}

/// (median, p90, max) of `steps`, in µs.
fn spread(steps: &[Duration]) -> (f64, f64, f64) {
    let mut sorted = steps.to_vec();
    sorted.sort();
    let pick = |q: f64| {
        let i = ((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1));
        sorted.get(i).copied().unwrap_or_default().as_secs_f64() * 1e6
    };
    (pick(0.5), pick(0.9), pick(1.0))
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
                    Event::PromptCached(_) | Event::Checked(_) => {}
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
        let (steps, tokens) = step_cost(&tok, batch, max_tokens);
        let part =
            |f: fn(&StepTimes) -> Duration| -> Vec<Duration> { steps.iter().map(f).collect() };
        let per_token =
            |d: &[Duration]| d.iter().sum::<Duration>().as_secs_f64() * 1e6 / tokens.max(1) as f64;
        let (plain, grammar, masked) = (
            part(|s| s.plain),
            part(|s| s.grammar),
            part(|s| s.masked_draw),
        );
        let (g50, g90, gmax) = spread(&grammar);
        println!(
            "batch {batch:2} ({tokens} tokens in {} steps), per token (mean): draw without the \
             grammar {:.1} us; with it {:.1} us = grammar (mask + accept) {:.1} us + draw from \
             the masked row {:.1} us. Grammar per step: median {g50:.1} us, p90 {g90:.1} us, \
             max {gmax:.1} us",
            steps.len(),
            per_token(&plain),
            per_token(&grammar) + per_token(&masked),
            per_token(&grammar),
            per_token(&masked),
        );
    }
    for batch in [1, 16] {
        for grammar in [false, true] {
            let (tokens, secs) = end_to_end(&model_path, batch, grammar, max_tokens);
            println!(
                "end to end {model_path}, batch {batch:2}, grammar {grammar:5}: {tokens} tokens, \
                 {:.3} ms per token ({:.0} tok/s)",
                secs * 1e3 / tokens.max(1) as f64,
                tokens as f64 / secs
            );
        }
    }
}
