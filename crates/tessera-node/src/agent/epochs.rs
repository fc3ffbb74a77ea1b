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
use crate::protocol::{ExpertAssignment, ExpertPeer, StageAssignment};

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
    /// [`NodeToCoord::LoadFailed`]: crate::protocol::NodeToCoord::LoadFailed
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
    /// [`NodeToCoord::LinkFailed`]: crate::protocol::NodeToCoord::LinkFailed
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
            EpochEvent::SessionEnded => {
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
    /// serves experts to (installed, loading and not superseded, or about to be assigned).
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
mod tests {
    use super::*;
    use crate::protocol::PeerInfo;

    const GIB: u64 = 1 << 30;

    fn limit(bytes: u64) -> MemoryLimit {
        MemoryLimit {
            refusal: BudgetRefusal {
                requested: u64::MAX,
                limit: Some(bytes),
                limit_source: "memory budget \"test\"".into(),
                total_ram: None,
                available_ram: None,
            },
        }
    }

    fn peer(n: u8) -> PeerInfo {
        let key = PublicKey::from_bytes([n; 32]);
        PeerInfo {
            node_id: key.node_id(),
            key,
            addr: ([127, 0, 0, 1], 7000 + u16::from(n)).into(),
        }
    }

    /// Stage 1 of a two-stage ring for `epoch`, its previous stage `prev`.
    fn stage(epoch: u64, prev: u8) -> StageAssignment {
        StageAssignment {
            epoch,
            model: tessera_host::ContentHash::of(b"model"),
            stage: 1,
            n_stages: 2,
            layers: 2..4,
            embed: false,
            head: true,
            next: Some(peer(prev)),
            prev: Some(peer(prev)),
            max_context: 64,
            kv_type: Default::default(),
        }
    }

    fn ticket_of(acts: &[EpochAction]) -> Ticket {
        acts.iter()
            .find_map(|a| match a {
                EpochAction::Load { ticket, .. } => Some(*ticket),
                _ => None,
            })
            .expect("a load")
    }

    fn installs(acts: &[EpochAction]) -> Vec<u64> {
        acts.iter()
            .filter_map(|a| match a {
                EpochAction::Install { epoch, .. } => Some(*epoch),
                _ => None,
            })
            .collect()
    }

    /// Assigns `epoch` and loads it to the end with `held` bytes: the load's actions.
    fn assign_and_load(m: &mut NodeEpochs, epoch: u64, prev: u8, held: u64) -> Vec<EpochAction> {
        let ticket = ticket_of(&m.handle(EpochEvent::Assign(stage(epoch, prev))));
        m.handle(EpochEvent::Loaded {
            ticket,
            held,
            n_embd: 8,
        })
    }

    #[test]
    fn an_assignment_loads_admits_its_previous_stage_and_installs() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        let acts = m.handle(EpochEvent::Assign(stage(1, 7)));
        assert!(acts.contains(&EpochAction::Admit(peer(7).key)));
        let ticket = ticket_of(&acts);
        assert!(m.holds(1), "a lost link of a loading epoch matters");
        assert!(m.installed(1).is_none());
        let acts = m.handle(EpochEvent::Loaded {
            ticket,
            held: GIB,
            n_embd: 8,
        });
        assert_eq!(
            acts,
            vec![
                EpochAction::Install {
                    ticket,
                    epoch: 1,
                    kv_budget: Some(3 * GIB)
                },
                EpochAction::PublishClaims
            ]
        );
        assert_eq!(m.ring_from(&peer(7).key), Some((1, 8)));
        assert_eq!(m.sealed_holding().map(|a| a.epoch), Some(1));
    }

    #[test]
    fn a_load_finished_after_the_release_of_its_epoch_is_discarded_and_frees_its_memory() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        let ticket = ticket_of(&m.handle(EpochEvent::Assign(stage(1, 7))));
        let acts = m.handle(EpochEvent::Release { epoch: 1 });
        assert!(acts.contains(&EpochAction::Unadmit(peer(7).node_id)));
        assert!(
            !acts
                .iter()
                .any(|a| matches!(a, EpochAction::ReleaseStage { .. })),
            "nothing was installed: {acts:?}"
        );
        assert!(!m.holds(1));
        // The load finishes: discarded, never installed, and the coordinator (which released
        // it) is not told.
        let acts = m.handle(EpochEvent::Loaded {
            ticket,
            held: 3 * GIB,
            n_embd: 8,
        });
        assert_eq!(
            acts,
            vec![EpochAction::Discard {
                ticket,
                why: LoadRefused::Released { epoch: 1 }
            }]
        );
        assert!(m.installed(1).is_none());
        assert_eq!(m.ring_from(&peer(7).key), None);
        // Its 3 GiB are not counted against the next epoch: 3 GiB fit in 4 alone.
        let acts = assign_and_load(&mut m, 2, 8, 3 * GIB);
        assert_eq!(installs(&acts), vec![2]);
        assert!(acts.contains(&EpochAction::Install {
            ticket: ticket + 1,
            epoch: 2,
            kv_budget: Some(GIB)
        }));
    }

    #[test]
    fn a_load_finished_after_a_newer_assignment_is_refused_and_the_newer_one_installs() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        let old = ticket_of(&m.handle(EpochEvent::Assign(stage(1, 7))));
        let acts = m.handle(EpochEvent::Assign(stage(2, 8)));
        let new = ticket_of(&acts);
        // The superseded load's previous stage is no longer let in.
        assert!(acts.contains(&EpochAction::Unadmit(peer(7).node_id)));
        assert!(acts.contains(&EpochAction::Admit(peer(8).key)));
        let acts = m.handle(EpochEvent::Loaded {
            ticket: old,
            held: GIB,
            n_embd: 8,
        });
        assert_eq!(
            acts,
            vec![EpochAction::Refuse {
                epoch: 1,
                why: LoadRefused::Superseded { epoch: 1 }
            }]
        );
        let acts = m.handle(EpochEvent::Loaded {
            ticket: new,
            held: GIB,
            n_embd: 8,
        });
        assert_eq!(installs(&acts), vec![2]);
        assert!(!m.holds(1));
    }

    #[test]
    fn a_stale_assignment_is_refused_without_loading() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        m.handle(EpochEvent::Assign(stage(5, 7)));
        let acts = m.handle(EpochEvent::Assign(stage(4, 8)));
        assert_eq!(
            acts,
            vec![EpochAction::Refuse {
                epoch: 4,
                why: LoadRefused::Superseded { epoch: 4 }
            }]
        );
        assert!(m.holds(5));
    }

    #[test]
    fn a_reassigned_epoch_installs_only_its_newest_load() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        let first = ticket_of(&m.handle(EpochEvent::Assign(stage(3, 7))));
        m.handle(EpochEvent::SessionEnded);
        // A restarted coordinator reuses the epoch number in the next session.
        let second = ticket_of(&m.handle(EpochEvent::Assign(stage(3, 8))));
        let acts = m.handle(EpochEvent::Loaded {
            ticket: first,
            held: GIB,
            n_embd: 8,
        });
        assert!(installs(&acts).is_empty(), "{acts:?}");
        let acts = m.handle(EpochEvent::Loaded {
            ticket: second,
            held: GIB,
            n_embd: 8,
        });
        assert_eq!(installs(&acts), vec![3]);
        assert_eq!(m.ring_from(&peer(8).key), Some((3, 8)));
    }

    #[test]
    fn link_loss_during_release_is_not_reported() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        assign_and_load(&mut m, 1, 7, GIB);
        let lost = EpochEvent::LinkLost {
            epoch: 1,
            link: DataLink::RingFromPrevious,
            peer: peer(7).node_id,
        };
        assert_eq!(
            m.handle(lost.clone()),
            vec![EpochAction::ReportLinkLost {
                epoch: 1,
                link: DataLink::RingFromPrevious,
                peer: peer(7).node_id
            }],
            "a link of an installed epoch that goes is a failure"
        );
        let acts = m.handle(EpochEvent::Release { epoch: 1 });
        for a in [
            EpochAction::CloseLinks { epoch: 1 },
            EpochAction::ReleaseStage { epoch: 1 },
            EpochAction::Unadmit(peer(7).node_id),
        ] {
            assert!(acts.contains(&a), "{a:?} in {acts:?}");
        }
        // The peer sees the link close and its end of it goes: not a failure here.
        assert!(m.handle(lost).is_empty());
        for link in [DataLink::RingToNext, DataLink::ExpertToWorker] {
            assert!(m
                .handle(EpochEvent::LinkLost {
                    epoch: 1,
                    link,
                    peer: peer(7).node_id
                })
                .is_empty());
        }
    }

    #[test]
    fn a_link_made_while_its_epoch_was_released_is_dropped() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        assign_and_load(&mut m, 1, 7, GIB);
        assert_eq!(
            m.handle(EpochEvent::LinkUp { epoch: 1 }),
            vec![EpochAction::KeepLink { epoch: 1 }]
        );
        m.handle(EpochEvent::Release { epoch: 1 });
        // The dial finished after the release: its connection must not outlive the epoch.
        assert_eq!(
            m.handle(EpochEvent::LinkUp { epoch: 1 }),
            vec![EpochAction::DropLink { epoch: 1 }]
        );
    }

    #[test]
    fn a_link_lost_while_loading_matters_and_not_after_the_session_ended() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        m.handle(EpochEvent::Assign(stage(1, 7)));
        let lost = EpochEvent::LinkLost {
            epoch: 1,
            link: DataLink::ExpertFromHome,
            peer: peer(7).node_id,
        };
        assert_eq!(m.handle(lost.clone()).len(), 1);
        let acts = m.handle(EpochEvent::SessionEnded);
        assert_eq!(acts, vec![EpochAction::Unadmit(peer(7).node_id)]);
        assert!(m.handle(lost).is_empty());
    }

    #[test]
    fn two_epochs_installed_at_once_the_old_one_serves_until_released() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        assign_and_load(&mut m, 1, 7, GIB);
        // The coordinator switches to a new split: epoch 2 loads beside epoch 1.
        let acts = assign_and_load(&mut m, 2, 8, GIB);
        assert_eq!(installs(&acts), vec![2]);
        assert!(
            !acts
                .iter()
                .any(|a| matches!(a, EpochAction::ReleaseStage { .. })),
            "the old epoch stays while its sequences finish: {acts:?}"
        );
        // The KV caches get what both epochs' weights leave.
        assert!(acts.contains(&EpochAction::Install {
            ticket: 2,
            epoch: 2,
            kv_budget: Some(2 * GIB)
        }));
        // Both previous stages are let in; each ring stream goes to its own epoch.
        assert_eq!(m.ring_from(&peer(7).key), Some((1, 8)));
        assert_eq!(m.ring_from(&peer(8).key), Some((2, 8)));
        assert!(m.holds(1) && m.holds(2));
        assert_eq!(m.sealed_holding().map(|a| a.epoch), Some(2));
        // A lost link of the old epoch still fails it while it serves.
        assert_eq!(
            m.handle(EpochEvent::LinkLost {
                epoch: 1,
                link: DataLink::RingToNext,
                peer: peer(7).node_id
            })
            .len(),
            1
        );
        // Drained: the coordinator releases the old epoch; the new one is untouched.
        let acts = m.handle(EpochEvent::Release { epoch: 1 });
        assert_eq!(
            acts,
            vec![
                EpochAction::CloseLinks { epoch: 1 },
                EpochAction::ReleaseStage { epoch: 1 },
                EpochAction::PublishClaims,
                EpochAction::Unadmit(peer(7).node_id),
            ]
        );
        assert!(m.installed(2).is_some());
        assert!(!m.holds(1));
        // Its memory is free: a 3 GiB epoch now fits beside epoch 2's 1 GiB.
        let acts = assign_and_load(&mut m, 3, 9, 3 * GIB);
        assert_eq!(installs(&acts), vec![3]);
    }

    #[test]
    fn a_second_epoch_that_does_not_fit_beside_the_first_is_refused() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        assign_and_load(&mut m, 1, 7, 3 * GIB);
        let acts = assign_and_load(&mut m, 2, 8, 2 * GIB);
        // Refused, and its previous stage no longer let in.
        let [EpochAction::Refuse { epoch: 2, why }, EpochAction::Unadmit(gone)] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!(*gone, peer(8).node_id);
        let LoadRefused::NotBeside {
            epoch: 2,
            beside,
            refusal,
        } = why
        else {
            panic!("{why:?}")
        };
        assert_eq!((*beside, refusal.requested), (3 * GIB, 5 * GIB));
        assert!(why.to_string().contains("beside the epoch still installed"));
        // Epoch 1 serves on.
        assert!(m.installed(1).is_some() && m.installed(2).is_none());
        assert_eq!(m.ring_from(&peer(8).key), None);
        // Alone, an epoch over the limit is refused as over the budget.
        let mut m = NodeEpochs::new(limit(GIB));
        let acts = assign_and_load(&mut m, 1, 7, 2 * GIB);
        assert!(
            matches!(
                &acts[..],
                [
                    EpochAction::Refuse {
                        why: LoadRefused::OverBudget(_),
                        ..
                    },
                    EpochAction::Unadmit(_)
                ]
            ),
            "{acts:?}"
        );
    }

    #[test]
    fn a_third_epoch_installed_while_two_are_held_evicts_the_oldest_whole() {
        let mut m = NodeEpochs::new(limit(8 * GIB));
        assign_and_load(&mut m, 1, 7, GIB);
        assign_and_load(&mut m, 2, 8, GIB);
        let ticket = ticket_of(&m.handle(EpochEvent::Assign(stage(3, 9))));
        // While epoch 3 loads, all three are resident: it must fit beside both.
        let acts = m.handle(EpochEvent::Loaded {
            ticket,
            held: GIB,
            n_embd: 8,
        });
        assert!(acts.contains(&EpochAction::Install {
            ticket,
            epoch: 3,
            kv_budget: Some(5 * GIB)
        }));
        // Epoch 1 goes whole, before epoch 3 is installed (the stage thread holds two).
        let pos = |a: &EpochAction| acts.iter().position(|x| x == a).expect("present");
        let install = acts
            .iter()
            .position(|a| matches!(a, EpochAction::Install { .. }))
            .unwrap();
        assert!(pos(&EpochAction::ReleaseStage { epoch: 1 }) < install);
        assert!(pos(&EpochAction::CloseLinks { epoch: 1 }) < install);
        assert!(acts.contains(&EpochAction::Unadmit(peer(7).node_id)));
        assert!(!m.holds(1));
        assert!(m.installed(2).is_some() && m.installed(3).is_some());
        // Its links are not the node's concern any more.
        assert!(m
            .handle(EpochEvent::LinkLost {
                epoch: 1,
                link: DataLink::RingToNext,
                peer: peer(7).node_id
            })
            .is_empty());
    }

    #[test]
    fn a_third_epoch_must_fit_beside_both_installed() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        assign_and_load(&mut m, 1, 7, GIB);
        assign_and_load(&mut m, 2, 8, GIB);
        let acts = assign_and_load(&mut m, 3, 9, 3 * GIB);
        assert!(
            matches!(
                &acts[..],
                [EpochAction::Refuse {
                    epoch: 3,
                    why: LoadRefused::NotBeside {
                        beside: b, ..
                    }
                }, EpochAction::Unadmit(_)] if *b == 2 * GIB
            ),
            "{acts:?}"
        );
        assert!(m.installed(1).is_some() && m.installed(2).is_some());
    }

    #[test]
    fn a_peer_shared_by_two_epochs_stays_admitted_until_neither_needs_it() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        assign_and_load(&mut m, 1, 7, GIB);
        let acts = assign_and_load(&mut m, 2, 7, GIB);
        assert!(!acts.iter().any(|a| matches!(a, EpochAction::Admit(_))));
        let acts = m.handle(EpochEvent::Release { epoch: 1 });
        assert!(!acts.iter().any(|a| matches!(a, EpochAction::Unadmit(_))));
        // The ring stream from it now goes to epoch 2.
        assert_eq!(m.ring_from(&peer(7).key), Some((2, 8)));
        let acts = m.handle(EpochEvent::Release { epoch: 2 });
        assert!(acts.contains(&EpochAction::Unadmit(peer(7).node_id)));
    }

    fn experts(clients: Vec<PeerInfo>, peers: Vec<PeerInfo>) -> ExpertAssignment {
        ExpertAssignment {
            held: vec![vec![0, 1], vec![0, 1], vec![], vec![]],
            expert_only: false,
            peers: peers
                .into_iter()
                .map(|peer| ExpertPeer {
                    peer,
                    experts: vec![vec![2, 3], vec![2, 3], vec![], vec![]],
                })
                .collect(),
            clients,
        }
    }

    #[test]
    fn expert_clients_are_admitted_with_their_placement_and_go_with_its_release() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        let acts = m.handle(EpochEvent::AssignExperts {
            epoch: 1,
            experts: experts(vec![peer(5)], vec![peer(6)]),
        });
        assert_eq!(acts, vec![EpochAction::Admit(peer(5).key)]);
        let acts = m.handle(EpochEvent::Assign(stage(1, 7)));
        let Some(EpochAction::Load {
            experts: Some(x), ..
        }) = acts.iter().find(|a| matches!(a, EpochAction::Load { .. }))
        else {
            panic!("{acts:?}")
        };
        assert_eq!(x.clients, vec![peer(5)]);
        let ticket = ticket_of(&acts);
        m.handle(EpochEvent::Loaded {
            ticket,
            held: GIB,
            n_embd: 8,
        });
        assert!(m.serves_experts_to(1, &peer(5).key));
        assert!(!m.serves_experts_to(1, &peer(6).key));
        assert_eq!(m.expert_peers(1).len(), 1);
        assert_eq!(m.sealed_holding(), None, "its experts are shared");
        let acts = m.handle(EpochEvent::Release { epoch: 1 });
        assert!(acts.contains(&EpochAction::Unadmit(peer(5).node_id)));
        assert!(!m.serves_experts_to(1, &peer(5).key));
    }

    #[test]
    fn expert_clients_of_an_epoch_released_while_loading_are_not_left_admitted() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        m.handle(EpochEvent::AssignExperts {
            epoch: 1,
            experts: experts(vec![peer(5)], vec![]),
        });
        m.handle(EpochEvent::Assign(stage(1, 7)));
        let acts = m.handle(EpochEvent::Release { epoch: 1 });
        assert!(acts.contains(&EpochAction::Unadmit(peer(5).node_id)));
        assert!(acts.contains(&EpochAction::Unadmit(peer(7).node_id)));
    }

    #[test]
    fn stale_expert_placements_are_bounded() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        for epoch in 1..=10u8 {
            m.handle(EpochEvent::AssignExperts {
                epoch: u64::from(epoch),
                experts: experts(vec![peer(epoch)], vec![]),
            });
        }
        assert_eq!(m.pending_experts.len(), MAX_PENDING_EXPERTS);
        assert_eq!(m.admitted.len(), MAX_PENDING_EXPERTS);
        // Assigning epoch 10 drops every older placement.
        m.handle(EpochEvent::Assign(stage(10, 7)));
        assert!(m.pending_experts.is_empty());
    }

    #[test]
    fn the_session_ending_releases_every_installed_epoch() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        assign_and_load(&mut m, 1, 7, GIB);
        assign_and_load(&mut m, 2, 8, GIB);
        let acts = m.handle(EpochEvent::SessionEnded);
        for e in [1, 2] {
            assert!(acts.contains(&EpochAction::ReleaseStage { epoch: e }));
            assert!(acts.contains(&EpochAction::CloseLinks { epoch: e }));
        }
        assert!(!m.holds(1) && !m.holds(2));
        assert_eq!(m.sealed_holding(), None);
        assert!(m.admitted.is_empty());
    }

    #[test]
    fn a_failed_load_keeps_its_epoch_assigned_but_admits_no_one() {
        let mut m = NodeEpochs::new(limit(4 * GIB));
        let ticket = ticket_of(&m.handle(EpochEvent::Assign(stage(1, 7))));
        let acts = m.handle(EpochEvent::LoadFailed { ticket });
        assert_eq!(acts, vec![EpochAction::Unadmit(peer(7).node_id)]);
        // The coordinator still counts it as this node's until it releases it.
        assert!(m.holds(1));
        // A report for a ticket already settled changes nothing.
        assert!(m
            .handle(EpochEvent::Loaded {
                ticket,
                held: GIB,
                n_embd: 8
            })
            .is_empty());
    }
}
