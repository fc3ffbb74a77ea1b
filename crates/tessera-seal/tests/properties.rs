//! Properties: hostile bytes never panic the parsers, headers round-trip, and under any schedule
//! of results, progress, departures and ticks the lease machine delivers at most one answer per
//! job, only from the live attempt's holder.

use proptest::prelude::*;
use tessera_seal::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic_the_parsers(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = JobEnvelope::from_bytes(&bytes);
        let _ = ResultEnvelope::from_bytes(&bytes);
        let _ = JobHeader::from_canonical(&bytes);
        let _ = ResultHeader::from_canonical(&bytes);
        let _ = Claims::from_canonical(&bytes);
        let _ = SecretKey::from_file_text(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn a_job_header_round_trips_through_its_canonical_bytes(
        job in any::<[u8; 16]>(), attempt in 1u32.., model in "[a-z0-9.-]{1,40}",
        context in any::<u64>(), expires in any::<u64>(), key in any::<[u8; 32]>(),
    ) {
        let h = JobHeader {
            job: JobId::from_bytes(job),
            attempt,
            recipient: PublicKey::from_bytes(key).key_id(),
            model,
            context_tokens: context,
            expires_at: UnixMillis(expires),
            reply_to: PublicKey::from_bytes(key),
        };
        prop_assert_eq!(JobHeader::from_canonical(&h.canonical_bytes()).unwrap(), h);
    }

    #[test]
    fn the_lease_machine_delivers_at_most_one_answer_per_job(
        steps in proptest::collection::vec((0u8..5, 0u8..3, 1u32..5, 0u8..4, 0u64..4_000), 1..80)
    ) {
        let node = |i: u8| NodeKey::from_bytes([i; 32]);
        let mut l = JobLeases::new(LeaseConfig::default());
        let jobs: Vec<JobId> = (0..3u8).map(|j| JobId::from_bytes([j; 16])).collect();
        let mut now = UnixMillis(0);
        for &job in &jobs {
            let holders = (0..4u8)
                .map(|i| Holder { node: node(i), tier: DeviceTier::ALL[usize::from(i)] })
                .collect();
            l.handle(LeaseEvent::Submit { job, holders, now });
        }
        let mut delivered = std::collections::BTreeMap::new();
        for (kind, j, attempt, n, dt) in steps {
            now = now.plus(dt);
            let job = jobs[usize::from(j)];
            let live = l.current(job);
            let event = match kind {
                0 => LeaseEvent::Result { job, attempt, from: node(n), now },
                1 => LeaseEvent::Progress { job, attempt, from: node(n), now },
                2 => LeaseEvent::HolderLeft { node: node(n), now },
                3 => match live {
                    // A result from the live holder, so deliveries happen.
                    Some((a, h)) => LeaseEvent::Result { job, attempt: a, from: h, now },
                    None => LeaseEvent::Tick { now },
                },
                _ => LeaseEvent::Tick { now },
            };
            for a in l.handle(event.clone()) {
                if let LeaseAction::Deliver { job, attempt, from } = a {
                    prop_assert_eq!(live, Some((attempt, from)), "{:?}", event);
                    prop_assert!(delivered.insert(job, attempt).is_none(), "second answer for {:?}", job);
                }
            }
        }
    }
}
