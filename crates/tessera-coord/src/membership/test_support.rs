//! Test helpers shared by the membership tests: members, the messages sent, an epoch driven
//! to `Ready`, the layers each node holds.

use std::ops::Range;

use tessera_net::{NodeId, NodeIdentity};

use super::{Action, Event, Member, Membership, Phase};
use tessera_host::ContentHash;
use tessera_proto::{CoordToNode, LoadReport};

pub(super) fn member(i: u8) -> Member {
    let id = NodeIdentity::from_seed([i; 32]);
    let addr = format!("127.0.0.1:{}", 4000 + u16::from(i))
        .parse()
        .unwrap();
    Member {
        session: 1,
        ..Member::hello(id.public_key(), format!("n{i}"), addr)
    }
}

pub(super) fn sends(actions: &[Action]) -> Vec<(NodeId, CoordToNode)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { to, msg } => Some((*to, msg.0.clone())),
            _ => None,
        })
        .collect()
}

pub(super) const MODEL: ContentHash = ContentHash([7; 32]);

/// Members 1, 2 and 3 joined and planned as a ring of one layer each (3 layers, 64 positions),
/// not yet loaded.
pub(super) fn three_stage_ring() -> (Membership, Member, Member, Member) {
    let mut m = Membership::new();
    let (a, b, c) = (member(1), member(2), member(3));
    for x in [&a, &b, &c] {
        m.handle(Event::Joined(Box::new(x.clone())));
    }
    m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(a.node_id, 0..1), (b.node_id, 1..2), (c.node_id, 2..3)],
        n_layer: 3,
        max_context: 64,
    });
    (m, a, b, c)
}

pub(super) fn ready(m: &mut Membership) -> u64 {
    let id = m.epoch().unwrap().id;
    ready_epoch(m, id);
    id
}

/// Drives epoch `id` (any cell's) to ready: every stage loads, then links.
pub(super) fn ready_epoch(m: &mut Membership, id: u64) {
    let nodes: Vec<NodeId> = m
        .epoch_with_id(id)
        .unwrap()
        .stages
        .iter()
        .map(|s| s.node_id)
        .collect();
    for n in &nodes {
        m.handle(Event::Loaded {
            node: *n,
            epoch: id,
            report: LoadReport::default(),
        });
    }
    for n in &nodes {
        m.handle(Event::Linked {
            node: *n,
            epoch: id,
            link: None,
        });
    }
    assert_eq!(m.epoch_with_id(id).unwrap().phase, Phase::Ready);
}

pub(super) fn layers(m: &Membership) -> Vec<(NodeId, Range<usize>)> {
    m.epoch()
        .unwrap()
        .stages
        .iter()
        .map(|s| (s.node_id, s.layers.clone()))
        .collect()
}
