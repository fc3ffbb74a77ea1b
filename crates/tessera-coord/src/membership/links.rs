//! Lost data links: a stage reports that a link of the epoch could not be made or was lost
//! mid-epoch (the ring link to a neighbour, an expert link between a home stage and an expert
//! owner), naming its peer. The epoch fails and the next plan does not need that pair: a ring
//! order in which the two are not neighbours when one exists (a ring of four or more, or more
//! nodes than stages), else a plan without the node that did not report — the reporter has
//! just proved that it is alive, the other may be dead or cut off. The pair is remembered
//! (both ways) until either node leaves or joins again.

use super::note::Note;
use tessera_net::NodeId;

use super::{Action, EpochFailure, Member, Membership, Phase};
use crate::replan::Survivor;

/// Most orders tried when looking for a ring that avoids the failed links (the search is
/// exhaustive on small clusters; beyond this the join order is used, and nodes are left out).
const MAX_ORDERS_TRIED: usize = 100_000;

impl Membership {
    /// Connected members in join order, without those benched for a failed link.
    pub(super) fn usable(&self) -> Vec<&Member> {
        self.connected()
            .into_iter()
            .filter(|m| !self.benched.contains(&m.node_id))
            .collect()
    }

    /// The data links reported lost, as (reporter, peer).
    pub fn failed_links(&self) -> impl Iterator<Item = &(NodeId, NodeId)> {
        self.failed_links.iter()
    }

    /// Whether `a` and `b` were reported unable to talk (in either direction); the node that
    /// did not report.
    fn failed_pair(&self, a: NodeId, b: NodeId) -> Option<NodeId> {
        if self.failed_links.contains(&(a, b)) {
            Some(b)
        } else if self.failed_links.contains(&(b, a)) {
            Some(a)
        } else {
            None
        }
    }

    /// `id` left or joined again: its links are worth trying again.
    pub(super) fn forget_failed_links(&mut self, id: NodeId) {
        self.failed_links.retain(|(a, b)| *a != id && *b != id);
        let paired: Vec<NodeId> = self
            .failed_links
            .iter()
            .flat_map(|(a, b)| [*a, *b])
            .collect();
        self.benched.retain(|n| paired.contains(n));
    }

    pub(super) fn link_failed(
        &mut self,
        node: NodeId,
        epoch: u64,
        reason: String,
        peer: Option<NodeId>,
    ) -> Vec<Action> {
        // Only a stage of the epoch may say that the epoch cannot link: any other member
        // saying so is ignored (it would stop the service with one message). A report about
        // an epoch that is no longer current is late, not hostile.
        if let Some(e) = self.successors.iter().find(|e| e.id == epoch) {
            if e.stages.iter().any(|s| s.node_id == node) {
                let slot = e.cell;
                let pair = peer.filter(|p| *p != node && e.stages.iter().any(|s| s.node_id == *p));
                if let Some(peer) = pair {
                    self.failed_links.insert((node, peer));
                }
                return self.successor_failed(slot, node, &reason);
            }
        }
        let Some(slot) = self.cells.iter().position(|e| e.id == epoch) else {
            return Vec::new();
        };
        let e = &self.cells[slot];
        let in_epoch = |n: NodeId| e.stages.iter().any(|s| s.node_id == n);
        if !in_epoch(node) {
            return vec![Action::Refused {
                node,
                why: crate::authz::Refusal::NotAStageOfEpoch { epoch },
            }];
        }
        if matches!(e.phase, Phase::Failed(_) | Phase::Released) {
            return Vec::new();
        }
        // A peer outside the epoch is no link of it: the epoch fails as reported, and no
        // pair is kept.
        let pair = peer.filter(|p| *p != node && in_epoch(*p));
        let mut out = self.fail(
            slot,
            EpochFailure::Reported {
                node,
                reason: reason.to_string(),
            },
        );
        if let Some(peer) = pair {
            self.failed_links.insert((node, peer));
            out.push(Action::Note(Note::LinkLost {
                between: (self.name_of(node), self.name_of(peer)),
            }));
            out.extend(self.replan(slot));
        }
        out
    }

    fn name_of(&self, id: NodeId) -> String {
        self.members
            .get(&id)
            .map_or_else(|| id.short(), |m| m.name.clone())
    }

    /// `nodes` (in join order) reordered so that the first `k` form a ring in which no two
    /// neighbours are a failed pair — the first such ring in join order — followed by the rest
    /// in join order; unchanged when there is none.
    pub(super) fn ring_order(&self, nodes: Vec<Survivor>, k: usize) -> Vec<Survivor> {
        if self.failed_links.is_empty() || k < 2 || k > nodes.len() {
            return nodes;
        }
        let ids: Vec<NodeId> = nodes.iter().map(|n| n.node_id).collect();
        let ok = |a: usize, b: usize| self.failed_pair(ids[a], ids[b]).is_none();
        let Some(ring) = first_ring(ids.len(), k, &ok) else {
            return nodes;
        };
        let mut rest: Vec<Option<Survivor>> = nodes.into_iter().map(Some).collect();
        let mut out: Vec<Survivor> = ring.iter().filter_map(|&i| rest[i].take()).collect();
        out.extend(rest.into_iter().flatten());
        out
    }

    /// The first failed link that a plan with ring `ring` would need, as the node to leave
    /// out (the one that did not report it). A plan needs its ring's neighbours' links and,
    /// with an expert split, the link from every ring stage to every other expert owner.
    pub(super) fn needs_failed_link(
        &self,
        ring: &[(NodeId, std::ops::Range<usize>)],
        n_layer: usize,
    ) -> Option<NodeId> {
        if self.failed_links.is_empty() {
            return None;
        }
        let stages: Vec<NodeId> = ring.iter().map(|(n, _)| *n).collect();
        let mut links: Vec<(NodeId, NodeId)> = Vec::new();
        if stages.len() > 1 {
            for (i, a) in stages.iter().enumerate() {
                links.push((*a, stages[(i + 1) % stages.len()]));
            }
        }
        if let Ok(Some((split, _))) = self.split_for(ring, n_layer, true) {
            let nodes = self.usable_candidates();
            let owners = split
                .groups
                .iter()
                .filter_map(|g| crate::assignment::find_node(&g.node, &nodes).ok());
            for owner in owners {
                links.extend(stages.iter().filter(|s| **s != owner).map(|s| (*s, owner)));
            }
        }
        links.into_iter().find_map(|(a, b)| self.failed_pair(a, b))
    }
}

/// The first ring (in lexicographic order of node indices) of `k` of `n` nodes whose
/// neighbours are all `ok` together, by depth-first search; `None` if there is none (or the
/// search gives up after [`MAX_ORDERS_TRIED`] steps).
fn first_ring(n: usize, k: usize, ok: &dyn Fn(usize, usize) -> bool) -> Option<Vec<usize>> {
    fn extend(
        path: &mut Vec<usize>,
        used: &mut [bool],
        k: usize,
        ok: &dyn Fn(usize, usize) -> bool,
        budget: &mut usize,
    ) -> bool {
        if path.len() == k {
            return ok(path[k - 1], path[0]);
        }
        for i in 0..used.len() {
            if *budget == 0 {
                return false;
            }
            *budget -= 1;
            if used[i] || !ok(path[path.len() - 1], i) {
                continue;
            }
            used[i] = true;
            path.push(i);
            if extend(path, used, k, ok, budget) {
                return true;
            }
            path.pop();
            used[i] = false;
        }
        false
    }
    let mut budget = MAX_ORDERS_TRIED;
    for first in 0..n {
        let mut used = vec![false; n];
        used[first] = true;
        let mut path = vec![first];
        if extend(&mut path, &mut used, k, ok, &mut budget) {
            return Some(path);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::test_support::*;
    use crate::membership::Event;
    use tessera_proto::CoordToNode;

    fn link_failed(m: &mut Membership, node: NodeId, peer: NodeId) -> Vec<Action> {
        let epoch = m.epoch().unwrap().id;
        m.handle(Event::LinkFailed {
            node,
            epoch,
            reason: "the ring link to the next stage is lost: timed out".into(),
            peer: Some(peer),
        })
    }

    fn assigned(acts: &[Action]) -> Vec<(NodeId, std::ops::Range<usize>)> {
        sends(acts)
            .into_iter()
            .filter_map(|(n, x)| match x {
                CoordToNode::Assign(a) => Some((n, a.layers)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_lost_ring_link_is_planned_around_by_a_ring_where_the_pair_are_not_neighbours() {
        let mut m = Membership::new();
        let (a, b, c, d) = (member(1), member(2), member(3), member(4));
        for x in [&a, &b, &c, &d] {
            m.handle(Event::Joined(Box::new(x.clone())));
        }
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![
                (a.node_id, 0..1),
                (b.node_id, 1..2),
                (c.node_id, 2..3),
                (d.node_id, 3..4),
            ],
            n_layer: 4,
            max_context: 64,
        });
        let first = ready(&mut m);
        // a's link to b (its next stage) is lost mid-epoch.
        let acts = link_failed(&mut m, a.node_id, b.node_id);
        assert!(acts.iter().any(|x| matches!(x, Action::EpochFailed {
                epoch,
                reason: EpochFailure::Reported { node, reason },
            } if *epoch == first && *node == a.node_id)));
        assert!(sends(&acts).iter().any(|(n, x)| *n == b.node_id
            && matches!(x, CoordToNode::Release { epoch } if *epoch == first)));
        // Every node keeps a stage: a, c, b, d is the first ring in join order in which a
        // and b are not neighbours.
        assert_eq!(
            assigned(&acts),
            vec![
                (a.node_id, 0..1),
                (c.node_id, 1..2),
                (b.node_id, 2..3),
                (d.node_id, 3..4)
            ]
        );
        assert_eq!(m.epoch().unwrap().id, first + 1);
        assert!(m.outage().is_none());
        // The report of the other end, about the failed epoch, changes nothing.
        let late = m.handle(Event::LinkFailed {
            node: b.node_id,
            epoch: first,
            reason: "the ring link from the previous stage is lost".into(),
            peer: Some(a.node_id),
        });
        assert!(late.is_empty(), "{late:?}");
    }

    #[test]
    fn with_no_ring_that_avoids_the_pair_the_node_that_did_not_report_is_left_out_until_it_rejoins()
    {
        let (mut m, a, b, c) = three_stage_ring();
        ready(&mut m);
        // In a ring of three every pair are neighbours: c reported, so b is left out.
        let acts = link_failed(&mut m, c.node_id, b.node_id);
        assert_eq!(assigned(&acts), vec![(a.node_id, 0..2), (c.node_id, 2..3)]);
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::Note(Note::LinkLost { between })
                if *between == ("n3".to_string(), "n2".to_string()))));
        ready(&mut m);
        // b restarts (a new session): its links are worth trying again, and it is folded
        // back in.
        let mut b2 = b.clone();
        b2.session = 2;
        let acts = m.handle(Event::Joined(Box::new(b2)));
        assert_eq!(m.failed_links().count(), 0);
        assert_eq!(
            assigned(&acts),
            vec![(a.node_id, 0..1), (c.node_id, 1..2), (b.node_id, 2..3)]
        );
    }

    #[test]
    fn with_more_nodes_than_stages_a_plan_without_the_pair_as_neighbours_keeps_every_stage() {
        let mut m = Membership::new();
        let (a, b, c) = (member(1), member(2), member(3));
        for x in [&a, &b, &c] {
            m.handle(Event::Joined(Box::new(x.clone())));
        }
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..1), (b.node_id, 1..2)],
            n_layer: 2,
            max_context: 64,
        });
        ready(&mut m);
        let acts = link_failed(&mut m, a.node_id, b.node_id);
        assert_eq!(assigned(&acts), vec![(a.node_id, 0..1), (c.node_id, 1..2)]);
    }

    #[test]
    fn a_two_stage_ring_whose_link_is_lost_runs_on_the_reporter_alone() {
        let mut m = Membership::new();
        let (a, b) = (member(1), member(2));
        for x in [&a, &b] {
            m.handle(Event::Joined(Box::new(x.clone())));
        }
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..2), (b.node_id, 2..4)],
            n_layer: 4,
            max_context: 64,
        });
        ready(&mut m);
        let acts = link_failed(&mut m, a.node_id, b.node_id);
        assert_eq!(assigned(&acts), vec![(a.node_id, 0..4)]);
    }

    #[test]
    fn a_lost_expert_link_moves_the_unreachable_owners_experts_to_the_survivors() {
        let mut m = Membership::new();
        let (a, b, c) = (member(1), member(2), member(3));
        for x in [&a, &b, &c] {
            m.handle(Event::Joined(Box::new(x.clone())));
        }
        m.set_expert_split(Some(
            crate::assignment::parse_experts("0-1@n1,2-4@n2,5-7@n3").unwrap(),
        ));
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..2)],
            n_layer: 2,
            max_context: 64,
        });
        ready(&mut m);
        // The home a cannot reach the expert owner c.
        let acts = link_failed(&mut m, a.node_id, c.node_id);
        let held: Vec<(NodeId, Vec<usize>)> = sends(&acts)
            .into_iter()
            .filter_map(|(n, x)| match x {
                CoordToNode::AssignExperts { experts, .. } => Some((n, experts.held[0].clone())),
                _ => None,
            })
            .collect();
        // The ring stays on a; c's experts go to the nodes a still reaches.
        assert_eq!(layers(&m), vec![(a.node_id, 0..2), (b.node_id, 0..0)]);
        assert_eq!(held.len(), 2, "{held:?}");
        let all: Vec<usize> = {
            let mut v: Vec<usize> = held.iter().flat_map(|(_, e)| e.clone()).collect();
            v.sort_unstable();
            v
        };
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        assert!(!m.expert_split_ready(), "c is left out of plans meanwhile");
    }

    #[test]
    fn a_report_naming_no_peer_of_the_epoch_fails_it_and_keeps_no_pair() {
        let mut m = Membership::new();
        let (a, b, c) = (member(1), member(2), member(3));
        for x in [&a, &b, &c] {
            m.handle(Event::Joined(Box::new(x.clone())));
        }
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..1), (b.node_id, 1..2)],
            n_layer: 2,
            max_context: 64,
        });
        let first = ready(&mut m);
        // c is no stage of the epoch: a cannot bench it, nor itself.
        let acts = link_failed(&mut m, a.node_id, c.node_id);
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::EpochFailed { epoch, .. } if *epoch == first)));
        assert_eq!(m.failed_links().count(), 0);
        assert!(assigned(&acts).is_empty());
        // A bystander's report is refused.
        let mut m2 = Membership::new();
        for x in [&a, &b, &c] {
            m2.handle(Event::Joined(Box::new(x.clone())));
        }
        m2.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..1), (b.node_id, 1..2)],
            n_layer: 2,
            max_context: 64,
        });
        ready(&mut m2);
        let acts = link_failed(&mut m2, c.node_id, a.node_id);
        assert!(matches!(acts[..], [Action::Refused { node, .. }] if node == c.node_id));
        assert_eq!(m2.failed_links().count(), 0);
    }

    #[test]
    fn first_ring_prefers_join_order_and_gives_up_when_none_exists() {
        let apart = |a: usize, b: usize| !matches!((a.min(b), a.max(b)), (0, 1));
        assert_eq!(first_ring(4, 4, &apart), Some(vec![0, 2, 1, 3]));
        assert_eq!(first_ring(3, 3, &apart), None);
        assert_eq!(first_ring(3, 2, &apart), Some(vec![0, 2]));
        assert_eq!(first_ring(2, 2, &apart), None);
    }
}
