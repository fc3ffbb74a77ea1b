//! The worker's replay guard: an authenticated envelope runs at most once. A retry carries the same
//! job id with a higher attempt (the coordinator re-dispatched it after a lease expired) and is
//! admitted; the same id and attempt again is a replay and refused, as is an envelope past its
//! expiry.
//!
//! Memory is bounded by expiry: an entry is needed only until its envelope expires (after that
//! the expiry check refuses it anyway), so [`ReplayGuard::admit`] forgets expired entries, the
//! guard refuses expiries further ahead than `max_ttl`, and at `capacity` unexpired entries it
//! refuses new ones rather than forget one early. No clock inside: `now` is passed in.

use std::collections::{BTreeMap, BTreeSet};

use crate::envelope::{JobHeader, JobId};
use crate::error::ReplayRefusal;
use crate::UnixMillis;

/// Remembers opened (job, attempt) pairs until they expire.
#[derive(Debug, Clone)]
pub struct ReplayGuard {
    max_ttl_ms: u64,
    capacity: usize,
    seen: BTreeMap<(JobId, u32), UnixMillis>,
    by_expiry: BTreeSet<(UnixMillis, JobId, u32)>,
}

impl ReplayGuard {
    /// A guard accepting expiries up to `max_ttl_ms` ahead and remembering at most `capacity`
    /// unexpired jobs.
    pub fn new(max_ttl_ms: u64, capacity: usize) -> Self {
        Self {
            max_ttl_ms,
            capacity: capacity.max(1),
            seen: BTreeMap::new(),
            by_expiry: BTreeSet::new(),
        }
    }

    /// Checks an authenticated header (call after [`crate::JobEnvelope::open`] succeeded, so an
    /// unauthenticated header never takes a slot) and records it. `Ok` means: run it.
    pub fn admit(&mut self, h: &JobHeader, now: UnixMillis) -> Result<(), ReplayRefusal> {
        self.forget_expired(now);
        if h.expires_at <= now {
            return Err(ReplayRefusal::Expired {
                job: h.job,
                attempt: h.attempt,
                expires_at: h.expires_at,
                now,
            });
        }
        if self.seen.contains_key(&(h.job, h.attempt)) {
            return Err(ReplayRefusal::Replayed {
                job: h.job,
                attempt: h.attempt,
            });
        }
        let ttl_ms = h.expires_at.0 - now.0;
        if ttl_ms > self.max_ttl_ms {
            return Err(ReplayRefusal::TtlTooLong {
                job: h.job,
                ttl_ms,
                max_ttl_ms: self.max_ttl_ms,
            });
        }
        if self.seen.len() >= self.capacity {
            return Err(ReplayRefusal::Full {
                capacity: self.capacity,
            });
        }
        self.seen.insert((h.job, h.attempt), h.expires_at);
        self.by_expiry.insert((h.expires_at, h.job, h.attempt));
        Ok(())
    }

    /// Takes back an entry a previous run recorded (a worker's seen-file after a restart), so
    /// a replay across the restart is still refused. Expired entries are dropped; at capacity,
    /// the entry is not taken (false) and the caller must refuse new work rather than forget.
    pub fn restore(
        &mut self,
        job: JobId,
        attempt: u32,
        expires_at: UnixMillis,
        now: UnixMillis,
    ) -> bool {
        self.forget_expired(now);
        if expires_at <= now || self.seen.contains_key(&(job, attempt)) {
            return true;
        }
        if self.seen.len() >= self.capacity {
            return false;
        }
        self.seen.insert((job, attempt), expires_at);
        self.by_expiry.insert((expires_at, job, attempt));
        true
    }

    /// The unexpired entries, as (job, attempt, expiry): what a worker writes down to refuse
    /// replays after a restart.
    pub fn entries(&self) -> impl Iterator<Item = (JobId, u32, UnixMillis)> + '_ {
        self.seen.iter().map(|(&(j, a), &e)| (j, a, e))
    }

    /// Entries held (unexpired as of the last call).
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    fn forget_expired(&mut self, now: UnixMillis) {
        while let Some(&(at, job, attempt)) = self.by_expiry.first() {
            if at > now {
                break;
            }
            self.by_expiry.pop_first();
            self.seen.remove(&(job, attempt));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::SecretKey;

    fn header(job: u8, attempt: u32, expires: u64) -> JobHeader {
        let k = SecretKey::derive(b"k");
        JobHeader {
            job: JobId::from_bytes([job; 16]),
            attempt,
            recipient: k.key_id(),
            model: "m".into(),
            context_tokens: 1,
            expires_at: UnixMillis(expires),
            reply_to: k.public_key(),
        }
    }

    #[test]
    fn a_replayed_envelope_is_refused_and_a_retry_admitted() {
        let mut g = ReplayGuard::new(60_000, 100);
        let now = UnixMillis(1_000);
        g.admit(&header(1, 1, 10_000), now).unwrap();
        assert_eq!(
            g.admit(&header(1, 1, 10_000), now),
            Err(ReplayRefusal::Replayed {
                job: JobId::from_bytes([1; 16]),
                attempt: 1
            })
        );
        g.admit(&header(1, 2, 10_000), now).unwrap();
    }

    #[test]
    fn an_expired_envelope_is_refused() {
        let mut g = ReplayGuard::new(60_000, 100);
        let err = g
            .admit(&header(1, 1, 5_000), UnixMillis(5_000))
            .unwrap_err();
        assert!(matches!(err, ReplayRefusal::Expired { .. }), "{err}");
        assert!(g.is_empty());
    }

    #[test]
    fn entries_are_forgotten_once_expired_so_memory_stays_bounded() {
        let mut g = ReplayGuard::new(10_000, 1_000);
        for i in 0..200u64 {
            let now = UnixMillis(i * 1_000);
            let mut h = header(0, 1, now.0 + 5_000);
            h.job = JobId::from_bytes((i as u128).to_be_bytes());
            g.admit(&h, now).unwrap();
            assert!(g.len() <= 5, "{} entries at step {i}", g.len());
        }
    }

    #[test]
    fn a_full_guard_refuses_rather_than_forget_unexpired_entries() {
        let mut g = ReplayGuard::new(60_000, 2);
        let now = UnixMillis(0);
        g.admit(&header(1, 1, 9_000), now).unwrap();
        g.admit(&header(2, 1, 9_000), now).unwrap();
        assert_eq!(
            g.admit(&header(3, 1, 9_000), now),
            Err(ReplayRefusal::Full { capacity: 2 })
        );
        // The first is still refused as a replay.
        assert!(matches!(
            g.admit(&header(1, 1, 9_000), now),
            Err(ReplayRefusal::Replayed { .. })
        ));
        // Once they expire, room returns.
        g.admit(&header(3, 1, 20_000), UnixMillis(9_000)).unwrap();
    }

    #[test]
    fn a_guard_restored_from_its_entries_refuses_the_same_replays() {
        let mut g = ReplayGuard::new(60_000, 100);
        g.admit(&header(1, 1, 10_000), UnixMillis(1_000)).unwrap();
        g.admit(&header(2, 1, 3_000), UnixMillis(1_000)).unwrap();
        let saved: Vec<_> = g.entries().collect();
        // A restart at 5 s: job 2 has expired, job 1 has not.
        let mut again = ReplayGuard::new(60_000, 100);
        for (j, a, e) in saved {
            assert!(again.restore(j, a, e, UnixMillis(5_000)));
        }
        assert_eq!(again.len(), 1);
        assert!(matches!(
            again.admit(&header(1, 1, 10_000), UnixMillis(5_000)),
            Err(ReplayRefusal::Replayed { .. })
        ));
    }

    #[test]
    fn an_expiry_beyond_the_guards_memory_is_refused() {
        let mut g = ReplayGuard::new(10_000, 10);
        let err = g.admit(&header(1, 1, 50_000), UnixMillis(0)).unwrap_err();
        assert_eq!(
            err,
            ReplayRefusal::TtlTooLong {
                job: JobId::from_bytes([1; 16]),
                ttl_ms: 50_000,
                max_ttl_ms: 10_000
            }
        );
    }
}
