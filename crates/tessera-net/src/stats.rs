//! Byte accounting per connection and per stream kind.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

#[derive(Debug, Default)]
struct Counter {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    frames_sent: AtomicU64,
    frames_received: AtomicU64,
}

impl Counter {
    fn snapshot(&self) -> Traffic {
        Traffic {
            bytes_sent: self.bytes_sent.load(Relaxed),
            bytes_received: self.bytes_received.load(Relaxed),
            frames_sent: self.frames_sent.load(Relaxed),
            frames_received: self.frames_received.load(Relaxed),
        }
    }
}

/// Frame traffic: bytes (headers included) and frames, each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Traffic {
    /// Frame bytes written (headers included).
    pub bytes_sent: u64,
    /// Frame bytes read (headers included).
    pub bytes_received: u64,
    /// Frames written.
    pub frames_sent: u64,
    /// Frames read.
    pub frames_received: u64,
}

/// A point-in-time view of one connection's traffic, for metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConnectionStats {
    /// All frame traffic on the connection.
    pub frames: Traffic,
    /// Frame traffic by stream kind (the kind given to `open_stream`).
    pub by_stream_kind: BTreeMap<u16, Traffic>,
    /// UDP payload bytes sent, QUIC and TLS overhead and retransmissions included.
    pub udp_bytes_sent: u64,
    /// UDP payload bytes received.
    pub udp_bytes_received: u64,
    /// Packets declared lost by QUIC.
    pub lost_packets: u64,
    /// QUIC's current smoothed round-trip estimate, microseconds.
    pub path_rtt_us: u64,
}

#[derive(Debug, Default)]
struct Inner {
    total: Counter,
    by_kind: Mutex<BTreeMap<u16, Arc<Counter>>>,
}

/// Shared counters of one connection; cheap to clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct ByteCounters {
    inner: Arc<Inner>,
}

impl ByteCounters {
    pub(crate) fn stream(&self, kind: u16) -> StreamCounters {
        let mut m = self.inner.by_kind.lock().unwrap_or_else(|p| p.into_inner());
        let kind = m.entry(kind).or_default().clone();
        StreamCounters {
            conn: self.inner.clone(),
            kind,
        }
    }

    pub(crate) fn snapshot(&self) -> (Traffic, BTreeMap<u16, Traffic>) {
        let m = self.inner.by_kind.lock().unwrap_or_else(|p| p.into_inner());
        (
            self.inner.total.snapshot(),
            m.iter().map(|(k, c)| (*k, c.snapshot())).collect(),
        )
    }
}

/// The counters one stream updates: its connection's total and its kind's.
#[derive(Debug, Clone)]
pub(crate) struct StreamCounters {
    conn: Arc<Inner>,
    kind: Arc<Counter>,
}

impl StreamCounters {
    pub(crate) fn sent(&self, bytes: usize) {
        for c in [&self.conn.total, &*self.kind] {
            c.bytes_sent.fetch_add(bytes as u64, Relaxed);
            c.frames_sent.fetch_add(1, Relaxed);
        }
    }

    pub(crate) fn received(&self, bytes: usize) {
        for c in [&self.conn.total, &*self.kind] {
            c.bytes_received.fetch_add(bytes as u64, Relaxed);
            c.frames_received.fetch_add(1, Relaxed);
        }
    }
}
