//! Membership and epochs: a pure state machine.
//!
//! Events come in ([`Event`]: a node joined or left, a plan was asked for, a node loaded or
//! linked its stage), actions come out ([`Action`]: messages to send, an epoch became ready or
//! failed). No I/O and no clock: the server feeds it and carries out the actions, and tests
//! drive it directly.
//!
//! An epoch is one immutable placement of the model's layer ranges on nodes. It goes through
//! `Loading` (every stage node received [`CoordToNode::Assign`] and loads its part) →
//! `Linking` (all loaded; every stage dials the next, measures the link, opens the ring) →
//! `Ready`. A new plan is a new epoch; the previous one is released.
//!
//! **Absorbing failures.** A stage node that leaves (its session ended or its lease expired)
//! fails the epoch, and the machine at once plans a new one from the connected survivors
//! ([`crate::replan`]: the configured stage count, or fewer when fewer nodes are left, within
//! their budgets). With no feasible placement the cluster is in an outage ([`Membership::outage`])
//! until a node joins. Sequences in flight are resumed on the new epoch by the driver, which
//! re-prefills what they had generated.
//!
//! **Joining.** A node that joins while a serving cell has fewer stages than configured, or
//! while an expert split runs with a departed owner's experts re-placed and every configured
//! owner is back, gets the new split made beside it (make before break): the new epoch is a
//! *successor* that loads and links while the old one serves; once ready it takes the cell's
//! slot and the old one *drains* — it keeps its runs, takes no new ones, and is released when
//! the driver reports no run seated on it ([`Event::Drained`]). A successor that cannot load or
//! link falls back to the plain re-plan. (A cell with no serving epoch is planned the plain
//! way.)
//!
//! **Lost data links.** A stage that loses a data link of the epoch (the ring link to a
//! neighbour, or an expert link between a home stage and an expert owner) reports it, naming
//! the peer. The epoch fails and the machine plans around the pair ([`links`]): a ring order
//! in which the two are not neighbours if one exists, else a plan without the node that did
//! not report. The pair is remembered until either node leaves or joins again.
//!
//! **Cells.** A plan may hold several cells: whole copies of the model, each a ring of its own
//! (a single node, or stages), given as one list of stages in which every cell starts again at
//! layer 0 (`--split 0..5,0..5`: two single-node cells). Each cell is an epoch of its own, so
//! a cell loads, links, fails and is re-planned without touching the others: a node lost in one
//! cell re-plans that cell on the nodes no other live cell holds, and a node that joins while a
//! cell is missing is folded in as a new cell while the others keep serving (make before
//! break). Requests are routed to ready cells by the driver ([`crate::cells`]).
//!
//! **Expert splits.** An owner of experts that leaves (an expert-only node, or a stage) fails
//! the epoch like a stage does. The new epoch keeps the ring if every ring stage survived, and
//! hands the departed owner's experts to the surviving owners and ring stages by free memory
//! ([`crate::replan::replace_experts`]); a node given more than its budget streams them from
//! disk. The configured split is kept: when its nodes are all back, it is planned again.

use std::collections::{BTreeMap, BTreeSet};

use tessera_net::NodeId;

use crate::replan::ModelBytes;
use tessera_proto::CoordToNode;

#[cfg(test)]
mod cells;
mod epochs;
mod events;
mod experts;
mod failover;
mod failure;
mod leases;
mod links;
mod member;
mod note;
mod peer_links;
#[cfg(test)]
mod test_support;

pub use epochs::{Epoch, EpochStage, Phase};
pub use events::{Action, CoordToNodeEq, Event};
pub use failover::AutoPlan;
pub use failure::{Departure, EpochFailure};
pub use member::Member;
pub use note::{MovedExperts, Note};

use events::send;

/// The membership and epoch state.
#[derive(Clone, Debug, Default)]
pub struct Membership {
    members: BTreeMap<NodeId, Member>,
    joins: u64,
    /// Each cell's latest epoch, by cell slot (empty before the first plan). A slot's epoch may
    /// be failed or released while others serve.
    cells: Vec<Epoch>,
    /// New epochs made beside a serving cell epoch (a node joined and a better split exists):
    /// they load and link while the old one serves, then take its slot.
    successors: Vec<Epoch>,
    /// Epochs a successor replaced: still ready, serving the runs seated on them and taking
    /// no new ones, until the driver reports them drained ([`Event::Drained`]).
    draining: Vec<Epoch>,
    next_epoch: u64,
    auto: Option<AutoPlan>,
    bytes: Option<ModelBytes>,
    outage: Option<crate::replan::NoPlacement>,
    /// Expert split applied to every plan (`None`: each stage holds all its layers' experts).
    experts: Option<crate::assignment::ExpertSplit>,
    /// KV cache type every stage is assigned.
    kv_type: tessera_model::kv::KvType,
    /// Bytes of experts each node (by name) keeps in memory, streaming the rest: what the
    /// coordinator's own plan placed, sent with each assignment.
    expert_budgets: BTreeMap<String, u64>,
    /// Liveness: the lease and when each connected member was last heard from.
    leases: leases::Leases,
    /// Data links reported lost, as (the stage that reported, the peer it named): plans do
    /// not need them until either node leaves or joins again.
    failed_links: BTreeSet<(NodeId, NodeId)>,
    /// Connected nodes the last re-plan left out, because every plan with them needed a
    /// failed link.
    benched: BTreeSet<NodeId>,
    /// A test-only fault ([`crate::fault::Fault::DropDepartedOwnersExperts`]).
    fault: Option<crate::fault::Fault>,
}

impl Membership {
    pub fn new() -> Self {
        Self::default()
    }

    /// Plants a deliberate bug, so the simulator can show it catches it.
    pub fn inject_fault(&mut self, fault: Option<crate::fault::Fault>) {
        self.fault = fault;
    }

    /// Splits the experts of every MoE layer across nodes in the plans made from now on.
    pub fn set_expert_split(&mut self, split: Option<crate::assignment::ExpertSplit>) {
        self.experts = split;
    }

    /// The KV cache type stages are assigned from the next plan on.
    pub fn set_kv_type(&mut self, kv_type: tessera_model::kv::KvType) {
        self.kv_type = kv_type;
    }

    pub fn kv_type(&self) -> tessera_model::kv::KvType {
        self.kv_type
    }

    /// The bytes of experts each named node keeps in memory from the next plan on (the rest
    /// streamed from its disk), as a plan placed them.
    pub fn set_expert_budgets(&mut self, budgets: BTreeMap<String, u64>) {
        self.expert_budgets = budgets;
    }

    /// The expert budget the plan gave `node`, if any.
    fn expert_budget_of(&self, node: &NodeId) -> Option<u64> {
        let name = &self.members.get(node)?.name;
        self.expert_budgets.get(name).copied()
    }

    pub fn expert_split(&self) -> Option<&crate::assignment::ExpertSplit> {
        self.experts.as_ref()
    }

    /// The expert split of the current epoch (differs from [`Membership::expert_split`] while
    /// a departed owner's experts are held by others).
    pub fn epoch_expert_split(&self) -> Option<&crate::assignment::ExpertSplit> {
        self.cells.first()?.experts.as_ref()
    }

    /// Whether every node the expert split names is connected (a plan would resolve).
    pub fn expert_split_ready(&self) -> bool {
        let Some(x) = &self.experts else {
            return true;
        };
        let nodes = self.usable_candidates();
        x.groups
            .iter()
            .all(|g| crate::assignment::find_node(&g.node, &nodes).is_ok())
    }

    pub fn member(&self, id: &NodeId) -> Option<&Member> {
        self.members.get(id)
    }

    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    /// Connected members in the order they joined.
    pub fn connected(&self) -> Vec<&Member> {
        let mut v: Vec<&Member> = self.members.values().filter(|m| m.connected).collect();
        v.sort_by_key(|m| m.joined);
        v
    }

    /// The first cell's epoch: the only one unless the plan holds several cells.
    pub fn epoch(&self) -> Option<&Epoch> {
        self.cells.first()
    }

    /// Every cell's latest epoch, by cell slot (failed and released ones included).
    pub fn cells(&self) -> &[Epoch] {
        &self.cells
    }

    /// The epoch numbered `id`, if it is a cell's latest, draining, or being made beside one.
    pub fn epoch_with_id(&self, id: u64) -> Option<&Epoch> {
        self.cells
            .iter()
            .chain(&self.draining)
            .chain(&self.successors)
            .find(|e| e.id == id)
    }

    /// Epochs replaced by a new split whose runs are finishing on them.
    pub fn draining(&self) -> &[Epoch] {
        &self.draining
    }

    /// New splits being made beside serving cells.
    pub fn successors(&self) -> &[Epoch] {
        &self.successors
    }

    /// Whether a run on epoch `id` may go on: it is a ready cell, or draining.
    pub fn serves(&self, id: u64) -> bool {
        self.cells
            .iter()
            .chain(&self.draining)
            .any(|e| e.id == id && e.phase == Phase::Ready)
    }

    /// The cells ready to take requests.
    pub fn ready_cells(&self) -> impl Iterator<Item = &Epoch> {
        self.cells.iter().filter(|e| e.phase == Phase::Ready)
    }

    /// The last epoch number handed out (0 before the first).
    pub fn last_epoch_id(&self) -> u64 {
        self.next_epoch
    }

    /// Continues numbering after `last` (a restarted coordinator never reuses an epoch number).
    pub fn continue_epochs_after(&mut self, last: u64) {
        self.next_epoch = self.next_epoch.max(last);
    }

    /// The weights' sizes, so that re-planning respects node budgets.
    pub fn set_model_bytes(&mut self, bytes: Option<ModelBytes>) {
        self.bytes = bytes;
    }

    /// What re-planning is configured with (`None` before the first plan).
    pub fn auto_plan(&self) -> Option<&AutoPlan> {
        self.auto.as_ref()
    }

    /// Why no epoch can be placed right now (no feasible plan on the connected nodes).
    pub fn outage(&self) -> Option<&crate::replan::NoPlacement> {
        self.outage.as_ref()
    }

    /// A successor of cell `slot` could not load or link (say it does not fit beside the
    /// epoch its nodes still hold): it is dropped and the cell is re-planned the plain way,
    /// releasing the serving epoch first (its runs resume on the new one).
    pub(super) fn successor_failed(
        &mut self,
        slot: usize,
        node: NodeId,
        reason: &str,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        self.discard_successor(slot, &mut out);
        out.push(Action::Note(Note::SuccessorFailed {
            cell: slot,
            node,
            reason: reason.to_string(),
        }));
        out.extend(self.replan(slot));
        out
    }

    /// Applies one event; returns what to do.
    pub fn handle(&mut self, event: Event) -> Vec<Action> {
        match event {
            Event::Joined(mut m) => {
                self.joins += 1;
                m.joined = self.joins;
                m.connected = true;
                let id = m.node_id;
                // A node that reconnects while its old session looks alive has restarted: it
                // lost whatever it held.
                let replaced = self.members.get(&id).is_some_and(|old| old.connected);
                self.leases.forget(&id);
                self.forget_failed_links(id);
                self.members.insert(id, *m);
                // (One that held nothing of the epoch is folded in like a new node.)
                let mut out = match replaced.then(|| self.stage_lost(id, Departure::Restarted)) {
                    Some(out) if !out.is_empty() => out,
                    _ => self.fold_in(),
                };
                out.extend(self.measure_peers());
                out
            }
            Event::Left { node: id, session } => {
                // A session already declared gone (its lease expired) has nothing left to lose.
                match self.members.get_mut(&id) {
                    Some(m) if m.session == session && m.connected => m.connected = false,
                    _ => return Vec::new(),
                }
                self.stage_lost(id, Departure::Left)
            }
            Event::Heard { node, session, now } => {
                if self
                    .members
                    .get(&node)
                    .is_some_and(|m| m.connected && m.session == session)
                {
                    self.leases.heard(node, now);
                }
                Vec::new()
            }
            Event::Tick { now } => self.tick(now),
            Event::Plan {
                model,
                stages,
                n_layer,
                max_context,
            } => {
                // A plan asked for is placed as asked.
                self.benched.clear();
                let cells = crate::assignment::cells_of(&stages);
                self.auto = Some(AutoPlan {
                    model,
                    n_layer,
                    max_context,
                    target_stages: cells.iter().map(|c| c.len()).max().unwrap_or(0),
                    cells: cells.len().max(1),
                });
                self.plan_cells(model, stages, cells, n_layer, max_context)
            }
            Event::Loaded {
                node,
                epoch,
                report,
            } => {
                let Some(e) = self.current_mut(epoch, Phase::Loading) else {
                    return Vec::new();
                };
                for s in e.stages.iter_mut().filter(|s| s.node_id == node) {
                    s.loaded = Some(report.clone());
                }
                if e.stages.iter().all(|s| s.loaded.is_some()) {
                    e.phase = Phase::Linking;
                    e.stages
                        .iter()
                        .map(|s| send(s.node_id, CoordToNode::Link { epoch }))
                        .collect()
                } else {
                    Vec::new()
                }
            }
            Event::Linked { node, epoch, link } => {
                let Some(e) = self.current_mut(epoch, Phase::Linking) else {
                    return Vec::new();
                };
                for s in e.stages.iter_mut().filter(|s| s.node_id == node) {
                    s.linked = true;
                    s.link = link;
                }
                if e.stages.iter().all(|s| s.linked) {
                    e.phase = Phase::Ready;
                    let mut out = self.promote(epoch);
                    out.push(Action::EpochReady(epoch));
                    out
                } else {
                    Vec::new()
                }
            }
            Event::LinkFailed {
                node,
                epoch,
                reason,
                peer,
            } => self.link_failed(node, epoch, reason, peer),
            Event::LoadFailed {
                node,
                epoch,
                reason,
            } => {
                // Only a stage of the epoch may say that the epoch cannot load or link: any other
                // member saying so is ignored (it would stop the service with one message).
                // A report about an epoch that is no longer current is late, not hostile.
                if let Some(e) = self.successors.iter().find(|e| e.id == epoch) {
                    if e.stages.iter().any(|s| s.node_id == node) {
                        let slot = e.cell;
                        return self.successor_failed(slot, node, &reason);
                    }
                }
                match self.cells.iter().position(|e| e.id == epoch) {
                    Some(slot) if self.cells[slot].stages.iter().any(|s| s.node_id == node) => {
                        self.fail(slot, EpochFailure::Reported { node, reason })
                    }
                    Some(_) => vec![Action::Refused {
                        node,
                        why: crate::authz::Refusal::NotAStageOfEpoch { epoch },
                    }],
                    None => Vec::new(),
                }
            }
            Event::Drained { epoch } => {
                let mut out = Vec::new();
                self.release_draining(|e| e.id != epoch, &mut out);
                out
            }
            Event::LinkMeasured { node, link } => {
                if let Some(m) = self.members.get_mut(&node) {
                    m.link = Some(link);
                }
                Vec::new()
            }
            Event::InventoryMeasured { node, inventory } => {
                if let Some(m) = self.members.get_mut(&node) {
                    m.memory_budget_bytes = inventory.memory_budget.as_ref().map(|b| b.bytes);
                    m.inventory = Some(*inventory);
                }
                self.measure_peers()
            }
            Event::PeerLinksMeasured { node, links } => {
                self.peer_links_measured(node, links);
                Vec::new()
            }
        }
    }
}
