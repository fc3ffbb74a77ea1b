//! Driving generations: a client's control session, and one generation over the ring.
//!
//! For a [`RunRequest`] the driver makes sure an epoch with the requested placement is ready
//! (planning a new one if needed and waiting for every stage to load and link), tokenizes the
//! prompt, opens the sequence on every stage, starts the first stage, and relays what the last
//! stage reports — each token, as text, to the client — until the sequence finishes. Then it
//! closes the sequence everywhere (each stage frees its KV cache and reports its traffic and
//! time) and sends the client a [`RunReport`].
//!
//! **Surviving failures.** The driver keeps every run's prompt, sampling parameters and the
//! tokens it has streamed. When the run's epoch is lost (a stage node declared gone, or a better
//! plan replacing it) the client is sent [`CoordToClient::Paused`]; once the membership has a
//! new ready epoch the run is opened there under a fresh stage-side id with prompt + generated
//! as its prompt and the remaining token budget, [`CoordToClient::Resumed`] is sent, and the
//! stream goes on. Sampling draws depend only on (seed, position) and the last stage's history
//! is the same, so the continuation is exactly the one the run would have had.
//!
//! Tokens travel the ring directly: the last stage sends each sampled token to the first stage
//! *and* to the coordinator. Routing it through the coordinator instead would add a hop per
//! token (two on different hosts) to the critical path; the coordinator only observes.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_model::StreamDecoder;
use tessera_net::{Connection, FramedStream, NodeId};
use tessera_node::protocol::{
    frame, BoundaryReport, ClientToCoord, CoordToClient, CoordToNode, FinishReason, NodeToCoord,
    OpenSeq, RunReport, RunRequest, StagePlacement, StageSeqStats, StageSpec, PROTOCOL_VERSION,
};
use tokio::sync::mpsc;

use crate::assignment::{resolve, Candidate};
use crate::error::CoordError;
use crate::membership::{Event, Membership, Phase};
use crate::server::{member_status, EpochStatus, Shared};

/// How long a new epoch may take to load (model transfer included) and link.
const EPOCH_TIMEOUT: Duration = Duration::from_secs(600);
/// How long stages may take to open a sequence.
const OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest silence between two events of a running sequence.
const STEP_TIMEOUT: Duration = Duration::from_secs(300);
/// How long stages may take to report a closed sequence.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connected members as placement candidates, in join order.
pub(crate) fn candidates(m: &Membership) -> Vec<Candidate> {
    m.connected()
        .into_iter()
        .map(|m| Candidate {
            node_id: m.node_id,
            name: m.name.clone(),
        })
        .collect()
}

pub(crate) async fn client_session(
    shared: Arc<Shared>,
    conn: Connection,
    s: FramedStream,
) -> Result<(), CoordError> {
    let FramedStream {
        mut reader,
        mut writer,
        ..
    } = s;
    let (tx, mut rx) = mpsc::unbounded_channel::<CoordToClient>();
    let _ = tx.send(CoordToClient::Welcome {
        protocol_version: PROTOCOL_VERSION,
        coordinator: shared.id,
        observed_addr: conn.remote_addr(),
    });
    let writer_task = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if writer.write_message(frame::MSG, &m).await.is_err() {
                break;
            }
        }
        let _ = writer.finish().await;
    });
    let mut mine: Vec<u64> = Vec::new();
    let result = async {
        while let Some(f) = reader.read_frame().await? {
            if f.kind != frame::MSG {
                return Err(CoordError::Protocol(format!(
                    "unexpected frame kind {:#06x}",
                    f.kind
                )));
            }
            match f.json::<ClientToCoord>() {
                Ok(ClientToCoord::Run(req)) => {
                    let seq = shared.next_seq.fetch_add(1, Ordering::Relaxed);
                    mine.push(seq);
                    let (shared, tx) = (shared.clone(), tx.clone());
                    tokio::spawn(async move {
                        match run(&shared, seq, *req, &tx).await {
                            Ok(report) => {
                                record_metrics(&shared, &report);
                                let _ = tx.send(CoordToClient::Done(Box::new(report)));
                            }
                            Err(e) => {
                                let _ = tx.send(CoordToClient::Error {
                                    message: e.to_string(),
                                });
                            }
                        }
                    });
                }
                Ok(ClientToCoord::Cancel { seq }) => cancel(&shared, seq),
                Ok(ClientToCoord::Status) => {
                    let (members, epoch) = member_status(&shared);
                    let _ = tx.send(CoordToClient::Status { members, epoch });
                }
                Ok(ClientToCoord::Hello(_)) => {
                    let _ = tx.send(CoordToClient::Error {
                        message: "a second hello".into(),
                    });
                }
                Err(e) => {
                    // A malformed message: answer, and end this stream only.
                    let _ = tx.send(CoordToClient::Error {
                        message: e.to_string(),
                    });
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }
    .await;
    // A client that goes away cancels what it started.
    for seq in mine {
        cancel(&shared, seq);
    }
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(2), writer_task).await;
    result
}

pub(crate) fn cancel(shared: &Shared, seq: u64) {
    if let Some(r) = shared.lock().routes.get(&seq) {
        let _ = r.send((
            shared.id,
            NodeToCoord::Finished {
                seq,
                reason: FinishReason::Cancelled,
                generated: 0,
                error: None,
            },
        ));
    }
}

fn record_metrics(shared: &Shared, report: &RunReport) {
    let path = shared.config.data_dir.join("metrics.jsonl");
    let line = serde_json::to_string(report).expect("report serializes");
    let _ = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| writeln!(f, "{line}"));
}

/// The stages of a ready epoch: (node, layers, placement).
struct Placement {
    epoch: u64,
    stages: Vec<StagePlacement>,
}

/// Makes sure an epoch placing `spec` is ready; plans one if needed and waits for it.
async fn ensure_epoch(
    shared: &Shared,
    spec: Option<&Vec<StageSpec>>,
) -> Result<Placement, CoordError> {
    let n_layer = shared.model.config.n_layer;
    let wanted = {
        let st = shared.lock();
        match spec {
            Some(spec) => Some(resolve(spec, n_layer, &candidates(&st.membership))?),
            None => None,
        }
    };
    let mut rx = shared.epoch_tx.subscribe();
    // Decide and plan under one lock, so concurrent runs asking for the same placement share
    // one epoch instead of replacing each other's.
    let target = {
        let mut st = shared.lock();
        let current = st.membership.epoch().filter(|e| {
            !matches!(e.phase, Phase::Failed(_) | Phase::Released)
                && wanted.as_ref().is_none_or(|w| {
                    // Expert-only nodes (no layers) follow the ring stages of an expert split.
                    let ring: Vec<_> = e.stages.iter().filter(|s| !s.layers.is_empty()).collect();
                    w.len() == ring.len()
                        && w.iter()
                            .zip(&ring)
                            .all(|((n, l), s)| *n == s.node_id && *l == s.layers)
                })
        });
        match (current.map(|e| e.id), wanted) {
            (Some(id), _) => id,
            (None, Some(stages)) => {
                shared.apply_locked(
                    &mut st,
                    Event::Plan {
                        model: shared.server.manifest().model_hash,
                        stages,
                        n_layer,
                        max_context: shared.config.max_context,
                    },
                );
                st.membership.epoch().map(|e| e.id).unwrap_or(0)
            }
            (None, None) => {
                let failed = st.membership.epoch().and_then(|e| match &e.phase {
                    Phase::Failed(r) => Some(format!("epoch {} failed: {r}", e.id)),
                    _ => None,
                });
                return Err(CoordError::Run(
                    match (st.membership.outage().map(str::to_string), failed) {
                        (Some(why), _) | (None, Some(why)) => {
                            format!("service unavailable: {why}")
                        }
                        (None, None) => {
                            "no assignment is active: give the stages (e.g. --split 0..3,3..5)"
                                .into()
                        }
                    },
                ));
            }
        }
    };
    let deadline = tokio::time::Instant::now() + EPOCH_TIMEOUT;
    loop {
        let status = rx.borrow_and_update().clone();
        match status {
            EpochStatus::Ready(e) if e == target => break,
            EpochStatus::Failed(e, reason) if e == target => {
                return Err(CoordError::Run(format!("epoch {e} failed: {reason}")))
            }
            _ => {}
        }
        // The status may have moved on before we subscribed: look at the membership too.
        if let Some(e) = shared.lock().membership.epoch() {
            if e.id == target && e.phase == Phase::Ready {
                break;
            }
            if let (true, Phase::Failed(r)) = (e.id == target, &e.phase) {
                return Err(CoordError::Run(format!("epoch {target} failed: {r}")));
            }
        }
        if tokio::time::timeout_at(deadline, rx.changed())
            .await
            .is_err()
        {
            return Err(CoordError::Timeout(format!(
                "epoch {target} did not become ready"
            )));
        }
    }
    let st = shared.lock();
    placement_of(&st, target).ok_or_else(|| CoordError::Run("the epoch was replaced".into()))
}

/// The stages of the current epoch if it is `epoch`.
fn placement_of(st: &crate::server::State, epoch: u64) -> Option<Placement> {
    let e = st.membership.epoch().filter(|e| e.id == epoch)?;
    let stages = e
        .stages
        .iter()
        .enumerate()
        .map(|(i, s)| StagePlacement {
            stage: i,
            node_id: s.node_id,
            name: st
                .membership
                .member(&s.node_id)
                .map_or(String::new(), |m| m.name.clone()),
            layers: s.layers.clone(),
            load: s.loaded.clone().unwrap_or_default(),
            link_to_next: s.link,
        })
        .collect();
    Some(Placement { epoch, stages })
}

struct Route<'a> {
    shared: &'a Shared,
    seqs: Vec<u64>,
}

impl Drop for Route<'_> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        for s in &self.seqs {
            st.routes.remove(s);
        }
    }
}

/// How long a run whose epoch was lost waits for a new one (re-planning, loading, linking)
/// before it fails with the outage's reason.
const RESUME_TIMEOUT: Duration = Duration::from_secs(300);

/// The sequence id a node message is about (`None` for messages not about one).
fn seq_of(msg: &NodeToCoord) -> Option<u64> {
    match msg {
        NodeToCoord::Opened { seq }
        | NodeToCoord::OpenFailed { seq, .. }
        | NodeToCoord::Token { seq, .. }
        | NodeToCoord::Finished { seq, .. }
        | NodeToCoord::Closed { seq, .. } => Some(*seq),
        NodeToCoord::Trace(t) => Some(t.seq),
        _ => None,
    }
}

/// Whether `epoch` is still the membership's current, ready epoch.
fn epoch_live(shared: &Shared, epoch: u64) -> bool {
    shared
        .lock()
        .membership
        .epoch()
        .is_some_and(|e| e.id == epoch && e.phase == Phase::Ready)
}

/// How one attempt of a run on one epoch ended.
enum Attempt {
    /// The sequence finished (or failed for a reason of its own).
    Finished {
        reason: FinishReason,
        error: Option<String>,
    },
    /// The epoch was lost under it: resume on the next one.
    Interrupted(String),
}

/// Waits for an error from a stage to be explained by the loss of `epoch` (a neighbour died
/// and its lease has not yet expired): true if the epoch goes within two leases.
async fn epoch_lost_soon(shared: &Shared, epoch: u64) -> bool {
    let mut rx = shared.epoch_tx.subscribe();
    let deadline = tokio::time::Instant::now() + shared.lease() * 2;
    loop {
        if !epoch_live(shared, epoch) {
            return true;
        }
        if tokio::time::timeout_at(deadline, rx.changed())
            .await
            .is_err()
        {
            return !epoch_live(shared, epoch);
        }
    }
}

/// Completes when the run is cancelled (a `Finished { Cancelled }` from the coordinator itself
/// on its route); stale stage messages are skipped.
async fn cancelled(rx: &mut mpsc::UnboundedReceiver<(NodeId, NodeToCoord)>, me: NodeId) {
    loop {
        match rx.recv().await {
            Some((
                from,
                NodeToCoord::Finished {
                    reason: FinishReason::Cancelled,
                    ..
                },
            )) if from == me => return,
            Some(_) => {}
            None => std::future::pending::<()>().await,
        }
    }
}

/// Waits for a ready epoch other than `lost` (the membership re-plans on its own).
async fn next_epoch(shared: &Shared, lost: u64) -> Result<Placement, CoordError> {
    let mut rx = shared.epoch_tx.subscribe();
    let deadline = tokio::time::Instant::now() + RESUME_TIMEOUT;
    loop {
        rx.borrow_and_update();
        {
            let st = shared.lock();
            if let Some(e) = st.membership.epoch() {
                if e.id != lost && e.phase == Phase::Ready {
                    return Ok(placement_of(&st, e.id).expect("the epoch is current"));
                }
            }
        }
        if tokio::time::timeout_at(deadline, rx.changed())
            .await
            .is_err()
        {
            let why = shared
                .lock()
                .membership
                .outage()
                .map_or("no new epoch became ready".to_string(), str::to_string);
            return Err(CoordError::Run(format!(
                "service unavailable: the run's epoch {lost} was lost and {why} within {RESUME_TIMEOUT:?}"
            )));
        }
    }
}

/// Runs one generation; streams tokens to `client`. If the epoch it runs on is lost (a stage
/// node departs, or a better plan replaces it), the run pauses, waits for the next epoch, and
/// resumes there by re-prefilling its prompt and the tokens generated so far: sampling draws
/// depend only on (seed, position) and kernels are batch-invariant, so the continuation is the
/// one the run would have had.
pub(crate) async fn run(
    shared: &Shared,
    seq: u64,
    req: RunRequest,
    client: &mpsc::UnboundedSender<CoordToClient>,
) -> Result<RunReport, CoordError> {
    if req.max_new_tokens == 0 {
        return Err(CoordError::Run("max_new_tokens must be at least 1".into()));
    }
    let mut placement = ensure_epoch(shared, req.stages.as_ref()).await?;
    let model = &shared.model;
    let prompt = match (&req.prompt_tokens, &req.prompt) {
        (Some(t), _) => t.clone(),
        (None, Some(text)) => model.tokenizer.encode(text, true),
        (None, None) => return Err(CoordError::Run("no prompt".into())),
    };
    if prompt.is_empty() {
        return Err(CoordError::Run("the prompt is empty".into()));
    }
    if let Some(&bad) = prompt
        .iter()
        .find(|&&t| t as usize >= model.config.vocab_size)
    {
        return Err(CoordError::Run(format!(
            "token {bad} is outside the vocabulary"
        )));
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    shared.lock().routes.insert(seq, tx.clone());
    let mut route = Route {
        shared,
        seqs: vec![seq],
    };
    let eog = if req.stop_at_eog {
        model.eog.clone()
    } else {
        Vec::new()
    };
    let mut decoder = StreamDecoder::new(&model.tokenizer);
    let mut generated: Vec<u32> = Vec::new();
    let mut times: Vec<Instant> = Vec::new();
    let mut start = None;
    // The id the stages know this attempt by: the run's own at first, a fresh one for each
    // resumption (so that late messages of a lost attempt are told apart).
    let mut attempt_seq = seq;
    let (reason, mut error) = loop {
        let nodes: Vec<NodeId> = placement.stages.iter().map(|s| s.node_id).collect();
        let outcome = attempt(
            shared,
            seq,
            attempt_seq,
            &req,
            &prompt,
            &eog,
            &placement,
            &mut rx,
            &mut generated,
            &mut times,
            &mut decoder,
            &mut start,
            client,
        )
        .await?;
        match outcome {
            Attempt::Finished { reason, error } => {
                break (reason, error);
            }
            Attempt::Interrupted(why) => {
                // Whatever the lost epoch's stages still hold of it is released with the epoch;
                // a stage that is still up frees the sequence now.
                for n in &nodes {
                    shared.send(*n, CoordToNode::Close { seq: attempt_seq });
                }
                if generated.len() >= req.max_new_tokens {
                    break (FinishReason::Length, None);
                }
                eprintln!(
                    "seq {seq}: paused after {} tokens on epoch {}: {why}",
                    generated.len(),
                    placement.epoch
                );
                let _ = client.send(CoordToClient::Paused {
                    seq,
                    reason: why.clone(),
                });
                // Wait for the next epoch, or for the client to give up.
                let next = tokio::select! {
                    p = next_epoch(shared, placement.epoch) => Some(p?),
                    () = cancelled(&mut rx, shared.id) => None,
                };
                let Some(next) = next else {
                    break (FinishReason::Cancelled, None);
                };
                placement = next;
                attempt_seq = shared.next_seq.fetch_add(1, Ordering::Relaxed);
                shared.lock().routes.insert(attempt_seq, tx.clone());
                route.seqs.push(attempt_seq);
                eprintln!(
                    "seq {seq}: resuming on epoch {} after {} tokens",
                    placement.epoch,
                    generated.len()
                );
                let _ = client.send(CoordToClient::Resumed {
                    seq,
                    epoch: placement.epoch,
                    generated: generated.len(),
                });
            }
        }
    };
    let nodes: Vec<NodeId> = placement.stages.iter().map(|s| s.node_id).collect();
    let tail = decoder.finish();
    if !tail.is_empty() {
        let _ = client.send(CoordToClient::Token {
            seq,
            pos: prompt.len() + times.len(),
            token: u32::MAX,
            text: tail,
        });
    }
    let stats = close_all(shared, attempt_seq, &nodes, &mut rx, Some(client)).await;
    let start = start.unwrap_or_else(Instant::now);
    let ttft = times
        .first()
        .map_or(0.0, |t| t.duration_since(start).as_secs_f64() * 1e3);
    let decode_tokens_per_s = match (times.first(), times.last()) {
        (Some(a), Some(b)) if times.len() > 1 => {
            (times.len() - 1) as f64 / b.duration_since(*a).as_secs_f64().max(1e-9)
        }
        _ => 0.0,
    };
    let n_embd = model.config.n_embd;
    let stage_stats: Vec<StageSeqStats> = (0..nodes.len())
        .map(|i| stats.get(&i).cloned().unwrap_or_default())
        .collect();
    // The ring: stages with layers (expert-only nodes of an expert split follow them).
    let n = placement
        .stages
        .iter()
        .filter(|s| !s.layers.is_empty())
        .count();
    let boundaries = if n > 1 {
        (0..n)
            .map(|i| {
                let s = &stage_stats[i];
                BoundaryReport {
                    from: i,
                    to: (i + 1) % n,
                    decode_bytes_per_token: if s.decode.frames_sent > 0 {
                        s.decode.bytes_sent as f64 / s.decode.frames_sent as f64
                    } else {
                        0.0
                    },
                    prefill_bytes: s.prefill.bytes_sent,
                    hidden_payload_bytes: if i + 1 < n { n_embd * 4 } else { 4 },
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    let hop_latency_us = (n > 1 && stage_stats[0].ring_waits > 0).then(|| {
        let ring = stage_stats[0].ring_wait_ns as f64 / stage_stats[0].ring_waits as f64;
        let downstream: f64 = stage_stats[1..n]
            .iter()
            .map(|s| s.decode.compute_ns as f64 / s.decode.steps.max(1) as f64)
            .sum();
        ((ring - downstream) / n as f64 / 1e3).max(0.0)
    });
    if reason == FinishReason::Error && error.is_none() {
        error = Some("the sequence failed".into());
    }
    Ok(RunReport {
        seq,
        epoch: placement.epoch,
        prompt_tokens: prompt.len(),
        generated: times.len(),
        reason,
        error,
        stages: placement.stages,
        stage_stats,
        time_to_first_token_ms: ttft,
        decode_tokens_per_s,
        n_embd,
        boundaries,
        hop_latency_us,
    })
}

/// One attempt of a run on one epoch: opens the sequence (prompt plus what was generated
/// before), starts it, and relays its tokens until it finishes or the epoch is lost.
#[allow(clippy::too_many_arguments)]
async fn attempt(
    shared: &Shared,
    seq: u64,
    attempt_seq: u64,
    req: &RunRequest,
    prompt: &[u32],
    eog: &[u32],
    placement: &Placement,
    rx: &mut mpsc::UnboundedReceiver<(NodeId, NodeToCoord)>,
    generated: &mut Vec<u32>,
    times: &mut Vec<Instant>,
    decoder: &mut StreamDecoder<'_>,
    start: &mut Option<Instant>,
    client: &mpsc::UnboundedSender<CoordToClient>,
) -> Result<Attempt, CoordError> {
    let epoch = placement.epoch;
    let nodes: Vec<NodeId> = placement.stages.iter().map(|s| s.node_id).collect();
    let mut epoch_rx = shared.epoch_tx.subscribe();
    let full: Vec<u32> = prompt.iter().chain(generated.iter()).copied().collect();
    let open = OpenSeq {
        seq: attempt_seq,
        epoch,
        prompt: full,
        sampling: req.sampling.clone(),
        max_new_tokens: req.max_new_tokens - generated.len(),
        eog: eog.to_vec(),
        prefill_chunk: req.prefill_chunk.max(1),
        trace: req.trace,
    };
    if !epoch_live(shared, epoch) {
        return Ok(Attempt::Interrupted(format!("epoch {epoch} was lost")));
    }
    for n in &nodes {
        shared.send(*n, CoordToNode::Open(open.clone()));
    }
    // A message of this attempt (or a cancel from the coordinator itself); the epoch's loss.
    enum Next {
        Msg(NodeId, NodeToCoord),
        Lost,
    }
    let mut next = async |timeout: Duration, what: &str| -> Result<Next, CoordError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            tokio::select! {
                m = tokio::time::timeout_at(deadline, rx.recv()) => match m {
                    Ok(Some((from, msg))) => {
                        if from == shared.id || seq_of(&msg) == Some(attempt_seq) {
                            return Ok(Next::Msg(from, msg));
                        }
                    }
                    Ok(None) => return Err(CoordError::Run("route closed".into())),
                    Err(_) => return Err(CoordError::Timeout(what.to_string())),
                },
                r = epoch_rx.changed() => {
                    if r.is_err() || !epoch_live(shared, epoch) {
                        return Ok(Next::Lost);
                    }
                }
            }
        }
    };
    let lost = || Attempt::Interrupted(format!("epoch {epoch} was lost"));
    let mut opened = 0;
    let mut failure = None;
    while opened < nodes.len() && failure.is_none() {
        match next(OPEN_TIMEOUT, "stages opening the sequence").await? {
            Next::Lost => return Ok(lost()),
            Next::Msg(_, NodeToCoord::Opened { .. }) => opened += 1,
            Next::Msg(n, NodeToCoord::OpenFailed { reason, .. }) => {
                failure = Some(format!("node {}: {reason}", n.short()))
            }
            Next::Msg(_, NodeToCoord::Finished { error, reason, .. }) => {
                failure = Some(error.unwrap_or_else(|| reason.to_string()))
            }
            _ => {}
        }
    }
    if let Some(f) = failure {
        if epoch_lost_soon(shared, epoch).await {
            return Ok(Attempt::Interrupted(f));
        }
        close_all(shared, attempt_seq, &nodes, rx, None).await;
        return Err(CoordError::Run(f));
    }
    if start.is_none() {
        let _ = client.send(CoordToClient::Started {
            seq,
            epoch,
            prompt_tokens: prompt.to_vec(),
            stages: placement.stages.clone(),
        });
        *start = Some(Instant::now());
    }
    shared.send(nodes[0], CoordToNode::Start { seq: attempt_seq });
    loop {
        let (from, msg) = match next(STEP_TIMEOUT, "the next token").await {
            Ok(Next::Msg(from, msg)) => (from, msg),
            Ok(Next::Lost) => return Ok(lost()),
            Err(e) => {
                return Ok(Attempt::Finished {
                    reason: FinishReason::Error,
                    error: Some(e.to_string()),
                })
            }
        };
        match msg {
            NodeToCoord::Token { pos, token, .. } => {
                times.push(Instant::now());
                generated.push(token);
                let text = decoder.push(token);
                let _ = client.send(CoordToClient::Token {
                    seq,
                    pos,
                    token,
                    text,
                });
            }
            NodeToCoord::Trace(mut t) => {
                t.seq = seq;
                let _ = client.send(CoordToClient::Trace(t));
            }
            NodeToCoord::Finished {
                reason: FinishReason::Error,
                error: e,
                ..
            } if from != shared.id => {
                let e = e.map_or("the sequence failed".to_string(), |e| {
                    format!("node {}: {e}", from.short())
                });
                if epoch_lost_soon(shared, epoch).await {
                    return Ok(Attempt::Interrupted(e));
                }
                return Ok(Attempt::Finished {
                    reason: FinishReason::Error,
                    error: Some(e),
                });
            }
            NodeToCoord::Finished {
                reason: r,
                error: e,
                ..
            } => {
                return Ok(Attempt::Finished {
                    reason: r,
                    error: e.map(|e| format!("node {}: {e}", from.short())),
                });
            }
            _ => {}
        }
    }
}

/// Closes the sequence on every stage and collects their statistics, by stage index. Traces a
/// stage sent before its `Closed` (the control stream keeps order) still go to `client`.
async fn close_all(
    shared: &Shared,
    seq: u64,
    nodes: &[NodeId],
    rx: &mut mpsc::UnboundedReceiver<(NodeId, NodeToCoord)>,
    client: Option<&mpsc::UnboundedSender<CoordToClient>>,
) -> HashMap<usize, StageSeqStats> {
    let mut out = HashMap::new();
    let mut expected = 0;
    for n in nodes {
        if shared.send(*n, CoordToNode::Close { seq }) {
            expected += 1;
        }
    }
    let deadline = tokio::time::Instant::now() + CLOSE_TIMEOUT;
    while out.len() < expected {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some((_, NodeToCoord::Closed { stats, .. }))) => {
                out.insert(stats.stage, stats);
            }
            Ok(Some((_, NodeToCoord::Trace(t)))) => {
                if let Some(c) = client {
                    let _ = c.send(CoordToClient::Trace(t));
                }
            }
            Ok(Some(_)) => {}
            _ => break,
        }
    }
    out
}
