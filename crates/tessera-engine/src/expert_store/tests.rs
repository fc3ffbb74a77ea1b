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
