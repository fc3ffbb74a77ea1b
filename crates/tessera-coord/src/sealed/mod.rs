//! Sealed jobs at the coordinator, as a pure machine: [`SealedDesk::handle`] takes an input (with
//! the time inside it) and returns what to send; no clock, no sockets.
//!
//! The coordinator routes whole requests it cannot read. A client asks for the workers' signed
//! claims, seals its request once per candidate worker (attempt `k` to candidate `k`), and
//! submits all the envelopes of the job. The desk checks them against the claims (each is sealed
//! to a worker's *current* key, and that worker claims the model), leases the job to the first
//! candidate ([`JobLeases`]) and moves it on when the lease runs out, the holder leaves or refuses.
//! The first result of the live attempt is the job's one answer.
//!
//! A share of answers ([`Verifier`], by the holder's device tier) is checked before the client
//! gets it: the same request runs on a second candidate (the client already sealed it one), and
//! the result headers' digests are compared (equal token ids, whatever the sampling). A mismatch
//! goes to a third; the odd one out is quarantined and gets no more jobs, and the client gets
//! the majority's answer. Everything the desk reads is routing metadata: envelope headers, result
//! headers and claims.

use std::collections::{BTreeMap, BTreeSet};

use tessera_proto::{Passed, PassedOver, SealedFailure, SealedNews, SealedRefusal};
use tessera_seal::{
    ClaimBook, ClaimChange, ClaimRefusal, DeviceTier, Holder, JobEnvelope, JobFailure, JobId,
    JobLeases, LeaseAction, LeaseConfig, LeaseEvent, NodeKey, ResultEnvelope, SignedClaims,
    UnixMillis, Verifier, VerifyAction, VerifyConfig, VerifyEvent, Worker, LONG_JOB_POSITIONS,
};

pub(crate) mod edge;
mod seen;
#[cfg(test)]
mod tests;

pub(crate) use edge::SealedEdge;
pub use edge::{SealedFault, SealedSettings};

/// Most candidate workers (envelopes) one job may carry.
pub const MAX_CANDIDATES: usize = 8;

/// A client control session, as the desk names it.
pub type ClientId = u64;

/// Inputs.
#[derive(Debug, Clone)]
pub enum SealedInput {
    /// A client's job: one envelope per candidate worker.
    Submit {
        client: ClientId,
        envelopes: Vec<JobEnvelope>,
        /// Check the answer on a second worker whatever the tier's rate.
        verified_only: bool,
        now: UnixMillis,
    },
    /// A worker reports progress on a job it holds.
    Progress {
        job: JobId,
        attempt: u32,
        from: NodeKey,
        tokens: usize,
        now: UnixMillis,
    },
    /// A worker's sealed result.
    Result {
        result: ResultEnvelope,
        from: NodeKey,
        now: UnixMillis,
    },
    /// A worker would not run an envelope.
    Refused {
        job: JobId,
        attempt: u32,
        from: NodeKey,
        reason: SealedRefusal,
        now: UnixMillis,
    },
    /// A worker's session ended.
    NodeLeft { node: NodeKey, now: UnixMillis },
    /// A client's session ended: its jobs have nobody to answer.
    ClientLeft { client: ClientId },
    /// Time passed: leases that ran out move their jobs on.
    Tick { now: UnixMillis },
}

/// Outputs, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum SealedOutput {
    /// Send this envelope to the node it is sealed to.
    Dispatch { to: NodeKey, envelope: JobEnvelope },
    /// Tell the client that submitted `job`.
    Tell {
        client: ClientId,
        job: JobId,
        news: SealedNews,
    },
    /// `node` was caught giving another answer than two others: it gets no more jobs.
    Quarantined { node: NodeKey, job: JobId },
}

/// Settings.
#[derive(Debug, Clone)]
pub struct SealedConfig {
    pub leases: LeaseConfig,
    pub verify: VerifyConfig,
    /// A deliberate bug (`None` outside the simulator's own tests).
    pub fault: Option<DeskFault>,
}

/// A deliberate bug in the desk, so the simulator can show it catches a broken one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeskFault {
    /// Forget that a worker left: keep listing it and dispatching to it.
    ForgetDeparted,
    /// Leave a departed holder's jobs to their job leases instead of moving them at once.
    IgnoreHolderLeft,
}

#[derive(Debug)]
struct Job {
    client: ClientId,
    /// The client's envelopes by attempt.
    envelopes: BTreeMap<u32, JobEnvelope>,
    /// Whom each attempt is sealed to.
    holders: BTreeMap<u32, NodeKey>,
    /// The answer, held back while it is checked, and who gave it.
    held: Option<(ResultEnvelope, NodeKey)>,
    /// Replicas asked for, by node: the attempt sealed to it, and when the replica counts as
    /// failed unless it reports (its tier's lease, renewed by progress).
    replicas: BTreeMap<NodeKey, (u32, UnixMillis)>,
    /// Replicas' results, by node.
    replica_results: BTreeMap<NodeKey, ResultEnvelope>,
    /// The client asked for a verified answer.
    verified_only: bool,
    /// Why candidates were passed over (skipped, refused, gone), for the failure's reason.
    passed_over: Vec<Passed>,
}

/// The coordinator's sealed jobs, the workers' claims and their reputations.
#[derive(Debug)]
pub struct SealedDesk {
    leases: JobLeases,
    claims: ClaimBook,
    verifier: Verifier,
    jobs: BTreeMap<JobId, Job>,
    /// Workers whose session ended (left, or their lease expired): their claims are not
    /// listed and nothing is dispatched to them until they claim again from a new session.
    departed: BTreeSet<NodeKey>,
    fault: Option<DeskFault>,
}

/// A desk with the default leases and verification rates and a fixed verification seed (the
/// simulator's); the coordinator installs one seeded at random (`edge::desk`).
impl Default for SealedDesk {
    fn default() -> Self {
        Self::new(SealedConfig {
            leases: LeaseConfig::default(),
            verify: verify_config([0; 32], None, true),
            fault: None,
        })
    }
}

impl SealedDesk {
    pub fn new(config: SealedConfig) -> Self {
        Self {
            leases: JobLeases::new(config.leases),
            claims: ClaimBook::new(),
            verifier: Verifier::new(config.verify),
            jobs: BTreeMap::new(),
            departed: BTreeSet::new(),
            fault: config.fault,
        }
    }

    /// Records a node's signed claims. Only the node itself may claim for itself: `from` is the
    /// key its session authenticated.
    pub fn offer_claims(
        &mut self,
        from: NodeKey,
        claims: SignedClaims,
    ) -> Result<ClaimChange, ClaimRefusal> {
        if claims.claims.node != from {
            return Err(ClaimRefusal::BadSignature);
        }
        let change = self.claims.offer(claims)?;
        // Claimed from a live session: back in the list.
        self.departed.remove(&from);
        Ok(change)
    }

    /// Current claims of the workers holding `model` (every worker's when `None`), quarantined
    /// and departed ones left out.
    pub fn holders(&self, model: Option<&str>) -> Vec<SignedClaims> {
        self.claims
            .signed()
            .filter(|s| model.is_none_or(|m| s.claims.models.iter().any(|x| x == m)))
            .filter(|s| !self.verifier.is_quarantined(&s.claims.node))
            .filter(|s| !self.departed.contains(&s.claims.node))
            .cloned()
            .collect()
    }

    pub fn is_quarantined(&self, node: &NodeKey) -> bool {
        self.verifier.is_quarantined(node)
    }

    /// Jobs waiting for an answer.
    pub fn in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// How much verification has cost so far.
    pub fn verify_stats(&self) -> tessera_seal::VerifyStats {
        self.verifier.stats()
    }

    pub fn handle(&mut self, input: SealedInput) -> Vec<SealedOutput> {
        let mut out = Vec::new();
        match input {
            SealedInput::Submit {
                client,
                envelopes,
                verified_only,
                now,
            } => self.submit(client, envelopes, verified_only, now, &mut out),
            SealedInput::Progress {
                job,
                attempt,
                from,
                tokens,
                now,
            } => {
                if let Some(r) = self
                    .jobs
                    .get_mut(&job)
                    .and_then(|j| j.replicas.get_mut(&from))
                    .filter(|r| r.0 == attempt)
                {
                    let lease = self
                        .claims
                        .get(&from)
                        .map_or(DeviceTier::Phone, |c| c.tier)
                        .policy()
                        .lease_ms;
                    r.1 = now.plus(lease);
                } else if self.leases.current(job) == Some((attempt, from)) {
                    self.leases.handle(LeaseEvent::Progress {
                        job,
                        attempt,
                        from,
                        now,
                    });
                    self.tell(job, SealedNews::Progress { attempt, tokens }, &mut out);
                }
            }
            SealedInput::Result { result, from, now } => self.result(result, from, now, &mut out),
            SealedInput::Refused {
                job,
                attempt,
                from,
                reason,
                now,
            } => {
                let Some(j) = self.jobs.get(&job) else {
                    return out;
                };
                if j.holders.get(&attempt) != Some(&from) {
                    return out;
                }
                let replica = j.replicas.get(&from).is_some_and(|r| r.0 == attempt);
                if !replica && reason != SealedRefusal::Replayed {
                    self.passed_over(
                        job,
                        attempt,
                        PassedOver::Refused {
                            worker: from,
                            reason: reason.clone(),
                        },
                    );
                }
                self.tell(
                    job,
                    SealedNews::Refused {
                        attempt,
                        from,
                        reason: reason.clone(),
                    },
                    &mut out,
                );
                if replica {
                    let acts = self
                        .verifier
                        .handle(VerifyEvent::ReplicaFailed { job, worker: from });
                    self.verified(acts, now, &mut out);
                } else if reason != SealedRefusal::Replayed {
                    // A replay refusal means the worker already opened this attempt (and is
                    // running it): the job stays with it.
                    let acts = self.leases.handle(LeaseEvent::Refused {
                        job,
                        attempt,
                        from,
                        now,
                    });
                    self.leased(acts, now, &mut out);
                }
            }
            SealedInput::NodeLeft { node, now } => {
                if self.fault != Some(DeskFault::ForgetDeparted) {
                    self.departed.insert(node);
                }
                let replicas: Vec<JobId> = self
                    .jobs
                    .iter()
                    .filter(|(_, j)| j.replicas.contains_key(&node))
                    .map(|(id, _)| *id)
                    .collect();
                for job in replicas {
                    let acts = self
                        .verifier
                        .handle(VerifyEvent::ReplicaFailed { job, worker: node });
                    self.verified(acts, now, &mut out);
                }
                if self.fault != Some(DeskFault::IgnoreHolderLeft) {
                    let acts = self.leases.handle(LeaseEvent::HolderLeft { node, now });
                    self.leased(acts, now, &mut out);
                }
            }
            SealedInput::ClientLeft { client } => self.jobs.retain(|_, j| j.client != client),
            SealedInput::Tick { now } => {
                let acts = self.leases.handle(LeaseEvent::Tick { now });
                self.leased(acts, now, &mut out);
                // A replica that went silent fails: another peer is asked, or the check ends.
                let silent: Vec<(JobId, NodeKey)> = self
                    .jobs
                    .iter()
                    .flat_map(|(id, j)| {
                        j.replicas
                            .iter()
                            .filter(|(n, r)| r.1 <= now && !j.replica_results.contains_key(n))
                            .map(|(n, _)| (*id, *n))
                    })
                    .collect();
                for (job, worker) in silent {
                    if let Some(j) = self.jobs.get_mut(&job) {
                        j.replicas.remove(&worker);
                    }
                    let acts = self
                        .verifier
                        .handle(VerifyEvent::ReplicaFailed { job, worker });
                    self.verified(acts, now, &mut out);
                }
            }
        }
        out
    }

    fn submit(
        &mut self,
        client: ClientId,
        envelopes: Vec<JobEnvelope>,
        verified_only: bool,
        now: UnixMillis,
        out: &mut Vec<SealedOutput>,
    ) {
        let Some(first) = envelopes.first() else {
            return;
        };
        let job = first.header.job;
        if self.jobs.contains_key(&job) {
            out.push(SealedOutput::Tell {
                client,
                job,
                news: SealedNews::Failed {
                    reason: SealedFailure::AlreadySubmitted { job },
                },
            });
            return;
        }
        let (holders, skipped) = match self.check_envelopes(&envelopes, now) {
            Ok(h) => h,
            Err(reason) => {
                out.push(SealedOutput::Tell {
                    client,
                    job,
                    news: SealedNews::Failed { reason },
                });
                return;
            }
        };
        for p in &skipped {
            out.push(SealedOutput::Tell {
                client,
                job,
                news: SealedNews::Skipped {
                    attempt: p.attempt,
                    reason: p.why.clone(),
                },
            });
        }
        if holders.is_empty() {
            out.push(SealedOutput::Tell {
                client,
                job,
                news: SealedNews::Failed {
                    reason: SealedFailure::NoWorkerFits {
                        passed_over: skipped,
                    },
                },
            });
            return;
        }
        self.jobs.insert(
            job,
            Job {
                client,
                holders: holders.iter().map(|(a, h)| (*a, h.node)).collect(),
                envelopes: envelopes
                    .into_iter()
                    .map(|e| (e.header.attempt, e))
                    .collect(),
                held: None,
                replicas: BTreeMap::new(),
                replica_results: BTreeMap::new(),
                verified_only,
                passed_over: skipped,
            },
        );
        let acts = self
            .leases
            .handle(LeaseEvent::SubmitAttempts { job, holders, now });
        self.leased(acts, now, out);
    }

    fn passed_over(&mut self, job: JobId, attempt: u32, why: PassedOver) {
        if let Some(j) = self.jobs.get_mut(&job) {
            // The first reason stands: a refused attempt's lease then ends as well, and
            // "went silent" would bury what the worker said.
            let known = j.passed_over.iter().any(|p| p.attempt == attempt);
            if !known && j.passed_over.len() < MAX_CANDIDATES * 2 {
                j.passed_over.push(Passed { attempt, why });
            }
        }
    }

    /// The candidates of a job that fit it, in the order to try them, with the attempt sealed
    /// to each, and the candidates left out with why; or why the envelopes cannot be routed at
    /// all. A candidate is left out when its key is no longer current (rotated, or the worker
    /// gone), it does not hold the model, the job needs more positions than it claims room
    /// for or its tier takes, or another attempt is sealed to the same worker. A long job
    /// ([`LONG_JOB_POSITIONS`]) goes first to tiers not expected to leave mid-job.
    #[allow(clippy::type_complexity)]
    fn check_envelopes(
        &self,
        envelopes: &[JobEnvelope],
        now: UnixMillis,
    ) -> Result<(Vec<(u32, Holder)>, Vec<Passed>), SealedFailure> {
        if envelopes.len() > MAX_CANDIDATES {
            return Err(SealedFailure::TooManyEnvelopes {
                count: envelopes.len(),
                max: MAX_CANDIDATES,
            });
        }
        let job = envelopes[0].header.job;
        let mut holders: Vec<(u32, Holder)> = Vec::with_capacity(envelopes.len());
        let mut skipped = Vec::new();
        for (i, e) in envelopes.iter().enumerate() {
            let h = &e.header;
            let attempt = i as u32 + 1;
            if h.job != job {
                return Err(SealedFailure::MixedJobs {
                    first: job,
                    other: h.job,
                });
            }
            if h.attempt != attempt {
                return Err(SealedFailure::AttemptOutOfOrder {
                    envelope: attempt,
                    carries: h.attempt,
                });
            }
            if h.expires_at <= now {
                return Err(SealedFailure::AttemptExpired {
                    attempt,
                    at: h.expires_at,
                });
            }
            match self.fits(h, &holders) {
                Ok(holder) => holders.push((attempt, holder)),
                Err(why) => skipped.push(Passed { attempt, why }),
            }
        }
        let positions = envelopes[0].header.context_tokens;
        if positions >= LONG_JOB_POSITIONS {
            // Stable: the client's order stands among equals.
            holders.sort_by_key(|(_, h)| h.tier.policy().expected_to_leave);
        }
        Ok((holders, skipped))
    }

    /// The worker an envelope is sealed to, if the job fits it; else why not.
    fn fits(
        &self,
        h: &tessera_seal::JobHeader,
        taken: &[(u32, Holder)],
    ) -> Result<Holder, PassedOver> {
        let claims = self
            .claims
            .signed()
            .map(|s| &s.claims)
            .find(|c| c.seal_key.key_id() == h.recipient)
            .ok_or(PassedOver::KeyNotClaimed { key: h.recipient })?;
        let worker = claims.node;
        if self.departed.contains(&worker) {
            return Err(PassedOver::WorkerLeft { worker });
        }
        if !claims.models.contains(&h.model) {
            return Err(PassedOver::ModelNotHeld {
                worker,
                model: h.model.clone(),
            });
        }
        if claims.max_context > 0 && h.context_tokens > claims.max_context {
            return Err(PassedOver::NoRoom {
                worker,
                needs: h.context_tokens,
                room: claims.max_context,
            });
        }
        if let Some(max) = claims.tier.policy().max_job_positions {
            if h.context_tokens > max {
                return Err(PassedOver::TierTooSmall {
                    worker,
                    tier: claims.tier,
                    needs: h.context_tokens,
                    max,
                });
            }
        }
        if taken.iter().any(|(_, x)| x.node == worker) {
            return Err(PassedOver::SameWorker { worker });
        }
        Ok(Holder {
            node: worker,
            tier: claims.tier,
        })
    }

    /// Carries out the lease machine's actions.
    fn leased(&mut self, acts: Vec<LeaseAction>, now: UnixMillis, out: &mut Vec<SealedOutput>) {
        for a in acts {
            match a {
                LeaseAction::Dispatch {
                    job, attempt, to, ..
                } => {
                    if self.verifier.is_quarantined(&to) || self.departed.contains(&to) {
                        // Caught altering answers since the job was submitted, or gone: skip
                        // it.
                        let why = if self.departed.contains(&to) {
                            PassedOver::WorkerLeft { worker: to }
                        } else {
                            PassedOver::Quarantined { worker: to }
                        };
                        self.passed_over(job, attempt, why);
                        let acts = self.leases.handle(LeaseEvent::Refused {
                            job,
                            attempt,
                            from: to,
                            now,
                        });
                        self.leased(acts, now, out);
                        continue;
                    }
                    let Some(envelope) = self
                        .jobs
                        .get(&job)
                        .and_then(|j| j.envelopes.get(&attempt))
                        .cloned()
                    else {
                        continue;
                    };
                    out.push(SealedOutput::Dispatch { to, envelope });
                    self.tell(job, SealedNews::Dispatched { attempt, to }, out);
                }
                LeaseAction::Expired {
                    job,
                    attempt,
                    holder,
                } => {
                    self.passed_over(job, attempt, PassedOver::WentSilent { holder });
                    self.tell(job, SealedNews::Expired { attempt, holder }, out)
                }
                LeaseAction::Deliver { .. } | LeaseAction::DropResult { .. } => {}
                LeaseAction::Failed { job, reason } => {
                    let passed_over = self
                        .jobs
                        .get_mut(&job)
                        .map(|j| std::mem::take(&mut j.passed_over))
                        .unwrap_or_default();
                    let reason = match reason {
                        JobFailure::NoHolderLeft { attempts } => SealedFailure::NoCandidateLeft {
                            tries: attempts,
                            passed_over,
                        },
                        JobFailure::TooManyAttempts { attempts } => SealedFailure::GaveUp {
                            tries: attempts,
                            passed_over,
                        },
                        JobFailure::DuplicateSubmit => SealedFailure::AlreadySubmitted { job },
                    };
                    self.tell(job, SealedNews::Failed { reason }, out);
                    self.jobs.remove(&job);
                }
            }
        }
    }

    fn result(
        &mut self,
        result: ResultEnvelope,
        from: NodeKey,
        now: UnixMillis,
        out: &mut Vec<SealedOutput>,
    ) {
        let (job, attempt) = (result.header.job, result.header.attempt);
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        let candidates: Vec<NodeKey> = j.holders.values().copied().collect();
        let always = j.verified_only;
        let is_replica = j.replicas.get(&from).is_some_and(|r| r.0 == attempt);
        if is_replica && !j.replica_results.contains_key(&from) {
            let answer = result.header.answer;
            j.replica_results.insert(from, result);
            let acts = self.verifier.handle(VerifyEvent::ReplicaAnswered {
                job,
                worker: from,
                answer,
            });
            self.verified(acts, now, out);
            return;
        }
        let acts = self.leases.handle(LeaseEvent::Result {
            job,
            attempt,
            from,
            now,
        });
        if !acts
            .iter()
            .any(|a| matches!(a, LeaseAction::Deliver { .. }))
        {
            return;
        }
        let Some(worker) = self.worker(&from) else {
            return self.deliver(job, result, None, out);
        };
        // A worker that left is no peer: a check sent to it would hold the answer back until
        // its replica lease ran out (the sealed simulator found this).
        let peers: Vec<Worker> = candidates
            .iter()
            .filter(|n| **n != from && !self.departed.contains(n))
            .filter_map(|n| self.worker(n))
            .collect();
        let answer = result.header.answer;
        let acts = self.verifier.handle(VerifyEvent::Answered {
            job,
            worker,
            answer,
            peers,
            always,
        });
        if acts.is_empty() {
            return self.deliver(job, result, None, out);
        }
        if let Some(j) = self.jobs.get_mut(&job) {
            j.held = Some((result, from));
        }
        self.verified(acts, now, out);
    }

    /// Carries out the verifier's actions.
    fn verified(&mut self, acts: Vec<VerifyAction>, now: UnixMillis, out: &mut Vec<SealedOutput>) {
        for a in acts {
            match a {
                VerifyAction::Replicate { job, to, .. } => {
                    if self.departed.contains(&to) {
                        // Gone since the check began: the next peer, or the check ends.
                        let acts = self
                            .verifier
                            .handle(VerifyEvent::ReplicaFailed { job, worker: to });
                        self.verified(acts, now, out);
                        continue;
                    }
                    let Some(j) = self.jobs.get_mut(&job) else {
                        continue;
                    };
                    let Some((attempt, envelope)) = j
                        .holders
                        .iter()
                        .find(|(_, n)| **n == to)
                        .and_then(|(a, _)| Some((*a, j.envelopes.get(a)?.clone())))
                    else {
                        continue;
                    };
                    let lease = self
                        .claims
                        .get(&to)
                        .map_or(DeviceTier::Phone, |c| c.tier)
                        .policy()
                        .lease_ms;
                    j.replicas.insert(to, (attempt, now.plus(lease)));
                    out.push(SealedOutput::Dispatch { to, envelope });
                    self.tell(job, SealedNews::Verifying { attempt, on: to }, out);
                }
                VerifyAction::Agreed { job, workers } => {
                    let Some(j) = self.jobs.get_mut(&job) else {
                        continue;
                    };
                    if let Some((r, by)) = j.held.take() {
                        // The agreeing worker's own result, for the client to compare.
                        let witness = workers
                            .iter()
                            .filter(|w| **w != by)
                            .find_map(|w| j.replica_results.get(w).cloned());
                        self.deliver(job, r, witness, out);
                    }
                }
                VerifyAction::Quarantine { job, node, .. } => {
                    out.push(SealedOutput::Quarantined { node, job });
                    let Some(j) = self.jobs.get_mut(&job) else {
                        continue;
                    };
                    // The primary was the odd one out: the client gets a majority answer,
                    // which a replica sealed to it as well.
                    if j.held.as_ref().is_some_and(|(_, n)| *n == node) {
                        j.held = j
                            .replica_results
                            .iter()
                            .find(|(n, _)| **n != node)
                            .map(|(n, r)| (r.clone(), *n));
                    }
                }
                VerifyAction::Inconclusive { job, .. } => {
                    if let Some((r, _)) = self.jobs.get_mut(&job).and_then(|j| j.held.take()) {
                        self.deliver(job, r, None, out);
                    }
                }
            }
        }
    }

    /// The job's one answer; verified when a second worker's result agreed with it (that
    /// result goes along as the witness).
    fn deliver(
        &mut self,
        job: JobId,
        result: ResultEnvelope,
        witness: Option<ResultEnvelope>,
        out: &mut Vec<SealedOutput>,
    ) {
        let news = SealedNews::Result {
            result,
            verified: witness.is_some(),
            witness,
        };
        self.tell(job, news, out);
        self.jobs.remove(&job);
    }

    fn worker(&self, node: &NodeKey) -> Option<Worker> {
        self.claims
            .signed()
            .find(|s| s.claims.node == *node)
            .map(worker_of)
    }

    fn tell(&self, job: JobId, news: SealedNews, out: &mut Vec<SealedOutput>) {
        if let Some(j) = self.jobs.get(&job) {
            out.push(SealedOutput::Tell {
                client: j.client,
                job,
                news,
            });
        }
    }
}

fn worker_of(s: &SignedClaims) -> Worker {
    let c = &s.claims;
    Worker {
        node: c.node,
        kernel_path: c.kernel_path.clone(),
        tier: c.tier,
        operator: s.operator(),
    }
}

/// The verification settings: `per_mille` for every tier when given (else each tier's policy),
/// and whether answers of different kernel paths are compared.
pub fn verify_config(seed: [u8; 32], per_mille: Option<u32>, cross_kernel: bool) -> VerifyConfig {
    let mut c = VerifyConfig::new(seed);
    if let Some(p) = per_mille {
        for t in DeviceTier::ALL {
            c.per_mille.insert(t, p.min(1000));
        }
    }
    c.cross_kernel_comparable = cross_kernel;
    c
}
