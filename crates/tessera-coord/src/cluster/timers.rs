//! The cluster's timers: a table keyed by kind (the lease clock, each run's five timers, its
//! placement deadline). Re-arming a key replaces it, so the table holds at most one entry per
//! key however many tokens a run streams.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use crate::run::TimerKind;

/// Which timer: at most one armed per key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum TimerKey {
    /// The membership's lease clock: a `Tick` four times per lease.
    Lease,
    /// One of run `.0`'s timers, by [`TimerKind`] (as an index).
    Run(u64, u8),
    /// Run `.0` waiting for its first cell.
    Placement(u64),
}

pub(super) fn kind_index(k: TimerKind) -> u8 {
    match k {
        TimerKind::Open => 0,
        TimerKind::Step => 1,
        TimerKind::LossGrace => 2,
        TimerKind::Resume => 3,
        TimerKind::Close => 4,
    }
}

pub(super) const RUN_TIMER_KINDS: [TimerKind; 5] = [
    TimerKind::Open,
    TimerKind::Step,
    TimerKind::LossGrace,
    TimerKind::Resume,
    TimerKind::Close,
];

/// Armed timers, by key, with an index by deadline.
#[derive(Debug, Default)]
pub(super) struct TimerTable {
    armed: HashMap<TimerKey, (Duration, u64)>,
    by_time: BTreeSet<(Duration, TimerKey)>,
}

impl TimerTable {
    /// Arms `key` at `at` with arming number `n`, replacing whatever it held.
    pub(super) fn arm(&mut self, key: TimerKey, at: Duration, n: u64) {
        if let Some((old, _)) = self.armed.insert(key, (at, n)) {
            self.by_time.remove(&(old, key));
        }
        self.by_time.insert((at, key));
    }

    pub(super) fn disarm(&mut self, key: TimerKey) {
        if let Some((at, _)) = self.armed.remove(&key) {
            self.by_time.remove(&(at, key));
        }
    }

    pub(super) fn next(&self) -> Option<Duration> {
        self.by_time.first().map(|(t, _)| *t)
    }

    /// Takes the earliest timer due at `now`.
    pub(super) fn pop_due(&mut self, now: Duration) -> Option<(TimerKey, u64)> {
        let &(at, key) = self.by_time.first()?;
        if at > now {
            return None;
        }
        self.by_time.remove(&(at, key));
        let (_, n) = self.armed.remove(&key).expect("indexed timers are armed");
        Some((key, n))
    }

    pub(super) fn len(&self) -> usize {
        self.armed.len()
    }
}
