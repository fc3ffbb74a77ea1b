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
//! `Ready`. A stage node that fails or leaves fails the epoch (re-planning onto survivors is a
//! later issue). A new plan is a new epoch; the previous one is released.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::Range;

use tessera_net::{LinkMeasurement, NodeId, PublicKey};
use tessera_node::protocol::{CoordToNode, LoadReport, PeerInfo, StageAssignment};
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
    Send { to: NodeId, msg: Box<CoordToNodeEq> },
    EpochReady(u64),
    EpochFailed { epoch: u64, reason: String },
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

/// The membership and epoch state.
#[derive(Debug, Default)]
pub struct Membership {
    members: BTreeMap<NodeId, Member>,
    joins: u64,
    epoch: Option<Epoch>,
    next_epoch: u64,
}

impl Membership {
    pub fn new() -> Self {
        Self::default()
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
                    Vec::new()
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
            } => self.plan(model, stages, n_layer, max_context),
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
                self.fail(format!("stage node {} {what}", id.short()))
            }
            _ => Vec::new(),
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

    fn plan(
        &mut self,
        model: ContentHash,
        stages: Vec<(NodeId, Range<usize>)>,
        n_layer: usize,
        max_context: usize,
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
        for (i, (node, layers)) in stages.iter().enumerate() {
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
}
