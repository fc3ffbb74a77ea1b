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

use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tessera_model::StreamDecoder;
use tessera_net::{Connection, FramedStream};
use tessera_proto::{
    frame, BoundaryReport, ClientToCoord, CoordToClient, FinishReason, RunReport, RunRequest,
    StageSeqStats, StageSpec, PROTOCOL_VERSION,
};
use tokio::sync::mpsc;

use crate::assignment::resolve;
use crate::cells::{choose, NoCell};
use crate::error::CoordError;
use crate::membership::{Event, Phase};
use crate::run::{Input, Output, Placement, RunEvent, RunMachine, RunOutcome, RunSpec, Timer};
use crate::shared::{member_status, EpochStatus, RouteMsg, Shared};

/// How long a new epoch may take to load (model transfer included) and link.
const EPOCH_TIMEOUT: Duration = Duration::from_secs(600);

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
    // This session's id at the sealed desk, from its first sealed job.
    let mut sealed_id = None;
    let mut sender = client_facts(&shared, &conn)?;
    let result = async {
        while let Some(f) = reader.read_frame().await? {
            // Rights are the key's now, not at the session's start: a revoked key's session
            // ends at its next message, and its runs are cancelled below.
            sender = match client_facts(&shared, &conn) {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx.send(CoordToClient::Error {
                        message: "this key has been revoked".into(),
                    });
                    conn.close("revoked");
                    return Err(e);
                }
            };
            if f.kind != frame::MSG {
                return Err(CoordError::Protocol(format!(
                    "unexpected frame kind {:#06x}",
                    f.kind
                )));
            }
            let parsed = f.json::<ClientToCoord>();
            if let Ok(m) = &parsed {
                if let Err(r) = shared.authz.check_client(&sender, m, &mine) {
                    let _ = tx.send(CoordToClient::Error {
                        message: r.to_string(),
                    });
                    continue;
                }
            }
            match parsed {
                Ok(ClientToCoord::Run(req)) => {
                    let Some(permit) = shared.authz.admit_run(&sender) else {
                        let _ = tx.send(CoordToClient::Error {
                            message: crate::authz::Refusal::TooManyRuns.to_string(),
                        });
                        continue;
                    };
                    let seq = shared.next_seq.fetch_add(1, Ordering::Relaxed);
                    mine.push(seq);
                    let (shared, tx) = (shared.clone(), tx.clone());
                    tokio::spawn(async move {
                        let _permit = permit;
                        let mut sink = |m| {
                            let _ = tx.send(m);
                        };
                        match run(&shared, seq, *req, true, &mut sink).await {
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
                Ok(ClientToCoord::Admin(req)) => {
                    let _ = tx.send(CoordToClient::Admin(crate::admin::handle(&shared, req)));
                }
                Ok(ClientToCoord::Holders { model }) => {
                    let holders = crate::sealed::edge::holders(&shared, model.as_deref());
                    let _ = tx.send(CoordToClient::Holders { holders });
                }
                Ok(ClientToCoord::SealedSubmit(s)) => {
                    let client = *sealed_id.get_or_insert_with(|| {
                        crate::sealed::edge::client_joined(&shared, tx.clone())
                    });
                    crate::sealed::edge::submit(&shared, client, s);
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
    if let Some(client) = sealed_id {
        crate::sealed::edge::client_left(&shared, client);
    }
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(2), writer_task).await;
    result
}

/// Cancels run `seq` (its owner gave up): an input to its machine, not a message from a node.
pub(crate) fn cancel(shared: &Shared, seq: u64) {
    if let Some(r) = shared.lock().routes.get(&seq) {
        let _ = r.send(RouteMsg::Cancel);
    }
}

/// Who a client session's peer is, from its credential.
fn client_facts(
    shared: &Shared,
    conn: &tessera_net::Connection,
) -> Result<crate::authz::SenderFacts, CoordError> {
    let grant = shared
        .enrol
        .grant_of(&conn.peer_key())
        .ok_or_else(|| CoordError::Protocol("the key is not enrolled".into()))?;
    Ok(crate::authz::SenderFacts {
        node: conn.peer_id(),
        grant,
    })
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

/// Bytes of KV cache per position per layer, as the stages hold it.
fn kv_bytes_per_position_layer(shared: &Shared, st: &crate::shared::LiveState) -> u64 {
    let shape = tessera_model::kv::KvShape::from_config(&shared.model.config);
    st.membership.kv_type().bytes_per_position(shape) as u64
}

/// Chooses a ready cell for run `seq` (never `exclude`, the cell it was lost on) and seats it
/// there ([`crate::cells`]), under one lock so that requests arriving together see each
/// other's seats.
fn take_cell(
    shared: &Shared,
    seq: u64,
    positions: u64,
    exclude: Option<u64>,
) -> Result<Placement, NoCell> {
    let mut st = shared.lock();
    let kv = kv_bytes_per_position_layer(shared, &st);
    let loads = st.cells.loads(&st.membership);
    let epoch = choose(&loads, positions, kv, exclude)?;
    st.cells.seat(seq, epoch, positions);
    // A resumed run may have been the last on a draining epoch.
    shared.release_drained(&mut st);
    Placement::of(&st.membership, epoch).ok_or(NoCell::NoneReady)
}

/// A run's seat on its cell: given up when the run ends, and the requests waiting for room
/// look again.
struct Seat<'a> {
    shared: &'a Shared,
    seq: u64,
}

impl Drop for Seat<'_> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        if st.cells.unseat(self.seq) {
            self.shared.seats_freed.notify_waiters();
            self.shared.release_drained(&mut st);
        }
    }
}

/// Why no cell can take a request now and none is coming: the refusal the client gets.
fn unavailable(st: &crate::shared::LiveState) -> Option<CoordError> {
    let m = &st.membership;
    if m.cells()
        .iter()
        .any(|e| matches!(e.phase, Phase::Loading | Phase::Linking | Phase::Ready))
    {
        return None;
    }
    let failed = m.epoch().and_then(|e| match &e.phase {
        Phase::Failed(r) => Some(format!("epoch {} failed: {r}", e.id)),
        _ => None,
    });
    Some(CoordError::Run(
        match (m.outage().map(str::to_string), failed) {
            (Some(why), _) | (None, Some(why)) => format!("service unavailable: {why}"),
            (None, None) => {
                "no assignment is active: give the stages (e.g. --split 0..3,3..5)".into()
            }
        },
    ))
}

/// Seats run `seq` on a ready cell and returns its placement: the cell placing `spec` when
/// one is given (planning it if no cell does, and waiting for it), else the cell the router
/// chooses, waiting while cells load or while none has room for `positions` of KV.
async fn ensure_epoch(
    shared: &Shared,
    spec: Option<&Vec<StageSpec>>,
    seq: u64,
    positions: u64,
) -> Result<Placement, CoordError> {
    let deadline = tokio::time::Instant::now() + EPOCH_TIMEOUT;
    let mut rx = shared.epoch_tx.subscribe();
    if let Some(spec) = spec {
        let target = plan_spec(shared, spec)?;
        wait_ready(shared, &mut rx, target, deadline).await?;
        let mut st = shared.lock();
        st.cells.seat(seq, target, positions);
        return Placement::of(&st.membership, target)
            .ok_or_else(|| CoordError::Run("the epoch was replaced".into()));
    }
    loop {
        // Armed before looking, so that a seat freed in between is not missed.
        let freed = shared.seats_freed.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        match take_cell(shared, seq, positions, None) {
            Ok(p) => return Ok(p),
            Err(NoCell::NoneReady) => {
                if let Some(e) = unavailable(&shared.lock()) {
                    return Err(e);
                }
            }
            Err(NoCell::NoneFits { .. }) => {}
            Err(e @ NoCell::TooBig { .. }) => return Err(CoordError::Run(e.to_string())),
        }
        tokio::select! {
            r = tokio::time::timeout_at(deadline, rx.changed()) => if r.is_err() {
                return Err(CoordError::Timeout(format!(
                    "no cell could take the request within {EPOCH_TIMEOUT:?}"
                )));
            },
            () = &mut freed => {}
        }
    }
}

/// The live cell whose ring is `spec`, or a new plan of it (which replaces every cell), as
/// its epoch number.
fn plan_spec(shared: &Shared, spec: &[StageSpec]) -> Result<u64, CoordError> {
    let n_layer = shared.model.config.n_layer;
    // Decide and plan under one lock, so concurrent runs asking for the same placement share
    // one epoch instead of replacing each other's.
    let mut st = shared.lock();
    let wanted = resolve(spec, n_layer, &st.membership.candidates())?;
    let current = st.membership.cells().iter().find(|e| {
        !matches!(e.phase, Phase::Failed(_) | Phase::Released) && {
            // Expert-only nodes (no layers) follow the ring stages of an expert split.
            let ring: Vec<_> = e.stages.iter().filter(|s| !s.layers.is_empty()).collect();
            wanted.len() == ring.len()
                && wanted
                    .iter()
                    .zip(&ring)
                    .all(|((n, l), s)| *n == s.node_id && *l == s.layers)
        }
    });
    if let Some(e) = current {
        return Ok(e.id);
    }
    shared.apply_locked(
        &mut st,
        Event::Plan {
            model: shared.server.manifest().model_hash,
            stages: wanted,
            n_layer,
            max_context: shared.max_context(),
        },
    );
    Ok(st.membership.epoch().map_or(0, |e| e.id))
}

/// Waits until epoch `target` is ready; its failure or replacement is the run's error.
async fn wait_ready(
    shared: &Shared,
    rx: &mut tokio::sync::watch::Receiver<Vec<EpochStatus>>,
    target: u64,
    deadline: tokio::time::Instant,
) -> Result<(), CoordError> {
    loop {
        rx.borrow_and_update();
        match shared
            .lock()
            .membership
            .epoch_with_id(target)
            .map(|e| e.phase.clone())
        {
            Some(Phase::Ready) => return Ok(()),
            Some(Phase::Failed(r)) => {
                return Err(CoordError::Run(format!("epoch {target} failed: {r}")))
            }
            Some(Phase::Released) | None => {
                return Err(CoordError::Run(format!("epoch {target} was replaced")))
            }
            Some(Phase::Loading | Phase::Linking) => {}
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
}

/// Removes a run's routes (its own id and every attempt's) when the run ends.
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

/// Whether a run on `epoch` may go on: a ready cell, or one draining after a new split took
/// its place.
fn epoch_live(shared: &Shared, epoch: u64) -> bool {
    shared.lock().membership.serves(epoch)
}

/// Runs one generation; streams tokens to `client`. The lifecycle — open, start, relay,
/// pause on a lost epoch, resume on the next, cancel, close — is [`RunMachine`]'s; this shell
/// feeds it node messages, epoch changes, cancellation and timers, and carries out what it
/// says. Text is decoded here, once, as tokens arrive.
pub(crate) async fn run(
    shared: &Shared,
    seq: u64,
    req: RunRequest,
    decode_text: bool,
    client: &mut (dyn FnMut(CoordToClient) + Send),
) -> Result<RunReport, CoordError> {
    let model = &shared.model;
    let prompt = match (&req.prompt_tokens, &req.prompt) {
        (Some(t), _) => t.clone(),
        (None, Some(text)) => model.tokenizer.encode(text, true),
        (None, None) => return Err(CoordError::Run("no prompt".into())),
    };
    let eog = if req.stop_at_eog {
        model.eog.clone()
    } else {
        Vec::new()
    };
    let mut spec = RunSpec::new(
        prompt.clone(),
        model.config.vocab_size,
        req.sampling.clone(),
        req.max_new_tokens,
        eog,
    )
    .map_err(|e| CoordError::Run(e.to_string()))?;
    spec.prefill_chunk = req.prefill_chunk.max(1);
    spec.trace = req.trace;
    if let Some(g) = &req.grammar {
        // Refused here, before any node sees it: a grammar past the limits is the client's
        // error, not a node's failure to fail over from.
        tessera_gateway::grammar::check(g, &tessera_gateway::grammar::GrammarLimits::DEFAULT)
            .map_err(|e| CoordError::Run(format!("the grammar was refused: {e}")))?;
    }
    spec.grammar = req.grammar.clone();
    spec.logprobs = req.logprobs;
    // KV the request reserves on its cell: the prompt and the most it may generate.
    let positions = (prompt.len() + req.max_new_tokens).min(shared.max_context()) as u64;
    let first = ensure_epoch(shared, req.stages.as_ref(), seq, positions).await?;
    let _seat = Seat { shared, seq };

    let (tx, mut rx) = mpsc::unbounded_channel();
    shared.lock().routes.insert(seq, tx.clone());
    let mut route = Route {
        shared,
        seqs: vec![seq],
    };
    let mut epoch_rx = shared.epoch_tx.subscribe();
    // Text is decoded once, where it is wanted (the HTTP gateway decodes its own).
    let mut decoder = decode_text.then(|| StreamDecoder::new(&model.tokenizer));
    let mut timers: Vec<(tokio::time::Instant, Timer)> = Vec::new();
    let (mut machine, mut out) = RunMachine::new(spec, shared.lease());
    // Which epoch the run waits for (`Some(lost)`), and which one its attempt is on.
    let mut awaiting: Option<Option<u64>> = None;
    let mut on_epoch: Option<u64> = None;
    let mut first = Some(first);
    let now = || shared.started.elapsed();
    let outcome = loop {
        // Carry out what the machine said; feed back what cannot be delivered.
        let mut inputs = Vec::new();
        let mut done = None;
        for o in out.drain(..) {
            match o {
                Output::Send { to, msg } => {
                    if !shared.send(to, msg.0) {
                        inputs.push(Input::Undeliverable { to });
                    }
                }
                Output::AwaitEpoch { lost } => {
                    awaiting = Some(lost);
                    on_epoch = None;
                    if let Some(lost) = lost {
                        tracing::info!(
                            event = "run_paused",
                            seq,
                            epoch = lost,
                            "seq {seq}: paused after {} tokens on epoch {lost}",
                            machine.generated().len()
                        );
                    }
                }
                Output::ArmTimer { timer, after } => {
                    timers.push((tokio::time::Instant::now() + after, timer));
                }
                Output::Event(e) => {
                    client(match e {
                        RunEvent::Started {
                            epoch,
                            stages,
                            prompt_tokens,
                            cached_tokens,
                        } => CoordToClient::Started {
                            seq,
                            epoch,
                            prompt_tokens,
                            stages,
                            cached_tokens,
                        },
                        RunEvent::Token {
                            pos,
                            token,
                            logprobs,
                        } => CoordToClient::Token {
                            seq,
                            pos,
                            token,
                            text: decoder.as_mut().map_or_else(String::new, |d| d.push(token)),
                            logprobs,
                        },
                        RunEvent::Trace(mut t) => {
                            t.seq = seq;
                            CoordToClient::Trace(t)
                        }
                        RunEvent::Paused { reason } => CoordToClient::Paused { seq, reason },
                        RunEvent::Resumed { epoch, generated } => {
                            tracing::info!(
                                event = "run_resumed",
                                seq,
                                epoch,
                                generated,
                                "seq {seq}: resuming on epoch {epoch} after {generated} tokens"
                            );
                            CoordToClient::Resumed {
                                seq,
                                epoch,
                                generated,
                            }
                        }
                    });
                }
                Output::Refused { from, why } => shared.authz.refuse(from, &why),
                Output::Done(o) => done = Some(o),
            }
        }
        if let Some(o) = done {
            break o;
        }
        // Epoch changes the machine must hear about.
        if let Some(e) = on_epoch.filter(|e| !epoch_live(shared, *e)) {
            on_epoch = None;
            inputs.push(Input::EpochLost {
                epoch: e,
                why: format!("epoch {e} was lost"),
            });
        }
        if let Some(lost) = awaiting {
            let ready = match (lost, first.take()) {
                (None, Some(p)) => Some((p, seq)),
                (lost, _) => take_cell(shared, seq, positions, lost).ok().map(|p| {
                    let attempt = shared.next_seq.fetch_add(1, Ordering::Relaxed);
                    shared.lock().routes.insert(attempt, tx.clone());
                    route.seqs.push(attempt);
                    (p, attempt)
                }),
            };
            if let Some((placement, attempt_seq)) = ready {
                awaiting = None;
                on_epoch = Some(placement.epoch);
                inputs.push(Input::EpochReady {
                    placement,
                    attempt_seq,
                });
            }
        }
        if inputs.is_empty() {
            timers.sort_by_key(|(t, _)| *t);
            let next_timer = timers.first().map(|(t, _)| *t);
            let input = tokio::select! {
                m = rx.recv() => match m {
                    Some(RouteMsg::Node(from, msg)) => Some(Input::Node { from, msg }),
                    Some(RouteMsg::Cancel) => Some(Input::Cancel),
                    None => Some(Input::Cancel),
                },
                _ = epoch_rx.changed() => None,
                () = shared.seats_freed.notified(), if awaiting.is_some() => None,
                () = async {
                    match next_timer {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                } => Some(Input::Timer(timers.remove(0).1)),
            };
            inputs.extend(input);
        }
        for input in inputs {
            out.extend(machine.handle(now(), input));
        }
    };
    drop(route);
    if let Some(p) = &outcome.placement {
        if let Some((n, d)) = outcome.decode {
            shared
                .lock()
                .cells
                .measured(p.epoch, n, d.as_secs_f64().max(1e-9));
        }
    }
    let tail = decoder.map_or_else(String::new, |mut d| d.finish());
    let generated = outcome.generated.len();
    if !tail.is_empty() {
        client(CoordToClient::Token {
            seq,
            pos: prompt.len() + generated,
            token: u32::MAX,
            text: tail,
            logprobs: None,
        });
    }
    // A run that failed without an attempt running (it never started, or no epoch came back
    // after a loss) is a refusal to the client; one that failed while running has a report.
    if outcome.reason == FinishReason::Error && outcome.stranded {
        return Err(CoordError::Run(outcome.error.unwrap_or_default()));
    }
    Ok(report(shared, seq, prompt.len(), *outcome))
}

/// The accounting of a finished run, from its outcome.
fn report(shared: &Shared, seq: u64, prompt_tokens: usize, o: RunOutcome) -> RunReport {
    let n_embd = shared.model.config.n_embd;
    let placement = o.placement.unwrap_or(Placement {
        epoch: 0,
        stages: Vec::new(),
    });
    let stage_stats: Vec<StageSeqStats> = (0..placement.stages.len())
        .map(|i| o.stage_stats.get(&i).cloned().unwrap_or_default())
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
    RunReport {
        seq,
        epoch: placement.epoch,
        prompt_tokens,
        generated: o.generated.len(),
        reason: o.reason,
        error: o.error,
        stages: placement.stages,
        stage_stats,
        time_to_first_token_ms: o.time_to_first_token.map_or(0.0, |d| d.as_secs_f64() * 1e3),
        decode_tokens_per_s: o
            .decode
            .map_or(0.0, |(n, d)| n as f64 / d.as_secs_f64().max(1e-9)),
        n_embd,
        boundaries,
        hop_latency_us,
    }
}
