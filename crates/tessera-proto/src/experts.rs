//! Expert-split placement ([`ExpertAssignment`], sent with [`super::CoordToNode::AssignExperts`])
//! and the expert-cache counters of expert streaming, as carried in control messages.

use serde::{Deserialize, Serialize};

use super::PeerInfo;

/// Which experts a node holds and whom it talks to for the others (expert-split execution).
///
/// Every node holds `held[layer]` (the experts it computes, possibly for layers outside its
/// stage). A stage node is the *home* of its layers: it runs attention and the router, computes
/// the held experts of its layers itself and sends each routed step to the [`ExpertPeer`]s that
/// own the others, one message per peer per layer. An expert-only node (`expert_only`) holds no
/// layers of the ring and only serves expert requests from `clients`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertAssignment {
    /// `held[layer]`: expert ids this node loads (ascending), for every layer of the model.
    pub held: Vec<Vec<usize>>,
    /// The node is not a ring stage: it only serves expert requests.
    #[serde(default)]
    pub expert_only: bool,
    /// Other nodes owning experts of this node's (home) layers.
    #[serde(default)]
    pub peers: Vec<ExpertPeer>,
    /// Home nodes that will send this node expert requests (admitted on connection).
    #[serde(default)]
    pub clients: Vec<PeerInfo>,
}

/// A node that computes some experts for a home stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertPeer {
    pub peer: PeerInfo,
    /// `experts[layer]`: the experts it owns, for every layer of the model.
    pub experts: Vec<Vec<usize>>,
}

/// Counters of a node's expert cache (expert streaming; cumulative since the load).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertCacheStats {
    /// Bytes of built experts kept in memory at most.
    pub budget_bytes: u64,
    /// Expert lookups (`hits + misses`).
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    /// Bytes read from disk for experts.
    pub bytes_read: u64,
    /// Microseconds computations waited for expert reads: against wall time, the share of it
    /// the node's streaming spends waiting for its disk.
    #[serde(default)]
    pub read_wait_us: u64,
    /// Microseconds during which at least one expert read was in progress (the disk busy for
    /// the store).
    #[serde(default)]
    pub disk_busy_us: u64,
    /// High-water mark of the bytes of built experts kept alive at once (cache, read window,
    /// reads in flight, experts computations took, spare allocations): within the budget plus
    /// one expert per computation.
    #[serde(default)]
    pub peak_bytes: u64,
    /// High-water mark of the raw read buffers (outside the budget).
    #[serde(default)]
    pub peak_read_buffer_bytes: u64,
}
