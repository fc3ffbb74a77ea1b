//! Expert streaming: serving more MoE experts than fit in memory.
//!
//! When a part must serve experts whose weights exceed its memory budget, the experts are not
//! loaded at load time. An [`ExpertStore`] keeps a RAM cache of built experts within
//! [`ExpertStreaming::budget_bytes`] and reads misses from the GGUF file:
//!
//! - **Reads**: positioned reads (`pread`) of the expert's three contiguous byte ranges into
//!   owned buffers, repacked by [`Matrix::new`] exactly as a full load repacks them, so the
//!   kernels see the same bytes and outputs are bit-identical. The expert tensors are never
//!   touched through the file mapping, so no file page is counted in the resident set, and
//!   (by default) `posix_fadvise(DONTNEED)` drops the pages from the page cache after each read,
//!   so a later miss really goes to the disk and the page cache does not grow.
//! - **Cache**: a pinned hot set (a share of the budget, learned from observed routing counts:
//!   every [`ExpertStreaming::repin_every`] tokens the most used experts over all layers are
//!   chosen, and are kept once loaded) plus an LRU per layer for the rest of the budget (one LRU
//!   shared by all layers when the budget cannot give every layer one expert). Experts in use by
//!   a computation are never evicted; `moe_experts` computes a layer's experts in chunks no larger
//!   than the layer's LRU, so the built experts alive never exceed the budget.
//! - **Prefetch**: while layer `l` computes, a background I/O thread loads the experts predicted
//!   for layer `l + 1`: layer `l + 1`'s router applied early to the current hidden state (normed
//!   with layer `l + 1`'s FFN norm); parts without routers fall back to the experts layer `l + 1`
//!   used last. The predictor's accuracy is measured against the routing that follows.
//!
//! [`ExpertStats`] counts hits, misses, bytes read, prefetches and the pinned set.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};
use tessera_model::config::names;
use tessera_model::{GgmlType, GgufFile, ModelConfig};

use crate::error::{EngineError, Result};
use crate::kernels::{Matrix, MatrixBytes};
use crate::weights::{Ffn, LoadSpec};

/// How a part streams its experts (see the module doc).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertStreaming {
    /// Bytes of built (repacked) experts kept in memory at most.
    pub budget_bytes: u64,
    /// Share of the budget given to the pinned hot set (0 disables pinning).
    pub pinned_fraction: f64,
    /// Tokens between re-learning the pinned set from routing counts.
    pub repin_every: u64,
    /// Prefetch the next layer's predicted experts on a background thread.
    pub prefetch: bool,
    /// Drop read pages from the page cache (`posix_fadvise(DONTNEED)`) after each read.
    pub drop_page_cache: bool,
    /// Misses of one layer read at once by up to this many threads (disks serve several
    /// outstanding reads faster than one).
    pub read_parallelism: usize,
}

impl ExpertStreaming {
    /// Defaults: a quarter of the budget pinned, re-learned every 16 tokens, prefetch on, page
    /// cache dropped, up to 4 misses read at once.
    pub fn with_budget(budget_bytes: u64) -> Self {
        Self {
            budget_bytes,
            pinned_fraction: 0.25,
            repin_every: 16,
            prefetch: true,
            drop_page_cache: true,
            read_parallelism: 4,
        }
    }
}

/// Counters of an [`ExpertStore`] (cumulative since load).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExpertStats {
    pub budget_bytes: u64,
    /// Built bytes of the largest expert.
    pub expert_bytes: u64,
    /// Experts the store may serve.
    pub experts_served: u64,
    /// Whether each layer has its own LRU (else one is shared by all layers).
    pub per_layer_lru: bool,
    /// Expert lookups by computations: `hits + misses`.
    pub lookups: u64,
    /// Lookups served from memory (pinned, cached, or prefetched, possibly after waiting for an
    /// in-flight prefetch).
    pub hits: u64,
    /// Lookups read from disk by the computing thread.
    pub misses: u64,
    /// Lookups that waited for a prefetch already reading the expert.
    pub inflight_waits: u64,
    /// Bytes read from the file (misses and prefetches).
    pub bytes_read: u64,
    /// Bytes read by misses (on the computing thread's critical path).
    pub miss_bytes_read: u64,
    /// Experts read by the prefetch thread.
    pub prefetch_issued: u64,
    /// Prefetched experts later used by a computation before being evicted.
    pub prefetch_useful: u64,
    /// Predicted experts already resident (nothing to read).
    pub prefetch_resident: u64,
    /// Predictions made for a layer, and how many of the predicted experts the layer then used.
    pub predicted: u64,
    pub predicted_used: u64,
    /// Distinct experts layers used where a prediction had been made (recall denominator).
    pub used_after_prediction: u64,
    pub pinned_experts: u64,
    pub pinned_bytes: u64,
    pub cached_experts: u64,
    pub cached_bytes: u64,
    /// Token routings observed (at the first held layer).
    pub tokens: u64,
}

impl ExpertStats {
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / self.lookups.max(1) as f64
    }

    /// Share of predicted experts the layer then used.
    pub fn prediction_precision(&self) -> f64 {
        self.predicted_used as f64 / self.predicted.max(1) as f64
    }

    /// Share of used experts that had been predicted.
    pub fn prediction_recall(&self) -> f64 {
        self.predicted_used as f64 / self.used_after_prediction.max(1) as f64
    }

    /// Share of prefetched reads that were used.
    pub fn prefetch_accuracy(&self) -> f64 {
        self.prefetch_useful as f64 / self.prefetch_issued.max(1) as f64
    }
}

/// Where one expert matrix lies in the file.
#[derive(Clone, Copy, Debug)]
struct MatSrc {
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    /// Offset of expert 0; expert `e` starts at `base + e * len`.
    base: u64,
    len: u64,
}

#[derive(Clone, Copy, Debug)]
struct LayerSrc {
    /// gate, up, down.
    mats: [MatSrc; 3],
    /// Built bytes of one expert of this layer.
    packed: u64,
}

struct Entry {
    ffn: Arc<Ffn>,
    bytes: u64,
    last: u64,
    /// Loaded by prefetch and not yet used.
    prefetched: bool,
}

#[derive(Default)]
struct Lru {
    cap: u64,
    bytes: u64,
    entries: HashMap<(usize, usize), Entry>,
}

impl Lru {
    /// Evicts least recently used entries not in use until `need` more bytes fit.
    fn make_room(&mut self, need: u64) -> bool {
        while self.bytes + need > self.cap {
            let victim = self
                .entries
                .iter()
                .filter(|(_, v)| Arc::strong_count(&v.ffn) == 1)
                .min_by_key(|(_, v)| v.last)
                .map(|(k, _)| *k);
            let Some(k) = victim else { return false };
            let v = self.entries.remove(&k).expect("present");
            self.bytes -= v.bytes;
        }
        true
    }
}

struct Inner {
    /// LRU partitions (one per held layer, or one).
    parts: Vec<Lru>,
    pinned: HashMap<(usize, usize), Arc<Ffn>>,
    pinned_bytes: u64,
    pin_wanted: HashSet<(usize, usize)>,
    inflight: HashSet<(usize, usize)>,
    /// `counts[layer - first][e]`: slots routed to the expert.
    counts: Vec<Vec<u64>>,
    /// `last_used[layer - first]`: distinct experts of the layer's last routing.
    last_used: Vec<Vec<usize>>,
    /// `predicted[layer - first]`: the pending prediction for the layer.
    predicted: Vec<Option<Vec<usize>>>,
    tick: u64,
    since_repin: u64,
    stats: ExpertStats,
}

struct Shared {
    file: File,
    cfg: Settings,
    layers: std::ops::Range<usize>,
    src: Vec<LayerSrc>,
    inner: Mutex<Inner>,
    ready: Condvar,
    /// Layer the computation is in (prefetches for earlier layers are stale).
    current_layer: AtomicUsize,
}

#[derive(Clone, Debug)]
struct Settings {
    streaming: ExpertStreaming,
    pinned_cap: u64,
    per_layer: bool,
}

/// The RAM cache of streamed experts and its prefetch thread (see the module doc).
pub struct ExpertStore {
    shared: Arc<Shared>,
    tx: Option<Sender<(usize, Vec<usize>)>>,
    io: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ExpertStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStore")
            .field("settings", &self.shared.cfg)
            .finish()
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(h) = self.io.take() {
            let _ = h.join();
        }
    }
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ExpertStore {
    /// Prepares streaming of the experts `spec` selects in its layers; reads no expert bytes.
    /// Errors if the budget cannot hold one expert.
    pub fn open(
        g: &GgufFile,
        config: &ModelConfig,
        spec: &LoadSpec,
        streaming: ExpertStreaming,
    ) -> Result<Self> {
        let n_expert = config.n_expert;
        let mut src = Vec::with_capacity(spec.layers.len());
        let mut served = 0u64;
        for il in spec.layers.clone() {
            let mut mats = Vec::with_capacity(3);
            for w in [
                "ffn_gate_exps.weight",
                "ffn_up_exps.weight",
                "ffn_down_exps.weight",
            ] {
                let name = names::layer(il, w);
                let info = g.require_tensor(&name)?;
                let dtype = info.dtype(g.path())?;
                let bad = |what: String| EngineError::Tensor {
                    tensor: name.clone(),
                    what,
                };
                let [cols, rows, n] = info.shape[..] else {
                    return Err(bad(format!(
                        "shape {:?} is not a stack of expert matrices",
                        info.shape
                    )));
                };
                if n as usize != n_expert || info.n_bytes % n != 0 {
                    return Err(bad(format!(
                        "does not hold {n_expert} equal expert matrices"
                    )));
                }
                mats.push(MatSrc {
                    dtype,
                    rows: rows as usize,
                    cols: cols as usize,
                    base: info.offset,
                    len: info.n_bytes / n,
                });
            }
            let mats: [MatSrc; 3] = mats.try_into().expect("three matrices");
            let mut packed = 0u64;
            for m in &mats {
                packed += Matrix::packed_len(m.dtype, m.rows, m.cols).ok_or_else(|| {
                    EngineError::Tensor {
                        tensor: names::layer(il, "ffn_*_exps.weight"),
                        what: format!("{} matrix {}x{} is not valid", m.dtype, m.rows, m.cols),
                    }
                })? as u64;
            }
            served += (0..n_expert).filter(|&e| spec.experts.holds(il, e)).count() as u64;
            src.push(LayerSrc { mats, packed });
        }
        let expert_bytes = src.iter().map(|s| s.packed).max().unwrap_or(0);
        let budget = streaming.budget_bytes;
        if budget < expert_bytes {
            return Err(EngineError::BadInput(format!(
                "expert budget of {budget} bytes is smaller than one expert ({expert_bytes} bytes)"
            )));
        }
        let n_layers = src.len().max(1) as u64;
        // Split the budget: pinned share, then an LRU per layer if each gets one expert.
        let pinned_try = ((budget as f64) * streaming.pinned_fraction.clamp(0.0, 1.0)) as u64;
        let (pinned_cap, per_layer) = if (budget - pinned_try) / n_layers >= expert_bytes {
            (pinned_try, true)
        } else if budget / n_layers >= expert_bytes {
            (0, true)
        } else {
            (0, false)
        };
        let lru_total = budget - pinned_cap;
        let parts = if per_layer {
            (0..n_layers)
                .map(|_| Lru {
                    cap: lru_total / n_layers,
                    ..Lru::default()
                })
                .collect()
        } else {
            vec![Lru {
                cap: lru_total,
                ..Lru::default()
            }]
        };
        let file = File::open(g.path()).map_err(|e| EngineError::Tensor {
            tensor: "experts".into(),
            what: format!("cannot open {}: {e}", g.path().display()),
        })?;
        let nl = src.len();
        let inner = Inner {
            parts,
            pinned: HashMap::new(),
            pinned_bytes: 0,
            pin_wanted: HashSet::new(),
            inflight: HashSet::new(),
            counts: vec![vec![0; n_expert]; nl],
            last_used: vec![Vec::new(); nl],
            predicted: vec![None; nl],
            tick: 0,
            since_repin: 0,
            stats: ExpertStats {
                budget_bytes: budget,
                expert_bytes,
                experts_served: served,
                per_layer_lru: per_layer,
                ..ExpertStats::default()
            },
        };
        let prefetch = streaming.prefetch;
        let shared = Arc::new(Shared {
            file,
            cfg: Settings {
                streaming,
                pinned_cap,
                per_layer,
            },
            layers: spec.layers.clone(),
            src,
            inner: Mutex::new(inner),
            ready: Condvar::new(),
            current_layer: AtomicUsize::new(0),
        });
        let (tx, io) = if prefetch {
            let (tx, rx) = mpsc::channel();
            let sh = Arc::clone(&shared);
            let h = std::thread::Builder::new()
                .name("tessera-expert-io".into())
                .spawn(move || io_loop(&sh, &rx))
                .map_err(|e| EngineError::BadInput(format!("cannot start the I/O thread: {e}")))?;
            (Some(tx), Some(h))
        } else {
            (None, None)
        };
        Ok(Self { shared, tx, io })
    }

    /// Whether the next layer's experts are prefetched.
    pub fn prefetching(&self) -> bool {
        self.tx.is_some()
    }

    /// Current counters.
    pub fn stats(&self) -> ExpertStats {
        let inner = lock(&self.shared.inner);
        let mut s = inner.stats.clone();
        s.pinned_experts = inner.pinned.len() as u64;
        s.pinned_bytes = inner.pinned_bytes;
        s.cached_experts = inner.parts.iter().map(|p| p.entries.len() as u64).sum();
        s.cached_bytes = inner.parts.iter().map(|p| p.bytes).sum();
        s
    }

    /// Bytes of built experts held now (pinned and cached).
    pub fn resident_bytes(&self) -> u64 {
        let inner = lock(&self.shared.inner);
        inner.pinned_bytes + inner.parts.iter().map(|p| p.bytes).sum::<u64>()
    }

    /// How many experts of `layer` may be held at once by one computation.
    pub(crate) fn chunk_limit(&self, layer: usize) -> usize {
        let sh = &self.shared;
        let inner = lock(&sh.inner);
        let per = sh.src[layer - sh.layers.start].packed.max(1);
        (inner.parts[sh.part(layer)].cap / per).max(1) as usize
    }

    /// Records the experts a layer's routing uses (`slots`: every slot's expert), learning the
    /// pinned set and scoring the pending prediction.
    pub(crate) fn observe(&self, layer: usize, n_tokens: usize, slots: &[u32]) {
        let sh = &self.shared;
        sh.current_layer.store(layer, Ordering::Relaxed);
        let li = layer - sh.layers.start;
        let mut inner = lock(&sh.inner);
        for &e in slots {
            if let Some(c) = inner.counts[li].get_mut(e as usize) {
                *c += 1;
            }
        }
        let mut used: Vec<usize> = slots.iter().map(|&e| e as usize).collect();
        used.sort_unstable();
        used.dedup();
        if let Some(pred) = inner.predicted[li].take() {
            let hit = pred
                .iter()
                .filter(|e| used.binary_search(e).is_ok())
                .count();
            inner.stats.predicted += pred.len() as u64;
            inner.stats.predicted_used += hit as u64;
            inner.stats.used_after_prediction += used.len() as u64;
        }
        inner.last_used[li] = used;
        if li == 0 {
            inner.stats.tokens += n_tokens as u64;
            inner.since_repin += n_tokens as u64;
            if sh.cfg.pinned_cap > 0 && inner.since_repin >= sh.cfg.streaming.repin_every {
                inner.since_repin = 0;
                sh.repin(&mut inner);
            }
        }
    }

    /// The experts layer `layer` used last (a prediction for parts without routers).
    pub(crate) fn last_used(&self, layer: usize) -> Vec<usize> {
        let sh = &self.shared;
        if !sh.layers.contains(&layer) {
            return Vec::new();
        }
        lock(&sh.inner).last_used[layer - sh.layers.start].clone()
    }

    /// Asks the I/O thread to load `experts` of `layer` (a prediction; recorded for accuracy).
    pub(crate) fn prefetch(&self, layer: usize, experts: Vec<usize>) {
        let sh = &self.shared;
        if !sh.layers.contains(&layer) || experts.is_empty() {
            return;
        }
        lock(&sh.inner).predicted[layer - sh.layers.start] = Some(experts.clone());
        if let Some(tx) = &self.tx {
            let _ = tx.send((layer, experts));
        }
    }

    /// Expert `e` of `layer`, from memory or read from disk now. The returned handle keeps the
    /// expert from being evicted until dropped.
    pub(crate) fn get(&self, layer: usize, e: usize) -> Result<Arc<Ffn>> {
        let sh = &self.shared;
        let key = (layer, e);
        let mut inner = lock(&sh.inner);
        loop {
            match sh.lookup(&mut inner, key) {
                Lookup::Hit(f) => return Ok(f),
                Lookup::InFlight => {
                    inner.stats.inflight_waits += 1;
                    while inner.inflight.contains(&key) {
                        inner = sh.ready.wait(inner).unwrap_or_else(|p| p.into_inner());
                    }
                }
                Lookup::Absent => break,
            }
        }
        inner.stats.lookups += 1;
        inner.stats.misses += 1;
        inner.inflight.insert(key);
        drop(inner);
        let read = sh.read_expert(layer, e);
        let mut inner = lock(&sh.inner);
        sh.finish_miss(&mut inner, key, read)
    }

    /// Experts `experts` of `layer` (in that order), as [`ExpertStore::get`], with the misses
    /// read by up to [`ExpertStreaming::read_parallelism`] threads at once.
    pub(crate) fn get_many(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<Ffn>>> {
        let sh = &self.shared;
        let mut out: Vec<Option<Arc<Ffn>>> = vec![None; experts.len()];
        let mut misses = Vec::new();
        {
            let mut inner = lock(&sh.inner);
            for (i, &e) in experts.iter().enumerate() {
                match sh.lookup(&mut inner, (layer, e)) {
                    Lookup::Hit(f) => out[i] = Some(f),
                    Lookup::InFlight => {} // waited for below
                    Lookup::Absent => {
                        inner.stats.lookups += 1;
                        inner.stats.misses += 1;
                        inner.inflight.insert((layer, e));
                        misses.push(i);
                    }
                }
            }
        }
        let ids: Vec<usize> = misses.iter().map(|&i| experts[i]).collect();
        let reads: Vec<(usize, Result<(Ffn, u64)>)> = sh
            .read_many(layer, &ids)
            .into_iter()
            .map(|(j, r)| (misses[j], r))
            .collect();
        let mut first_err = None;
        {
            let mut inner = lock(&sh.inner);
            for (i, read) in reads {
                match sh.finish_miss(&mut inner, (layer, experts[i]), read) {
                    Ok(f) => out[i] = Some(f),
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        experts
            .iter()
            .zip(out)
            .map(|(&e, f)| match f {
                Some(f) => Ok(f),
                None => self.get(layer, e),
            })
            .collect()
    }
}

/// What the cache holds for a key.
enum Lookup {
    Hit(Arc<Ffn>),
    InFlight,
    Absent,
}

impl Shared {
    /// Looks `key` up (counting a hit, and a useful prefetch on its first use).
    fn lookup(&self, inner: &mut Inner, key: (usize, usize)) -> Lookup {
        inner.tick += 1;
        let tick = inner.tick;
        if let Some(f) = inner.pinned.get(&key).cloned() {
            inner.stats.lookups += 1;
            inner.stats.hits += 1;
            return Lookup::Hit(f);
        }
        let part = self.part(key.0);
        let found = inner.parts[part].entries.get_mut(&key).map(|en| {
            en.last = tick;
            (Arc::clone(&en.ffn), std::mem::take(&mut en.prefetched))
        });
        if let Some((f, useful)) = found {
            inner.stats.lookups += 1;
            inner.stats.hits += 1;
            inner.stats.prefetch_useful += u64::from(useful);
            if inner.pin_wanted.contains(&key) {
                self.try_pin(inner, key, &f, part);
            }
            return Lookup::Hit(f);
        }
        if inner.inflight.contains(&key) {
            Lookup::InFlight
        } else {
            Lookup::Absent
        }
    }

    /// Completes a miss: clears its in-flight mark, wakes waiters, caches the expert.
    fn finish_miss(
        &self,
        inner: &mut Inner,
        key: (usize, usize),
        read: Result<(Ffn, u64)>,
    ) -> Result<Arc<Ffn>> {
        inner.inflight.remove(&key);
        self.ready.notify_all();
        let (ffn, bytes) = read?;
        inner.stats.bytes_read += bytes;
        inner.stats.miss_bytes_read += bytes;
        let ffn = Arc::new(ffn);
        self.insert(inner, key, &ffn, false);
        Ok(ffn)
    }

    fn part(&self, layer: usize) -> usize {
        if self.cfg.per_layer {
            layer - self.layers.start
        } else {
            0
        }
    }

    /// Reads and builds experts `experts` of `layer`: `(index into experts, result)`, in
    /// completion order.
    fn read_many(&self, layer: usize, experts: &[usize]) -> Vec<(usize, Result<(Ffn, u64)>)> {
        // Raw buffers are allocated here and filled by up to `read_parallelism` reader threads;
        // each expert is built here as soon as its bytes arrive, overlapping the other reads.
        // Building on this thread keeps the long-lived experts in its allocator arena (built on
        // reader threads, freed elsewhere, glibc's per-thread arenas inflated RSS by ~60 MiB).
        let sh = self;
        let n_threads = sh
            .cfg
            .streaming
            .read_parallelism
            .clamp(1, experts.len().max(1));
        let mut reads: Vec<(usize, Result<(Ffn, u64)>)> = Vec::with_capacity(experts.len());
        if n_threads <= 1 {
            for (i, &e) in experts.iter().enumerate() {
                reads.push((i, sh.read_expert(layer, e)));
            }
        } else {
            let mut lanes: Vec<Vec<(usize, [Vec<u8>; 3])>> = vec![Vec::new(); n_threads];
            for i in 0..experts.len() {
                lanes[i % n_threads].push((i, sh.buffers(layer)));
            }
            std::thread::scope(|s| {
                let (tx, rx) = mpsc::channel();
                for lane in lanes {
                    let tx = tx.clone();
                    s.spawn(move || {
                        for (i, mut bufs) in lane {
                            let r = sh.read_raw(layer, experts[i], &mut bufs);
                            if tx.send((i, bufs, r)).is_err() {
                                return;
                            }
                        }
                    });
                }
                drop(tx);
                for (i, bufs, r) in rx {
                    let built = r.and_then(|n| Ok((sh.build(layer, experts[i], bufs)?, n)));
                    reads.push((i, built));
                }
            });
        }
        reads
    }

    /// Reads and builds expert `e` of `layer`; returns it with the bytes read.
    fn read_expert(&self, layer: usize, e: usize) -> Result<(Ffn, u64)> {
        let mut bufs = self.buffers(layer);
        let n = self.read_raw(layer, e, &mut bufs)?;
        Ok((self.build(layer, e, bufs)?, n))
    }

    /// Buffers for the raw bytes of one expert of `layer` (allocated by the caller's thread,
    /// so the long-lived built experts come from the computing thread's allocator arena).
    fn buffers(&self, layer: usize) -> [Vec<u8>; 3] {
        self.src[layer - self.layers.start]
            .mats
            .map(|m| vec![0u8; m.len as usize])
    }

    /// Reads expert `e`'s three matrices into `bufs`; the bytes read.
    fn read_raw(&self, layer: usize, e: usize, bufs: &mut [Vec<u8>; 3]) -> Result<u64> {
        let ls = &self.src[layer - self.layers.start];
        let mut total = 0;
        for (m, buf) in ls.mats.iter().zip(bufs.iter_mut()) {
            let off = m.base + m.len * e as u64;
            read_at(&self.file, buf, off).map_err(|err| EngineError::Tensor {
                tensor: format!("blk.{layer} expert {e}"),
                what: format!("read of {} bytes at {off} failed: {err}", m.len),
            })?;
            if self.cfg.streaming.drop_page_cache {
                drop_pages(&self.file, off, m.len);
            }
            total += m.len;
        }
        Ok(total)
    }

    /// Builds (repacks) an expert from its raw bytes, as a full load does.
    fn build(&self, layer: usize, e: usize, bufs: [Vec<u8>; 3]) -> Result<Ffn> {
        let ls = &self.src[layer - self.layers.start];
        let [g, u, d] = bufs;
        let mat = |m: &MatSrc, buf: Vec<u8>| {
            Matrix::new(m.dtype, m.rows, m.cols, MatrixBytes::Owned(buf)).map_err(|err| {
                EngineError::Tensor {
                    tensor: format!("blk.{layer} expert {e}"),
                    what: err.to_string(),
                }
            })
        };
        Ok(Ffn {
            gate: mat(&ls.mats[0], g)?,
            up: mat(&ls.mats[1], u)?,
            down: mat(&ls.mats[2], d)?,
        })
    }

    /// Puts a freshly read expert into the pinned set (if wanted) or its LRU. Returns false if
    /// no room could be made (the expert then lives only as long as its user holds it).
    fn insert(&self, inner: &mut Inner, key: (usize, usize), ffn: &Arc<Ffn>, pf: bool) -> bool {
        let bytes = self.src[key.0 - self.layers.start].packed;
        if inner.pin_wanted.contains(&key) && inner.pinned_bytes + bytes <= self.cfg.pinned_cap {
            inner.pinned.insert(key, Arc::clone(ffn));
            inner.pinned_bytes += bytes;
            return true;
        }
        inner.tick += 1;
        let tick = inner.tick;
        let lru = &mut inner.parts[self.part(key.0)];
        if !lru.make_room(bytes) {
            return false;
        }
        lru.bytes += bytes;
        lru.entries.insert(
            key,
            Entry {
                ffn: Arc::clone(ffn),
                bytes,
                last: tick,
                prefetched: pf,
            },
        );
        true
    }

    /// Moves a cached expert into the pinned set if there is room.
    fn try_pin(&self, inner: &mut Inner, key: (usize, usize), ffn: &Arc<Ffn>, part: usize) {
        let bytes = self.src[key.0 - self.layers.start].packed;
        if inner.pinned_bytes + bytes > self.cfg.pinned_cap {
            return;
        }
        if let Some(en) = inner.parts[part].entries.remove(&key) {
            inner.parts[part].bytes -= en.bytes;
        }
        inner.pinned.insert(key, Arc::clone(ffn));
        inner.pinned_bytes += bytes;
    }

    /// Re-learns the pinned set: the most used experts over all layers that fit its share.
    fn repin(&self, inner: &mut Inner) {
        let mut all: Vec<(u64, usize, usize)> = Vec::new();
        for (li, c) in inner.counts.iter().enumerate() {
            for (e, &n) in c.iter().enumerate() {
                if n > 0 {
                    all.push((n, li, e));
                }
            }
        }
        all.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut wanted = HashSet::new();
        let mut bytes = 0;
        for (_, li, e) in all {
            let b = self.src[li].packed;
            if bytes + b > self.cfg.pinned_cap {
                break;
            }
            bytes += b;
            wanted.insert((self.layers.start + li, e));
        }
        // Unpin what is no longer wanted; pin what is wanted and already cached.
        let gone: Vec<_> = inner
            .pinned
            .keys()
            .filter(|k| !wanted.contains(k))
            .copied()
            .collect();
        for k in gone {
            inner.pinned.remove(&k);
            inner.pinned_bytes -= self.src[k.0 - self.layers.start].packed;
        }
        for &k in &wanted {
            if inner.pinned.contains_key(&k) {
                continue;
            }
            let part = self.part(k.0);
            if let Some(f) = inner.parts[part]
                .entries
                .get(&k)
                .map(|en| Arc::clone(&en.ffn))
            {
                self.try_pin(inner, k, &f, part);
            }
        }
        inner.pin_wanted = wanted;
    }
}

/// The prefetch thread: loads requested experts, newest request first (older ones are stale).
fn io_loop(sh: &Shared, rx: &Receiver<(usize, Vec<usize>)>) {
    while let Ok(mut req) = rx.recv() {
        while let Ok(newer) = rx.try_recv() {
            req = newer;
        }
        let (layer, experts) = req;
        if sh.current_layer.load(Ordering::Relaxed) > layer {
            continue; // the computation has passed this layer
        }
        // Pick what to read: not resident, not in flight, and only into room that evicting
        // idle entries can make.
        let mut todo = Vec::new();
        {
            let mut inner = lock(&sh.inner);
            let part = sh.part(layer);
            let bytes = sh.src[layer - sh.layers.start].packed;
            let mut room = 0u64;
            for e in experts {
                let key = (layer, e);
                if inner.pinned.contains_key(&key)
                    || inner.parts[part].entries.contains_key(&key)
                    || inner.inflight.contains(&key)
                {
                    inner.stats.prefetch_resident += 1;
                    continue;
                }
                let wanted_pin = inner.pin_wanted.contains(&key)
                    && inner.pinned_bytes + bytes <= sh.cfg.pinned_cap;
                if !wanted_pin {
                    if !inner.parts[part].make_room(room + bytes) {
                        break;
                    }
                    room += bytes;
                }
                inner.inflight.insert(key);
                todo.push(e);
            }
        }
        let reads = sh.read_many(layer, &todo);
        let mut inner = lock(&sh.inner);
        for (i, read) in reads {
            let key = (layer, todo[i]);
            inner.inflight.remove(&key);
            if let Ok((ffn, bytes)) = read {
                inner.stats.bytes_read += bytes;
                inner.stats.prefetch_issued += 1;
                sh.insert(&mut inner, key, &Arc::new(ffn), true);
            }
        }
        sh.ready.notify_all();
        drop(inner);
        trim_heap();
    }
}

/// Returns free heap memory to the OS. Experts built on this thread live in its allocator arena
/// and are freed by the computing thread on eviction; glibc only trims an arena's top, so without
/// this the freed holes stay resident (~20 MiB over a 100 MiB budget in the bench).
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(unix)]
fn read_at(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(buf, off)
}

#[cfg(not(unix))]
fn read_at(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = f.try_clone()?;
    f.seek(SeekFrom::Start(off))?;
    f.read_exact(buf)
}

/// Drops the file's pages in `off..off + len` from the page cache (advice; errors ignored).
#[cfg(unix)]
fn drop_pages(f: &File, off: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is open.
    unsafe {
        libc::posix_fadvise(
            f.as_raw_fd(),
            off as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

#[cfg(not(unix))]
fn drop_pages(_: &File, _: u64, _: u64) {}
