//! The sampling (last) stage's part: the grammars compiled over the model's vocabulary, and what
//! a drawn token leads to (the next ring turn, or the sequence's end).

use std::sync::{Arc, OnceLock};

use tessera_engine::Logits;
use tessera_grammar::{Grammar, GrammarCompiler};
use tessera_model::Tokenizer;
use tessera_sampling::prediction::Predicted;
use tessera_sampling::speculate::{settle, DraftSource, PromptLookup};
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

/// Last stage: draws from the rows of a step and says what they lead to. Row 0 follows the
/// last accepted token; with drafts (the sequence speculates), row `i` follows draft `i` and
/// the draft stands only where the draw equals it ([`tessera_sampling::speculate::settle`]):
/// each draw is the one a one-token step would make (same logits, history and `(seed,
/// position)`), so the tokens and log-probabilities are those without speculation. A grammar
/// with no way on fails the sequence.
pub(super) fn verify(s: &mut SeqState, logits: &Logits) -> Vec<StageOutput> {
    let drafts = std::mem::take(&mut s.drafts);
    let mut out = Vec::new();
    if logits.n_tokens != drafts.len() + 1 {
        s.finished = true;
        out.push(failed(
            s,
            format!(
                "{} rows to check {} drafts against",
                logits.n_tokens,
                drafts.len()
            ),
        ));
        return out;
    }
    let settled = settle(&drafts, |i| draw(s, logits.row(i), &mut out));
    let settled = match settled {
        Ok(settled) => settled,
        Err(e) => {
            s.finished = true;
            out.push(failed(s, e.to_string()));
            return out;
        }
    };
    s.stats.verifications += u64::from(!drafts.is_empty());
    s.stats.drafted += drafts.len() as u64;
    s.stats.drafts_accepted += settled.accepted as u64;
    if s.finished {
        return out;
    }
    // The ring turns again: the last token drawn, with the next guesses.
    let pos = s.history.len() - 1;
    let token = s.history[pos];
    s.drafts = next_drafts(s);
    s.stats.decode.bytes_sent += (tessera_net::frame::HEADER_LEN + RingToken::LEN) as u64;
    s.stats.decode.bytes_sent += 4 * s.drafts.len() as u64;
    s.stats.decode.frames_sent += 1;
    out.push(StageOutput::Token(RingToken {
        seq: s.open.seq,
        pos: pos as u32,
        token,
        drafts: s.drafts.clone(),
    }));
    out
}

/// Guesses for the positions after the last token, from the client's prediction where it
/// sent one and by prompt lookup otherwise: no more than the sequence speculates, than tokens
/// it may still generate after the next, or than its cache has positions for.
fn next_drafts(s: &SeqState) -> Vec<u32> {
    if s.open.speculate == 0 {
        return Vec::new();
    }
    let pos = s.history.len() - 1;
    let room = s.kv.capacity().saturating_sub(pos + 1);
    let left = s.open.max_new_tokens.saturating_sub(s.generated + 1);
    let k = s.open.speculate.min(room).min(left);
    if s.open.prediction.is_empty() {
        return PromptLookup::default().propose(&s.history, k);
    }
    // A resumed attempt's prompt ends with the tokens generated before: the answer starts
    // before them.
    let answer_from = s.open.prompt.len() - s.open.replayed;
    Predicted::new(&s.open.prediction[..], answer_from).propose(&s.history, k)
}

/// One draw from `row` at the sequence's next position, recorded: the token's report, and the
/// sequence's end when it ends there (then `None`).
fn draw(
    s: &mut SeqState,
    row: &[f32],
    out: &mut Vec<StageOutput>,
) -> Result<Option<u32>, tessera_grammar::GrammarError> {
    let pos = s.history.len() as u64;
    let eog = &s.open.eog;
    let (token, logprobs) = tessera_grammar::choose(
        row,
        &s.open.sampling,
        &s.history,
        pos,
        s.grammar.as_mut(),
        s.open.logprobs,
    )?;
    if let Some(g) = s.grammar.as_mut().filter(|_| !eog.contains(&token)) {
        g.accept(token)?;
    }
    out.extend(record(s, token, logprobs));
    Ok((!s.finished).then_some(token))
}

fn failed(s: &SeqState, error: String) -> StageOutput {
    StageOutput::Control(NodeToCoord::Finished {
        seq: s.open.seq,
        reason: FinishReason::Error,
        generated: s.generated,
        error: Some(error),
    })
}

/// Last stage: a drawn token into the sequence's history and its report to the coordinator,
/// and the sequence's end when the token ends it.
fn record(s: &mut SeqState, token: u32, logprobs: Option<TokenLogprobs>) -> Vec<StageOutput> {
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
    }
    out
}
