//! Property tests over random models and clusters.

use proptest::prelude::*;
use tessera_plan::{
    plan, usable_memory, Bytes, BytesPerSec, FlopsPerSec, LinkSpec, ModelProfile, Node, Objective,
    Plan, PlanError, Policy, Quant, ResourceGraph, Source, StrategyKind, Tier,
};

fn arb_model() -> impl Strategy<Value = ModelProfile> {
    (
        0usize..4,
        1u64..16,
        prop::sample::select(vec![256u64, 512, 1024]),
        prop::sample::select(vec![768u64, 1536, 3072]),
        prop::sample::select(vec![4u64, 8, 16]),
        prop::sample::select(vec![Quant::Q4_K, Quant::Q8_0, Quant::F16, Quant::F32]),
        any::<bool>(),
        1000u64..8000,
    )
        .prop_map(|(arch, layers, hidden, ffn, experts, quant, tied, vocab)| {
            let arch = ["llama", "qwen3", "qwen3_moe", "mixtral"][arch];
            let moe = match arch {
                "qwen3_moe" => format!(
                    r#","num_experts":{experts},"num_experts_per_tok":{},"moe_intermediate_size":{}"#,
                    experts / 4,
                    ffn / 4
                ),
                "mixtral" => format!(r#","num_local_experts":{experts},"num_experts_per_tok":2"#),
                _ => String::new(),
            };
            let cfg = format!(
                r#"{{"model_type":"{arch}","hidden_size":{hidden},"num_hidden_layers":{layers},
                "num_attention_heads":8,"num_key_value_heads":4,"intermediate_size":{ffn},
                "vocab_size":{vocab},"tie_word_embeddings":{tied}{moe}}}"#
            );
            ModelProfile::from_hf_config(&cfg, quant).expect("generated config parses")
        })
}

fn arb_node(i: usize) -> impl Strategy<Value = Node> {
    (
        300u64..700,
        prop::option::of((32u64..400, 50.0f64..500.0, 1.0f64..20.0)),
        1.0f64..100.0,
        0.05f64..2.0,
        prop::option::of((100u64..2000, 0.2f64..4.0)),
        prop::option::of(280u64..800),
    )
        .prop_map(move |(ram, vram, mem_bw, cpu, disk, budget)| Node {
            name: format!("n{i}"),
            profile: None,
            vram: vram.map(|(c, _, _)| Tier {
                capacity: Bytes::mib(c),
                bandwidth: BytesPerSec::gb_s(vram.unwrap().1),
            }),
            gpu_compute: vram.map_or(FlopsPerSec(0.0), |v| FlopsPerSec::tflops(v.2)),
            ram: Tier {
                capacity: Bytes::mib(ram),
                bandwidth: BytesPerSec::gb_s(mem_bw),
            },
            ram_compute: FlopsPerSec::tflops(cpu),
            disk: disk.map(|(c, bw)| Tier {
                capacity: Bytes::mib(c),
                bandwidth: BytesPerSec::gb_s(bw),
            }),
            memory_budget: budget.map(Bytes::mib),
        })
}

fn arb_graph() -> impl Strategy<Value = ResourceGraph> {
    (1usize..5)
        .prop_flat_map(|n| {
            let nodes: Vec<_> = (0..n).map(arb_node).collect();
            let links = prop::collection::vec((0..n, 0..n, 0.01f64..50.0, 1.0f64..1000.0), 0..6);
            (
                nodes,
                links,
                prop::option::of((0.05f64..20.0, 10.0f64..1000.0)),
                prop::sample::select(vec![
                    Objective::Latency,
                    Objective::Throughput,
                    Objective::Balanced,
                ]),
                1u32..4,
                prop::sample::select(vec![128u64, 512, 2048]),
            )
        })
        .prop_map(|(nodes, links, default, objective, concurrency, context)| {
            let mut g = ResourceGraph::default();
            for n in nodes {
                g.add_node(n, Source::Declared);
            }
            for (a, b, rtt_ms, mbit) in links {
                if a != b {
                    let (a, b) = (g.nodes[a].name.clone(), g.nodes[b].name.clone());
                    if g.links
                        .iter()
                        .all(|l| !((l.a == a && l.b == b) || (l.a == b && l.b == a)))
                    {
                        let spec = LinkSpec {
                            rtt_s: rtt_ms / 1e3,
                            bandwidth: BytesPerSec(mbit * 1e6 / 8.0),
                        };
                        g.add_link(&a, &b, spec, None, Source::Declared);
                    }
                }
            }
            g.default_link = default.map(|(ms, mbit)| LinkSpec {
                rtt_s: ms / 1e3,
                bandwidth: BytesPerSec(mbit * 1e6 / 8.0),
            });
            g.policy = Policy {
                objective,
                concurrency,
                context_tokens: context,
                prompt_tokens: context / 2,
                ..Policy::default()
            };
            g
        })
}

fn check_budgets(p: &Plan, g: &ResourceGraph) {
    let mut seen = Vec::new();
    for a in p.assignments() {
        assert!(!seen.contains(&a.node), "node {} appears twice", a.node);
        seen.push(a.node.clone());
        let node = g.node(&a.node).unwrap();
        let share = g.policy.max_memory_share;
        assert!(
            a.memory.total <= usable_memory(node, &g.policy),
            "{} over budget: {:?}",
            a.node,
            a.memory
        );
        assert!(a.memory.ram.as_f64() <= node.ram.capacity.as_f64() * share + 1.0);
        assert!(
            a.memory.vram.as_f64() <= node.vram.map_or(0.0, |t| t.capacity.as_f64() * share) + 1.0
        );
        assert!(a.memory.disk.as_f64() <= node.disk.map_or(0.0, |t| t.capacity.as_f64()) + 1.0);
    }
}

fn check_coverage(p: &Plan, m: &ModelProfile) {
    for cell in &p.cells {
        for (i, layer) in m.layers.iter().enumerate() {
            let attn = cell
                .assignments
                .iter()
                .filter(|a| a.layers.is_some_and(|r| r.contains(i)))
                .count();
            let ffn = cell
                .assignments
                .iter()
                .filter(|a| a.ffn.is_some_and(|r| r.contains(i)))
                .count();
            assert_eq!(attn, 1, "layer {i} attention placed {attn} times");
            assert_eq!(ffn, 1, "layer {i} FFN placed {ffn} times");
            if layer.is_moe() {
                for e in 0..layer.n_expert as usize {
                    let n = cell
                        .assignments
                        .iter()
                        .filter(|a| {
                            a.experts
                                .is_some_and(|s| s.layers.contains(i) && s.experts.contains(e))
                        })
                        .count();
                    assert_eq!(n, 1, "layer {i} expert {e} placed {n} times");
                }
            }
        }
        assert_eq!(cell.assignments.iter().filter(|a| a.embedding).count(), 1);
        assert_eq!(cell.assignments.iter().filter(|a| a.head).count(), 1);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn plans_respect_budgets_place_everything_once_and_hash_deterministically(
        m in arb_model(), g in arb_graph()
    ) {
        match plan(&m, &g, 3) {
            Ok(o) => {
                check_budgets(&o.plan, &g);
                check_coverage(&o.plan, &m);
                prop_assert_eq!(&o.plan.hash, &o.plan.content_hash());
                let again = plan(&m, &g, 3).unwrap();
                prop_assert_eq!(&again.plan.hash, &o.plan.hash);
                prop_assert_eq!(again.to_json(), o.to_json());
                for alt in &o.explanation.alternatives {
                    prop_assert!(alt.score <= o.explanation.chosen.score * (1.0 + 1e-9));
                }
            }
            Err(PlanError::NoFeasiblePlan { rejected }) => prop_assert!(!rejected.is_empty()),
            Err(e) => prop_assert!(false, "unexpected error {}", e),
        }
    }

    #[test]
    fn a_split_is_never_chosen_over_a_faster_single_node(m in arb_model(), g in arb_graph()) {
        let Ok(o) = plan(&m, &g, 1) else { return Ok(()) };
        let mut singles = g.clone();
        singles.policy.strategies = vec![StrategyKind::Single];
        if let Ok(s) = plan(&m, &singles, 1) {
            let objective = g.policy.objective;
            let (chosen, single) = (o.plan.predicted.score(objective), s.plan.predicted.score(objective));
            if o.plan.nodes().len() > 1 {
                prop_assert!(chosen > single, "split {} scores {} <= single {}", o.explanation.chosen.description, chosen, single);
            } else {
                prop_assert!(chosen >= single * (1.0 - 1e-9));
            }
        }
    }
}
