//! Epochs: one immutable placement of the model's layer ranges on nodes, going through
//! `Loading` (every stage node received [`CoordToNode::Assign`] and loads its part) → `Linking`
//! (all loaded; every stage dials the next, measures the link, opens the ring) → `Ready`. A new
//! plan is a new epoch; the previous one is released.

use super::note::Note;
use std::ops::Range;

use tessera_net::{LinkMeasurement, NodeId};

use super::events::send;
use super::{Action, EpochFailure, Membership};
use tessera_host::ContentHash;
use tessera_proto::{CoordToNode, LoadReport, PeerInfo, StageAssignment};

/// Where an epoch is.
#[derive(Clone, Debug, PartialEq)]
pub enum Phase {
    Loading,
    Linking,
    Ready,
    Failed(EpochFailure),
    Released,
}

/// As recorded in `state.redb` and shown on `/api/status`: `loading`, `linking`, `ready`,
/// `failed: REASON` or `released`.
impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Loading => f.write_str("loading"),
            Self::Linking => f.write_str("linking"),
            Self::Ready => f.write_str("ready"),
            Self::Failed(r) => write!(f, "failed: {r}"),
            Self::Released => f.write_str("released"),
        }
    }
}

/// One stage of an epoch.
#[derive(Clone, Debug)]
pub struct EpochStage {
    pub node_id: NodeId,
    pub layers: Range<usize>,
    pub loaded: Option<LoadReport>,
    pub linked: bool,
    /// Link from this stage to the next, measured by this stage.
    pub link: Option<LinkMeasurement>,
    /// In an expert split, the experts it loads, by layer (`None`: every expert of its own
    /// layers). With its layers, what it may receive of the model ([`crate::model_access`]).
    pub held_experts: Option<Vec<Vec<usize>>>,
}

/// One placement of the model: one cell's ring.
#[derive(Clone, Debug)]
pub struct Epoch {
    pub id: u64,
    /// The cell slot it places (0 unless the plan holds several cells).
    pub cell: usize,
    pub model: ContentHash,
    pub stages: Vec<EpochStage>,
    pub phase: Phase,
    /// The expert split it runs (`None`: each stage holds all its layers' experts): the
    /// configured one, or after a loss the one with the departed owners' experts re-placed.
    pub experts: Option<crate::assignment::ExpertSplit>,
}

/// Whether an epoch still holds its nodes (it has not failed or been released).
pub(super) fn is_live(e: &Epoch) -> bool {
    !matches!(e.phase, Phase::Failed(_) | Phase::Released)
}

impl Membership {
    /// Epoch `epoch` in `phase`: a cell's, or a successor being made beside one.
    pub(super) fn current_mut(&mut self, epoch: u64, phase: Phase) -> Option<&mut Epoch> {
        self.cells
            .iter_mut()
            .chain(self.successors.iter_mut())
            .find(|e| e.id == epoch && e.phase == phase)
    }

    /// Sends `Release` for `e` to its connected nodes.
    fn release_nodes(&self, e: &Epoch, out: &mut Vec<Action>) {
        for s in &e.stages {
            if self.members.get(&s.node_id).is_some_and(|m| m.connected) {
                out.push(send(s.node_id, CoordToNode::Release { epoch: e.id }));
            }
        }
    }

    /// Drops the successor being made for cell `slot`, if any, releasing what it assigned.
    pub(super) fn discard_successor(&mut self, slot: usize, out: &mut Vec<Action>) {
        let (gone, kept): (Vec<Epoch>, Vec<Epoch>) = std::mem::take(&mut self.successors)
            .into_iter()
            .partition(|e| e.cell == slot);
        self.successors = kept;
        for e in gone {
            self.release_nodes(&e, out);
        }
    }

    /// Releases every draining epoch that `keep` rejects.
    pub(super) fn release_draining(
        &mut self,
        keep: impl Fn(&Epoch) -> bool,
        out: &mut Vec<Action>,
    ) {
        let (kept, gone): (Vec<Epoch>, Vec<Epoch>) = std::mem::take(&mut self.draining)
            .into_iter()
            .partition(|e| keep(e));
        self.draining = kept;
        for e in gone {
            self.release_nodes(&e, out);
        }
    }

    /// A successor became ready: it takes its cell's slot, and the epoch it replaces drains
    /// (its runs finish on it; new ones go to the successor).
    pub(super) fn promote(&mut self, epoch: u64) -> Vec<Action> {
        let Some(i) = self.successors.iter().position(|e| e.id == epoch) else {
            return Vec::new();
        };
        let new = self.successors.remove(i);
        let slot = new.cell;
        let mut out = Vec::new();
        match self.cells.get_mut(slot) {
            Some(old) => {
                let old = std::mem::replace(old, new);
                if old.phase == Phase::Ready {
                    out.push(Action::Note(Note::Replaces {
                        epoch,
                        old: old.id,
                        cell: slot,
                    }));
                    self.draining.push(old);
                } else if is_live(&old) {
                    self.release_nodes(&old, &mut out);
                }
            }
            None => self.set_cell(new),
        }
        out
    }

    /// Fails cell `slot`'s epoch: its connected stages release it.
    pub(super) fn fail(&mut self, slot: usize, reason: EpochFailure) -> Vec<Action> {
        let Some(e) = self.cells.get_mut(slot) else {
            return Vec::new();
        };
        e.phase = Phase::Failed(reason.clone());
        let mut out: Vec<Action> = e
            .stages
            .iter()
            .filter(|s| self.members.get(&s.node_id).is_some_and(|m| m.connected))
            .map(|s| send(s.node_id, CoordToNode::Release { epoch: e.id }))
            .collect();
        out.push(Action::EpochFailed {
            epoch: e.id,
            reason,
        });
        out
    }

    /// Puts `epoch` in its cell's slot (slots are filled in order).
    fn set_cell(&mut self, epoch: Epoch) {
        match self.cells.get_mut(epoch.cell) {
            Some(e) => *e = epoch,
            None => {
                debug_assert_eq!(
                    epoch.cell,
                    self.cells.len(),
                    "cell slots are filled in order"
                );
                self.cells.push(epoch);
            }
        }
    }

    /// Records epoch `id` of cell `slot` as failed before any stage was assigned, and says why.
    fn fail_unstarted(
        &mut self,
        slot: usize,
        id: u64,
        model: ContentHash,
        reason: EpochFailure,
        out: &mut Vec<Action>,
    ) {
        self.set_cell(Epoch {
            id,
            cell: slot,
            model,
            stages: Vec::new(),
            phase: Phase::Failed(reason.clone()),
            experts: None,
        });
        out.push(Action::EpochFailed { epoch: id, reason });
    }

    /// Releases cell `slot`'s epoch if it still holds its nodes.
    fn release(&mut self, slot: usize, out: &mut Vec<Action>) {
        let Some(old) = self.cells.get_mut(slot) else {
            return;
        };
        if is_live(old) {
            for s in &old.stages {
                if self.members.get(&s.node_id).is_some_and(|m| m.connected) {
                    out.push(send(s.node_id, CoordToNode::Release { epoch: old.id }));
                }
            }
        }
        old.phase = Phase::Released;
    }

    /// Places a requested plan: `stages` as the cells `cells` (index ranges into it) says,
    /// releasing every cell of the previous plan.
    pub(super) fn plan_cells(
        &mut self,
        model: ContentHash,
        stages: Vec<(NodeId, Range<usize>)>,
        cells: Vec<Range<usize>>,
        n_layer: usize,
        max_context: usize,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        for slot in 0..self.cells.len() {
            self.release(slot, &mut out);
            self.discard_successor(slot, &mut out);
        }
        self.release_draining(|_| false, &mut out);
        self.cells.truncate(cells.len().max(1));
        if cells.len() > 1 && self.experts.is_some() {
            // An expert split spreads one copy of the model's experts over nodes: one cell.
            self.next_epoch += 1;
            let reason = EpochFailure::ExpertSplitIsOneCell;
            self.fail_unstarted(0, self.next_epoch, model, reason, &mut out);
            self.cells.truncate(1);
            return out;
        }
        if cells.is_empty() {
            out.extend(self.plan(0, model, stages, n_layer, max_context, false));
            return out;
        }
        for (slot, range) in cells.into_iter().enumerate() {
            let ring = stages[range].to_vec();
            out.extend(self.plan(slot, model, ring, n_layer, max_context, false));
        }
        out
    }

    /// Places `stages` as a new epoch of cell `slot`, releasing the cell's previous one.
    pub(super) fn plan(
        &mut self,
        slot: usize,
        model: ContentHash,
        stages: Vec<(NodeId, Range<usize>)>,
        n_layer: usize,
        max_context: usize,
        reassign: bool,
    ) -> Vec<Action> {
        self.place(slot, model, stages, n_layer, max_context, reassign, false)
    }

    /// Places `stages` as a new epoch of cell `slot` beside its serving one (make before
    /// break): the new epoch loads and links while the old one serves, and takes the slot once
    /// ready ([`Membership::promote`]). A placement that cannot start leaves the old one
    /// serving.
    pub(super) fn plan_beside(
        &mut self,
        slot: usize,
        model: ContentHash,
        stages: Vec<(NodeId, Range<usize>)>,
        n_layer: usize,
        max_context: usize,
    ) -> Vec<Action> {
        self.place(slot, model, stages, n_layer, max_context, true, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn place(
        &mut self,
        slot: usize,
        model: ContentHash,
        stages: Vec<(NodeId, Range<usize>)>,
        n_layer: usize,
        max_context: usize,
        reassign: bool,
        beside: bool,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        // A newer placement replaces a successor still being made.
        self.discard_successor(slot, &mut out);
        if !beside {
            self.release(slot, &mut out);
        }
        self.next_epoch += 1;
        let id = self.next_epoch;
        let peers: Vec<Option<PeerInfo>> = stages
            .iter()
            .map(|(n, _)| {
                self.members
                    .get(n)
                    .filter(|m| m.connected)
                    .map(|m| PeerInfo {
                        node_id: m.node_id,
                        key: m.key,
                        addr: m.addr,
                    })
            })
            .collect();
        if let Some(i) = peers.iter().position(Option::is_none) {
            let reason = format!("node {} is not connected", stages[i].0.short());
            self.unstarted(slot, id, model, reason, beside, &mut out);
            return out;
        }
        let peers: Vec<PeerInfo> = peers.into_iter().flatten().collect();
        let n = stages.len();
        let split = match self.split_for(&stages, n_layer, reassign) {
            Ok(s) => s.map(|(split, note)| {
                out.extend(note.map(Action::Note));
                split
            }),
            Err(reason) => {
                let reason = format!("expert split: {reason}");
                self.unstarted(slot, id, model, reason, beside, &mut out);
                return out;
            }
        };
        let expert_plan = match &split {
            None => None,
            Some(split) => {
                let ring: Vec<(NodeId, PeerInfo)> = stages
                    .iter()
                    .map(|(id, _)| *id)
                    .zip(peers.iter().cloned())
                    .collect();
                match self.place_experts(split, &ring, n_layer) {
                    Ok(p) => Some(p),
                    Err(reason) => {
                        let reason = format!("expert split: {reason}");
                        self.unstarted(slot, id, model, reason, beside, &mut out);
                        return out;
                    }
                }
            }
        };
        for (i, (node, layers)) in stages.iter().enumerate() {
            if let Some((parts, _)) = &expert_plan {
                out.push(send(
                    *node,
                    CoordToNode::AssignExperts {
                        epoch: id,
                        experts: parts[i].clone(),
                    },
                ));
            }
            let (next, prev) = if n == 1 {
                (None, None)
            } else {
                (
                    Some(peers[(i + 1) % n].clone()),
                    Some(peers[(i + n - 1) % n].clone()),
                )
            };
            out.push(send(
                *node,
                CoordToNode::Assign(StageAssignment {
                    epoch: id,
                    model,
                    stage: i,
                    n_stages: n,
                    layers: layers.clone(),
                    embed: i == 0,
                    head: layers.end == n_layer,
                    next,
                    prev,
                    max_context,
                    kv_type: self.kv_type,
                    expert_budget: self.expert_budget_of(node),
                }),
            ));
        }
        // Expert-only nodes: not in the ring, but part of the epoch (they load, link, open and
        // close sequences like stages, with no layers).
        let mut stages = stages;
        let mut held: Vec<Option<Vec<Vec<usize>>>> = match &expert_plan {
            Some((parts, _)) => parts.iter().map(|x| Some(x.held.clone())).collect(),
            None => vec![None; stages.len()],
        };
        if let Some((_, only)) = expert_plan {
            for (j, (p, x)) in only.into_iter().enumerate() {
                let x_held = x.held.clone();
                out.push(send(
                    p.node_id,
                    CoordToNode::AssignExperts {
                        epoch: id,
                        experts: x,
                    },
                ));
                out.push(send(
                    p.node_id,
                    CoordToNode::Assign(StageAssignment {
                        epoch: id,
                        model,
                        stage: n + j,
                        n_stages: n,
                        layers: 0..0,
                        embed: false,
                        head: false,
                        next: None,
                        prev: None,
                        max_context,
                        kv_type: self.kv_type,
                        expert_budget: self.expert_budget_of(&p.node_id),
                    }),
                ));
                held.push(Some(x_held));
                stages.push((p.node_id, 0..0));
            }
        }
        let epoch = Epoch {
            id,
            cell: slot,
            model,
            stages: stages
                .into_iter()
                .zip(held)
                .map(|((node_id, layers), held_experts)| EpochStage {
                    node_id,
                    layers,
                    loaded: None,
                    linked: false,
                    link: None,
                    held_experts,
                })
                .collect(),
            phase: Phase::Loading,
            experts: split,
        };
        if beside {
            self.successors.push(epoch);
        } else {
            self.set_cell(epoch);
        }
        out
    }

    /// Epoch `id` of cell `slot` could not start: recorded as failed in the slot, or, beside
    /// a serving epoch, only said (the serving one goes on).
    fn unstarted(
        &mut self,
        slot: usize,
        id: u64,
        model: ContentHash,
        reason: String,
        beside: bool,
        out: &mut Vec<Action>,
    ) {
        if beside {
            out.push(Action::Note(Note::SuccessorCannotStart {
                cell: slot,
                epoch: id,
                reason,
            }));
        } else {
            self.fail_unstarted(slot, id, model, EpochFailure::CannotStart(reason), out);
        }
    }
}

#[cfg(test)]
mod tests;
