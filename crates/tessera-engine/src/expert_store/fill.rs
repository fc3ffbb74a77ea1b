//! Filling the cache ([`ExpertStreaming::fill`]): a store opens empty, and without a fill every
//! expert a request first routes to is a read the computation waits for, even where the budget
//! holds nearly all of them; a model that fits is read whole at load, and one slightly over its
//! budget should start as close to that as its memory allows. So while no demand or prefetch
//! read is queued, the readers read experts into free room of the LRU (never evicting for it),
//! one expert at a time (a demand read queued meanwhile waits for at most that one expert's
//! ranges), each layer in turn so a fill cut short leaves every layer some. Until routing has
//! chosen a pinned set, a layer whose LRU is full fills the pinned share instead (the budget is
//! all used from the start); the first pinned set keeps those of them it wants and moves the
//! others to room left in their LRUs (`cache.rs`, `repin`). Once every layer's room is full or
//! every expert it holds is in memory, the fill is done. It runs while the store is new: later
//! room is filled by the reads routing asks for (a fill read then would delay them).
//!
//! [`ExpertStreaming::fill`]: super::ExpertStreaming::fill

use std::collections::VecDeque;

use super::io_queue::{Flight, Kind};
use super::shared::{Inner, Shared};

/// The fill's state (behind the store's lock).
pub(super) struct Fill {
    /// Per served layer (by position), the experts the store holds, in the order they are filled.
    order: Vec<Vec<usize>>,
    /// Per served layer, how far its `order` has been looked through.
    cursor: Vec<usize>,
    /// The served layer (by position) the next fill read is looked for in first.
    next_layer: usize,
    /// Nothing left to fill until room frees up.
    pub(super) done: bool,
    /// Fill reads queued or running (at most one).
    pub(super) flights: usize,
    /// Bytes of fill reads in flight bound for the pinned share.
    pub(super) pin_reserved: u64,
    /// Keys of the fill reads queued, for the readers (behind demand reads and prefetches).
    pub(super) queue: VecDeque<(usize, usize)>,
}

impl Fill {
    /// A fill of the experts `order[li]` of each served layer; `enabled: false` is one already
    /// done.
    pub(super) fn new(order: Vec<Vec<usize>>, enabled: bool) -> Self {
        let n = order.len();
        Self {
            order,
            cursor: vec![0; n],
            next_layer: 0,
            done: !enabled,
            flights: 0,
            pin_reserved: 0,
            queue: VecDeque::new(),
        }
    }

    /// Ends fill read `fl` (of an expert of `bytes` built), read or promoted to a demand read:
    /// it no longer counts as the fill's, nor holds room in the pinned share.
    pub(super) fn end(&mut self, fl: &mut Flight, bytes: u64) {
        self.flights -= 1;
        if fl.fill_pin {
            fl.fill_pin = false;
            self.pin_reserved -= bytes;
        }
    }

    /// Whether the fill has nothing queued or running and nothing left to read.
    pub(super) fn finished(&self) -> bool {
        self.done && self.flights == 0
    }
}

impl Shared {
    /// Queues the next fill read, if the fill is not done and none is queued or running: the
    /// next expert absent from memory of the next layer (in turn) whose LRU has room for it
    /// without evicting, or else room in the pinned share while no pinned set is chosen. Marks
    /// the fill done (and wakes [`ExpertStore::wait_filled`]) when there is none. Whether one
    /// was queued.
    ///
    /// [`ExpertStore::wait_filled`]: super::ExpertStore::wait_filled
    pub(super) fn start_fill(&self, inner: &mut Inner) -> bool {
        if inner.fill.done || inner.fill.flights > 0 {
            return false;
        }
        let nl = self.src.len();
        for _ in 0..nl {
            let li = inner.fill.next_layer;
            inner.fill.next_layer = (li + 1) % nl;
            let layer = self.layers.at(li);
            let bytes = self.src[li].packed;
            let part = self.part(layer);
            let to_lru = inner.parts[part].fits(bytes);
            // The pinned share fills layer by layer within each layer's quota (no fill read
            // bound for it is in flight here: one fill read at a time).
            let to_pin = inner.pin_wanted.is_empty()
                && Self::pinned_in(inner, layer) < inner.pin_quota[li]
                && inner.pinned_bytes + inner.fill.pin_reserved + bytes <= self.cfg.pinned_cap;
            if !to_lru && !to_pin {
                continue;
            }
            while let Some(&e) = inner.fill.order[li].get(inner.fill.cursor[li]) {
                inner.fill.cursor[li] += 1;
                let key = (layer, e);
                if !self.absent(inner, key) {
                    continue;
                }
                let mut fl = Flight::new(Kind::Fill, 0);
                if to_lru {
                    inner.parts[part].reserved += bytes;
                    fl.reserved = bytes;
                } else {
                    inner.fill.pin_reserved += bytes;
                    fl.fill_pin = true;
                }
                inner.inflight.insert(key, fl);
                inner.fill.flights += 1;
                inner.fill.queue.push_back(key);
                return true;
            }
        }
        inner.fill.done = true;
        self.notify_ready();
        false
    }

    /// Puts a fill read bound for the pinned share (`to_pin`, its reservation already ended)
    /// there, while no pinned set is chosen (else where [`Shared::insert`] puts any read).
    /// Whether it found room.
    pub(super) fn insert_filled(
        &self,
        inner: &mut Inner,
        key: (usize, usize),
        ffn: &std::sync::Arc<crate::weights::Ffn>,
        to_pin: bool,
    ) -> bool {
        if to_pin {
            let bytes = self.src[self.layers.index(key.0)].packed;
            if inner.pin_wanted.is_empty() && inner.pinned_bytes + bytes <= self.cfg.pinned_cap {
                inner.pinned.insert(key, std::sync::Arc::clone(ffn));
                inner.pinned_bytes += bytes;
                return true;
            }
        }
        self.insert(inner, key, ffn, super::cache::Origin::Used)
    }
}
