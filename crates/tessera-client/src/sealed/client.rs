//! The sealing client, as a library: `tessera client submit` and the gateway's sealed backend
//! ([`super::SealedBackend`]) both use it. It holds one control session with a coordinator,
//! fetches the workers' signed claims and checks them, seals a request to each candidate worker
//! (attempt `k` to candidate `k`, each job with a fresh reply key), submits the envelopes and
//! opens the one answer. Several jobs may be in flight on one session.
//!
//! The client trusts the coordinator with nothing it can check itself ([`ClientPolicy`]):
//! - with operator keys pinned (`--trust`), it seals only to workers whose claims carry a
//!   certificate from one of those operators, and names every key it refuses;
//! - it re-derives each answer's digest from the tokens it opened, so a worker that reports the
//!   honest digest (which the coordinator compares) but ships other tokens is caught;
//! - an answer counts as verified only when the second worker's own result (the witness, sealed
//!   to this client too) opens, binds its tokens, comes from another worker (and operator,
//!   where known) and holds the same tokens; with `verified_only`, nothing else is released.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tessera_net::{Connection, Endpoint, FrameWriter, JoinToken, NodeIdentity};
use tessera_proto::{
    frame, ClientToCoord, CoordToClient, SealedAnswer, SealedFailure, SealedNews, SealedRequest,
    SealedSubmit,
};
use tessera_seal::{
    AnswerDigest, JobEnvelope, JobId, NodeKey, ResultEnvelope, SecretKey, SignedClaims,
    Uncertified, UnixMillis,
};
use tokio::sync::{mpsc, oneshot};

use crate::error::ClientError;

/// What the reader task routes: each job's news, and the answers to `holders` in order.
#[derive(Default)]
struct Routes {
    jobs: HashMap<JobId, mpsc::UnboundedSender<SealedNews>>,
    holders: VecDeque<oneshot::Sender<Vec<SignedClaims>>>,
}

/// One control session with a coordinator, for sealed jobs.
pub struct SealedClient {
    endpoint: Endpoint,
    conn: Connection,
    writer: tokio::sync::Mutex<FrameWriter<tessera_net::quinn::SendStream>>,
    routes: Arc<Mutex<Routes>>,
    reader: tokio::task::JoinHandle<()>,
}

/// What the client takes on trust, and what it insists on.
#[derive(Debug, Clone, Default)]
pub struct ClientPolicy {
    /// Operator keys whose certificates make a worker one to seal to. Empty: every worker with
    /// validly self-signed claims (the coordinator is trusted to list only real workers).
    pub trust: Vec<NodeKey>,
    /// Release only answers a second worker agreed with (checked here, on its witness).
    pub verified_only: bool,
}

/// A job's outcome.
#[derive(Debug, Clone)]
pub struct SealedOutcome {
    pub job: JobId,
    /// The attempt whose answer it is.
    pub attempt: u32,
    /// A second worker's tokens agreed with it: the client opened that worker's own result
    /// and compared the tokens.
    pub verified: bool,
    pub answer: SealedAnswer,
}

impl SealedClient {
    pub async fn connect(
        identity: &NodeIdentity,
        addr: SocketAddr,
        token: &JoinToken,
    ) -> Result<Self, ClientError> {
        let (endpoint, conn, s) = crate::session::connect_client(identity, addr, token).await?;
        let tessera_net::FramedStream {
            mut reader, writer, ..
        } = s;
        let routes = Arc::new(Mutex::new(Routes::default()));
        let r = routes.clone();
        let reader = tokio::spawn(async move {
            while let Ok(msg) = reader.read_message::<CoordToClient>(frame::MSG).await {
                let mut routes = r.lock().unwrap_or_else(|p| p.into_inner());
                match msg {
                    CoordToClient::Sealed { job, news } => {
                        let last =
                            matches!(news, SealedNews::Result { .. } | SealedNews::Failed { .. });
                        if let Some(tx) = routes.jobs.get(&job) {
                            let _ = tx.send(news);
                        }
                        if last {
                            routes.jobs.remove(&job);
                        }
                    }
                    CoordToClient::Holders { holders } => {
                        if let Some(tx) = routes.holders.pop_front() {
                            let _ = tx.send(holders);
                        }
                    }
                    // A refusal of one of this session's messages: it cannot be told which,
                    // so every job waiting hears it.
                    CoordToClient::Error { message } => {
                        for (_, tx) in routes.jobs.drain() {
                            let _ = tx.send(SealedNews::Failed {
                                reason: SealedFailure::SessionRefused {
                                    message: message.clone(),
                                },
                            });
                        }
                        routes.holders.clear();
                    }
                    _ => {}
                }
            }
            // The session is over: whoever waits hears nothing more.
            let mut routes = r.lock().unwrap_or_else(|p| p.into_inner());
            routes.jobs.clear();
            routes.holders.clear();
        });
        Ok(Self {
            endpoint,
            conn,
            writer: tokio::sync::Mutex::new(writer),
            routes,
            reader,
        })
    }

    async fn send(&self, msg: &ClientToCoord) -> Result<(), ClientError> {
        Ok(self
            .writer
            .lock()
            .await
            .write_message(frame::MSG, msg)
            .await?)
    }

    /// [`SealedClient::holders`] that `trust` (operator keys) vouches for, and why each other
    /// one was refused. With no trusted key, every holder passes. None left is an error naming
    /// each refused key.
    pub async fn trusted_holders(
        &self,
        trust: &[NodeKey],
    ) -> Result<(Vec<SignedClaims>, Vec<Uncertified>), ClientError> {
        let all = self.holders().await?;
        if trust.is_empty() {
            return Ok((all, Vec::new()));
        }
        let (mut ok, mut refused) = (Vec::new(), Vec::new());
        for c in all {
            match c.certified_by(trust) {
                Ok(_) => ok.push(c),
                Err(why) => refused.push(why),
            }
        }
        if ok.is_empty() {
            let why: Vec<String> = refused.iter().map(ToString::to_string).collect();
            return Err(ClientError::Refused(format!(
                "no listed worker is certified by an operator this client trusts, so nothing \
                 was sealed: {}",
                why.join("; ")
            )));
        }
        Ok((ok, refused))
    }

    /// The workers that hold a model whole now, whose claims' signatures hold, all of the first
    /// one's model, in the coordinator's order.
    pub async fn holders(&self) -> Result<Vec<SignedClaims>, ClientError> {
        let (tx, rx) = oneshot::channel();
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .holders
            .push_back(tx);
        self.send(&ClientToCoord::Holders { model: None }).await?;
        let all = rx
            .await
            .map_err(|_| ClientError::Protocol("the coordinator did not list workers".into()))?;
        let valid: Vec<SignedClaims> = all
            .into_iter()
            .filter(|c| c.verify().is_ok() && !c.claims.models.is_empty())
            .collect();
        let Some(model) = valid.first().map(|c| c.claims.models[0].clone()) else {
            return Err(ClientError::Protocol(
                "no worker holds a whole copy of the model now (sealed jobs run on single-node \
                 cells)"
                    .into(),
            ));
        };
        Ok(valid
            .into_iter()
            .filter(|c| c.claims.models.contains(&model))
            .collect())
    }

    /// Submits a job's envelopes; its news arrive on the receiver, the last one a result or a
    /// failure.
    pub async fn submit(
        &self,
        envelopes: Vec<JobEnvelope>,
        verified_only: bool,
    ) -> Result<mpsc::UnboundedReceiver<SealedNews>, ClientError> {
        let job = envelopes
            .first()
            .ok_or_else(|| ClientError::Protocol("a job needs an envelope".into()))?
            .header
            .job;
        let (tx, rx) = mpsc::unbounded_channel();
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .jobs
            .insert(job, tx);
        self.send(&ClientToCoord::SealedSubmit(SealedSubmit {
            envelopes,
            verified_only,
        }))
        .await?;
        Ok(rx)
    }

    /// Seals `request` to each candidate, submits it and waits for the answer; `on_news` sees
    /// every piece of news on the way.
    pub async fn run(
        &self,
        request: &SealedRequest,
        candidates: &[SignedClaims],
        ttl_ms: u64,
        policy: &ClientPolicy,
        on_news: impl FnMut(JobId, &SealedNews),
    ) -> Result<SealedOutcome, ClientError> {
        let reply = SecretKey::generate();
        let envelopes = seal(request, candidates, &reply, ttl_ms)?;
        self.answer(request, envelopes, candidates, &reply, policy, on_news)
            .await
    }

    /// Submits envelopes of `request` sealed with [`seal`] to `candidates` under `reply`, and
    /// opens the answer, releasing it only if it binds its digest (and, under
    /// `policy.verified_only`, was verified).
    pub async fn answer(
        &self,
        request: &SealedRequest,
        envelopes: Vec<JobEnvelope>,
        candidates: &[SignedClaims],
        reply: &SecretKey,
        policy: &ClientPolicy,
        mut on_news: impl FnMut(JobId, &SealedNews),
    ) -> Result<SealedOutcome, ClientError> {
        let job = envelopes
            .first()
            .ok_or_else(|| ClientError::Protocol("a job needs an envelope".into()))?
            .header
            .job;
        let body = request_body(request);
        let mut news = self.submit(envelopes, policy.verified_only).await?;
        while let Some(n) = news.recv().await {
            on_news(job, &n);
            match n {
                SealedNews::Result {
                    result, witness, ..
                } => {
                    let (attempt, worker, answer) = open_answer(&result, candidates, reply, &body)?;
                    // Verified only on the witness's own evidence, not the coordinator's word.
                    let verified = match &witness {
                        Some(w) => match open_answer(w, candidates, reply, &body) {
                            Ok((_, by, second)) => {
                                let other_worker = by.claims.node != worker.claims.node;
                                let other_operator =
                                    by.operator().is_none() || by.operator() != worker.operator();
                                other_worker && other_operator && second.tokens == answer.tokens
                            }
                            Err(_) => false,
                        },
                        None => false,
                    };
                    if policy.verified_only && !verified {
                        return Err(ClientError::Refused(format!(
                            "job {job}: the answer of worker {} was not verified by a second \
                             worker, and only verified answers were asked for",
                            worker.claims.node
                        )));
                    }
                    return Ok(SealedOutcome {
                        job,
                        attempt,
                        verified,
                        answer,
                    });
                }
                SealedNews::Failed { reason } => {
                    return Err(ClientError::Protocol(format!("job {job} failed: {reason}")))
                }
                _ => {}
            }
        }
        Err(ClientError::Protocol(format!(
            "the coordinator session ended before job {job} was answered"
        )))
    }

    /// Ends the session.
    pub async fn close(self) {
        let _ = self.writer.lock().await.finish().await;
        self.reader.abort();
        self.conn.close("done");
        self.endpoint.close();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), self.endpoint.wait_idle())
            .await;
    }
}

/// The bytes sealed for `request` (the key of its answers' digests).
fn request_body(request: &SealedRequest) -> Vec<u8> {
    serde_json::to_vec(request).expect("a request serializes")
}

/// Opens a sealed result from one of `candidates` and checks that its tokens are the ones its
/// digest names (the digest the coordinator compared): the attempt, the worker and the answer.
fn open_answer<'a>(
    result: &ResultEnvelope,
    candidates: &'a [SignedClaims],
    reply: &SecretKey,
    body: &[u8],
) -> Result<(u32, &'a SignedClaims, SealedAnswer), ClientError> {
    let job = result.header.job;
    let worker = candidates
        .iter()
        .find(|c| c.claims.seal_key.key_id() == result.header.worker)
        .ok_or_else(|| {
            ClientError::Protocol("an answer from a worker the job was not sealed to".into())
        })?;
    let (attempt, plain) = result
        .open(reply, &worker.claims.seal_key, job)
        .map_err(|e| ClientError::Protocol(format!("the answer: {e}")))?;
    let answer: SealedAnswer = serde_json::from_slice(&plain)
        .map_err(|e| ClientError::Protocol(format!("a malformed sealed answer: {e}")))?;
    if AnswerDigest::of_tokens(body, &answer.tokens) != result.header.answer {
        return Err(ClientError::Refused(format!(
            "job {job}: worker {}'s answer does not match the digest it reported (its tokens \
             were altered after the digest was taken)",
            worker.claims.node
        )));
    }
    Ok((attempt, worker, answer))
}

/// One envelope per candidate, attempt `k` sealed to candidate `k`, all with `reply`'s key.
pub fn seal(
    request: &SealedRequest,
    candidates: &[SignedClaims],
    reply: &SecretKey,
    ttl_ms: u64,
) -> Result<Vec<JobEnvelope>, ClientError> {
    if candidates.is_empty() {
        return Err(ClientError::Protocol(
            "no candidate worker to seal to".into(),
        ));
    }
    let body = request_body(request);
    tessera_seal::seal_attempts(
        JobId::random(),
        &body,
        candidates,
        (request.prompt_tokens.len() + request.max_new_tokens) as u64,
        UnixMillis::now().plus(ttl_ms),
        &reply.public_key(),
    )
    .map_err(|e| ClientError::Protocol(format!("sealing: {e}")))
}
