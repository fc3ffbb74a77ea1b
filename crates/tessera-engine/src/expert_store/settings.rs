//! How a part streams its experts ([`ExpertStreaming`], see the parent module's doc), and the
//! settings the store derives from it when it opens: the pinned share of the budget, whether
//! each layer gets its own LRU, and each layer's share in whole experts, first even and then
//! following the layers' reuse of their experts (`reuse::shares_by_reuse`).

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
    pub(super) per_layer: bool,
    /// Bytes the layers' shares (pinned and cached) divide among them: the budget less the
    /// read window.
    pub(super) share_bytes: u64,
    /// The experts each served layer (by position) holds.
    pub(super) held: Vec<Vec<usize>>,
    /// The least share in whole experts each served layer keeps however the routing goes: its
    /// even share, or a routing's experts if that is less (see `reuse::shares_by_reuse`).
    pub(super) share_floor: Vec<usize>,
    /// Tokens between re-learning the layers' shares ([`reshare_every`]).
    pub(super) reshare_every: u64,
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

/// Each layer's share at open, in whole experts, and the least each keeps when the shares
/// follow the routing: even shares ([`whole_experts`]), each keeping a routing's experts (or
/// its even share if that is less), except that the first layer holds every expert it serves,
/// for good, where the other layers' even shares of what is left still hold two routings'
/// experts each (`n_used` a routing).
///
/// The first layer's misses are the ones nothing can read ahead: its routing exists only once
/// the token has gone through the first attention, and no prediction or run-ahead has yet run;
/// each costs the step a whole read. Later layers' misses are predicted (by the router applied
/// early, or by the run-ahead's estimate) and read behind the computation. bench-qwen3moe-q4_0
/// under the lab's eMMC, 32 tokens after 64 of context (2-core Xeon VM, alternated): 2x over
/// budget 59 -> 85 tok/s (0.50 -> 0.13 MiB missed a token), 3x 47-54 -> 59-61 (1.7 -> 1.1 MiB:
/// the other layers' routing keeps to fewer experts, and a smaller share of theirs missed
/// little). Where the rest would be thinner (5x: 13 experts a layer, 8 a routing) the other
/// layers' misses outweighed it: 23 -> 13 tok/s, 7.2 -> 16.5 MiB a token. The second layer
/// whole as well (3x) left too little to the rest: 3.0 MiB a token, 45 tok/s.
pub(super) fn shares_at_open(
    bytes: u64,
    packed: &[u64],
    held: &[usize],
    n_used: usize,
) -> (Vec<usize>, Vec<usize>) {
    let first = packed.first().map_or(0, |&p| p * held[0] as u64);
    let first_whole = (packed.len() >= 2 && first <= bytes)
        .then(|| whole_experts(bytes - first, &packed[1..], &held[1..]))
        .filter(|rest| {
            rest.iter()
                .zip(&held[1..])
                .all(|(&s, &h)| s >= (2 * n_used).min(h))
        });
    let slots = match &first_whole {
        Some(rest) => std::iter::once(held[0])
            .chain(rest.iter().copied())
            .collect(),
        None => whole_experts(bytes, packed, held),
    };
    let mut floor: Vec<usize> = slots.iter().map(|&s| s.min(n_used)).collect();
    if first_whole.is_some() {
        floor[0] = held[0];
    }
    (slots, floor)
}

/// Tokens between re-learning the layers' shares: every `repin_every / 4` tokens where every
/// layer's first (even) share `slots` holds at least two routings' experts (`n_used` each),
/// else every `repin_every`. Each re-learning moves a layer by one expert at most
/// ([`step_toward`]), so at every 16 tokens the first layer of bench-qwen3moe-q4_0, 2x over
/// budget, took three re-learnings (48 tokens) to grow from its even share toward the 55-63
/// experts its routing asked for, and missed meanwhile. Every 4 tokens (32 tokens decoded
/// after 64 of context, under the lab's eMMC): 2x 0.84 -> 0.50-0.53 MiB missed a token,
/// 117-128 -> 126-146 tok/s; 3x 2.2 -> 1.7 MiB, 75-77 -> 84-86 tok/s. Where a share is barely
/// more than a routing, each expert a layer gives up is one its routing misses, and a few
/// tokens' counts move the targets back and forth: 5x over budget (13 experts a layer, 8 a
/// routing) lost at every 4 tokens (7.1 -> 8.1 MiB a token, 33 -> 29-30 tok/s), so there the
/// shares move as slowly as before.
pub(super) fn reshare_every(repin_every: u64, slots: &[usize], n_used: usize) -> u64 {
    let roomy = slots.iter().all(|&s| s >= 2 * n_used);
    if roomy {
        (repin_every / 4).max(1)
    } else {
        repin_every.max(1)
    }
}

/// Each layer's share (`slots[l]` experts of `packed[l]` bytes) split between the pinned set
/// and the layer's LRU: the pinned quotas (`pinned` bytes shared as whole experts, each layer
/// keeping at least one expert's room in its LRU) and each LRU's room in bytes.
pub(super) fn split_shares(pinned: u64, packed: &[u64], slots: &[usize]) -> (Vec<usize>, Vec<u64>) {
    let below: Vec<usize> = slots.iter().map(|s| s.saturating_sub(1)).collect();
    let quota = whole_experts(pinned, packed, &below);
    let room = (0..slots.len())
        .map(|l| (slots[l] - quota[l]) as u64 * packed[l])
        .collect();
    (quota, room)
}

/// The shares `now` moved toward `target`: each layer gives up at most one expert, and the
/// room given up (with any left idle in `bytes`) goes to the layers short of their target, the
/// one furthest short first. Counts over a few dozen tokens are noisy: a layer's share swung
/// by a dozen experts between two re-learnings, and each swing's evictions were read back.
pub(super) fn step_toward(
    now: &[usize],
    target: &[usize],
    packed: &[u64],
    bytes: u64,
) -> Vec<usize> {
    let mut next: Vec<usize> = now
        .iter()
        .zip(target)
        .map(|(&n, &t)| if t < n { n - 1 } else { n })
        .collect();
    let used: u64 = next.iter().zip(packed).map(|(&s, &p)| s as u64 * p).sum();
    let mut left = bytes.saturating_sub(used);
    loop {
        let short = (0..next.len())
            .filter(|&l| next[l] < target[l] && packed[l] <= left)
            .max_by_key(|&l| (target[l] - next[l], std::cmp::Reverse(l)));
        let Some(l) = short else { return next };
        next[l] += 1;
        left -= packed[l];
    }
}

#[cfg(test)]
mod tests {
    use super::{reshare_every, shares_at_open, step_toward, whole_experts};

    #[test]
    fn the_first_layer_holds_all_its_experts_where_the_rest_still_hold_two_routings() {
        // 4 layers of 64 experts of 1 byte, 8 a routing: the first layer whole leaves the
        // others 16 each, two routings: kept whole for good.
        let (slots, floor) = shares_at_open(64 + 3 * 16, &[1; 4], &[64; 4], 8);
        assert_eq!(slots, vec![64, 16, 16, 16]);
        assert_eq!(floor, vec![64, 8, 8, 8]);
        // One expert less and a later layer would hold fewer than two routings: even shares.
        let (slots, floor) = shares_at_open(64 + 3 * 16 - 1, &[1; 4], &[64; 4], 8);
        assert_eq!(slots, vec![28, 28, 28, 27]);
        assert_eq!(floor, vec![8; 4]);
        // A layer serving fewer experts than two routings needs only what it serves.
        let (slots, _) = shares_at_open(64 + 10, &[1; 2], &[64, 10], 8);
        assert_eq!(slots, vec![64, 10]);
        // One layer, or a first layer larger than the budget: even shares as before.
        assert_eq!(shares_at_open(10, &[1], &[64], 8).0, vec![10]);
        assert_eq!(shares_at_open(50, &[1; 2], &[64; 2], 8).0, vec![25, 25]);
    }

    #[test]
    fn shares_are_relearned_four_times_as_often_where_every_layer_holds_two_routings() {
        // 8 experts a routing: shares of 16 and more re-learn every 4 tokens of 16...
        assert_eq!(reshare_every(16, &[16, 30, 64], 8), 4);
        // ...one share below two routings keeps every layer at the pinned set's pace.
        assert_eq!(reshare_every(16, &[15, 30, 64], 8), 16);
        // Never every zero tokens.
        assert_eq!(reshare_every(2, &[16], 8), 1);
        assert_eq!(reshare_every(0, &[1], 8), 1);
    }

    #[test]
    fn shares_move_toward_their_target_one_expert_given_up_a_layer_at_a_time() {
        // Three layers of 10-byte experts.
        let step =
            |now: &[usize], target: &[usize], bytes| step_toward(now, target, &[10; 3], bytes);
        // Layers 1 and 2 give up one expert each; layer 0 takes both (and the idle room).
        assert_eq!(step(&[4, 4, 4], &[8, 2, 2], 125), vec![6, 3, 3]);
        assert_eq!(step(&[6, 3, 3], &[8, 2, 2], 125), vec![8, 2, 2]);
        // Two layers short: the one furthest short first, then the earlier.
        assert_eq!(step(&[4, 4, 4], &[2, 5, 5], 120), vec![3, 5, 4]);
        // At the target nothing moves; room no target asks for stays idle.
        assert_eq!(step(&[8, 2, 2], &[8, 2, 2], 200), vec![8, 2, 2]);
    }

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
