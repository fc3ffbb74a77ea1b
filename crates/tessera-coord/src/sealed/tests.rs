use super::*;
use tessera_seal::{
    seal_job, seal_result, AnswerDigest, JobHeader, KernelPath, PublicKey, SecretKey,
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
                news: SealedNews::Result { result, verified },
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
    let fail = |out: Vec<SealedOutput>| match &out[..] {
        [SealedOutput::Tell {
            news: SealedNews::Failed { reason },
            ..
        }] => reason.clone(),
        other => panic!("expected a failure, got {other:?}"),
    };
    let job = JobId::from_bytes([2; 16]);
    let reason = fail(d.handle(SealedInput::Submit {
        client: 1,
        envelopes: envelopes(job, &[&stranger], &client.public_key()),
        now: T0,
    }));
    assert!(reason.contains("no worker claims"), "{reason}");
    let reason = fail(d.handle(SealedInput::Submit {
        client: 1,
        envelopes: envelopes(job, &[&a, &a], &client.public_key()),
        now: T0,
    }));
    assert!(reason.contains("two attempts"), "{reason}");
    let mut late = envelopes(job, &[&a], &client.public_key());
    late[0].header.attempt = 2;
    let reason = fail(d.handle(SealedInput::Submit {
        client: 1,
        envelopes: late,
        now: T0,
    }));
    assert!(reason.contains("attempts count"), "{reason}");
    // A node may not claim for another.
    assert!(d
        .offer_claims(a.node(), stranger.claims(1, &[MODEL]))
        .is_err());
}

#[test]
fn a_refusal_moves_the_job_on_but_a_replay_refusal_does_not() {
    let (a, b) = (W::new(1), W::new(2));
    let mut d = desk(None, &[&a, &b]);
    let client = SecretKey::derive(b"client");
    let job = JobId::from_bytes([3; 16]);
    d.handle(SealedInput::Submit {
        client: 1,
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
        envelopes: envelopes(JobId::from_bytes([3; 16]), &[&a, &b], &client.public_key()),
        now: T0,
    });
    assert_eq!(dispatched(&out), vec![(b.node(), 2)]);
    // Back from a new session, it claims again and is listed.
    d.offer_claims(a.node(), a.claims(1, &[MODEL])).unwrap();
    assert_eq!(d.holders(Some(MODEL)).len(), 2);
}
