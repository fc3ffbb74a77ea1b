//! The state machine's inputs ([`Event`]: a node joined or left, a plan was asked for, a node
//! loaded or linked its stage) and outputs ([`Action`]: messages to send, an epoch became ready
//! or failed).

use std::ops::Range;
use std::time::Duration;

use tessera_net::{LinkMeasurement, NodeId};

use super::member::Member;
use tessera_host::{ContentHash, Inventory};
use tessera_proto::{CoordToNode, LoadReport};

/// Inputs.
#[derive(Clone, Debug)]
pub enum Event {
    Joined(Box<Member>),
    /// A control session ended (ignored if the node has a newer session).
    Left {
        node: NodeId,
        session: u64,
    },
    /// Place `stages` (node, layers) in ring order as a new epoch; a stage that starts again
    /// at layer 0 begins another cell (a whole copy of the model with a ring of its own), and
    /// each cell becomes an epoch of its own.
    Plan {
        model: ContentHash,
        stages: Vec<(NodeId, Range<usize>)>,
        n_layer: usize,
        max_context: usize,
    },
    Loaded {
        node: NodeId,
        epoch: u64,
        report: LoadReport,
    },
    LoadFailed {
        node: NodeId,
        epoch: u64,
        reason: String,
    },
    Linked {
        node: NodeId,
        epoch: u64,
        link: Option<LinkMeasurement>,
    },
    /// A data link of the epoch could not be made, or was lost mid-epoch; `peer` is the node at
    /// its other end when the reporter knows it.
    LinkFailed {
        node: NodeId,
        epoch: u64,
        reason: String,
        peer: Option<NodeId>,
    },
    /// No run is seated on draining epoch `epoch` any more (the driver's seats say so): it is
    /// released.
    Drained {
        epoch: u64,
    },
    /// Something arrived from the node on its control session `session` (a heartbeat or any
    /// other message): its lease is renewed. `now` is the shell's clock, as for [`Event::Tick`].
    Heard {
        node: NodeId,
        session: u64,
        now: Duration,
    },
    /// Time passed: members silent for longer than the lease are declared gone. `now` is any
    /// monotonic clock the shell keeps (time since it started); only differences matter.
    Tick {
        now: Duration,
    },
    /// The coordinator measured its link to a node.
    LinkMeasured {
        node: NodeId,
        link: LinkMeasurement,
    },
    /// A node measured itself again.
    InventoryMeasured {
        node: NodeId,
        inventory: Box<Inventory>,
    },
    /// A node measured its links to other members.
    PeerLinksMeasured {
        node: NodeId,
        links: Vec<tessera_proto::PeerLink>,
    },
}

/// Outputs.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    Send {
        to: NodeId,
        msg: Box<CoordToNodeEq>,
    },
    EpochReady(u64),
    EpochFailed {
        epoch: u64,
        reason: super::EpochFailure,
    },
    /// The node's lease expired on control session `session`: the shell ends that session (the
    /// node has already been declared gone; it must join again).
    LeaseExpired {
        node: NodeId,
        session: u64,
    },
    /// A decision worth a line in the log (experts re-placed after a loss).
    Note(super::Note),
    /// A member said something its assignment does not allow (a report about an epoch it is
    /// not a stage of): nothing was done; the shell counts and logs it.
    Refused {
        node: NodeId,
        why: crate::authz::Refusal,
    },
}

/// [`CoordToNode`] with a structural equality for tests (compared as JSON).
#[derive(Clone, Debug)]
pub struct CoordToNodeEq(pub CoordToNode);

impl PartialEq for CoordToNodeEq {
    fn eq(&self, other: &Self) -> bool {
        serde_json::to_value(&self.0).ok() == serde_json::to_value(&other.0).ok()
    }
}

pub(super) fn send(to: NodeId, msg: CoordToNode) -> Action {
    Action::Send {
        to,
        msg: Box::new(CoordToNodeEq(msg)),
    }
}
