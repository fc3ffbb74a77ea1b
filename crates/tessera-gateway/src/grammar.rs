//! Constrained decoding: a grammar (a JSON schema, or a lark grammar for tool calls) turned
//! into a mask over the model's vocabulary at every step, by [`llguidance`] (the engine
//! llama.cpp uses), so `response_format` and forced tool calls hold for any model, even one
//! with random weights.
//!
//! The vocabulary is indexed once per served model ([`GrammarCompiler::new`]: every token's
//! bytes in a [`toktrie::TokTrie`]; control tokens behind llguidance's special-token marker so
//! grammar text never matches them). Each request gets its own [`Grammar`]: the sampler masks
//! the logits with [`Grammar::mask`] before the draw and feeds the drawn token back with
//! [`Grammar::accept`]. A grammar depends only on the request's own tokens, so a constrained
//! request's output is the same alone or in a batch.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use tessera_model::{TokenType, Tokenizer};
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// What a grammar is written in.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// A JSON schema; the output is one JSON value matching it.
    JsonSchema(Value),
    /// llguidance's lark dialect (`%json { … }` embeds a schema).
    Lark(String),
}

/// Why a grammar could not be built or followed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The vocabulary could not be indexed.
    #[error("the tokenizer cannot be used for grammars: {0}")]
    Vocabulary(String),
    /// The schema or grammar is not valid (or not supported by llguidance).
    #[error("invalid grammar: {0}")]
    Invalid(String),
    /// The grammar rejected the state it reached (no token can continue it).
    #[error("the grammar cannot continue: {0}")]
    Dead(String),
}

/// `schema` with llguidance's layout options set, unless it sets them itself: no free
/// whitespace (a model, above all a random one, could otherwise emit whitespace until
/// `max_tokens`), `", "` and `": "` between items and keys as Python's `json.dumps` writes.
pub fn compact(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Value::Object(o) = &mut s {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    s
}

/// Compiles grammars over one vocabulary.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl GrammarCompiler {
    /// Indexes `tok`'s vocabulary. End-of-generation tokens are the grammar's "end": allowed
    /// exactly when the grammar accepts.
    pub fn new(tok: &Tokenizer) -> Result<Self, GrammarError> {
        let n = tok.vocab_size();
        let mut words = Vec::with_capacity(n);
        let mut eog = Vec::new();
        for id in 0..n as u32 {
            if tok.is_end_of_generation(id) {
                eog.push(id);
            }
            let special = matches!(
                tok.token_type(id),
                Some(TokenType::Control | TokenType::Unknown | TokenType::Unused)
            );
            let word = if special {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(tok.token_str(id).unwrap_or_default().as_bytes());
                w
            } else {
                tok.piece_bytes(id).to_vec()
            };
            words.push(word);
        }
        let eos = tok
            .eos_id()
            .or_else(|| eog.first().copied())
            .ok_or_else(|| GrammarError::Vocabulary("no end-of-generation token".into()))?;
        if eog.is_empty() {
            eog.push(eos);
        }
        let info = TokRxInfo::new(n as u32, eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
        let env: Arc<dyn TokenizerEnv + Sync> = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory,
            vocab_size: n,
        })
    }

    /// A fresh matcher for `spec`.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar, GrammarError> {
        let top = match spec {
            GrammarSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)),
            GrammarSpec::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(Grammar {
            matcher,
            vocab_size: self.vocab_size,
        })
    }
}

impl crate::backend::ServedModel {
    /// The grammar compiler for this model's vocabulary (indexed on first use, then shared).
    pub fn grammar_compiler(&self) -> Result<Arc<GrammarCompiler>, GrammarError> {
        self.grammars
            .get_or_init(|| {
                GrammarCompiler::new(&self.tokenizer)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(GrammarError::Vocabulary)
    }
}

/// One request's grammar state.
pub struct Grammar {
    matcher: Matcher,
    vocab_size: usize,
}

impl Clone for Grammar {
    /// An independent matcher in the same state (each of `n` choices gets one).
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            vocab_size: self.vocab_size,
        }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Grammar {
    /// Sets the logits of every token the grammar forbids now to `-inf`.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self
            .matcher
            .compute_mask()
            .map_err(|e| GrammarError::Dead(e.to_string()))?;
        // Word by word: most of a vocabulary is forbidden at most steps, and a zero word
        // forbids 32 tokens with one fill.
        let words = allowed.as_slice();
        let n = logits.len().min(self.vocab_size);
        for (w, chunk) in logits[..n].chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == 0 {
                chunk.fill(f32::NEG_INFINITY);
            } else if bits != u32::MAX {
                for (b, l) in chunk.iter_mut().enumerate() {
                    if bits & (1 << b) == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
        logits[n..].fill(f32::NEG_INFINITY);
        Ok(())
    }

    /// Advances over a drawn token (one [`Grammar::mask`] allowed).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Dead(e.to_string()))
    }

    /// The grammar is complete and allows no further token: generation should end.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_model::GgufFile;

    fn tokenizer() -> Tokenizer {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/stories260K.gguf");
        Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap()
    }

    /// Greedy decoding over made-up logits that prefer the highest id: whatever the "model"
    /// wants, the output follows the schema.
    #[test]
    fn masked_greedy_decoding_yields_schema_valid_json() {
        let tok = tokenizer();
        let c = GrammarCompiler::new(&tok).unwrap();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 120}},
            "required": ["name", "age"],
            "additionalProperties": false
        });
        let mut g = c.compile(&GrammarSpec::JsonSchema(schema)).unwrap();
        let mut out = Vec::new();
        for step in 0..200u32 {
            let mut logits: Vec<f32> = (0..tok.vocab_size())
                .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ step) % 1000) as f32)
                .collect();
            g.mask(&mut logits).unwrap();
            let t = tessera_engine::ops::argmax(&logits) as u32;
            if tok.is_end_of_generation(t) {
                break;
            }
            g.accept(t).unwrap();
            out.push(t);
            if g.is_finished() {
                break;
            }
        }
        let text = tok.decode(&out);
        let v: Value =
            serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["name"].is_string() && v["age"].is_i64(), "{v}");
    }

    /// Greedy decoding over made-up logits under `g`; the text produced.
    fn decode(tok: &Tokenizer, g: &mut Grammar, salt: u32) -> String {
        let mut out = Vec::new();
        for step in 0..300u32 {
            let mut logits: Vec<f32> = (0..tok.vocab_size())
                .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ step ^ salt) % 1000) as f32)
                .collect();
            g.mask(&mut logits).unwrap();
            let t = tessera_engine::ops::argmax(&logits) as u32;
            if tok.is_end_of_generation(t) {
                break;
            }
            g.accept(t).unwrap();
            out.push(t);
            if g.is_finished() {
                break;
            }
        }
        tok.decode(&out)
    }

    #[test]
    fn a_forced_tool_call_parses_back_into_a_valid_call() {
        use crate::openai::tools::{
            parse_tools, tool_grammar, ToolCallParser, ToolChoice, ToolEvent, ToolFormat,
        };
        let tok = tokenizer();
        let c = GrammarCompiler::new(&tok).unwrap();
        let tools = parse_tools(&serde_json::json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"], "additionalProperties": false}}},
            {"type": "function", "function": {"name": "noop"}}
        ]))
        .unwrap();
        for (choice, parallel) in [
            (ToolChoice::Required, true),
            (ToolChoice::Named("get_weather".into()), false),
        ] {
            let spec = tool_grammar(&tools, &choice, parallel, ToolFormat::Hermes).unwrap();
            let mut g = c.compile(&spec).unwrap();
            let text = decode(&tok, &mut g, 7);
            let mut p = ToolCallParser::new(ToolFormat::Hermes, &tools);
            let mut events = p.push(&text);
            events.extend(p.finish());
            assert!(!events.is_empty(), "{text:?}");
            for e in &events {
                let ToolEvent::Call(call) = e else {
                    panic!("not a call: {e:?} in {text:?}");
                };
                let args: Value = serde_json::from_str(&call.arguments).unwrap();
                if call.name == "get_weather" {
                    assert!(args["city"] == "Paris" || args["city"] == "Rome", "{args}");
                    assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
                }
            }
        }
    }

    #[test]
    fn invalid_schemas_are_refused() {
        let c = GrammarCompiler::new(&tokenizer()).unwrap();
        let e = c
            .compile(&GrammarSpec::JsonSchema(serde_json::json!({"type": 7})))
            .unwrap_err();
        assert!(matches!(e, GrammarError::Invalid(_)), "{e}");
    }
}
