//! What the simulators check and how a broken check is reported, shared by every kind of
//! schedule (`world/`, `sealed.rs`, and the sealed jobs both carry, `jobs.rs`).

use std::time::Duration;

/// An invariant that broke, with the seed and virtual time to replay it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub seed: u64,
    pub at: Duration,
    /// Which invariant: what the simulator's own tests match.
    pub broke: Invariant,
    /// The particulars, for the person replaying the seed.
    pub what: String,
}

/// The simulators' invariants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invariant {
    /// Every request streams, and ends with, the fault-free run's tokens.
    SameTextAsFaultFree,
    /// Every request ends (before the time limit, and by the end of the schedule).
    EveryRequestEnds,
    /// A request that fails says why; none is cancelled that nobody cancelled.
    HonestEndings,
    /// Epoch numbers only grow.
    EpochsGrow,
    /// A sequence is opened only on a node given that epoch.
    OpenOnlyWhereGiven,
    /// A request is routed only to a ready cell: no sequence is opened on an epoch before
    /// every node given it reported it linked.
    RouteOnlyToReadyCells,
    /// Every expert of every MoE layer is held exactly once when an expert split links.
    ExpertsHeldOnce,
    /// A node that is up and enrolled is a connected member once the world settles, and holds
    /// no sequence after every request ended.
    SettledMembers,
    /// Sealed: no envelope goes to a worker that left, was quarantined or is unknown.
    DispatchOnlyToCurrentWorkers,
    /// Sealed: only a worker that altered an answer is quarantined.
    QuarantineOnlyLiars,
    /// Sealed: a client hears only of its own jobs, and nothing after a job's end.
    NewsOfLiveJobsOnly,
    /// Sealed: a verified answer is the honest one.
    VerifiedIsHonest,
    /// Sealed: a failed job says why its candidates were passed over.
    FailuresSayWhy,
    /// Sealed: a job held by a worker that stopped moves on within the node lease.
    HandoverWithinLease,
    /// Sealed: every job ends, and the desk holds nothing afterwards.
    EveryJobEnds,
    /// The simulator's own sealing failed (a defect of the harness, not of the desk).
    Harness,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seed {} at {:?}: {:?} broke: {} (replay: TESSERA_SIM_SEED={} cargo test -p \
             tessera-coord sim::)",
            self.seed, self.at, self.broke, self.what, self.seed
        )
    }
}
