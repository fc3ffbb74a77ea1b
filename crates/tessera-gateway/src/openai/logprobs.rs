//! Log-probabilities in OpenAI's two shapes: chat's `logprobs.content` (one entry per token
//! with its text, UTF-8 bytes and alternatives) and the legacy completions object (parallel
//! `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists).
//!
//! The numbers are the log-softmax of the logits the sampler drew from, after penalties, logit
//! bias and any grammar mask, at temperature 1 and before top-k/top-p/min-p (see
//! [`tessera_sampling::token_logprobs`]).

use serde_json::{json, Map, Value};
use tessera_model::Tokenizer;
use tessera_sampling::TokenLogprobs;

/// A token's text as OpenAI shows it (invalid UTF-8 replaced; `bytes` keeps the truth).
fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tok.piece_bytes(id).to_vec();
    let text = if bytes.is_empty() {
        tok.token_str(id).unwrap_or_default().to_string()
    } else {
        String::from_utf8_lossy(&bytes).into_owned()
    };
    (text, bytes)
}

/// Finite for JSON (a masked alternative never appears; a chosen token is never masked).
fn finite(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

/// Chat's `logprobs` object for `tokens`.
pub fn chat(tok: &Tokenizer, tokens: &[TokenLogprobs]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let (text, bytes) = token_text(tok, t.token);
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|&(id, lp)| {
                    let (text, bytes) = token_text(tok, id);
                    json!({"token": text, "logprob": finite(lp), "bytes": bytes})
                })
                .collect();
            json!({"token": text, "logprob": finite(t.logprob), "bytes": bytes, "top_logprobs": top})
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The legacy completions `logprobs` object; `offset` is the text length before the first
/// token (so `text_offset` counts from the start of the choice's text).
pub fn completion(tok: &Tokenizer, tokens: &[TokenLogprobs], offset: usize) -> Value {
    let mut texts = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    let mut at = offset;
    for t in tokens {
        let (text, _) = token_text(tok, t.token);
        offsets.push(at);
        at += text.len();
        texts.push(text);
        lps.push(finite(t.logprob));
        let mut m = Map::new();
        for &(id, lp) in &t.top {
            m.insert(token_text(tok, id).0, finite(lp).into());
        }
        tops.push(Value::Object(m));
    }
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}
