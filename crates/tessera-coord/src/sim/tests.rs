//! Thousands of seeded fault schedules against the coordinator's machines.

use super::{
    simulate, simulate_sealed, Config, Invariant, SealedSimConfig, SealedSummary, Summary,
};
use crate::run::Fault;
use crate::sealed::DeskFault;

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
    // Schedules with sealed jobs beside their runs, and what those jobs did.
    let (mut mixed, mut beside) = (0, 0);
    let mut sealed = SealedSummary::default();
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
        total.expert_owners += usize::from(s.expert_owners > 0);
        total.experts_replaced += s.experts_replaced;
        mixed += usize::from(s.requests > 0 && s.sealed.jobs > 0);
        sealed.add(&s.sealed);
        beside += s.desk_inputs_beside_runs;
    }
    println!(
        "simulated {} schedules: {} requests ({} with the fault-free text, {} explicit errors), \
         {} faults, {} resumptions, {} forged messages refused, {} events, {} schedules \
         with several cells, {} epochs drained after a new split replaced them, {} schedules \
         with an expert split, {} epochs whose experts were re-placed after an owner left",
        seeds.len(),
        total.requests,
        total.completed,
        total.errors,
        total.faults,
        total.resumes,
        total.forged,
        total.events,
        total.cells,
        total.drained,
        total.expert_owners,
        total.experts_replaced
    );
    println!(
        "{mixed} of them with sealed jobs beside the runs, through the same cluster: {} jobs \
         ({} answered, {} of them verified; {} failed with a reason; {} not sealed for want of a \
         listed worker; {} lost with a restarted coordinator), {} handed over from a node that \
         died or froze, {} liars quarantined; the desk took {beside} inputs while runs were in \
         flight",
        sealed.jobs,
        sealed.answered,
        sealed.verified,
        sealed.failed,
        sealed.unsealed,
        sealed.lost,
        sealed.handed_over,
        sealed.quarantined
    );
    assert_eq!(total.completed + total.errors, total.requests);
    let ended = sealed.answered + sealed.failed + sealed.unsealed + sealed.lost;
    assert_eq!(ended, sealed.jobs, "{sealed:?}");
    if seeds.len() as u64 >= SCHEDULES {
        // The schedules must exercise what they claim to: failures, and runs that survive them.
        assert!(total.resumes > 400, "{total:?}");
        assert!(total.forged > 500, "{total:?}");
        assert!(total.cells > 150, "{total:?}");
        assert!(total.drained > 50, "{total:?}");
        assert!(total.expert_owners > 500, "{total:?}");
        assert!(total.experts_replaced > 50, "{total:?}");
        assert!(total.completed * 10 > total.requests * 8, "{total:?}");
        // A good share of the schedules mix runs and sealed jobs, and the jobs get answered.
        assert!(mixed > 1_000, "{mixed} mixed schedules");
        assert!(
            beside > 10_000,
            "{beside} desk inputs while runs were in flight"
        );
        assert!(sealed.answered > 4_000, "{sealed:?}");
        assert!(sealed.verified > 500, "{sealed:?}");
        assert!(sealed.handed_over > 20, "{sealed:?}");
        assert!(sealed.quarantined > 20, "{sealed:?}");
        assert!(
            sealed.answered > (sealed.failed + sealed.unsealed) * 2,
            "{sealed:?}"
        );
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
    assert_eq!(v.broke, Invariant::SameTextAsFaultFree, "{v}");
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
    assert_eq!(v.broke, Invariant::SameTextAsFaultFree, "{v}");
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

#[test]
fn a_schedule_with_sealed_jobs_beside_its_runs_replays_exactly() {
    let with_jobs = |seed: &u64| {
        simulate(*seed, Config::default()).is_ok_and(|s| s.sealed.jobs > 0 && s.requests > 0)
    };
    let seeds: Vec<u64> = (0..100).filter(with_jobs).take(3).collect();
    assert_eq!(
        seeds.len(),
        3,
        "some of the first hundred seeds mix runs and jobs"
    );
    for seed in seeds {
        assert_eq!(
            simulate(seed, Config::default()),
            simulate(seed, Config::default())
        );
    }
}

/// Sealed-job schedules run by CI, beside the ring and cell schedules above.
const SEALED_SCHEDULES: u64 = 5_000;

fn sealed_seeds() -> Vec<u64> {
    if std::env::var("TESSERA_SIM_SEED").is_ok() {
        return seeds();
    }
    (0..SEALED_SCHEDULES).collect()
}

#[test]
fn thousands_of_sealed_job_schedules_break_no_invariant() {
    let seeds = sealed_seeds();
    let mut t = SealedSummary::default();
    for &seed in &seeds {
        let s = simulate_sealed(seed, SealedSimConfig::default()).unwrap_or_else(|v| panic!("{v}"));
        t.add(&s);
    }
    println!(
        "simulated {} sealed schedules: {} jobs ({} answered, {} of them verified; {} failed \
         with a reason; {} not sealed for want of a listed worker; {} unverified answers \
         refused by clients that asked for verified ones), {} handed over from a dead or \
         frozen holder, {} kills, {} freezes, {} liars quarantined, {} events",
        seeds.len(),
        t.jobs,
        t.answered,
        t.verified,
        t.failed,
        t.unsealed,
        t.refused_by_client,
        t.handed_over,
        t.kills,
        t.freezes,
        t.quarantined,
        t.events
    );
    assert_eq!(t.answered + t.failed + t.unsealed, t.jobs, "{t:?}");
    if seeds.len() as u64 >= SEALED_SCHEDULES {
        // The schedules exercise what they claim to.
        assert!(t.handed_over > 100, "{t:?}");
        assert!(t.quarantined > 20, "{t:?}");
        assert!(t.verified > 500, "{t:?}");
        assert!(t.failed > 20, "{t:?}");
        assert!(t.answered > t.failed * 2, "{t:?}");
    }
}

fn caught(fault: DeskFault) -> super::Violation {
    first_caught(
        SEALED_SCHEDULES,
        SealedSimConfig { fault: Some(fault) },
        simulate_sealed,
    )
}

/// The first of `schedules` seeds whose schedule shows the bug planted in `cfg`; the failing
/// seed replays exactly.
fn first_caught<C: Clone, S>(
    schedules: u64,
    cfg: C,
    simulate: impl Fn(u64, C) -> Result<S, super::Violation>,
) -> super::Violation {
    let v = (0..schedules)
        .find_map(|seed| simulate(seed, cfg.clone()).err())
        .expect("some schedule shows the planted bug");
    println!("caught: {v}");
    assert_eq!(simulate(v.seed, cfg).err(), Some(v.clone()));
    v
}

#[test]
fn the_sealed_simulator_catches_a_desk_that_dispatches_to_a_worker_that_left() {
    let v = caught(DeskFault::ForgetDeparted);
    assert_eq!(v.broke, Invariant::DispatchOnlyToCurrentWorkers, "{v}");
}

#[test]
fn the_sealed_simulator_catches_a_desk_that_leaves_a_dead_holders_job_to_its_lease() {
    let v = caught(DeskFault::IgnoreHolderLeft);
    assert_eq!(v.broke, Invariant::HandoverWithinLease, "{v}");
}

#[test]
fn the_simulator_catches_an_expert_split_that_loses_a_departed_owners_experts() {
    let cfg = Config {
        fault: Some(Fault::DropDepartedOwnersExperts),
        ..Config::default()
    };
    let caught = (0..SCHEDULES).find_map(|seed| simulate(seed, cfg.clone()).err());
    let v = caught.expect("some schedule loses an owner of experts, and the bug shows");
    assert_eq!(v.broke, Invariant::ExpertsHeldOnce, "{v}");
    assert_eq!(simulate(v.seed, cfg).err(), Some(v));
}

/// The first of the 5,000 schedules that shows the bug planted in `cfg`, replayed exactly.
fn caught_in_schedules(cfg: Config) -> super::Violation {
    first_caught(SCHEDULES, cfg, simulate)
}

#[test]
fn the_simulator_catches_a_router_that_sends_a_request_to_a_cell_still_being_made() {
    let v = caught_in_schedules(Config {
        fault: Some(Fault::RouteToUnreadyCells),
        ..Config::default()
    });
    assert_eq!(v.broke, Invariant::RouteOnlyToReadyCells, "{v}");
}

#[test]
fn the_simulator_catches_a_desk_that_leaves_a_dead_nodes_job_to_its_lease_beside_runs() {
    // The same planted bug as above, in the schedules that mix sealed jobs with runs: there
    // the desk hears a node left only from the cluster's lease.
    let v = caught_in_schedules(Config {
        desk_fault: Some(DeskFault::IgnoreHolderLeft),
        ..Config::default()
    });
    assert_eq!(v.broke, Invariant::HandoverWithinLease, "{v}");
}

#[test]
fn the_simulator_catches_a_cluster_that_forgets_a_restarted_workers_earlier_session() {
    // A node killed and restarted within its lease comes back on a new session before the
    // lease could expire: unless the cluster says its earlier session left, the job its worker
    // held waits out the job's own lease.
    let v = caught_in_schedules(Config {
        fault: Some(Fault::ForgetReplacedSessions),
        ..Config::default()
    });
    assert_eq!(v.broke, Invariant::HandoverWithinLease, "{v}");
}
