//! Constrained decoding: a grammar (a JSON schema, or a lark grammar for tool calls) turned
//! into a mask over the model's vocabulary at every step, by [`llguidance`] (the engine
//! llama.cpp uses), so `response_format` and forced tool calls hold for any model, even one
//! with random weights.
//!
//! Its own crate because two places sample: the gateway's in-process scheduler and the last
//! stage of a cluster ring (tessera-node). Both call [`choose`], so a request draws the same
//! tokens whichever backend serves it; a cluster carries the [`GrammarSpec`] (serde) to its
//! sampling stage, which compiles it there.
//!
//! The vocabulary is indexed once per served model ([`GrammarCompiler::new`]: every token's
//! bytes in a [`toktrie::TokTrie`]; control tokens behind llguidance's special-token marker so
//! grammar text never matches them). Each request gets its own [`Grammar`]: the sampler masks
//! the logits with [`Grammar::mask`] before the draw and feeds the drawn token back with
//! [`Grammar::accept`]. A grammar depends only on the request's own tokens, so a constrained
//! request's output is the same alone or in a batch.

#![forbid(unsafe_code)]

mod bounds;

use std::sync::Arc;
use std::time::Duration;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use tessera_model::{TokenType, Tokenizer};
use tessera_sampling::{
    process_logits, sample, sample_processed, token_logprobs, SamplingParams, TokenLogprobs,
};
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie, TokenizerEnv};

pub use bounds::{check, json_size, GrammarLimits};
pub use tessera_sampling::GrammarSpec;

mod integers;
pub use integers::{bound_integers, MAX_UNBOUNDED_INTEGER};

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
    /// The grammar is larger than a limit allows ([`GrammarLimits`]); `limit` names it.
    #[error("the grammar exceeds the limit '{limit}' (at most {max}, found {found} or more)")]
    Limit {
        limit: &'static str,
        max: usize,
        found: usize,
    },
    /// Compiling took longer than [`COMPILE_BUDGET`].
    #[error("the grammar took longer than {} s to compile", COMPILE_BUDGET.as_secs())]
    TooSlow,
}

/// The longest a grammar may take to compile. llguidance bounds its own work with fuel; this
/// is the wall-clock backstop, so a request that slips past both fails instead of holding a
/// sampling thread.
pub const COMPILE_BUDGET: Duration = Duration::from_secs(10);

/// The stack a compile runs on. llguidance recurses over a schema; the bounds keep its depth
/// far below what this holds (it is reserved address space, touched only as deep as used).
const COMPILE_STACK: usize = 256 * 1024 * 1024;

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
    /// Shared with the compile threads, which may outlive a call that gave up waiting.
    factory: Arc<ParserFactory>,
    limits: GrammarLimits,
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
        let limits = GrammarLimits::DEFAULT;
        factory.limits_mut().max_grammar_size = limits.max_grammar_symbols;
        Ok(Self {
            factory: Arc::new(factory),
            limits,
            vocab_size: n,
        })
    }

    /// The limits this compiler holds every grammar to.
    pub fn limits(&self) -> &GrammarLimits {
        &self.limits
    }

    /// A fresh matcher for `spec`, once it is within [`GrammarLimits`]: compiled on a thread
    /// of its own with a large stack, waited for at most [`COMPILE_BUDGET`]. Whatever the spec,
    /// this returns; it cannot take the process down.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar, GrammarError> {
        check(spec, &self.limits)?;
        let top = match spec {
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact(&bound_integers(schema)))
            }
            GrammarSpec::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
        };
        let factory = self.factory.clone();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("grammar-compile".into())
            .stack_size(COMPILE_STACK)
            .spawn(move || {
                let made = factory
                    .create_parser(top)
                    .map_err(|e| GrammarError::Invalid(e.to_string()))
                    .and_then(|parser| {
                        let matcher = Matcher::new(Ok(parser));
                        match matcher.get_error() {
                            Some(e) => Err(GrammarError::Invalid(e)),
                            None => Ok(matcher),
                        }
                    });
                // The caller may have stopped waiting: nothing to tell it then.
                let _ = tx.send(made);
            })
            .map_err(|e| GrammarError::Invalid(format!("no thread to compile on: {e}")))?;
        let matcher = match rx.recv_timeout(COMPILE_BUDGET) {
            Ok(made) => made?,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => return Err(GrammarError::TooSlow),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(GrammarError::Invalid("the grammar compiler failed".into()))
            }
        };
        Ok(Grammar {
            matcher,
            vocab_size: self.vocab_size,
            spec: Arc::new(spec.clone()),
        })
    }
}

/// One request's grammar state.
pub struct Grammar {
    matcher: Matcher,
    vocab_size: usize,
    /// What it was compiled from (a cluster sends this, not the matcher).
    spec: Arc<GrammarSpec>,
}

impl Clone for Grammar {
    /// An independent matcher in the same state (each of `n` choices gets one).
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            vocab_size: self.vocab_size,
            spec: self.spec.clone(),
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
    /// How many of `tokens`, in order from the current state, the grammar allows; the state
    /// does not move (drafts are cut here before they are verified; the state then advances
    /// only over the tokens drawn).
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        if tokens.is_empty() || self.matcher.is_stopped() {
            return 0;
        }
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

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

    /// The spec this grammar was compiled from.
    pub fn spec(&self) -> &GrammarSpec {
        &self.spec
    }
}

/// One sampling step, the same for every backend: the token at `position` drawn from `row`
/// after penalties over `history`, masked by `grammar` if there is one, with its
/// log-probabilities and the `logprobs` best alternatives when asked. The grammar is not
/// advanced here: the caller [`Grammar::accept`]s the token unless it ends the generation.
///
/// Without a grammar or log-probabilities this is [`sample`] exactly (no copy of the row).
pub fn choose(
    row: &[f32],
    params: &SamplingParams,
    history: &[u32],
    position: u64,
    grammar: Option<&mut Grammar>,
    logprobs: Option<usize>,
) -> Result<(u32, Option<TokenLogprobs>), GrammarError> {
    if grammar.is_none() && logprobs.is_none() {
        return Ok((sample(row, params, history, position), None));
    }
    let mut logits = row.to_vec();
    process_logits(&mut logits, params, history);
    if let Some(g) = grammar {
        g.mask(&mut logits)?;
    }
    let token = sample_processed(&logits, params, position);
    Ok((token, logprobs.map(|n| token_logprobs(&logits, token, n))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_model::GgufFile;

    fn tokenizer() -> Tokenizer {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/stories260K.gguf");
        Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap()
    }

    /// Drafts are checked against the grammar without moving it: the valid prefix is counted,
    /// and the state afterwards accepts exactly what it accepted before.
    #[test]
    fn valid_prefix_counts_allowed_drafts_and_leaves_the_state() {
        let tok = tokenizer();
        let c = GrammarCompiler::new(&tok).unwrap();
        let schema = serde_json::json!({"enum": ["cat", "dog", "bird"]});
        let mut g = c.compile(&GrammarSpec::JsonSchema(schema)).unwrap();
        // Tokens the grammar allows, drawn on a copy; and one it forbids after the first.
        let mut probe = g.clone();
        let mut allowed = Vec::new();
        let mut forbidden = None;
        while !probe.is_finished() && allowed.len() < 20 {
            let mut logits: Vec<f32> = (0..tok.vocab_size()).map(|i| i as f32).collect();
            probe.mask(&mut logits).unwrap();
            if allowed.len() == 1 {
                forbidden = logits.iter().position(|l| *l == f32::NEG_INFINITY);
            }
            let t = tessera_sampling::argmax(&logits) as u32;
            if tok.is_end_of_generation(t) {
                break;
            }
            probe.accept(t).unwrap();
            allowed.push(t);
        }
        assert!(allowed.len() >= 2, "{allowed:?}");
        assert_eq!(g.valid_prefix(&allowed), allowed.len());
        let bad = forbidden.expect("something is forbidden") as u32;
        assert_eq!(g.valid_prefix(&[allowed[0], bad]), 1);
        // Unmoved: the same tokens are accepted from the start.
        for &t in &allowed {
            g.accept(t).unwrap();
        }
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
            let t = tessera_sampling::argmax(&logits) as u32;
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

    /// A "model" that only ever wants another digit still ends an unbounded integer after
    /// 16 digits, as llama.cpp's grammars do.
    #[test]
    fn an_unbounded_integer_ends_after_sixteen_digits() {
        let tok = tokenizer();
        let c = GrammarCompiler::new(&tok).unwrap();
        let nine = (0..tok.vocab_size() as u32)
            .find(|&t| tok.decode(&[t]) == "9")
            .expect("a token for the digit 9");
        let schema = serde_json::json!({"type": "integer"});
        let mut g = c.compile(&GrammarSpec::JsonSchema(schema)).unwrap();
        let mut out = Vec::new();
        for _ in 0..64 {
            // The 16th digit completes the grammar: nothing may follow.
            if g.is_finished() {
                break;
            }
            let mut logits = vec![0.0f32; tok.vocab_size()];
            logits[nine as usize] = 10.0;
            g.mask(&mut logits).unwrap();
            let t = tessera_sampling::argmax(&logits) as u32;
            if tok.is_end_of_generation(t) {
                break;
            }
            g.accept(t).unwrap();
            out.push(t);
        }
        let text = tok.decode(&out);
        assert_eq!(text.trim(), "9".repeat(16), "{text:?}");
    }

    /// A spec survives the wire (JSON) unchanged, and a compiled grammar remembers it.
    #[test]
    fn specs_round_trip_and_grammars_keep_theirs() {
        let spec = GrammarSpec::JsonSchema(serde_json::json!({"type": "object"}));
        let back: GrammarSpec =
            serde_json::from_str(&serde_json::to_string(&spec).unwrap()).unwrap();
        assert_eq!(back, spec);
        let lark = GrammarSpec::Lark("start: \"a\"".into());
        let back: GrammarSpec =
            serde_json::from_str(&serde_json::to_string(&lark).unwrap()).unwrap();
        assert_eq!(back, lark);
        let c = GrammarCompiler::new(&tokenizer()).unwrap();
        assert_eq!(c.compile(&spec).unwrap().clone().spec(), &spec);
    }

    /// `choose` without a grammar or log-probabilities is the plain sampler; with them it draws
    /// an allowed token and reports it.
    #[test]
    fn choose_is_the_plain_sampler_unless_asked_for_more() {
        let tok = tokenizer();
        let row: Vec<f32> = (0..tok.vocab_size())
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) % 1000) as f32 / 100.0)
            .collect();
        let params = SamplingParams {
            temperature: 0.8,
            seed: 11,
            ..SamplingParams::greedy()
        };
        let history = [1u32, 5, 9];
        for pos in 3..20u64 {
            let plain = sample(&row, &params, &history, pos);
            assert_eq!(
                choose(&row, &params, &history, pos, None, None).unwrap(),
                (plain, None)
            );
            let (t, lp) = choose(&row, &params, &history, pos, None, Some(2)).unwrap();
            assert_eq!(t, plain);
            let lp = lp.unwrap();
            assert_eq!((lp.token, lp.top.len()), (t, 2));
        }
        let c = GrammarCompiler::new(&tok).unwrap();
        let mut g = c
            .compile(&GrammarSpec::JsonSchema(
                serde_json::json!({"type": "object"}),
            ))
            .unwrap();
        let (t, _) = choose(&row, &params, &history, 3, Some(&mut g), None).unwrap();
        assert!(tok.decode(&[t]).trim_start().starts_with('{'), "{t}");
    }

    /// The schema that aborted `serve` (a chain of 300 `$ref`s in 20 KB) and one just within
    /// the depth limit: the first is refused naming the limit, the second compiles and the
    /// process is still here for both.
    #[test]
    fn a_chain_of_references_is_refused_not_a_crash() {
        let c = GrammarCompiler::new(&tokenizer()).unwrap();
        let e = c
            .compile(&GrammarSpec::JsonSchema(bounds::tests::ref_chain(300)))
            .unwrap_err();
        assert!(
            matches!(
                e,
                GrammarError::Limit {
                    limit: "schema_depth",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("schema_depth"), "{e}");
        // d0 → … → d19: each link is a property of an object (three levels), within 64.
        c.compile(&GrammarSpec::JsonSchema(bounds::tests::ref_chain(19)))
            .unwrap();
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
