//! Expert streaming: a model whose experts are read from the file through a small RAM cache
//! computes bit-identical logits to the fully loaded model, and a budget below one expert is
//! refused. (No timing here: the prefetch thread only changes what is cached, never outputs.)

mod common;

use common::assert_bits_eq;
use tessera_engine::ops::argmax;
use tessera_engine::{ExpertStreaming, LoadSpec, Model};
use tessera_model::{GgufFile, ModelConfig};

const PROMPTS: [&[u32]; 3] = [&[1, 403, 407, 261, 378, 300, 42], &[1, 17, 99], &[5]];
const DECODE_STEPS: usize = 4;

fn streamed(g: &GgufFile, s: ExpertStreaming, threads: usize) -> Model {
    let cfg = ModelConfig::from_gguf(g).unwrap();
    Model::load_streaming(g, LoadSpec::full(&cfg), s, threads, &mut |_, _| {}).unwrap()
}

/// Built bytes of one expert (from a store with room for everything).
fn expert_bytes(g: &GgufFile) -> u64 {
    let nothing_read = ExpertStreaming {
        fill: false,
        ..ExpertStreaming::with_budget(u64::MAX / 2)
    };
    let m = streamed(g, nothing_read, 1);
    m.expert_stats().unwrap().expert_bytes
}

/// Prompt then greedy decode, every row's logits of every step, on both models.
fn compare(name: &str, full: &Model, s: &Model) {
    for (pi, prompt) in PROMPTS.iter().enumerate() {
        let mut kv_a = common::kv_for(full);
        let mut kv_b = common::kv_for(s);
        let mut a = full.forward(prompt, &mut kv_a).unwrap();
        let mut b = s.forward(prompt, &mut kv_b).unwrap();
        for step in 0..=DECODE_STEPS {
            assert_bits_eq(&a.data, &b.data, &format!("{name} prompt {pi} step {step}"));
            let t = argmax(a.last()) as u32;
            a = full.forward(&[t], &mut kv_a).unwrap();
            b = s.forward(&[t], &mut kv_b).unwrap();
        }
    }
    // A batch step of several sequences at different positions.
    let mut kvs_a: Vec<_> = (0..3).map(|_| common::kv_for(full)).collect();
    let mut kvs_b: Vec<_> = (0..3).map(|_| common::kv_for(s)).collect();
    for (i, p) in PROMPTS.iter().enumerate() {
        full.forward(p, &mut kvs_a[i]).unwrap();
        s.forward(p, &mut kvs_b[i]).unwrap();
    }
    for step in 0..3u32 {
        let mut sa: Vec<(u32, &mut _)> = kvs_a.iter_mut().map(|k| (7 + step, k)).collect();
        let mut sb: Vec<(u32, &mut _)> = kvs_b.iter_mut().map(|k| (7 + step, k)).collect();
        let la = full.step(&mut sa).unwrap();
        let lb = s.step(&mut sb).unwrap();
        assert_bits_eq(&la.data, &lb.data, &format!("{name} batch step {step}"));
    }
}

fn check(name: &str) {
    let g = common::open(name);
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let full = common::full(&g, 2);
    let eb = expert_bytes(&g);
    // The layers holding experts (Llama 4's alternate with dense ones).
    let n_layer = (0..cfg.n_layer).filter(|&l| cfg.is_moe_layer(l)).count() as u64;
    let settings = [
        // One expert in all: a shared LRU, every expert computed alone, nearly all misses.
        ExpertStreaming {
            prefetch: false,
            read_parallelism: 1,
            ..ExpertStreaming::with_budget(eb)
        },
        // Two experts per layer, a pinned share, prefetch: many misses and evictions.
        ExpertStreaming {
            repin_every: 2,
            ..ExpertStreaming::with_budget(eb * 3 * n_layer)
        },
        // A shared LRU with prefetch, no pinning.
        ExpertStreaming {
            pinned_fraction: 0.0,
            ..ExpertStreaming::with_budget(eb * 3)
        },
        // Eager prefetch (every predicted expert, whatever its probability) racing the demand
        // reads of a small cache; buffered reads (page cache dropped by advice), 2 readers.
        ExpertStreaming {
            prefetch_max: usize::MAX,
            prefetch_min_prob: 0.0,
            drop_page_cache: false,
            read_parallelism: 2,
            ..ExpertStreaming::with_budget(eb * 2 * n_layer)
        },
        // Room for one expert per layer (fewer than a routing uses) and a read window of two:
        // a layer's misses beyond its room are read ahead through the window, out of order
        // with the computation, and complete as orphans outside the cache.
        ExpertStreaming {
            pinned_fraction: 0.0,
            read_parallelism: 2,
            ..ExpertStreaming::with_budget(eb * (n_layer + 2))
        },
    ];
    for (i, st) in settings.into_iter().enumerate() {
        let st_copy = st.clone();
        let s = streamed(&g, st, 2);
        compare(&format!("{name} setting {i}"), &full, &s);
        let stats = s.expert_stats().unwrap();
        assert_eq!(stats.lookups, stats.hits + stats.misses, "{stats:?}");
        assert!(stats.misses > 0, "{stats:?}");
        assert!(stats.bytes_read > 0, "{stats:?}");
        check_peak(&stats, 1, &st_copy);
        if i == 0 {
            // One expert in all and routings of several: each layer's second expert is read
            // while its first is still needed, so the peak (unlike the cache's own counters)
            // sees the expert beyond the budget.
            assert!(stats.peak_bytes > st_copy.budget_bytes, "{stats:?}");
        }
        assert_eq!(
            s.resident_bytes() as u64,
            s.weights().resident_bytes() as u64 + stats.cached_bytes + stats.pinned_bytes
        );
        assert!(stats.prefetch_useful <= stats.prefetch_issued, "{stats:?}");
        if i == 3 {
            assert!(stats.prefetch_issued > 0, "{stats:?}");
            assert!(!stats.direct_io, "{stats:?}");
        }
        if i == 4 && cfg.n_expert_used > 1 {
            assert!(stats.window_reads > 0, "{stats:?}");
            assert!(stats.per_layer_lru, "{stats:?}");
        } else if i == 4 {
            // Top-1 routing: one expert per layer is a whole routing, so no window is set
            // aside.
            assert_eq!(stats.window_reads, 0, "{stats:?}");
            assert!(stats.per_layer_lru, "{stats:?}");
        } else if !stats.per_layer_lru {
            assert_eq!(
                stats.window_reads, 0,
                "no window with a shared LRU: {stats:?}"
            );
        }
        // Without expert weights held up front, the streamed part keeps less than the full one.
        assert!(s.weights().resident_bytes() < full.resident_bytes());
        let json = serde_json::to_string(&stats).unwrap();
        assert!(json.contains("\"hits\""));
    }
}

/// The store's high-water mark (built experts cached, pinned, in the read window, taken by a
/// computation, being read, and the free memory its slot pool keeps; see `expert_store/peak.rs`)
/// stays within the budget plus one expert for each of `computations` using the store at once,
/// and is at least the end state the cache reports. The raw read buffers (outside the budget) stay within one
/// buffer per pooled slot and reader, each at most a matrix's aligned byte range.
fn check_peak(stats: &tessera_engine::ExpertStats, computations: u64, st: &ExpertStreaming) {
    let budget = st.budget_bytes;
    assert!(
        stats.peak_bytes >= stats.cached_bytes + stats.pinned_bytes,
        "the peak is below the end state: {stats:?}"
    );
    assert!(
        stats.peak_bytes <= budget + computations * stats.expert_bytes,
        "the store held {} bytes at its peak, over the budget of {budget} plus \
         {computations} expert(s) of {}: {stats:?}",
        stats.peak_bytes,
        stats.expert_bytes
    );
    // A matrix's raw range is smaller than its built copy; O_DIRECT adds at most two pages.
    let buffers = (READ_BUFFER_POOL + st.read_parallelism.max(1)) as u64;
    assert!(
        stats.peak_read_buffer_bytes <= buffers * (stats.expert_bytes + 2 * 4096),
        "{stats:?}"
    );
}

/// Raw read buffers the reader keeps for reuse (`file_reader.rs`'s `POOL_MAX`).
const READ_BUFFER_POOL: usize = 12;

#[test]
fn streamed_experts_are_bit_identical_tiny() {
    check("tiny-qwen3moe-Q8_0.gguf");
}

#[test]
fn streamed_experts_are_bit_identical_small() {
    check("small-qwen3moe-Q8_0.gguf");
}

/// Experts in IQ2_XXS, the type big MoE files ship in: its repacked size is what the cache
/// budgets, and a streamed expert builds into an evicted one's buffer.
#[test]
fn streamed_experts_are_bit_identical_iq2_xxs() {
    check("small-qwen3moe-IQ2_XXS.gguf");
}

/// Llama 4: MoE layers every second layer with dense ones between (the store serves the MoE
/// ones, the next MoE layer is the one predicted), a shared expert beside top-1 routing.
#[test]
fn streamed_experts_are_bit_identical_llama4() {
    check("tiny-llama4-Q8_0.gguf");
}

#[test]
fn budget_below_one_expert_is_refused() {
    let g = common::open("tiny-qwen3moe-Q8_0.gguf");
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let eb = expert_bytes(&g);
    let err = Model::load_streaming(
        &g,
        LoadSpec::full(&cfg),
        ExpertStreaming::with_budget(eb - 1),
        1,
        &mut |_, _| {},
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("smaller than one expert"), "{msg}");
    // Exactly one expert is enough.
    streamed(&g, ExpertStreaming::with_budget(eb), 1);
}

#[test]
fn pinned_set_is_learned_and_stats_add_up() {
    let g = common::open("small-qwen3moe-Q8_0.gguf");
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let eb = expert_bytes(&g);
    let s = streamed(
        &g,
        ExpertStreaming {
            repin_every: 1,
            prefetch: false,
            fill: false,
            ..ExpertStreaming::with_budget(eb * 4 * cfg.n_layer as u64)
        },
        1,
    );
    let mut kv = common::kv_for(&s);
    let mut l = s.forward(PROMPTS[0], &mut kv).unwrap();
    for _ in 0..6 {
        let t = argmax(l.last()) as u32;
        l = s.forward(&[t], &mut kv).unwrap();
    }
    let st = s.expert_stats().unwrap();
    assert!(st.pinned_experts > 0, "{st:?}");
    assert!(st.pinned_bytes <= st.budget_bytes / 4, "{st:?}");
    assert_eq!(st.tokens, PROMPTS[0].len() as u64 + 6);
    // Without prefetch or fill every byte read was a miss.
    assert_eq!(st.bytes_read, st.miss_bytes_read);
    assert_eq!(st.prefetch_issued, 0);
    assert_eq!(st.filled, 0);
}

/// A new store fills its cache before anything asks: with room for every expert, the first
/// request reads nothing (and nothing is predicted); with room for some, the budget is used
/// from the start (the LRUs and, before routing has chosen a pinned set, the pinned share), and
/// the first pinned set keeps the fill's experts it wants and moves the others to their LRUs'
/// room. Outputs stay
/// bit-identical to the full load throughout.
#[test]
fn a_new_store_fills_its_budget_before_the_first_request() {
    let g = common::open("small-qwen3moe-Q8_0.gguf");
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let full = common::full(&g, 2);
    let eb = expert_bytes(&g);
    let all = eb * (cfg.n_layer * cfg.n_expert) as u64;

    let roomy = streamed(&g, ExpertStreaming::with_budget(all), 2);
    roomy.wait_experts_filled();
    let st = roomy.expert_stats().unwrap();
    assert_eq!(st.filled, st.experts_served, "{st:?}");
    assert_eq!(st.cached_bytes + st.pinned_bytes, all, "{st:?}");
    compare("filled, room for all", &full, &roomy);
    let st = roomy.expert_stats().unwrap();
    assert_eq!((st.misses, st.hits), (0, st.lookups), "{st:?}");
    assert_eq!(st.miss_bytes_read, 0, "{st:?}");
    // Nothing can miss, so nothing is predicted (the router product would only cost time).
    assert_eq!(st.predicted, 0, "{st:?}");

    // Room for three experts a layer, a quarter of it pinned: every layer's LRU and the pinned
    // share are full to within one expert before the first token.
    let n_layer = cfg.n_layer as u64;
    let budget = eb * 3 * n_layer;
    let settings = ExpertStreaming {
        repin_every: 2,
        ..ExpertStreaming::with_budget(budget)
    };
    let some = streamed(&g, settings.clone(), 2);
    some.wait_experts_filled();
    let st = some.expert_stats().unwrap();
    let held = st.cached_bytes + st.pinned_bytes;
    assert!(
        held <= budget && held + (n_layer + 1) * eb > budget,
        "{st:?}"
    );
    assert!(
        st.pinned_bytes > 0 && st.pinned_bytes <= budget / 4,
        "{st:?}"
    );
    assert_eq!(st.misses, 0, "{st:?}");
    assert_eq!(st.filled, held / eb, "{st:?}");
    // Decoding re-learns the pinned set every two tokens: the fill's pins it does not want move
    // to room in their LRUs, none is read twice for it, and the budget holds.
    compare("filled, room for some", &full, &some);
    let after = some.expert_stats().unwrap();
    assert_eq!(after.lookups, after.hits + after.misses, "{after:?}");
    assert!(after.hits > 0 && after.misses > 0, "{after:?}");
    assert_eq!(
        after.filled, st.filled,
        "the fill reads only while the store is new"
    );
    assert!(after.predicted > 0, "{after:?}");
    assert!(
        after.cached_bytes + after.pinned_bytes <= budget,
        "{after:?}"
    );
    check_peak(&after, 2, &settings);
}

#[test]
fn expert_only_part_streams_its_experts() {
    use tessera_engine::{ExpertSelection, PartExperts};
    let g = common::open("tiny-qwen3moe-Q8_0.gguf");
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let full = common::full(&g, 1);
    let eb = expert_bytes(&g);
    let n = cfg.n_expert;
    let half: Vec<usize> = (0..n / 2).collect();
    let rest: Vec<usize> = (n / 2..n).collect();
    // The dense part holds the first half of the experts; the second half is streamed by an
    // experts-only part.
    let mut dense = LoadSpec::full(&cfg);
    dense.experts = ExpertSelection::same_in_every_layer(&half, cfg.n_layer);
    let dense = common::load(&g, dense, 1);
    let experts = Model::load_streaming(
        &g,
        LoadSpec::experts_only(
            0..cfg.n_layer,
            ExpertSelection::same_in_every_layer(&rest, cfg.n_layer),
        ),
        ExpertStreaming::with_budget(eb * 2),
        1,
        &mut |_, _| {},
    )
    .unwrap();
    assert!(!experts.holds_expert(0, 0) && experts.holds_expert(0, n - 1));
    let mut kv_a = common::kv_for(&full);
    let mut kv_b = common::kv_for(&dense);
    let mut tokens = PROMPTS[0].to_vec();
    for step in 0..4 {
        let a = full.forward(&tokens, &mut kv_a).unwrap();
        let mut h = dense.embed(&tokens).unwrap();
        let start_pos = kv_b.len();
        dense
            .run_layers(
                0..cfg.n_layer,
                &mut h,
                &[tessera_engine::SeqStep {
                    n_tokens: tokens.len(),
                    start_pos,
                }],
                &mut [&mut kv_b],
                &mut PartExperts(vec![&dense, &experts]),
            )
            .unwrap();
        let b = dense.head(&h).unwrap();
        assert_bits_eq(&a.data, &b.data, &format!("step {step}"));
        tokens = vec![argmax(a.last()) as u32];
    }
    assert!(experts.expert_stats().unwrap().misses > 0);
}

#[test]
fn stats_source_outlives_moves_and_sums() {
    let g = common::open("tiny-qwen3moe-Q8_0.gguf");
    let eb = expert_bytes(&g);
    // No fill: the counters must not move between the two reads below.
    let cold = ExpertStreaming {
        fill: false,
        ..ExpertStreaming::with_budget(eb * 2)
    };
    let s = streamed(&g, cold, 1);
    let source = s.expert_stats_source().expect("streamed");
    // The model moves to another thread (as a node's stage does); the handle still reads it.
    let h = std::thread::spawn(move || {
        let mut kv = common::kv_for(&s);
        s.forward(PROMPTS[0], &mut kv).unwrap();
        s
    });
    let s = h.join().unwrap();
    let a = source.stats().expect("live");
    assert_eq!(a, s.expert_stats().unwrap());
    assert!(a.lookups > 0 && a.misses > 0, "{a:?}");
    let mut sum = a.clone();
    sum.add(&a);
    assert_eq!(sum.lookups, 2 * a.lookups);
    assert_eq!(sum.bytes_read, 2 * a.bytes_read);
    assert_eq!(sum.budget_bytes, 2 * a.budget_bytes);
    drop(s);
    assert!(source.stats().is_none(), "the store is gone");
    // A model without streamed experts has no source.
    let full = common::full(&g, 1);
    assert!(full.expert_stats_source().is_none());
}

#[test]
fn concurrent_computations_on_one_store_stay_exact() {
    // A node serving several homes computes their layers' experts at once on one store (each
    // request on its own blocking thread). With a budget that forces the read window, two
    // threads computing different layers interleave their reads, windows and orphans; every
    // output must still equal the fully loaded model's, and nothing may hang.
    use std::sync::Arc;
    use tessera_engine::Hidden;
    let g = common::open("small-qwen3moe-Q8_0.gguf");
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let full = Arc::new(common::full(&g, 1));
    let eb = expert_bytes(&g);
    // The layers holding experts (Llama 4's alternate with dense ones).
    let n_layer = (0..cfg.n_layer).filter(|&l| cfg.is_moe_layer(l)).count() as u64;
    let settings = ExpertStreaming {
        pinned_fraction: 0.0,
        read_parallelism: 2,
        ..ExpertStreaming::with_budget(eb * (n_layer + 2))
    };
    let s = Arc::new(streamed(&g, settings.clone(), 1));
    let threads: Vec<_> = (0..2)
        .map(|tid| {
            let (full, s, d) = (full.clone(), s.clone(), cfg.n_embd);
            std::thread::spawn(move || {
                let mut seed = 17 + tid as u32;
                for it in 0..24 {
                    let layer = (it * 2 + tid) % full.config().n_layer;
                    let n = 1 + it % 5;
                    let mut h = Hidden::zeros(n, d);
                    for t in 0..n {
                        for x in h.row_mut(t) {
                            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                            *x = (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                        }
                    }
                    let routing = full.moe_route(layer, &h).unwrap();
                    let want = full.moe_experts(layer, &h, &routing, &|_| true).unwrap();
                    let got = s.moe_experts(layer, &h, &routing, &|_| true).unwrap();
                    assert_eq!(got, want, "thread {tid} iteration {it} layer {layer}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a computing thread failed");
    }
    let st = s.expert_stats().unwrap();
    assert!(st.misses > 0 && st.window_reads > 0, "{st:?}");
    // Two computations at once: each may hold one expert outside the cache.
    check_peak(&st, 2, &settings);
}
