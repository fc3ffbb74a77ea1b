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
    StageSeqStats, PROTOCOL_VERSION,
};
use tokio::sync::mpsc;

use crate::cluster::{ClusterInput, RunNews};
use crate::error::CoordError;
use crate::run::{Placement, RunEvent, RunOutcome, RunSpec};
use crate::shared::{member_status, Shared};

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
                    crate::sealed::edge::submit(&shared, client, s.envelopes);
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

/// Runs one generation; streams tokens to `client`. The lifecycle — placement, open, start,
/// relay, pause on a lost epoch, resume on the next, cancel, close — is decided in the
/// [`crate::cluster::Cluster`] (one `RunMachine` per run); this shell builds the spec, hands it
/// in, and turns the run's news into the client's messages. Text is decoded here, once, as tokens arrive.
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
    let (tx, mut rx) = mpsc::unbounded_channel();
    // A shell dropped before its run ended cancels it (the owner gave up).
    let mut guard = CancelOnDrop {
        shared,
        seq,
        armed: true,
    };
    shared.submit(seq, spec, req.stages.clone(), positions, tx);
    // Text is decoded once, where it is wanted (the HTTP gateway decodes its own).
    let mut decoder = decode_text.then(|| StreamDecoder::new(&model.tokenizer));
    let ended = loop {
        let Some(news) = rx.recv().await else {
            break Err(CoordError::Run("the run was dropped".into()));
        };
        let e = match news {
            RunNews::Ended(r) => break r.map_err(CoordError::from),
            RunNews::Event(e) => e,
        };
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
            RunEvent::Resumed { epoch, generated } => CoordToClient::Resumed {
                seq,
                epoch,
                generated,
            },
        });
    };
    guard.armed = false;
    let outcome = ended?;
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
