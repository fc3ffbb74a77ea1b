//! Node-to-node links: once a member has reported what it is (its inventory), every member
//! that has is asked to measure its links to the others ([`CoordToNode::MeasurePeers`]); each
//! measures only those it has not measured in its session, so a join costs the new member's
//! pairs alone. The planner prefers these to links composed from the coordinator's own,
//! which say nothing of the path between two nodes.

use tessera_net::NodeId;
use tessera_proto::{CoordToNode, PeerInfo, PeerLink};

use super::events::send;
use super::{Action, Membership};

impl Membership {
    /// A [`CoordToNode::MeasurePeers`] to every connected member with an inventory, naming the
    /// others; nothing while fewer than two have one.
    pub(super) fn measure_peers(&self) -> Vec<Action> {
        let ready: Vec<PeerInfo> = self
            .connected()
            .into_iter()
            .filter(|m| m.inventory.is_some())
            .map(|m| PeerInfo {
                node_id: m.node_id,
                key: m.key,
                addr: m.addr,
            })
            .collect();
        if ready.len() < 2 {
            return Vec::new();
        }
        ready
            .iter()
            .map(|me| {
                let peers = ready
                    .iter()
                    .filter(|p| p.node_id != me.node_id)
                    .take(CoordToNode::MAX_MEASURED_PEERS)
                    .cloned()
                    .collect();
                send(me.node_id, CoordToNode::MeasurePeers { peers })
            })
            .collect()
    }

    /// Records what `node` measured: links to members only (a report naming anyone else, or
    /// itself, is dropped), the newest figure for each. A failed measurement keeps nothing
    /// (the planner falls back to the coordinator's links).
    pub(super) fn peer_links_measured(&mut self, node: NodeId, links: Vec<PeerLink>) {
        let known: Vec<NodeId> = self
            .members
            .keys()
            .copied()
            .filter(|id| *id != node)
            .collect();
        let Some(m) = self.members.get_mut(&node) else {
            return;
        };
        for l in links {
            if let (true, Ok(link)) = (known.contains(&l.peer), l.measured) {
                m.peer_links.insert(l.peer, link);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::test_support::{member, sends};
    use super::super::Event;
    use super::*;
    use tessera_net::LinkMeasurement;

    /// A quick real probe: what is in an inventory does not matter here, only that there is one.
    fn inventory() -> Box<tessera_host::Inventory> {
        Box::new(tessera_host::measure(&tessera_host::ProbeOptions {
            memory_buffer_bytes: 1 << 16,
            memory_reps: 1,
            threads: Some(1),
            probe_time_limit: Duration::from_millis(1),
            ..Default::default()
        }))
    }

    fn with_inventory(i: u8) -> Event {
        let mut m = member(i);
        m.inventory = Some(*inventory());
        Event::Joined(Box::new(m))
    }

    fn link(ms: u64) -> LinkMeasurement {
        LinkMeasurement {
            rtt_min: Duration::from_millis(ms),
            rtt_median: Duration::from_millis(ms),
            bytes_per_s: 1e8,
            measured_at_unix_ms: 0,
        }
    }

    fn measure_requests(actions: &[Action]) -> Vec<(NodeId, Vec<NodeId>)> {
        sends(actions)
            .into_iter()
            .filter_map(|(to, m)| match m {
                CoordToNode::MeasurePeers { peers } => {
                    Some((to, peers.iter().map(|p| p.node_id).collect()))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn members_with_inventories_are_asked_to_measure_each_other() {
        let mut ms = Membership::new();
        let (a, b, c) = (member(1).node_id, member(2).node_id, member(3).node_id);
        assert!(measure_requests(&ms.handle(with_inventory(1))).is_empty());
        // Without an inventory a member is not planned for, so not measured.
        assert!(measure_requests(&ms.handle(Event::Joined(Box::new(member(2))))).is_empty());
        let out = ms.handle(with_inventory(3));
        assert_eq!(measure_requests(&out), vec![(a, vec![c]), (c, vec![a])]);
        let out = ms.handle(Event::InventoryMeasured {
            node: b,
            inventory: inventory(),
        });
        assert_eq!(
            measure_requests(&out),
            vec![(a, vec![b, c]), (b, vec![a, c]), (c, vec![a, b])]
        );
    }

    #[test]
    fn only_links_to_other_members_that_were_measured_are_kept() {
        let mut ms = Membership::new();
        ms.handle(with_inventory(1));
        ms.handle(with_inventory(2));
        let (a, b) = (member(1).node_id, member(2).node_id);
        let stranger = member(9).node_id;
        ms.handle(Event::PeerLinksMeasured {
            node: a,
            links: vec![
                PeerLink {
                    peer: b,
                    measured: Ok(link(40)),
                },
                PeerLink {
                    peer: a,
                    measured: Ok(link(1)),
                },
                PeerLink {
                    peer: stranger,
                    measured: Ok(link(1)),
                },
            ],
        });
        ms.handle(Event::PeerLinksMeasured {
            node: b,
            links: vec![PeerLink {
                peer: a,
                measured: Err("refused".into()),
            }],
        });
        let m = |id| {
            ms.connected()
                .into_iter()
                .find(|m| m.node_id == id)
                .unwrap()
                .peer_links
                .clone()
        };
        assert_eq!(m(a).into_iter().collect::<Vec<_>>(), vec![(b, link(40))]);
        assert!(m(b).is_empty());
    }
}
