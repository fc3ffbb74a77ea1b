//! Counters of an [`ExpertStore`] (cumulative since load): hits, misses, bytes read, prefetches
//! and the pinned set ([`ExpertStats`]), and [`ExpertStatsSource`], a handle that reads the live
//! counters while the store exists.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::shared::{lock, Shared};
#[cfg(doc)]
use super::ExpertStore;

/// Counters of an [`ExpertStore`] (cumulative since load).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExpertStats {
    pub budget_bytes: u64,
    /// Built bytes of the largest expert.
    pub expert_bytes: u64,
    /// Experts the store may serve.
    pub experts_served: u64,
    /// Whether each layer has its own LRU (else one is shared by all layers).
    pub per_layer_lru: bool,
    /// Expert lookups by computations: `hits + misses`.
    pub lookups: u64,
    /// Lookups served from memory (pinned, cached, or prefetched, possibly after waiting for an
    /// in-flight prefetch).
    pub hits: u64,
    /// Lookups read from disk by the computing thread.
    pub misses: u64,
    /// Lookups that waited for a prefetch already reading the expert.
    pub inflight_waits: u64,
    /// Bytes read from the file (misses and prefetches).
    pub bytes_read: u64,
    /// Bytes read by misses (on the computing thread's critical path).
    pub miss_bytes_read: u64,
    /// Misses whose read could not be queued with the rest of their layer's (no room in the
    /// layer's cache until some of its experts were computed): read one at a time, late.
    #[serde(default)]
    pub late_reads: u64,
    /// Misses read ahead through the window (see `window.rs`) because their layer's cache had no
    /// room for them.
    #[serde(default)]
    pub window_reads: u64,
    /// Experts read ahead by prefetch (completed reads).
    pub prefetch_issued: u64,
    /// Prefetched experts later used by a computation before being evicted.
    pub prefetch_useful: u64,
    /// Predicted experts already resident (nothing to read).
    pub prefetch_resident: u64,
    /// Queued prefetches dropped unread: the computation reached their layer first (those the
    /// routing then needed were promoted to demand reads and count as misses).
    #[serde(default)]
    pub prefetch_dropped: u64,
    /// Prefetches queued by the run-ahead (experts an estimate of the coming layers routed to).
    #[serde(default)]
    pub ahead_queued: u64,
    /// Experts read into free room of the cache by its fill (`fill.rs`), before anything
    /// asked for them.
    #[serde(default)]
    pub filled: u64,
    /// Microseconds computations spent waiting for reads (misses, and prefetches not yet in).
    #[serde(default)]
    pub read_wait_us: u64,
    /// Microseconds spent building (repacking) read experts.
    #[serde(default)]
    pub build_us: u64,
    /// Microseconds during which at least one read was in progress (the disk was busy for the
    /// store), and the sum of all reads' durations (÷ busy time: the mean reads in flight).
    #[serde(default)]
    pub disk_busy_us: u64,
    #[serde(default)]
    pub read_us: u64,
    /// Reads bypass the page cache with `O_DIRECT`.
    #[serde(default)]
    pub direct_io: bool,
    /// Predictions made for a layer, and how many of the predicted experts the layer then used.
    pub predicted: u64,
    pub predicted_used: u64,
    /// Distinct experts layers used where a prediction had been made (recall denominator).
    pub used_after_prediction: u64,
    pub pinned_experts: u64,
    pub pinned_bytes: u64,
    pub cached_experts: u64,
    pub cached_bytes: u64,
    /// Token routings observed (at the first held layer).
    pub tokens: u64,
    /// High-water mark of the bytes of built experts the store kept alive at once: cached,
    /// pinned, read-window orphans, experts computations took out of the cache, reads in flight
    /// and free memory of the store's slot pool kept for the next builds (see `peak.rs`).
    /// Within `budget_bytes`.
    #[serde(default)]
    pub peak_bytes: u64,
    /// High-water mark of the raw read buffers (the file's bytes before repacking, in use and
    /// pooled), outside the budget.
    #[serde(default)]
    pub peak_read_buffer_bytes: u64,
}

impl ExpertStats {
    /// Adds `other`'s counters to these (for a process holding several streamed models, e.g. a
    /// node's stage and the experts it serves to other stages). Sizes add; flags are or-ed.
    pub fn add(&mut self, other: &Self) {
        self.budget_bytes += other.budget_bytes;
        self.expert_bytes = self.expert_bytes.max(other.expert_bytes);
        self.experts_served += other.experts_served;
        self.per_layer_lru &= other.per_layer_lru;
        self.lookups += other.lookups;
        self.hits += other.hits;
        self.misses += other.misses;
        self.inflight_waits += other.inflight_waits;
        self.bytes_read += other.bytes_read;
        self.miss_bytes_read += other.miss_bytes_read;
        self.late_reads += other.late_reads;
        self.window_reads += other.window_reads;
        self.prefetch_issued += other.prefetch_issued;
        self.prefetch_useful += other.prefetch_useful;
        self.prefetch_resident += other.prefetch_resident;
        self.prefetch_dropped += other.prefetch_dropped;
        self.ahead_queued += other.ahead_queued;
        self.filled += other.filled;
        self.direct_io |= other.direct_io;
        self.read_wait_us += other.read_wait_us;
        self.build_us += other.build_us;
        self.disk_busy_us += other.disk_busy_us;
        self.read_us += other.read_us;
        self.predicted += other.predicted;
        self.predicted_used += other.predicted_used;
        self.used_after_prediction += other.used_after_prediction;
        self.pinned_experts += other.pinned_experts;
        self.pinned_bytes += other.pinned_bytes;
        self.cached_experts += other.cached_experts;
        self.cached_bytes += other.cached_bytes;
        self.tokens = self.tokens.max(other.tokens);
        // A bound on the peak of the sum (the two peaks may not coincide).
        self.peak_bytes += other.peak_bytes;
        self.peak_read_buffer_bytes += other.peak_read_buffer_bytes;
    }

    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / self.lookups.max(1) as f64
    }

    /// Share of predicted experts the layer then used.
    pub fn prediction_precision(&self) -> f64 {
        self.predicted_used as f64 / self.predicted.max(1) as f64
    }

    /// Share of used experts that had been predicted.
    pub fn prediction_recall(&self) -> f64 {
        self.predicted_used as f64 / self.used_after_prediction.max(1) as f64
    }

    /// Share of prefetched reads that were used.
    pub fn prefetch_accuracy(&self) -> f64 {
        self.prefetch_useful as f64 / self.prefetch_issued.max(1) as f64
    }
}

/// A handle on an [`ExpertStore`]'s counters that outlives moving or sharing its model (e.g.
/// into a stage run on another thread): reads the live counters while the store exists.
#[derive(Clone)]
pub struct ExpertStatsSource(std::sync::Weak<Shared>);

impl std::fmt::Debug for ExpertStatsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExpertStatsSource")
    }
}

impl ExpertStatsSource {
    /// Current counters, or `None` once the store is gone.
    pub fn stats(&self) -> Option<ExpertStats> {
        self.0.upgrade().map(|sh| sh.stats())
    }
}

impl crate::model::Model {
    /// A handle on the expert store's counters that can be kept after the model is moved
    /// elsewhere (`None` when experts are not streamed).
    pub fn expert_stats_source(&self) -> Option<ExpertStatsSource> {
        self.expert_store()
            .map(|s| ExpertStatsSource(Arc::downgrade(&s.shared)))
    }
}

impl Shared {
    pub(super) fn stats(&self) -> ExpertStats {
        let inner = lock(&self.inner);
        let mut s = inner.stats.clone();
        s.pinned_experts = inner.pinned.len() as u64;
        s.pinned_bytes = inner.pinned_bytes;
        s.cached_experts = inner.parts.iter().map(|p| p.entries.len() as u64).sum();
        s.cached_bytes = inner.parts.iter().map(|p| p.bytes).sum();
        s.direct_io = self.reader.direct();
        s
    }
}
