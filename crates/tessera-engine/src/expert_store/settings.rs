//! How a part streams its experts ([`ExpertStreaming`], see the parent module's doc), and the
//! settings the store derives from it when it opens: the pinned share of the budget, whether
//! each layer gets its own LRU, and each layer's share in whole experts.

use serde::{Deserialize, Serialize};

/// How a part streams its experts (see the module doc).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertStreaming {
    /// Bytes of built (repacked) experts kept in memory at most.
    pub budget_bytes: u64,
    /// Share of the budget given to the pinned hot set (0 disables pinning).
    pub pinned_fraction: f64,
    /// Tokens between re-learning the pinned set from routing counts.
    pub repin_every: u64,
    /// Prefetch the next layer's predicted experts on the I/O thread.
    pub prefetch: bool,
    /// Keep expert reads out of the page cache: `O_DIRECT` where the system allows it, else
    /// `posix_fadvise(DONTNEED)` after each read.
    pub drop_page_cache: bool,
    /// Reads in flight at once (reader threads); a layer's misses are read in parallel.
    pub read_parallelism: usize,
    /// Most experts read ahead for a layer (the most probable predicted ones not resident).
    #[serde(default = "default_prefetch_max")]
    pub prefetch_max: usize,
    /// Least predicted router probability (softmax over all experts) of an expert read ahead.
    #[serde(default = "default_prefetch_min_prob")]
    pub prefetch_min_prob: f32,
    /// Fill the cache from the file while no other read is queued, from the moment the store
    /// opens: the first requests find in memory what the budget holds instead of waiting for
    /// each expert's first read (see `fill.rs`).
    #[serde(default = "default_fill")]
    pub fill: bool,
    /// While a one-token step waits for a read, run the layers after it on an estimate (the
    /// experts in memory only) to learn which experts they will route to, and read those ahead
    /// (see `crate::run_ahead`). The step's result is computed as before, once the read is in.
    /// A kind of prefetch: off when `prefetch` is.
    #[serde(default = "default_run_ahead")]
    pub run_ahead: bool,
}

fn default_run_ahead() -> bool {
    true
}

fn default_fill() -> bool {
    true
}

fn default_prefetch_max() -> usize {
    2
}

fn default_prefetch_min_prob() -> f32 {
    0.05
}

impl ExpertStreaming {
    /// Defaults: a quarter of the budget pinned, re-learned every 16 tokens, prefetch on (at most
    /// 2 experts per layer, predicted probability at least 0.05), page cache bypassed, 4 reads in
    /// flight, the cache filled from the start.
    pub fn with_budget(budget_bytes: u64) -> Self {
        Self {
            budget_bytes,
            pinned_fraction: 0.25,
            repin_every: 16,
            prefetch: true,
            drop_page_cache: true,
            read_parallelism: 4,
            prefetch_max: default_prefetch_max(),
            prefetch_min_prob: default_prefetch_min_prob(),
            fill: default_fill(),
            run_ahead: default_run_ahead(),
        }
    }
}

#[derive(Clone, Debug)]
pub(super) struct Settings {
    pub(super) streaming: ExpertStreaming,
    pub(super) pinned_cap: u64,
    /// Experts of each served layer (by position) the pinned set may hold.
    pub(super) pin_quota: Vec<usize>,
    pub(super) per_layer: bool,
    /// Bytes of the budget for reads a layer's cache has no room for (see `window.rs`).
    pub(super) window_cap: u64,
    /// The budget holds every expert served: once filled nothing misses, so nothing is
    /// predicted (the next layer's router product costs ~4% of a decode step).
    pub(super) holds_all: bool,
}

/// `bytes` shared among layers as whole experts (`packed[l]` bytes each, at most `held[l]` of
/// them): one expert to each layer in turn while one fits, so that the layers' shares differ by
/// at most one expert (where their sizes are equal) and no share keeps room for a fraction of
/// one idle.
pub(super) fn whole_experts(bytes: u64, packed: &[u64], held: &[usize]) -> Vec<usize> {
    let mut slots = vec![0; packed.len()];
    let mut left = bytes;
    loop {
        let mut gave = false;
        for l in 0..packed.len() {
            if slots[l] < held[l] && packed[l] > 0 && packed[l] <= left {
                slots[l] += 1;
                left -= packed[l];
                gave = true;
            }
        }
        if !gave {
            return slots;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::whole_experts;

    #[test]
    fn layers_share_a_budget_in_whole_experts_evenly() {
        // 270.2 experts' bytes over 12 layers of 23: 6 layers hold 23, 6 hold 22, and the
        // fifth of an expert left over is all that stays idle (an equal share in bytes gave
        // each layer 22.5, of which an LRU keeps 22).
        let slots = whole_experts(2702, &[10; 12], &[23; 12]);
        assert_eq!(slots.iter().sum::<usize>(), 270);
        assert!(slots.iter().all(|&s| s == 22 || s == 23), "{slots:?}");
        // A layer holding fewer experts leaves its share to the others.
        let slots = whole_experts(100, &[10; 3], &[1, 8, 8]);
        assert_eq!(slots, vec![1, 5, 4]);
        // Experts of different sizes: each layer in turn while one of its own fits.
        assert_eq!(whole_experts(25, &[10, 5], &[9, 9]), vec![2, 1]);
        assert_eq!(whole_experts(9, &[10, 10], &[9, 9]), vec![0, 0]);
    }
}
