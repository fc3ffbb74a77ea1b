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
//! until a node joins. A node that joins while the epoch has fewer stages than configured (or
//! while there is none) triggers a plan that folds it in. Sequences in flight are resumed on the
//! new epoch by the driver, which re-prefills what they had generated.
//!
//! **Expert splits.** An owner of experts that leaves (an expert-only node, or a stage) fails
//! the epoch like a stage does. The new epoch keeps the ring if every ring stage survived, and
//! hands the departed owner's experts to the surviving owners and ring stages by free memory
//! ([`crate::replan::replace_experts`]); a node given more than its budget streams them from
//! disk. The configured split is kept: when its nodes are all back, it is planned again.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::Range;

use tessera_net::{LinkMeasurement, NodeId, PublicKey};

use crate::replan::{even_split, ModelBytes, Survivor};
use tessera_node::protocol::{
    CoordToNode, ExpertAssignment, ExpertPeer, LoadReport, PeerInfo, StageAssignment,
};
use tessera_node::{ContentHash, Inventory};

/// A node known to the coordinator in this run.
#[derive(Clone, Debug)]
pub struct Member {
    pub node_id: NodeId,
    pub key: PublicKey,
    pub name: String,
    /// Where the node's endpoint is, as the coordinator sees it (peers dial this).
    pub addr: SocketAddr,
    pub connected: bool,
    /// Order of joining (unpinned stages are placed in this order).
    pub joined: u64,
    pub memory_budget_bytes: Option<u64>,
    pub inventory: Option<Inventory>,
    /// Models held whole on disk.
    pub models: Vec<ContentHash>,
    /// The link coordinator → node.
    pub link: Option<LinkMeasurement>,
    /// Which control session of the node this is (a node that reconnects gets a new one).
    pub session: u64,
}

/// Where an epoch is.
#[derive(Clone, Debug, PartialEq)]
pub enum Phase {
    Loading,
    Linking,
    Ready,
    Failed(String),
    Released,
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
}

/// One placement of the model.
#[derive(Clone, Debug)]
pub struct Epoch {
    pub id: u64,
    pub model: ContentHash,
    pub stages: Vec<EpochStage>,
    pub phase: Phase,
}

/// Inputs.
#[derive(Clone, Debug)]
pub enum Event {
    Joined(Box<Member>),
    /// A control session ended (ignored if the node has a newer session).
    Left {
        node: NodeId,
        session: u64,
    },
    /// Place `stages` (node, layers) in ring order as a new epoch.
    Plan {
        model: ContentHash,
        stages: Vec<(NodeId, Range<usize>)>,
        n_layer: usize,
        max_context: usize,
    },
    Loaded {
        node: NodeId,
        epoch: u64,
        report: LoadReport,
    },
    LoadFailed {
        node: NodeId,
        epoch: u64,
        reason: String,
    },
    Linked {
        node: NodeId,
        epoch: u64,
        link: Option<LinkMeasurement>,
    },
    LinkFailed {
        node: NodeId,
        epoch: u64,
        reason: String,
    },
    /// The coordinator measured its link to a node.
    LinkMeasured {
        node: NodeId,
        link: LinkMeasurement,
    },
    /// A node measured itself again.
    InventoryMeasured {
        node: NodeId,
        inventory: Box<Inventory>,
    },
}

/// Outputs.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    Send {
        to: NodeId,
        msg: Box<CoordToNodeEq>,
    },
    EpochReady(u64),
    EpochFailed {
        epoch: u64,
        reason: String,
    },
    /// A decision worth a line in the log (experts re-placed after a loss).
    Note(String),
}

/// [`CoordToNode`] with a structural equality for tests (compared as JSON).
#[derive(Clone, Debug)]
pub struct CoordToNodeEq(pub CoordToNode);

impl PartialEq for CoordToNodeEq {
    fn eq(&self, other: &Self) -> bool {
        serde_json::to_value(&self.0).ok() == serde_json::to_value(&other.0).ok()
    }
}

fn send(to: NodeId, msg: CoordToNode) -> Action {
    Action::Send {
        to,
        msg: Box::new(CoordToNodeEq(msg)),
    }
}

/// What re-planning needs: set by the last requested plan.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoPlan {
    pub model: ContentHash,
    pub n_layer: usize,
    pub max_context: usize,
    /// The configured stage count (the requested plan's).
    pub target_stages: usize,
}

/// The membership and epoch state.
#[derive(Debug, Default)]
pub struct Membership {
    members: BTreeMap<NodeId, Member>,
    joins: u64,
    epoch: Option<Epoch>,
    next_epoch: u64,
    auto: Option<AutoPlan>,
    bytes: Option<ModelBytes>,
    outage: Option<String>,
    /// Expert split applied to every plan (`None`: each stage holds all its layers' experts).
    experts: Option<crate::assignment::ExpertSplit>,
    /// The split the current epoch runs: the configured one, or after a loss the one with the
    /// departed owners' experts re-placed.
    epoch_experts: Option<crate::assignment::ExpertSplit>,
}

impl Membership {
    pub fn new() -> Self {
        Self::default()
    }

    /// Splits the experts of every MoE layer across nodes in the plans made from now on.
    pub fn set_expert_split(&mut self, split: Option<crate::assignment::ExpertSplit>) {
        self.experts = split;
    }

    pub fn expert_split(&self) -> Option<&crate::assignment::ExpertSplit> {
        self.experts.as_ref()
    }

    /// The expert split of the current epoch (differs from [`Membership::expert_split`] while
    /// a departed owner's experts are held by others).
    pub fn epoch_expert_split(&self) -> Option<&crate::assignment::ExpertSplit> {
        self.epoch_experts.as_ref()
    }

    /// Whether every node the expert split names is connected (a plan would resolve).
    pub fn expert_split_ready(&self) -> bool {
        let Some(x) = &self.experts else {
            return true;
        };
        let nodes = self.candidates();
        x.groups
            .iter()
            .all(|g| crate::assignment::find_node(&g.node, &nodes).is_ok())
    }

    fn candidates(&self) -> Vec<crate::assignment::Candidate> {
        self.connected()
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
    fn place_experts(
        &self,
        split: &crate::assignment::ExpertSplit,
        ring: &[(NodeId, PeerInfo)],
        n_layer: usize,
    ) -> Result<(Vec<ExpertAssignment>, Vec<(PeerInfo, ExpertAssignment)>), String> {
        let nodes = self.candidates();
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

    pub fn epoch(&self) -> Option<&Epoch> {
        self.epoch.as_ref()
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
    pub fn outage(&self) -> Option<&str> {
        self.outage.as_deref()
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
                self.members.insert(id, *m);
                if replaced {
                    self.stage_lost(id, "restarted")
                } else {
                    self.fold_in()
                }
            }
            Event::Left { node: id, session } => {
                match self.members.get_mut(&id) {
                    Some(m) if m.session == session => m.connected = false,
                    _ => return Vec::new(),
                }
                self.stage_lost(id, "left")
            }
            Event::Plan {
                model,
                stages,
                n_layer,
                max_context,
            } => {
                self.auto = Some(AutoPlan {
                    model,
                    n_layer,
                    max_context,
                    target_stages: stages.len(),
                });
                self.plan(model, stages, n_layer, max_context, false)
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
                    vec![Action::EpochReady(epoch)]
                } else {
                    Vec::new()
                }
            }
            Event::LoadFailed {
                node,
                epoch,
                reason,
            }
            | Event::LinkFailed {
                node,
                epoch,
                reason,
            } => {
                if self.epoch.as_ref().is_some_and(|e| e.id == epoch) {
                    self.fail(format!("node {}: {reason}", node.short()))
                } else {
                    Vec::new()
                }
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
                Vec::new()
            }
        }
    }

    fn stage_lost(&mut self, id: NodeId, what: &str) -> Vec<Action> {
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

    /// Connected members as re-planning candidates, in join order.
    fn survivors(&self) -> Vec<Survivor> {
        self.connected()
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

    /// The stage count a plan on the connected nodes aims for.
    fn wanted_stages(&self, auto: &AutoPlan) -> usize {
        auto.target_stages
            .min(self.connected().len())
            .min(auto.n_layer)
    }

    /// With an expert split, the last epoch's ring when all of it is still connected and it
    /// has the stages wanted: an expert owner's loss (or return) moves experts, not layers.
    fn surviving_ring(&self, auto: &AutoPlan) -> Option<Vec<(NodeId, Range<usize>)>> {
        self.experts.as_ref()?;
        let ring = self.ring();
        let alive = ring
            .iter()
            .all(|(id, _)| self.members.get(id).is_some_and(|m| m.connected));
        (!ring.is_empty() && alive && ring.len() >= self.wanted_stages(auto)).then_some(ring)
    }

    /// Plans a new epoch on the connected nodes (after a loss, or to fold a node in).
    fn replan(&mut self) -> Vec<Action> {
        let Some(auto) = self.auto.clone() else {
            return Vec::new();
        };
        // With an expert split, a stage's budget bounds its layers without their experts
        // (which its node streams from disk when they do not fit).
        let dense = match (&self.experts, &self.bytes) {
            (Some(_), Some(b)) => Some(b.without_experts()),
            (_, b) => b.clone(),
        };
        let ring = match self.surviving_ring(&auto) {
            Some(ring) => Ok(ring),
            None => even_split(
                auto.n_layer,
                &self.survivors(),
                auto.target_stages,
                dense.as_ref(),
            ),
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
    fn fold_in(&mut self) -> Vec<Action> {
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

    fn current_mut(&mut self, epoch: u64, phase: Phase) -> Option<&mut Epoch> {
        self.epoch
            .as_mut()
            .filter(|e| e.id == epoch && e.phase == phase)
    }

    fn fail(&mut self, reason: String) -> Vec<Action> {
        let Some(e) = self.epoch.as_mut() else {
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
    fn split_for(
        &self,
        ring: &[(NodeId, Range<usize>)],
        n_layer: usize,
        reassign: bool,
    ) -> Result<Option<(crate::assignment::ExpertSplit, Option<String>)>, String> {
        use crate::assignment::{find_node, ids_spec, ExpertGroup, ExpertSplit};
        let Some(split) = &self.experts else {
            return Ok(None);
        };
        let nodes = self.candidates();
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
        if orphans.is_empty() {
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
            let over = match (self.bytes.as_ref(), h.limit) {
                (Some(b), Some(limit))
                    if b.expert_holder(&h.layers, n_layer, h.experts.len()) > limit =>
                {
                    " (beyond its budget: it streams experts from disk)"
                }
                _ => "",
            };
            moved.push(format!("{} to {name}{over}", ids_spec(g)));
        }
        let note = format!(
            "experts {} of {} (gone) re-placed: {}",
            ids_spec(&orphans),
            gone.join(", "),
            moved.join(", ")
        );
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

    fn plan(
        &mut self,
        model: ContentHash,
        stages: Vec<(NodeId, Range<usize>)>,
        n_layer: usize,
        max_context: usize,
        reassign: bool,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        if let Some(old) = self.epoch.as_mut() {
            if !matches!(old.phase, Phase::Released | Phase::Failed(_)) {
                for s in &old.stages {
                    if self.members.get(&s.node_id).is_some_and(|m| m.connected) {
                        out.push(send(s.node_id, CoordToNode::Release { epoch: old.id }));
                    }
                }
            }
            old.phase = Phase::Released;
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
            self.epoch = Some(Epoch {
                id,
                model,
                stages: Vec::new(),
                phase: Phase::Failed(format!("node {} is not connected", stages[i].0.short())),
            });
            out.push(Action::EpochFailed {
                epoch: id,
                reason: format!("node {} is not connected", stages[i].0.short()),
            });
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
                self.epoch_experts = None;
                self.epoch = Some(Epoch {
                    id,
                    model,
                    stages: Vec::new(),
                    phase: Phase::Failed(reason.clone()),
                });
                out.push(Action::EpochFailed { epoch: id, reason });
                return out;
            }
        };
        self.epoch_experts = split.clone();
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
                        self.epoch = Some(Epoch {
                            id,
                            model,
                            stages: Vec::new(),
                            phase: Phase::Failed(reason.clone()),
                        });
                        out.push(Action::EpochFailed { epoch: id, reason });
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
                }),
            ));
        }
        // Expert-only nodes: not in the ring, but part of the epoch (they load, link, open and
        // close sequences like stages, with no layers).
        let mut stages = stages;
        if let Some((_, only)) = expert_plan {
            for (j, (p, x)) in only.into_iter().enumerate() {
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
                    }),
                ));
                stages.push((p.node_id, 0..0));
            }
        }
        self.epoch = Some(Epoch {
            id,
            model,
            stages: stages
                .into_iter()
                .map(|(node_id, layers)| EpochStage {
                    node_id,
                    layers,
                    loaded: None,
                    linked: false,
                    link: None,
                })
                .collect(),
            phase: Phase::Loading,
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_net::NodeIdentity;

    fn member(i: u8) -> Member {
        let id = NodeIdentity::from_seed([i; 32]);
        Member {
            node_id: id.node_id(),
            key: id.public_key(),
            name: format!("n{i}"),
            addr: format!("127.0.0.1:{}", 4000 + u16::from(i))
                .parse()
                .unwrap(),
            connected: true,
            joined: 0,
            memory_budget_bytes: None,
            inventory: None,
            models: vec![],
            link: None,
            session: 1,
        }
    }

    fn sends(actions: &[Action]) -> Vec<(NodeId, CoordToNode)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send { to, msg } => Some((*to, msg.0.clone())),
                _ => None,
            })
            .collect()
    }

    const MODEL: ContentHash = ContentHash([7; 32]);

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

    fn ready(m: &mut Membership) -> u64 {
        let e = m.epoch().unwrap();
        let (id, nodes): (u64, Vec<NodeId>) = (e.id, e.stages.iter().map(|s| s.node_id).collect());
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
        assert_eq!(m.epoch().unwrap().phase, Phase::Ready);
        id
    }

    fn layers(m: &Membership) -> Vec<(NodeId, Range<usize>)> {
        m.epoch()
            .unwrap()
            .stages
            .iter()
            .map(|s| (s.node_id, s.layers.clone()))
            .collect()
    }

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

    #[test]
    fn a_lost_expert_node_hands_its_experts_to_the_survivors_and_gets_them_back() {
        let mut m = Membership::new();
        // Two layers of 8 experts of 10 bytes each and 40 bytes of the rest; 10 bytes each of
        // embedding and head.
        m.set_model_bytes(Some(ModelBytes {
            layers: vec![120; 2],
            embed: 10,
            head: 10,
            expert: vec![10; 2],
            n_expert: 8,
        }));
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
        m.set_expert_split(Some(
            crate::assignment::parse_experts("0-1@n1,2-4@n2,5-7@n3").unwrap(),
        ));
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..2)],
            n_layer: 2,
            max_context: 64,
        });
        let first = ready(&mut m);
        // c goes: its experts 5-7 go to b, which has the room (a has 20 bytes, b 140).
        let acts = m.handle(Event::Left {
            node: c.node_id,
            session: 1,
        });
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::EpochFailed { epoch, reason }
            if *epoch == first && reason.contains("expert node"))));
        let note = acts
            .iter()
            .find_map(|x| match x {
                Action::Note(n) => Some(n.clone()),
                _ => None,
            })
            .expect("a note on the re-placement");
        assert!(
            note.contains("5-7 of n3") && note.contains("5-7 to n2"),
            "{note}"
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
        ready(&mut m);
        // c comes back: the configured split is placed again.
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
        assert_eq!(m.epoch_expert_split(), m.expert_split());
        ready(&mut m);
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
        assert!(note.contains("streams experts from disk"), "{note}");
        assert_eq!(layers(&m), vec![(a.node_id, 0..2)]);
    }

    #[test]
    fn a_lost_home_moves_the_ring_and_its_experts_to_the_survivors() {
        let mut m = Membership::new();
        m.set_model_bytes(Some(ModelBytes {
            layers: vec![120; 2],
            embed: 10,
            head: 10,
            expert: vec![10; 2],
            n_expert: 8,
        }));
        let (a, mut b, mut c) = (member(1), member(2), member(3));
        // b cannot hold the whole model (420 bytes), but holds its dense part (100) and its
        // experts; what does not fit it would stream.
        b.memory_budget_bytes = Some(200);
        c.memory_budget_bytes = Some(100);
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
