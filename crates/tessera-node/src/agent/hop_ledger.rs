//! The hop ledger: the stage thread's account, per sequence, of where its decode frames spent
//! their time in the fabric's software on this node ([`HopTimes`]): encoding and handing a
//! frame to QUIC on the way out; decoding it on the reader task and handing it to the stage
//! thread on the way in. Wall-clock stamps of each write and each read let a same-host
//! observer (the lab) subtract one stage's sends from the next stage's arrivals: the time in
//! between is QUIC, the kernel, the link and the reader task's wake-up.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_proto::{HopTimes, StepEntry};

/// Wall-clock now, ns since the UNIX epoch (wrapping into u64: only sums' differences matter).
pub(super) fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// How a frame from the previous stage arrived: stamped by the reader task.
#[derive(Clone, Copy, Debug)]
pub(super) struct Arrival {
    /// When the frame had been read (wall clock, ns).
    pub read_wall_ns: u64,
    /// Time spent decoding it.
    pub decode: Duration,
    /// When it was handed to the stage thread.
    pub queued: Instant,
}

impl Arrival {
    /// Stamps a frame read just now, decoded by `decode`.
    pub(super) fn stamp<T>(decode: impl FnOnce() -> T) -> (T, Self) {
        let read_wall_ns = wall_ns();
        let t = Instant::now();
        let out = decode();
        let decode = t.elapsed();
        (
            out,
            Self {
                read_wall_ns,
                decode,
                queued: Instant::now(),
            },
        )
    }
}

/// Whether a hidden-state frame is a decode frame: one token for every sequence in it.
pub(super) fn is_decode(entries: &[StepEntry]) -> bool {
    entries.iter().all(|e| e.n_tokens == 1)
}

#[derive(Default)]
pub(super) struct HopLedger {
    per_seq: HashMap<u64, HopTimes>,
}

fn ns(d: Duration) -> u64 {
    d.as_nanos() as u64
}

impl HopLedger {
    /// A decode frame carrying `seqs` left: encoded in `encode`, written in `send`, the write
    /// starting at wall-clock `wall_ns`.
    pub(super) fn sent(&mut self, seqs: &[u64], encode: Duration, send: Duration, wall_ns: u64) {
        let k = seqs.len().max(1) as u64;
        for &seq in seqs {
            let h = self.per_seq.entry(seq).or_default();
            h.frames_out += 1;
            h.encode_ns += ns(encode) / k;
            h.send_ns += ns(send) / k;
            h.sent_wall_ns = h.sent_wall_ns.wrapping_add(wall_ns);
        }
    }

    /// A decode frame carrying `seqs` that arrived as `a` was taken by the stage thread at
    /// `taken`.
    pub(super) fn arrived(&mut self, seqs: &[u64], a: &Arrival, taken: Instant) {
        let k = seqs.len().max(1) as u64;
        for &seq in seqs {
            let h = self.per_seq.entry(seq).or_default();
            h.frames_in += 1;
            h.decode_ns += ns(a.decode) / k;
            h.handoff_ns += ns(taken.saturating_duration_since(a.queued)) / k;
            h.arrived_wall_ns = h.arrived_wall_ns.wrapping_add(a.read_wall_ns);
        }
    }

    /// A closed sequence's account (empty if none of its frames crossed a hop here).
    pub(super) fn take(&mut self, seq: u64) -> HopTimes {
        self.per_seq.remove(&seq).unwrap_or_default()
    }

    /// Forgets every sequence (the stage was released or replaced).
    pub(super) fn clear(&mut self) {
        self.per_seq.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_frame_splits_its_times_and_stamps_add_with_wrap_around() {
        let mut l = HopLedger::default();
        let ms = Duration::from_millis;
        l.sent(&[1, 2], ms(2), ms(4), u64::MAX);
        l.sent(&[1], ms(1), ms(1), 10);
        let now = Instant::now();
        let a = Arrival {
            read_wall_ns: 5,
            decode: ms(3),
            queued: now,
        };
        l.arrived(&[1], &a, now + ms(7));
        let one = l.take(1);
        assert_eq!((one.frames_out, one.frames_in), (2, 1));
        assert_eq!(one.encode_ns, 2_000_000);
        assert_eq!(one.send_ns, 3_000_000);
        assert_eq!(one.sent_wall_ns, 9, "u64::MAX + 10 wraps to 9");
        assert_eq!((one.decode_ns, one.handoff_ns), (3_000_000, 7_000_000));
        assert_eq!(one.arrived_wall_ns, 5);
        let two = l.take(2);
        assert_eq!((two.frames_out, two.encode_ns), (1, 1_000_000));
        assert_eq!(l.take(2), HopTimes::default(), "taken once");
    }

    #[test]
    fn only_frames_of_one_token_per_sequence_are_decode_frames() {
        let e = |n_tokens| StepEntry {
            seq: 1,
            start_pos: 0,
            n_tokens,
            flags: 0,
        };
        assert!(is_decode(&[e(1), e(1)]));
        assert!(!is_decode(&[e(1), e(16)]));
    }
}
