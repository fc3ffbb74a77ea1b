//! The read window: room in the budget for the misses a layer's cache cannot hold.
//!
//! A layer's LRU holds its share of the budget. When a routing needs more of the layer's
//! experts than that share has room for (small budgets: every layer's share is a few experts),
//! the misses beyond the room cannot be read when the routing is known; before this window they
//! were read one at a time as the computation reached them, each read's latency on the critical
//! path and the disk idle while each was computed. The window is a share of the budget
//! (`read_parallelism` experts) through which those misses are read ahead, in the order the
//! computation will take them: each completes into an orphan (outside the cache) holding its
//! window bytes until the computation takes it, which frees them for the next.

use super::io_queue::{Flight, Kind};
use super::shared::{Inner, Shared};

impl Shared {
    /// Whether `key` is neither cached, pinned, being read nor waiting as an orphan.
    pub(super) fn absent(&self, inner: &Inner, key: (usize, usize)) -> bool {
        !(inner.pinned.contains_key(&key)
            || inner.orphans.contains_key(&key)
            || inner.inflight.contains_key(&key)
            || inner.parts[self.part(key.0)].entries.contains_key(&key))
    }

    /// Queues reads of the current layer's late misses while the window has room; whether any
    /// was queued.
    pub(super) fn fill_window(&self, inner: &mut Inner) -> bool {
        let mut queued = false;
        while let Some(&key) = inner.late.front() {
            if !self.absent(inner, key) {
                inner.late.pop_front();
                continue;
            }
            let bytes = self.src[self.layers.index(key.0)].packed;
            if inner.window_used + bytes > self.cfg.window_cap {
                break;
            }
            inner.late.pop_front();
            inner.window_used += bytes;
            let mut fl = Flight::new(Kind::Demand, 0);
            fl.windowed = bytes;
            inner.inflight.insert(key, fl);
            inner.demand_q.push_back(key);
            inner.stats.window_reads += 1;
            queued = true;
        }
        queued
    }

    /// The computation moved to another layer: orphans read through the window for earlier
    /// layers are no longer wanted (a computation that failed part-way), and free their room.
    pub(super) fn release_stale_window(&self, inner: &mut Inner, layer: usize) {
        inner.late.clear();
        let stale: Vec<(usize, usize)> = inner
            .orphan_window
            .keys()
            .filter(|k| k.0 != layer)
            .copied()
            .collect();
        for key in stale {
            if let Some(b) = inner.orphan_window.remove(&key) {
                inner.window_used -= b;
            }
            inner.orphans.remove(&key);
        }
    }

    /// A computation took `key`'s orphan: its window bytes go to the next late miss. Whether a
    /// read was queued.
    pub(super) fn orphan_taken(&self, inner: &mut Inner, key: (usize, usize)) -> bool {
        match inner.orphan_window.remove(&key) {
            Some(b) => {
                inner.window_used -= b;
                self.fill_window(inner)
            }
            None => false,
        }
    }
}
