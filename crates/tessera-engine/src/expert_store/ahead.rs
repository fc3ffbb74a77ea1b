//! What the run-ahead (`crate::run_ahead`) asks of the store while a computation waits for a
//! read: the experts in memory now, without counting a lookup; whether the awaited reads are
//! in; and the experts its estimate routed to, read ahead as prefetches that the router's early
//! guesses do not replace.

use std::sync::Arc;

use super::shared::lock;
use super::ExpertStore;
use crate::weights::Ffn;

impl ExpertStore {
    /// Whether a computation waiting for a read may run the layers ahead meanwhile
    /// ([`super::ExpertStreaming::run_ahead`], a kind of prefetch: off without it; nothing is
    /// missed when the budget holds every expert).
    pub(crate) fn runs_ahead(&self) -> bool {
        let st = &self.shared.cfg.streaming;
        st.run_ahead && st.prefetch && !self.shared.cfg.holds_all
    }

    /// Experts `experts` of `layer` that are in memory now (pinned, cached, or read for a
    /// computation that has not taken them yet), `None` for the others. Nothing is counted and
    /// nothing is touched: an estimate's look is not a computation's lookup.
    pub(crate) fn peek(&self, layer: usize, experts: &[usize]) -> Vec<Option<Arc<Ffn>>> {
        self.look_up(layer, experts, None, |inner, part, key| {
            inner
                .pinned
                .get(&key)
                .or_else(|| inner.orphans.get(&key))
                .or_else(|| inner.parts[part].entries.get(&key).map(|en| &en.ffn))
                .cloned()
        })
    }

    /// Whether none of `experts` of `layer` is being read any more: a computation waiting for
    /// them can go on (each is in memory, failed, or gone and read again when looked up).
    pub(crate) fn arrived(&self, layer: usize, experts: &[usize]) -> bool {
        let inner = lock(&self.shared.inner);
        experts
            .iter()
            .all(|&e| !inner.inflight.contains_key(&(layer, e)))
    }

    /// Experts of `layer` the run-ahead's estimate routed to and found absent: read ahead,
    /// behind the demand reads and the prefetches queued before, each into room the layer's LRU
    /// makes. They stay queued when the router's next early guess replaces its own, and are
    /// dropped unread only when the computation reaches their layer first.
    pub(crate) fn prefetch_ahead(&self, layer: usize, experts: &[usize]) {
        let sh = &self.shared;
        if !sh.layers.contains(&layer) || experts.is_empty() {
            return;
        }
        let ranked: Vec<(usize, f32)> = experts.iter().map(|&e| (e, 1.0)).collect();
        let mut inner = lock(&sh.inner);
        let queued = sh.queue_prefetches(&mut inner, layer, &ranked, usize::MAX, 0.0, true);
        inner.stats.ahead_queued += queued as u64;
        drop(inner);
        if queued > 0 {
            sh.work.notify_all();
        }
    }
}

#[cfg(test)]
impl ExpertStore {
    /// The faults a unit test injects into this store's reads.
    pub(crate) fn faults(&self) -> &super::io_queue::TestFaults {
        &self.shared.faults
    }
}
