//! The scenarios in the repository: each parses, builds a lab description with the links its
//! planner part declares, and is planned by the planner on its declared figures.

use std::path::PathBuf;

use tessera_lab::scenario::Scenario;

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

fn planned(name: &str) -> tessera_plan::PlanOutcome {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(format!("{name}.toml"));
    let s = Scenario::load(&path).unwrap();
    let g = tessera_model::GgufFile::open(&s.model).unwrap();
    let profile = tessera_model::ModelProfile::from_gguf(&g).unwrap();
    let model = tessera_coord::planning::planner_model(&profile, name).unwrap();
    tessera_plan::plan(&model, &s.graph, 1).unwrap()
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
