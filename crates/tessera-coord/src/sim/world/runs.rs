//! The coordinator's side: planning, membership events, epoch changes, and each request's
//! run machine with the checks on what it streams.

use super::*;

impl World {
    /// The first plan: the configured cells of the configured stage count over the connected
    /// nodes, once enough have joined (later plans are the membership's own re-planning).
    pub(super) fn maybe_plan(&mut self) -> Result<(), Violation> {
        if self.membership.auto_plan().is_some() || self.membership.epoch().is_some() {
            return Ok(());
        }
        let connected: Vec<NodeId> = self
            .membership
            .connected()
            .iter()
            .map(|m| m.node_id)
            .collect();
        let alive = self.nodes.iter().filter(|n| n.alive && n.enrolled).count();
        if connected.len() < (self.stages * self.cells).min(alive.max(1)) {
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
        self.membership_event(Event::Plan {
            model: tessera_host::ContentHash([7; 32]),
            stages,
            n_layer: N_LAYER,
            max_context: 256,
        })
    }

    pub(super) fn membership_event(&mut self, event: Event) -> Result<(), Violation> {
        let actions = self.membership.handle(event);
        for a in actions {
            match a {
                Action::Send { to, msg } => {
                    if let Some(i) = self.index(to) {
                        self.coord_send(i, msg.0);
                    }
                }
                Action::LeaseExpired { node, session } => {
                    if let Some(i) = self.index(node) {
                        if self.coord_conn[i] == Some(session) {
                            self.coord_conn[i] = None;
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
                Action::EpochReady(_)
                | Action::EpochFailed { .. }
                | Action::Note(_)
                | Action::Refused { .. } => {}
            }
        }
        self.epochs_changed()
    }

    /// Tells runs about the cells as they now are: lost under them, or ready for those
    /// waiting (each seated on the cell the router chooses, as the driver does).
    pub(super) fn epochs_changed(&mut self) -> Result<(), Violation> {
        // Epoch numbers only grow, whichever cell takes the next.
        if let Some(id) = self.membership.cells().iter().map(|e| e.id).max() {
            if id < self.highest_epoch {
                return Err(self.violation(format!(
                    "epoch went backwards: {id} after {}",
                    self.highest_epoch
                )));
            }
            self.highest_epoch = id;
            self.summary.epochs = self.summary.epochs.max(id);
        }
        for run in 0..self.runs.len() {
            if let Some(e) = self.runs[run].epoch {
                if !self.membership.serves(e) {
                    self.runs[run].epoch = None;
                    self.book.unseat(run as u64);
                    let why = format!("epoch {e} was lost");
                    self.run_input(run, Input::EpochLost { epoch: e, why })?;
                }
            }
        }
        for run in 0..self.runs.len() {
            let Some(lost) = self.runs[run].awaiting else {
                continue;
            };
            let loads = self.book.loads(&self.membership);
            let Ok(id) = crate::cells::choose(&loads, 1, 1, lost) else {
                continue;
            };
            self.runs[run].awaiting = None;
            self.book.seat(run as u64, id, 1);
            let placement = Placement::of(&self.membership, id).expect("a ready cell");
            let attempt_seq = self.next_seq;
            self.next_seq += 1;
            self.routes.insert(attempt_seq, run);
            self.runs[run].epoch = Some(id);
            self.run_input(
                run,
                Input::EpochReady {
                    placement,
                    attempt_seq,
                },
            )?;
        }
        self.release_drained()
    }

    pub(super) fn submit(&mut self, run: usize) -> Result<(), Violation> {
        let mut spec = self.runs[run].spec.clone();
        spec.prefill_chunk = 4;
        let (mut machine, out) = RunMachine::new(spec, self.cfg.lease);
        if let Some(f) = self.cfg.fault {
            machine.inject_fault(f);
        }
        self.runs[run].machine = Some(machine);
        self.outputs(run, out)
    }

    pub(super) fn run_input(&mut self, run: usize, input: Input) -> Result<(), Violation> {
        let Some(m) = self.runs[run].machine.as_mut() else {
            return Ok(());
        };
        let out = m.handle(self.now, input);
        self.outputs(run, out)
    }

    /// Carries out a run machine's outputs, as the driver does.
    pub(super) fn outputs(&mut self, run: usize, out: Vec<Output>) -> Result<(), Violation> {
        let mut follow = Vec::new();
        for o in out {
            match o {
                Output::Send { to, msg } => {
                    let Some(i) = self.index(to) else { continue };
                    if let CoordToNode::Open(open) = &msg.0 {
                        if !self.given.contains(&(to, open.epoch)) {
                            return Err(self.violation(format!(
                                "opened a sequence on {} for epoch {}, which it was not given",
                                self.nodes[i].name, open.epoch
                            )));
                        }
                    }
                    if !self.coord_send(i, msg.0) {
                        follow.push(Input::Undeliverable { to });
                    }
                }
                Output::AwaitEpoch { lost } => {
                    if lost.is_some() {
                        self.summary.resumes += 1;
                    }
                    self.runs[run].awaiting = Some(lost);
                    self.runs[run].epoch = None;
                    self.book.unseat(run as u64);
                }
                Output::ArmTimer { timer, after } => {
                    let life = self.coord_life;
                    self.after(after, Ev::RunTimer { run, timer, life });
                }
                Output::Event(RunEvent::Token { pos, token, .. }) => {
                    let r = &mut self.runs[run];
                    let i = r.streamed.len();
                    let want = r.reference.get(i).copied();
                    let at = r.spec.prompt.len() + i;
                    if want != Some(token) || pos != at {
                        let what = format!(
                            "request {run} streamed token {token} at position {pos}; the \
                             fault-free run has {want:?} at {at}"
                        );
                        return Err(self.violation(what));
                    }
                    r.streamed.push(token);
                }
                Output::Event(_) | Output::Refused { .. } => {}
                Output::Done(outcome) => {
                    self.book.unseat(run as u64);
                    let r = &mut self.runs[run];
                    r.awaiting = None;
                    r.epoch = None;
                    match outcome.reason {
                        FinishReason::Error => {
                            if outcome.error.as_deref().is_none_or(str::is_empty) {
                                return Err(self.violation(format!(
                                    "request {run} failed without saying why"
                                )));
                            }
                            r.ended = Some(Err(outcome.error.unwrap_or_default()));
                            self.summary.errors += 1;
                        }
                        FinishReason::Cancelled => {
                            return Err(self.violation(format!(
                                "request {run} was cancelled, and nobody cancelled it"
                            )));
                        }
                        FinishReason::Length | FinishReason::EndOfGeneration => {
                            if r.streamed != r.reference || outcome.generated != r.reference {
                                let what = format!(
                                    "request {run} ended ({:?}) with {:?}; the fault-free run \
                                     gives {:?}",
                                    outcome.reason, outcome.generated, r.reference
                                );
                                return Err(self.violation(what));
                            }
                            r.ended = Some(Ok(()));
                            self.summary.completed += 1;
                        }
                    }
                }
            }
        }
        for input in follow {
            self.run_input(run, input)?;
        }
        // A run asking for an epoch may find one ready now.
        if self.runs[run].awaiting.is_some() {
            self.epochs_changed()?;
        }
        self.release_drained()
    }

    /// Releases a draining epoch no run is seated on any more, as the driver does.
    fn release_drained(&mut self) -> Result<(), Violation> {
        let drained = self
            .membership
            .draining()
            .iter()
            .map(|e| e.id)
            .find(|&e| self.book.seated(e) == 0);
        match drained {
            Some(epoch) => {
                self.summary.drained += 1;
                self.membership_event(Event::Drained { epoch })
            }
            None => Ok(()),
        }
    }

    // ---- invariants ----------------------------------------------------------------------
}
