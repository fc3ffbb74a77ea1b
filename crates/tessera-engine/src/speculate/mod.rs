//! Speculative decoding in the engine: verifying drafts in one forward pass, and a draft model.
//!
//! [`Model::verify`] runs the last accepted token and `k` drafts as one chunk and returns all
//! `k + 1` rows of logits; the kernels are batch-invariant, so row `i` is bit-identical to the
//! one-token step it stands for. The caller decides which drafts stand (the rule is
//! [`settle`](tessera_sampling::speculate::settle)) and calls [`keep_accepted`], which drops the
//! rejected positions from the KV cache — nothing is recomputed. The same holds for a stage's
//! partial model: its `run_layers` over the `k + 1` rows writes their positions, and
//! [`keep_accepted`] on its cache drops them.
//!
//! [`ModelDraft`] drafts greedily with a smaller model of the same vocabulary
//! ([`check_same_vocabulary`]); its own cache follows the target's history by keeping the
//! longest common prefix, so rejected drafts cost it nothing to undo either.
//!
//! [`bench`] measures speculation against plain decoding in the same run.

pub mod bench;

use std::sync::Arc;

use tessera_model::Tokenizer;

use crate::error::Result;
use crate::kv::KvCache;
use crate::model::{Logits, Model};
use crate::ops::argmax;
use tessera_sampling::speculate::DraftSource;

impl Model {
    /// Appends `last` (the last accepted token, not yet in `kv`) and `drafts` to the sequence in
    /// `kv` in one pass; returns `drafts.len() + 1` rows: row 0 is the distribution after
    /// `last`, row `i` the one after `drafts[i - 1]`.
    pub fn verify(&self, last: u32, drafts: &[u32], kv: &mut KvCache) -> Result<Logits> {
        let mut tokens = Vec::with_capacity(drafts.len() + 1);
        tokens.push(last);
        tokens.extend_from_slice(drafts);
        self.forward(&tokens, kv)
    }
}

/// After a verification that started with `before` positions in `kv` and accepted `accepted`
/// drafts: keeps the last token's position and the accepted drafts', drops the rest.
pub fn keep_accepted(kv: &mut KvCache, before: usize, accepted: usize) {
    kv.truncate(before + 1 + accepted);
}

/// Why a draft model cannot draft for a target.
#[derive(Debug, thiserror::Error)]
pub enum DraftMismatch {
    #[error(
        "the draft model's vocabulary has {draft} tokens, the target's {target}: a draft model \
         must share the target's vocabulary"
    )]
    Size { draft: usize, target: usize },
    #[error(
        "the draft model's token {id} is {draft:?}, the target's is {target:?}: a draft model \
         must share the target's vocabulary"
    )]
    Token {
        id: u32,
        draft: String,
        target: String,
    },
}

/// Errors unless `draft` has exactly `target`'s tokens, in the same order.
pub fn check_same_vocabulary(
    target: &Tokenizer,
    draft: &Tokenizer,
) -> std::result::Result<(), DraftMismatch> {
    if target.vocab_size() != draft.vocab_size() {
        return Err(DraftMismatch::Size {
            draft: draft.vocab_size(),
            target: target.vocab_size(),
        });
    }
    for id in 0..target.vocab_size() as u32 {
        let (t, d) = (target.piece_bytes(id), draft.piece_bytes(id));
        if t != d || target.token_type(id) != draft.token_type(id) {
            return Err(DraftMismatch::Token {
                id,
                draft: String::from_utf8_lossy(d).into_owned(),
                target: String::from_utf8_lossy(t).into_owned(),
            });
        }
    }
    Ok(())
}

/// Most tokens the draft model catches up on before a draft, after its first (which feeds the
/// whole prompt). While drafts are asked for every step it is behind by a few tokens; after
/// speculation was off for a while (adaptive k probing a poor draft), it restarts on the last
/// this-many tokens instead, so a probe costs a bounded prefill, not one over everything
/// generated since the last.
pub const MAX_CATCH_UP: usize = 64;

/// One sequence's drafting with a draft model: greedy tokens from its own KV cache, which
/// holds a window of the history starting at `offset` (drafts need not be good to be correct:
/// every one is verified).
pub struct ModelDraft {
    model: Arc<Model>,
    kv: KvCache,
    /// The tokens whose positions are in `kv`: `history[offset..]`'s prefix, when it matches.
    fed: Vec<u32>,
    offset: usize,
}

impl std::fmt::Debug for ModelDraft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelDraft")
            .field("fed", &self.fed.len())
            .finish()
    }
}

impl ModelDraft {
    /// A drafter for one sequence of up to `capacity` positions.
    pub fn new(model: Arc<Model>, capacity: usize) -> Self {
        let capacity = capacity.min(model.config().context_length);
        Self {
            kv: model.new_kv(capacity),
            model,
            fed: Vec::new(),
            offset: 0,
        }
    }

    fn try_propose(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>> {
        if k == 0 || history.is_empty() {
            return Ok(Vec::new());
        }
        let mut window = history.get(self.offset..).unwrap_or_default();
        // Keep what still matches the history; at least one token is fed, for its logits.
        let mut common = self
            .fed
            .iter()
            .zip(window)
            .take_while(|(a, b)| a == b)
            .count()
            .min(window.len().saturating_sub(1));
        // The first feed takes the whole history (the prompt's one prefill); later ones at
        // most MAX_CATCH_UP tokens.
        let far_behind = !self.fed.is_empty() && window.len() - common > MAX_CATCH_UP;
        if window.is_empty() || far_behind || window.len() + k > self.kv.capacity() {
            // Restart on the last tokens (see MAX_CATCH_UP).
            self.offset = history.len() - MAX_CATCH_UP.min(history.len());
            window = &history[self.offset..];
            common = 0;
            if window.len() + k > self.kv.capacity() {
                return Ok(Vec::new());
            }
        }
        self.kv.truncate(common);
        self.fed.truncate(common);
        let mut logits = None;
        for chunk in window[common..].chunks(MAX_CATCH_UP) {
            logits = Some(self.model.forward_last(chunk, &mut self.kv)?);
            self.fed.extend_from_slice(chunk);
        }
        let mut logits = logits.expect("at least one token fed");
        let mut drafts = Vec::with_capacity(k);
        loop {
            let t = argmax(logits.last()) as u32;
            drafts.push(t);
            if drafts.len() == k {
                return Ok(drafts);
            }
            logits = self.model.forward_last(&[t], &mut self.kv)?;
            self.fed.push(t);
        }
    }
}

impl DraftSource for ModelDraft {
    fn propose(&mut self, history: &[u32], k: usize) -> Vec<u32> {
        // A failed draft is no draft: the target decodes on as without speculation (the
        // target's own forward pass reports any error that matters). Start afresh next time.
        self.try_propose(history, k).unwrap_or_else(|_| {
            self.kv.truncate(0);
            self.fed.clear();
            self.offset = 0;
            Vec::new()
        })
    }
}
