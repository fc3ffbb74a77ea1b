//! The sampling (last) stage's part: the grammars compiled over the model's vocabulary, and what
//! a drawn token leads to (the next ring turn, or the sequence's end).

use std::sync::{Arc, OnceLock};

use tessera_grammar::{Grammar, GrammarCompiler};
use tessera_model::Tokenizer;
use tessera_sampling::TokenLogprobs;

use super::seq::{SeqState, StageError, StageOutput};
use tessera_proto::{FinishReason, NodeToCoord, OpenSeq, RingToken};

/// The sampling stage's vocabulary for grammars, indexed once and shared by all sequences.
pub(super) struct Grammars {
    pub(super) tokenizer: Arc<Tokenizer>,
    pub(super) compiler: Arc<OnceLock<Result<Arc<GrammarCompiler>, String>>>,
}

impl Grammars {
    /// The compiler, indexing the vocabulary here unless another thread is at it (then this
    /// waits for it).
    pub(super) fn compiler(&self) -> Result<Arc<GrammarCompiler>, String> {
        self.compiler
            .get_or_init(|| {
                GrammarCompiler::new(&self.tokenizer)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
    }
}

/// Last stage (`is_last`): `open`'s grammar compiled and advanced over the tokens an earlier attempt
/// generated ([`OpenSeq::replayed`]); checks the log-probability count.
pub(super) fn grammar_for(
    grammars: Option<&Grammars>,
    is_last: bool,
    open: &OpenSeq,
) -> Result<Option<Grammar>, StageError> {
    let seq = open.seq;
    if let Some(n) = open.logprobs.filter(|&n| n > OpenSeq::MAX_TOP_LOGPROBS) {
        return Err(StageError::BadStep {
            seq,
            what: format!(
                "{n} alternatives asked (at most {})",
                OpenSeq::MAX_TOP_LOGPROBS
            ),
        });
    }
    if open.replayed > open.prompt.len() {
        return Err(StageError::BadStep {
            seq,
            what: format!(
                "{} replayed tokens in a prompt of {}",
                open.replayed,
                open.prompt.len()
            ),
        });
    }
    let Some(spec) = open.grammar.as_ref().filter(|_| is_last) else {
        return Ok(None);
    };
    let refuse = |reason: String| StageError::Grammar { seq, reason };
    let g =
        grammars.ok_or_else(|| refuse("this stage has no tokenizer to compile it over".into()))?;
    let compiler = g.compiler().map_err(refuse)?;
    let mut grammar = compiler.compile(spec).map_err(|e| refuse(e.to_string()))?;
    for &t in &open.prompt[open.prompt.len() - open.replayed..] {
        grammar.accept(t).map_err(|e| refuse(e.to_string()))?;
    }
    Ok(Some(grammar))
}

/// Last stage: draws the next token from `row` (under the grammar, with log-probabilities
/// when asked) and says what it leads to. A grammar with no way on fails the sequence.
pub(super) fn sample_next(s: &mut SeqState, row: &[f32]) -> Vec<StageOutput> {
    let pos = s.history.len() as u64;
    let eog = &s.open.eog;
    let chosen = tessera_grammar::choose(
        row,
        &s.open.sampling,
        &s.history,
        pos,
        s.grammar.as_mut(),
        s.open.logprobs,
    )
    .and_then(|(token, logprobs)| {
        if let Some(g) = s.grammar.as_mut().filter(|_| !eog.contains(&token)) {
            g.accept(token)?;
        }
        Ok((token, logprobs))
    });
    match chosen {
        Ok((token, logprobs)) => after_sample(s, token, logprobs),
        Err(e) => {
            s.finished = true;
            vec![StageOutput::Control(NodeToCoord::Finished {
                seq: s.open.seq,
                reason: FinishReason::Error,
                generated: s.generated,
                error: Some(e.to_string()),
            })]
        }
    }
}

/// Last stage: what a sampled token leads to.
pub(super) fn after_sample(
    s: &mut SeqState,
    token: u32,
    logprobs: Option<TokenLogprobs>,
) -> Vec<StageOutput> {
    let seq = s.open.seq;
    let mut out = Vec::new();
    if s.open.eog.contains(&token) {
        s.finished = true;
        out.push(StageOutput::Control(NodeToCoord::Finished {
            seq,
            reason: FinishReason::EndOfGeneration,
            generated: s.generated,
            error: None,
        }));
        return out;
    }
    let pos = s.history.len();
    s.history.push(token);
    s.generated += 1;
    out.push(StageOutput::Control(NodeToCoord::Token {
        seq,
        pos,
        token,
        logprobs,
    }));
    // The token's own position must fit in the cache for the next step.
    let reason = if s.generated >= s.open.max_new_tokens || pos >= s.kv.capacity() {
        Some(FinishReason::Length)
    } else {
        // A complete grammar admits nothing more: the answer is done, as in one process.
        s.grammar
            .as_ref()
            .is_some_and(Grammar::is_finished)
            .then_some(FinishReason::EndOfGeneration)
    };
    if let Some(reason) = reason {
        s.finished = true;
        out.push(StageOutput::Control(NodeToCoord::Finished {
            seq,
            reason,
            generated: s.generated,
            error: None,
        }));
        return out;
    }
    s.stats.decode.bytes_sent += (tessera_net::frame::HEADER_LEN + RingToken::LEN) as u64;
    s.stats.decode.frames_sent += 1;
    out.push(StageOutput::Token(RingToken {
        seq,
        pos: pos as u32,
        token,
    }));
    out
}
