//! How long a home waits, per MoE layer of a one-token decode step, for the slowest owner of the
//! experts its token routes to.
//!
//! The owners of an expert split compute a layer's experts at once, so the layer takes the
//! largest of their times. Those times vary from layer to layer with the routing: how many of
//! the token's experts fall on each owner, and which of those a streaming owner must read from
//! its disk. The largest of varying times is on average more than the largest of their averages:
//! a layer where the home reads two experts while another owner reads one waits for the home's
//! two, and the next layer, where the other owner reads two, for its two. Pricing a split by its
//! slowest owner's *mean* (as a batch, whose many rows average the routing out, may be priced)
//! credited the lab's split of two boards streaming from eMMC with a third more speed than it
//! measured (`tessera lab run … moe-bigger-than-any.toml --hosts 2`, 2026-12-05: the home read
//! 16.8 MiB a token, 58.8 ms at its disk's rate, its owner about as much, and the token took
//! 82.6 ms). The owner reads its misses when the home's request arrives, on the layer's path,
//! and so, mostly, does the home (see the caller).
//!
//! A token's `used` experts are distinct and uniformly chosen among the layer's `n` (a
//! multivariate hypergeometric split over the owners); each routed expert a streaming owner
//! holds is read from disk independently with its miss share. The expectation is exact under
//! those assumptions: `E[max] = ∫ P(max > t) dt`, where `P(max ≤ t)` sums over the ways the
//! token's experts fall on the owners, owner by owner (a small dynamic programme over the slots
//! taken so far), at every value the maximum can take.

/// One owner's part of a MoE layer for one token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OwnerLayer {
    /// Experts of the layer the owner holds.
    pub owned: u32,
    /// Time per routed expert, computed from memory, s.
    pub per_expert_s: f64,
    /// Time added per routed expert read from disk first, s, and the chance one is.
    pub per_miss_s: f64,
    pub miss_share: f64,
    /// Time added when any of the token's experts is the owner's (a remote owner's round trip
    /// and transfer), s.
    pub contact_s: f64,
}

impl OwnerLayer {
    /// The owner's time when `routed` of the token's experts are its own and `missed` of them
    /// are read from disk.
    fn time(&self, routed: u32, missed: u32) -> f64 {
        if routed == 0 {
            return 0.0;
        }
        f64::from(routed) * self.per_expert_s + f64::from(missed) * self.per_miss_s + self.contact_s
    }

    /// The chance the owner's time with `routed` experts is at most `t`.
    fn cdf(&self, routed: u32, t: f64) -> f64 {
        let tol = 1e-12 * t.abs().max(1e-12);
        (0..=routed)
            .filter(|&j| self.time(routed, j) <= t + tol)
            .map(|j| binomial_pmf(routed, j, self.miss_share))
            .sum()
    }
}

/// The expected time of the slowest owner for one token routed to `used` distinct experts of
/// `n` (uniformly), `owners` holding disjoint sets of them (experts no owner holds add no time).
pub(crate) fn expected_slowest(n: u32, used: u32, owners: &[OwnerLayer]) -> f64 {
    let owned: u32 = owners.iter().map(|o| o.owned).sum();
    if n == 0 || used == 0 || owned > n || used > n {
        return owners
            .iter()
            .map(|o| o.time(used.min(o.owned), 0))
            .fold(0.0, f64::max);
    }
    let rest = n - owned;
    // Every value the slowest owner's time can take, ascending.
    let mut values: Vec<f64> = vec![0.0];
    for o in owners {
        for c in 1..=used.min(o.owned) {
            values.extend((0..=c).map(|j| o.time(c, j)));
        }
    }
    values.sort_by(f64::total_cmp);
    values.dedup_by(|a, b| (*a - *b).abs() <= 1e-12 * b.abs().max(1e-12));
    let ways = choose(n, used);
    let at_most = |t: f64| -> f64 {
        // dp[k]: the weight of the ways the owners so far take k of the token's experts with
        // every one of them done by `t`.
        let mut dp = vec![0.0; used as usize + 1];
        dp[0] = 1.0;
        for o in owners {
            let mut next = vec![0.0; used as usize + 1];
            for (k, &w) in dp.iter().enumerate() {
                if w == 0.0 {
                    continue;
                }
                for c in 0..=(used - k as u32).min(o.owned) {
                    next[k + c as usize] += w * choose(o.owned, c) * o.cdf(c, t);
                }
            }
            dp = next;
        }
        let done: f64 = dp
            .iter()
            .enumerate()
            .map(|(k, &w)| w * choose(rest, used - k as u32))
            .sum();
        (done / ways).clamp(0.0, 1.0)
    };
    values
        .windows(2)
        .map(|w| (w[1] - w[0]) * (1.0 - at_most(w[0])))
        .sum()
}

/// `n` choose `k` as a float (0 when k > n).
fn choose(n: u32, k: u32) -> f64 {
    if k > n {
        return 0.0;
    }
    let k = k.min(n - k);
    (0..k).fold(1.0, |acc, i| acc * f64::from(n - i) / f64::from(i + 1))
}

fn binomial_pmf(n: u32, k: u32, p: f64) -> f64 {
    let p = p.clamp(0.0, 1.0);
    choose(n, k) * p.powi(k as i32) * (1.0 - p).powi((n - k) as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(owned: u32, per_expert_s: f64) -> OwnerLayer {
        OwnerLayer {
            owned,
            per_expert_s,
            per_miss_s: 0.0,
            miss_share: 0.0,
            contact_s: 0.0,
        }
    }

    /// The same expectation by brute force: every set of `used` experts of `n`, every pattern
    /// of misses among them.
    fn brute(n: u32, used: u32, owners: &[OwnerLayer]) -> f64 {
        let mut total = 0.0;
        let mut sets = 0.0;
        for mask in 0u64..(1 << n) {
            if mask.count_ones() != used {
                continue;
            }
            sets += 1.0;
            // Which owner each expert belongs to, in order.
            let mut routed = vec![0u32; owners.len()];
            let mut first = 0;
            for (i, o) in owners.iter().enumerate() {
                for e in first..first + o.owned {
                    if mask & (1 << e) != 0 {
                        routed[i] += 1;
                    }
                }
                first += o.owned;
            }
            let n_routed: u32 = routed.iter().sum();
            let mut expect = 0.0;
            for misses in 0u64..(1 << n_routed) {
                let mut slowest: f64 = 0.0;
                let mut p = 1.0;
                let mut bit = 0;
                for (i, o) in owners.iter().enumerate() {
                    let mut missed = 0;
                    for _ in 0..routed[i] {
                        if misses & (1 << bit) != 0 {
                            missed += 1;
                            p *= o.miss_share;
                        } else {
                            p *= 1.0 - o.miss_share;
                        }
                        bit += 1;
                    }
                    slowest = slowest.max(o.time(routed[i], missed));
                }
                expect += p * slowest;
            }
            total += expect;
        }
        total / sets
    }

    #[test]
    fn agrees_with_enumerating_every_routing_and_every_miss() {
        let home = OwnerLayer {
            owned: 4,
            per_expert_s: 1.0,
            per_miss_s: 7.0,
            miss_share: 0.4,
            contact_s: 0.0,
        };
        let remote = OwnerLayer {
            owned: 5,
            per_expert_s: 0.5,
            per_miss_s: 5.0,
            miss_share: 0.2,
            contact_s: 3.0,
        };
        let third = OwnerLayer {
            owned: 2,
            contact_s: 2.5,
            ..owner(2, 1.5)
        };
        for (n, used, owners) in [
            (12, 3, vec![home, remote, third]),
            (11, 4, vec![home, remote, third]),
            (9, 2, vec![home, remote]),
            (6, 6, vec![owner(3, 1.0), owner(3, 2.0)]),
        ] {
            let fast = expected_slowest(n, used, &owners);
            let slow = brute(n, used, &owners);
            assert!(
                (fast - slow).abs() < 1e-9 * slow,
                "{n} {used}: {fast} vs {slow}"
            );
        }
    }

    #[test]
    fn the_slowest_owner_waits_more_than_the_slowest_mean() {
        // Two owners of 32 experts each, 8 of 64 a token, both reading every routed expert.
        let streaming = OwnerLayer {
            owned: 32,
            per_expert_s: 0.0,
            per_miss_s: 1.0,
            miss_share: 1.0,
            contact_s: 0.0,
        };
        let e = expected_slowest(64, 8, &[streaming, streaming]);
        // Each reads 4 on average; the slower of the two reads more.
        assert!(e > 4.5 && e < 8.0, "{e}");
        // One owner of everything: exactly its mean.
        let all = OwnerLayer {
            owned: 64,
            ..streaming
        };
        assert!((expected_slowest(64, 8, &[all]) - 8.0).abs() < 1e-9);
        // Misses by chance on one owner: its mean number of reads, no more.
        let half = OwnerLayer {
            miss_share: 0.5,
            ..all
        };
        assert!((expected_slowest(64, 8, &[half]) - 4.0).abs() < 1e-9);
    }

    #[test]
    fn an_owner_costs_its_round_trip_only_when_the_token_needs_it() {
        // 1 of 10 experts a token; the remote owns 2 of them: contacted a fifth of the time.
        let remote = OwnerLayer {
            contact_s: 5.0,
            ..owner(2, 1.0)
        };
        let e = expected_slowest(10, 1, &[owner(8, 1.0), remote]);
        assert!((e - (0.8 * 1.0 + 0.2 * 6.0)).abs() < 1e-12, "{e}");
    }
}
