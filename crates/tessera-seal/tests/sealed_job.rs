//! A sealed job's life across the pure machines, as the coordinator and workers will drive them:
//! the client seals one envelope per (holder, attempt), the lease machine dispatches, the first
//! holder goes silent mid-job, the job moves to the next holder with the next attempt, a replayed
//! envelope and a late result are refused, and the client opens exactly one answer.

use tessera_seal::*;

struct Worker {
    node: NodeKey,
    key: SecretKey,
    guard: ReplayGuard,
}

fn worker(i: u8) -> Worker {
    Worker {
        node: NodeKey::of_seed(&[i; 32]),
        key: SecretKey::derive(&[i; 32]),
        guard: ReplayGuard::new(120_000, 1_000),
    }
}

/// What the worker does with an envelope: open, check replay and expiry, answer.
fn run_job(w: &mut Worker, env: &JobEnvelope, now: UnixMillis) -> Result<ResultEnvelope, String> {
    let body = env.open(&w.key).map_err(|e| e.to_string())?;
    w.guard.admit(&env.header, now).map_err(|e| e.to_string())?;
    let answer = format!(
        "answer to {} from attempt {}",
        body.len(),
        env.header.attempt
    );
    let digest = AnswerDigest::of_tokens(&body, &[1, 2, 3]);
    seal_result(&env.header, &w.key, digest, answer.as_bytes()).map_err(|e| e.to_string())
}

#[test]
fn a_job_whose_holder_goes_silent_completes_on_the_next_holder_with_one_answer() {
    let mut workers = [worker(1), worker(2)];
    let client = SecretKey::derive(b"client");
    let job = JobId::from_bytes([9; 16]);
    let t0 = UnixMillis(1_000_000);
    // The client seals the request for each candidate, attempt by attempt.
    let envelopes: Vec<JobEnvelope> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let header = JobHeader {
                job,
                attempt: i as u32 + 1,
                recipient: w.key.key_id(),
                model: "qwen3-0.6b".into(),
                context_tokens: 2048,
                expires_at: t0.plus(60_000),
                reply_to: client.public_key(),
            };
            seal_job(&header, b"{\"prompt\":\"MARKER\"}", &w.key.public_key()).unwrap()
        })
        .collect();
    let mut leases = JobLeases::new(LeaseConfig::default());
    let holders = workers
        .iter()
        .map(|w| Holder {
            node: w.node,
            tier: DeviceTier::Laptop,
        })
        .collect();
    let a = leases.handle(LeaseEvent::Submit {
        job,
        holders,
        now: t0,
    });
    let [LeaseAction::Dispatch { attempt: 1, to, .. }] = a[..] else {
        panic!("{a:?}")
    };
    assert_eq!(to, workers[0].node);
    // Worker 1 opens its envelope and starts, then goes silent past its lease.
    let late = run_job(&mut workers[0], &envelopes[0], t0).unwrap();
    let expiry = t0.plus(DeviceTier::Laptop.policy().lease_ms);
    let a = leases.handle(LeaseEvent::Tick { now: expiry });
    assert!(matches!(
        a[..],
        [
            LeaseAction::Expired { attempt: 1, .. },
            LeaseAction::Dispatch { attempt: 2, to, .. }
        ] if to == workers[1].node
    ));
    // The coordinator tries to send worker 2 the old envelope, re-addressed: authentication fails.
    let mut readdressed = envelopes[0].clone();
    readdressed.header.recipient = workers[1].key.key_id();
    readdressed.header.attempt = 2;
    let err = run_job(&mut workers[1], &readdressed, expiry).unwrap_err();
    assert!(err.starts_with("authentication failed"), "{err}");
    // The genuine attempt-2 envelope runs once; sent again it is a replay.
    let result = run_job(&mut workers[1], &envelopes[1], expiry).unwrap();
    let err = run_job(&mut workers[1], &envelopes[1], expiry).unwrap_err();
    assert!(err.contains("replay refused"), "{err}");
    // Worker 1's late result is dropped; worker 2's is delivered; a duplicate is dropped.
    let mut delivered = Vec::new();
    for (r, from) in [
        (&late, workers[0].node),
        (&result, workers[1].node),
        (&result, workers[1].node),
    ] {
        for a in leases.handle(LeaseEvent::Result {
            job,
            attempt: r.header.attempt,
            from,
            now: expiry.plus(100),
        }) {
            if let LeaseAction::Deliver { .. } = a {
                delivered.push(r.clone());
            }
        }
    }
    assert_eq!(delivered.len(), 1);
    let (attempt, text) = delivered[0]
        .open(&client, &workers[1].key.public_key(), job)
        .unwrap();
    assert_eq!(attempt, 2);
    assert_eq!(text, b"answer to 19 from attempt 2");
    // Both workers ran the same request to the same tokens: their digests agree, for verification.
    assert_eq!(late.header.answer, result.header.answer);
    // What the coordinator handled never held the prompt or the answer in clear.
    for bytes in [
        envelopes[0].to_bytes(),
        envelopes[1].to_bytes(),
        result.to_bytes(),
    ] {
        assert!(!bytes.windows(6).any(|w| w == b"MARKER"));
        assert!(!bytes.windows(6).any(|w| w == b"answer"));
    }
}

#[test]
fn an_envelope_past_its_expiry_is_refused_even_though_it_authenticates() {
    let mut w = worker(3);
    let client = SecretKey::derive(b"client");
    let header = JobHeader {
        job: JobId::from_bytes([4; 16]),
        attempt: 1,
        recipient: w.key.key_id(),
        model: "m".into(),
        context_tokens: 1,
        expires_at: UnixMillis(5_000),
        reply_to: client.public_key(),
    };
    let env = seal_job(&header, b"{}", &w.key.public_key()).unwrap();
    let err = run_job(&mut w, &env, UnixMillis(5_000)).unwrap_err();
    assert!(err.contains("expired"), "{err}");
}
