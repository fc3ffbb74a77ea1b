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

/// Each layer's share of the budget (pinned and cached together) follows how widely its
/// routing spreads: a layer routed to every expert in turn holds more of them than one that
/// keeps to two, which keeps no room it does not use; the pinned set stays within its share of
/// the budget, and the layers together within theirs.
#[test]
fn each_layers_share_follows_how_widely_its_routing_spreads() {
    let (g, cfg) = small_moe();
    let spec = LoadSpec::full(&cfg);
    let (nl, ne, k) = (cfg.n_layer, cfg.n_expert, cfg.n_expert_used);
    assert_eq!((nl, ne, k), (3, 8, 2), "the test model's geometry");
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
    // Thirteen experts' bytes (5, 4 and 4 evenly), half of them pinned, re-learned every token.
    let budget = eb * 13 + eb / 2;
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
    // Layer 0 routes each token to the next two of all eight experts; layer 1 always to
    // experts 0 and 1; layer 2 to expert 3 and one of 0, 1 and 2 in turn. The routing counts
    // then give every layer its two and layer 2 two more (3 and the three it turns through
    // a third of the time each, against layer 0's experts a quarter of the time each), and
    // layer 0 the rest: seven.
    for token in 0..24 {
        for layer in 0..nl {
            let used = match layer {
                0 => vec![(2 * token) % ne, (2 * token + 1) % ne],
                1 => vec![0, 1],
                _ => vec![token % 3, 3],
            };
            let slots: Vec<u32> = used.iter().map(|&e| e as u32).collect();
            store.observe(layer, 1, &slots);
            store.get_many(layer, &used).unwrap();
        }
    }
    let counts: Vec<usize> = (0..nl).map(|l| held(&store, l, ne)).collect();
    assert_eq!(counts, vec![7, 2, 4], "experts held by each layer");
    let st = store.stats();
    assert!(
        st.pinned_bytes > 0 && st.pinned_bytes <= budget / 2,
        "{st:?}"
    );
    assert!(store.resident_bytes() <= budget, "{st:?}");
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
