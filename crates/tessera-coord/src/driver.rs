//! Driving generations: a client's control session, and one generation's shell.
//!
//! For a [`RunRequest`] the shell tokenizes the prompt and checks the request once into a
//! `RunSpec`, and hands it to the [`crate::cluster::Cluster`], which seats it on a ready cell
//! (planning the requested placement if needed and waiting for it to load and link), opens the
//! sequence on every stage, starts the first stage, relays what the last stage reports — each
//! token, to the run's owner — until the sequence finishes, then closes the sequence everywhere
//! (each stage frees its KV cache and reports its traffic and time). The shell turns the
//! outcome into a [`RunReport`].
//!
//! **Surviving failures.** The run's machine keeps its prompt, sampling parameters and the
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
    frame, BoundaryReport, ClientToCoord, CoordToClient, FinishReason, OpenSeq, Prediction,
    RunReport, RunRequest, StageSeqStats, PROTOCOL_VERSION,
};
use tokio::sync::mpsc;

use crate::cluster::{ClusterInput, RunNews, RunRefused};
use crate::error::CoordError;
use crate::run::{Placement, RunEvent, RunOutcome, RunSpec};
use crate::shared::{member_status, ModelInfo, RunOwner, Shared};

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
                    let Some(permit) = shared.admit_run(&sender).await else {
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
                    let _ = tx.send(CoordToClient::Admin(
                        crate::admin::handle(&shared, req).await,
                    ));
                }
                Ok(ClientToCoord::Holders { model }) => {
                    let holders = shared
                        .ask(move |core, shared| {
                            crate::sealed::edge::holders(&mut core.edge(shared), model.as_deref())
                        })
                        .await
                        .unwrap_or_default();
                    let _ = tx.send(CoordToClient::Holders { holders });
                }
                Ok(ClientToCoord::SealedSubmit(s)) => {
                    let client = match sealed_id {
                        Some(c) => c,
                        None => {
                            let tx = tx.clone();
                            let joined = shared.ask(move |core, shared| {
                                crate::sealed::edge::client_joined(&mut core.edge(shared), tx)
                            });
                            let Some(c) = joined.await else { break };
                            *sealed_id.insert(c)
                        }
                    };
                    shared.with(move |core, shared| {
                        crate::sealed::edge::submit(&mut core.edge(shared), client, s);
                    });
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
        shared.with(move |core, shared| {
            crate::sealed::edge::client_left(&mut core.edge(shared), client);
        });
    }
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(2), writer_task).await;
    result
}

/// Cancels run `seq` (its owner gave up): an input to its machine, not a message from a node.
pub(crate) fn cancel(shared: &Shared, seq: u64) {
    shared.handle(ClusterInput::Cancel { run: seq });
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

/// How a run ended, as its owner receives it (once, when it ends).
pub(crate) type Ending = tokio::sync::oneshot::Receiver<Result<Box<RunOutcome>, RunRefused>>;

/// Checks a request and builds its [`RunSpec`], once, off the cluster (tokenizing and the
/// grammar's bounds are work); with the KV positions it reserves on its cell.
fn spec_of(shared: &Shared, req: &RunRequest) -> Result<(RunSpec, u64), CoordError> {
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
        prompt,
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
        tessera_grammar::check(g, &tessera_grammar::GrammarLimits::DEFAULT)
            .map_err(|e| CoordError::Run(format!("the grammar was refused: {e}")))?;
    }
    spec.grammar = req.grammar.clone();
    spec.logprobs = req.logprobs;
    if req.speculate > OpenSeq::MAX_SPECULATE {
        return Err(CoordError::Run(format!(
            "speculate: {} drafts a turn asked (at most {})",
            req.speculate,
            OpenSeq::MAX_SPECULATE
        )));
    }
    spec.speculate = req.speculate;
    spec.prediction = prediction_of(model, req)?;
    // KV the request reserves on its cell: the prompt and the most it may generate.
    let positions = (spec.prompt.len() + req.max_new_tokens).min(shared.max_context()) as u64;
    Ok((spec, positions))
}

/// The request's predicted answer in tokens, bounded; refused without speculation (it would be
/// ignored) or outside the vocabulary.
fn prediction_of(model: &ModelInfo, req: &RunRequest) -> Result<Vec<u32>, CoordError> {
    use tessera_sampling::prediction::MAX_PREDICTION_TOKENS;
    let tokens = match &req.prediction {
        None => return Ok(Vec::new()),
        Some(Prediction::Text(t)) => model.tokenizer.encode(t, false),
        Some(Prediction::Tokens(t)) => t.clone(),
    };
    if req.speculate == 0 {
        return Err(CoordError::Run(
            "a prediction is a source of drafts: it needs speculate (at least 1 draft a turn)"
                .into(),
        ));
    }
    if tokens.len() > MAX_PREDICTION_TOKENS {
        return Err(CoordError::Run(format!(
            "the prediction is {} tokens (at most {MAX_PREDICTION_TOKENS})",
            tokens.len()
        )));
    }
    if let Some(&bad) = tokens
        .iter()
        .find(|&&t| t as usize >= model.config.vocab_size)
    {
        return Err(CoordError::Run(format!(
            "prediction token {bad} is outside the vocabulary"
        )));
    }
    Ok(tokens)
}

/// Starts run `seq`: the cluster decides its whole lifecycle — placement, open, start,
/// relay, pause on a lost epoch, resume on the next, cancel, close ([`crate::cluster`], one
/// `RunMachine` per run) — and calls `on_event` with each of its events where the node's
/// message is handled (no channel in between: the owner's own sink is the one hop). Returns
/// the prompt's length and the run's ending.
pub(crate) fn start(
    shared: &Shared,
    seq: u64,
    req: &RunRequest,
    mut on_event: impl FnMut(RunEvent) + Send + 'static,
) -> Result<(usize, Ending), CoordError> {
    let (spec, positions) = spec_of(shared, req)?;
    let prompt_len = spec.prompt.len();
    let (done, ending) = tokio::sync::oneshot::channel();
    let mut done = Some(done);
    let owner: RunOwner = Box::new(move |news| match news {
        RunNews::Event(e) => on_event(e),
        RunNews::Ended(r) => {
            if let Some(done) = done.take() {
                let _ = done.send(r);
            }
        }
    });
    shared.submit(seq, spec, req.stages.clone(), positions, owner);
    Ok((prompt_len, ending))
}

/// A run's report from its ending: a run that failed without an attempt running (it never
/// started, or no epoch came back after a loss) is a refusal; one that failed while running
/// has a report.
pub(crate) async fn finish(
    shared: &Shared,
    seq: u64,
    prompt_len: usize,
    ending: Ending,
) -> Result<RunReport, CoordError> {
    let outcome = ending
        .await
        .map_err(|_| CoordError::Run("the run was dropped".into()))??;
    if outcome.reason == FinishReason::Error && outcome.stranded {
        return Err(CoordError::Run(outcome.error.unwrap_or_default()));
    }
    Ok(report(shared, seq, prompt_len, *outcome))
}

/// Runs one generation for a CLI client; streams its events to `client` as the client's
/// messages, with text decoded here, once, as tokens arrive.
pub(crate) async fn run(
    shared: &Shared,
    seq: u64,
    req: RunRequest,
    decode_text: bool,
    client: &mut (dyn FnMut(CoordToClient) + Send),
) -> Result<RunReport, CoordError> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (prompt_len, ending) = start(shared, seq, &req, move |e| {
        let _ = tx.send(e);
    })?;
    // A shell dropped before its run ended cancels it (the owner gave up).
    let mut guard = CancelOnDrop {
        shared,
        seq,
        armed: true,
    };
    let mut decoder = decode_text.then(|| StreamDecoder::new(&shared.model.tokenizer));
    let mut generated = 0;
    // The sender is dropped with the owner, when the run ends.
    while let Some(e) = rx.recv().await {
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
            } => {
                generated += 1;
                CoordToClient::Token {
                    seq,
                    pos,
                    token,
                    text: decoder.as_mut().map_or_else(String::new, |d| d.push(token)),
                    logprobs,
                }
            }
            RunEvent::Trace(mut t) => {
                t.seq = seq;
                CoordToClient::Trace(t)
            }
            RunEvent::Paused { reason } => CoordToClient::Paused { seq, reason },
            RunEvent::Resumed { epoch, generated } => CoordToClient::Resumed {
                seq,
                epoch,
                generated,
            },
        });
    }
    guard.armed = false;
    let tail = decoder.map_or_else(String::new, |mut d| d.finish());
    if !tail.is_empty() {
        client(CoordToClient::Token {
            seq,
            pos: prompt_len + generated,
            token: u32::MAX,
            text: tail,
            logprobs: None,
        });
    }
    finish(shared, seq, prompt_len, ending).await
}

/// Cancels a run whose shell is dropped before it ended.
struct CancelOnDrop<'a> {
    shared: &'a Shared,
    seq: u64,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            cancel(self.shared, self.seq);
        }
    }
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
    let unconfirmed_stages = (0..placement.stages.len())
        .filter(|i| !o.stage_stats.contains_key(i))
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
        unconfirmed_stages,
    }
}
