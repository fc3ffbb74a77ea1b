//! Several sequences advanced in one forward pass (continuous batching): decode steps of one
//! token each ([`Model::step`]), or any mix of prefill chunks and decode steps
//! ([`Model::step_mixed`]). A sequence's logits are bit-identical to running it alone.

use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::{Logits, Model, SeqStep};
use crate::moe::LocalExperts;

impl Model {
    /// Advances each sequence by its token: `seqs[i] = (token, cache)`, the token taking the
    /// next position of that cache. Returns one row of logits per sequence, in order.
    pub fn step(&self, seqs: &mut [(u32, &mut KvCache)]) -> Result<Logits> {
        let tokens: Vec<[u32; 1]> = seqs.iter().map(|(t, _)| [*t]).collect();
        let mut mixed: Vec<(&[u32], &mut KvCache)> = tokens
            .iter()
            .zip(seqs.iter_mut())
            .map(|(t, (_, kv))| (&t[..], &mut **kv))
            .collect();
        self.step_mixed(&mut mixed)
    }

    /// Appends `seqs[i].0` (one or more tokens) to sequence `i` and returns the logits of each
    /// sequence's last new token, in order: a prefill chunk of one request and decode steps of
    /// others can share one pass.
    pub fn step_mixed(&self, seqs: &mut [(&[u32], &mut KvCache)]) -> Result<Logits> {
        if seqs.is_empty() || seqs.iter().any(|(t, _)| t.is_empty()) {
            return Err(EngineError::BadInput(
                "a batch needs at least one sequence, each with at least one token".into(),
            ));
        }
        let mut batch = Vec::with_capacity(seqs.len());
        let mut tokens = Vec::new();
        for (t, kv) in seqs.iter() {
            let step = SeqStep {
                n_tokens: t.len(),
                start_pos: kv.len(),
            };
            let needed = step.start_pos + step.n_tokens;
            let limit = kv.capacity().min(self.config().context_length);
            if needed > limit {
                return Err(EngineError::ContextOverflow { needed, limit });
            }
            batch.push(step);
            tokens.extend_from_slice(t);
        }
        let mut hidden = self.embed(&tokens)?;
        let mut kvs: Vec<&mut KvCache> = seqs.iter_mut().map(|(_, kv)| &mut **kv).collect();
        self.run_layers(
            0..self.config().n_layer,
            &mut hidden,
            &batch,
            &mut kvs,
            &mut LocalExperts(self),
        )?;
        // Only each sequence's last row goes through the head.
        let mut last = Vec::with_capacity(batch.len());
        let mut row = 0;
        for s in &batch {
            row += s.n_tokens;
            last.push(row - 1);
        }
        self.head(&hidden.gather(&last))
    }
}
