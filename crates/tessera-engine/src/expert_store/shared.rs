//! The state the store shares with its reader threads: where each layer's expert matrices lie in
//! the file, and the cache, queues and counters behind one lock ([`Inner`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera_model::GgmlType;

use crate::kernels::SlotPool;
use crate::timeline::Timeline;
use crate::weights::Ffn;

use super::cache::{Lru, Origin};
use super::fill::Fill;
use super::io_queue::Flight;
use super::settings::Settings;
use super::ExpertStats;
use tessera_host::direct_read::Reader;

/// Where one expert matrix lies in the file.
#[derive(Clone, Copy, Debug)]
pub(super) struct MatSrc {
    pub(super) dtype: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Offset of expert 0; expert `e` starts at `base + e * len`.
    pub(super) base: u64,
    pub(super) len: u64,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct LayerSrc {
    /// gate, up, down.
    pub(super) mats: [MatSrc; 3],
    /// Built bytes of one expert of this layer.
    pub(super) packed: u64,
}

/// The MoE layers a store serves, ascending: a contiguous run, or (Llama 4) every
/// `moe_layer_step`-th layer with dense ones between. Per-layer state is indexed by position
/// in this list.
pub(super) struct Served(pub(super) Vec<usize>);

impl Served {
    pub(super) fn contains(&self, layer: &usize) -> bool {
        self.0.binary_search(layer).is_ok()
    }

    /// The position of a served layer.
    ///
    /// # Panics
    /// If the store does not serve `layer` (callers check [`Served::contains`] or only pass
    /// layers they were handed experts of).
    pub(super) fn index(&self, layer: usize) -> usize {
        self.0
            .binary_search(&layer)
            .unwrap_or_else(|_| panic!("layer {layer} is not one the expert store serves"))
    }

    /// The served layer at position `li`.
    pub(super) fn at(&self, li: usize) -> usize {
        self.0[li]
    }
}

pub(super) struct Inner {
    /// LRU partitions (one per held layer, or one).
    pub(super) parts: Vec<Lru>,
    pub(super) pinned: HashMap<(usize, usize), Arc<Ffn>>,
    pub(super) pinned_bytes: u64,
    pub(super) pin_wanted: HashSet<(usize, usize)>,
    /// Experts of each served layer (by position) the pinned set may hold: a share of the
    /// layer's, which follows the routing (`cache.rs`, `Shared::reshare`).
    pub(super) pin_quota: Vec<usize>,
    /// Each served layer's share of the budget in whole experts, pinned and cached together.
    pub(super) shares: Vec<usize>,
    /// Pinned experts read and not looked up since (why they were read).
    pub(super) pinned_origin: HashMap<(usize, usize), Origin>,
    /// Reads queued or running.
    pub(super) inflight: HashMap<(usize, usize), Flight>,
    /// The readers stop.
    pub(super) stop: bool,
    pub(super) demand_q: VecDeque<(usize, usize)>,
    pub(super) prefetch_q: VecDeque<(usize, usize)>,
    /// The cache's fill (`fill.rs`), with its own queue.
    pub(super) fill: Fill,
    /// Demand reads that completed without room in the cache, for their waiting computation.
    pub(super) orphans: HashMap<(usize, usize), Arc<Ffn>>,
    /// Window bytes held by orphans read through the window (released when taken).
    pub(super) orphan_window: HashMap<(usize, usize), u64>,
    /// Bytes of the window held by reads and their orphans.
    pub(super) window_used: u64,
    /// The current layer's misses that its cache had no room for, in the order the
    /// computation will ask for them; read through the window as it frees up.
    pub(super) late: VecDeque<(usize, usize)>,
    /// Demand reads that failed, for their waiting computation.
    pub(super) failed: HashMap<(usize, usize), String>,
    /// Experts the current layer's routing needs: never evicted while it computes.
    pub(super) needed: HashSet<(usize, usize)>,
    /// `counts[li][e]` (`li`: the layer's [`Served::index`]): slots routed to the expert.
    pub(super) counts: Vec<Vec<u64>>,
    /// `reuse[li]`: the layer's recency order and lookups by depth, which its share follows.
    pub(super) reuse: Vec<super::reuse::Reuse>,
    /// `last_used[li]`: distinct experts of the layer's last routing.
    pub(super) last_used: Vec<Vec<usize>>,
    /// `predicted[li]`: the pending prediction for the layer.
    pub(super) predicted: Vec<Option<Vec<usize>>>,
    pub(super) tick: u64,
    /// Tokens since the pinned set, and since the layers' shares, were last re-learned.
    pub(super) since_repin: u64,
    pub(super) since_reshare: u64,
    /// Reads in progress, and since when at least one has been (for the disk-busy time).
    pub(super) reading: usize,
    pub(super) busy_since: Option<std::time::Instant>,
    /// When free heap was last returned to the system (see `io_queue::trim_heap`).
    pub(super) trimmed_at: Option<std::time::Instant>,
    /// Bytes of the matrices readers are building now (their targets, taken or to allocate).
    pub(super) building: u64,
    /// Experts out of the cache that computations may still hold, and their allocated bytes.
    pub(super) lent: Vec<(std::sync::Weak<Ffn>, u64)>,
    pub(super) stats: ExpertStats,
}

pub(super) struct Shared {
    pub(super) reader: Reader,
    pub(super) cfg: Settings,
    pub(super) layers: Served,
    pub(super) src: Vec<LayerSrc>,
    pub(super) inner: Mutex<Inner>,
    /// The memory of the built experts (huge-page slabs; an evicted expert's goes to the next
    /// build of its length).
    pub(super) slots: SlotPool,
    /// The timeline being recorded, if one is (`crate::timeline`).
    pub(super) timeline: Timeline,
    /// Signalled when a read has arrived (through [`Shared::notify_ready`]).
    pub(super) ready: Condvar,
    /// Counts the `ready` signals, so that a computation waiting for a read can watch for the
    /// next one without the lock ([`Shared::wait_ready`]).
    pub(super) arrivals: AtomicU64,
    /// Signalled when reads are queued (the readers wait on it).
    pub(super) work: Condvar,
    /// Layer the computation is in (prefetches for it and earlier layers are stale).
    pub(super) current_layer: AtomicUsize,
    #[cfg(test)]
    pub(super) faults: super::io_queue::TestFaults,
}

pub(super) fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long a computation waiting for a read keeps its core before it sleeps
/// ([`Shared::wait_ready`]): about two of a slow disk's expert reads.
const READ_SPIN: Duration = Duration::from_millis(5);

impl Shared {
    /// Wakes the computations waiting for reads (call with the lock held, after the change
    /// they wait for).
    pub(super) fn notify_ready(&self) {
        self.arrivals.fetch_add(1, Ordering::Release);
        self.ready.notify_all();
    }

    /// Waits for the next [`Shared::notify_ready`] (or a spurious wake-up: callers look
    /// again). For up to [`READ_SPIN`] the thread keeps its core, yielding it to any other
    /// thread that can run there, and only then sleeps: a computing thread that slept through
    /// each read resumed on a core that the readers' builds (or, in the lab, the emulated
    /// disk) had taken, or that the hypervisor had halted, and its next layer ran slower
    /// (2-core VM under the lab's eMMC cap: 3–7% longer steps at 1.2–3× over budget).
    pub(super) fn wait_ready<'a>(&'a self, inner: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        let seen = self.arrivals.load(Ordering::Acquire);
        drop(inner);
        let start = Instant::now();
        while self.arrivals.load(Ordering::Acquire) == seen && start.elapsed() < READ_SPIN {
            std::thread::yield_now();
        }
        let inner = lock(&self.inner);
        // Signals are sent with the lock held, so none can come between this check and the
        // wait, which releases it.
        if self.arrivals.load(Ordering::Acquire) != seen {
            return inner;
        }
        self.ready.wait(inner).unwrap_or_else(|p| p.into_inner())
    }
}
