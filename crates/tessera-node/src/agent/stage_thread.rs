//! The stage thread: it receives [`WorkerMsg`]s and applies them to the current [`Stage`] in
//! order, batching queued tokens or hidden states of different sequences into one step, and
//! routes the stage's outputs to the ring and the coordinator.

use std::time::Instant;

use tokio::sync::mpsc;

use crate::protocol::{frame, FinishReason, NodeToCoord, OpenSeq, RingToken, StepHeader};
use crate::stage::{Stage, StageOutput};

use super::hop_ledger::{is_decode, wall_ns, Arrival, HopLedger};
use super::ring::RingOut;

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

/// The stage thread: applies messages to the current [`Stage`] in order. Tokens (first stage)
/// or hidden states (other stages) of different sequences that are queued together run as one
/// batch: one forward pass and one frame on to the next stage. Kernels are batch-invariant, so
/// every sequence gets the bits it would get alone.
pub(super) fn worker_loop(
    mut rx: mpsc::UnboundedReceiver<WorkerMsg>,
    me: mpsc::WeakUnboundedSender<WorkerMsg>,
    ctrl: mpsc::UnboundedSender<NodeToCoord>,
) {
    let mut stage: Option<Stage> = None;
    let mut ring: Option<RingOut> = None;
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
            WorkerMsg::Install(s) => {
                stage = Some(*s);
                ring = None;
                ledger.clear();
            }
            WorkerMsg::Release(epoch) => {
                if stage
                    .as_ref()
                    .is_some_and(|s| s.assignment().epoch == epoch)
                {
                    stage = None;
                    ring = None;
                    ledger.clear();
                }
            }
            WorkerMsg::Experts(epoch, peers) => {
                if let Some(s) = stage.as_mut().filter(|s| s.assignment().epoch == epoch) {
                    s.set_remote_experts(peers);
                }
            }
            WorkerMsg::Ring(epoch, r) => {
                if stage
                    .as_ref()
                    .is_some_and(|s| s.assignment().epoch == epoch)
                {
                    ring = Some(r);
                }
            }
            WorkerMsg::Open(o) => {
                let seq = o.seq;
                let reply = match stage.as_mut() {
                    Some(s) if s.assignment().epoch == o.epoch => match s.open(o) {
                        Ok(cached) => NodeToCoord::Opened { seq, cached },
                        Err(e) => NodeToCoord::OpenFailed {
                            seq,
                            reason: e.to_string(),
                        },
                    },
                    _ => NodeToCoord::OpenFailed {
                        seq,
                        reason: format!("no stage loaded for epoch {}", o.epoch),
                    },
                };
                let _ = ctrl.send(reply);
            }
            WorkerMsg::Close(seq, keep) => {
                let mut stats = stage
                    .as_mut()
                    .and_then(|s| s.close(seq, &keep))
                    .unwrap_or_default();
                stats.hop = Box::new(ledger.take(seq));
                let _ = ctrl.send(NodeToCoord::Closed { seq, stats });
            }
            WorkerMsg::Start(seq, reuse) => {
                let Some(s) = stage.as_mut() else {
                    fail(seq, &"no stage loaded");
                    continue;
                };
                let mut sink = sink(&mut ring, &mut ledger, &me, &ctrl);
                if let Err(e) = s.start(seq, reuse, &mut sink) {
                    fail(seq, &e);
                }
            }
            WorkerMsg::Token(t, a) => {
                if let Some(a) = a {
                    ledger.arrived(&[t.seq], &a, Instant::now());
                }
                let mut batch = vec![t];
                while batch.len() < MAX_BATCH {
                    match next_ready(&mut pending) {
                        Some(WorkerMsg::Token(t, a)) if !batch.iter().any(|b| b.seq == t.seq) => {
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
                let Some(s) = stage.as_mut() else { continue };
                let mut sink = sink(&mut ring, &mut ledger, &me, &ctrl);
                for (seq, e) in s.handle_tokens(batch, &mut sink) {
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
                while h.entries.len() < MAX_BATCH {
                    match next_ready(&mut pending) {
                        Some(WorkerMsg::Hidden(h2, d2, a2))
                            if h2.n_embd == h.n_embd
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
                let Some(s) = stage.as_mut() else { continue };
                let seqs: Vec<u64> = h.entries.iter().map(|e| e.seq).collect();
                let mut sink = sink(&mut ring, &mut ledger, &me, &ctrl);
                match s.handle_hidden(h, d, &mut sink) {
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
            let sent = match ring.as_mut() {
                Some(RingOut::Loopback) => me
                    .upgrade()
                    .is_some_and(|me| me.send(WorkerMsg::Token(t, None)).is_ok()),
                Some(r @ RingOut::Stream(..)) => {
                    let t0 = Instant::now();
                    let payload = t.encode().to_vec();
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
                let _ = ctrl.send(unlinked(t.seq, "first"));
            }
        }
    }
}
