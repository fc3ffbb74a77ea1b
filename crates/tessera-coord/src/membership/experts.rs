//! Expert splits: where each owner's experts live in a plan, and, when an owner of experts
//! leaves (an expert-only node, or a stage), the new split that hands the departed owner's
//! experts to the surviving owners and ring stages by free memory
//! ([`crate::replan::replace_experts`]); a node given more than its budget streams them from
//! disk. The configured split is kept: when its nodes are all back, it is planned again.

use super::note::{MovedExperts, Note};
use std::ops::Range;

use tessera_net::NodeId;

use super::Membership;
use tessera_proto::{ExpertAssignment, ExpertPeer, PeerInfo};

impl Membership {
    /// The connected members, as placement resolves names against them.
    pub(crate) fn candidates(&self) -> Vec<crate::assignment::Candidate> {
        Self::as_candidates(self.connected())
    }

    /// Connected members a re-plan may use: those benched for a failed link left out.
    pub(super) fn usable_candidates(&self) -> Vec<crate::assignment::Candidate> {
        Self::as_candidates(self.usable())
    }

    /// Every member, connected or not (to name the holders of an epoch already placed).
    pub(crate) fn member_candidates(&self) -> Vec<crate::assignment::Candidate> {
        Self::as_candidates(self.members())
    }

    fn as_candidates<'a>(
        members: impl IntoIterator<Item = &'a super::Member>,
    ) -> Vec<crate::assignment::Candidate> {
        members
            .into_iter()
            .map(|m| crate::assignment::Candidate {
                node_id: m.node_id,
                name: m.name.clone(),
            })
            .collect()
    }

    /// The expert placement of a plan: per ring stage and per expert-only node, what it holds,
    /// whom it asks and who asks it.
    #[allow(clippy::type_complexity)]
    pub(super) fn place_experts(
        &self,
        split: &crate::assignment::ExpertSplit,
        ring: &[(NodeId, PeerInfo)],
        n_layer: usize,
    ) -> Result<(Vec<ExpertAssignment>, Vec<(PeerInfo, ExpertAssignment)>), String> {
        let nodes = self.usable_candidates();
        let mut owners: Vec<(PeerInfo, Vec<usize>)> = Vec::new();
        for g in &split.groups {
            let id = crate::assignment::find_node(&g.node, &nodes).map_err(|e| e.to_string())?;
            let m = self
                .members
                .get(&id)
                .ok_or_else(|| format!("node {} is not a member", id.short()))?;
            match owners.iter_mut().find(|(p, _)| p.node_id == id) {
                Some((_, ids)) => {
                    ids.extend(&g.experts);
                    ids.sort_unstable();
                }
                None => owners.push((
                    PeerInfo {
                        node_id: m.node_id,
                        key: m.key,
                        addr: m.addr,
                    },
                    g.experts.clone(),
                )),
            }
        }
        let every = |ids: &Vec<usize>| vec![ids.clone(); n_layer];
        let homes: Vec<PeerInfo> = ring.iter().map(|(_, p)| p.clone()).collect();
        let stage_parts = ring
            .iter()
            .map(|(id, _)| {
                let held = owners
                    .iter()
                    .find(|(p, _)| p.node_id == *id)
                    .map(|(_, ids)| ids.clone())
                    .unwrap_or_default();
                ExpertAssignment {
                    held: every(&held),
                    expert_only: false,
                    peers: owners
                        .iter()
                        .filter(|(p, _)| p.node_id != *id)
                        .map(|(p, ids)| ExpertPeer {
                            peer: p.clone(),
                            experts: every(ids),
                        })
                        .collect(),
                    clients: homes.iter().filter(|h| h.node_id != *id).cloned().collect(),
                }
            })
            .collect();
        let only = owners
            .iter()
            .filter(|(p, _)| !ring.iter().any(|(id, _)| *id == p.node_id))
            .map(|(p, ids)| {
                (
                    p.clone(),
                    ExpertAssignment {
                        held: every(ids),
                        expert_only: true,
                        peers: Vec::new(),
                        clients: homes.clone(),
                    },
                )
            })
            .collect();
        Ok((stage_parts, only))
    }

    /// The member's memory limit, as its node applies it: the budget, else the RAM available
    /// when it started.
    fn limit(&self, id: &NodeId) -> Option<u64> {
        let m = self.members.get(id)?;
        m.memory_budget_bytes
            .or_else(|| m.inventory.as_ref()?.memory.available_bytes)
    }

    fn holder(
        &self,
        id: NodeId,
        ring: &[(NodeId, Range<usize>)],
        experts: Vec<usize>,
    ) -> crate::replan::ExpertHolder {
        crate::replan::ExpertHolder {
            node_id: id,
            layers: ring
                .iter()
                .find(|(n, _)| *n == id)
                .map_or(0..0, |(_, l)| l.clone()),
            experts,
            limit: self.limit(&id),
        }
    }

    /// The expert split to place with `ring`: the configured one. With `reassign` (re-planning
    /// on the survivors), the experts of owners no longer connected go to the connected owners
    /// and ring stages ([`crate::replan::replace_experts`]), and a note says where; without it,
    /// a named node that is not connected fails the plan.
    #[allow(clippy::type_complexity)]
    pub(super) fn split_for(
        &self,
        ring: &[(NodeId, Range<usize>)],
        n_layer: usize,
        reassign: bool,
    ) -> Result<Option<(crate::assignment::ExpertSplit, Option<Note>)>, String> {
        use crate::assignment::{find_node, ExpertGroup, ExpertSplit};
        let Some(split) = &self.experts else {
            return Ok(None);
        };
        let nodes = self.usable_candidates();
        // (the node as the split names it, what it holds)
        let mut holders: Vec<(String, crate::replan::ExpertHolder)> = Vec::new();
        let mut orphans = Vec::new();
        let mut gone: Vec<String> = Vec::new();
        for g in &split.groups {
            match find_node(&g.node, &nodes) {
                Ok(id) => match holders.iter_mut().find(|(_, h)| h.node_id == id) {
                    Some((_, h)) => h.experts.extend(&g.experts),
                    None => {
                        holders.push((g.node.clone(), self.holder(id, ring, g.experts.clone())))
                    }
                },
                Err(_) if reassign => {
                    orphans.extend(&g.experts);
                    if !gone.contains(&g.node) {
                        gone.push(g.node.clone());
                    }
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        if self.fault == Some(crate::fault::Fault::DropDepartedOwnersExperts) {
            orphans.clear();
        }
        if orphans.is_empty() && gone.is_empty() {
            return Ok(Some((split.clone(), None)));
        }
        // Ring stages that held no experts may take some too.
        for (id, _) in ring {
            if !holders.iter().any(|(_, h)| h.node_id == *id) {
                holders.push((id.to_string(), self.holder(*id, ring, Vec::new())));
            }
        }
        for (_, h) in holders.iter_mut() {
            h.experts.sort_unstable();
        }
        orphans.sort_unstable();
        let mut hs: Vec<crate::replan::ExpertHolder> =
            holders.iter().map(|(_, h)| h.clone()).collect();
        let given = crate::replan::replace_experts(&orphans, &mut hs, self.bytes.as_ref(), n_layer);
        let mut moved = Vec::new();
        for (h, g) in hs.iter().zip(&given).filter(|(_, g)| !g.is_empty()) {
            let name = self
                .members
                .get(&h.node_id)
                .map_or_else(|| h.node_id.short(), |m| m.name.clone());
            let streams = match (self.bytes.as_ref(), h.limit) {
                (Some(b), Some(limit)) => {
                    b.expert_holder(&h.layers, n_layer, h.experts.len()) > limit
                }
                _ => false,
            };
            moved.push(MovedExperts {
                experts: g.clone(),
                to: name,
                streams,
            });
        }
        let note = Note::ExpertsReplaced {
            orphans: orphans.clone(),
            gone,
            moved,
        };
        let groups = holders
            .into_iter()
            .zip(hs)
            .filter(|(_, h)| !h.experts.is_empty())
            .map(|((node, _), h)| ExpertGroup {
                experts: h.experts,
                node,
            })
            .collect();
        Ok(Some((ExpertSplit { groups }, Some(note))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::test_support::*;
    use crate::membership::{Action, Event};
    use crate::replan::ModelBytes;
    use tessera_proto::CoordToNode;

    #[test]
    fn an_expert_split_places_experts_on_stages_and_expert_only_nodes() {
        let mut m = Membership::new();
        let (a, b, c) = (member(1), member(2), member(3));
        for x in [&a, &b, &c] {
            m.handle(Event::Joined(Box::new(x.clone())));
        }
        m.set_expert_split(Some(
            crate::assignment::parse_experts("0-2@n1,3-5@n2,6-7@n3").unwrap(),
        ));
        assert!(m.expert_split_ready());
        let acts = m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..2), (b.node_id, 2..4)],
            n_layer: 4,
            max_context: 128,
        });
        let s = sends(&acts);
        // Each node: its expert placement, then its assignment.
        assert_eq!(s.len(), 6);
        let experts_of = |i: usize| match &s[i].1 {
            CoordToNode::AssignExperts { experts, .. } => experts.clone(),
            other => panic!("{other:?}"),
        };
        let (xa, xb, xc) = (experts_of(0), experts_of(2), experts_of(4));
        assert_eq!(xa.held, vec![vec![0, 1, 2]; 4]);
        assert!(!xa.expert_only && xc.expert_only);
        let peers: Vec<NodeId> = xa.peers.iter().map(|p| p.peer.node_id).collect();
        assert_eq!(peers, vec![b.node_id, c.node_id]);
        assert_eq!(xa.clients.len(), 1);
        assert_eq!(xb.clients[0].node_id, a.node_id);
        assert_eq!(xc.clients.len(), 2);
        assert_eq!(xc.held, vec![vec![6, 7]; 4]);
        let CoordToNode::Assign(only) = &s[5].1 else {
            panic!()
        };
        assert_eq!(s[5].0, c.node_id);
        assert!(only.layers.is_empty() && only.next.is_none() && !only.embed && !only.head);
        // The expert-only node is part of the epoch: it loads and links like a stage.
        let e = m.epoch().unwrap();
        assert_eq!(e.stages.len(), 3);
        assert!(e.stages[2].layers.is_empty());
        // A named node that is not connected fails the plan with a reason.
        m.handle(Event::Left {
            node: c.node_id,
            session: 1,
        });
        assert!(!m.expert_split_ready());
    }

    fn experts_held(acts: &[Action]) -> Vec<(NodeId, Vec<usize>, bool)> {
        sends(acts)
            .into_iter()
            .filter_map(|(n, x)| match x {
                CoordToNode::AssignExperts { experts, .. } => {
                    Some((n, experts.held[0].clone(), experts.expert_only))
                }
                _ => None,
            })
            .collect()
    }

    /// Two MoE layers of 8 experts of 10 bytes each and 40 bytes of the rest; 10 bytes each of
    /// embedding and head.
    fn two_layers_of_eight_experts() -> ModelBytes {
        ModelBytes {
            layers: vec![120; 2],
            embed: 10,
            head: 10,
            expert: vec![10; 2],
            n_expert: 8,
        }
    }

    /// Experts 0-1 on n1, 2-4 on n2, 5-7 on n3, and a ring of `home` alone holding both layers.
    fn split_and_plan(m: &mut Membership, home: &crate::membership::Member) {
        m.set_expert_split(Some(
            crate::assignment::parse_experts("0-1@n1,2-4@n2,5-7@n3").unwrap(),
        ));
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(home.node_id, 0..2)],
            n_layer: 2,
            max_context: 64,
        });
    }

    #[test]
    fn a_lost_expert_node_hands_its_experts_to_the_survivors_and_gets_them_back() {
        let mut m = Membership::new();
        m.set_model_bytes(Some(two_layers_of_eight_experts()));
        let (mut a, mut b, mut c) = (member(1), member(2), member(3));
        // Home a: 100 bytes of dense weights and 2 experts (40): 140 of 160. Owner b holds 3
        // experts (60) of 200, owner c 3 of 100.
        a.memory_budget_bytes = Some(160);
        b.memory_budget_bytes = Some(200);
        c.memory_budget_bytes = Some(100);
        // The expert nodes join first: the ring must stay on the home when one of them goes.
        for x in [&b, &c, &a] {
            m.handle(Event::Joined(Box::new(x.clone())));
        }
        split_and_plan(&mut m, &a);
        let first = ready(&mut m);
        // c goes: its experts 5-7 go to b, which has the room (a has 20 bytes, b 140).
        let acts = m.handle(Event::Left {
            node: c.node_id,
            session: 1,
        });
        assert!(acts.iter().any(|x| matches!(x, Action::EpochFailed {
                epoch,
                reason: crate::membership::EpochFailure::NodeGone {
                    node,
                    expert_only: true,
                    how: crate::membership::Departure::Left,
                },
            } if *epoch == first && *node == c.node_id)));
        let note = acts
            .iter()
            .find_map(|x| match x {
                Action::Note(n) => Some(n.clone()),
                _ => None,
            })
            .expect("a note on the re-placement");
        assert_eq!(
            note,
            Note::ExpertsReplaced {
                orphans: vec![5, 6, 7],
                gone: vec!["n3".into()],
                moved: vec![MovedExperts {
                    experts: vec![5, 6, 7],
                    to: "n2".into(),
                    streams: false
                }]
            }
        );
        assert!(m.outage().is_none());
        assert_eq!(
            experts_held(&acts),
            vec![
                (a.node_id, vec![0, 1], false),
                (b.node_id, vec![2, 3, 4, 5, 6, 7], true)
            ]
        );
        assert_eq!(layers(&m), vec![(a.node_id, 0..2), (b.node_id, 0..0)]);
        assert_eq!(m.epoch_expert_split().unwrap().to_string(), "0-1@n1,2-7@n2");
        let replaced = ready(&mut m);
        // c comes back: the configured split is made again, beside the serving one (make
        // before break): nothing of the serving epoch is released yet.
        let mut c2 = c.clone();
        c2.session = 2;
        let acts = m.handle(Event::Joined(Box::new(c2)));
        assert_eq!(
            experts_held(&acts),
            vec![
                (a.node_id, vec![0, 1], false),
                (b.node_id, vec![2, 3, 4], true),
                (c.node_id, vec![5, 6, 7], true)
            ]
        );
        assert!(!sends(&acts)
            .iter()
            .any(|(_, x)| matches!(x, CoordToNode::Release { .. })));
        assert_eq!(m.epoch().unwrap().id, replaced);
        assert_eq!(m.epoch_expert_split().unwrap().to_string(), "0-1@n1,2-7@n2");
        let restored = m.successors()[0].id;
        // Once it is ready it serves new runs, and the replaced split drains its own.
        ready_epoch(&mut m, restored);
        assert_eq!(m.epoch().unwrap().id, restored);
        assert_eq!(m.epoch_expert_split(), m.expert_split());
        assert!(m.serves(replaced) && m.draining()[0].id == replaced);
        let acts = m.handle(Event::Drained { epoch: replaced });
        let mut released: Vec<NodeId> = sends(&acts)
            .iter()
            .filter(|(_, x)| matches!(x, CoordToNode::Release { epoch } if *epoch == replaced))
            .map(|(n, _)| *n)
            .collect();
        released.sort();
        let mut holders = vec![a.node_id, b.node_id];
        holders.sort();
        assert_eq!(released, holders);
        // Both expert nodes go: the home takes everything, beyond its budget (it streams).
        m.handle(Event::Left {
            node: b.node_id,
            session: 1,
        });
        let acts = m.handle(Event::Left {
            node: c.node_id,
            session: 2,
        });
        assert_eq!(
            experts_held(&acts),
            vec![(a.node_id, (0..8).collect(), false)]
        );
        let note = acts
            .iter()
            .find_map(|x| match x {
                Action::Note(n) => Some(n.clone()),
                _ => None,
            })
            .unwrap();
        let Note::ExpertsReplaced { moved, .. } = &note else {
            panic!("{note}")
        };
        assert!(moved.iter().all(|m| m.to == "n1" && m.streams), "{note}");
        assert_eq!(layers(&m), vec![(a.node_id, 0..2)]);
    }

    #[test]
    fn a_lost_home_moves_the_ring_and_its_experts_to_the_survivors() {
        let mut m = Membership::new();
        m.set_model_bytes(Some(two_layers_of_eight_experts()));
        let (a, mut b, mut c) = (member(1), member(2), member(3));
        // b cannot hold the whole model (420 bytes), but holds its dense part (100) and its
        // experts; what does not fit it would stream.
        b.memory_budget_bytes = Some(200);
        c.memory_budget_bytes = Some(100);
        for x in [&a, &b, &c] {
            m.handle(Event::Joined(Box::new(x.clone())));
        }
        split_and_plan(&mut m, &a);
        ready(&mut m);
        let acts = m.handle(Event::Left {
            node: a.node_id,
            session: 1,
        });
        assert!(m.outage().is_none(), "{:?}", m.outage());
        assert_eq!(layers(&m), vec![(b.node_id, 0..2), (c.node_id, 0..0)]);
        // b: 160 of 200, c: 60 of 100; 0 → b (40 vs 40, equal counts: the earlier), 1 → c.
        assert_eq!(
            experts_held(&acts),
            vec![
                (b.node_id, vec![0, 2, 3, 4], false),
                (c.node_id, vec![1, 5, 6, 7], true)
            ]
        );
    }
}
