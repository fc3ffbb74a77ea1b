//! Each layer's reuse distances, and the shares of the budget they call for.
//!
//! A layer's share is an LRU (with its pinned part), and what one more expert of room is worth
//! to an LRU is the lookups it would have turned into hits: those whose expert was that many
//! distinct experts back in the layer's recency order. The routing counts the shares followed
//! before gave each layer its most routed experts' worth, the hits a cache holding them for
//! good would get, which an LRU gets only where the layer's popular experts stay popular. On
//! bench-qwen3moe-q4_0 the first two layers' popular experts change as a sequence goes on: at
//! 3× over budget 48 of the 69 experts a 128-token decode waited for were the second layer's,
//! and at 5× the first layer's misses were 3 in 4 of a step's; weighing those layers' counts
//! threefold (a trial) cut both and made the decodes 8% faster. The reuse distances measure
//! what each layer's LRU would hit at each size, so the room goes where it hits most, without
//! a weight chosen by hand (utility-based cache partitioning, Qureshi and Patt, MICRO 2006).
//!
//! A lookup of an expert the layer never routed to before claims no room: an estimate of the
//! unseen routing (Good–Turing's, tried on the counts) moved half the budget between layers on
//! 16 tokens' evidence and lost more to the re-reads than it saved.

/// A layer's recency order and the lookups seen at each depth of it.
#[derive(Clone, Debug, Default)]
pub(super) struct Reuse {
    /// The layer's experts routed to so far, the most recent first.
    order: Vec<usize>,
    /// `hits[d]`: lookups whose expert was `d` distinct experts back (`d = 0`: the last
    /// routing's), since the store opened (forgetting the older ones, three quarters kept at
    /// each re-learning, made no difference at 3× and 5× over budget).
    hits: Vec<f64>,
}

impl Reuse {
    /// A routing of the layer used the distinct experts `used`. Each is looked up where it
    /// stood before this routing (its experts are held together, so none pushes another back),
    /// then all move to the front.
    pub(super) fn observe(&mut self, used: &[usize]) {
        for &e in used {
            if let Some(d) = self.order.iter().position(|&o| o == e) {
                if self.hits.len() <= d {
                    self.hits.resize(d + 1, 0.0);
                }
                self.hits[d] += 1.0;
            }
        }
        self.order.retain(|o| !used.contains(o));
        self.order.splice(0..0, used.iter().copied());
    }

    /// Lookups an LRU holding `slots` of the layer's experts would have hit.
    #[cfg(test)]
    pub(super) fn hits_within(&self, slots: usize) -> f64 {
        self.hits.iter().take(slots).sum()
    }
}

/// Each layer's share of `bytes` in whole experts (`packed[l]` bytes each, at most `held[l]` of
/// them), following the layers' reuse distances: every layer keeps `floor[l]`, and the rest
/// goes, a few experts at a time, to the layer whose next experts of room would have hit the
/// most lookups per byte. A layer's hits by depth need not fall with depth (a routing of eight
/// experts puts its repeats eight deep at once), so each layer offers the run of further
/// experts with the most hits per byte, not just the next one. Room that no hit was seen to
/// want (the first tokens, or a budget past every reuse) goes one expert at a time to the
/// layer holding fewest (then the earlier): even shares with no evidence.
pub(super) fn shares_by_reuse(
    bytes: u64,
    packed: &[u64],
    floor: &[usize],
    held: &[usize],
    reuse: &[Reuse],
) -> Vec<usize> {
    let mut slots: Vec<usize> = floor.iter().zip(held).map(|(&f, &h)| f.min(h)).collect();
    let floor_bytes: u64 = slots.iter().zip(packed).map(|(&s, &p)| s as u64 * p).sum();
    let mut left = bytes.saturating_sub(floor_bytes);
    // A layer's best offer from its current share: (hits per byte, experts).
    let offer = |l: usize, s: usize, left: u64| -> Option<(f64, usize)> {
        let p = packed[l];
        if p == 0 {
            return None;
        }
        let most = (held[l] - s).min((left / p) as usize);
        let hits = &reuse[l].hits;
        let mut sum = 0.0;
        let mut best: Option<(f64, usize)> = None;
        for k in 1..=most {
            sum += hits.get(s + k - 1).copied().unwrap_or(0.0);
            let per_byte = sum / (k as u64 * p) as f64;
            if best.is_none_or(|(b, _)| per_byte > b) {
                best = Some((per_byte, k));
            }
        }
        best
    };
    let mut offers: Vec<Option<(f64, usize)>> =
        (0..slots.len()).map(|l| offer(l, slots[l], left)).collect();
    loop {
        // The best offer with any hits; ties to the layer holding fewest, then the earlier.
        let winner = (0..slots.len())
            .filter_map(|l| offers[l].map(|(v, k)| (l, v, k)))
            .filter(|&(_, v, _)| v > 0.0)
            .max_by(|a, b| {
                a.1.total_cmp(&b.1)
                    .then(slots[b.0].cmp(&slots[a.0]))
                    .then(b.0.cmp(&a.0))
            });
        let (l, k) = match winner {
            Some((l, _, k)) => (l, k),
            None => {
                // No hits left to win: one expert to the layer holding fewest that fits.
                let fits = (0..slots.len())
                    .filter(|&l| slots[l] < held[l] && packed[l] > 0 && packed[l] <= left);
                match fits.min_by_key(|&l| (slots[l], l)) {
                    Some(l) => (l, 1),
                    None => break,
                }
            }
        };
        slots[l] += k;
        left -= k as u64 * packed[l];
        // The winner's offer starts further on. Another's stands while its run still fits: the
        // best of the runs that fit before, it is the best of the fewer that fit now.
        for (m, o) in offers.iter_mut().enumerate() {
            if m == l || o.is_some_and(|(_, k)| k as u64 * packed[m] > left) {
                *o = offer(m, slots[m], left);
            }
        }
    }
    slots
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(routings: &[&[usize]]) -> Reuse {
        let mut r = Reuse::default();
        for u in routings {
            r.observe(u);
        }
        r
    }

    #[test]
    fn a_lookup_counts_at_its_expert_s_depth_before_the_routing() {
        let r = seen(&[&[1, 2], &[3, 4], &[1, 3], &[5, 1]]);
        // [1, 2] then [3, 4]: order 3 4 1 2. [1, 3]: 1 two back, 3 at the front; order
        // 1 3 4 2. [5, 1]: 5 unseen (no depth), 1 at the front.
        assert_eq!(r.hits_within(1), 2.0);
        assert_eq!(r.hits_within(2), 2.0);
        assert_eq!(r.hits_within(3), 3.0);
        assert_eq!(r.hits_within(64), 3.0);
        assert_eq!(r.order, vec![5, 1, 3, 4, 2]);
    }

    #[test]
    fn room_goes_where_an_lru_would_hit_most() {
        // Layer 0 cycles through 6 experts two at a time (every lookup 4 back); layer 1 keeps
        // to 2 (every lookup at the front). 10-byte experts, each layer keeping one.
        let cycle: Vec<Vec<usize>> = (0..30)
            .map(|i| vec![(2 * i) % 6, (2 * i + 1) % 6])
            .collect();
        let a = seen(&cycle.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let b = seen(&[&[0usize, 1][..]; 30]);
        let share =
            |bytes| shares_by_reuse(bytes, &[10; 2], &[1; 2], &[8; 2], &[a.clone(), b.clone()]);
        // Layer 1 first (its second expert hits every lookup it holds); then layer 0 takes
        // the 5 it needs at once (4 of room are worth nothing until the fifth and sixth).
        assert_eq!(share(30), vec![1, 2]);
        assert_eq!(share(80), vec![6, 2]);
        // Less than layer 0's run: its shorter runs hit nothing, so the room stays even.
        assert_eq!(share(60), vec![3, 3]);
        // No evidence: even shares within each layer's experts.
        let none = vec![Reuse::default(); 3];
        assert_eq!(
            shares_by_reuse(90, &[10; 3], &[1; 3], &[2, 8, 8], &none),
            vec![2, 4, 3]
        );
    }

    #[test]
    fn per_byte_a_smaller_expert_is_worth_more() {
        let a = seen(&[&[0usize, 1][..]; 10]);
        // Both layers hit their second expert equally; layer 1's are half the size.
        let shares = shares_by_reuse(15, &[10, 5], &[0, 0], &[2, 2], &[a.clone(), a]);
        assert_eq!(shares, vec![0, 2]);
    }
}
