//! Absorbing failures: a stage node that leaves (its session ended or its lease expired) fails
//! the epoch, and a new one is planned at once from the connected survivors
//! ([`crate::replan`]: the configured stage count, or fewer when fewer nodes are left, within
//! their budgets). With no feasible placement the cluster is in an outage
//! ([`Membership::outage`]) until a node joins. A node that joins while the epoch has fewer
//! stages than configured (or while there is none) triggers a plan that folds it in.

use super::note::Note;
use std::ops::Range;

use tessera_net::NodeId;

use super::epochs::is_live;
use super::{Action, Departure, Epoch, EpochFailure, Membership, Phase};
use crate::replan::{even_split, Survivor};
use tessera_host::ContentHash;

/// What re-planning needs: set by the last requested plan.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoPlan {
    pub model: ContentHash,
    pub n_layer: usize,
    pub max_context: usize,
    /// The configured stage count of a cell (the requested plan's largest ring).
    pub target_stages: usize,
    /// The configured number of cells (whole copies of the model).
    pub cells: usize,
}

impl Membership {
    pub(super) fn stage_lost(&mut self, id: NodeId, how: Departure) -> Vec<Action> {
        self.forget_failed_links(id);
        let mut early = Vec::new();
        // A new split being made on the node is dropped (the serving epoch goes on); a draining
        // epoch on it is lost, and its runs resume on a ready cell.
        let has = |e: &Epoch| e.stages.iter().any(|s| s.node_id == id);
        let slots: Vec<usize> = self
            .successors
            .iter()
            .filter(|e| has(e))
            .map(|e| e.cell)
            .collect();
        for slot in slots {
            self.discard_successor(slot, &mut early);
        }
        self.release_draining(|e| !has(e), &mut early);
        let mut out = self.stage_lost_from_cells(id, how);
        early.append(&mut out);
        early
    }

    fn stage_lost_from_cells(&mut self, id: NodeId, how: Departure) -> Vec<Action> {
        let holding = self
            .cells
            .iter()
            .position(|e| is_live(e) && e.stages.iter().any(|s| s.node_id == id));
        match holding {
            Some(slot) => {
                let expert_only = self.cells[slot]
                    .stages
                    .iter()
                    .find(|s| s.node_id == id)
                    .is_some_and(|s| s.layers.is_empty());
                let gone = EpochFailure::NodeGone {
                    node: id,
                    expert_only,
                    how,
                };
                let mut out = self.fail(slot, gone);
                out.extend(self.replan(slot));
                out
            }
            // A cell had already failed (say a neighbour of this node could not link to it
            // before its lease ran out): try again with those left.
            None if self.auto.is_some() => {
                let failed: Vec<usize> = (0..self.cells.len())
                    .filter(|&c| matches!(self.cells[c].phase, Phase::Failed(_)))
                    .collect();
                failed.into_iter().flat_map(|c| self.replan(c)).collect()
            }
            None => Vec::new(),
        }
    }

    /// Connected members cell `slot` may be planned on, in join order: neither benched nor
    /// held by another live cell.
    fn survivors(&self, slot: usize) -> Vec<Survivor> {
        let held: Vec<NodeId> = self
            .cells
            .iter()
            .chain(&self.successors)
            .chain(&self.draining)
            .filter(|e| e.cell != slot && is_live(e))
            .flat_map(|e| e.stages.iter().map(|s| s.node_id))
            .collect();
        self.usable()
            .into_iter()
            .filter(|m| !held.contains(&m.node_id))
            .map(|m| Survivor {
                node_id: m.node_id,
                memory_budget_bytes: m.memory_budget_bytes,
            })
            .collect()
    }

    /// The ring stages (nodes with layers) of cell `slot`'s epoch.
    fn ring(&self, slot: usize) -> Vec<(NodeId, Range<usize>)> {
        self.cells
            .get(slot)
            .iter()
            .flat_map(|e| &e.stages)
            .filter(|s| !s.layers.is_empty())
            .map(|s| (s.node_id, s.layers.clone()))
            .collect()
    }

    /// The stage count a plan of cell `slot` on the nodes it may use aims for.
    pub(super) fn wanted_stages(&self, auto: &AutoPlan, slot: usize) -> usize {
        auto.target_stages
            .min(self.survivors(slot).len())
            .min(auto.n_layer)
    }

    /// With an expert split, the last epoch's ring when all of it is still connected and it
    /// has the stages wanted: an expert owner's loss (or return) moves experts, not layers.
    fn surviving_ring(&self, auto: &AutoPlan, slot: usize) -> Option<Vec<(NodeId, Range<usize>)>> {
        self.experts.as_ref()?;
        let ring = self.ring(slot);
        let alive = ring.iter().all(|(id, _)| {
            self.members.get(id).is_some_and(|m| m.connected) && !self.benched.contains(id)
        });
        (!ring.is_empty() && alive && ring.len() >= self.wanted_stages(auto, slot)).then_some(ring)
    }

    /// Whether a cell other than `slot` is loading, linking or serving.
    fn another_cell_live(&self, slot: usize) -> bool {
        self.cells.iter().any(|e| e.cell != slot && is_live(e))
    }

    /// Plans a new epoch of cell `slot` on the nodes it may use (after a loss, or to fold a
    /// node in). The other cells are not touched.
    pub(super) fn replan(&mut self, slot: usize) -> Vec<Action> {
        self.replan_with(slot, false)
    }

    /// [`Membership::replan`]; `beside`: the new epoch is made beside the cell's serving one,
    /// which keeps serving until it is ready (and on, if no plan is found).
    fn replan_with(&mut self, slot: usize, beside: bool) -> Vec<Action> {
        let Some(auto) = self.auto.clone() else {
            return Vec::new();
        };
        // With an expert split, a stage's budget bounds its layers without their experts
        // (which its node streams from disk when they do not fit).
        let dense = match (&self.experts, &self.bytes) {
            (Some(_), Some(b)) => Some(b.without_experts()),
            (_, b) => b.clone(),
        };
        // Each round leaves out one more node of a failed link the plan would need; a plan on
        // one node needs none, so this ends.
        self.benched.clear();
        let ring = loop {
            let ring = match self.surviving_ring(&auto, slot) {
                Some(ring) => Ok(ring),
                None => even_split(
                    auto.n_layer,
                    &self.ring_order(self.survivors(slot), self.wanted_stages(&auto, slot)),
                    auto.target_stages,
                    dense.as_ref(),
                ),
            };
            match ring
                .as_ref()
                .ok()
                .and_then(|r| self.needs_failed_link(r, auto.n_layer))
            {
                Some(leave_out) => {
                    self.benched.insert(leave_out);
                }
                None => break ring,
            }
        };
        match ring {
            Ok(stages) if beside => {
                self.plan_beside(slot, auto.model, stages, auto.n_layer, auto.max_context)
            }
            Ok(stages) => {
                self.outage = None;
                self.plan(
                    slot,
                    auto.model,
                    stages,
                    auto.n_layer,
                    auto.max_context,
                    true,
                )
            }
            Err(reason) if beside => vec![Action::Note(Note::KeepsSplit { cell: slot, reason })],
            // Another cell still serves: this one waits for nodes, and the service goes on.
            Err(reason) if self.another_cell_live(slot) => {
                if let Some(e) = self.cells.get_mut(slot) {
                    if is_live(e) {
                        e.phase = Phase::Failed(EpochFailure::NoFeasiblePlan(reason.clone()));
                    }
                }
                vec![Action::Note(Note::CellNotPlaced { cell: slot, reason })]
            }
            Err(reason) => {
                self.outage = Some(reason.clone());
                let reason = EpochFailure::NoFeasiblePlan(reason);
                let epoch = self.cells.get(slot).map_or(0, |e| e.id);
                vec![Action::EpochFailed { epoch, reason }]
            }
        }
    }

    /// A node joined: plan a cell again when that restores its configured stage count, places
    /// a missing cell (the others keep serving), or ends an outage. (A better plan by the
    /// planner's score is the planner's seam.)
    pub(super) fn fold_in(&mut self) -> Vec<Action> {
        let Some(auto) = self.auto.clone() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for slot in 0..auto.cells {
            let wanted = self.wanted_stages(&auto, slot);
            // The configured expert split can be placed again (its owners are all back) while
            // the epoch runs a re-placed one.
            let restorable = slot == 0
                && self.experts.is_some()
                && self
                    .cells
                    .first()
                    .is_some_and(|e| e.experts != self.experts)
                && self.expert_split_ready();
            // A new split already being made with the stages wanted is left to finish.
            let making = self.successors.iter().any(|e| {
                e.cell == slot && e.stages.iter().filter(|s| !s.layers.is_empty()).count() >= wanted
            });
            let better = match self.cells.get(slot) {
                Some(_) if making => false,
                Some(e) if is_live(e) => self.ring(slot).len() < wanted || restorable,
                // The first cell is always tried (its failure is the outage's reason); a
                // further cell only with nodes to place it on.
                _ => slot == 0 || wanted > 0,
            };
            if better {
                // A serving cell (a ring, or an expert split) is switched to the new split once
                // that is ready (make before break): its runs finish where they are.
                let serving = self
                    .cells
                    .get(slot)
                    .is_some_and(|e| e.phase == Phase::Ready);
                out.extend(self.replan_with(slot, serving));
            }
            // Slots fill in order: a cell that could not be placed leaves no nodes for later.
            if !self.cells.get(slot).is_some_and(is_live) {
                break;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::test_support::*;
    use crate::membership::Event;
    use crate::replan::ModelBytes;
    use tessera_proto::CoordToNode;

    #[test]
    fn a_lost_stage_is_replanned_onto_survivors_and_a_returning_node_folded_in() {
        let (mut m, a, b, c) = three_stage_ring();
        let first = ready(&mut m);
        // The middle stage goes: epoch failed, survivors released, a new 2-stage epoch placed.
        let acts = m.handle(Event::Left {
            node: b.node_id,
            session: 1,
        });
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::EpochFailed { epoch, .. } if *epoch == first)));
        let s = sends(&acts);
        assert!(s.iter().any(|(n, x)| *n == a.node_id
            && matches!(x, CoordToNode::Release { epoch } if *epoch == first)));
        let assigns: Vec<_> = s
            .iter()
            .filter_map(|(n, x)| match x {
                CoordToNode::Assign(a) => Some((*n, a.layers.clone(), a.epoch)),
                _ => None,
            })
            .collect();
        assert_eq!(
            assigns,
            vec![(a.node_id, 0..2, first + 1), (c.node_id, 2..3, first + 1)]
        );
        ready(&mut m);
        // b returns: the configured three stages are restored in a new epoch.
        let mut b2 = b.clone();
        b2.session = 2;
        let acts = m.handle(Event::Joined(Box::new(b2)));
        // Made beside the serving epoch: three assigned, nothing released yet.
        assert_eq!(sends(&acts).len(), 3, "assign three, release none");
        assert_eq!(
            m.epoch().unwrap().id,
            first + 1,
            "the serving epoch serves on"
        );
        ready_epoch(&mut m, first + 2);
        assert_eq!(m.epoch().unwrap().id, first + 2);
        assert_eq!(
            layers(&m),
            vec![(a.node_id, 0..1), (c.node_id, 1..2), (b.node_id, 2..3)]
        );
        // The replaced epoch drains, then is released on its two nodes.
        assert!(m.serves(first + 1));
        let s = sends(&m.handle(Event::Drained { epoch: first + 1 }));
        assert_eq!(s.len(), 2);
        assert!(s
            .iter()
            .all(|(_, x)| matches!(x, CoordToNode::Release { epoch } if *epoch == first + 1)));
        assert!(!m.serves(first + 1));
        // A join that does not restore anything plans nothing.
        let d = member(4);
        assert!(m.handle(Event::Joined(Box::new(d))).is_empty());
    }

    /// A join that re-splits a serving ring makes the new epoch beside it; what goes wrong
    /// while it is made never stops the serving one.
    #[test]
    fn a_new_split_is_made_beside_the_serving_ring_and_its_failures_fall_back() {
        let mut m = Membership::new();
        let (a, b, c) = (member(1), member(2), member(3));
        m.handle(Event::Joined(Box::new(a.clone())));
        m.handle(Event::Joined(Box::new(b.clone())));
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..2), (b.node_id, 2..4)],
            n_layer: 4,
            max_context: 64,
        });
        ready(&mut m);
        // b goes: re-planned on a alone (break: the ring lost a stage).
        m.handle(Event::Left {
            node: b.node_id,
            session: 1,
        });
        let serving = ready(&mut m);
        assert_eq!(m.epoch().unwrap().stages.len(), 1);
        // b returns: a two-stage successor is made beside the one-node ring.
        let mut b2 = b.clone();
        b2.session = 2;
        m.handle(Event::Joined(Box::new(b2)));
        let succ = m.successors()[0].id;
        assert!(m.serves(serving));
        // Another join while it is made does not restart it (it already has the stages).
        assert!(m.handle(Event::Joined(Box::new(c.clone()))).is_empty());
        assert_eq!(m.successors()[0].id, succ);
        // It cannot load beside the old one on a: dropped, and the cell re-planned the plain
        // way (the serving epoch released first).
        let acts = m.handle(Event::LoadFailed {
            node: a.node_id,
            epoch: succ,
            reason: "does not fit beside the epoch still installed".into(),
        });
        let s = sends(&acts);
        assert!(s.iter().any(|(n, x)| *n == b.node_id
            && matches!(x, CoordToNode::Release { epoch } if *epoch == succ)));
        assert!(s.iter().any(|(n, x)| *n == a.node_id
            && matches!(x, CoordToNode::Release { epoch } if *epoch == serving)));
        assert!(m.successors().is_empty());
        let plain = m.epoch().unwrap().id;
        assert!(plain > succ && !m.serves(serving));
        ready(&mut m);
        assert!(m.draining().is_empty());
    }

    #[test]
    fn a_node_lost_while_a_new_split_is_made_or_drained_loses_only_that() {
        let (mut m, _, b, c) = three_stage_ring();
        ready(&mut m);
        m.handle(Event::Left {
            node: c.node_id,
            session: 1,
        });
        let two = ready(&mut m);
        assert_eq!(m.epoch().unwrap().stages.len(), 2);
        // c returns: a three-stage successor; c leaves before it is ready: dropped, the
        // two-stage ring serves on untouched.
        let mut c2 = c.clone();
        c2.session = 2;
        m.handle(Event::Joined(Box::new(c2)));
        let succ = m.successors()[0].id;
        let acts = m.handle(Event::Left {
            node: c.node_id,
            session: 2,
        });
        assert!(m.successors().is_empty());
        assert!(!acts.iter().any(|x| matches!(x, Action::EpochFailed { .. })));
        assert!(sends(&acts)
            .iter()
            .all(|(_, x)| matches!(x, CoordToNode::Release { epoch } if *epoch == succ)));
        assert!(m.serves(two));
        // c returns; the successor is ready and the old ring drains; b (in both) leaves: the
        // draining epoch is gone with it and the new one is re-planned.
        let mut c3 = c.clone();
        c3.session = 3;
        m.handle(Event::Joined(Box::new(c3)));
        let three = m.successors()[0].id;
        ready_epoch(&mut m, three);
        assert_eq!(m.draining()[0].id, two);
        m.handle(Event::Left {
            node: b.node_id,
            session: 1,
        });
        assert!(m.draining().is_empty() && !m.serves(two) && !m.serves(three));
    }

    #[test]
    fn with_nobody_left_the_cluster_is_in_outage_until_a_node_joins() {
        let mut m = Membership::new();
        m.continue_epochs_after(41);
        let a = member(1);
        m.handle(Event::Joined(Box::new(a.clone())));
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..3)],
            n_layer: 3,
            max_context: 64,
        });
        assert_eq!(
            m.epoch().unwrap().id,
            42,
            "numbering continues after the stored epoch"
        );
        ready(&mut m);
        m.handle(Event::Left {
            node: a.node_id,
            session: 1,
        });
        assert_eq!(m.outage(), Some(&crate::replan::NoPlacement::NoNode));
        assert!(matches!(m.epoch().unwrap().phase, Phase::Failed(_)));
        let b = member(2);
        let acts = m.handle(Event::Joined(Box::new(b.clone())));
        assert!(m.outage().is_none());
        assert_eq!(layers(&m), vec![(b.node_id, 0..3)]);
        assert_eq!(m.epoch().unwrap().id, 43);
        assert_eq!(sends(&acts).len(), 1);
    }

    #[test]
    fn budgets_bound_the_replan() {
        let mut m = Membership::new();
        m.set_model_bytes(Some(ModelBytes {
            layers: vec![100; 4],
            embed: 10,
            head: 10,
            ..ModelBytes::default()
        }));
        let mut a = member(1);
        a.memory_budget_bytes = Some(250);
        let mut b = member(2);
        b.memory_budget_bytes = Some(250);
        m.handle(Event::Joined(Box::new(a.clone())));
        m.handle(Event::Joined(Box::new(b.clone())));
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..2), (b.node_id, 2..4)],
            n_layer: 4,
            max_context: 64,
        });
        ready(&mut m);
        m.handle(Event::Left {
            node: b.node_id,
            session: 1,
        });
        // a alone would need 420 bytes: no feasible plan, and the reason names the budget.
        assert!(
            matches!(
                m.outage(),
                Some(crate::replan::NoPlacement::OverBudget { .. })
            ),
            "{:?}",
            m.outage()
        );
    }
}
