//! What the agent's tasks share: the allow list, the stage thread's and the coordinator's
//! channels, the epoch machine with the links and models kept for its epochs, and the sealed
//! worker. Every decision about epochs is [`NodeEpochs`]'; [`Shared::handle_epochs`] carries
//! out its actions.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tessera_engine::Model;
use tessera_net::{AllowList, Connection};
use tokio::sync::mpsc;

use tessera_proto::{ExpertCacheStats, NodeToCoord, StageAssignment};

use super::epochs::{DataLink, EpochAction, EpochEvent, NodeEpochs};
use super::sealed::SealedWorker;
use super::stage_thread::WorkerMsg;

/// The epoch machine and what the shell keeps for its installed epochs, behind one lock.
pub(super) struct Epochs {
    pub(super) machine: NodeEpochs,
    /// Data links of installed epochs this node dialled: the ring to the next stage (one per
    /// epoch) and the expert links to workers.
    pub(super) links: Vec<(u64, DataLink, Connection)>,
    /// Expert split: the model serving other homes' requests (experts of layers outside this
    /// node's stage), per installed epoch that has one.
    pub(super) serving: BTreeMap<u64, Arc<Model>>,
}

impl Epochs {
    /// Closes every data link of `epoch` and drops its expert serving model.
    pub(super) fn close_links(&mut self, epoch: u64) {
        self.links.retain(|(e, _, c)| {
            if *e == epoch {
                c.close("epoch released");
            }
            *e != epoch
        });
        self.serving.remove(&epoch);
    }
}

pub(super) struct Shared {
    pub(super) allow: Arc<AllowList>,
    pub(super) worker: mpsc::UnboundedSender<WorkerMsg>,
    pub(super) ctrl: mpsc::UnboundedSender<NodeToCoord>,
    /// The node's epochs ([`NodeEpochs`]: assignments, loads, installed epochs, admissions)
    /// with the connections and models kept for them. Every decision about them is the
    /// machine's; the shell only carries out its actions ([`Shared::handle_epochs`]).
    pub(super) epochs: Mutex<Epochs>,
    /// The counters of the current stage's own streamed experts (the stage's model lives on the
    /// worker thread; the handle reads them from here, and reads nothing once it is dropped).
    pub(super) stage_experts: Mutex<Option<tessera_engine::expert_store::ExpertStatsSource>>,
    /// Sealed jobs: this node's sealing key, replay guard and local sequences.
    pub(super) sealed: SealedWorker,
}

impl Shared {
    pub(super) fn lock_epochs(&self) -> std::sync::MutexGuard<'_, Epochs> {
        self.epochs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Feeds the epoch machine one event and carries out its actions, all under the epochs'
    /// lock (so the stage thread sees installs and releases in the machine's order). The
    /// actions that need what only the caller holds (a load to start, a loaded stage to
    /// install, a link just made, a lost link's error) go to `edge`. New sealed claims are
    /// published after the lock is let go.
    pub(super) fn handle_epochs(
        &self,
        event: EpochEvent,
        mut edge: impl FnMut(&mut Epochs, EpochAction),
    ) {
        let mut claims = false;
        {
            let mut g = self.lock_epochs();
            let actions = g.machine.handle(event);
            for action in actions {
                match action {
                    EpochAction::Admit(key) => self.allow.insert(key),
                    EpochAction::Unadmit(id) => {
                        self.allow.remove(&id);
                    }
                    EpochAction::CloseLinks { epoch } => g.close_links(epoch),
                    EpochAction::ReleaseStage { epoch } => {
                        let _ = self.worker.send(WorkerMsg::Release(epoch));
                    }
                    EpochAction::Refuse { epoch, why } => {
                        tracing::warn!("cannot take epoch {epoch}: {why}");
                        let _ = self.ctrl.send(NodeToCoord::LoadFailed {
                            epoch,
                            reason: why.to_string(),
                        });
                    }
                    EpochAction::PublishClaims => claims = true,
                    other => edge(&mut g, other),
                }
            }
        }
        if claims {
            self.publish_claims();
        }
    }

    /// What this node holds that a sealed job can run on: the current assignment, unless its
    /// experts are shared with other nodes.
    pub(super) fn sealed_holding(&self) -> Option<StageAssignment> {
        self.lock_epochs().machine.sealed_holding()
    }

    /// Whether a lost link of `epoch` matters (it is assigned or installed here).
    pub(super) fn holds_epoch(&self, epoch: u64) -> bool {
        self.lock_epochs().machine.holds(epoch)
    }

    /// Tells the coordinator what this node can run sealed jobs on now, in new signed claims.
    pub(super) fn publish_claims(&self) {
        let claims = self.sealed.claims(self.sealed_holding().as_ref());
        let _ = self.ctrl.send(NodeToCoord::Claims(Box::new(claims)));
    }

    /// Counters of this node's streamed experts: the stage's own and those of the model serving
    /// other homes' experts, summed (`None` when neither streams experts).
    pub(super) fn expert_cache(&self) -> Option<ExpertCacheStats> {
        let stage = self
            .stage_experts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|s| s.stats());
        let serving: Vec<_> = {
            let g = self.lock_epochs();
            g.serving
                .values()
                .filter_map(|m| m.expert_stats())
                .collect()
        };
        let st = stage.into_iter().chain(serving).reduce(|mut a, b| {
            a.add(&b);
            a
        })?;
        Some(ExpertCacheStats {
            budget_bytes: st.budget_bytes,
            lookups: st.lookups,
            hits: st.hits,
            misses: st.misses,
            bytes_read: st.bytes_read,
            read_wait_us: st.read_wait_us,
            disk_busy_us: st.disk_busy_us,
            peak_bytes: st.peak_bytes,
            peak_read_buffer_bytes: st.peak_read_buffer_bytes,
        })
    }
}
