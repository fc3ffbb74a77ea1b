//! Per-direction counters: atomics that the relay and delivery tasks bump (relaxed) as
//! datagrams enter, leave or are dropped, and the snapshots readers get ([`DirectionStats`],
//! [`LinkStats`], through [`LinkHandle::stats`](crate::LinkHandle::stats)).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one direction (monotonic since start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectionStats {
    /// Datagrams that entered the emulator in this direction.
    pub packets_in: u64,
    /// Their bytes.
    pub bytes_in: u64,
    /// Datagrams sent on towards their destination.
    pub packets_out: u64,
    /// Their bytes.
    pub bytes_out: u64,
    /// Dropped by random loss.
    pub dropped_loss: u64,
    /// Dropped because the bandwidth queue (or the delay line,
    /// [`MAX_IN_FLIGHT_BYTES`](crate::MAX_IN_FLIGHT_BYTES)) was full.
    pub dropped_queue: u64,
    /// Dropped by a partition.
    pub dropped_partition: u64,
    /// Dropped because sending failed (destination gone, too many associations).
    pub dropped_other: u64,
}

impl DirectionStats {
    /// All drops.
    pub fn dropped(&self) -> u64 {
        self.dropped_loss + self.dropped_queue + self.dropped_partition + self.dropped_other
    }
}

/// Counters of both directions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Client → upstream.
    pub to_upstream: DirectionStats,
    /// Upstream → client.
    pub to_client: DirectionStats,
    /// Associations opened since start (one per client source address, reopened after idling).
    pub associations: u64,
}

impl fmt::Display for LinkStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, d) in [
            ("to upstream", &self.to_upstream),
            ("to client", &self.to_client),
        ] {
            writeln!(
                f,
                "{name}: {} pkts / {} B in, {} pkts / {} B out, dropped {} (loss {}, queue {}, \
                 partition {}, other {})",
                d.packets_in,
                d.bytes_in,
                d.packets_out,
                d.bytes_out,
                d.dropped(),
                d.dropped_loss,
                d.dropped_queue,
                d.dropped_partition,
                d.dropped_other
            )?;
        }
        write!(f, "associations: {}", self.associations)
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) packets_in: AtomicU64,
    pub(crate) bytes_in: AtomicU64,
    pub(crate) packets_out: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
    pub(crate) dropped_loss: AtomicU64,
    pub(crate) dropped_queue: AtomicU64,
    pub(crate) dropped_partition: AtomicU64,
    pub(crate) dropped_other: AtomicU64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> DirectionStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DirectionStats {
            packets_in: g(&self.packets_in),
            bytes_in: g(&self.bytes_in),
            packets_out: g(&self.packets_out),
            bytes_out: g(&self.bytes_out),
            dropped_loss: g(&self.dropped_loss),
            dropped_queue: g(&self.dropped_queue),
            dropped_partition: g(&self.dropped_partition),
            dropped_other: g(&self.dropped_other),
        }
    }
}

pub(crate) fn bump(a: &AtomicU64, n: usize) {
    a.fetch_add(n as u64, Ordering::Relaxed);
}
