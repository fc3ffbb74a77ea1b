//! Absorbing failures: a stage node that leaves (its session ended or its lease expired) fails
//! the epoch, and a new one is planned at once from the connected survivors
//! ([`crate::replan`]: the configured stage count, or fewer when fewer nodes are left, within
//! their budgets). With no feasible placement the cluster is in an outage
//! ([`Membership::outage`]) until a node joins. A node that joins while the epoch has fewer
//! stages than configured (or while there is none) triggers a plan that folds it in.

use std::ops::Range;

use tessera_net::NodeId;

use super::{Action, Membership, Phase};
use crate::replan::{even_split, Survivor};
use tessera_host::ContentHash;

/// What re-planning needs: set by the last requested plan.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoPlan {
    pub model: ContentHash,
    pub n_layer: usize,
    pub max_context: usize,
    /// The configured stage count (the requested plan's).
    pub target_stages: usize,
}

impl Membership {
    pub(super) fn stage_lost(&mut self, id: NodeId, what: &str) -> Vec<Action> {
        self.forget_failed_links(id);
        match &self.epoch {
            Some(e)
                if e.stages.iter().any(|s| s.node_id == id)
                    && !matches!(e.phase, Phase::Failed(_) | Phase::Released) =>
            {
                let role = match e.stages.iter().find(|s| s.node_id == id) {
                    Some(s) if s.layers.is_empty() => "expert node",
                    _ => "stage node",
                };
                let mut out = self.fail(format!("{role} {} {what}", id.short()));
                out.extend(self.replan());
                out
            }
            // The epoch had already failed (say a neighbour of this node could not link to it
            // before its lease ran out): try again with those left.
            Some(e) if matches!(e.phase, Phase::Failed(_)) && self.auto.is_some() => self.replan(),
            _ => Vec::new(),
        }
    }

    /// Connected members as re-planning candidates, in join order, without those benched.
    fn survivors(&self) -> Vec<Survivor> {
        self.usable()
            .into_iter()
            .map(|m| Survivor {
                node_id: m.node_id,
                memory_budget_bytes: m.memory_budget_bytes,
            })
            .collect()
    }

    /// The ring stages (nodes with layers) of the current epoch.
    fn ring(&self) -> Vec<(NodeId, Range<usize>)> {
        self.epoch
            .iter()
            .flat_map(|e| &e.stages)
            .filter(|s| !s.layers.is_empty())
            .map(|s| (s.node_id, s.layers.clone()))
            .collect()
    }

    /// The stage count a plan on the usable nodes aims for.
    pub(super) fn wanted_stages(&self, auto: &AutoPlan) -> usize {
        auto.target_stages
            .min(self.usable().len())
            .min(auto.n_layer)
    }

    /// With an expert split, the last epoch's ring when all of it is still connected and it
    /// has the stages wanted: an expert owner's loss (or return) moves experts, not layers.
    fn surviving_ring(&self, auto: &AutoPlan) -> Option<Vec<(NodeId, Range<usize>)>> {
        self.experts.as_ref()?;
        let ring = self.ring();
        let alive = ring.iter().all(|(id, _)| {
            self.members.get(id).is_some_and(|m| m.connected) && !self.benched.contains(id)
        });
        (!ring.is_empty() && alive && ring.len() >= self.wanted_stages(auto)).then_some(ring)
    }

    /// Plans a new epoch on the connected nodes (after a loss, or to fold a node in).
    pub(super) fn replan(&mut self) -> Vec<Action> {
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
            let ring = match self.surviving_ring(&auto) {
                Some(ring) => Ok(ring),
                None => even_split(
                    auto.n_layer,
                    &self.ring_order(self.survivors(), self.wanted_stages(&auto)),
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
            Ok(stages) => {
                self.outage = None;
                self.plan(auto.model, stages, auto.n_layer, auto.max_context, true)
            }
            Err(reason) => {
                let reason = format!("no feasible plan: {reason}");
                self.outage = Some(reason.clone());
                let epoch = self.epoch.as_ref().map_or(0, |e| e.id);
                vec![Action::EpochFailed { epoch, reason }]
            }
        }
    }

    /// A node joined: plan again when that restores the configured stage count, or ends an
    /// outage. (A better plan by the planner's score is the planner's seam.)
    pub(super) fn fold_in(&mut self) -> Vec<Action> {
        let Some(auto) = &self.auto else {
            return Vec::new();
        };
        let wanted = self.wanted_stages(auto);
        // The configured expert split can be placed again (its owners are all back) while the
        // epoch runs a re-placed one.
        let restorable = self.experts.is_some()
            && self.epoch_experts != self.experts
            && self.expert_split_ready();
        let better = match &self.epoch {
            Some(e) if !matches!(e.phase, Phase::Failed(_) | Phase::Released) => {
                self.ring().len() < wanted || restorable
            }
            _ => true,
        };
        if better {
            self.replan()
        } else {
            Vec::new()
        }
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
        assert_eq!(sends(&acts).len(), 2 + 3, "release two, assign three");
        assert_eq!(m.epoch().unwrap().id, first + 2);
        assert_eq!(
            layers(&m),
            vec![(a.node_id, 0..1), (c.node_id, 1..2), (b.node_id, 2..3)]
        );
        ready(&mut m);
        // A join that does not restore anything plans nothing.
        let d = member(4);
        assert!(m.handle(Event::Joined(Box::new(d))).is_empty());
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
        assert!(m.outage().unwrap().contains("no node is connected"));
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
        assert!(m.outage().unwrap().contains("budget"), "{:?}", m.outage());
    }
}
