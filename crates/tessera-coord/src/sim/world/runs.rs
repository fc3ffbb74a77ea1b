//! The coordinator's side: the world feeds the [`Cluster`] what reaches it and carries out
//! what it says, checking every request's stream against its fault-free text. The wiring
//! between the machines is the cluster's own; nothing of it is copied here.

use super::*;

impl World {
    /// The first plan: the configured cells of the configured stage count over the connected
    /// nodes, once enough have joined (later plans are the membership's own re-planning).
    pub(super) fn maybe_plan(&mut self) -> Result<(), Violation> {
        let m = self.cluster.membership();
        if m.auto_plan().is_some() || m.epoch().is_some() {
            return Ok(());
        }
        let connected: Vec<NodeId> = m.connected().iter().map(|m| m.node_id).collect();
        let alive = self.nodes.iter().filter(|n| n.alive && n.enrolled).count();
        if connected.len() < (self.stages * self.cells).min(alive.max(1)) {
            return Ok(());
        }
        // An expert split's first plan waits for every owner it names (as `--experts` does).
        if self.experts.is_some() && !m.expert_split_ready() {
            return Ok(());
        }
        let k = self.stages.min(connected.len());
        let cells = (connected.len() / k).clamp(1, self.cells);
        self.summary.cells = cells;
        let ranges = crate::replan::even_ranges(N_LAYER, k);
        let stages = connected
            .chunks(k)
            .take(cells)
            .flat_map(|nodes| nodes.iter().copied().zip(ranges.iter().cloned()))
            .collect();
        self.coord(ClusterInput::Plan { stages })
    }

    /// Schedules the coordinator's next timeout, if it came nearer.
    pub(super) fn schedule_wake(&mut self) {
        let Some(t) = self.cluster.poll_timeout() else {
            return;
        };
        if self.coord_wake.is_none_or(|w| t < w) {
            self.coord_wake = Some(t);
            let life = self.coord_life;
            self.at(t.max(self.now), Ev::CoordTimeout { life });
        }
    }

    pub(super) fn submit(&mut self, run: usize) -> Result<(), Violation> {
        let mut spec = self.runs[run].spec.clone();
        spec.prefill_chunk = 4;
        let positions = (spec.prompt.len() + spec.max_new_tokens) as u64;
        self.runs[run].submitted = true;
        self.coord(ClusterInput::Submit {
            run: run as u64 + 1,
            spec: Box::new(spec),
            stages: None,
            positions,
        })
    }

    /// Feeds the coordinator one input and carries out its outputs.
    pub(super) fn coord(&mut self, input: ClusterInput) -> Result<(), Violation> {
        let outputs = self.cluster.handle(self.now, input);
        // Epoch numbers only grow, whichever cell takes the next.
        if let Some(id) = self.cluster.membership().cells().iter().map(|e| e.id).max() {
            if id < self.highest_epoch {
                return Err(self.violation(
                    Invariant::EpochsGrow,
                    format!("epoch went backwards: {id} after {}", self.highest_epoch),
                ));
            }
            self.highest_epoch = id;
            self.summary.epochs = self.summary.epochs.max(id);
        }
        self.summary.drained = self.drained_before + self.cluster.drained() as usize;
        // Nodes the sealed desk hears left, after the cluster's sends (as the runtime's shell).
        let mut left = Vec::new();
        for o in outputs {
            match o {
                ClusterOutput::ToNode { to, msg } => {
                    let Some(i) = self.index(to) else { continue };
                    match &*msg {
                        CoordToNode::Open(open) if !self.given.contains(&(to, open.epoch)) => {
                            return Err(self.violation(
                                Invariant::OpenOnlyWhereGiven,
                                format!(
                                    "opened a sequence on {} for epoch {}, which it was not given",
                                    self.nodes[i].name, open.epoch
                                ),
                            ));
                        }
                        CoordToNode::Open(open) => self.check_routed(open.epoch)?,
                        CoordToNode::AssignExperts { epoch, experts } => {
                            self.experts_given
                                .entry(*epoch)
                                .or_default()
                                .push((to, experts.held.clone()));
                        }
                        CoordToNode::Link { epoch } => self.check_experts(*epoch)?,
                        _ => {}
                    }
                    self.coord_send(i, *msg);
                }
                ClusterOutput::LeaseExpired { node, session } => {
                    if let Some(i) = self.index(node) {
                        if self.coord_conn[i] == Some(session) {
                            self.coord_conn[i] = None;
                            left.push(i);
                            let d = self.latency(i);
                            self.after(
                                d,
                                Ev::Closed {
                                    node: i,
                                    conn: session,
                                },
                            );
                        }
                    }
                }
                ClusterOutput::Run { run, news } => self.news(run as usize - 1, news)?,
                ClusterOutput::NodeLeft { node, .. } => left.extend(self.index(node)),
                // The sealed desk's outputs come of sealed inputs only (`world/jobs.rs`).
                ClusterOutput::RecordEpoch(_)
                | ClusterOutput::Refused { .. }
                | ClusterOutput::Sealed(_) => {}
            }
        }
        for i in left {
            self.worker_left(i)?;
        }
        self.schedule_wake();
        Ok(())
    }

    /// What a request's owner hears, checked against the fault-free run.
    fn news(&mut self, run: usize, news: RunNews) -> Result<(), Violation> {
        match news {
            RunNews::Event(RunEvent::Paused { .. }) => self.summary.resumes += 1,
            RunNews::Event(RunEvent::Token { pos, token, .. }) => {
                let r = &mut self.runs[run];
                let i = r.streamed.len();
                let want = r.reference.get(i).copied();
                let at = r.spec.prompt.len() + i;
                if want != Some(token) || pos != at {
                    let what = format!(
                        "request {run} streamed token {token} at position {pos}; the \
                         fault-free run has {want:?} at {at}"
                    );
                    return Err(self.violation(Invariant::SameTextAsFaultFree, what));
                }
                r.streamed.push(token);
            }
            RunNews::Event(_) => {}
            RunNews::Ended(Err(refused)) => {
                let why = crate::CoordError::from(refused).to_string();
                self.runs[run].ended = Some(Err(why));
                self.summary.errors += 1;
            }
            RunNews::Ended(Ok(outcome)) => {
                let r = &mut self.runs[run];
                match outcome.reason {
                    FinishReason::Error => {
                        if outcome.error.as_deref().is_none_or(str::is_empty) {
                            return Err(self.violation(
                                Invariant::HonestEndings,
                                format!("request {run} failed without saying why"),
                            ));
                        }
                        r.ended = Some(Err(outcome.error.unwrap_or_default()));
                        self.summary.errors += 1;
                    }
                    FinishReason::Cancelled => {
                        return Err(self.violation(
                            Invariant::HonestEndings,
                            format!("request {run} was cancelled, and nobody cancelled it"),
                        ));
                    }
                    FinishReason::Length | FinishReason::EndOfGeneration => {
                        if r.streamed != r.reference || outcome.generated != r.reference {
                            let what = format!(
                                "request {run} ended ({:?}) with {:?}; the fault-free run \
                                 gives {:?}",
                                outcome.reason, outcome.generated, r.reference
                            );
                            return Err(self.violation(Invariant::SameTextAsFaultFree, what));
                        }
                        r.ended = Some(Ok(()));
                        self.summary.completed += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// An epoch of an expert split, once it links: every expert of every MoE layer is held by
    /// exactly one of its nodes, whoever left before it was planned.
    fn check_experts(&mut self, epoch: u64) -> Result<(), Violation> {
        if self.experts.is_none() || !self.experts_checked.insert(epoch) {
            return Ok(());
        }
        let given = self.experts_given.get(&epoch).cloned().unwrap_or_default();
        for layer in 0..N_LAYER {
            let mut held: Vec<usize> = given
                .iter()
                .flat_map(|(_, h)| h.get(layer).into_iter().flatten().copied())
                .collect();
            held.sort_unstable();
            if held != (0..N_EXPERT).collect::<Vec<_>>() {
                return Err(self.violation(
                    Invariant::ExpertsHeldOnce,
                    format!(
                    "epoch {epoch} links with experts {held:?} of layer {layer} held; every one of \
                     0..{N_EXPERT} must be held exactly once"
                ),
                ));
            }
        }
        let owners: BTreeSet<NodeId> = given
            .iter()
            .filter(|(_, h)| h.iter().any(|l| !l.is_empty()))
            .map(|(n, _)| *n)
            .collect();
        let configured: BTreeSet<NodeId> = self.nodes[..self.summary.expert_owners]
            .iter()
            .map(|n| n.id)
            .collect();
        if owners != configured {
            self.summary.experts_replaced += 1;
        }
        Ok(())
    }
}
