//! The I/O queue: reads queued or running ([`Flight`]), *demand* reads always before *prefetch*
//! reads and those before the cache's *fill* (`fill.rs`), and the reader threads
//! ([`reader_loop`]) that read the queued ranges. Each reader builds (repacks, as a full load
//! does) the matrix it has just read, into a range of the store's slot pool (huge-page slabs;
//! an evicted expert's range when there is one), so an expert's three matrices are built in
//! parallel as they arrive; the reader that completes the third caches the expert. Free heap
//! (the reads' own) is returned to the system when the queues drain.

use std::collections::HashSet;
use std::sync::Arc;

use crate::error::{EngineError, Result};
use crate::kernels::{Matrix, MatrixBytes, WeightBuffer};
use crate::timeline::{Lane, ReadKind, SpanKind};
use crate::weights::Ffn;

use super::cache::Origin;
use super::shared::{lock, Inner, Shared};
use tessera_host::direct_read::RawBuf;

/// Faults a unit test injects into one store's reads: a delay before each read's bytes
/// arrive (a slow disk), and a layer whose reads fail.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct TestFaults {
    pub(crate) delay: std::sync::Mutex<std::time::Duration>,
    pub(crate) failing_layer: std::sync::Mutex<Option<usize>>,
}

#[cfg(test)]
impl TestFaults {
    fn apply(&self, layer: usize, read: std::io::Result<RawBuf>) -> std::io::Result<RawBuf> {
        let delay = *self.delay.lock().unwrap();
        std::thread::sleep(delay);
        if *self.failing_layer.lock().unwrap() == Some(layer) {
            return Err(std::io::Error::other("a fault the test injected"));
        }
        read
    }
}

/// Priority of a queued or running read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Demand,
    Prefetch,
    /// Read into free room of the cache while nothing else is queued (`fill.rs`).
    Fill,
}

/// A read queued or running: its three ranges (gate, up, down) are read by the readers.
pub(super) struct Flight {
    pub(super) kind: Kind,
    /// Ranges handed to readers so far (a read is started once the first one is).
    next_m: usize,
    /// Ranges read (and built) so far.
    done: usize,
    mats: [Option<Matrix>; 3],
    err: Option<String>,
    /// Bytes reserved in the key's LRU (0: none, e.g. a pinned-set read or no room).
    pub(super) reserved: u64,
    /// Bytes of the window this read holds (0: not a window read).
    pub(super) windowed: u64,
    /// A fill read bound for the pinned share (`fill.rs`).
    pub(super) fill_pin: bool,
    /// A prefetch the run-ahead asked for (`ahead.rs`): kept when the router's next guess
    /// replaces the queued prefetches.
    pub(super) ahead: bool,
}

impl Flight {
    pub(super) fn new(kind: Kind, reserved: u64) -> Self {
        Self {
            kind,
            next_m: 0,
            done: 0,
            mats: [None, None, None],
            err: None,
            reserved,
            windowed: 0,
            fill_pin: false,
            ahead: false,
        }
    }

    fn started(&self) -> bool {
        self.next_m > 0
    }

    /// Why it is read, as a timeline tells it.
    fn read_kind(&self) -> ReadKind {
        match self.kind {
            Kind::Demand => ReadKind::Demand,
            Kind::Prefetch if self.ahead => ReadKind::RunAhead,
            Kind::Prefetch => ReadKind::Prefetch,
            Kind::Fill => ReadKind::Fill,
        }
    }

    /// Bytes of its matrices built so far.
    pub(super) fn built_bytes(&self) -> u64 {
        self.mats
            .iter()
            .flatten()
            .map(|m| m.allocated_bytes() as u64)
            .sum()
    }
}

impl Shared {
    /// Queues a demand read of `key` unless it is resident or already being read; a queued
    /// prefetch or fill read of it is promoted. With `ahead`, reads only into room the LRU can
    /// make (a computation looking it up later reads it anyway). Whether a read was queued or
    /// promoted.
    pub(super) fn queue_demand(&self, inner: &mut Inner, key: (usize, usize), ahead: bool) -> bool {
        if inner.pinned.contains_key(&key)
            || inner.orphans.contains_key(&key)
            || inner.parts[self.part(key.0)].entries.contains_key(&key)
        {
            return false;
        }
        if let Some(fl) = inner.inflight.get_mut(&key) {
            if fl.kind != Kind::Demand && !fl.started() {
                if fl.kind == Kind::Fill {
                    inner
                        .fill
                        .end(fl, self.src[self.layers.index(key.0)].packed);
                    inner.fill.queue.retain(|k| *k != key);
                } else {
                    inner.prefetch_q.retain(|k| *k != key);
                }
                fl.kind = Kind::Demand;
                inner.demand_q.push_back(key);
                return true;
            }
            return false;
        }
        let bytes = self.src[self.layers.index(key.0)].packed;
        let part = self.part(key.0);
        let to_pin = inner.pin_wanted.contains(&key)
            && inner.pinned_bytes + bytes + self.pin_reserved(inner) <= self.cfg.pinned_cap;
        let reserved = if to_pin {
            0
        } else {
            let keep = inner.needed.clone();
            if inner.parts[part].make_room(bytes, &keep) {
                inner.parts[part].reserved += bytes;
                bytes
            } else if ahead {
                return false;
            } else {
                0
            }
        };
        inner
            .inflight
            .insert(key, Flight::new(Kind::Demand, reserved));
        inner.demand_q.push_back(key);
        true
    }

    /// Touches the experts of `ranked` (most probable first) already resident, so that reads
    /// evict other experts first, then queues prefetch reads of those neither resident nor being
    /// read: at most `max`, none below `min_prob`, each into room its layer's LRU makes (sparing
    /// the needed and the touched ones); `ahead` marks the run-ahead's. The number queued.
    pub(super) fn queue_prefetches(
        &self,
        inner: &mut Inner,
        layer: usize,
        ranked: &[(usize, f32)],
        max: usize,
        min_prob: f32,
        ahead: bool,
    ) -> usize {
        inner.tick += 1;
        let tick = inner.tick;
        let part = self.part(layer);
        let mut keep = HashSet::new();
        for &(e, _) in ranked {
            let key = (layer, e);
            if inner.pinned.contains_key(&key) || inner.inflight.contains_key(&key) {
                inner.stats.prefetch_resident += 1;
            } else if let Some(en) = inner.parts[part].entries.get_mut(&key) {
                en.last = tick;
                inner.stats.prefetch_resident += 1;
                keep.insert(key);
            }
        }
        let bytes = self.src[self.layers.index(layer)].packed;
        let mut n = 0;
        for &(e, p) in ranked {
            if n >= max || p < min_prob {
                break;
            }
            let key = (layer, e);
            if inner.pinned.contains_key(&key)
                || inner.orphans.contains_key(&key)
                || inner.parts[part].entries.contains_key(&key)
                || inner.inflight.contains_key(&key)
            {
                continue;
            }
            let to_pin = inner.pin_wanted.contains(&key)
                && inner.pinned_bytes + bytes + self.pin_reserved(inner) <= self.cfg.pinned_cap;
            let reserved = if to_pin {
                0
            } else {
                let mut spared = inner.needed.clone();
                spared.extend(keep.iter().copied());
                if !inner.parts[part].make_room(bytes, &spared) {
                    break;
                }
                inner.parts[part].reserved += bytes;
                bytes
            };
            let mut flight = Flight::new(Kind::Prefetch, reserved);
            flight.ahead = ahead;
            inner.inflight.insert(key, flight);
            inner.prefetch_q.push_back(key);
            n += 1;
        }
        n
    }

    /// Drops the queued prefetches not started yet of layers up to `layer`, but for the
    /// run-ahead's with `spare_ahead`.
    pub(super) fn drop_queued_prefetches(
        &self,
        inner: &mut Inner,
        layer: usize,
        spare_ahead: bool,
    ) {
        let q = std::mem::take(&mut inner.prefetch_q);
        for key in q {
            let (started, ahead) = inner
                .inflight
                .get(&key)
                .map_or((false, false), |f| (f.started(), f.ahead));
            if key.0 <= layer && !started && !(spare_ahead && ahead) {
                if let Some(fl) = inner.inflight.remove(&key) {
                    let part = self.part(key.0);
                    inner.parts[part].reserved -= fl.reserved;
                    inner.stats.prefetch_dropped += 1;
                    // A computation waiting for it (another thread's) looks again.
                    self.notify_ready();
                }
            } else {
                inner.prefetch_q.push_back(key);
            }
        }
    }

    /// The next range to read, `(key, m)`: demand reads first, then prefetches, then the fill.
    fn next_range(&self, inner: &mut Inner) -> Option<((usize, usize), usize)> {
        if inner.demand_q.is_empty() && inner.prefetch_q.is_empty() && inner.fill.queue.is_empty() {
            self.start_fill(inner);
        }
        let key = *inner
            .demand_q
            .front()
            .or(inner.prefetch_q.front())
            .or(inner.fill.queue.front())?;
        let fl = inner
            .inflight
            .get_mut(&key)
            .expect("queued reads are in flight");
        let m = fl.next_m;
        fl.next_m += 1;
        if fl.next_m == 3 {
            if inner.demand_q.front() == Some(&key) {
                inner.demand_q.pop_front();
            } else if inner.prefetch_q.front() == Some(&key) {
                inner.prefetch_q.pop_front();
            } else {
                inner.fill.queue.pop_front();
            }
        }
        Some((key, m))
    }

    /// Completes a read: caches the built expert (or keeps it for its waiter).
    fn complete(
        &self,
        inner: &mut Inner,
        key: (usize, usize),
        mut fl: Flight,
        read: Result<(Ffn, u64)>,
    ) {
        let part = self.part(key.0);
        inner.parts[part].reserved -= fl.reserved;
        let to_pin = fl.fill_pin;
        if fl.kind == Kind::Fill {
            inner
                .fill
                .end(&mut fl, self.src[self.layers.index(key.0)].packed);
        }
        match read {
            Ok((ffn, bytes)) => {
                inner.stats.bytes_read += bytes;
                let ffn = Arc::new(ffn);
                let origin = match fl.kind {
                    Kind::Demand => {
                        inner.stats.miss_bytes_read += bytes;
                        Origin::Demanded
                    }
                    Kind::Prefetch => {
                        inner.stats.prefetch_issued += 1;
                        Origin::Prefetched
                    }
                    // In memory before anything asked for it: its lookups are hits.
                    Kind::Fill => {
                        inner.stats.filled += 1;
                        Origin::Used
                    }
                };
                let inserted = if fl.kind == Kind::Fill {
                    self.insert_filled(inner, key, &ffn, to_pin)
                } else {
                    self.insert(inner, key, &ffn, origin)
                };
                if inserted {
                    inner.window_used -= fl.windowed;
                } else if fl.kind == Kind::Demand {
                    inner.orphans.insert(key, ffn);
                    if fl.windowed > 0 {
                        inner.orphan_window.insert(key, fl.windowed);
                    }
                } else {
                    inner.window_used -= fl.windowed;
                }
            }
            Err(e) => {
                inner.window_used -= fl.windowed;
                if fl.kind == Kind::Demand {
                    inner.failed.insert(key, e.to_string());
                }
            }
        }
    }

    /// The file offset and length of range `m` (gate, up, down) of expert `e` of `layer`.
    fn range(&self, layer: usize, e: usize, m: usize) -> (u64, u64) {
        let ms = &self.src[self.layers.index(layer)].mats[m];
        (ms.base + ms.len * e as u64, ms.len)
    }

    /// Builds (repacks) matrix `m` of expert `e` of `layer` from its bytes, into `buf` (a
    /// range of the store's slot pool), as a full load does.
    fn build(
        &self,
        layer: usize,
        e: usize,
        m: usize,
        raw: RawBuf,
        buf: WeightBuffer,
    ) -> Result<Matrix> {
        let ms = &self.src[self.layers.index(layer)].mats[m];
        let (offset, len) = (raw.start, raw.len);
        let bytes = MatrixBytes::Shared {
            bytes: Arc::new(raw),
            offset,
            len,
        };
        Matrix::new_in(ms.dtype, ms.rows, ms.cols, bytes, buf).map_err(|err| EngineError::Tensor {
            tensor: format!("blk.{layer} expert {e}"),
            what: err.to_string(),
        })
    }

    /// Bytes of the built matrix `m` of `layer`'s experts.
    fn built_len(&self, layer: usize, m: usize) -> usize {
        let ms = &self.src[self.layers.index(layer)].mats[m];
        Matrix::packed_len(ms.dtype, ms.rows, ms.cols).unwrap_or(0)
    }
}

/// A reader: reads queued ranges (demand reads first) until the store is dropped, and builds
/// each matrix it reads (while the computation goes on) into the store's slot pool; the reader
/// that builds an expert's third matrix caches the expert. Free heap is returned to the system
/// whenever the queues drain.
pub(super) fn reader_loop(sh: &Shared, n: usize) {
    let mut inner = lock(&sh.inner);
    loop {
        if inner.stop {
            return;
        }
        let Some((key, m)) = sh.next_range(&mut inner) else {
            inner = sh.work.wait(inner).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        // The build's target, counted from now until the matrix joins its read (peak.rs): a
        // range an evicted expert gave back leaves the pool's free bytes at the same moment.
        let target = sh.built_len(key.0, m);
        let reused = sh.slots.lend_free(target);
        inner.building += target as u64;
        if reused.is_none() {
            // New memory: the pool's free ranges beyond the bound go first.
            sh.note_peak(&mut inner);
        }
        let why = inner
            .inflight
            .get(&key)
            .map_or(ReadKind::Demand, Flight::read_kind);
        let t_read = std::time::Instant::now();
        if inner.reading == 0 {
            inner.busy_since = Some(t_read);
        }
        inner.reading += 1;
        drop(inner);
        // Outside the lock: a new range is zeroed (faulted in) here.
        let buf = reused.unwrap_or_else(|| sh.slots.carve(target));
        let (off, len) = sh.range(key.0, key.1, m);
        let span = sh.timeline.begin();
        let read = sh.reader.read_range(off, len);
        #[cfg(test)]
        let read = sh.faults.apply(key.0, read);
        let (layer, expert, matrix) = (key.0, key.1, m);
        let kind = SpanKind::Read {
            layer,
            expert,
            matrix,
            why,
        };
        sh.timeline.end(span, Lane::Reader(n), kind);
        let t_built = std::time::Instant::now();
        inner = lock(&sh.inner);
        inner.stats.read_us += (t_built - t_read).as_micros() as u64;
        inner.reading -= 1;
        if inner.reading == 0 {
            if let Some(t0) = inner.busy_since.take() {
                inner.stats.disk_busy_us += (t_built - t0).as_micros() as u64;
            }
        }
        // The most this read holds at once: its raw bytes and its build target.
        sh.note_peak(&mut inner);
        drop(inner);
        let span = sh.timeline.begin();
        let built = match read {
            Ok(raw) => sh
                .build(key.0, key.1, m, raw, buf)
                .map_err(|e| e.to_string()),
            Err(e) => Err(format!("read failed: {e}")),
        };
        let kind = SpanKind::Build {
            layer,
            expert,
            matrix,
        };
        sh.timeline.end(span, Lane::Reader(n), kind);
        let build_us = t_built.elapsed().as_micros() as u64;
        inner = lock(&sh.inner);
        inner.stats.build_us += build_us;
        inner.building -= target as u64;
        let fl = inner.inflight.get_mut(&key).expect("a read in flight");
        match built {
            Ok(mat) => fl.mats[m] = Some(mat),
            Err(e) => fl.err = Some(e),
        }
        fl.done += 1;
        if fl.done < 3 {
            continue;
        }
        // The read stays in flight (waiters wait) until cached.
        let mut fl = inner.inflight.remove(&key).expect("a read in flight");
        let read = match (fl.err.take(), std::mem::take(&mut fl.mats)) {
            (None, [Some(gate), Some(up), Some(down)]) => {
                let bytes = (0..3).map(|m| sh.range(key.0, key.1, m).1).sum();
                Ok((Ffn { gate, up, down }, bytes))
            }
            (err, _) => Err(EngineError::Tensor {
                tensor: format!("blk.{} expert {}", key.0, key.1),
                what: err.unwrap_or_else(|| "a matrix is missing".into()),
            }),
        };
        sh.complete(&mut inner, key, fl, read);
        sh.notify_ready();
        if inner.demand_q.is_empty()
            && inner.prefetch_q.is_empty()
            && inner.inflight.is_empty()
            && inner.fill.finished()
            && inner.trimmed_at.is_none_or(|t| t.elapsed() >= TRIM_EVERY)
        {
            inner.trimmed_at = Some(std::time::Instant::now());
            drop(inner);
            trim_heap();
            inner = lock(&sh.inner);
        }
    }
}

/// Returns free heap memory to the OS once more than [`TRIM_SLACK`] bytes of it are held (glibc
/// keeps the freed holes of an arena resident otherwise; trimming after every read would make
/// the next builds fault their pages in again). Called when the queues drain, at most every
/// [`TRIM_EVERY`]: a decode drains them several times a token, and each call walked the
/// arenas' free lists (`mallinfo2`) and unmapped pages (TLB shootdowns interrupting the
/// computing threads): ~9% of a streamed decode's step where the disk is fast and the queues
/// drain often (none measurable under a slow disk's cap).
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallinfo2 and malloc_trim have no preconditions.
    unsafe {
        if libc::mallinfo2().fordblks > TRIM_SLACK {
            libc::malloc_trim(0);
        }
    }
}

/// Least time between two [`trim_heap`] calls of a store's readers.
const TRIM_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// Free heap bytes kept before [`trim_heap`] returns them.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_SLACK: usize = 16 << 20;
