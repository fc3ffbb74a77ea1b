//! The impairment model of one direction: partition, then seeded loss, then the bandwidth
//! queue (a token bucket whose burst is one datagram, tail-dropping what would exceed
//! `queue_bytes`), then `delay ± jitter`, never reordering. [`Shaper::decide`] gives each
//! datagram a [`Verdict`]. It takes the current time as an argument and touches no socket or
//! timer, so the tests below drive it directly; its random draws come from a SplitMix64
//! generator seeded per association and direction from the link's seed ([`derive_seed`]).

use std::time::Duration;

use tokio::time::Instant;

use crate::shape::{Direction, Impairment, LinkShape};

pub(crate) fn derive_seed(seed: u64, association: u64, dir: Direction) -> u64 {
    let mut r = SplitMix64(seed ^ association.wrapping_mul(0xA076_1D64_78BD_642F));
    r.next_u64() ^ (dir.index() as u64 + 1).wrapping_mul(0xE703_7ED1_A0B4_28DB)
}

/// SplitMix64: small, fast, seedable; statistically fine for drop decisions.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What the shaping decided for one datagram.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// The link is partitioned.
    Partition,
    /// Dropped by the seeded loss draw.
    Loss,
    /// The bandwidth queue would exceed its bound.
    QueueFull,
    /// Deliver at this time.
    Deliver(Instant),
}

/// The deterministic part of one direction: loss draws, the bandwidth queue, delay and jitter.
#[derive(Debug)]
pub struct Shaper {
    rng: SplitMix64,
    /// When the bandwidth queue will have sent everything accepted so far.
    busy_until: Instant,
    /// Delivery time of the previous datagram (no reordering).
    last_delivery: Instant,
}

impl Shaper {
    /// A shaper whose loss and jitter draws start from `seed`, idle at `now`.
    pub fn new(seed: u64, now: Instant) -> Self {
        Self {
            rng: SplitMix64(seed),
            busy_until: now,
            last_delivery: now,
        }
    }

    /// The verdict for a datagram of `len` bytes offered at `now`, shaped by `imp` (the
    /// direction's impairment) unless `shape` is partitioned.
    pub fn decide(
        &mut self,
        shape: &LinkShape,
        imp: &Impairment,
        len: usize,
        now: Instant,
    ) -> Verdict {
        if shape.partitioned {
            return Verdict::Partition;
        }
        if imp.loss > 0.0 && self.rng.next_f64() < imp.loss {
            return Verdict::Loss;
        }
        let leave = match imp.bandwidth {
            None => now,
            Some(rate) => {
                let start = self.busy_until.max(now);
                let backlog = (start - now).as_secs_f64() * rate as f64;
                if backlog + len as f64 > imp.queue_bytes.max(len) as f64 {
                    return Verdict::QueueFull;
                }
                self.busy_until = start + Duration::from_secs_f64(len as f64 / rate as f64);
                self.busy_until
            }
        };
        let mut delay = imp.delay;
        if !imp.jitter.is_zero() {
            // Uniform in [delay - jitter, delay + jitter], floored at zero.
            let j = imp.jitter.as_secs_f64() * (2.0 * self.rng.next_f64() - 1.0);
            delay = Duration::from_secs_f64((delay.as_secs_f64() + j).max(0.0));
        }
        let at = (leave + delay).max(self.last_delivery);
        self.last_delivery = at;
        Verdict::Deliver(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which of `n` datagrams are lost.
    fn losses(seed: u64, imp: &Impairment, n: usize) -> Vec<bool> {
        let now = Instant::now();
        let shape = LinkShape::symmetric(*imp);
        let mut s = Shaper::new(seed, now);
        (0..n)
            .map(|_| s.decide(&shape, imp, 100, now) == Verdict::Loss)
            .collect()
    }

    #[test]
    fn loss_is_seeded_and_close_to_the_fraction() {
        let imp = Impairment::default().loss(0.2);
        let a = losses(42, &imp, 10_000);
        let b = losses(42, &imp, 10_000);
        let c = losses(43, &imp, 10_000);
        assert!(a == b, "same seed, same drops");
        assert!(a != c, "another seed, other drops");
        let lost = a.iter().filter(|&&l| l).count() as f64 / 10_000.0;
        assert!((lost - 0.2).abs() < 0.02, "lost fraction {lost}");
    }

    #[test]
    fn bandwidth_queue_serialises_and_tail_drops() {
        // 1000 B/s, queue of 300 B, 100 B datagrams all at once: 3 fit (the first leaves at
        // 0.1 s, the third at 0.3 s), the rest are dropped.
        let imp = Impairment::default().bandwidth(1000).queue_bytes(300);
        let now = Instant::now();
        let shape = LinkShape::symmetric(imp);
        let mut s = Shaper::new(1, now);
        let v: Vec<_> = (0..5).map(|_| s.decide(&shape, &imp, 100, now)).collect();
        let ms = |d: Verdict| match d {
            Verdict::Deliver(at) => (at - now).as_millis(),
            other => panic!("{other:?}"),
        };
        assert_eq!(ms(v[0]), 100);
        assert_eq!(ms(v[1]), 200);
        assert_eq!(ms(v[2]), 300);
        assert_eq!(v[3], Verdict::QueueFull);
        assert_eq!(v[4], Verdict::QueueFull);
        // Later, the queue has drained.
        let later = now + Duration::from_secs(1);
        assert_eq!(
            s.decide(&shape, &imp, 100, later),
            Verdict::Deliver(later + Duration::from_millis(100))
        );
    }

    #[test]
    fn delay_and_jitter_never_reorder() {
        let imp = Impairment::default()
            .delay(Duration::from_millis(50))
            .jitter(Duration::from_millis(40));
        let now = Instant::now();
        let shape = LinkShape::symmetric(imp);
        let mut s = Shaper::new(9, now);
        let mut last = now;
        for i in 0..1000u64 {
            let t = now + Duration::from_micros(i * 100);
            let Verdict::Deliver(at) = s.decide(&shape, &imp, 10, t) else {
                panic!("no loss configured");
            };
            assert!(at >= last);
            assert!(at >= t + Duration::from_millis(10) && at <= t + Duration::from_millis(90));
            last = at;
        }
    }

    #[test]
    fn partition_wins_over_everything() {
        let imp = Impairment::default();
        let shape = LinkShape::symmetric(imp).partitioned(true);
        let now = Instant::now();
        let mut s = Shaper::new(0, now);
        assert_eq!(s.decide(&shape, &imp, 1, now), Verdict::Partition);
    }
}
