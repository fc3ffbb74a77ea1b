//! The node's epochs as a pure state machine: which epoch is assigned, whether a finished load
//! is installed or discarded, the (at most two) installed epochs while the coordinator switches
//! to a new split, the memory a second epoch must fit beside the first, which peers are
//! admitted, which lost links matter and what goes when an epoch is released.
//!
//! Events come in ([`EpochEvent`]: the coordinator's assignments and releases, a load that
//! finished or failed, a data link made or lost, the session's end); actions come out
//! ([`EpochAction`]: load this, install that, close these links, admit or stop admitting a
//! key, report a lost link). No I/O, no clock, no locks: the agent's shell holds the machine
//! behind one lock, carries out its actions, and keeps what the machine only names — the loaded
//! models, the stage thread, the connections — keyed by epoch. No decision here depends on
//! time, so no event carries `now`.
//!
//! **Loads are tickets.** Each assignment starts one load, named by a ticket (not by its epoch:
//! a re-sent or reused epoch number never installs an older load's weights). A load that
//! finishes after a newer assignment is *superseded*, after its epoch's release (or the
//! session's end) *released*; either way it is never installed, and the shell drops its weights.
//!
//! **Make before break.** The coordinator loads a new split beside the serving one: the new
//! epoch is installed while the old one finishes its sequences, until the coordinator releases
//! it. The new epoch's weights must fit in the memory limit beside the old one's. A third epoch
//! installed while two are held evicts the oldest, whole (stage, links, admissions), as the stage
//! thread drops its stage ([`MAX_EPOCHS`]).
//!
//! **Admission** is derived, not tracked by hand: after every event the machine computes which
//! keys its live epochs need admitted (each epoch's previous stage, and the home stages it
//! serves experts to) and emits the difference from what it had admitted.

use std::collections::BTreeMap;

use tessera_net::{NodeId, PublicKey};

use crate::inventory::{BudgetRefusal, Inventory};
use tessera_proto::{ExpertAssignment, ExpertPeer, StageAssignment};

/// Most epochs a node holds at once: the serving one and the one being switched to (make before
/// break).
pub(super) const MAX_EPOCHS: usize = 2;

/// Expert placements kept for epochs not assigned yet (the coordinator sends each just before
/// its assignment, so one is the rule; more are stale and the lowest goes first).
const MAX_PENDING_EXPERTS: usize = MAX_EPOCHS;

/// Which data link a connection is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DataLink {
    RingToNext,
    RingFromPrevious,
    ExpertToWorker,
    ExpertFromHome,
}

impl std::fmt::Display for DataLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::RingToNext => "the ring link to the next stage",
            Self::RingFromPrevious => "the ring link from the previous stage",
            Self::ExpertToWorker => "the expert link to a worker",
            Self::ExpertFromHome => "the expert link from a home stage",
        })
    }
}

/// Names one load (see the module doc).
pub(super) type Ticket = u64;

/// What happens to the machine.
#[derive(Clone, Debug)]
pub(super) enum EpochEvent {
    /// The coordinator's expert placement for `epoch` (sent just before its assignment).
    AssignExperts {
        epoch: u64,
        experts: ExpertAssignment,
    },
    Assign(StageAssignment),
    /// A load finished: its weights hold `held` bytes (what counts against the memory limit)
    /// and its hidden states are `n_embd` wide.
    Loaded {
        ticket: Ticket,
        held: u64,
        n_embd: usize,
    },
    /// A load failed (the shell reports why).
    LoadFailed {
        ticket: Ticket,
    },
    Release {
        epoch: u64,
    },
    /// A data link of `epoch` was just made; the shell keeps it or closes it as told.
    LinkUp {
        epoch: u64,
    },
    /// A data link of `epoch` was lost (not closed on purpose).
    LinkLost {
        epoch: u64,
        link: DataLink,
        peer: NodeId,
    },
    /// The coordinator asked for the links to these peers to be measured: they dial this
    /// node to measure it too, so their keys are admitted (until the next such request or the
    /// session's end; a measuring peer gets answers to measurement streams, nothing else).
    MeasurePeers(BTreeMap<NodeId, PublicKey>),
    /// The control session ended: whatever it placed here is void.
    SessionEnded,
}

/// What the shell must do.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum EpochAction {
    /// Let this peer's connections in.
    Admit(PublicKey),
    /// Stop letting this peer in.
    Unadmit(NodeId),
    /// Load `assignment` (with its expert placement) off the control loop, and report back
    /// [`EpochEvent::Loaded`] or [`EpochEvent::LoadFailed`] with `ticket`.
    Load {
        ticket: Ticket,
        assignment: Box<StageAssignment>,
        experts: Option<ExpertAssignment>,
    },
    /// Install load `ticket`'s stage (epoch `epoch`) on the stage thread with this KV cache
    /// budget (`None`: no limit known), and report it loaded.
    Install {
        ticket: Ticket,
        epoch: u64,
        kv_budget: Option<u64>,
    },
    /// The epoch will not be taken: tell the coordinator ([`NodeToCoord::LoadFailed`]) and drop
    /// whatever was loaded for it.
    ///
    /// [`NodeToCoord::LoadFailed`]: tessera_proto::NodeToCoord::LoadFailed
    Refuse { epoch: u64, why: LoadRefused },
    /// Drop what load `ticket` loaded, telling no one: the coordinator released its epoch (or
    /// the session ended) and expects nothing.
    Discard { ticket: Ticket, why: LoadRefused },
    /// Keep the data link of `epoch` just made.
    KeepLink { epoch: u64 },
    /// Close the data link of `epoch` just made: the epoch went while it linked.
    DropLink { epoch: u64 },
    /// Close every data link of `epoch` and drop its expert serving model.
    CloseLinks { epoch: u64 },
    /// The stage thread drops `epoch`'s stage (its sequences with it).
    ReleaseStage { epoch: u64 },
    /// Tell the coordinator a data link of `epoch` is lost ([`NodeToCoord::LinkFailed`]).
    ///
    /// [`NodeToCoord::LinkFailed`]: tessera_proto::NodeToCoord::LinkFailed
    ReportLinkLost {
        epoch: u64,
        link: DataLink,
        peer: NodeId,
    },
    /// What this node holds changed: publish new sealed-job claims.
    PublishClaims,
}

/// Why a load is not installed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub(super) enum LoadRefused {
    #[error("epoch {epoch} was superseded while it loaded")]
    Superseded { epoch: u64 },
    #[error("epoch {epoch} was released while it loaded")]
    Released { epoch: u64 },
    /// The same words as [`crate::error::FabricError::OverBudget`].
    #[error("over the memory budget: {0}")]
    OverBudget(BudgetRefusal),
    #[error(
        "epoch {epoch} does not fit beside the epoch still installed ({} held): {refusal}",
        tessera_model::human_bytes(*beside)
    )]
    NotBeside {
        epoch: u64,
        beside: u64,
        refusal: BudgetRefusal,
    },
}

/// The memory every installed epoch's weights must fit in together: the budget, else the RAM
/// available at start (the limit [`Inventory::accepts`] applies).
#[derive(Clone, Debug)]
pub(super) struct MemoryLimit {
    /// What the largest request is refused with: the limit, and where it comes from.
    refusal: BudgetRefusal,
}

impl MemoryLimit {
    pub(super) fn of(inventory: &Inventory) -> Self {
        let refusal = inventory.accepts(u64::MAX).err().unwrap_or(BudgetRefusal {
            // Only a limit of u64::MAX accepts u64::MAX bytes.
            requested: u64::MAX,
            limit: Some(u64::MAX),
            limit_source: String::new(),
            total_ram: None,
            available_ram: None,
        });
        Self { refusal }
    }

    fn limit(&self) -> Option<u64> {
        self.refusal.limit
    }

    fn accepts(&self, bytes: u64) -> Result<(), BudgetRefusal> {
        match self.limit() {
            Some(limit) if bytes <= limit => Ok(()),
            _ => Err(BudgetRefusal {
                requested: bytes,
                ..self.refusal.clone()
            }),
        }
    }
}

/// What became of a load while it ran.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fate {
    Live,
    Superseded,
    Released,
}

#[derive(Clone, Debug)]
struct Loading {
    assignment: StageAssignment,
    experts: Option<ExpertAssignment>,
    fate: Fate,
}

/// An epoch whose stage is on the stage thread.
#[derive(Clone, Debug)]
struct Installed {
    assignment: StageAssignment,
    experts: Option<ExpertAssignment>,
    n_embd: usize,
    /// Memory its weights hold, counted when another epoch loads beside it.
    held: u64,
}

/// The node's epochs (see the module doc).
#[derive(Debug)]
pub(super) struct NodeEpochs {
    limit: MemoryLimit,
    /// The latest epoch assigned and not released: a lost link of it matters while it loads.
    assigned: Option<u64>,
    /// Loads in flight, by ticket, until they report back.
    loading: BTreeMap<Ticket, Loading>,
    next_ticket: Ticket,
    /// Expert placements received for epochs not assigned yet.
    pending_experts: BTreeMap<u64, ExpertAssignment>,
    /// Installed epochs, oldest first.
    installed: Vec<Installed>,
    /// Keys admitted on this machine's behalf.
    admitted: BTreeMap<NodeId, PublicKey>,
    /// Peers named for link measurement ([`EpochEvent::MeasurePeers`]).
    measuring: BTreeMap<NodeId, PublicKey>,
}

impl NodeEpochs {
    pub(super) fn new(limit: MemoryLimit) -> Self {
        Self {
            limit,
            assigned: None,
            loading: BTreeMap::new(),
            next_ticket: 1,
            pending_experts: BTreeMap::new(),
            installed: Vec::new(),
            admitted: BTreeMap::new(),
            measuring: BTreeMap::new(),
        }
    }

    pub(super) fn handle(&mut self, event: EpochEvent) -> Vec<EpochAction> {
        let mut out = Vec::new();
        match event {
            EpochEvent::AssignExperts { epoch, experts } => {
                self.pending_experts.insert(epoch, experts);
                while self.pending_experts.len() > MAX_PENDING_EXPERTS {
                    self.pending_experts.pop_first();
                }
            }
            EpochEvent::Assign(a) => self.assign(a, &mut out),
            EpochEvent::Loaded {
                ticket,
                held,
                n_embd,
            } => self.loaded(ticket, held, n_embd, &mut out),
            EpochEvent::LoadFailed { ticket } => {
                self.loading.remove(&ticket);
            }
            EpochEvent::Release { epoch } => {
                if self.assigned == Some(epoch) {
                    self.assigned = None;
                }
                self.end_loads(|l| l.assignment.epoch == epoch);
                self.pending_experts.remove(&epoch);
                if let Some(i) = self.position(epoch) {
                    self.uninstall(i, &mut out);
                }
                out.push(EpochAction::PublishClaims);
            }
            EpochEvent::LinkUp { epoch } => out.push(match self.position(epoch) {
                Some(_) => EpochAction::KeepLink { epoch },
                None => EpochAction::DropLink { epoch },
            }),
            EpochEvent::LinkLost { epoch, link, peer } => {
                if self.holds(epoch) {
                    out.push(EpochAction::ReportLinkLost { epoch, link, peer });
                }
            }
            EpochEvent::MeasurePeers(peers) => self.measuring = peers,
            EpochEvent::SessionEnded => {
                self.measuring.clear();
                self.assigned = None;
                self.end_loads(|_| true);
                self.pending_experts.clear();
                while !self.installed.is_empty() {
                    self.uninstall(0, &mut out);
                }
            }
        }
        self.readmit(&mut out);
        out
    }

    fn assign(&mut self, a: StageAssignment, out: &mut Vec<EpochAction>) {
        let epoch = a.epoch;
        // An assignment older than the latest is stale: loading it would only be discarded.
        if self.assigned.is_some_and(|latest| epoch < latest) {
            out.push(EpochAction::Refuse {
                epoch,
                why: LoadRefused::Superseded { epoch },
            });
            return;
        }
        self.assigned = Some(epoch);
        for l in self.loading.values_mut() {
            if l.fate == Fate::Live {
                l.fate = Fate::Superseded;
            }
        }
        let experts = self.pending_experts.remove(&epoch);
        // Placements for older epochs will never be assigned.
        self.pending_experts.retain(|&e, _| e > epoch);
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.loading.insert(
            ticket,
            Loading {
                assignment: a.clone(),
                experts: experts.clone(),
                fate: Fate::Live,
            },
        );
        out.push(EpochAction::Load {
            ticket,
            assignment: Box::new(a),
            experts,
        });
    }

    fn loaded(&mut self, ticket: Ticket, held: u64, n_embd: usize, out: &mut Vec<EpochAction>) {
        let Some(l) = self.loading.remove(&ticket) else {
            return;
        };
        let epoch = l.assignment.epoch;
        match l.fate {
            Fate::Released => {
                out.push(EpochAction::Discard {
                    ticket,
                    why: LoadRefused::Released { epoch },
                });
                return;
            }
            Fate::Superseded => {
                out.push(EpochAction::Refuse {
                    epoch,
                    why: LoadRefused::Superseded { epoch },
                });
                return;
            }
            Fate::Live => {}
        }
        // An epoch still installed (the split being switched from) holds its weights until it
        // is released: the two together must fit.
        let beside: u64 = self
            .installed
            .iter()
            .filter(|i| i.assignment.epoch != epoch)
            .map(|i| i.held)
            .sum();
        if let Err(refusal) = self.limit.accepts(held.saturating_add(beside)) {
            let why = if beside == 0 {
                LoadRefused::OverBudget(refusal)
            } else {
                LoadRefused::NotBeside {
                    epoch,
                    beside,
                    refusal,
                }
            };
            out.push(EpochAction::Refuse { epoch, why });
            return;
        }
        // The KV caches get what the weights leave.
        let kv_budget = self.limit.limit().map(|l| l.saturating_sub(held + beside));
        if let Some(i) = self.position(epoch) {
            self.uninstall(i, out);
        }
        while self.installed.len() >= MAX_EPOCHS {
            self.uninstall(0, out);
        }
        self.installed.push(Installed {
            assignment: l.assignment,
            experts: l.experts,
            n_embd,
            held,
        });
        out.push(EpochAction::Install {
            ticket,
            epoch,
            kv_budget,
        });
        out.push(EpochAction::PublishClaims);
    }

    /// Marks the loads `which` selects released (they report back later and are discarded).
    fn end_loads(&mut self, which: impl Fn(&Loading) -> bool) {
        for l in self.loading.values_mut().filter(|l| which(l)) {
            l.fate = Fate::Released;
        }
    }

    fn position(&self, epoch: u64) -> Option<usize> {
        self.installed
            .iter()
            .position(|i| i.assignment.epoch == epoch)
    }

    fn uninstall(&mut self, i: usize, out: &mut Vec<EpochAction>) {
        let gone = self.installed.remove(i);
        let epoch = gone.assignment.epoch;
        out.push(EpochAction::CloseLinks { epoch });
        out.push(EpochAction::ReleaseStage { epoch });
    }

    /// The keys the live epochs need admitted: each one's previous stage and the homes it
    /// serves experts to (installed, loading and not superseded, or about to be assigned), and
    /// the peers measuring their links to this node.
    fn wanted(&self) -> BTreeMap<NodeId, PublicKey> {
        let live = self
            .loading
            .values()
            .filter(|l| l.fate == Fate::Live)
            .map(|l| (&l.assignment, l.experts.as_ref()));
        let installed = self
            .installed
            .iter()
            .map(|i| (&i.assignment, i.experts.as_ref()));
        let mut keys = BTreeMap::new();
        for (a, x) in live.chain(installed) {
            keys.extend(a.prev.iter().map(|p| (p.node_id, p.key)));
            keys.extend(
                x.iter()
                    .flat_map(|x| &x.clients)
                    .map(|c| (c.node_id, c.key)),
            );
        }
        for x in self.pending_experts.values() {
            keys.extend(x.clients.iter().map(|c| (c.node_id, c.key)));
        }
        keys.extend(&self.measuring);
        keys
    }

    fn readmit(&mut self, out: &mut Vec<EpochAction>) {
        let wanted = self.wanted();
        for id in self.admitted.keys().filter(|id| !wanted.contains_key(id)) {
            out.push(EpochAction::Unadmit(*id));
        }
        for (id, key) in &wanted {
            if self.admitted.get(id) != Some(key) {
                out.push(EpochAction::Admit(*key));
            }
        }
        self.admitted = wanted;
    }

    /// Whether a lost link of `epoch` matters: it is assigned here (loading) or installed.
    pub(super) fn holds(&self, epoch: u64) -> bool {
        self.assigned == Some(epoch) || self.position(epoch).is_some()
    }

    /// The assignment of installed epoch `epoch`.
    pub(super) fn installed(&self, epoch: u64) -> Option<&StageAssignment> {
        self.position(epoch).map(|i| &self.installed[i].assignment)
    }

    /// The newest installed epoch whose previous stage has `key`, and its hidden width: where a
    /// ring stream from that peer goes (while a new split is switched to, both epochs'
    /// previous stages may dial in).
    pub(super) fn ring_from(&self, key: &PublicKey) -> Option<(u64, usize)> {
        self.installed
            .iter()
            .rev()
            .find(|i| i.assignment.prev.as_ref().is_some_and(|p| p.key == *key))
            .map(|i| (i.assignment.epoch, i.n_embd))
    }

    /// Whether installed epoch `epoch` serves experts to the home with `key`.
    pub(super) fn serves_experts_to(&self, epoch: u64, key: &PublicKey) -> bool {
        self.position(epoch)
            .and_then(|i| self.installed[i].experts.as_ref())
            .is_some_and(|x| x.clients.iter().any(|c| c.key == *key))
    }

    /// The workers owning the rest of installed epoch `epoch`'s stage experts (none unless the
    /// node is a home stage of an expert split).
    pub(super) fn expert_peers(&self, epoch: u64) -> Vec<ExpertPeer> {
        self.position(epoch)
            .and_then(|i| self.installed[i].experts.as_ref())
            .filter(|x| !x.expert_only)
            .map(|x| x.peers.clone())
            .unwrap_or_default()
    }

    /// What a sealed job can run on: the newest installed assignment, unless an installed
    /// epoch shares experts with other nodes.
    pub(super) fn sealed_holding(&self) -> Option<StageAssignment> {
        if self.installed.iter().any(|i| i.experts.is_some()) {
            return None;
        }
        self.installed.last().map(|i| i.assignment.clone())
    }
}

#[cfg(test)]
mod tests;
