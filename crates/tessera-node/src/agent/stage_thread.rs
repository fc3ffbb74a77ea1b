//! The stage thread: it receives [`WorkerMsg`]s and applies them in order to the [`Stage`] of
//! the epoch each sequence was opened on (two while a new split is switched to), batching
//! queued tokens or hidden states of different sequences into one step, and routes the stage's
//! outputs to the ring and the coordinator.

use std::time::Instant;

use tokio::sync::mpsc;

use crate::stage::{Stage, StageOutput};
use tessera_proto::{frame, FinishReason, NodeToCoord, OpenSeq, RingToken, StepHeader};

use super::hop_ledger::{is_decode, wall_ns, Arrival, HopLedger};
use super::ring_out::RingOut;

/// Messages for the stage thread.
pub(super) enum WorkerMsg {
    Install(Box<Stage>),
    Release(u64),
    Ring(u64, RingOut),
    Open(OpenSeq),
    /// Start a sequence at this many reused positions.
    Start(u64, usize),
    /// Close a sequence, keeping its cache for the tokens given (none: free it).
    Close(u64, Vec<u32>),
    /// From the previous stage (with how it arrived; none when it did not cross a hop).
    Hidden(StepHeader, Vec<f32>, Option<Arrival>),
    Token(RingToken, Option<Arrival>),
    /// Expert split: the links to the workers owning the rest of this stage's experts.
    Experts(u64, crate::expert::RemotePeers),
}

/// Most sequences the stage thread puts in one step.
const MAX_BATCH: usize = 64;

// A third install drops the oldest held stage (the epoch machine releases it first; this keeps
// the thread's own bound).
use super::epochs::MAX_EPOCHS;

/// One epoch's loaded stage and where its ring outputs go.
struct Held {
    stage: Stage,
    ring: Option<RingOut>,
}

/// The stages this node holds, by epoch, and which epoch each open sequence runs on. Two
/// epochs are held while the coordinator switches to a new split: sequences opened on the old
/// one finish there while new ones open on the new one.
#[derive(Default)]
struct Stages {
    by_epoch: std::collections::BTreeMap<u64, Held>,
    seq_epoch: std::collections::HashMap<u64, u64>,
}

impl Stages {
    /// The held epoch sequence `seq` was opened on.
    fn opened_on(&self, seq: u64) -> Option<u64> {
        self.seq_epoch
            .get(&seq)
            .copied()
            .filter(|e| self.by_epoch.contains_key(e))
    }

    /// [`Stages::opened_on`], else the newest held (whose stage then refuses the unknown
    /// sequence, as a single stage did).
    fn epoch_for(&self, seq: u64) -> Option<u64> {
        self.opened_on(seq)
            .or_else(|| self.by_epoch.keys().next_back().copied())
    }

    /// Whether work for `next` may join a batch led by `first`: both open on the same epoch.
    /// (A sequence open nowhere, such as a released epoch's frame still in flight, runs
    /// alone, so that its refusal fails only itself.)
    fn batchable(&self, first: u64, next: u64) -> bool {
        self.opened_on(first)
            .is_some_and(|e| self.opened_on(next) == Some(e))
    }

    fn install(&mut self, stage: Stage) {
        let epoch = stage.assignment().epoch;
        self.by_epoch.insert(epoch, Held { stage, ring: None });
        while self.by_epoch.len() > MAX_EPOCHS {
            if let Some((old, _)) = self.by_epoch.pop_first() {
                tracing::warn!("dropping the stage of epoch {old}: a third epoch was installed");
                self.forget(old);
            }
        }
    }

    fn release(&mut self, epoch: u64) -> bool {
        let held = self.by_epoch.remove(&epoch).is_some();
        self.forget(epoch);
        held
    }

    fn forget(&mut self, epoch: u64) {
        self.seq_epoch.retain(|_, e| *e != epoch);
    }
}

/// The stage thread: applies messages to the stage of the sequence's epoch, in order. Tokens
/// (first stage) or hidden states (other stages) of different sequences of one epoch that are
/// queued together run as one batch: one forward pass and one frame on to the next stage.
/// Kernels are batch-invariant, so every sequence gets the bits it would get alone.
pub(super) fn worker_loop(
    mut rx: mpsc::UnboundedReceiver<WorkerMsg>,
    me: mpsc::WeakUnboundedSender<WorkerMsg>,
    ctrl: mpsc::UnboundedSender<NodeToCoord>,
) {
    let mut stages = Stages::default();
    let mut pending: std::collections::VecDeque<WorkerMsg> = std::collections::VecDeque::new();
    let mut ledger = HopLedger::default();
    let fail = |seq: u64, e: &dyn std::fmt::Display| {
        let _ = ctrl.send(NodeToCoord::Finished {
            seq,
            reason: FinishReason::Error,
            generated: 0,
            error: Some(e.to_string()),
        });
    };
    loop {
        let msg = match pending.pop_front() {
            Some(m) => m,
            None => match rx.blocking_recv() {
                Some(m) => m,
                None => break,
            },
        };
        // The next message already queued, without waiting.
        let mut next_ready = |pending: &mut std::collections::VecDeque<WorkerMsg>| {
            pending.pop_front().or_else(|| rx.try_recv().ok())
        };
        match msg {
            WorkerMsg::Install(s) => stages.install(*s),
            WorkerMsg::Release(epoch) => {
                if stages.release(epoch) && stages.by_epoch.is_empty() {
                    ledger.clear();
                }
            }
            WorkerMsg::Experts(epoch, peers) => {
                if let Some(h) = stages.by_epoch.get_mut(&epoch) {
                    h.stage.set_remote_experts(peers);
                }
            }
            WorkerMsg::Ring(epoch, r) => {
                if let Some(h) = stages.by_epoch.get_mut(&epoch) {
                    h.ring = Some(r);
                }
            }
            WorkerMsg::Open(o) => {
                let (seq, epoch) = (o.seq, o.epoch);
                let reply = match stages.by_epoch.get_mut(&epoch) {
                    Some(h) => match h.stage.open(o) {
                        Ok(cached) => {
                            stages.seq_epoch.insert(seq, epoch);
                            NodeToCoord::Opened { seq, cached }
                        }
                        Err(e) => NodeToCoord::OpenFailed {
                            seq,
                            reason: e.to_string(),
                        },
                    },
                    None => NodeToCoord::OpenFailed {
                        seq,
                        reason: format!("no stage loaded for epoch {epoch}"),
                    },
                };
                let _ = ctrl.send(reply);
            }
            WorkerMsg::Close(seq, keep) => {
                let held = stages.epoch_for(seq);
                stages.seq_epoch.remove(&seq);
                let mut stats = held
                    .and_then(|e| stages.by_epoch.get_mut(&e))
                    .and_then(|h| h.stage.close(seq, &keep))
                    .unwrap_or_default();
                stats.hop = Box::new(ledger.take(seq));
                let _ = ctrl.send(NodeToCoord::Closed {
                    seq,
                    stats: Box::new(stats),
                });
            }
            WorkerMsg::Start(seq, reuse) => {
                let Some(h) = stages
                    .epoch_for(seq)
                    .and_then(|e| stages.by_epoch.get_mut(&e))
                else {
                    fail(seq, &"no stage loaded");
                    continue;
                };
                let mut sink = sink(&mut h.ring, &mut ledger, &me, &ctrl);
                if let Err(e) = h.stage.start(seq, reuse, &mut sink) {
                    fail(seq, &e);
                }
            }
            WorkerMsg::Token(t, a) => {
                if let Some(a) = a {
                    ledger.arrived(&[t.seq], &a, Instant::now());
                }
                let epoch = stages.epoch_for(t.seq);
                let lead = t.seq;
                let mut batch = vec![t];
                while batch.len() < MAX_BATCH {
                    match next_ready(&mut pending) {
                        Some(WorkerMsg::Token(t, a))
                            if !batch.iter().any(|b| b.seq == t.seq)
                                && stages.batchable(lead, t.seq) =>
                        {
                            if let Some(a) = a {
                                ledger.arrived(&[t.seq], &a, Instant::now());
                            }
                            batch.push(t)
                        }
                        Some(other) => {
                            pending.push_front(other);
                            break;
                        }
                        None => break,
                    }
                }
                let Some(h) = epoch.and_then(|e| stages.by_epoch.get_mut(&e)) else {
                    continue;
                };
                let mut sink = sink(&mut h.ring, &mut ledger, &me, &ctrl);
                for (seq, e) in h.stage.handle_tokens(batch, &mut sink) {
                    fail(seq, &e);
                }
            }
            WorkerMsg::Hidden(mut h, mut d, a) => {
                let mut arrived = |h: &StepHeader, a: Option<Arrival>| {
                    if let Some(a) = a.filter(|_| is_decode(&h.entries)) {
                        let seqs: Vec<u64> = h.entries.iter().map(|e| e.seq).collect();
                        ledger.arrived(&seqs, &a, Instant::now());
                    }
                };
                arrived(&h, a);
                let lead = h.entries.first().map_or(0, |e| e.seq);
                let epoch = stages.epoch_for(lead);
                while h.entries.len() < MAX_BATCH {
                    match next_ready(&mut pending) {
                        Some(WorkerMsg::Hidden(h2, d2, a2))
                            if h2.n_embd == h.n_embd
                                && h2.entries.iter().all(|e| stages.batchable(lead, e.seq))
                                && !h2
                                    .entries
                                    .iter()
                                    .any(|e| h.entries.iter().any(|x| x.seq == e.seq)) =>
                        {
                            arrived(&h2, a2);
                            h.entries.extend(h2.entries);
                            d.extend(d2);
                        }
                        Some(other) => {
                            pending.push_front(other);
                            break;
                        }
                        None => break,
                    }
                }
                let Some(held) = epoch.and_then(|e| stages.by_epoch.get_mut(&e)) else {
                    continue;
                };
                let seqs: Vec<u64> = h.entries.iter().map(|e| e.seq).collect();
                let mut sink = sink(&mut held.ring, &mut ledger, &me, &ctrl);
                match held.stage.handle_hidden(h, d, &mut sink) {
                    Ok(()) => {}
                    // A closed sequence's state still in flight (after a cancel).
                    Err(crate::stage::StageError::UnknownSeq(_)) if seqs.len() == 1 => {}
                    Err(e) => {
                        for seq in seqs {
                            fail(seq, &e);
                        }
                    }
                }
            }
        }
    }
}

/// Routes a stage's outputs: hidden states and tokens to the ring (decode frames timed in
/// `ledger`), messages to the coordinator.
fn sink<'a>(
    ring: &'a mut Option<RingOut>,
    ledger: &'a mut HopLedger,
    me: &'a mpsc::WeakUnboundedSender<WorkerMsg>,
    ctrl: &'a mpsc::UnboundedSender<NodeToCoord>,
) -> impl FnMut(StageOutput) + 'a {
    let unlinked = |seq: u64, what: &str| NodeToCoord::Finished {
        seq,
        reason: FinishReason::Error,
        generated: 0,
        error: Some(format!("this stage is not linked to the {what} stage")),
    };
    move |o| match o {
        StageOutput::Control(m) => {
            let _ = ctrl.send(m);
        }
        StageOutput::Hidden(h, d) => {
            let sent = match ring.as_mut() {
                Some(r @ RingOut::Stream(..)) => {
                    let t0 = Instant::now();
                    let payload = h.encode_with(&d);
                    let (t1, wall) = (Instant::now(), wall_ns());
                    let sent = r.send(frame::HIDDEN, payload);
                    if sent && is_decode(&h.entries) {
                        let seqs: Vec<u64> = h.entries.iter().map(|e| e.seq).collect();
                        ledger.sent(&seqs, t1 - t0, t1.elapsed(), wall);
                    }
                    sent
                }
                _ => false,
            };
            if !sent {
                let _ = ctrl.send(unlinked(h.entries[0].seq, "next"));
            }
        }
        StageOutput::Token(t) => {
            let seq = t.seq;
            let sent = match ring.as_mut() {
                Some(RingOut::Loopback) => me
                    .upgrade()
                    .is_some_and(|me| me.send(WorkerMsg::Token(t, None)).is_ok()),
                Some(r @ RingOut::Stream(..)) => {
                    let t0 = Instant::now();
                    let payload = t.encode();
                    let (t1, wall) = (Instant::now(), wall_ns());
                    let sent = r.send(frame::TOKEN, payload);
                    if sent {
                        ledger.sent(&[t.seq], t1 - t0, t1.elapsed(), wall);
                    }
                    sent
                }
                None => false,
            };
            if !sent {
                let _ = ctrl.send(unlinked(seq, "first"));
            }
        }
    }
}
