//! A member of the cluster as the membership machine knows it (its own file so that the
//! machine's events, which carry members, need nothing from the machine itself).

use std::net::SocketAddr;

use tessera_host::{ContentHash, Inventory};
use tessera_net::{LinkMeasurement, NodeId, PublicKey};

/// A node known to the coordinator in this run.
#[derive(Clone, Debug)]
pub struct Member {
    pub node_id: NodeId,
    pub key: PublicKey,
    pub name: String,
    /// Where the node's endpoint is, as the coordinator sees it (peers dial this).
    pub addr: SocketAddr,
    pub connected: bool,
    /// Order of joining (unpinned stages are placed in this order).
    pub joined: u64,
    pub memory_budget_bytes: Option<u64>,
    pub inventory: Option<Inventory>,
    /// Models held whole on disk.
    pub models: Vec<ContentHash>,
    /// The link coordinator → node.
    pub link: Option<LinkMeasurement>,
    /// The links node → other members, as this node measured them
    /// ([`CoordToNode::MeasurePeers`](tessera_proto::CoordToNode::MeasurePeers)).
    pub peer_links: std::collections::BTreeMap<NodeId, LinkMeasurement>,
    /// Which control session of the node this is (a node that reconnects gets a new one).
    pub session: u64,
}

impl Member {
    /// A node that has just said hello: connected, and known by nothing but its key, name and
    /// address until it reports (whoever admits it sets the session and the join order).
    pub fn hello(key: PublicKey, name: String, addr: SocketAddr) -> Self {
        Self {
            node_id: key.node_id(),
            key,
            name,
            addr,
            connected: true,
            joined: 0,
            memory_budget_bytes: None,
            inventory: None,
            models: Vec::new(),
            link: None,
            peer_links: Default::default(),
            session: 0,
        }
    }
}
