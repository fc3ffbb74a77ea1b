//! Tokenizer on arbitrary text and arbitrary ids: encode, decode and streaming decode must not
//! panic, and streaming decode must equal one-shot decode (its documented contract).
//!
//! Two vocabularies: the SentencePiece one of `models/stories260K.gguf` (read through
//! `GgufFile::parse` from the bytes compiled in), and a small byte-level BPE built here so that
//! the pre-tokenizer regexes and merge loop are exercised too.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tessera_model::tokenizer::bpe::encode_bytes_into;
use tessera_model::{
    GgufFile, PreTokenizer, StreamDecoder, TokenType, Tokenizer, TokenizerKind, TokenizerParts,
};

#[path = "common.rs"]
mod common;

#[global_allocator]
static ALLOC: common::BoundedAlloc = common::BoundedAlloc;

static STORIES: &[u8] = include_bytes!("../../models/stories260K.gguf");

fn spm() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let g = GgufFile::parse(STORIES).expect("stories260K.gguf parses");
        Tokenizer::from_gguf(&g).expect("stories260K.gguf has a tokenizer")
    })
}

/// A byte-level BPE vocabulary: the 256 byte tokens, a handful of merges, and special tokens.
fn bpe(pre: PreTokenizer) -> Tokenizer {
    let mut tokens: Vec<String> = (0..=255u8)
        .map(|b| {
            let mut s = String::new();
            encode_bytes_into(&[b], &mut s);
            s
        })
        .collect();
    let mut merges = Vec::new();
    for word in [
        "the",
        " the",
        "ing",
        " a",
        "in",
        "er",
        "12",
        "\u{e9}t\u{e9}",
    ] {
        let mut enc = String::new();
        encode_bytes_into(word.as_bytes(), &mut enc);
        let chars: Vec<char> = enc.chars().collect();
        let mut left: String = chars[0].to_string();
        for c in &chars[1..] {
            merges.push(format!("{left} {c}"));
            left.push(*c);
            if !tokens.contains(&left) {
                tokens.push(left.clone());
            }
        }
    }
    let bos = tokens.len() as u32;
    tokens.push("<|endoftext|>".into());
    tokens.push("<|im_start|>".into());
    let mut types = vec![TokenType::Normal; tokens.len()];
    types[bos as usize] = TokenType::Control;
    types[bos as usize + 1] = TokenType::Control;
    let mut p = TokenizerParts::new(TokenizerKind::Bpe, tokens);
    p.merges = merges;
    p.token_types = Some(types);
    p.pre = pre;
    p.bos_id = Some(bos);
    p.eos_id = Some(bos);
    Tokenizer::from_parts(p).expect("the fuzz BPE vocabulary is valid")
}

fn bpes() -> &'static [Tokenizer; 4] {
    static T: OnceLock<[Tokenizer; 4]> = OnceLock::new();
    T.get_or_init(|| {
        [
            bpe(PreTokenizer::Gpt2),
            bpe(PreTokenizer::Llama3),
            bpe(PreTokenizer::Qwen2),
            bpe(PreTokenizer::Default),
        ]
    })
}

fn check(tok: &Tokenizer, text: &str, raw: &[u8], add_special: bool) {
    let ids = tok.encode(text, add_special);
    let ids2 = tok.encode_with_specials(text, add_special);
    for &id in ids.iter().chain(&ids2) {
        assert!(
            (id as usize) < tok.vocab_size(),
            "encode produced id {id} outside the vocabulary"
        );
    }
    let _ = tok.decode(&ids2);
    let decoded = tok.decode(&ids);

    // Arbitrary ids (in and out of the vocabulary) decode, and streaming agrees with one-shot.
    let mut any_ids: Vec<u32> = raw
        .chunks_exact(2)
        .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    any_ids.extend_from_slice(&ids);
    for ids in [&ids, &any_ids] {
        let mut stream = StreamDecoder::new(tok);
        let mut out = String::new();
        for &id in ids.iter() {
            out.push_str(&stream.push(id));
            let _ = (
                tok.token_str(id),
                tok.token_type(id),
                tok.is_end_of_generation(id),
            );
        }
        out.push_str(&stream.finish());
        assert_eq!(out, tok.decode(ids), "StreamDecoder disagrees with decode");
    }
    let _ = decoded;
}

fuzz_target!(|data: &[u8]| {
    let [sel, raw @ ..] = data else {
        return;
    };
    let text = String::from_utf8_lossy(raw);
    let add_special = sel & 1 == 1;
    let tok = match (sel >> 1) % 5 {
        0 => spm(),
        n => &bpes()[usize::from(n) - 1],
    };
    check(tok, &text, raw, add_special);
});
