//! Expert streaming: serving more MoE experts than fit in memory.
//!
//! When a part must serve experts whose weights exceed its memory budget, the experts are not
//! loaded at load time. An [`ExpertStore`] keeps a RAM cache of built experts within
//! [`ExpertStreaming::budget_bytes`] and reads misses from the GGUF file:
//!
//! - **Reads**: positioned reads (`pread`) of the expert's three contiguous byte ranges, repacked
//!   by [`Matrix::new`] exactly as a full load repacks them, so the kernels see the same bytes
//!   and outputs are bit-identical. The expert tensors are never touched through the file
//!   mapping, so no file page is counted in the resident set. With
//!   [`ExpertStreaming::drop_page_cache`] (the default) the page cache is kept out of it: on
//!   Linux the reads use `O_DIRECT` (4 KiB-aligned supersets of the ranges into aligned buffers:
//!   no copy through the page cache, far less CPU per byte), elsewhere, or where the file system
//!   refuses `O_DIRECT`, buffered reads followed by `posix_fadvise(DONTNEED)`. Either way a later
//!   miss really goes to the disk and the page cache does not grow.
//! - **I/O queue**: one I/O thread owns [`ExpertStreaming::read_parallelism`] reader threads and
//!   two queues: *demand* reads (experts a layer's routing needs now) always go before
//!   *prefetch* reads. A layer's misses are all queued as soon as its routing is known
//!   ([`ExpertStore::fetch`]), before any of its experts is computed, so they are read several
//!   at a time (a virtual disk serves several outstanding reads faster than one), and the I/O
//!   thread builds each expert as soon as its bytes arrive. Experts are built on that one thread,
//!   so their memory comes from one allocator arena (it is trimmed when the queue drains).
//! - **Cache**: a pinned hot set (a share of the budget, learned from observed routing counts:
//!   every [`ExpertStreaming::repin_every`] tokens the most used experts over all layers are
//!   chosen, and are kept once loaded) plus an LRU per layer for the rest of the budget (one LRU
//!   shared by all layers when the budget cannot give every layer one expert). A read reserves
//!   its room when it is queued, so reads in flight never push the cache past its share. Experts
//!   in use by a computation, and those the current layer's routing asked for, are never
//!   evicted; `moe_experts` computes a layer's experts in chunks no larger than the layer's LRU,
//!   so the built experts alive never exceed the budget.
//! - **Prefetch**: while layer `l` computes, the experts predicted for layer `l + 1` are read
//!   behind the demand reads: layer `l + 1`'s router applied early to the current hidden state
//!   (normed with layer `l + 1`'s FFN norm) gives each expert a predicted probability; only
//!   the [`ExpertStreaming::prefetch_max`] most probable experts not resident, and only those
//!   with a probability of at least [`ExpertStreaming::prefetch_min_prob`], are read (a wrong
//!   prefetch costs disk time that the demand reads need). Predicted experts already resident
//!   are touched, so the prefetch's own evictions spare them. Prefetches not started when the
//!   computation reaches their layer are dropped (or promoted to demand reads if the routing
//!   asks for them). Parts without routers fall back to the experts layer `l + 1` used last.
//!   The predictor's accuracy is measured against the routing that follows.
//!
//! [`ExpertStats`] counts hits, misses, bytes read, prefetches and the pinned set.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};
use tessera_model::config::names;
use tessera_model::{GgmlType, GgufFile, ModelConfig};

use crate::error::{EngineError, Result};
use crate::kernels::{Matrix, MatrixBytes, ThreadPool};
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
    /// Prefetch the next layer's predicted experts on the I/O thread.
    pub prefetch: bool,
    /// Keep expert reads out of the page cache: `O_DIRECT` where the system allows it, else
    /// `posix_fadvise(DONTNEED)` after each read.
    pub drop_page_cache: bool,
    /// Reads in flight at once (reader threads); a layer's misses are read in parallel.
    pub read_parallelism: usize,
    /// Most experts read ahead for a layer (the most probable predicted ones not resident).
    #[serde(default = "default_prefetch_max")]
    pub prefetch_max: usize,
    /// Least predicted router probability (softmax over all experts) of an expert read ahead.
    #[serde(default = "default_prefetch_min_prob")]
    pub prefetch_min_prob: f32,
}

fn default_prefetch_max() -> usize {
    2
}

fn default_prefetch_min_prob() -> f32 {
    0.05
}

impl ExpertStreaming {
    /// Defaults: a quarter of the budget pinned, re-learned every 16 tokens, prefetch on (at most
    /// 2 experts per layer, predicted probability at least 0.05), page cache bypassed, 4 reads in
    /// flight.
    pub fn with_budget(budget_bytes: u64) -> Self {
        Self {
            budget_bytes,
            pinned_fraction: 0.25,
            repin_every: 16,
            prefetch: true,
            drop_page_cache: true,
            read_parallelism: 4,
            prefetch_max: default_prefetch_max(),
            prefetch_min_prob: default_prefetch_min_prob(),
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
    /// Experts read ahead by prefetch (completed reads).
    pub prefetch_issued: u64,
    /// Prefetched experts later used by a computation before being evicted.
    pub prefetch_useful: u64,
    /// Predicted experts already resident (nothing to read).
    pub prefetch_resident: u64,
    /// Queued prefetches dropped unread: the computation reached their layer first (those the
    /// routing then needed were promoted to demand reads and count as misses).
    #[serde(default)]
    pub prefetch_dropped: u64,
    /// Microseconds computations spent waiting for reads (misses, and prefetches not yet in).
    #[serde(default)]
    pub read_wait_us: u64,
    /// Microseconds spent building (repacking) read experts.
    #[serde(default)]
    pub build_us: u64,
    /// Reads bypass the page cache with `O_DIRECT`.
    #[serde(default)]
    pub direct_io: bool,
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
    /// Adds `other`'s counters to these (for a process holding several streamed models, e.g. a
    /// node's stage and the experts it serves to other stages). Sizes add; flags are or-ed.
    pub fn add(&mut self, other: &Self) {
        self.budget_bytes += other.budget_bytes;
        self.expert_bytes = self.expert_bytes.max(other.expert_bytes);
        self.experts_served += other.experts_served;
        self.per_layer_lru &= other.per_layer_lru;
        self.lookups += other.lookups;
        self.hits += other.hits;
        self.misses += other.misses;
        self.inflight_waits += other.inflight_waits;
        self.bytes_read += other.bytes_read;
        self.miss_bytes_read += other.miss_bytes_read;
        self.prefetch_issued += other.prefetch_issued;
        self.prefetch_useful += other.prefetch_useful;
        self.prefetch_resident += other.prefetch_resident;
        self.prefetch_dropped += other.prefetch_dropped;
        self.direct_io |= other.direct_io;
        self.read_wait_us += other.read_wait_us;
        self.build_us += other.build_us;
        self.predicted += other.predicted;
        self.predicted_used += other.predicted_used;
        self.used_after_prediction += other.used_after_prediction;
        self.pinned_experts += other.pinned_experts;
        self.pinned_bytes += other.pinned_bytes;
        self.cached_experts += other.cached_experts;
        self.cached_bytes += other.cached_bytes;
        self.tokens = self.tokens.max(other.tokens);
    }

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

/// Why a cached expert was read, until a computation first looks it up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// Looked up since it was read (or pinned).
    Used,
    /// Read ahead by prefetch: its first lookup is a hit and a useful prefetch.
    Prefetched,
    /// Read for a routing that needs it: its first lookup is a miss.
    Demanded,
}

struct Entry {
    ffn: Arc<Ffn>,
    bytes: u64,
    last: u64,
    origin: Origin,
}

#[derive(Default)]
struct Lru {
    cap: u64,
    bytes: u64,
    /// Bytes promised to reads in flight (released when they complete).
    reserved: u64,
    entries: HashMap<(usize, usize), Entry>,
}

impl Lru {
    /// Evicts least recently used entries, neither in use nor in `keep`, until `need` more
    /// bytes fit beside the entries and the reservations.
    fn make_room(&mut self, need: u64, keep: &HashSet<(usize, usize)>) -> bool {
        while self.bytes + self.reserved + need > self.cap {
            let victim = self
                .entries
                .iter()
                .filter(|(k, v)| Arc::strong_count(&v.ffn) == 1 && !keep.contains(k))
                .min_by_key(|(_, v)| v.last)
                .map(|(k, _)| *k);
            let Some(k) = victim else { return false };
            let v = self.entries.remove(&k).expect("present");
            self.bytes -= v.bytes;
        }
        true
    }
}

/// Priority of a queued or running read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Demand,
    Prefetch,
}

/// A read queued or running: its three ranges (gate, up, down) are read by the readers.
struct Flight {
    kind: Kind,
    /// Ranges handed to readers so far (a read is started once the first one is).
    next_m: usize,
    /// Ranges read so far.
    done: usize,
    bufs: [Option<RawBuf>; 3],
    err: Option<String>,
    /// Bytes reserved in the key's LRU (0: none, e.g. a pinned-set read or no room).
    reserved: u64,
}

impl Flight {
    fn new(kind: Kind, reserved: u64) -> Self {
        Self {
            kind,
            next_m: 0,
            done: 0,
            bufs: [None, None, None],
            err: None,
            reserved,
        }
    }

    fn started(&self) -> bool {
        self.next_m > 0
    }
}

struct Inner {
    /// LRU partitions (one per held layer, or one).
    parts: Vec<Lru>,
    pinned: HashMap<(usize, usize), Arc<Ffn>>,
    pinned_bytes: u64,
    pin_wanted: HashSet<(usize, usize)>,
    /// Pinned experts read and not looked up since (why they were read).
    pinned_origin: HashMap<(usize, usize), Origin>,
    /// Reads queued or running.
    inflight: HashMap<(usize, usize), Flight>,
    /// The readers stop.
    stop: bool,
    demand_q: VecDeque<(usize, usize)>,
    prefetch_q: VecDeque<(usize, usize)>,
    /// Demand reads that completed without room in the cache, for their waiting computation.
    orphans: HashMap<(usize, usize), Arc<Ffn>>,
    /// Demand reads that failed, for their waiting computation.
    failed: HashMap<(usize, usize), String>,
    /// Experts the current layer's routing needs: never evicted while it computes.
    needed: HashSet<(usize, usize)>,
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

/// Positioned reads of the model file, kept out of the page cache if asked.
struct Reader {
    file: File,
    /// The same file opened with `O_DIRECT` (when asked for and allowed).
    direct: Option<File>,
    /// Cleared when a direct read is refused (then buffered reads are used).
    direct_ok: AtomicBool,
    drop_page_cache: bool,
    bufs: Arc<BufPool>,
}

impl Reader {
    fn open(path: &std::path::Path, drop_page_cache: bool) -> std::io::Result<Self> {
        let file = File::open(path)?;
        let direct = if drop_page_cache {
            open_direct(path)
        } else {
            None
        };
        Ok(Self {
            file,
            direct_ok: AtomicBool::new(direct.is_some()),
            direct,
            drop_page_cache,
            bufs: Arc::default(),
        })
    }

    fn direct(&self) -> bool {
        self.direct_ok.load(Ordering::Relaxed)
    }

    /// Reads `len` bytes at `off` into a fresh buffer: `O_DIRECT` of the aligned superset when
    /// possible, else a buffered read (then dropped from the page cache if asked).
    fn read_range(&self, off: u64, len: u64) -> std::io::Result<RawBuf> {
        if let (Some(d), true) = (&self.direct, self.direct()) {
            let a0 = off & !(DIRECT_ALIGN - 1);
            let end = (off + len).next_multiple_of(DIRECT_ALIGN);
            let mut buf = self
                .bufs
                .take((end - a0) as usize, (off - a0) as usize, len as usize);
            match read_direct(d, buf.all_mut(), a0, (off + len - a0) as usize) {
                Ok(()) => return Ok(buf),
                Err(e) if e.raw_os_error() == Some(libc_einval()) => {
                    // The file system refuses this direct read: buffered from now on.
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let mut buf = self.bufs.take(len as usize, 0, len as usize);
        read_at(&self.file, &mut buf.all_mut()[..len as usize], off)?;
        if self.drop_page_cache {
            drop_pages(&self.file, off, len);
        }
        Ok(buf)
    }
}

struct Shared {
    reader: Reader,
    cfg: Settings,
    layers: std::ops::Range<usize>,
    src: Vec<LayerSrc>,
    inner: Mutex<Inner>,
    /// Signalled when a read has arrived.
    ready: Condvar,
    /// Signalled when reads are queued (the readers wait on it).
    work: Condvar,
    /// Layer the computation is in (prefetches for it and earlier layers are stale).
    current_layer: AtomicUsize,
}

#[derive(Clone, Debug)]
struct Settings {
    streaming: ExpertStreaming,
    pinned_cap: u64,
    per_layer: bool,
}

/// The RAM cache of streamed experts and its I/O thread (see the module doc).
pub struct ExpertStore {
    shared: Arc<Shared>,
    readers: Vec<JoinHandle<()>>,
    /// The computing thread alone, for the prediction's router product: a tiny matmul that
    /// is not worth waking (and then spinning) the model's pool workers for.
    predict_pool: ThreadPool,
}

/// A handle on an [`ExpertStore`]'s counters that outlives moving or sharing its model (e.g.
/// into a stage run on another thread): reads the live counters while the store exists.
#[derive(Clone)]
pub struct ExpertStatsSource(std::sync::Weak<Shared>);

impl std::fmt::Debug for ExpertStatsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExpertStatsSource")
    }
}

impl ExpertStatsSource {
    /// Current counters, or `None` once the store is gone.
    pub fn stats(&self) -> Option<ExpertStats> {
        self.0.upgrade().map(|sh| sh.stats())
    }
}

impl crate::model::Model {
    /// A handle on the expert store's counters that can be kept after the model is moved
    /// elsewhere (`None` when experts are not streamed).
    pub fn expert_stats_source(&self) -> Option<ExpertStatsSource> {
        self.expert_store()
            .map(|s| ExpertStatsSource(Arc::downgrade(&s.shared)))
    }
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
        lock(&self.shared.inner).stop = true;
        self.shared.work.notify_all();
        for h in self.readers.drain(..) {
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
        let open_err = |e: std::io::Error| EngineError::Tensor {
            tensor: "experts".into(),
            what: format!("cannot open {}: {e}", g.path().display()),
        };
        let reader = Reader::open(g.path(), streaming.drop_page_cache).map_err(open_err)?;
        let nl = src.len();
        let inner = Inner {
            parts,
            pinned: HashMap::new(),
            pinned_bytes: 0,
            pin_wanted: HashSet::new(),
            pinned_origin: HashMap::new(),
            inflight: HashMap::new(),
            stop: false,
            demand_q: VecDeque::new(),
            prefetch_q: VecDeque::new(),
            orphans: HashMap::new(),
            failed: HashMap::new(),
            needed: HashSet::new(),
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
        let shared = Arc::new(Shared {
            reader,
            cfg: Settings {
                streaming,
                pinned_cap,
                per_layer,
            },
            layers: spec.layers.clone(),
            src,
            inner: Mutex::new(inner),
            ready: Condvar::new(),
            work: Condvar::new(),
            current_layer: AtomicUsize::new(usize::MAX),
        });
        let mut store = Self {
            shared,
            readers: Vec::new(),
            predict_pool: ThreadPool::new(1),
        };
        for i in 0..store.shared.cfg.streaming.read_parallelism.max(1) {
            let sh = Arc::clone(&store.shared);
            let h = std::thread::Builder::new()
                .name(format!("tessera-expert-read-{i}"))
                .spawn(move || reader_loop(&sh))
                .map_err(|e| EngineError::BadInput(format!("cannot start a reader: {e}")))?;
            store.readers.push(h);
        }
        Ok(store)
    }

    /// A pool of the calling thread alone (for the next layer's prediction).
    pub(crate) fn predict_pool(&self) -> &ThreadPool {
        &self.predict_pool
    }

    /// Whether the next layer's experts are prefetched.
    pub fn prefetching(&self) -> bool {
        self.shared.cfg.streaming.prefetch
    }

    /// Current counters.
    pub fn stats(&self) -> ExpertStats {
        self.shared.stats()
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
    /// pinned set and scoring the pending prediction; queues the reads of those not resident
    /// (as [`ExpertStore::fetch`]).
    pub(crate) fn observe(&self, layer: usize, n_tokens: usize, slots: &[u32]) {
        let sh = &self.shared;
        let li = layer - sh.layers.start;
        let mut used: Vec<usize> = slots.iter().map(|&e| e as usize).collect();
        used.sort_unstable();
        used.dedup();
        self.fetch(layer, &used);
        let mut inner = lock(&sh.inner);
        for &e in slots {
            if let Some(c) = inner.counts[li].get_mut(e as usize) {
                *c += 1;
            }
        }
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

    /// The computation is at `layer` and its routing needs `experts`: queues the reads of those
    /// neither resident nor being read, ahead of any prefetch (as many as the layer's cache has
    /// room for; the rest are read when looked up), keeps the needed ones from eviction, and
    /// drops the prefetches this layer made stale. Idempotent for a layer.
    pub(crate) fn fetch(&self, layer: usize, experts: &[usize]) {
        let sh = &self.shared;
        if !sh.layers.contains(&layer) {
            return;
        }
        let mut inner = lock(&sh.inner);
        let prev = sh.current_layer.swap(layer, Ordering::Relaxed);
        if prev != layer {
            inner.needed.clear();
            // Prefetches of this layer not started are late: the misses are read now instead.
            sh.drop_queued_prefetches(&mut inner, layer);
        }
        for &e in experts {
            inner.needed.insert((layer, e));
        }
        let mut queued = false;
        for &e in experts {
            queued |= sh.queue_demand(&mut inner, (layer, e), true);
        }
        drop(inner);
        if queued {
            sh.work.notify_all();
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

    /// A prediction for `layer` without probabilities (e.g. the experts it used last): as
    /// [`ExpertStore::prefetch_ranked`] with each given probability 1, in the given order.
    pub(crate) fn prefetch(&self, layer: usize, experts: Vec<usize>) {
        let ranked: Vec<(usize, f32)> = experts.into_iter().map(|e| (e, 1.0)).collect();
        self.prefetch_ranked(layer, &ranked);
    }

    /// A prediction for `layer`: `(expert, predicted probability)`, most probable first.
    /// Recorded for accuracy; the I/O thread reads the most probable ones not resident (see
    /// [`ExpertStreaming::prefetch_max`]) behind any demand read.
    pub(crate) fn prefetch_ranked(&self, layer: usize, predicted: &[(usize, f32)]) {
        let sh = &self.shared;
        if !sh.layers.contains(&layer) || predicted.is_empty() {
            return;
        }
        let li = layer - sh.layers.start;
        let st = &sh.cfg.streaming;
        let mut inner = lock(&sh.inner);
        inner.predicted[li] = Some(predicted.iter().map(|&(e, _)| e).collect());
        if !st.prefetch {
            return;
        }
        // Touch the predicted experts already resident, so that the reads below (and the
        // misses to come) evict other experts first.
        inner.tick += 1;
        let tick = inner.tick;
        let part = sh.part(layer);
        let mut keep = HashSet::new();
        for &(e, _) in predicted {
            let key = (layer, e);
            if inner.pinned.contains_key(&key) || inner.inflight.contains_key(&key) {
                inner.stats.prefetch_resident += 1;
            } else if let Some(en) = inner.parts[part].entries.get_mut(&key) {
                en.last = tick;
                inner.stats.prefetch_resident += 1;
                keep.insert(key);
            }
        }
        // Only the newest prediction is worth reading.
        sh.drop_queued_prefetches(&mut inner, usize::MAX);
        let mut n = 0;
        for &(e, p) in predicted {
            if n >= st.prefetch_max || p < st.prefetch_min_prob {
                break;
            }
            let key = (layer, e);
            if inner.pinned.contains_key(&key)
                || inner.parts[part].entries.contains_key(&key)
                || inner.inflight.contains_key(&key)
            {
                continue;
            }
            let bytes = sh.src[li].packed;
            let to_pin = inner.pin_wanted.contains(&key)
                && inner.pinned_bytes + bytes + sh.pin_reserved(&inner) <= sh.cfg.pinned_cap;
            let reserved = if to_pin {
                0
            } else {
                let mut k2 = inner.needed.clone();
                k2.extend(keep.iter().copied());
                if !inner.parts[part].make_room(bytes, &k2) {
                    break;
                }
                inner.parts[part].reserved += bytes;
                bytes
            };
            inner
                .inflight
                .insert(key, Flight::new(Kind::Prefetch, reserved));
            inner.prefetch_q.push_back(key);
            n += 1;
        }
        drop(inner);
        if n > 0 {
            sh.work.notify_all();
        }
    }

    /// Which of `experts` of `layer` are in memory now (pinned or cached; not being read), so a
    /// computation can start on them while the others' reads proceed.
    pub(crate) fn resident(&self, layer: usize, experts: &[usize]) -> Vec<bool> {
        let sh = &self.shared;
        if !sh.layers.contains(&layer) {
            return vec![false; experts.len()];
        }
        let inner = lock(&sh.inner);
        let part = &inner.parts[sh.part(layer)];
        experts
            .iter()
            .map(|&e| {
                let key = (layer, e);
                inner.pinned.contains_key(&key) || part.entries.contains_key(&key)
            })
            .collect()
    }

    /// Experts `experts` of `layer` (in that order), from memory or read from disk (the misses
    /// all queued at once, read in parallel by the I/O thread's readers). The returned handles
    /// keep the experts from being evicted until dropped.
    pub(crate) fn get_many(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<Ffn>>> {
        let sh = &self.shared;
        let mut inner = lock(&sh.inner);
        let mut missed = vec![false; experts.len()];
        let mut queued = false;
        for (i, &e) in experts.iter().enumerate() {
            inner.needed.insert((layer, e));
            if sh.queue_demand(&mut inner, (layer, e), false) {
                missed[i] = true;
                queued = true;
            }
        }
        if queued {
            sh.work.notify_all();
        }
        let mut out = Vec::with_capacity(experts.len());
        for (i, &e) in experts.iter().enumerate() {
            let key = (layer, e);
            let mut waited_prefetch = false;
            let f = loop {
                if let Some(f) = inner.orphans.remove(&key) {
                    missed[i] = true;
                    break f;
                }
                if let Some(err) = inner.failed.remove(&key) {
                    return Err(EngineError::Tensor {
                        tensor: format!("blk.{layer} expert {e}"),
                        what: err,
                    });
                }
                inner.tick += 1;
                let tick = inner.tick;
                if let Some(f) = inner.pinned.get(&key).cloned() {
                    match inner.pinned_origin.remove(&key) {
                        Some(Origin::Demanded) => missed[i] = true,
                        Some(Origin::Prefetched) => inner.stats.prefetch_useful += 1,
                        _ => {}
                    }
                    break f;
                }
                let part = sh.part(layer);
                if let Some(en) = inner.parts[part].entries.get_mut(&key) {
                    en.last = tick;
                    let origin = std::mem::replace(&mut en.origin, Origin::Used);
                    let f = Arc::clone(&en.ffn);
                    match origin {
                        Origin::Demanded => missed[i] = true,
                        Origin::Prefetched => inner.stats.prefetch_useful += 1,
                        Origin::Used => {}
                    }
                    if inner.pin_wanted.contains(&key) {
                        sh.try_pin(&mut inner, key, &f, part);
                    }
                    break f;
                }
                match inner.inflight.get(&key).map(|f| f.kind) {
                    Some(kind) => {
                        if kind == Kind::Demand {
                            missed[i] = true;
                        } else {
                            waited_prefetch = true;
                        }
                        let t = std::time::Instant::now();
                        inner = sh.ready.wait(inner).unwrap_or_else(|p| p.into_inner());
                        inner.stats.read_wait_us += t.elapsed().as_micros() as u64;
                    }
                    None => {
                        // Evicted between its read and this lookup: read it again.
                        missed[i] = true;
                        if sh.queue_demand(&mut inner, key, false) {
                            sh.work.notify_all();
                        }
                    }
                }
            };
            inner.stats.lookups += 1;
            if missed[i] {
                inner.stats.misses += 1;
            } else {
                inner.stats.hits += 1;
                inner.stats.inflight_waits += u64::from(waited_prefetch);
            }
            out.push(f);
        }
        Ok(out)
    }
}

impl Shared {
    fn stats(&self) -> ExpertStats {
        let inner = lock(&self.inner);
        let mut s = inner.stats.clone();
        s.pinned_experts = inner.pinned.len() as u64;
        s.pinned_bytes = inner.pinned_bytes;
        s.cached_experts = inner.parts.iter().map(|p| p.entries.len() as u64).sum();
        s.cached_bytes = inner.parts.iter().map(|p| p.bytes).sum();
        s.direct_io = self.reader.direct();
        s
    }

    fn part(&self, layer: usize) -> usize {
        if self.cfg.per_layer {
            layer - self.layers.start
        } else {
            0
        }
    }

    /// Bytes of pinned-set reads in flight (they take no LRU reservation).
    fn pin_reserved(&self, inner: &Inner) -> u64 {
        inner
            .inflight
            .iter()
            .filter(|(k, f)| f.reserved == 0 && inner.pin_wanted.contains(k))
            .map(|(k, _)| self.src[k.0 - self.layers.start].packed)
            .sum()
    }

    /// Queues a demand read of `key` unless it is resident or already being read; a queued
    /// prefetch of it is promoted. With `ahead`, reads only into room the LRU can make (a
    /// computation looking it up later reads it anyway). Whether a read was queued or promoted.
    fn queue_demand(&self, inner: &mut Inner, key: (usize, usize), ahead: bool) -> bool {
        if inner.pinned.contains_key(&key)
            || inner.orphans.contains_key(&key)
            || inner.parts[self.part(key.0)].entries.contains_key(&key)
        {
            return false;
        }
        if let Some(fl) = inner.inflight.get_mut(&key) {
            if fl.kind == Kind::Prefetch && !fl.started() {
                fl.kind = Kind::Demand;
                inner.prefetch_q.retain(|k| *k != key);
                inner.demand_q.push_back(key);
                return true;
            }
            return false;
        }
        let bytes = self.src[key.0 - self.layers.start].packed;
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

    /// Drops the queued prefetches not started yet of layers up to `layer`.
    fn drop_queued_prefetches(&self, inner: &mut Inner, layer: usize) {
        let q = std::mem::take(&mut inner.prefetch_q);
        for key in q {
            let started = inner.inflight.get(&key).is_some_and(Flight::started);
            if key.0 <= layer && !started {
                if let Some(fl) = inner.inflight.remove(&key) {
                    let part = self.part(key.0);
                    inner.parts[part].reserved -= fl.reserved;
                    inner.stats.prefetch_dropped += 1;
                    // A computation waiting for it (another thread's) looks again.
                    self.ready.notify_all();
                }
            } else {
                inner.prefetch_q.push_back(key);
            }
        }
    }

    /// The next range to read, `(key, m)`: demand reads first, then prefetches.
    fn next_range(&self, inner: &mut Inner) -> Option<((usize, usize), usize)> {
        let key = *inner.demand_q.front().or(inner.prefetch_q.front())?;
        let fl = inner
            .inflight
            .get_mut(&key)
            .expect("queued reads are in flight");
        let m = fl.next_m;
        fl.next_m += 1;
        if fl.next_m == 3 {
            if inner.demand_q.front() == Some(&key) {
                inner.demand_q.pop_front();
            } else {
                inner.prefetch_q.pop_front();
            }
        }
        Some((key, m))
    }

    /// Builds an expert from a read's three ranges (without the lock: readers build).
    fn build_read(
        &self,
        key: (usize, usize),
        bufs: [Option<RawBuf>; 3],
        err: Option<String>,
    ) -> Result<(Ffn, u64)> {
        let (layer, e) = key;
        if let Some(err) = err {
            return Err(EngineError::Tensor {
                tensor: format!("blk.{layer} expert {e}"),
                what: format!("read failed: {err}"),
            });
        }
        let [a, b, c] = bufs;
        let bufs = [a.expect("read"), b.expect("read"), c.expect("read")];
        let n: u64 = bufs.iter().map(|b| b.len as u64).sum();
        Ok((self.build(layer, e, bufs)?, n))
    }

    /// Completes a read: caches the built expert (or keeps it for its waiter).
    fn complete(
        &self,
        inner: &mut Inner,
        key: (usize, usize),
        fl: Flight,
        read: Result<(Ffn, u64)>,
    ) {
        let part = self.part(key.0);
        inner.parts[part].reserved -= fl.reserved;
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
                };
                if !self.insert(inner, key, &ffn, origin) && fl.kind == Kind::Demand {
                    inner.orphans.insert(key, ffn);
                }
            }
            Err(e) => {
                if fl.kind == Kind::Demand {
                    inner.failed.insert(key, e.to_string());
                }
            }
        }
    }

    /// Buffers for the raw bytes of range `m` of expert `e` of `layer`, and the read's offset.
    fn range(&self, layer: usize, e: usize, m: usize) -> (u64, u64) {
        let ms = &self.src[layer - self.layers.start].mats[m];
        (ms.base + ms.len * e as u64, ms.len)
    }

    /// Builds (repacks) an expert from its three ranges' bytes, as a full load does.
    fn build(&self, layer: usize, e: usize, bufs: [RawBuf; 3]) -> Result<Ffn> {
        let ls = &self.src[layer - self.layers.start];
        let [g, u, d] = bufs;
        let mat = |m: &MatSrc, buf: RawBuf| {
            let (offset, len) = (buf.start, buf.len);
            let bytes = MatrixBytes::Shared {
                bytes: Arc::new(buf),
                offset,
                len,
            };
            Matrix::new(m.dtype, m.rows, m.cols, bytes).map_err(|err| EngineError::Tensor {
                tensor: format!("blk.{layer} expert {e}"),
                what: err.to_string(),
            })
        };
        Ok(Ffn {
            gate: mat(&ls.mats[0], g)?,
            up: mat(&ls.mats[1], u)?,
            down: mat(&ls.mats[2], d)?,
        })
    }

    /// Puts a freshly read expert into the pinned set (if wanted) or its LRU. Returns false if
    /// no room could be made.
    fn insert(&self, inner: &mut Inner, key: (usize, usize), ffn: &Arc<Ffn>, o: Origin) -> bool {
        let bytes = self.src[key.0 - self.layers.start].packed;
        if inner.pin_wanted.contains(&key) && inner.pinned_bytes + bytes <= self.cfg.pinned_cap {
            inner.pinned.insert(key, Arc::clone(ffn));
            inner.pinned_bytes += bytes;
            if o != Origin::Used {
                inner.pinned_origin.insert(key, o);
            }
            return true;
        }
        inner.tick += 1;
        let tick = inner.tick;
        let keep = inner.needed.clone();
        let lru = &mut inner.parts[self.part(key.0)];
        if !lru.make_room(bytes, &keep) {
            return false;
        }
        lru.bytes += bytes;
        lru.entries.insert(
            key,
            Entry {
                ffn: Arc::clone(ffn),
                bytes,
                last: tick,
                origin: o,
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
            inner.pinned_origin.remove(&k);
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

/// A reader: reads queued ranges (demand reads first) until the store is dropped; the reader
/// that reads the last range of an expert builds it (while the computation goes on) and caches
/// it. Built experts thus live in the readers' allocator arenas: freed holes are returned to the
/// system whenever the queues drain.
fn reader_loop(sh: &Shared) {
    let mut inner = lock(&sh.inner);
    loop {
        if inner.stop {
            return;
        }
        let Some((key, m)) = sh.next_range(&mut inner) else {
            inner = sh.work.wait(inner).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        drop(inner);
        let (off, len) = sh.range(key.0, key.1, m);
        let res = sh.reader.read_range(off, len);
        inner = lock(&sh.inner);
        let fl = inner.inflight.get_mut(&key).expect("a read in flight");
        match res {
            Ok(buf) => fl.bufs[m] = Some(buf),
            Err(e) => fl.err = Some(e.to_string()),
        }
        fl.done += 1;
        if fl.done < 3 {
            continue;
        }
        // Build without the lock; the read stays in flight (waiters wait) until cached.
        let bufs = std::mem::take(&mut fl.bufs);
        let err = fl.err.take();
        drop(inner);
        let t = std::time::Instant::now();
        let read = sh.build_read(key, bufs, err);
        let build_us = t.elapsed().as_micros() as u64;
        inner = lock(&sh.inner);
        inner.stats.build_us += build_us;
        let fl = inner.inflight.remove(&key).expect("a read in flight");
        sh.complete(&mut inner, key, fl, read);
        sh.ready.notify_all();
        if inner.demand_q.is_empty() && inner.prefetch_q.is_empty() && inner.inflight.is_empty() {
            drop(inner);
            trim_heap();
            inner = lock(&sh.inner);
        }
    }
}

/// Returns free heap memory to the OS once more than [`TRIM_SLACK`] bytes of it are held (glibc
/// keeps the freed holes of an arena resident otherwise; trimming after every read would make
/// the next builds fault their pages in again).
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallinfo2 and malloc_trim have no preconditions.
    unsafe {
        if libc::mallinfo2().fordblks > TRIM_SLACK {
            libc::malloc_trim(0);
        }
    }
}

/// Free heap bytes kept before [`trim_heap`] returns them.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_SLACK: usize = 16 << 20;

/// Alignment of `O_DIRECT` offsets, lengths and buffers (a page: enough for any logical block
/// size up to 4 KiB).
const DIRECT_ALIGN: u64 = 4096;

/// A [`DIRECT_ALIGN`]-aligned allocation of `cap` initialized bytes.
struct RawAlloc {
    ptr: std::ptr::NonNull<u8>,
    cap: usize,
}

// SAFETY: RawAlloc owns its allocation exclusively (like a Vec<u8>).
unsafe impl Send for RawAlloc {}

impl RawAlloc {
    fn layout(cap: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(cap.max(1), DIRECT_ALIGN as usize).expect("layout")
    }

    fn zeroed(cap: usize) -> Self {
        let layout = Self::layout(cap);
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, cap }
    }
}

impl Drop for RawAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
    }
}

/// Read buffers returned by dropped [`RawBuf`]s, reused by later reads (no allocation, zeroing
/// or page faults per read).
#[derive(Default)]
struct BufPool(Mutex<Vec<RawAlloc>>);

/// Buffers a pool keeps at most (three ranges for each of four readers).
const POOL_MAX: usize = 12;

impl BufPool {
    /// A buffer of `cap` bytes or more holding a range at `start..start + len`.
    fn take(self: &Arc<Self>, cap: usize, start: usize, len: usize) -> RawBuf {
        assert!(start + len <= cap);
        let reuse = {
            let mut free = self.0.lock().unwrap_or_else(|p| p.into_inner());
            free.iter()
                .position(|a| a.cap >= cap)
                .map(|i| free.swap_remove(i))
        };
        RawBuf {
            alloc: Some(reuse.unwrap_or_else(|| RawAlloc::zeroed(cap))),
            pool: Some(Arc::clone(self)),
            start,
            len,
        }
    }
}

/// An aligned byte buffer holding one range at `start..start + len` (returned to its pool when
/// dropped).
struct RawBuf {
    alloc: Option<RawAlloc>,
    pool: Option<Arc<BufPool>>,
    start: usize,
    len: usize,
}

// SAFETY: shared access to the (owned) allocation is read-only.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    fn all_mut(&mut self) -> &mut [u8] {
        match &self.alloc {
            // SAFETY: `cap` initialized bytes owned by self.
            Some(a) => unsafe { std::slice::from_raw_parts_mut(a.ptr.as_ptr(), a.cap) },
            None => &mut [],
        }
    }
}

impl AsRef<[u8]> for RawBuf {
    fn as_ref(&self) -> &[u8] {
        match &self.alloc {
            // SAFETY: `cap` initialized bytes owned by self.
            Some(a) => unsafe { std::slice::from_raw_parts(a.ptr.as_ptr(), a.cap) },
            None => &[],
        }
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        if let (Some(a), Some(pool)) = (self.alloc.take(), &self.pool) {
            let mut free = pool.0.lock().unwrap_or_else(|p| p.into_inner());
            if free.len() < POOL_MAX {
                free.push(a);
            }
        }
    }
}

/// Measures the read bandwidth (GB/s) this store's reader achieves on `ranges` (offset, length)
/// of `path`, read by `parallelism` threads at once, the way the store reads experts
/// (`O_DIRECT` when `drop_page_cache` and allowed, else buffered reads followed by
/// `posix_fadvise(DONTNEED)`). For benchmarks: the disk-bound limit of streaming.
pub fn measure_read_bandwidth(
    path: &std::path::Path,
    ranges: &[(u64, u64)],
    parallelism: usize,
    drop_page_cache: bool,
) -> std::io::Result<(f64, bool)> {
    let reader = Reader::open(path, drop_page_cache)?;
    let n = parallelism.max(1);
    let next = AtomicUsize::new(0);
    let t = std::time::Instant::now();
    let res: std::io::Result<()> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(off, len)) = ranges.get(i) else {
                            return Ok(());
                        };
                        std::hint::black_box(reader.read_range(off, len)?);
                    }
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().unwrap_or(Ok(())))
    });
    res?;
    let bytes: u64 = ranges.iter().map(|r| r.1).sum();
    Ok((
        bytes as f64 / t.elapsed().as_secs_f64() / 1e9,
        reader.direct(),
    ))
}

/// Opens `path` for `O_DIRECT` reads (Linux; `None` elsewhere or if refused).
#[cfg(target_os = "linux")]
fn open_direct(path: &std::path::Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_: &std::path::Path) -> Option<File> {
    None
}

fn libc_einval() -> i32 {
    #[cfg(unix)]
    {
        libc::EINVAL
    }
    #[cfg(not(unix))]
    {
        22
    }
}

/// Reads at least `need` bytes at `off` (aligned) into `buf` (aligned, a multiple of the
/// alignment long) with direct I/O; a short read at the end of the file is fine once `need`
/// bytes are in.
#[cfg(unix)]
fn read_direct(f: &File, buf: &mut [u8], off: u64, need: usize) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut done = 0;
    while done < need {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "end of file inside an expert",
                ))
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(not(unix))]
fn read_direct(f: &File, buf: &mut [u8], off: u64, need: usize) -> std::io::Result<()> {
    read_at(f, &mut buf[..need], off)
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
