//! Grammars from clients, as the gateway and a ring's sampling stage take them: arbitrary bytes
//! as a JSON schema (or, after a leading `%`, as lark source) go through the bounds check and,
//! when within the limits, llguidance's compiler and a few mask/accept steps. Nothing may panic,
//! abort (a stack overflow is an abort), hang or allocate without bound: a grammar is refused
//! with an error or compiled.
//!
//! The vocabulary is `models/stories260K.gguf`'s (compiled in), small enough that a compile
//! costs milliseconds.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tessera_grammar::{GrammarCompiler, GrammarSpec};
use tessera_model::{GgufFile, Tokenizer};

#[path = "common.rs"]
mod common;

#[global_allocator]
static ALLOC: common::BoundedAlloc = common::BoundedAlloc;

static STORIES: &[u8] = include_bytes!("../../models/stories260K.gguf");

fn compiler() -> &'static (Tokenizer, GrammarCompiler) {
    static C: OnceLock<(Tokenizer, GrammarCompiler)> = OnceLock::new();
    C.get_or_init(|| {
        let g = GgufFile::parse(STORIES).expect("stories260K.gguf parses");
        let tok = Tokenizer::from_gguf(&g).expect("stories260K.gguf has a tokenizer");
        let c = GrammarCompiler::new(&tok).expect("the vocabulary indexes");
        (tok, c)
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let spec = match text.strip_prefix('%') {
        Some(lark) => GrammarSpec::Lark(lark.to_string()),
        None => match serde_json::from_str(text) {
            Ok(schema) => GrammarSpec::JsonSchema(schema),
            Err(_) => return,
        },
    };
    let (tok, c) = compiler();
    let Ok(mut g) = c.compile(&spec) else {
        return;
    };
    // A few greedy steps over made-up logits: masks and accepts on the compiled grammar.
    for step in 0..8u32 {
        let mut logits: Vec<f32> = (0..tok.vocab_size() as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ step) as f32)
            .collect();
        if g.mask(&mut logits).is_err() {
            return;
        }
        let best = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap_or(0);
        if logits[best as usize] == f32::NEG_INFINITY || g.accept(best).is_err() || g.is_finished()
        {
            return;
        }
    }
});
