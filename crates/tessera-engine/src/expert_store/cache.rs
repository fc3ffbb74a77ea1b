//! The cache of built experts: a pinned hot set (re-learned from observed routing counts) plus
//! an LRU per layer, or one shared by all layers, for the rest; each layer's share of the budget
//! follows its reuse distances (`reuse.rs`).
//! Reads reserve their room when queued; experts in use by a computation, and those the current
//! layer's routing needs, are never evicted.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::weights::Ffn;

use super::reuse::shares_by_reuse;
use super::settings::{split_shares, step_toward};
use super::shared::{Inner, Shared};

/// Why a cached expert was read, until a computation first looks it up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Origin {
    /// Looked up since it was read (or pinned).
    Used,
    /// Read ahead by prefetch: its first lookup is a hit and a useful prefetch.
    Prefetched,
    /// Read for a routing that needs it: its first lookup is a miss.
    Demanded,
}

pub(super) struct Entry {
    pub(super) ffn: Arc<Ffn>,
    pub(super) bytes: u64,
    pub(super) last: u64,
    pub(super) origin: Origin,
}

#[derive(Default)]
pub(super) struct Lru {
    pub(super) cap: u64,
    pub(super) bytes: u64,
    /// Bytes promised to reads in flight (released when they complete).
    pub(super) reserved: u64,
    pub(super) entries: HashMap<(usize, usize), Entry>,
}

impl Lru {
    /// Whether `need` more bytes fit beside the entries and the reservations, evicting nothing.
    pub(super) fn fits(&self, need: u64) -> bool {
        self.bytes + self.reserved + need <= self.cap
    }

    /// Adds `key` (`bytes` built), last used at `last`.
    pub(super) fn put(
        &mut self,
        key: (usize, usize),
        ffn: Arc<Ffn>,
        bytes: u64,
        last: u64,
        origin: Origin,
    ) {
        self.bytes += bytes;
        self.entries.insert(
            key,
            Entry {
                ffn,
                bytes,
                last,
                origin,
            },
        );
    }

    /// Evicts least recently used entries, neither in use nor in `keep`, until `need` more
    /// bytes fit beside the entries and the reservations; their memory goes back to the
    /// store's slot pool, for the next builds.
    pub(super) fn make_room(&mut self, need: u64, keep: &HashSet<(usize, usize)>) -> bool {
        while !self.fits(need) {
            let victim = self
                .entries
                .iter()
                .filter(|(k, v)| Arc::strong_count(&v.ffn) == 1 && !keep.contains(k))
                .min_by_key(|(_, v)| v.last)
                .map(|(k, _)| *k);
            let Some(k) = victim else { return false };
            let v = self.entries.remove(&k).expect("present");
            self.bytes -= v.bytes;
        }
        true
    }
}

impl Shared {
    pub(super) fn part(&self, layer: usize) -> usize {
        if self.cfg.per_layer {
            self.layers.index(layer)
        } else {
            0
        }
    }

    /// Bytes of pinned-set reads in flight (they take no LRU reservation).
    pub(super) fn pin_reserved(&self, inner: &Inner) -> u64 {
        inner
            .inflight
            .iter()
            .filter(|(k, f)| f.reserved == 0 && inner.pin_wanted.contains(k))
            .map(|(k, _)| self.src[self.layers.index(k.0)].packed)
            .sum()
    }

    /// Puts a freshly read expert into the pinned set (if wanted) or its LRU. Returns false if
    /// no room could be made.
    pub(super) fn insert(
        &self,
        inner: &mut Inner,
        key: (usize, usize),
        ffn: &Arc<Ffn>,
        o: Origin,
    ) -> bool {
        let bytes = self.src[self.layers.index(key.0)].packed;
        if inner.pin_wanted.contains(&key) && inner.pinned_bytes + bytes <= self.cfg.pinned_cap {
            inner.pinned.insert(key, Arc::clone(ffn));
            inner.pinned_bytes += bytes;
            if o != Origin::Used {
                inner.pinned_origin.insert(key, o);
            }
            return true;
        }
        inner.tick += 1;
        let tick = inner.tick;
        let keep = inner.needed.clone();
        let lru = &mut inner.parts[self.part(key.0)];
        if !lru.make_room(bytes, &keep) {
            return false;
        }
        lru.put(key, Arc::clone(ffn), bytes, tick, o);
        true
    }

    /// Experts of `layer` pinned now.
    pub(super) fn pinned_in(inner: &Inner, layer: usize) -> usize {
        inner.pinned.keys().filter(|k| k.0 == layer).count()
    }

    /// Moves a cached expert into the pinned set if there is room.
    pub(super) fn try_pin(
        &self,
        inner: &mut Inner,
        key: (usize, usize),
        ffn: &Arc<Ffn>,
        part: usize,
    ) {
        let bytes = self.src[self.layers.index(key.0)].packed;
        if inner.pinned_bytes + bytes > self.cfg.pinned_cap {
            return;
        }
        if let Some(en) = inner.parts[part].entries.remove(&key) {
            inner.parts[part].bytes -= en.bytes;
        }
        inner.pinned.insert(key, Arc::clone(ffn));
        inner.pinned_bytes += bytes;
    }

    /// Re-learns each layer's share of the budget from the layers' reuse of their experts so
    /// far ([`shares_by_reuse`]), a step toward it at a time ([`step_toward`]: a layer gives up
    /// at most one expert each time): the layers' pinned quotas, and their LRUs' room. A layer
    /// whose share shrinks evicts down to it now; one whose share grows gets the room the others
    /// have given up, so the LRUs' room (and what they hold) never adds up past their part of
    /// the budget, even while a shrunk layer still holds experts a computation uses.
    pub(super) fn reshare(&self, inner: &mut Inner) {
        let packed: Vec<u64> = self.src.iter().map(|s| s.packed).collect();
        let held: Vec<usize> = self.cfg.held.iter().map(Vec::len).collect();
        let target = shares_by_reuse(
            self.cfg.share_bytes,
            &packed,
            &self.cfg.share_floor,
            &held,
            &inner.reuse,
        );
        let slots = step_toward(&inner.shares, &target, &packed, self.cfg.share_bytes);
        let (quota, caps) = split_shares(self.cfg.pinned_cap, &packed, &slots);
        let keep = inner.needed.clone();
        for (lru, &cap) in inner.parts.iter_mut().zip(&caps) {
            if cap < lru.cap {
                lru.cap = cap;
                lru.make_room(0, &keep);
            }
        }
        let room = self.cfg.share_bytes - self.cfg.pinned_cap;
        let mut taken: u64 = inner
            .parts
            .iter()
            .map(|p| p.cap.max(p.bytes + p.reserved))
            .sum();
        for (lru, &cap) in inner.parts.iter_mut().zip(&caps) {
            if cap > lru.cap {
                let grant = (cap - lru.cap).min(room.saturating_sub(taken));
                lru.cap += grant;
                taken += grant;
            }
        }
        inner.pin_quota = quota;
        inner.shares = slots;
    }

    /// Re-learns the pinned set: each layer's most used experts, as many as its quota.
    pub(super) fn repin(&self, inner: &mut Inner) {
        let mut wanted = HashSet::new();
        for (li, c) in inner.counts.iter().enumerate() {
            let mut used: Vec<(u64, usize)> = c
                .iter()
                .enumerate()
                .filter(|(_, &n)| n > 0)
                .map(|(e, &n)| (n, e))
                .collect();
            used.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            let layer = self.layers.at(li);
            wanted.extend(
                used.iter()
                    .take(inner.pin_quota[li])
                    .map(|&(_, e)| (layer, e)),
            );
        }
        // Unpin what is no longer wanted; pin what is wanted and already cached; move what was
        // unpinned to room left in its LRU (the fill's pins, chosen before any routing, land
        // there), else let it go.
        let gone: Vec<_> = inner
            .pinned
            .keys()
            .filter(|k| !wanted.contains(k))
            .copied()
            .collect();
        let mut unpinned = Vec::with_capacity(gone.len());
        for k in gone {
            if let Some(f) = inner.pinned.remove(&k) {
                unpinned.push((k, f));
            }
            inner.pinned_origin.remove(&k);
            inner.pinned_bytes -= self.src[self.layers.index(k.0)].packed;
        }
        for &k in &wanted {
            if inner.pinned.contains_key(&k) {
                continue;
            }
            let part = self.part(k.0);
            if let Some(f) = inner.parts[part]
                .entries
                .get(&k)
                .map(|en| Arc::clone(&en.ffn))
            {
                self.try_pin(inner, k, &f, part);
            }
        }
        inner.pin_wanted = wanted;
        for (k, f) in unpinned {
            let bytes = self.src[self.layers.index(k.0)].packed;
            let part = self.part(k.0);
            if inner.parts[part].fits(bytes) {
                inner.tick += 1;
                let tick = inner.tick;
                inner.parts[part].put(k, f, bytes, tick, Origin::Used);
            } else {
                Self::lend(inner, &f);
            }
        }
    }
}
