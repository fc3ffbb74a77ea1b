//! Cells: several whole copies of the model, each an epoch of its own (see the module docs of
//! [`super`]). These tests drive the machine through plans of several cells, a loss in one,
//! and a node that joins while a cell is missing.

use super::test_support::*;
use super::*;

fn joined(m: &mut Membership, n: &Member) -> Vec<Action> {
    m.handle(Event::Joined(Box::new(n.clone())))
}

/// The nodes of each cell, by slot, with its phase.
fn cells(m: &Membership) -> Vec<(Vec<NodeId>, Phase)> {
    m.cells()
        .iter()
        .map(|e| {
            (
                e.stages.iter().map(|s| s.node_id).collect(),
                e.phase.clone(),
            )
        })
        .collect()
}

#[test]
fn each_cell_is_an_epoch_with_a_ring_of_its_own_and_becomes_ready_alone() {
    let mut m = Membership::new();
    let (a, b, c) = (member(1), member(2), member(3));
    for n in [&a, &b, &c] {
        joined(&mut m, n);
    }
    let acts = m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(a.node_id, 0..5), (b.node_id, 0..2), (c.node_id, 2..5)],
        n_layer: 5,
        max_context: 64,
    });
    let assigns: Vec<_> = sends(&acts)
        .into_iter()
        .filter_map(|(n, x)| match x {
            CoordToNode::Assign(s) => Some((n, s)),
            _ => None,
        })
        .collect();
    assert_eq!(assigns.len(), 3);
    // a alone: one stage, no neighbours, embeds and samples.
    let (_, sa) = &assigns[0];
    assert!(sa.n_stages == 1 && sa.next.is_none() && sa.embed && sa.head);
    // b and c: a ring of two of its own, numbered from 0, in another epoch.
    let (_, sb) = &assigns[1];
    let (_, sc) = &assigns[2];
    assert_eq!((sb.stage, sb.n_stages, sc.stage, sc.n_stages), (0, 2, 1, 2));
    assert_eq!(sb.next.as_ref().unwrap().node_id, c.node_id);
    assert_eq!(sc.next.as_ref().unwrap().node_id, b.node_id);
    assert!(sb.embed && !sb.head && sc.head && !sc.embed);
    assert_ne!(sa.epoch, sb.epoch);
    assert_eq!(sb.epoch, sc.epoch);
    // The second cell serves before the first has loaded.
    ready_epoch(&mut m, sb.epoch);
    let ready: Vec<u64> = m.ready_cells().map(|e| e.id).collect();
    assert_eq!(ready, vec![sb.epoch]);
    ready_epoch(&mut m, sa.epoch);
    assert_eq!(m.ready_cells().count(), 2);
    assert_eq!(m.cells()[1].cell, 1);
}

#[test]
fn a_loss_replans_only_its_cell_on_a_spare_node_and_the_other_cell_is_not_touched() {
    let mut m = Membership::new();
    let (a, b, c) = (member(1), member(2), member(3));
    for n in [&a, &b, &c] {
        joined(&mut m, n);
    }
    m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(a.node_id, 0..5), (b.node_id, 0..5)],
        n_layer: 5,
        max_context: 64,
    });
    let (e0, e1) = (m.cells()[0].id, m.cells()[1].id);
    ready_epoch(&mut m, e0);
    ready_epoch(&mut m, e1);
    let acts = m.handle(Event::Left {
        node: b.node_id,
        session: 1,
    });
    // Nothing is said to a: its cell goes on serving.
    assert!(
        sends(&acts).iter().all(|(n, _)| *n != a.node_id),
        "{acts:?}"
    );
    assert!(acts
        .iter()
        .any(|x| matches!(x, Action::EpochFailed { epoch, .. } if *epoch == e1)));
    // Cell 1 is placed again on c, the node no live cell holds.
    assert_eq!(
        cells(&m),
        vec![
            (vec![a.node_id], Phase::Ready),
            (vec![c.node_id], Phase::Loading)
        ]
    );
    assert_eq!(m.cells()[0].id, e0);
    assert!(m.outage().is_none());
}

#[test]
fn a_node_joining_while_a_cell_is_missing_places_it_and_the_serving_cell_is_not_touched() {
    let mut m = Membership::new();
    let (a, b) = (member(1), member(2));
    joined(&mut m, &a);
    joined(&mut m, &b);
    m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(a.node_id, 0..5), (b.node_id, 0..5)],
        n_layer: 5,
        max_context: 64,
    });
    let (e0, e1) = (m.cells()[0].id, m.cells()[1].id);
    ready_epoch(&mut m, e0);
    ready_epoch(&mut m, e1);
    // b goes and nobody can take its cell: the service goes on with one cell, no outage.
    let acts = m.handle(Event::Left {
        node: b.node_id,
        session: 1,
    });
    assert!(acts
        .iter()
        .any(|x| matches!(x, Action::Note(Note::CellNotPlaced { cell: 1, .. }))));
    assert!(m.outage().is_none());
    assert_eq!(m.ready_cells().map(|e| e.id).collect::<Vec<_>>(), vec![e0]);
    // A new node joins: cell 1 is placed on it; a hears nothing.
    let d = member(4);
    let acts = joined(&mut m, &d);
    let s = sends(&acts);
    assert_eq!(s.len(), 1, "{s:?}");
    assert!(matches!(&s[0], (n, CoordToNode::Assign(x)) if *n == d.node_id && x.n_stages == 1));
    let e2 = m.cells()[1].id;
    assert!(e2 > e1);
    ready_epoch(&mut m, e2);
    assert_eq!(m.ready_cells().count(), 2);
    assert_eq!(m.cells()[0].id, e0, "the serving cell kept its epoch");
    // A further node has no cell to fill: nothing is planned.
    assert!(joined(&mut m, &member(5)).is_empty());
}

#[test]
fn with_every_cell_lost_the_cluster_is_in_outage_until_a_node_joins() {
    let mut m = Membership::new();
    let (a, b) = (member(1), member(2));
    joined(&mut m, &a);
    joined(&mut m, &b);
    m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(a.node_id, 0..5), (b.node_id, 0..5)],
        n_layer: 5,
        max_context: 64,
    });
    for n in [&a, &b] {
        m.handle(Event::Left {
            node: n.node_id,
            session: 1,
        });
    }
    assert!(m.ready_cells().next().is_none());
    assert!(m.outage().is_some(), "no cell left is an outage");
    let c = member(3);
    joined(&mut m, &c);
    assert!(m.outage().is_none());
    assert_eq!(cells(&m)[0], (vec![c.node_id], Phase::Loading));
}

#[test]
fn an_expert_split_is_one_cell() {
    let mut m = Membership::new();
    let (a, b) = (member(1), member(2));
    joined(&mut m, &a);
    joined(&mut m, &b);
    m.set_expert_split(Some(
        crate::assignment::parse_experts("0-3@n1,4-7@n2").unwrap(),
    ));
    let acts = m.handle(Event::Plan {
        model: MODEL,
        stages: vec![(a.node_id, 0..5), (b.node_id, 0..5)],
        n_layer: 5,
        max_context: 64,
    });
    assert!(sends(&acts).is_empty());
    assert!(acts.iter().any(|x| matches!(
        x,
        Action::EpochFailed {
            reason: crate::membership::EpochFailure::ExpertSplitIsOneCell,
            ..
        }
    )));
}
