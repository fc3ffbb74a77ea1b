//! Thousands of seeded fault schedules against the coordinator's machines.

use super::{simulate, Config, Summary};
use crate::run::Fault;

/// Schedules run by CI (each is a few milliseconds of real time).
const SCHEDULES: u64 = 5_000;

/// `TESSERA_SIM_SEED=N` replays one seed; `TESSERA_SIM_SCHEDULES=N` runs more.
fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("TESSERA_SIM_SEED") {
        return vec![s.parse().expect("TESSERA_SIM_SEED is a number")];
    }
    let n = std::env::var("TESSERA_SIM_SCHEDULES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SCHEDULES);
    (0..n).collect()
}

#[test]
fn thousands_of_fault_schedules_break_no_invariant() {
    let seeds = seeds();
    let mut total = Summary::default();
    for &seed in &seeds {
        let s = simulate(seed, Config::default()).unwrap_or_else(|v| panic!("{v}"));
        total.requests += s.requests;
        total.completed += s.completed;
        total.errors += s.errors;
        total.faults += s.faults;
        total.resumes += s.resumes;
        total.events += s.events;
        total.forged += s.forged;
        total.cells += usize::from(s.cells > 1);
        total.drained += s.drained;
    }
    println!(
        "simulated {} schedules: {} requests ({} with the fault-free text, {} explicit errors), \
         {} faults, {} resumptions, {} forged messages refused, {} events, {} schedules \
         with several cells, {} epochs drained after a new split replaced them",
        seeds.len(),
        total.requests,
        total.completed,
        total.errors,
        total.faults,
        total.resumes,
        total.forged,
        total.events,
        total.cells,
        total.drained
    );
    assert_eq!(total.completed + total.errors, total.requests);
    if seeds.len() as u64 >= SCHEDULES {
        // The schedules must exercise what they claim to: failures, and runs that survive them.
        assert!(total.resumes > 400, "{total:?}");
        assert!(total.forged > 500, "{total:?}");
        assert!(total.cells > 150, "{total:?}");
        assert!(total.drained > 50, "{total:?}");
        assert!(total.completed * 10 > total.requests * 8, "{total:?}");
    }
}

#[test]
fn the_simulator_catches_a_run_that_resumes_from_the_wrong_position() {
    let cfg = Config {
        fault: Some(Fault::ResumeOneTokenShort),
        ..Config::default()
    };
    let caught = (0..SCHEDULES).find_map(|seed| simulate(seed, cfg.clone()).err());
    let v = caught.expect("some schedule resumes a run, and the bug shows");
    assert!(v.what.contains("fault-free"), "{v}");
    // And the failing seed replays exactly.
    assert_eq!(simulate(v.seed, cfg).err(), Some(v));
}

#[test]
fn the_simulator_catches_a_run_that_hears_tokens_from_a_node_that_does_not_sample_it() {
    let cfg = Config {
        fault: Some(Fault::HearAnySender),
        ..Config::default()
    };
    let caught = (0..SCHEDULES).find_map(|seed| simulate(seed, cfg.clone()).err());
    let v = caught.expect("some schedule has a hostile member forge a token");
    assert!(v.what.contains("fault-free"), "{v}");
}

#[test]
fn a_schedule_replays_exactly() {
    for seed in [1, 7, 42] {
        assert_eq!(
            simulate(seed, Config::default()),
            simulate(seed, Config::default())
        );
    }
}
