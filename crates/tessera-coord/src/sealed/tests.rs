use super::*;
use tessera_seal::{
    seal_job, seal_result, AnswerDigest, Claims, JobHeader, KernelPath, PublicKey, SecretKey,
};

const MODEL: &str = "m0";
const BODY: &[u8] = br#"{"prompt_tokens":[1,2,3]}"#;

struct W {
    seed: [u8; 32],
    seal: SecretKey,
}

impl W {
    fn new(i: u8) -> Self {
        Self {
            seed: [i; 32],
            seal: SecretKey::derive(&[i; 40]),
        }
    }
    fn node(&self) -> NodeKey {
        NodeKey::of_seed(&self.seed)
    }
    fn claims(&self, epoch: u64, models: &[&str]) -> SignedClaims {
        Claims {
            node: self.node(),
            epoch,
            issued_at: UnixMillis(epoch),
            seal_key: self.seal.public_key(),
            models: models.iter().map(|m| m.to_string()).collect(),
            memory_bytes: 1 << 30,
            max_context: 4096,
            features: vec![],
            isa: "x86_64".into(),
            kernel_path: KernelPath::new("avx2"),
            tier: DeviceTier::Server,
        }
        .sign(&self.seed)
        .unwrap()
    }
    fn answer(&self, env: &JobEnvelope, tokens: &[u32]) -> ResultEnvelope {
        let body = env.open(&self.seal).unwrap();
        let digest = AnswerDigest::of_tokens(&body, tokens);
        seal_result(&env.header, &self.seal, digest, b"answer").unwrap()
    }
}

fn desk(per_mille: Option<u32>, workers: &[&W]) -> SealedDesk {
    let mut d = SealedDesk::new(SealedConfig {
        leases: LeaseConfig::default(),
        verify: verify_config([7; 32], per_mille.or(Some(0)), true),
        fault: None,
    });
    for w in workers {
        d.offer_claims(w.node(), w.claims(1, &[MODEL])).unwrap();
    }
    d
}

fn envelopes(job: JobId, to: &[&W], reply: &PublicKey) -> Vec<JobEnvelope> {
    to.iter()
        .enumerate()
        .map(|(i, w)| {
            let h = JobHeader {
                job,
                attempt: i as u32 + 1,
                recipient: w.seal.key_id(),
                model: MODEL.into(),
                context_tokens: 64,
                expires_at: UnixMillis(1_000_000),
                reply_to: *reply,
            };
            seal_job(&h, BODY, &w.seal.public_key()).unwrap()
        })
        .collect()
}

fn dispatched(out: &[SealedOutput]) -> Vec<(NodeKey, u32)> {
    out.iter()
        .filter_map(|o| match o {
            SealedOutput::Dispatch { to, envelope } => Some((*to, envelope.header.attempt)),
            _ => None,
        })
        .collect()
}

fn results(out: &[SealedOutput]) -> Vec<(ResultEnvelope, bool)> {
    out.iter()
        .filter_map(|o| match o {
            SealedOutput::Tell {
                news:
                    SealedNews::Result {
                        result, verified, ..
                    },
                ..
            } => Some((result.clone(), *verified)),
            _ => None,
        })
        .collect()
}

fn envelope_to(out: &[SealedOutput], node: NodeKey) -> JobEnvelope {
    out.iter()
        .find_map(|o| match o {
            SealedOutput::Dispatch { to, envelope } if *to == node => Some(envelope.clone()),
            _ => None,
        })
        .expect("dispatched to the node")
}

const T0: UnixMillis = UnixMillis(1_000);

#[test]
fn a_job_goes_to_its_first_candidate_and_its_result_to_the_client_once() {
    let (a, b) = (W::new(1), W::new(2));
    let mut d = desk(None, &[&a, &b]);
    let client = SecretKey::derive(b"client");
    let job = JobId::from_bytes([1; 16]);
    let out = d.handle(SealedInput::Submit {
        client: 9,
        verified_only: false,
        envelopes: envelopes(job, &[&a, &b], &client.public_key()),
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(a.node(), 1)]);
    let r = a.answer(&envelope_to(&out, a.node()), &[5, 6]);
    let out = d.handle(SealedInput::Result {
        result: r.clone(),
        from: a.node(),
        now: T0,
    });
    assert_eq!(results(&out), vec![(r.clone(), false)]);
    assert!(matches!(out[0], SealedOutput::Tell { client: 9, .. }));
    // The same result again is dropped: one answer.
    let out = d.handle(SealedInput::Result {
        result: r,
        from: a.node(),
        now: T0,
    });
    assert!(out.is_empty());
    assert_eq!(d.in_flight(), 0);
}

#[test]
fn envelopes_the_claims_do_not_back_are_refused_with_the_reason() {
    let (a, stranger) = (W::new(1), W::new(3));
    let mut d = desk(None, &[&a]);
    let client = SecretKey::derive(b"client");
    let job = JobId::from_bytes([2; 16]);
    let reason = failure(&d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: envelopes(job, &[&stranger], &client.public_key()),
        now: T0,
    }));
    let key = stranger.claims(1, &[MODEL]).claims.seal_key.key_id();
    assert_eq!(
        reason,
        SealedFailure::NoWorkerFits {
            passed_over: vec![Passed {
                attempt: 1,
                why: PassedOver::KeyNotClaimed { key }
            }]
        }
    );
    let mut late = envelopes(job, &[&a], &client.public_key());
    late[0].header.attempt = 2;
    let reason = failure(&d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: late,
        now: T0,
    }));
    assert_eq!(
        reason,
        SealedFailure::AttemptOutOfOrder {
            envelope: 1,
            carries: 2
        }
    );
    // Two attempts sealed to one worker: the second is skipped, the first runs.
    let out = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: envelopes(job, &[&a, &a], &client.public_key()),
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(a.node(), 1)]);
    assert_eq!(skipped(&out).len(), 1);
    assert_eq!(
        skipped(&out),
        vec![(2, PassedOver::SameWorker { worker: a.node() })]
    );
    // A node may not claim for another.
    assert!(d
        .offer_claims(a.node(), stranger.claims(1, &[MODEL]))
        .is_err());
}

fn failure(out: &[SealedOutput]) -> SealedFailure {
    out.iter()
        .find_map(|o| match o {
            SealedOutput::Tell {
                news: SealedNews::Failed { reason },
                ..
            } => Some(reason.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("expected a failure, got {out:?}"))
}

fn skipped(out: &[SealedOutput]) -> Vec<(u32, PassedOver)> {
    out.iter()
        .filter_map(|o| match o {
            SealedOutput::Tell {
                news: SealedNews::Skipped { attempt, reason },
                ..
            } => Some((*attempt, reason.clone())),
            _ => None,
        })
        .collect()
}

/// Envelopes of `positions` KV positions each.
fn sized(job: JobId, to: &[&W], positions: u64) -> Vec<JobEnvelope> {
    let reply = SecretKey::derive(b"client").public_key();
    to.iter()
        .enumerate()
        .map(|(i, w)| {
            let h = JobHeader {
                job,
                attempt: i as u32 + 1,
                recipient: w.seal.key_id(),
                model: MODEL.into(),
                context_tokens: positions,
                expires_at: UnixMillis(1_000_000),
                reply_to: reply,
            };
            seal_job(&h, BODY, &w.seal.public_key()).unwrap()
        })
        .collect()
}

#[test]
fn a_candidate_whose_key_was_rotated_is_skipped_and_the_next_runs_the_job() {
    let (a, b) = (W::new(1), W::new(2));
    let mut d = desk(None, &[&a, &b]);
    let job = JobId::from_bytes([40; 16]);
    let env = sized(job, &[&a, &b], 64);
    // `a` rotates its sealing key after the client sealed to the old one.
    let rotated = W {
        seed: a.seed,
        seal: SecretKey::derive(b"a's new key"),
    };
    d.offer_claims(a.node(), rotated.claims(2, &[MODEL]))
        .unwrap();
    let out = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: env,
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(b.node(), 2)]);
    let s = skipped(&out);
    assert_eq!(s.len(), 1, "{out:?}");
    assert_eq!(s[0].0, 1);
    assert!(
        matches!(s[0].1, PassedOver::KeyNotClaimed { .. }),
        "{}",
        s[0].1
    );
}

#[test]
fn a_job_too_big_for_a_workers_claimed_context_goes_to_one_with_room_or_fails_saying_why() {
    let (small, big) = (W::new(1), W::new(2));
    let mut d = desk(None, &[]);
    let mut c = small.claims(1, &[MODEL]).claims;
    c.max_context = 512;
    d.offer_claims(small.node(), c.sign(&small.seed).unwrap())
        .unwrap();
    d.offer_claims(big.node(), big.claims(1, &[MODEL])).unwrap();
    let job = JobId::from_bytes([41; 16]);
    let out = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: sized(job, &[&small, &big], 606),
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(big.node(), 2)]);
    let no_room = PassedOver::NoRoom {
        worker: small.node(),
        needs: 606,
        room: 512,
    };
    assert_eq!(skipped(&out), vec![(1, no_room.clone())]);
    // Only the small one: the job fails at once, and the reason names the sizes.
    let job = JobId::from_bytes([42; 16]);
    let out = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: sized(job, &[&small], 606),
        now: T0,
    });
    assert!(dispatched(&out).is_empty());
    assert_eq!(
        failure(&out),
        SealedFailure::NoWorkerFits {
            passed_over: vec![Passed {
                attempt: 1,
                why: no_room
            }]
        }
    );
}

#[test]
fn when_every_candidate_refuses_the_failure_says_what_each_said() {
    let (a, b) = (W::new(1), W::new(2));
    let mut d = desk(None, &[&a, &b]);
    let job = JobId::from_bytes([43; 16]);
    d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: sized(job, &[&a, &b], 64),
        now: T0,
    });
    let out = d.handle(SealedInput::Refused {
        job,
        attempt: 1,
        from: a.node(),
        reason: SealedRefusal::Authentication,
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(b.node(), 2)]);
    let out = d.handle(SealedInput::Refused {
        job,
        attempt: 2,
        from: b.node(),
        reason: SealedRefusal::CannotRun("out of memory".into()),
        now: T0,
    });
    let SealedFailure::NoCandidateLeft { passed_over, .. } = failure(&out) else {
        panic!("{out:?}")
    };
    let said: Vec<_> = passed_over
        .into_iter()
        .map(|p| (p.attempt, p.why))
        .collect();
    assert_eq!(
        said,
        vec![
            (
                1,
                PassedOver::Refused {
                    worker: a.node(),
                    reason: SealedRefusal::Authentication
                }
            ),
            (
                2,
                PassedOver::Refused {
                    worker: b.node(),
                    reason: SealedRefusal::CannotRun("out of memory".into())
                }
            )
        ]
    );
}

#[test]
fn phones_get_short_jobs_and_long_jobs_go_first_to_tiers_that_stay() {
    let (phone, laptop, server) = (W::new(1), W::new(2), W::new(3));
    let mut d = desk(None, &[]);
    for (w, tier) in [
        (&phone, DeviceTier::Phone),
        (&laptop, DeviceTier::Laptop),
        (&server, DeviceTier::Server),
    ] {
        let mut c = w.claims(1, &[MODEL]).claims;
        c.tier = tier;
        c.max_context = 1 << 20;
        d.offer_claims(w.node(), c.sign(&w.seed).unwrap()).unwrap();
    }
    // A short job keeps the client's order.
    let out = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: sized(
            JobId::from_bytes([50; 16]),
            &[&phone, &laptop, &server],
            100,
        ),
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(phone.node(), 1)]);
    // A long one goes to the server first (the laptop is expected to leave), and a job past
    // the phone tier's limit never goes to the phone.
    let out = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: sized(
            JobId::from_bytes([51; 16]),
            &[&phone, &laptop, &server],
            LONG_JOB_POSITIONS,
        ),
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(server.node(), 3)]);
    let out = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: sized(JobId::from_bytes([52; 16]), &[&phone], 5000),
        now: T0,
    });
    let SealedFailure::NoWorkerFits { passed_over } = failure(&out) else {
        panic!("{out:?}")
    };
    assert!(
        matches!(
            passed_over[0].why,
            PassedOver::TierTooSmall {
                tier: DeviceTier::Phone,
                needs: 5000,
                ..
            }
        ),
        "{passed_over:?}"
    );
}

#[test]
fn a_client_that_wants_verified_answers_gets_every_one_checked_with_the_witness() {
    let (a, b) = (W::new(1), W::new(2));
    // Rate 0: nothing is checked unless the client asks.
    let mut d = desk(Some(0), &[&a, &b]);
    let job = JobId::from_bytes([60; 16]);
    let out = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: true,
        envelopes: sized(job, &[&a, &b], 64),
        now: T0,
    });
    let first = a.answer(&envelope_to(&out, a.node()), &[7, 8]);
    let out = d.handle(SealedInput::Result {
        result: first.clone(),
        from: a.node(),
        now: T0,
    });
    assert!(results(&out).is_empty(), "held while checked: {out:?}");
    let second = b.answer(&envelope_to(&out, b.node()), &[7, 8]);
    let out = d.handle(SealedInput::Result {
        result: second.clone(),
        from: b.node(),
        now: T0,
    });
    let delivered: Vec<_> = out
        .iter()
        .filter_map(|o| match o {
            SealedOutput::Tell {
                news:
                    SealedNews::Result {
                        result,
                        verified,
                        witness,
                    },
                ..
            } => Some((result.clone(), *verified, witness.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(delivered, vec![(first, true, Some(second))]);
}

#[test]
fn a_refusal_moves_the_job_on_but_a_replay_refusal_does_not() {
    let (a, b) = (W::new(1), W::new(2));
    let mut d = desk(None, &[&a, &b]);
    let client = SecretKey::derive(b"client");
    let job = JobId::from_bytes([3; 16]);
    d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: envelopes(job, &[&a, &b], &client.public_key()),
        now: T0,
    });
    let out = d.handle(SealedInput::Refused {
        job,
        attempt: 1,
        from: a.node(),
        reason: SealedRefusal::Replayed,
        now: T0,
    });
    assert!(dispatched(&out).is_empty(), "{out:?}");
    let out = d.handle(SealedInput::Refused {
        job,
        attempt: 1,
        from: a.node(),
        reason: SealedRefusal::Authentication,
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(b.node(), 2)]);
}

#[test]
fn a_holder_that_leaves_mid_job_hands_it_to_the_next_and_its_late_result_is_dropped() {
    let (a, b) = (W::new(1), W::new(2));
    let mut d = desk(None, &[&a, &b]);
    let client = SecretKey::derive(b"client");
    let job = JobId::from_bytes([4; 16]);
    let first = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: envelopes(job, &[&a, &b], &client.public_key()),
        now: T0,
    });
    let out = d.handle(SealedInput::NodeLeft {
        node: a.node(),
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(b.node(), 2)]);
    let late = a.answer(&envelope_to(&first, a.node()), &[1]);
    assert!(d
        .handle(SealedInput::Result {
            result: late,
            from: a.node(),
            now: T0
        })
        .is_empty());
    let r = b.answer(&envelope_to(&out, b.node()), &[1]);
    let out = d.handle(SealedInput::Result {
        result: r.clone(),
        from: b.node(),
        now: T0,
    });
    assert_eq!(results(&out), vec![(r, false)]);
}

/// Runs one verified job: `primary` answers first; every worker answers `tokens_of(worker)`.
fn verified_job(
    d: &mut SealedDesk,
    n: u8,
    order: &[&W],
    tokens_of: &dyn Fn(&W) -> Vec<u32>,
) -> (ResultEnvelope, bool) {
    let client = SecretKey::derive(b"client");
    let job = JobId::from_bytes([n; 16]);
    let mut out = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: envelopes(job, order, &client.public_key()),
        now: T0,
    });
    for _ in 0..4 {
        let Some((to, _)) = dispatched(&out).first().copied() else {
            break;
        };
        let w = order.iter().find(|w| w.node() == to).unwrap();
        let r = w.answer(&envelope_to(&out, to), &tokens_of(w));
        out = d.handle(SealedInput::Result {
            result: r,
            from: to,
            now: T0,
        });
        if let Some(r) = results(&out).pop() {
            return r;
        }
    }
    panic!("no result: {out:?}");
}

#[test]
fn a_worker_that_alters_its_tokens_is_quarantined_and_the_client_gets_the_majority_answer() {
    let (a, b, c) = (W::new(1), W::new(2), W::new(3));
    let mut d = desk(Some(1000), &[&a, &b, &c]);
    let liar = a.node();
    let tokens = |w: &W| {
        if w.node() == liar {
            vec![9, 9]
        } else {
            vec![1, 2]
        }
    };
    let (r, verified) = verified_job(&mut d, 10, &[&a, &b, &c], &tokens);
    assert!(verified);
    assert_ne!(
        r.header.worker,
        a.seal.key_id(),
        "the liar's answer was delivered"
    );
    assert!(d.is_quarantined(&liar));
    assert!(!d.is_quarantined(&b.node()) && !d.is_quarantined(&c.node()));
    // It gets no more jobs, and is no longer offered to clients.
    assert!(d.holders(Some(MODEL)).iter().all(|s| s.claims.node != liar));
    let (r, _) = verified_job(&mut d, 11, &[&a, &b, &c], &tokens);
    assert_ne!(r.header.worker, a.seal.key_id());
}

#[test]
fn honest_workers_are_never_quarantined_in_200_verified_jobs() {
    let (a, b, c) = (W::new(1), W::new(2), W::new(3));
    let mut d = desk(Some(1000), &[&a, &b, &c]);
    let ws = [&a, &b, &c];
    for n in 0..200u8 {
        let order: Vec<&W> = (0..3).map(|i| ws[(n as usize + i) % 3]).collect();
        let (_, verified) = verified_job(&mut d, n, &order, &|_| vec![4, 2]);
        assert!(verified);
    }
    assert!(ws.iter().all(|w| !d.is_quarantined(&w.node())));
    let s = d.verify_stats();
    assert_eq!(
        (s.answers, s.selected, s.agreed, s.quarantined),
        (200, 200, 200, 0)
    );
}

#[test]
fn a_silent_replica_does_not_hold_the_answer_back_past_its_lease() {
    let (a, b) = (W::new(1), W::new(2));
    let mut d = desk(Some(1000), &[&a, &b]);
    let client = SecretKey::derive(b"client");
    let job = JobId::from_bytes([12; 16]);
    let out = d.handle(SealedInput::Submit {
        client: 1,
        verified_only: false,
        envelopes: envelopes(job, &[&a, &b], &client.public_key()),
        now: T0,
    });
    let r = a.answer(&envelope_to(&out, a.node()), &[3]);
    let out = d.handle(SealedInput::Result {
        result: r.clone(),
        from: a.node(),
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(b.node(), 2)], "checked on b");
    assert!(results(&out).is_empty(), "held back while checked");
    let lease = DeviceTier::Server.policy().lease_ms;
    // Progress renews the replica's lease.
    d.handle(SealedInput::Progress {
        job,
        attempt: 2,
        from: b.node(),
        tokens: 8,
        now: T0.plus(lease - 1),
    });
    assert!(d
        .handle(SealedInput::Tick {
            now: T0.plus(lease + 1)
        })
        .is_empty());
    // Then silence: no other peer to ask, so the answer goes out unverified.
    let out = d.handle(SealedInput::Tick {
        now: T0.plus(2 * lease),
    });
    assert_eq!(results(&out), vec![(r, false)]);
    assert_eq!(d.in_flight(), 0);
}

#[test]
fn a_departed_worker_is_unlisted_skipped_at_dispatch_and_listed_again_when_it_claims() {
    let (a, b) = (W::new(1), W::new(2));
    let mut d = desk(None, &[&a, &b]);
    d.handle(SealedInput::NodeLeft {
        node: a.node(),
        now: T0,
    });
    let listed: Vec<NodeKey> = d
        .holders(Some(MODEL))
        .iter()
        .map(|s| s.claims.node)
        .collect();
    assert_eq!(listed, vec![b.node()], "its claims are withdrawn");
    // A job sealed to it first (the client's list was older) goes to the next at once.
    let client = SecretKey::derive(b"client");
    let out = d.handle(SealedInput::Submit {
        client: 9,
        verified_only: false,
        envelopes: envelopes(JobId::from_bytes([3; 16]), &[&a, &b], &client.public_key()),
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(b.node(), 2)]);
    // Back from a new session, it claims again and is listed.
    d.offer_claims(a.node(), a.claims(1, &[MODEL])).unwrap();
    assert_eq!(d.holders(Some(MODEL)).len(), 2);
}
