//! The coordinator's job leases, as a pure machine: [`JobLeases::handle`] takes an event and `now`
//! inside it, and returns actions; no clock, no sockets, no envelopes (it sees job ids, attempts
//! and holders, which is all a coordinator that cannot read jobs has).
//!
//! A job goes to the first of its candidate holders under a lease as long as that holder's tier
//! allows ([`crate::DeviceTier::policy`]); progress reports renew it. When a lease runs out (seen
//! at a [`LeaseEvent::Tick`]), the holder leaves or refuses the job, the job goes to the next
//! candidate still present. Candidate `k` (counting from 1) is attempt `k`: the client seals the
//! request once per candidate, attempt `k` to candidate `k`, and the header binds the attempt and
//! recipient, so the coordinator cannot re-address an envelope; a candidate that left before its
//! turn is skipped with its attempt number. The
//! first result of the current attempt from its holder is delivered; every other result — a
//! duplicate, or a late one from an expired attempt — is dropped, so the client gets exactly one
//! answer. With no candidate left the job fails with an explicit reason.

use std::collections::{BTreeMap, VecDeque};

use crate::claims::NodeKey;
use crate::envelope::JobId;
use crate::tier::DeviceTier;
use crate::UnixMillis;

/// A node that holds the job's model, as routing ranked it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub node: NodeKey,
    pub tier: DeviceTier,
}

/// Inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseEvent {
    /// A new job and its candidate holders, best first: candidate `k` is attempt `k`.
    Submit {
        job: JobId,
        holders: Vec<Holder>,
        now: UnixMillis,
    },
    /// A new job whose candidates carry their attempt numbers, in the order to try them: the
    /// router left out candidates unfit for the job, or put more dependable ones first.
    SubmitAttempts {
        job: JobId,
        holders: Vec<(u32, Holder)>,
        now: UnixMillis,
    },
    /// The holder reports progress (a token, a heartbeat): its lease starts over.
    Progress {
        job: JobId,
        attempt: u32,
        from: NodeKey,
        now: UnixMillis,
    },
    /// A result arrived (still sealed: the coordinator forwards it, it does not read it).
    Result {
        job: JobId,
        attempt: u32,
        from: NodeKey,
        now: UnixMillis,
    },
    /// The node left (its connection closed, or membership declared it dead).
    HolderLeft { node: NodeKey, now: UnixMillis },
    /// The holder of `attempt` will not run it (the envelope did not open, was replayed or
    /// expired, or the node cannot run the model): the next candidate is tried.
    Refused {
        job: JobId,
        attempt: u32,
        from: NodeKey,
        now: UnixMillis,
    },
    /// Time passed: leases that ran out are expired.
    Tick { now: UnixMillis },
}

/// Outputs, in the order the caller should carry them out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseAction {
    /// Send the job's envelope for `attempt`, sealed to `to`, to `to`.
    Dispatch {
        job: JobId,
        attempt: u32,
        to: NodeKey,
        lease_until: UnixMillis,
    },
    /// The lease of `attempt` on `holder` ran out (or the holder left): stop waiting for it.
    Expired {
        job: JobId,
        attempt: u32,
        holder: NodeKey,
    },
    /// Forward this result to the client: the job's one answer.
    Deliver {
        job: JobId,
        attempt: u32,
        from: NodeKey,
    },
    /// Drop this result, for `reason`.
    DropResult {
        job: JobId,
        attempt: u32,
        from: NodeKey,
        reason: DropReason,
    },
    /// The job cannot complete: tell the client.
    Failed { job: JobId, reason: JobFailure },
}

/// Why a result was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The job was already answered.
    Duplicate,
    /// From an attempt whose lease expired; `current` is the live attempt.
    StaleAttempt { current: u32 },
    /// The current attempt, but from a node that does not hold it.
    NotTheHolder,
    /// No such job (never submitted, or answered and forgotten).
    UnknownJob,
}

/// Why a job failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobFailure {
    /// Every candidate holder was tried (or none was given); `attempts` counts the tries.
    NoHolderLeft { attempts: u32 },
    /// The job reached the cap on tries.
    TooManyAttempts { attempts: u32 },
    /// A job with this id is already in flight or answered.
    DuplicateSubmit,
}

/// Settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Most holders tried per job.
    pub max_attempts: u32,
    /// How long a finished (answered or failed) job is remembered, so a late duplicate is told
    /// apart from an unknown job and its id is not dispatched again.
    pub remember_finished_ms: u64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            max_attempts: 4,
            remember_finished_ms: 10 * 60_000,
        }
    }
}

#[derive(Debug, Clone)]
struct Live {
    attempt: u32,
    holder: Holder,
    lease_until: UnixMillis,
    /// Holders tried so far, this one included.
    tries: u32,
    /// The candidates not tried yet, with their attempt numbers.
    untried: VecDeque<(u32, Holder)>,
}

/// All jobs in flight, and recently answered ones.
#[derive(Debug, Clone, Default)]
pub struct JobLeases {
    config: LeaseConfig,
    live: BTreeMap<JobId, Live>,
    /// Answered or failed jobs, until they are forgotten.
    finished: BTreeMap<JobId, UnixMillis>,
}

impl JobLeases {
    pub fn new(config: LeaseConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// Jobs waiting for a result.
    pub fn in_flight(&self) -> usize {
        self.live.len()
    }

    /// The live attempt of `job` and its holder.
    pub fn current(&self, job: JobId) -> Option<(u32, NodeKey)> {
        self.live.get(&job).map(|l| (l.attempt, l.holder.node))
    }

    /// Takes one event; returns what to do.
    pub fn handle(&mut self, event: LeaseEvent) -> Vec<LeaseAction> {
        let mut out = Vec::new();
        match event {
            LeaseEvent::Submit { job, holders, now } => {
                let holders = (1..).zip(holders).collect();
                return self.handle(LeaseEvent::SubmitAttempts { job, holders, now });
            }
            LeaseEvent::SubmitAttempts { job, holders, now } => {
                if self.live.contains_key(&job) || self.finished.contains_key(&job) {
                    out.push(LeaseAction::Failed {
                        job,
                        reason: JobFailure::DuplicateSubmit,
                    });
                } else {
                    self.dispatch(job, 0, holders.into(), now, &mut out);
                }
            }
            LeaseEvent::Progress {
                job,
                attempt,
                from,
                now,
            } => {
                if let Some(l) = self.live.get_mut(&job) {
                    if l.attempt == attempt && l.holder.node == from {
                        l.lease_until = lease_end(l.holder, now);
                    }
                }
            }
            LeaseEvent::Result {
                job,
                attempt,
                from,
                now,
            } => self.result(job, attempt, from, now, &mut out),
            LeaseEvent::HolderLeft { node, now } => {
                let held: Vec<JobId> = self
                    .live
                    .iter()
                    .filter(|(_, l)| l.holder.node == node)
                    .map(|(j, _)| *j)
                    .collect();
                for l in self.live.values_mut() {
                    l.untried.retain(|(_, h)| h.node != node);
                }
                for job in held {
                    self.expire(job, now, &mut out);
                }
            }
            LeaseEvent::Refused {
                job,
                attempt,
                from,
                now,
            } => {
                if self
                    .live
                    .get(&job)
                    .is_some_and(|l| l.attempt == attempt && l.holder.node == from)
                {
                    self.expire(job, now, &mut out);
                }
            }
            LeaseEvent::Tick { now } => {
                self.finished.retain(|_, until| *until > now);
                let due: Vec<JobId> = self
                    .live
                    .iter()
                    .filter(|(_, l)| l.lease_until <= now)
                    .map(|(j, _)| *j)
                    .collect();
                for job in due {
                    self.expire(job, now, &mut out);
                }
            }
        }
        out
    }

    fn result(
        &mut self,
        job: JobId,
        attempt: u32,
        from: NodeKey,
        now: UnixMillis,
        out: &mut Vec<LeaseAction>,
    ) {
        let drop = |reason| LeaseAction::DropResult {
            job,
            attempt,
            from,
            reason,
        };
        let Some(l) = self.live.get(&job) else {
            let reason = if self.finished.contains_key(&job) {
                DropReason::Duplicate
            } else {
                DropReason::UnknownJob
            };
            out.push(drop(reason));
            return;
        };
        if attempt != l.attempt {
            out.push(drop(DropReason::StaleAttempt { current: l.attempt }));
        } else if from != l.holder.node {
            out.push(drop(DropReason::NotTheHolder));
        } else {
            self.live.remove(&job);
            self.finished
                .insert(job, now.plus(self.config.remember_finished_ms));
            out.push(LeaseAction::Deliver { job, attempt, from });
        }
    }

    fn expire(&mut self, job: JobId, now: UnixMillis, out: &mut Vec<LeaseAction>) {
        let Some(l) = self.live.remove(&job) else {
            return;
        };
        out.push(LeaseAction::Expired {
            job,
            attempt: l.attempt,
            holder: l.holder.node,
        });
        self.dispatch(job, l.tries, l.untried, now, out);
    }

    /// Dispatches to the next untried candidate, `tries` holders having been tried.
    fn dispatch(
        &mut self,
        job: JobId,
        tries: u32,
        mut untried: VecDeque<(u32, Holder)>,
        now: UnixMillis,
        out: &mut Vec<LeaseAction>,
    ) {
        let holder = match untried.pop_front() {
            _ if tries >= self.config.max_attempts => {
                Err(JobFailure::TooManyAttempts { attempts: tries })
            }
            None => Err(JobFailure::NoHolderLeft { attempts: tries }),
            Some(h) => Ok(h),
        };
        let (attempt, holder) = match holder {
            Ok(h) => h,
            Err(reason) => {
                self.finished
                    .insert(job, now.plus(self.config.remember_finished_ms));
                out.push(LeaseAction::Failed { job, reason });
                return;
            }
        };
        let lease_until = lease_end(holder, now);
        out.push(LeaseAction::Dispatch {
            job,
            attempt,
            to: holder.node,
            lease_until,
        });
        self.live.insert(
            job,
            Live {
                attempt,
                holder,
                lease_until,
                tries: tries + 1,
                untried,
            },
        );
    }
}

fn lease_end(h: Holder, now: UnixMillis) -> UnixMillis {
    now.plus(h.tier.policy().lease_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(i: u8) -> NodeKey {
        NodeKey::from_bytes([i; 32])
    }
    fn holder(i: u8, tier: DeviceTier) -> Holder {
        Holder {
            node: node(i),
            tier,
        }
    }
    const JOB: JobId = JobId::from_bytes([1; 16]);

    fn submit(l: &mut JobLeases, holders: Vec<Holder>) -> Vec<LeaseAction> {
        l.handle(LeaseEvent::Submit {
            job: JOB,
            holders,
            now: UnixMillis(0),
        })
    }

    #[test]
    fn the_lease_length_follows_the_holders_tier() {
        let mut l = JobLeases::new(LeaseConfig::default());
        let a = submit(&mut l, vec![holder(1, DeviceTier::Phone)]);
        let phone = DeviceTier::Phone.policy().lease_ms;
        assert_eq!(
            a,
            vec![LeaseAction::Dispatch {
                job: JOB,
                attempt: 1,
                to: node(1),
                lease_until: UnixMillis(phone)
            }]
        );
        assert!(phone < DeviceTier::Server.policy().lease_ms);
    }

    #[test]
    fn a_lease_expiring_mid_job_redispatches_to_the_next_holder_with_the_next_attempt() {
        let mut l = JobLeases::new(LeaseConfig::default());
        let lease = DeviceTier::Laptop.policy().lease_ms;
        submit(
            &mut l,
            vec![holder(1, DeviceTier::Laptop), holder(2, DeviceTier::Server)],
        );
        // Progress renews the lease: half a lease later, then a full lease after that, it holds.
        l.handle(LeaseEvent::Progress {
            job: JOB,
            attempt: 1,
            from: node(1),
            now: UnixMillis(lease / 2),
        });
        assert!(l
            .handle(LeaseEvent::Tick {
                now: UnixMillis(lease)
            })
            .is_empty());
        // Then it goes silent mid-job.
        let a = l.handle(LeaseEvent::Tick {
            now: UnixMillis(lease / 2 + lease),
        });
        assert_eq!(
            a,
            vec![
                LeaseAction::Expired {
                    job: JOB,
                    attempt: 1,
                    holder: node(1)
                },
                LeaseAction::Dispatch {
                    job: JOB,
                    attempt: 2,
                    to: node(2),
                    lease_until: UnixMillis(
                        lease / 2 + lease + DeviceTier::Server.policy().lease_ms
                    )
                }
            ]
        );
        assert_eq!(l.current(JOB), Some((2, node(2))));
    }

    #[test]
    fn a_late_result_from_the_expired_attempt_is_dropped_and_the_client_gets_one_answer() {
        let mut l = JobLeases::new(LeaseConfig::default());
        submit(
            &mut l,
            vec![holder(1, DeviceTier::Phone), holder(2, DeviceTier::Phone)],
        );
        l.handle(LeaseEvent::Tick {
            now: UnixMillis(DeviceTier::Phone.policy().lease_ms),
        });
        let late = l.handle(LeaseEvent::Result {
            job: JOB,
            attempt: 1,
            from: node(1),
            now: UnixMillis(6_000),
        });
        assert_eq!(
            late,
            vec![LeaseAction::DropResult {
                job: JOB,
                attempt: 1,
                from: node(1),
                reason: DropReason::StaleAttempt { current: 2 }
            }]
        );
        let ok = l.handle(LeaseEvent::Result {
            job: JOB,
            attempt: 2,
            from: node(2),
            now: UnixMillis(7_000),
        });
        assert_eq!(
            ok,
            vec![LeaseAction::Deliver {
                job: JOB,
                attempt: 2,
                from: node(2)
            }]
        );
        assert_eq!(l.in_flight(), 0);
    }

    #[test]
    fn a_duplicate_result_is_dropped() {
        let mut l = JobLeases::new(LeaseConfig::default());
        submit(&mut l, vec![holder(1, DeviceTier::Server)]);
        let r = LeaseEvent::Result {
            job: JOB,
            attempt: 1,
            from: node(1),
            now: UnixMillis(100),
        };
        assert!(matches!(
            l.handle(r.clone())[..],
            [LeaseAction::Deliver { .. }]
        ));
        assert_eq!(
            l.handle(r.clone()),
            vec![LeaseAction::DropResult {
                job: JOB,
                attempt: 1,
                from: node(1),
                reason: DropReason::Duplicate
            }]
        );
        // Once forgotten, it is an unknown job: still dropped.
        l.handle(LeaseEvent::Tick {
            now: UnixMillis(100 + LeaseConfig::default().remember_finished_ms),
        });
        assert!(matches!(
            l.handle(r)[..],
            [LeaseAction::DropResult {
                reason: DropReason::UnknownJob,
                ..
            }]
        ));
    }

    #[test]
    fn a_result_from_a_node_that_does_not_hold_the_attempt_is_dropped() {
        let mut l = JobLeases::new(LeaseConfig::default());
        submit(&mut l, vec![holder(1, DeviceTier::Server)]);
        let a = l.handle(LeaseEvent::Result {
            job: JOB,
            attempt: 1,
            from: node(9),
            now: UnixMillis(1),
        });
        assert!(matches!(
            a[..],
            [LeaseAction::DropResult {
                reason: DropReason::NotTheHolder,
                ..
            }]
        ));
        assert_eq!(l.current(JOB), Some((1, node(1))));
    }

    #[test]
    fn the_holder_leaving_mid_job_moves_it_at_once_and_no_holder_left_is_an_explicit_failure() {
        let mut l = JobLeases::new(LeaseConfig::default());
        submit(
            &mut l,
            vec![holder(1, DeviceTier::Server), holder(2, DeviceTier::Server)],
        );
        let a = l.handle(LeaseEvent::HolderLeft {
            node: node(1),
            now: UnixMillis(10),
        });
        assert!(matches!(
            a[..],
            [
                LeaseAction::Expired { attempt: 1, .. },
                LeaseAction::Dispatch { attempt: 2, .. }
            ]
        ));
        let a = l.handle(LeaseEvent::HolderLeft {
            node: node(2),
            now: UnixMillis(20),
        });
        assert_eq!(
            a,
            vec![
                LeaseAction::Expired {
                    job: JOB,
                    attempt: 2,
                    holder: node(2)
                },
                LeaseAction::Failed {
                    job: JOB,
                    reason: JobFailure::NoHolderLeft { attempts: 2 }
                }
            ]
        );
        let mut l = JobLeases::new(LeaseConfig::default());
        assert_eq!(
            submit(&mut l, vec![]),
            vec![LeaseAction::Failed {
                job: JOB,
                reason: JobFailure::NoHolderLeft { attempts: 0 }
            }]
        );
    }

    #[test]
    fn a_refusal_by_the_holder_moves_the_job_on_and_one_by_anyone_else_is_ignored() {
        let mut l = JobLeases::new(LeaseConfig::default());
        let hs = (1..=2).map(|i| holder(i, DeviceTier::Server)).collect();
        submit(&mut l, hs);
        let refuse = |l: &mut JobLeases, attempt, from| {
            l.handle(LeaseEvent::Refused {
                job: JOB,
                attempt,
                from,
                now: UnixMillis(1),
            })
        };
        assert!(refuse(&mut l, 1, node(2)).is_empty());
        assert!(refuse(&mut l, 2, node(1)).is_empty());
        let a = refuse(&mut l, 1, node(1));
        assert!(matches!(a[1], LeaseAction::Dispatch { to, attempt: 2, .. } if to == node(2)));
        let a = refuse(&mut l, 2, node(2));
        assert_eq!(
            a[1],
            LeaseAction::Failed {
                job: JOB,
                reason: JobFailure::NoHolderLeft { attempts: 2 }
            }
        );
    }

    #[test]
    fn a_departed_node_is_not_tried_later_and_attempts_are_capped() {
        let mut l = JobLeases::new(LeaseConfig {
            max_attempts: 2,
            ..LeaseConfig::default()
        });
        let hs = (1..=4).map(|i| holder(i, DeviceTier::Phone)).collect();
        submit(&mut l, hs);
        l.handle(LeaseEvent::HolderLeft {
            node: node(2),
            now: UnixMillis(0),
        });
        let a = l.handle(LeaseEvent::Tick {
            now: UnixMillis(5_000),
        });
        // Node 3 was sealed attempt 3: node 2's turn is skipped, its number with it.
        assert!(matches!(a[1], LeaseAction::Dispatch { to, attempt: 3, .. } if to == node(3)));
        let a = l.handle(LeaseEvent::Tick {
            now: UnixMillis(10_000),
        });
        assert_eq!(
            a[1],
            LeaseAction::Failed {
                job: JOB,
                reason: JobFailure::TooManyAttempts { attempts: 2 }
            }
        );
        // A failed job is finished: its id is not dispatched again.
        assert_eq!(
            submit(&mut l, vec![holder(1, DeviceTier::Phone)]),
            vec![LeaseAction::Failed {
                job: JOB,
                reason: JobFailure::DuplicateSubmit
            }]
        );
    }
}
