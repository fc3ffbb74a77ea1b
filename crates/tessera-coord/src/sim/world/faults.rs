//! Carrying out the faults: killing, freezing and partitioning nodes, restarting the
//! coordinator, and hostile members forging messages.

use super::*;

impl World {
    pub(super) fn fault(&mut self, f: FaultKind) -> Result<(), Violation> {
        match f {
            FaultKind::Join(i) => {
                self.nodes[i].enrolled = true;
                self.connect(i);
            }
            FaultKind::Kill(i) => {
                let n = &mut self.nodes[i];
                n.alive = false;
                n.stopped_at = Some(self.now);
                n.killed_at = Some(self.now);
                n.incarnation += 1;
                n.drop_state();
            }
            FaultKind::Restart(i) => {
                let n = &mut self.nodes[i];
                if !n.alive {
                    n.alive = true;
                    n.incarnation += 1;
                    n.frozen_until = None;
                    if n.enrolled {
                        self.connect(i);
                    }
                }
            }
            FaultKind::Freeze(i, d) => {
                self.nodes[i].frozen_until = Some(self.now + d);
                self.nodes[i].stopped_at = Some(self.now);
            }
            FaultKind::Partition(i, d) => self.nodes[i].partitioned_until = Some(self.now + d),
            FaultKind::SlowLinks(d) => self.extra_latency = d,
            FaultKind::CoordinatorRestart => self.restart_coordinator()?,
            FaultKind::Forge(i) => self.forge(i)?,
        }
        Ok(())
    }

    /// The coordinator process restarts: its runs and sealed jobs end with an error (their
    /// clients' sessions drop), every node session closes, and epoch numbers continue from the
    /// store.
    pub(super) fn restart_coordinator(&mut self) -> Result<(), Violation> {
        self.coord_life += 1;
        for r in self.runs.iter_mut().filter(|r| r.submitted) {
            if r.ended.is_none() {
                r.ended = Some(Err("the coordinator restarted".into()));
                self.summary.errors += 1;
            }
        }
        let last = self.cluster.membership().last_epoch_id();
        self.drained_before += self.cluster.drained() as usize;
        self.cluster = new_cluster(&self.cfg, Some(last), self.experts.as_ref());
        self.jobs_lost_in_restart();
        self.coord_wake = None;
        for i in 0..self.nodes.len() {
            if let Some(conn) = self.coord_conn[i].take() {
                let d = self.latency(i);
                self.after(d, Ev::Closed { node: i, conn });
            }
        }
        self.schedule_wake();
        Ok(())
    }

    /// What a hostile member may try; every one of these must be refused by the machines
    /// (the invariants then show each victim's text unchanged and the service going on).
    pub(super) fn forge(&mut self, node: usize) -> Result<(), Violation> {
        let Some(conn) = self.coord_conn[node] else {
            return Ok(());
        };
        let id = self.nodes[node].id;
        // Every cell's epoch, and whether this node is a stage of it.
        let cells: Vec<(u64, bool)> = self
            .cluster
            .membership()
            .cells()
            .iter()
            .map(|e| (e.id, e.stages.iter().any(|s| s.node_id == id)))
            .collect();
        let mut forged = Vec::new();
        for &(epoch, member) in &cells {
            if !member {
                forged.push(NodeToCoord::LoadFailed {
                    epoch,
                    reason: "forged".into(),
                });
                forged.push(NodeToCoord::LinkFailed {
                    epoch,
                    reason: "forged".into(),
                    peer: None,
                });
            }
        }
        for (i, run) in self.runs.iter().enumerate() {
            // The sampler of a run's own cell may say anything about it (verification is the
            // answer to that): forge only for runs this node does not sample.
            let Some((epoch, seq)) = self.cluster.attempt(i as u64 + 1) else {
                continue;
            };
            // Its epoch may be a cell's, or one draining beside a new split.
            let sampler = self
                .cluster
                .membership()
                .epoch_with_id(epoch)
                .and_then(|e| e.stages.iter().rev().find(|s| !s.layers.is_empty()))
                .map(|s| s.node_id);
            if sampler != Some(id) {
                let pos = run.spec.prompt.len() + run.streamed.len();
                forged.push(NodeToCoord::Token {
                    seq,
                    pos,
                    token: VOCAB - 1,
                    logprobs: None,
                });
                forged.push(NodeToCoord::Finished {
                    seq,
                    reason: FinishReason::Length,
                    generated: 1,
                    error: None,
                });
            }
        }
        self.summary.forged += forged.len();
        for msg in forged {
            self.coord_receives(node, conn, msg)?;
        }
        Ok(())
    }

    // ---- the network ---------------------------------------------------------------------
}
