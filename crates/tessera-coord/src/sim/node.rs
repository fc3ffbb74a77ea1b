//! A simulated node: the node agent's control protocol as a small state machine.

use std::collections::BTreeMap;
use std::time::Duration;

use tessera_net::{NodeId, NodeIdentity};
use tessera_proto::{CoordToNode, FinishReason, LoadReport, NodeToCoord, StageSeqStats};

/// One open sequence on a node.
#[derive(Clone, Debug)]
pub struct SeqState {
    pub epoch: u64,
    /// Prompt + tokens so far (the sampler's history).
    pub history: Vec<u32>,
    pub prompt_len: usize,
    pub remaining: usize,
    pub eog: Vec<u32>,
    pub seed: u64,
}

/// What a node holds for an epoch.
#[derive(Clone, Debug)]
pub struct Holding {
    pub epoch: u64,
    pub stage: usize,
    pub head: bool,
    pub linked: bool,
}

#[derive(Clone, Debug)]
pub struct SimNode {
    pub id: NodeId,
    pub name: String,
    pub alive: bool,
    /// Bumped at each restart: timers of an earlier life are stale.
    pub incarnation: u64,
    /// The node's current control session (connection id).
    pub conn: Option<u64>,
    pub frozen_until: Option<Duration>,
    /// When it was last killed or frozen.
    pub stopped_at: Option<Duration>,
    /// When it was last killed (its work then is lost, even once it runs again).
    pub killed_at: Option<Duration>,
    pub partitioned_until: Option<Duration>,
    /// The epochs it holds, oldest first: two while a new split is switched to (the node
    /// agent holds both until the old one is released).
    pub holding: Vec<Holding>,
    pub seqs: BTreeMap<u64, SeqState>,
    /// Has joined the cluster at least once.
    pub enrolled: bool,
}

/// What a node does in answer to a message (the world carries it out).
#[derive(Debug)]
pub enum NodeEffect {
    Reply(NodeToCoord),
    /// Finish loading `epoch` after a while, then report.
    LoadLater(u64),
    /// The first stage was told to start `seq`: the ring begins to turn.
    RingStart(u64),
}

/// The seed of node `i`'s identity (its key as a member, and as a sealed worker).
pub fn identity_seed(i: usize) -> [u8; 32] {
    [i as u8 + 1; 32]
}

impl SimNode {
    pub fn new(i: usize) -> Self {
        let id = NodeIdentity::from_seed(identity_seed(i)).node_id();
        Self {
            id,
            name: format!("n{i}"),
            alive: true,
            incarnation: 0,
            conn: None,
            frozen_until: None,
            stopped_at: None,
            killed_at: None,
            partitioned_until: None,
            holding: Vec::new(),
            seqs: BTreeMap::new(),
            enrolled: false,
        }
    }

    /// The session ended (or the process died): whatever it held is gone.
    pub fn drop_state(&mut self) {
        self.conn = None;
        self.holding.clear();
        self.seqs.clear();
    }

    pub fn partitioned(&self, now: Duration) -> bool {
        self.partitioned_until.is_some_and(|t| t > now)
    }

    /// Handles one message from the coordinator.
    pub fn handle(&mut self, msg: CoordToNode) -> Vec<NodeEffect> {
        use NodeEffect::*;
        match msg {
            CoordToNode::Assign(a) => {
                // The agent holds at most two epochs: a third drops the oldest and its
                // sequences.
                self.holding.retain(|h| h.epoch != a.epoch);
                if self.holding.len() >= 2 {
                    let old = self.holding.remove(0).epoch;
                    self.seqs.retain(|_, s| s.epoch != old);
                }
                self.holding.push(Holding {
                    epoch: a.epoch,
                    stage: a.stage,
                    head: a.head,
                    linked: false,
                });
                vec![LoadLater(a.epoch)]
            }
            CoordToNode::Link { epoch } => match self.holding.iter_mut().find(|h| h.epoch == epoch)
            {
                Some(h) => {
                    h.linked = true;
                    vec![Reply(NodeToCoord::Linked { epoch, link: None })]
                }
                _ => vec![Reply(NodeToCoord::LinkFailed {
                    epoch,
                    reason: "epoch not held".into(),
                    peer: None,
                })],
            },
            CoordToNode::Release { epoch } => {
                self.holding.retain(|h| h.epoch != epoch);
                self.seqs.retain(|_, s| s.epoch != epoch);
                Vec::new()
            }
            CoordToNode::Open(o) => match self.held(o.epoch) {
                Some(h) if h.linked => {
                    self.seqs.insert(
                        o.seq,
                        SeqState {
                            epoch: o.epoch,
                            prompt_len: o.prompt.len(),
                            history: o.prompt,
                            remaining: o.max_new_tokens,
                            eog: o.eog,
                            seed: o.sampling.seed,
                        },
                    );
                    vec![Reply(NodeToCoord::Opened {
                        seq: o.seq,
                        cached: 0,
                    })]
                }
                _ => vec![Reply(NodeToCoord::OpenFailed {
                    seq: o.seq,
                    reason: format!("epoch {} is not held here", o.epoch),
                })],
            },
            CoordToNode::Start { seq, .. } => {
                if self.seqs.contains_key(&seq) {
                    vec![RingStart(seq)]
                } else {
                    vec![Reply(NodeToCoord::Finished {
                        seq,
                        reason: FinishReason::Error,
                        generated: 0,
                        error: Some("no such sequence".into()),
                    })]
                }
            }
            CoordToNode::Close { seq, .. } => {
                let stage = self
                    .seqs
                    .get(&seq)
                    .and_then(|s| self.held(s.epoch))
                    .map_or(0, |h| h.stage);
                self.seqs.remove(&seq);
                vec![Reply(NodeToCoord::Closed {
                    seq,
                    stats: Box::new(StageSeqStats {
                        stage,
                        ..Default::default()
                    }),
                })]
            }
            CoordToNode::Welcome { .. }
            | CoordToNode::Refused { .. }
            | CoordToNode::AssignExperts { .. }
            | CoordToNode::MeasureInventory
            | CoordToNode::MeasurePeers { .. }
            | CoordToNode::Lease { .. }
            | CoordToNode::SealedJob { .. } => Vec::new(),
        }
    }

    /// What it holds of `epoch`.
    pub fn held(&self, epoch: u64) -> Option<&Holding> {
        self.holding.iter().find(|h| h.epoch == epoch)
    }

    /// The node finished loading `epoch` (if it still holds it).
    pub fn loaded(&self, epoch: u64) -> Option<NodeToCoord> {
        self.held(epoch).map(|_| NodeToCoord::Loaded {
            epoch,
            report: LoadReport::default(),
        })
    }
}
