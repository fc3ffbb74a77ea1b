//! A timeline of a streamed decode (`tessera bench --timeline`): when each forward pass ran,
//! when it waited for an expert's read, when it ran the layers ahead meanwhile, and when each
//! reader read and built which matrix. It shows what a step's figures only sum up: whether the
//! disk idles while the computation goes on, and where (between steps, before a token's first
//! miss, after its last read).
//!
//! Recorded by the expert store ([`crate::ExpertStore::start_timeline`]); off otherwise, where
//! each point that could record costs one relaxed load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use serde::Serialize;

/// Most spans one recording keeps (about 50 MiB); later ones are counted, not kept.
const MAX_SPANS: usize = 1 << 20;

/// What a span of the timeline was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "what")]
pub enum SpanKind {
    /// A forward pass over the model's layers, of `rows` rows (one a sequence when decoding).
    Step { rows: usize },
    /// The computation waiting for an expert's read.
    Wait { layer: usize, expert: usize },
    /// The run-ahead's estimate while a step waited at `layer`: layers up to `to` (not
    /// included) estimated (see `crate::run_ahead`).
    RunAhead { layer: usize, to: usize },
    /// A reader reading matrix `matrix` (0 gate, 1 up, 2 down) of an expert, for `why`.
    Read {
        layer: usize,
        expert: usize,
        matrix: usize,
        why: ReadKind,
    },
    /// A reader building (repacking) the matrix it read.
    Build {
        layer: usize,
        expert: usize,
        matrix: usize,
    },
}

/// Why an expert was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadKind {
    /// A routing needed it.
    Demand,
    /// The router's early guess of the next layer.
    Prefetch,
    /// The run-ahead's estimate routed to it.
    RunAhead,
    /// Filling the cache's free room.
    Fill,
}

/// Which thread a span ran on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    /// The computing thread.
    Compute,
    /// The store's reader thread number `n`.
    Reader(usize),
}

/// One span: microseconds from the recording's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TimelineSpan {
    #[serde(flatten)]
    pub kind: SpanKind,
    pub lane: Lane,
    pub start_us: u64,
    pub dur_us: u64,
}

/// A recording's spans, in the order they ended, and how many more there were.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TimelineRecord {
    pub spans: Vec<TimelineSpan>,
    pub dropped: u64,
}

/// The recorder (see the module doc).
pub(crate) struct Timeline {
    on: AtomicBool,
    rec: Mutex<(Instant, TimelineRecord)>,
}

impl Timeline {
    pub(crate) fn new() -> Self {
        Self {
            on: AtomicBool::new(false),
            rec: Mutex::new((Instant::now(), TimelineRecord::default())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, (Instant, TimelineRecord)> {
        self.rec.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a recording (what an earlier one kept is dropped).
    pub(crate) fn start(&self) {
        *self.lock() = (Instant::now(), TimelineRecord::default());
        self.on.store(true, Ordering::Release);
    }

    /// Stops recording and returns what it kept.
    pub(crate) fn stop(&self) -> TimelineRecord {
        self.on.store(false, Ordering::Release);
        std::mem::take(&mut self.lock().1)
    }

    /// When a span begins, while recording (else nothing is measured).
    pub(crate) fn begin(&self) -> Option<Instant> {
        self.on.load(Ordering::Relaxed).then(Instant::now)
    }

    /// Records the span begun at `begun` (if it was, and the recording goes on) as ending now.
    pub(crate) fn end(&self, begun: Option<Instant>, lane: Lane, kind: SpanKind) {
        let Some(begun) = begun.filter(|_| self.on.load(Ordering::Relaxed)) else {
            return;
        };
        let end = Instant::now();
        let mut rec = self.lock();
        let (t0, rec) = &mut *rec;
        if rec.spans.len() >= MAX_SPANS {
            rec.dropped += 1;
            return;
        }
        rec.spans.push(TimelineSpan {
            kind,
            lane,
            start_us: begun.saturating_duration_since(*t0).as_micros() as u64,
            dur_us: end.saturating_duration_since(begun).as_micros() as u64,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_recording_keeps_spans_and_a_new_one_starts_empty() {
        let t = Timeline::new();
        let step = SpanKind::Step { rows: 1 };
        assert!(t.begin().is_none());
        t.start();
        let before_stop = t.begin();
        assert!(t.stop().spans.is_empty());
        t.end(before_stop, Lane::Compute, step);
        t.start();
        assert!(
            t.stop().spans.is_empty(),
            "a span ending after its recording is not kept"
        );
        t.start();
        let b = t.begin();
        assert!(b.is_some());
        t.end(b, Lane::Reader(2), step);
        let rec = t.stop();
        assert_eq!(rec.spans.len(), 1);
        assert_eq!(rec.spans[0].lane, Lane::Reader(2));
        assert!(t.begin().is_none(), "stopped");
        let json = serde_json::to_value(rec.spans[0]).unwrap();
        assert_eq!(json["what"], "step");
        assert_eq!(json["rows"], 1);
    }
}
