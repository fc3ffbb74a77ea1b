//! The epoch part of the membership machine: loading, linking, failing and draining.

use super::*;
use crate::membership::test_support::*;
use crate::membership::Event;

#[test]
fn epoch_goes_loading_linking_ready_as_a_ring() {
    let mut m = Membership::new();
    let (a, b) = (member(1), member(2));
    m.handle(Event::Joined(Box::new(a.clone())));
    m.handle(Event::Joined(Box::new(b.clone())));
    assert_eq!(m.connected()[0].node_id, a.node_id);
    let acts = m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(a.node_id, 0..3), (b.node_id, 3..5)],
        n_layer: 5,
        max_context: 128,
    });
    let s = sends(&acts);
    assert_eq!(s.len(), 2);
    let CoordToNode::Assign(first) = &s[0].1 else {
        panic!()
    };
    let CoordToNode::Assign(last) = &s[1].1 else {
        panic!()
    };
    assert!(first.embed && !first.head && last.head && !last.embed);
    // A ring: the last stage's next is the first.
    assert_eq!(first.next.as_ref().unwrap().node_id, b.node_id);
    assert_eq!(last.next.as_ref().unwrap().node_id, a.node_id);
    assert_eq!(first.prev.as_ref().unwrap().key, b.key);
    let epoch = first.epoch;
    let loaded = |n: NodeId| Event::Loaded {
        node: n,
        epoch,
        report: LoadReport::default(),
    };
    assert!(m.handle(loaded(a.node_id)).is_empty());
    let links = sends(&m.handle(loaded(b.node_id)));
    assert_eq!(links.len(), 2);
    assert!(matches!(links[0].1, CoordToNode::Link { .. }));
    assert!(m
        .handle(Event::Linked {
            node: a.node_id,
            epoch,
            link: None
        })
        .is_empty());
    assert_eq!(
        m.handle(Event::Linked {
            node: b.node_id,
            epoch,
            link: None
        }),
        vec![Action::EpochReady(epoch)]
    );
    assert_eq!(m.epoch().unwrap().phase, Phase::Ready);
}

#[test]
fn a_departed_stage_fails_the_epoch_and_a_new_plan_releases_the_old() {
    let mut m = Membership::new();
    let (a, b) = (member(1), member(2));
    m.handle(Event::Joined(Box::new(a.clone())));
    m.handle(Event::Joined(Box::new(b.clone())));
    m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(a.node_id, 0..5)],
        n_layer: 5,
        max_context: 128,
    });
    let acts = m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(b.node_id, 0..5)],
        n_layer: 5,
        max_context: 128,
    });
    let s = sends(&acts);
    assert!(matches!(s[0], (n, CoordToNode::Release { epoch: 1 }) if n == a.node_id));
    assert!(matches!(&s[1].1, CoordToNode::Assign(x) if x.epoch == 2 && x.next.is_none()));
    let acts = m.handle(Event::Left {
        node: b.node_id,
        session: 1,
    });
    assert!(acts
        .iter()
        .any(|x| matches!(x, Action::EpochFailed { epoch: 2, .. })));
    // Stale reports of an old epoch change nothing.
    assert!(m
        .handle(Event::Loaded {
            node: a.node_id,
            epoch: 1,
            report: LoadReport::default()
        })
        .is_empty());
}

#[test]
fn a_plan_on_a_disconnected_node_fails_at_once() {
    let mut m = Membership::new();
    let a = member(1);
    m.handle(Event::Joined(Box::new(a.clone())));
    m.handle(Event::Left {
        node: a.node_id,
        session: 1,
    });
    let acts = m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(a.node_id, 0..5)],
        n_layer: 5,
        max_context: 128,
    });
    assert!(matches!(acts.last(), Some(Action::EpochFailed { .. })));
}

#[test]
fn each_assignment_carries_the_expert_budget_the_plan_gave_its_node() {
    let mut m = Membership::new();
    let (a, b) = (member(1), member(2));
    m.handle(Event::Joined(Box::new(a.clone())));
    m.handle(Event::Joined(Box::new(b.clone())));
    // The plan streams experts on n1 (by name) only.
    m.set_expert_budgets([(a.name.clone(), 123 << 20)].into_iter().collect());
    let acts = m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(a.node_id, 0..3), (b.node_id, 3..5)],
        n_layer: 5,
        max_context: 128,
    });
    let budgets: Vec<(NodeId, Option<u64>)> = sends(&acts)
        .into_iter()
        .filter_map(|(to, msg)| match msg {
            CoordToNode::Assign(x) => Some((to, x.expert_budget)),
            _ => None,
        })
        .collect();
    assert_eq!(
        budgets,
        vec![(a.node_id, Some(123 << 20)), (b.node_id, None)]
    );
}
