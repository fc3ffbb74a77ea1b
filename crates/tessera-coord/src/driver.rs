//! Driving generations: a client's control session, and one generation over the ring.
//!
//! For a [`RunRequest`] the driver makes sure an epoch with the requested placement is ready
//! (planning a new one if needed and waiting for every stage to load and link), tokenizes the
//! prompt, opens the sequence on every stage, starts the first stage, and relays what the last
//! stage reports — each token, as text, to the client — until the sequence finishes. Then it
//! closes the sequence everywhere (each stage frees its KV cache and reports its traffic and
//! time) and sends the client a [`RunReport`].
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

fn cancel(shared: &Shared, seq: u64) {
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
                    w.len() == e.stages.len()
                        && w.iter()
                            .zip(&e.stages)
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
                return Err(CoordError::Run(
                    "no assignment is active: give the stages (e.g. --split 0..3,3..5)".into(),
                ))
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
    let e = st
        .membership
        .epoch()
        .filter(|e| e.id == target)
        .ok_or_else(|| CoordError::Run("the epoch was replaced".into()))?;
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
    Ok(Placement {
        epoch: target,
        stages,
    })
}

struct Route<'a> {
    shared: &'a Shared,
    seq: u64,
}

impl Drop for Route<'_> {
    fn drop(&mut self) {
        self.shared.lock().routes.remove(&self.seq);
    }
}

async fn recv(
    rx: &mut mpsc::UnboundedReceiver<(NodeId, NodeToCoord)>,
    timeout: Duration,
    what: &str,
) -> Result<(NodeId, NodeToCoord), CoordError> {
    match tokio::time::timeout(timeout, rx.recv()).await {
        Ok(Some(m)) => Ok(m),
        Ok(None) => Err(CoordError::Run("route closed".into())),
        Err(_) => Err(CoordError::Timeout(what.to_string())),
    }
}

/// Runs one generation; streams tokens to `client`.
async fn run(
    shared: &Shared,
    seq: u64,
    req: RunRequest,
    client: &mpsc::UnboundedSender<CoordToClient>,
) -> Result<RunReport, CoordError> {
    if req.max_new_tokens == 0 {
        return Err(CoordError::Run("max_new_tokens must be at least 1".into()));
    }
    let placement = ensure_epoch(shared, req.stages.as_ref()).await?;
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
    let nodes: Vec<NodeId> = placement.stages.iter().map(|s| s.node_id).collect();
    let (tx, mut rx) = mpsc::unbounded_channel();
    shared.lock().routes.insert(seq, tx);
    let _route = Route { shared, seq };
    let open = OpenSeq {
        seq,
        epoch: placement.epoch,
        prompt: prompt.clone(),
        sampling: req.sampling.clone(),
        max_new_tokens: req.max_new_tokens,
        eog: if req.stop_at_eog {
            model.eog.clone()
        } else {
            Vec::new()
        },
        prefill_chunk: req.prefill_chunk.max(1),
        trace: req.trace,
    };
    for n in &nodes {
        shared.send(*n, CoordToNode::Open(open.clone()));
    }
    let mut opened = 0;
    let mut failure = None;
    while opened + usize::from(failure.is_some()) < nodes.len() && failure.is_none() {
        match recv(&mut rx, OPEN_TIMEOUT, "stages opening the sequence").await? {
            (_, NodeToCoord::Opened { .. }) => opened += 1,
            (n, NodeToCoord::OpenFailed { reason, .. }) => {
                failure = Some(format!("node {}: {reason}", n.short()))
            }
            (_, NodeToCoord::Finished { error, reason, .. }) => {
                failure = Some(error.unwrap_or_else(|| reason.to_string()))
            }
            _ => {}
        }
    }
    if let Some(f) = failure {
        close_all(shared, seq, &nodes, &mut rx, None).await;
        return Err(CoordError::Run(f));
    }
    let _ = client.send(CoordToClient::Started {
        seq,
        epoch: placement.epoch,
        prompt_tokens: prompt.clone(),
        stages: placement.stages.clone(),
    });
    let start = Instant::now();
    shared.send(nodes[0], CoordToNode::Start { seq });
    let mut decoder = StreamDecoder::new(&model.tokenizer);
    let mut times: Vec<Instant> = Vec::new();
    let mut reason = FinishReason::Error;
    let mut error;
    loop {
        let (from, msg) = match recv(&mut rx, STEP_TIMEOUT, "the next token").await {
            Ok(m) => m,
            Err(e) => {
                error = Some(e.to_string());
                break;
            }
        };
        match msg {
            NodeToCoord::Token { pos, token, .. } => {
                times.push(Instant::now());
                let text = decoder.push(token);
                let _ = client.send(CoordToClient::Token {
                    seq,
                    pos,
                    token,
                    text,
                });
            }
            NodeToCoord::Trace(t) => {
                let _ = client.send(CoordToClient::Trace(t));
            }
            NodeToCoord::Finished {
                reason: r,
                error: e,
                ..
            } => {
                reason = r;
                error = e.map(|e| format!("node {}: {e}", from.short()));
                break;
            }
            _ => {}
        }
    }
    let tail = decoder.finish();
    if !tail.is_empty() {
        let _ = client.send(CoordToClient::Token {
            seq,
            pos: prompt.len() + times.len(),
            token: u32::MAX,
            text: tail,
        });
    }
    let stats = close_all(shared, seq, &nodes, &mut rx, Some(client)).await;
    let ttft = times
        .first()
        .map_or(0.0, |t| t.duration_since(start).as_secs_f64() * 1e3);
    let decode_tokens_per_s = match (times.first(), times.last()) {
        (Some(a), Some(b)) if times.len() > 1 => {
            (times.len() - 1) as f64 / b.duration_since(*a).as_secs_f64().max(1e-9)
        }
        _ => 0.0,
    };
    let n = nodes.len();
    let n_embd = model.config.n_embd;
    let stage_stats: Vec<StageSeqStats> = (0..n)
        .map(|i| stats.get(&i).cloned().unwrap_or_default())
        .collect();
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
        let downstream: f64 = stage_stats[1..]
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
