//! The store's cache as a whole, on a real file: what each layer holds.

use super::{ExpertStore, ExpertStreaming};
use crate::weights::LoadSpec;
use tessera_model::{GgufFile, ModelConfig};

/// The small qwen3moe test model (`models/test/`) and its configuration.
pub(crate) fn small_moe() -> (GgufFile, ModelConfig) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/test/small-qwen3moe-Q8_0.gguf");
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    (g, cfg)
}

/// Experts of `layer` in memory now.
fn held(store: &ExpertStore, layer: usize, n_expert: usize) -> usize {
    let all: Vec<usize> = (0..n_expert).collect();
    store
        .resident(layer, &all)
        .into_iter()
        .filter(|&r| r)
        .count()
}

#[test]
fn every_layer_holds_as_many_experts_however_the_pinned_set_is_learned() {
    let (g, cfg) = small_moe();
    let spec = LoadSpec::full(&cfg);
    let (nl, ne) = (cfg.n_layer, cfg.n_expert);
    let probe = ExpertStore::open(
        &g,
        &cfg,
        &spec,
        ExpertStreaming {
            fill: false,
            ..ExpertStreaming::with_budget(u64::MAX / 2)
        },
    )
    .unwrap();
    let eb = probe.stats().expert_bytes;
    // Four and a half experts' bytes a layer, half of them pinned, re-learned every token.
    let budget = eb * 9 * nl as u64 / 2;
    let store = ExpertStore::open(
        &g,
        &cfg,
        &spec,
        ExpertStreaming {
            pinned_fraction: 0.5,
            repin_every: 1,
            prefetch: false,
            fill: false,
            ..ExpertStreaming::with_budget(budget)
        },
    )
    .unwrap();
    // Layer 0's routing takes every expert each token, the others' one expert in turn: the
    // pinned set counted over all layers at once went to layer 0's experts, and every other
    // layer held its LRU's two experts.
    for token in 0..3 * ne {
        for layer in 0..nl {
            let used: Vec<usize> = if layer == 0 {
                (0..ne).collect()
            } else {
                vec![token % ne]
            };
            let slots: Vec<u32> = used.iter().map(|&e| e as u32).collect();
            store.observe(layer, 1, &slots);
            for &e in &used {
                store.get_many(layer, &[e]).unwrap();
            }
        }
    }
    let counts: Vec<usize> = (0..nl).map(|l| held(&store, l, ne)).collect();
    assert!(
        counts.iter().all(|&c| c == 4 || c == 5),
        "experts held by each layer: {counts:?}"
    );
    assert_eq!(counts.iter().sum::<usize>(), 9 * nl / 2, "{counts:?}");
    let st = store.stats();
    assert!(
        st.pinned_bytes > 0 && st.pinned_bytes <= budget / 2,
        "{st:?}"
    );
}

/// A computation waiting for a read wakes for the signal that follows it, whether the signal
/// comes while it still keeps its core or after it has gone to sleep (past `READ_SPIN`), and a
/// signal it has already seen does not keep it waiting.
#[test]
fn a_waiting_computation_wakes_for_the_next_read_spinning_or_asleep() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    let (g, cfg) = small_moe();
    let store = ExpertStore::open(
        &g,
        &cfg,
        &LoadSpec::full(&cfg),
        ExpertStreaming {
            fill: false,
            ..ExpertStreaming::with_budget(u64::MAX / 2)
        },
    )
    .unwrap();
    let sh = &*store.shared;
    for delay in [Duration::from_millis(1), Duration::from_millis(50)] {
        let signalled = AtomicBool::new(false);
        std::thread::scope(|s| {
            let inner = super::shared::lock(&sh.inner);
            let before = sh.arrivals.load(Ordering::Acquire);
            s.spawn(|| {
                std::thread::sleep(delay);
                let _inner = super::shared::lock(&sh.inner);
                signalled.store(true, Ordering::Release);
                sh.notify_ready();
            });
            // A spurious wake-up is allowed: wait again until the signal has come.
            let mut inner = sh.wait_ready(inner);
            while !signalled.load(Ordering::Acquire) {
                inner = sh.wait_ready(inner);
            }
            drop(inner);
            assert_eq!(sh.arrivals.load(Ordering::Acquire), before + 1, "{delay:?}");
        });
    }
}

/// The run-ahead's prefetches stand when the router's next early guess replaces its own queued
/// ones, and are dropped unread once the computation reaches their layer.
#[test]
fn the_run_aheads_prefetches_stand_until_their_layer_is_reached() {
    use std::time::Duration;

    let (g, cfg) = small_moe();
    let spec = LoadSpec::full(&cfg);
    let probe = ExpertStreaming {
        fill: false,
        ..ExpertStreaming::with_budget(u64::MAX / 2)
    };
    let eb = ExpertStore::open(&g, &cfg, &spec, probe)
        .unwrap()
        .stats()
        .expert_bytes;
    let store = ExpertStore::open(
        &g,
        &cfg,
        &spec,
        ExpertStreaming {
            fill: false,
            pinned_fraction: 0.0,
            read_parallelism: 1,
            ..ExpertStreaming::with_budget(eb * 3 * cfg.n_layer as u64)
        },
    )
    .unwrap();
    // One reader, a second a range: layer 0's demand read holds it for three seconds, and
    // every prefetch below stays queued, unstarted, meanwhile.
    *store.faults().delay.lock().unwrap() = Duration::from_secs(1);
    store.fetch(0, &[0]);
    let queued = |e: usize| !store.arrived(2, &[e]);
    store.prefetch_ahead(2, &[1]);
    store.prefetch_ranked(2, &[(2, 0.9)]);
    assert!(queued(1) && queued(2));
    // The router's next guess replaces its own, not the run-ahead's.
    store.prefetch_ranked(2, &[(3, 0.9)]);
    assert!(queued(1) && !queued(2) && queued(3));
    assert_eq!(store.stats().prefetch_dropped, 1);
    // The computation reaches layer 2: both are late.
    store.fetch(2, &[]);
    assert!(!queued(1) && !queued(3));
    let st = store.stats();
    assert_eq!((st.prefetch_dropped, st.ahead_queued), (3, 1), "{st:?}");
}
