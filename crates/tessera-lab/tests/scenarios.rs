//! The scenarios in the repository: each parses, builds a lab description with the links its
//! planner part declares, and is planned by the planner on its declared figures.

use std::path::PathBuf;

use tessera_lab::run::plans::{candidates, CandidatesError};
use tessera_lab::run::{describe, Force};
use tessera_lab::scenario::{with_planner_part, Scenario};
use tessera_plan::{AutoPlanRecord, StrategyKind};

fn scenarios() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    v.sort();
    v
}

fn model(s: &Scenario) -> (tessera_model::ModelProfile, tessera_plan::ModelProfile) {
    let g = tessera_model::GgufFile::open(&s.model).unwrap();
    let profile = tessera_model::ModelProfile::from_gguf(&g).unwrap();
    let model =
        tessera_placement::planning::planner_model(&profile, Default::default(), &s.name).unwrap();
    (profile, model)
}

fn load(name: &str) -> Scenario {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(format!("{name}.toml"));
    Scenario::load(&path).unwrap()
}

fn planned(name: &str) -> tessera_plan::PlanOutcome {
    let s = load(name);
    tessera_plan::plan(&model(&s).1, &s.graph, 1).unwrap()
}

/// The lab reads the coordinator's `plan-auto.json` as the [`AutoPlanRecord`] it was written
/// as: every scenario's graph and plan read back, and nothing written is lost on the way (as a
/// non-finite figure would be, written as `null`). Compared as written, since the planner's
/// working state (a cell's throughput curve) is not in the file.
#[test]
fn every_scenarios_plan_auto_record_reads_back_as_written() {
    for p in scenarios() {
        let s = Scenario::load(&p).unwrap();
        let outcome = tessera_plan::plan(&model(&s).1, &s.graph, 1).unwrap();
        let record = AutoPlanRecord {
            graph: s.graph.clone(),
            outcome,
        };
        let json = serde_json::to_string_pretty(&record).unwrap();
        let back: AutoPlanRecord =
            serde_json::from_str(&json).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert_eq!(back.outcome.plan.strategy, record.outcome.plan.strategy);
        assert_eq!(
            serde_json::to_string_pretty(&back).unwrap(),
            json,
            "{}",
            p.display()
        );
    }
}

#[test]
fn every_scenario_is_planned_and_its_runs_are_listed_with_their_placement_or_why_not() {
    for p in scenarios() {
        let s = Scenario::load(&p).unwrap();
        let (profile, model) = model(&s);
        let o = tessera_plan::plan(&model, &s.graph, 1)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let c = candidates(&model, &profile, &s.graph, &o, &Force::default())
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert_eq!(c[0].role, "choice");
        assert!(
            c.iter().any(|c| c.placement.is_ok()),
            "{}: nothing the fabric can run",
            p.display()
        );
        for x in &c {
            if let Err(why) = &x.placement {
                assert!(!why.is_empty());
            }
        }
    }
}

#[test]
fn the_slow_node_is_left_out() {
    let o = planned("slow-node");
    assert!(
        !o.plan.nodes().contains(&"slow"),
        "{}",
        o.explanation.chosen.description
    );
}

#[test]
fn the_moe_is_ranked_as_expert_split_stage_ring_and_one_node_streaming_from_its_disk() {
    let s = load("moe-experts");
    let (profile, model) = model(&s);
    let o = tessera_plan::plan(&model, &s.graph, 1).unwrap();
    let c = candidates(&model, &profile, &s.graph, &o, &Force::default()).unwrap();
    let kinds: Vec<StrategyKind> = c.iter().map(|c| c.plan.strategy).collect();
    assert!(kinds.contains(&StrategyKind::Expert), "{kinds:?}");
    assert!(kinds.contains(&StrategyKind::Stage), "{kinds:?}");
    let expert = c
        .iter()
        .find(|c| c.plan.strategy == StrategyKind::Expert)
        .unwrap();
    assert!(
        expert.placement.as_ref().is_ok_and(|p| p.experts.is_some()),
        "the expert split executes with an expert split: {:?}",
        expert.placement.as_ref().err()
    );
    let single = c
        .iter()
        .find(|c| c.plan.strategy == StrategyKind::Single)
        .unwrap();
    // One node streaming the experts its memory cannot hold from its disk runs as an expert
    // split homed on it that owns every expert, the node told how much of them to keep.
    let placement = single
        .placement
        .as_ref()
        .expect("one node streaming executes");
    let node = &single.plan.cells[0].assignments[0];
    assert!(node.memory.disk.0 > 0, "{node:?}");
    let split = placement.experts.as_ref().expect("an expert split");
    assert_eq!(split.groups.len(), 1);
    assert_eq!(split.groups[0].node, node.node);
    assert_eq!(split.groups[0].experts.len(), profile.config.n_expert);
    let [(name, kept)] = single.streams.as_slice() else {
        panic!("one streaming budget: {:?}", single.streams)
    };
    let kept = *kept;
    assert_eq!(*name, node.node);
    let experts: u64 = model
        .layers
        .iter()
        .map(|l| l.expert.0 * u64::from(l.n_expert))
        .sum();
    assert_eq!(kept + node.memory.experts_on_disk.0, experts);
    assert!(kept > 0, "the plan keeps some experts in memory");
}

#[test]
fn a_forced_split_is_costed_as_given() {
    let s = load("home-lan");
    let (profile, model) = model(&s);
    let o = tessera_plan::plan(&model, &s.graph, 1).unwrap();
    let force = Force {
        split: Some("mini=0..1,laptop=1..3".into()),
        ..Force::default()
    };
    let c = candidates(&model, &profile, &s.graph, &o, &force).unwrap();
    let forced = c.iter().find(|c| c.role == "forced").unwrap();
    assert_eq!(describe(&forced.plan), "mini[0..1) -> laptop[1..3)");
    let ring = &forced.placement.as_ref().unwrap().ring.stages;
    assert_eq!(ring.len(), 2);
    assert_eq!(ring[0].node.as_deref(), Some("mini"));
    assert_eq!(ring[1].layers, 1..3);
    let e = candidates(
        &model,
        &profile,
        &s.graph,
        &o,
        &Force {
            split: Some("nobody=0..3".into()),
            ..Force::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(&e, CandidatesError::SplitNode { node } if node == "nobody"),
        "{e:?}"
    );
}

#[test]
fn a_calibrated_scenario_is_read_back_by_the_planner_and_the_lab() {
    let s = load("home-lan");
    let mut g = s.graph.clone();
    g.token_overhead_s = 300e-6;
    g.nodes[0].ram_compute.0 *= 0.5;
    let text = with_planner_part(&s, &g.to_toml()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calibrated.toml");
    std::fs::write(&path, &text).unwrap();
    let back = Scenario::load(&path).unwrap();
    assert_eq!(back.model, s.model.canonicalize().unwrap());
    assert_eq!(back.workload.tokens, s.workload.tokens);
    assert_eq!(back.graph.nodes[0].ram_compute, g.nodes[0].ram_compute);
    assert!((back.graph.token_overhead_s - 300e-6).abs() < 1e-12);
    let planner = tessera_lab::scenario::planner_part(&text).unwrap();
    assert!(tessera_plan::ResourceGraph::from_toml(&planner).is_ok());
    assert_eq!(
        back.lab_spec().unwrap().hosts.len(),
        s.lab_spec().unwrap().hosts.len()
    );
}

#[test]
fn every_scenario_parses_into_a_lab_with_its_model_present() {
    let all = scenarios();
    assert!(all.len() >= 6, "{all:?}");
    for p in all {
        let s = Scenario::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(
            s.model.is_file(),
            "{}: no model {}",
            p.display(),
            s.model.display()
        );
        let spec = s.lab_spec().unwrap();
        assert_eq!(spec.hosts.len(), s.graph.nodes.len() + 1, "{}", p.display());
    }
}

#[test]
fn the_model_larger_than_any_node_is_split_into_a_ring() {
    let o = planned("must-split");
    assert_eq!(
        o.plan.strategy,
        tessera_plan::StrategyKind::Stage,
        "{}",
        o.explanation.chosen.description
    );
}

#[test]
fn the_wan_keeps_every_request_on_one_machine() {
    let o = planned("wan-replicas");
    assert_ne!(
        o.plan.strategy,
        tessera_plan::StrategyKind::Stage,
        "{}",
        o.explanation.chosen.description
    );
}

/// `--hosts N`: the first N boards of the bigger-than-any scenario, each with its caps; one
/// board alone has a single-node plan that runs (with the repo's tiny stand-in model it fits
/// in memory; with the scenario's real model it streams, see tests/lab/lab_run.rs in tessera).
#[test]
fn the_first_hosts_of_a_scenario_keep_their_caps_and_one_board_alone_runs() {
    let s = load("moe-bigger-than-any");
    let all = s.lab_spec().unwrap();
    for n in 1..=4 {
        let part = s.first_hosts(n).unwrap();
        assert_eq!(part.graph.nodes.len(), n);
        assert_eq!(part.name, format!("moe-bigger-than-any-{n}h"));
        let spec = part.lab_spec().unwrap();
        // The coordinator's host, then the kept boards with the whole scenario's caps.
        assert_eq!(spec.hosts.len(), n + 1);
        for (h, whole) in spec.hosts.iter().zip(&all.hosts) {
            assert_eq!(h.name, whole.name);
            assert_eq!(h.limits.memory, whole.limits.memory);
            assert_eq!(h.disk, whole.disk);
        }
    }
    assert!(s.first_hosts(0).is_err());
    assert!(s.first_hosts(5).is_err());

    let one = s.first_hosts(1).unwrap();
    let (profile, model) = model(&one);
    let o = tessera_plan::plan(&model, &one.graph, 1).unwrap();
    let c = candidates(&model, &profile, &one.graph, &o, &Force::default()).unwrap();
    assert_eq!(
        c[0].plan.strategy,
        StrategyKind::Single,
        "{:?}",
        o.explanation
    );
    assert!(c[0].placement.is_ok(), "{:?}", c[0].placement);
}
