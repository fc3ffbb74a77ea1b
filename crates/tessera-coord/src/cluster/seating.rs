//! Seating: after the cells or the seats change, runs whose epoch is gone hear it, runs
//! waiting are seated where a cell is ready and has room (or refused when none is coming),
//! and a draining epoch nobody is seated on any more is released.

use super::*;
use crate::cells::{choose, NoCell};
use crate::run::Placement;

impl Cluster {
    /// After cells or seats changed: runs whose epoch is gone hear it, runs waiting are seated
    /// where they can be, and a draining epoch nobody is seated on any more is released. Not
    /// run for a token (nothing changes then).
    pub(super) fn settle(&mut self, now: Duration, out: &mut Vec<ClusterOutput>) {
        while std::mem::take(&mut self.unsettled) {
            let mut ids: Vec<u64> = self.runs.keys().copied().collect();
            ids.sort_unstable();
            for run in ids {
                self.settle_run(now, run, out);
            }
            self.release_drained(out);
        }
    }

    pub(super) fn settle_run(&mut self, now: Duration, run: u64, out: &mut Vec<ClusterOutput>) {
        let Some(r) = self.runs.get(&run) else {
            return;
        };
        let positions = r.positions;
        match &r.state {
            RunState::Placing {
                target: Some(t), ..
            } => {
                let t = *t;
                let phase = self.membership.epoch_with_id(t).map(|e| e.phase.clone());
                match phase {
                    Some(Phase::Ready) => {
                        self.cells.seat(run, t, positions);
                        self.generation += 1;
                        match Placement::of(&self.membership, t) {
                            Some(p) => self.start(now, run, p, out),
                            None => self.refuse_run(
                                run,
                                RunRefused::Unavailable(Unavailable::EpochReplaced(None)),
                                out,
                            ),
                        }
                    }
                    Some(Phase::Failed(r)) => self.refuse_run(
                        run,
                        RunRefused::Unavailable(Unavailable::EpochFailed {
                            epoch: t,
                            why: r.clone(),
                        }),
                        out,
                    ),
                    Some(Phase::Released) | None => self.refuse_run(
                        run,
                        RunRefused::Unavailable(Unavailable::EpochReplaced(Some(t))),
                        out,
                    ),
                    Some(Phase::Loading | Phase::Linking) => {}
                }
            }
            RunState::Placing { target: None, .. } => match self.take_cell(run, positions, None) {
                Ok(p) => self.start(now, run, p, out),
                Err(NoCell::NoneReady) => {
                    if let Some(why) = self.unavailable() {
                        self.refuse_run(run, RunRefused::Unavailable(why), out);
                    }
                }
                Err(NoCell::NoneFits { .. }) => {}
                Err(e @ NoCell::TooBig { .. }) => {
                    self.refuse_run(run, RunRefused::Unavailable(Unavailable::NoCell(e)), out)
                }
            },
            RunState::Running {
                on_epoch: Some(e), ..
            } => {
                let e = *e;
                if !self.membership.serves(e) {
                    if let Some(Run {
                        state: RunState::Running { on_epoch, .. },
                        ..
                    }) = self.runs.get_mut(&run)
                    {
                        *on_epoch = None;
                    }
                    let why = format!("epoch {e} was lost");
                    self.run_input(now, run, Input::EpochLost { epoch: e, why }, out);
                }
            }
            RunState::Running {
                awaiting: Some(lost),
                ..
            } => {
                let lost = *lost;
                if let Ok(placement) = self.take_cell(run, positions, lost) {
                    let r = self.runs.get_mut(&run).expect("checked");
                    r.attempts += 1;
                    let attempt_seq = run | (r.attempts << ATTEMPT_SHIFT);
                    if let RunState::Running {
                        awaiting, on_epoch, ..
                    } = &mut r.state
                    {
                        *awaiting = None;
                        *on_epoch = Some(placement.epoch);
                    }
                    self.routes.insert(attempt_seq, run);
                    self.run_input(
                        now,
                        run,
                        Input::EpochReady {
                            placement,
                            attempt_seq,
                        },
                        out,
                    );
                }
            }
            RunState::Running { .. } => {}
        }
    }

    /// Chooses a ready cell for run `run` (never `exclude`, the cell it was lost on) and seats
    /// it there ([`crate::cells`]).
    pub(super) fn take_cell(
        &mut self,
        run: u64,
        positions: u64,
        exclude: Option<u64>,
    ) -> Result<Placement, NoCell> {
        let loads = self.cells.loads(&self.membership);
        let epoch = choose(&loads, positions, self.kv_bytes(), exclude)?;
        self.cells.seat(run, epoch, positions);
        self.generation += 1;
        // A resumed run may have been the last on a draining epoch.
        self.unsettled = true;
        Placement::of(&self.membership, epoch).ok_or(NoCell::NoneReady)
    }

    /// Makes run `run`'s machine and starts its first attempt on `placement`.
    pub(super) fn start(
        &mut self,
        now: Duration,
        run: u64,
        placement: Placement,
        out: &mut Vec<ClusterOutput>,
    ) {
        let r = self.runs.get_mut(&run).expect("a placing run");
        let RunState::Placing { spec, .. } = &r.state else {
            return;
        };
        let (mut machine, first) = RunMachine::new((**spec).clone(), self.lease);
        if let Some(f) = self.fault {
            machine.inject_fault(f);
        }
        debug_assert!(matches!(first[..], [Output::AwaitEpoch { lost: None }]));
        r.state = RunState::Running {
            machine: Box::new(machine),
            awaiting: None,
            on_epoch: Some(placement.epoch),
        };
        self.timers.disarm(TimerKey::Placement(run));
        self.routes.insert(run, run);
        self.run_input(
            now,
            run,
            Input::EpochReady {
                placement,
                attempt_seq: run,
            },
            out,
        );
    }

    /// Releases the draining epochs no run is seated on any more (make before break: a new
    /// split took their cell, and their last runs ended).
    pub(super) fn release_drained(&mut self, out: &mut Vec<ClusterOutput>) {
        let drained = self
            .membership
            .draining()
            .iter()
            .map(|e| e.id)
            .find(|&e| self.cells.seated(e) == 0);
        if let Some(epoch) = drained {
            tracing::info!(
                event = "epoch_drained",
                epoch,
                "epoch {epoch} drained: releasing it"
            );
            self.drained += 1;
            // Applying it changes the cells: the next pass looks for the next.
            self.apply(Event::Drained { epoch }, out);
        }
    }
}
