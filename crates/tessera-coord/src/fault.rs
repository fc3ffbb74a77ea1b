//! Deliberate bugs the coordinator's machines can be told to have (tests only), so that the
//! simulator can show its invariants catch each kind. Its own module: the run machine,
//! the membership and the cell book read it.

/// A test-only fault, so the simulator can show it catches a broken machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// On resumption, re-prefill one generated token too few (resume from the wrong position).
    ResumeOneTokenShort,
    /// Hear tokens and finishes from any node (drop the rule that only the sampler sends them).
    HearAnySender,
    /// The membership's: when an owner of experts leaves, re-plan without handing its experts
    /// to anyone (the home's router would then pick experts nobody computes).
    DropDepartedOwnersExperts,
    /// Cell routing's: take cells still loading or linking as candidates too (a request would
    /// start on a cell not every node of which is ready, and open its sequence there).
    RouteToUnreadyCells,
    /// The cluster's: when a node connects again while its earlier session is still the
    /// current one, say nothing of the earlier session (its sealed jobs would wait out their
    /// job leases instead of moving at once).
    ForgetReplacedSessions,
}
