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
//!   thread builds each expert as soon as its bytes arrive, into the store's slot pool:
//!   huge-page slabs whose ranges evicted experts give back to the next builds of their length
//!   (`kernels::weight_buffer`), so a streamed expert is computed from huge pages as a loaded
//!   one is, and a build writes to memory already faulted in. A computation waiting for a read
//!   keeps its core for up to 5 ms, yielding it to any thread that can run there, before it
//!   sleeps (`Shared::wait_ready`).
//! - **Cache**: a pinned hot set (a share of the budget, learned from observed routing counts:
//!   every [`ExpertStreaming::repin_every`] tokens each layer's most used experts are chosen,
//!   as many as its quota, and are kept once loaded) plus an LRU per layer for the rest of the
//!   budget (one LRU shared by all layers when the budget cannot give every layer one expert).
//!   Each layer has a share of the budget in whole experts, pinned and cached together (a
//!   pinned quota chosen over all layers at once left the layers it favoured less their LRU's
//!   room, and the others missed more; an LRU's room for a fraction of an expert stayed idle).
//!   The shares start even, except that the first layer holds all its experts for good where
//!   the others' shares of the rest still hold two routings' experts
//!   (`settings::shares_at_open`: its misses are the ones nothing can read ahead), and then
//!   follow each layer's reuse distances so far, re-learned with the
//!   pinned set, or four times as often where every share holds two routings' experts
//!   (`settings::reshare_every`), a layer moving by one expert each time
//!   (`reuse::shares_by_reuse`, `settings::step_toward`): the room goes where an LRU of that
//!   layer would have hit the most lookups per byte, each layer keeping at least a routing's
//!   experts (the routing counts the shares followed before favoured layers whose popular
//!   experts later changed: 3x 92.7 -> 98.8 tok/s, 5x 37.9 -> 42.4, README). On
//!   bench-qwen3moe-q4_0 the first layer, routed by the token's embedding alone, spreads over
//!   all 64 experts while later layers keep to fewer; at even shares 26 of the 37 experts a
//!   32-token decode at 1.2x over budget waited for were the first layer's, each a full read's
//!   wait at the start of a step, before any computation could have run ahead to find it. A
//!   read reserves its room when it is queued, so reads in flight never push the cache past
//!   its share. Experts in use by a computation, and those the current layer's routing asked
//!   for, are never evicted; `moe_experts` computes a layer's experts in chunks no larger than
//!   the layer's LRU, so the built experts alive stay within the budget plus the one expert a
//!   computation may hold outside the cache (see `peak.rs`, which measures the high-water
//!   mark).
//! - **Read window**: when a layer's share of the cache cannot hold one routing's experts (small
//!   budgets), `read_parallelism` experts of the budget are set aside, and the misses beyond the
//!   layer's room are read ahead through them, in the order the computation takes them, instead
//!   of one at a time as it reaches them (see `window.rs`).
//! - **Fill**: while no other read is queued, the readers read experts into the LRU's free room
//!   (never evicting for it), one at a time, each layer in turn, from the moment the store opens
//!   ([`ExpertStreaming::fill`], see `fill.rs`): a model slightly over its budget starts with
//!   what the budget holds in memory, as a model that fits does, instead of paying a read for
//!   each expert's first use. [`ExpertStore::wait_filled`] waits for it.
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
//! - **Run-ahead**: while a step of a few rows waits for a miss, its computing thread runs the
//!   layers after it on an estimate (the experts in memory only, `crate::run_ahead`), and the
//!   experts the estimate routes to that are absent are read as prefetches behind the awaited
//!   read (`ahead.rs`); the router's next early guess does not replace them, the computation
//!   reaching their layer does.
//!
//! [`ExpertStats`] counts hits, misses, bytes read, prefetches and the pinned set; a timeline of
//! the steps, waits and reads is recorded when asked for ([`ExpertStore::start_timeline`]).

mod ahead;
mod cache;
mod fill;
mod io_queue;
mod peak;
mod reuse;
mod settings;
mod shared;
mod stats;
#[cfg(test)]
pub(crate) mod tests;
mod window;

pub use settings::ExpertStreaming;
use settings::{reshare_every, shares_at_open, split_shares};
pub use stats::{ExpertStats, ExpertStatsSource};
pub use tessera_host::direct_read::measure_read_bandwidth;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use tessera_model::config::names;
use tessera_model::{GgufFile, ModelConfig};

use crate::error::{EngineError, Result};
use crate::kernels::{Matrix, SlotPool, ThreadPool};
use crate::timeline::{Lane, SpanKind, Timeline, TimelineRecord};
use crate::weights::{Ffn, LoadSpec};

use cache::{Lru, Origin};
use fill::Fill;
use io_queue::{reader_loop, Kind};
use settings::Settings;
use shared::{lock, Inner, LayerSrc, MatSrc, Served, Shared};
use tessera_host::direct_read::Reader;

/// The RAM cache of streamed experts and its I/O thread (see the module doc).
pub struct ExpertStore {
    shared: Arc<Shared>,
    readers: Vec<JoinHandle<()>>,
    /// The computing thread alone, for the prediction's router product: a tiny matmul that
    /// is not worth waking (and then spinning) the model's pool workers for.
    predict_pool: ThreadPool,
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

/// Free expert memory the slot pool keeps resident for the next builds: a sixteenth of the
/// budget, and at least an expert per reader. Evictions free memory when reads are queued and
/// the reads take it when they start, so a decode's queued reads (several at a time where the
/// run-ahead reads ahead) find their room still on huge pages; beyond this the free pages go
/// back to the OS. Counted in the store's peak (`peak.rs`).
fn slot_keep(budget: u64, expert_bytes: u64, readers: usize) -> u64 {
    (budget / 16).max(expert_bytes * readers.max(1) as u64)
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
        // Only the layers that route to experts: a model's leading dense layers hold none, nor
        // do Llama 4's dense layers between its MoE ones.
        let layers: Vec<usize> = spec
            .layers
            .clone()
            .filter(|&l| config.is_moe_layer(l))
            .collect();
        let mut src = Vec::with_capacity(layers.len());
        let mut held = Vec::with_capacity(layers.len());
        let mut served = 0u64;
        for &il in &layers {
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
            // Streamed experts are read later, by position: a partial copy must hold them now.
            for e in (0..n_expert).filter(|&e| spec.experts.holds(il, e)) {
                for (m, w) in mats.iter().zip(["gate", "up", "down"]) {
                    let start = m.base + m.len * e as u64;
                    g.check_present(
                        &names::layer(il, &format!("ffn_{w}_exps.weight")),
                        start..start + m.len,
                    )?;
                }
            }
            let experts: Vec<usize> = (0..n_expert)
                .filter(|&e| spec.experts.holds(il, e))
                .collect();
            served += experts.len() as u64;
            held.push(experts);
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
        // Split the budget: pinned share, then an LRU per layer if each gets one expert. A
        // budget that holds every expert served needs no pinned set: nothing is ever evicted
        // (and a pinned share would only move experts between a layer's LRU and itself).
        let all_bytes: u64 = src
            .iter()
            .zip(&held)
            .map(|(s, h)| s.packed * h.len() as u64)
            .sum();
        let holds_all = budget >= all_bytes;
        let pinned_try = if holds_all {
            0
        } else {
            ((budget as f64) * streaming.pinned_fraction.clamp(0.0, 1.0)) as u64
        };
        let (pinned_cap, per_layer) = if (budget - pinned_try) / n_layers >= expert_bytes {
            (pinned_try, true)
        } else if budget / n_layers >= expert_bytes {
            (0, true)
        } else {
            (0, false)
        };
        // The read window (window.rs): when a layer's share cannot hold one routing's experts,
        // and taking the window leaves every layer room for one expert.
        let unpinned = budget - pinned_cap;
        let window_try = streaming.read_parallelism.max(1) as u64 * expert_bytes;
        let routing_bytes = config.n_expert_used.max(1) as u64 * expert_bytes;
        let window_cap = if per_layer
            && unpinned / n_layers < routing_bytes
            && unpinned.saturating_sub(window_try) / n_layers >= expert_bytes
        {
            window_try
        } else {
            0
        };
        let lru_total = unpinned - window_cap;
        // Each layer's share (pinned and cached together) in whole experts, even until the
        // routing has been seen: the pinned set is chosen layer by layer within its quota, and
        // no layer's LRU keeps a fraction of an expert's room idle.
        let (parts, pin_quota, pinned_cap, share_floor, shares, reshare_every) = if per_layer {
            let packed: Vec<u64> = src.iter().map(|s| s.packed).collect();
            let counts: Vec<usize> = held.iter().map(Vec::len).collect();
            // The shares then follow the routing (`Shared::reshare`), each at least its floor
            // (`shares_at_open`: the first layer whole where the rest stays roomy).
            let n_used = config.n_expert_used.max(1);
            let (slots, floor) = shares_at_open(budget - window_cap, &packed, &counts, n_used);
            let reshare = reshare_every(streaming.repin_every, &slots, n_used);
            let (quota, room) = split_shares(pinned_cap, &packed, &slots);
            let parts = room
                .into_iter()
                .map(|cap| Lru {
                    cap,
                    ..Lru::default()
                })
                .collect();
            let pinned = (0..quota.len()).map(|l| quota[l] as u64 * packed[l]).sum();
            (parts, quota, pinned, floor, slots, reshare)
        } else {
            let parts = vec![Lru {
                cap: lru_total,
                ..Lru::default()
            }];
            (parts, vec![0; src.len()], 0, Vec::new(), Vec::new(), 0)
        };
        let open_err = |e: std::io::Error| EngineError::Tensor {
            tensor: "experts".into(),
            what: format!("cannot open {}: {e}", g.path().display()),
        };
        // The reader reads one file by offset; a split model's experts lie in several.
        if g.is_split() {
            return Err(EngineError::BadInput(format!(
                "{} is a split model: experts cannot be streamed from its parts yet (merge them \
                 with llama-gguf-split --merge, or load without an expert budget)",
                g.path().display()
            )));
        }
        let reader = Reader::open(g.path(), streaming.drop_page_cache).map_err(open_err)?;
        let nl = src.len();
        let inner = Inner {
            parts,
            pinned: HashMap::new(),
            pinned_bytes: 0,
            pin_wanted: HashSet::new(),
            pin_quota,
            shares,
            pinned_origin: HashMap::new(),
            inflight: HashMap::new(),
            stop: false,
            demand_q: VecDeque::new(),
            prefetch_q: VecDeque::new(),
            fill: Fill::new(held.clone(), streaming.fill),
            orphans: HashMap::new(),
            orphan_window: HashMap::new(),
            window_used: 0,
            late: VecDeque::new(),
            failed: HashMap::new(),
            needed: HashSet::new(),
            counts: vec![vec![0; n_expert]; nl],
            reuse: vec![reuse::Reuse::default(); nl],
            last_used: vec![Vec::new(); nl],
            predicted: vec![None; nl],
            tick: 0,
            since_repin: 0,
            since_reshare: 0,
            reading: 0,
            busy_since: None,
            trimmed_at: None,
            building: 0,
            lent: Vec::new(),
            stats: ExpertStats {
                budget_bytes: budget,
                expert_bytes,
                experts_served: served,
                per_layer_lru: per_layer,
                ..ExpertStats::default()
            },
        };
        let slots = SlotPool::new(slot_keep(budget, expert_bytes, streaming.read_parallelism));
        let shared = Arc::new(Shared {
            reader,
            cfg: Settings {
                streaming,
                pinned_cap,
                per_layer,
                share_bytes: budget - window_cap,
                held,
                share_floor,
                reshare_every,
                window_cap,
                holds_all,
            },
            layers: Served(layers),
            src,
            inner: Mutex::new(inner),
            slots,
            timeline: Timeline::new(),
            ready: Condvar::new(),
            work: Condvar::new(),
            current_layer: AtomicUsize::new(usize::MAX),
            arrivals: std::sync::atomic::AtomicU64::new(0),
            #[cfg(test)]
            faults: Default::default(),
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
                .spawn(move || reader_loop(&sh, i))
                .map_err(|e| EngineError::BadInput(format!("cannot start a reader: {e}")))?;
            store.readers.push(h);
        }
        Ok(store)
    }

    /// Starts recording a timeline of the computation's steps, waits and run-ahead and of the
    /// readers' reads and builds (see `crate::timeline`); what an earlier recording kept is
    /// dropped.
    pub fn start_timeline(&self) {
        self.shared.timeline.start();
    }

    /// Stops recording the timeline and returns it.
    pub fn stop_timeline(&self) -> TimelineRecord {
        self.shared.timeline.stop()
    }

    /// The timeline, for the computation's own spans.
    pub(crate) fn timeline(&self) -> &Timeline {
        &self.shared.timeline
    }

    /// A pool of the calling thread alone (for the next layer's prediction).
    pub(crate) fn predict_pool(&self) -> &ThreadPool {
        &self.predict_pool
    }

    /// Blocks until the cache's fill (`fill.rs`) has nothing left to read: every layer's room
    /// is full, or holds all its experts. Returns at once where filling is off.
    pub fn wait_filled(&self) {
        let mut inner = lock(&self.shared.inner);
        while !inner.fill.finished() && !inner.stop {
            inner = self
                .shared
                .ready
                .wait(inner)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Whether the next layer's experts are prefetched (not where the budget holds them all).
    pub fn prefetching(&self) -> bool {
        self.shared.cfg.streaming.prefetch && !self.shared.cfg.holds_all
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
        let per = sh.src[sh.layers.index(layer)].packed.max(1);
        (inner.parts[sh.part(layer)].cap / per).max(1) as usize
    }

    /// Records the experts a layer's routing uses (`slots`: every slot's expert), learning the
    /// pinned set and scoring the pending prediction; queues the reads of those not resident
    /// (as [`ExpertStore::fetch`]).
    pub(crate) fn observe(&self, layer: usize, n_tokens: usize, slots: &[u32]) {
        let sh = &self.shared;
        let li = sh.layers.index(layer);
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
        inner.reuse[li].observe(&used);
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
            inner.since_reshare += n_tokens as u64;
            // Only a store with an LRU per layer has shares, and a pinned set.
            if sh.cfg.per_layer {
                if inner.since_reshare >= sh.cfg.reshare_every {
                    inner.since_reshare = 0;
                    sh.reshare(&mut inner);
                }
                if inner.since_repin >= sh.cfg.streaming.repin_every {
                    inner.since_repin = 0;
                    if sh.cfg.pinned_cap > 0 {
                        sh.repin(&mut inner);
                    }
                }
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
            sh.drop_queued_prefetches(&mut inner, layer, false);
            sh.release_stale_window(&mut inner, layer);
        }
        for &e in experts {
            inner.needed.insert((layer, e));
        }
        let mut queued = false;
        let mut late = VecDeque::new();
        for &e in experts {
            let key = (layer, e);
            if sh.queue_demand(&mut inner, key, true) {
                queued = true;
            } else if sh.absent(&inner, key) {
                late.push_back(key);
            }
        }
        if !late.is_empty() {
            inner.late = late;
            queued |= sh.fill_window(&mut inner);
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
        lock(&sh.inner).last_used[sh.layers.index(layer)].clone()
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
        let li = sh.layers.index(layer);
        let st = &sh.cfg.streaming;
        let mut guard = lock(&sh.inner);
        let inner = &mut *guard;
        inner.predicted[li] = Some(predicted.iter().map(|&(e, _)| e).collect());
        if !st.prefetch {
            return;
        }
        // Only the newest prediction is worth reading (the run-ahead's, made from the layers
        // themselves, stand until their layer is reached).
        sh.drop_queued_prefetches(inner, usize::MAX, true);
        let queued = sh.queue_prefetches(
            inner,
            layer,
            predicted,
            st.prefetch_max,
            st.prefetch_min_prob,
            false,
        );
        drop(guard);
        if queued > 0 {
            sh.work.notify_all();
        }
    }

    /// Which of `experts` of `layer` are in memory now (pinned or cached; not being read), so a
    /// computation can start on them while the others' reads proceed.
    pub(crate) fn resident(&self, layer: usize, experts: &[usize]) -> Vec<bool> {
        self.look_up(layer, experts, false, |inner, part, key| {
            inner.pinned.contains_key(&key) || inner.parts[part].entries.contains_key(&key)
        })
    }

    /// `look(inner, the layer's LRU, (layer, expert))` for each of `experts`, the store locked
    /// once; `absent` for all where the store does not serve `layer`.
    fn look_up<T: Clone>(
        &self,
        layer: usize,
        experts: &[usize],
        absent: T,
        look: impl Fn(&Inner, usize, (usize, usize)) -> T,
    ) -> Vec<T> {
        let sh = &self.shared;
        if !sh.layers.contains(&layer) {
            return vec![absent; experts.len()];
        }
        let inner = lock(&sh.inner);
        let part = sh.part(layer);
        experts
            .iter()
            .map(|&e| look(&inner, part, (layer, e)))
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
                inner.stats.late_reads += 1;
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
                    // Out of the store's hands, alive until this computation drops it.
                    inner.lent.push((Arc::downgrade(&f), f.allocated_bytes()));
                    if sh.orphan_taken(&mut inner, key) {
                        sh.work.notify_all();
                    }
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
                        // A fill read this lookup waits for is as slow as a miss's.
                        if kind != Kind::Prefetch {
                            missed[i] = true;
                        } else {
                            waited_prefetch = true;
                        }
                        let t = std::time::Instant::now();
                        let span = sh.timeline.begin();
                        inner = sh.wait_ready(inner);
                        inner.stats.read_wait_us += t.elapsed().as_micros() as u64;
                        let wait = SpanKind::Wait { layer, expert: e };
                        sh.timeline.end(span, Lane::Compute, wait);
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
