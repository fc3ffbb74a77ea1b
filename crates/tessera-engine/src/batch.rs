//! One decode step for several sequences in a single forward pass (continuous batching).

use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::{Logits, Model, SeqStep};
use crate::moe::LocalExperts;

impl Model {
    /// Advances each sequence by its token: `seqs[i] = (token, cache)`, the token taking the
    /// next position of that cache. Returns one row of logits per sequence, in order. A
    /// sequence's logits are bit-identical to decoding it alone.
    pub fn step(&self, seqs: &mut [(u32, &mut KvCache)]) -> Result<Logits> {
        if seqs.is_empty() {
            return Err(EngineError::BadInput("empty batch".into()));
        }
        let tokens: Vec<u32> = seqs.iter().map(|(t, _)| *t).collect();
        let batch: Vec<SeqStep> = seqs
            .iter()
            .map(|(_, kv)| SeqStep {
                n_tokens: 1,
                start_pos: kv.len(),
            })
            .collect();
        for (s, (_, kv)) in batch.iter().zip(seqs.iter()) {
            if s.start_pos + 1 > kv.capacity() {
                return Err(EngineError::ContextOverflow {
                    needed: s.start_pos + 1,
                    limit: kv.capacity(),
                });
            }
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
        self.head(&hidden)
    }
}
