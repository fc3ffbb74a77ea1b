//! The store's high-water mark of memory ([`ExpertStats::peak_bytes`]), so that the budget is
//! checked as a peak rather than read from the cache's own counters at the end of a run.
//!
//! What the store keeps alive at a moment is more than its cache: the cached and pinned experts,
//! read-window orphans waiting for their computation, experts a computation took that are no
//! longer in the cache (a taken orphan, an unpinned expert still in use), the matrices of reads
//! in flight (built so far, and the one each reader is building), and the free ranges of the
//! store's slot pool that evicted experts gave back (`kernels::weight_buffer`), kept resident
//! for the next builds. All of it is counted by allocation size. Memory grows only when a reader
//! starts a build (its target counted from the moment it is taken), so the peak is sampled there,
//! under the lock, with every other reader's state. The raw read buffers (the file's bytes before
//! repacking, pooled by the reader) are outside the budget and counted apart
//! ([`ExpertStats::peak_read_buffer_bytes`]).
//!
//! The bound this measures (checked by the engine's and the node's tests): the budget plus one
//! expert per computation using the store. A computation may work on one expert outside the
//! cache: a miss read when its layer's share is full of experts its routing still needs (a
//! budget below one routing's experts), or an orphan it took from the read window, whose window
//! room goes at once to the next read ahead.
//!
//! The pool's free memory is kept only within that bound. It fills as experts leave (evicted,
//! or dropped by the computation that took them) and empties as builds take it again, but a
//! build that found no free range of its length carves a new one, and ranges given back while
//! it reads then sit beside it: the store held a budget and a lent expert, plus a free expert,
//! in one run of ten of the engine's tiny-model test (CI, Intel; 6 of 60 runs on a 2-core Xeon
//! VM). So where the store is sampled (before a new range is carved, and as each read
//! completes), free ranges beyond the bound have their pages given back to the OS first
//! (`SlotPool::release_beyond`); they stay in the pool and are lent again, faulted in anew.

use std::sync::Arc;

use crate::weights::Ffn;

use super::shared::{Inner, Shared};
#[cfg(doc)]
use super::ExpertStats;

impl Shared {
    /// Bytes of built experts and their allocations the store keeps alive now (see the module
    /// doc).
    pub(super) fn held_bytes(&self, inner: &mut Inner) -> u64 {
        inner.lent.retain(|(w, _)| w.strong_count() > 0);
        let ffn = |f: &Arc<Ffn>| f.allocated_bytes();
        let cached: u64 = inner
            .parts
            .iter()
            .flat_map(|p| p.entries.values())
            .map(|e| ffn(&e.ffn))
            .sum();
        let pinned: u64 = inner.pinned.values().map(ffn).sum();
        let orphans: u64 = inner.orphans.values().map(ffn).sum();
        let lent: u64 = inner.lent.iter().map(|(_, b)| b).sum();
        let reads: u64 = inner.inflight.values().map(|f| f.built_bytes()).sum();
        cached + pinned + orphans + lent + reads + inner.building + self.slots.free_bytes()
    }

    /// Raises the high-water marks to what the store holds now, first giving back to the OS
    /// what its slot pool keeps free beyond the bound (see the module doc).
    pub(super) fn note_peak(&self, inner: &mut Inner) {
        let mut held = self.held_bytes(inner);
        let bound = inner.stats.budget_bytes + inner.stats.expert_bytes;
        if held > bound {
            let in_use = held - self.slots.free_bytes();
            self.slots.release_beyond(bound.saturating_sub(in_use));
            held = in_use + self.slots.free_bytes();
        }
        let st = &mut inner.stats;
        st.peak_bytes = st.peak_bytes.max(held);
        st.peak_read_buffer_bytes = st.peak_read_buffer_bytes.max(self.reader.buffer_bytes());
    }

    /// `ffn` leaves the store's cache while a computation may still hold it: counted until the
    /// last holder drops it.
    pub(super) fn lend(inner: &mut Inner, ffn: &Arc<Ffn>) {
        if Arc::strong_count(ffn) > 1 {
            inner
                .lent
                .push((Arc::downgrade(ffn), ffn.allocated_bytes()));
        }
    }
}
