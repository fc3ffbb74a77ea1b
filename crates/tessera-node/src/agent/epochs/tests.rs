//! `NodeEpochs`' decisions, one scenario each (the `membership/` style).

use super::*;
use tessera_proto::PeerInfo;

const GIB: u64 = 1 << 30;

fn limit(bytes: u64) -> MemoryLimit {
    MemoryLimit {
        refusal: BudgetRefusal {
            requested: u64::MAX,
            limit: Some(bytes),
            limit_source: "memory budget \"test\"".into(),
            total_ram: None,
            available_ram: None,
        },
    }
}

fn peer(n: u8) -> PeerInfo {
    let key = PublicKey::from_bytes([n; 32]);
    PeerInfo {
        node_id: key.node_id(),
        key,
        addr: ([127, 0, 0, 1], 7000 + u16::from(n)).into(),
    }
}

/// Stage 1 of a two-stage ring for `epoch`, its previous stage `prev`.
fn stage(epoch: u64, prev: u8) -> StageAssignment {
    StageAssignment {
        epoch,
        model: tessera_host::ContentHash::of(b"model"),
        stage: 1,
        n_stages: 2,
        layers: 2..4,
        embed: false,
        head: true,
        next: Some(peer(prev)),
        prev: Some(peer(prev)),
        max_context: 64,
        kv_type: Default::default(),
        expert_budget: None,
    }
}

fn ticket_of(acts: &[EpochAction]) -> Ticket {
    acts.iter()
        .find_map(|a| match a {
            EpochAction::Load { ticket, .. } => Some(*ticket),
            _ => None,
        })
        .expect("a load")
}

fn installs(acts: &[EpochAction]) -> Vec<u64> {
    acts.iter()
        .filter_map(|a| match a {
            EpochAction::Install { epoch, .. } => Some(*epoch),
            _ => None,
        })
        .collect()
}

/// Assigns `epoch` and loads it to the end with `held` bytes: the load's actions.
fn assign_and_load(m: &mut NodeEpochs, epoch: u64, prev: u8, held: u64) -> Vec<EpochAction> {
    let ticket = ticket_of(&m.handle(EpochEvent::Assign(stage(epoch, prev))));
    m.handle(EpochEvent::Loaded {
        ticket,
        held,
        n_embd: 8,
    })
}

#[test]
fn an_assignment_loads_admits_its_previous_stage_and_installs() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    let acts = m.handle(EpochEvent::Assign(stage(1, 7)));
    assert!(acts.contains(&EpochAction::Admit(peer(7).key)));
    let ticket = ticket_of(&acts);
    assert!(m.holds(1), "a lost link of a loading epoch matters");
    assert!(m.installed(1).is_none());
    let acts = m.handle(EpochEvent::Loaded {
        ticket,
        held: GIB,
        n_embd: 8,
    });
    assert_eq!(
        acts,
        vec![
            EpochAction::Install {
                ticket,
                epoch: 1,
                kv_budget: Some(3 * GIB)
            },
            EpochAction::PublishClaims
        ]
    );
    assert_eq!(m.ring_from(&peer(7).key), Some((1, 8)));
    assert_eq!(m.sealed_holding().map(|a| a.epoch), Some(1));
}

#[test]
fn a_load_finished_after_the_release_of_its_epoch_is_discarded_and_frees_its_memory() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    let ticket = ticket_of(&m.handle(EpochEvent::Assign(stage(1, 7))));
    let acts = m.handle(EpochEvent::Release { epoch: 1 });
    assert!(acts.contains(&EpochAction::Unadmit(peer(7).node_id)));
    assert!(
        !acts
            .iter()
            .any(|a| matches!(a, EpochAction::ReleaseStage { .. })),
        "nothing was installed: {acts:?}"
    );
    assert!(!m.holds(1));
    // The load finishes: discarded, never installed, and the coordinator (which released
    // it) is not told.
    let acts = m.handle(EpochEvent::Loaded {
        ticket,
        held: 3 * GIB,
        n_embd: 8,
    });
    assert_eq!(
        acts,
        vec![EpochAction::Discard {
            ticket,
            why: LoadRefused::Released { epoch: 1 }
        }]
    );
    assert!(m.installed(1).is_none());
    assert_eq!(m.ring_from(&peer(7).key), None);
    // Its 3 GiB are not counted against the next epoch: 3 GiB fit in 4 alone.
    let acts = assign_and_load(&mut m, 2, 8, 3 * GIB);
    assert_eq!(installs(&acts), vec![2]);
    assert!(acts.contains(&EpochAction::Install {
        ticket: ticket + 1,
        epoch: 2,
        kv_budget: Some(GIB)
    }));
}

#[test]
fn a_load_finished_after_a_newer_assignment_is_refused_and_the_newer_one_installs() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    let old = ticket_of(&m.handle(EpochEvent::Assign(stage(1, 7))));
    let acts = m.handle(EpochEvent::Assign(stage(2, 8)));
    let new = ticket_of(&acts);
    // The superseded load's previous stage is no longer let in.
    assert!(acts.contains(&EpochAction::Unadmit(peer(7).node_id)));
    assert!(acts.contains(&EpochAction::Admit(peer(8).key)));
    let acts = m.handle(EpochEvent::Loaded {
        ticket: old,
        held: GIB,
        n_embd: 8,
    });
    assert_eq!(
        acts,
        vec![EpochAction::Refuse {
            epoch: 1,
            why: LoadRefused::Superseded { epoch: 1 }
        }]
    );
    let acts = m.handle(EpochEvent::Loaded {
        ticket: new,
        held: GIB,
        n_embd: 8,
    });
    assert_eq!(installs(&acts), vec![2]);
    assert!(!m.holds(1));
}

#[test]
fn a_stale_assignment_is_refused_without_loading() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    m.handle(EpochEvent::Assign(stage(5, 7)));
    let acts = m.handle(EpochEvent::Assign(stage(4, 8)));
    assert_eq!(
        acts,
        vec![EpochAction::Refuse {
            epoch: 4,
            why: LoadRefused::Superseded { epoch: 4 }
        }]
    );
    assert!(m.holds(5));
}

#[test]
fn a_reassigned_epoch_installs_only_its_newest_load() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    let first = ticket_of(&m.handle(EpochEvent::Assign(stage(3, 7))));
    m.handle(EpochEvent::SessionEnded);
    // A restarted coordinator reuses the epoch number in the next session.
    let second = ticket_of(&m.handle(EpochEvent::Assign(stage(3, 8))));
    let acts = m.handle(EpochEvent::Loaded {
        ticket: first,
        held: GIB,
        n_embd: 8,
    });
    assert!(installs(&acts).is_empty(), "{acts:?}");
    let acts = m.handle(EpochEvent::Loaded {
        ticket: second,
        held: GIB,
        n_embd: 8,
    });
    assert_eq!(installs(&acts), vec![3]);
    assert_eq!(m.ring_from(&peer(8).key), Some((3, 8)));
}

#[test]
fn link_loss_during_release_is_not_reported() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    assign_and_load(&mut m, 1, 7, GIB);
    let lost = EpochEvent::LinkLost {
        epoch: 1,
        link: DataLink::RingFromPrevious,
        peer: peer(7).node_id,
    };
    assert_eq!(
        m.handle(lost.clone()),
        vec![EpochAction::ReportLinkLost {
            epoch: 1,
            link: DataLink::RingFromPrevious,
            peer: peer(7).node_id
        }],
        "a link of an installed epoch that goes is a failure"
    );
    let acts = m.handle(EpochEvent::Release { epoch: 1 });
    for a in [
        EpochAction::CloseLinks { epoch: 1 },
        EpochAction::ReleaseStage { epoch: 1 },
        EpochAction::Unadmit(peer(7).node_id),
    ] {
        assert!(acts.contains(&a), "{a:?} in {acts:?}");
    }
    // The peer sees the link close and its end of it goes: not a failure here.
    assert!(m.handle(lost).is_empty());
    for link in [DataLink::RingToNext, DataLink::ExpertToWorker] {
        assert!(m
            .handle(EpochEvent::LinkLost {
                epoch: 1,
                link,
                peer: peer(7).node_id
            })
            .is_empty());
    }
}

#[test]
fn a_link_made_while_its_epoch_was_released_is_dropped() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    assign_and_load(&mut m, 1, 7, GIB);
    assert_eq!(
        m.handle(EpochEvent::LinkUp { epoch: 1 }),
        vec![EpochAction::KeepLink { epoch: 1 }]
    );
    m.handle(EpochEvent::Release { epoch: 1 });
    // The dial finished after the release: its connection must not outlive the epoch.
    assert_eq!(
        m.handle(EpochEvent::LinkUp { epoch: 1 }),
        vec![EpochAction::DropLink { epoch: 1 }]
    );
}

#[test]
fn a_link_lost_while_loading_matters_and_not_after_the_session_ended() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    m.handle(EpochEvent::Assign(stage(1, 7)));
    let lost = EpochEvent::LinkLost {
        epoch: 1,
        link: DataLink::ExpertFromHome,
        peer: peer(7).node_id,
    };
    assert_eq!(m.handle(lost.clone()).len(), 1);
    let acts = m.handle(EpochEvent::SessionEnded);
    assert_eq!(acts, vec![EpochAction::Unadmit(peer(7).node_id)]);
    assert!(m.handle(lost).is_empty());
}

#[test]
fn two_epochs_installed_at_once_the_old_one_serves_until_released() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    assign_and_load(&mut m, 1, 7, GIB);
    // The coordinator switches to a new split: epoch 2 loads beside epoch 1.
    let acts = assign_and_load(&mut m, 2, 8, GIB);
    assert_eq!(installs(&acts), vec![2]);
    assert!(
        !acts
            .iter()
            .any(|a| matches!(a, EpochAction::ReleaseStage { .. })),
        "the old epoch stays while its sequences finish: {acts:?}"
    );
    // The KV caches get what both epochs' weights leave.
    assert!(acts.contains(&EpochAction::Install {
        ticket: 2,
        epoch: 2,
        kv_budget: Some(2 * GIB)
    }));
    // Both previous stages are let in; each ring stream goes to its own epoch.
    assert_eq!(m.ring_from(&peer(7).key), Some((1, 8)));
    assert_eq!(m.ring_from(&peer(8).key), Some((2, 8)));
    assert!(m.holds(1) && m.holds(2));
    assert_eq!(m.sealed_holding().map(|a| a.epoch), Some(2));
    // A lost link of the old epoch still fails it while it serves.
    assert_eq!(
        m.handle(EpochEvent::LinkLost {
            epoch: 1,
            link: DataLink::RingToNext,
            peer: peer(7).node_id
        })
        .len(),
        1
    );
    // Drained: the coordinator releases the old epoch; the new one is untouched.
    let acts = m.handle(EpochEvent::Release { epoch: 1 });
    assert_eq!(
        acts,
        vec![
            EpochAction::CloseLinks { epoch: 1 },
            EpochAction::ReleaseStage { epoch: 1 },
            EpochAction::PublishClaims,
            EpochAction::Unadmit(peer(7).node_id),
        ]
    );
    assert!(m.installed(2).is_some());
    assert!(!m.holds(1));
    // Its memory is free: a 3 GiB epoch now fits beside epoch 2's 1 GiB.
    let acts = assign_and_load(&mut m, 3, 9, 3 * GIB);
    assert_eq!(installs(&acts), vec![3]);
}

#[test]
fn a_second_epoch_that_does_not_fit_beside_the_first_is_refused() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    assign_and_load(&mut m, 1, 7, 3 * GIB);
    let acts = assign_and_load(&mut m, 2, 8, 2 * GIB);
    // Refused, and its previous stage no longer let in.
    let [EpochAction::Refuse { epoch: 2, why }, EpochAction::Unadmit(gone)] = &acts[..] else {
        panic!("{acts:?}")
    };
    assert_eq!(*gone, peer(8).node_id);
    let LoadRefused::NotBeside {
        epoch: 2,
        beside,
        refusal,
    } = why
    else {
        panic!("{why:?}")
    };
    assert_eq!((*beside, refusal.requested), (3 * GIB, 5 * GIB));
    assert!(why.to_string().contains("beside the epoch still installed"));
    // Epoch 1 serves on.
    assert!(m.installed(1).is_some() && m.installed(2).is_none());
    assert_eq!(m.ring_from(&peer(8).key), None);
    // Alone, an epoch over the limit is refused as over the budget.
    let mut m = NodeEpochs::new(limit(GIB));
    let acts = assign_and_load(&mut m, 1, 7, 2 * GIB);
    assert!(
        matches!(
            &acts[..],
            [
                EpochAction::Refuse {
                    why: LoadRefused::OverBudget(_),
                    ..
                },
                EpochAction::Unadmit(_)
            ]
        ),
        "{acts:?}"
    );
}

#[test]
fn a_third_epoch_installed_while_two_are_held_evicts_the_oldest_whole() {
    let mut m = NodeEpochs::new(limit(8 * GIB));
    assign_and_load(&mut m, 1, 7, GIB);
    assign_and_load(&mut m, 2, 8, GIB);
    let ticket = ticket_of(&m.handle(EpochEvent::Assign(stage(3, 9))));
    // While epoch 3 loads, all three are resident: it must fit beside both.
    let acts = m.handle(EpochEvent::Loaded {
        ticket,
        held: GIB,
        n_embd: 8,
    });
    assert!(acts.contains(&EpochAction::Install {
        ticket,
        epoch: 3,
        kv_budget: Some(5 * GIB)
    }));
    // Epoch 1 goes whole, before epoch 3 is installed (the stage thread holds two).
    let pos = |a: &EpochAction| acts.iter().position(|x| x == a).expect("present");
    let install = acts
        .iter()
        .position(|a| matches!(a, EpochAction::Install { .. }))
        .unwrap();
    assert!(pos(&EpochAction::ReleaseStage { epoch: 1 }) < install);
    assert!(pos(&EpochAction::CloseLinks { epoch: 1 }) < install);
    assert!(acts.contains(&EpochAction::Unadmit(peer(7).node_id)));
    assert!(!m.holds(1));
    assert!(m.installed(2).is_some() && m.installed(3).is_some());
    // Its links are not the node's concern any more.
    assert!(m
        .handle(EpochEvent::LinkLost {
            epoch: 1,
            link: DataLink::RingToNext,
            peer: peer(7).node_id
        })
        .is_empty());
}

#[test]
fn a_third_epoch_must_fit_beside_both_installed() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    assign_and_load(&mut m, 1, 7, GIB);
    assign_and_load(&mut m, 2, 8, GIB);
    let acts = assign_and_load(&mut m, 3, 9, 3 * GIB);
    assert!(
        matches!(
            &acts[..],
            [EpochAction::Refuse {
                epoch: 3,
                why: LoadRefused::NotBeside {
                    beside: b, ..
                }
            }, EpochAction::Unadmit(_)] if *b == 2 * GIB
        ),
        "{acts:?}"
    );
    assert!(m.installed(1).is_some() && m.installed(2).is_some());
}

#[test]
fn a_peer_shared_by_two_epochs_stays_admitted_until_neither_needs_it() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    assign_and_load(&mut m, 1, 7, GIB);
    let acts = assign_and_load(&mut m, 2, 7, GIB);
    assert!(!acts.iter().any(|a| matches!(a, EpochAction::Admit(_))));
    let acts = m.handle(EpochEvent::Release { epoch: 1 });
    assert!(!acts.iter().any(|a| matches!(a, EpochAction::Unadmit(_))));
    // The ring stream from it now goes to epoch 2.
    assert_eq!(m.ring_from(&peer(7).key), Some((2, 8)));
    let acts = m.handle(EpochEvent::Release { epoch: 2 });
    assert!(acts.contains(&EpochAction::Unadmit(peer(7).node_id)));
}

fn experts(clients: Vec<PeerInfo>, peers: Vec<PeerInfo>) -> ExpertAssignment {
    ExpertAssignment {
        held: vec![vec![0, 1], vec![0, 1], vec![], vec![]],
        expert_only: false,
        peers: peers
            .into_iter()
            .map(|peer| ExpertPeer {
                peer,
                experts: vec![vec![2, 3], vec![2, 3], vec![], vec![]],
            })
            .collect(),
        clients,
    }
}

#[test]
fn expert_clients_are_admitted_with_their_placement_and_go_with_its_release() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    let acts = m.handle(EpochEvent::AssignExperts {
        epoch: 1,
        experts: experts(vec![peer(5)], vec![peer(6)]),
    });
    assert_eq!(acts, vec![EpochAction::Admit(peer(5).key)]);
    let acts = m.handle(EpochEvent::Assign(stage(1, 7)));
    let Some(EpochAction::Load {
        experts: Some(x), ..
    }) = acts.iter().find(|a| matches!(a, EpochAction::Load { .. }))
    else {
        panic!("{acts:?}")
    };
    assert_eq!(x.clients, vec![peer(5)]);
    let ticket = ticket_of(&acts);
    m.handle(EpochEvent::Loaded {
        ticket,
        held: GIB,
        n_embd: 8,
    });
    assert!(m.serves_experts_to(1, &peer(5).key));
    assert!(!m.serves_experts_to(1, &peer(6).key));
    assert_eq!(m.expert_peers(1).len(), 1);
    assert_eq!(m.sealed_holding(), None, "its experts are shared");
    let acts = m.handle(EpochEvent::Release { epoch: 1 });
    assert!(acts.contains(&EpochAction::Unadmit(peer(5).node_id)));
    assert!(!m.serves_experts_to(1, &peer(5).key));
}

#[test]
fn expert_clients_of_an_epoch_released_while_loading_are_not_left_admitted() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    m.handle(EpochEvent::AssignExperts {
        epoch: 1,
        experts: experts(vec![peer(5)], vec![]),
    });
    m.handle(EpochEvent::Assign(stage(1, 7)));
    let acts = m.handle(EpochEvent::Release { epoch: 1 });
    assert!(acts.contains(&EpochAction::Unadmit(peer(5).node_id)));
    assert!(acts.contains(&EpochAction::Unadmit(peer(7).node_id)));
}

#[test]
fn stale_expert_placements_are_bounded() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    for epoch in 1..=10u8 {
        m.handle(EpochEvent::AssignExperts {
            epoch: u64::from(epoch),
            experts: experts(vec![peer(epoch)], vec![]),
        });
    }
    assert_eq!(m.pending_experts.len(), MAX_PENDING_EXPERTS);
    assert_eq!(m.admitted.len(), MAX_PENDING_EXPERTS);
    // Assigning epoch 10 drops every older placement.
    m.handle(EpochEvent::Assign(stage(10, 7)));
    assert!(m.pending_experts.is_empty());
}

#[test]
fn the_session_ending_releases_every_installed_epoch() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    assign_and_load(&mut m, 1, 7, GIB);
    assign_and_load(&mut m, 2, 8, GIB);
    let acts = m.handle(EpochEvent::SessionEnded);
    for e in [1, 2] {
        assert!(acts.contains(&EpochAction::ReleaseStage { epoch: e }));
        assert!(acts.contains(&EpochAction::CloseLinks { epoch: e }));
    }
    assert!(!m.holds(1) && !m.holds(2));
    assert_eq!(m.sealed_holding(), None);
    assert!(m.admitted.is_empty());
}

#[test]
fn a_failed_load_keeps_its_epoch_assigned_but_admits_no_one() {
    let mut m = NodeEpochs::new(limit(4 * GIB));
    let ticket = ticket_of(&m.handle(EpochEvent::Assign(stage(1, 7))));
    let acts = m.handle(EpochEvent::LoadFailed { ticket });
    assert_eq!(acts, vec![EpochAction::Unadmit(peer(7).node_id)]);
    // The coordinator still counts it as this node's until it releases it.
    assert!(m.holds(1));
    // A report for a ticket already settled changes nothing.
    assert!(m
        .handle(EpochEvent::Loaded {
            ticket,
            held: GIB,
            n_embd: 8
        })
        .is_empty());
}

#[test]
fn peers_named_for_measurement_are_admitted_until_the_next_list_or_the_sessions_end() {
    let mut m = NodeEpochs::new(limit(GIB));
    let (p2, p3) = (peer(2), peer(3));
    let named = |ps: &[&PeerInfo]| {
        EpochEvent::MeasurePeers(ps.iter().map(|p| (p.node_id, p.key)).collect())
    };
    let acts = m.handle(named(&[&p2, &p3]));
    assert!(acts.contains(&EpochAction::Admit(p2.key)));
    assert!(acts.contains(&EpochAction::Admit(p3.key)));
    // A ring's previous stage that is also measured stays admitted when the list moves on.
    assign_and_load(&mut m, 1, 2, GIB / 4);
    let acts = m.handle(named(&[]));
    assert_eq!(acts, vec![EpochAction::Unadmit(p3.node_id)]);
    let acts = m.handle(named(&[&p3]));
    assert_eq!(acts, vec![EpochAction::Admit(p3.key)]);
    let acts = m.handle(EpochEvent::SessionEnded);
    assert!(acts.contains(&EpochAction::Unadmit(p3.node_id)));
    assert!(acts.contains(&EpochAction::Unadmit(p2.node_id)));
}
