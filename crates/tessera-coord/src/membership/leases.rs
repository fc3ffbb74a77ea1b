//! Leases: a member silent for longer than the lease (dead, frozen, cut off) is declared gone.
//!
//! Liveness is two events, like everything else in this machine: [`Event::Heard`] when anything
//! arrives on a member's control session, [`Event::Tick`] as time passes. Both carry the
//! shell's `now`, so the machine has no clock and a simulator can move time as it likes. A
//! member is first timed from the first tick after it joined, so a join never expires on a
//! stale reading.
//!
//! [`Event::Heard`]: super::Event::Heard
//! [`Event::Tick`]: super::Event::Tick

use std::collections::BTreeMap;
use std::time::Duration;

use tessera_net::NodeId;

use super::{Action, Departure, Membership};

/// The lease, and when each member was last heard from.
#[derive(Clone, Debug, Default)]
pub(super) struct Leases {
    /// `None`: leases are not enforced (no shell has set one).
    lease: Option<Duration>,
    last_heard: BTreeMap<NodeId, Duration>,
}

impl Leases {
    pub(super) fn heard(&mut self, node: NodeId, now: Duration) {
        let t = self.last_heard.entry(node).or_insert(now);
        *t = (*t).max(now);
    }

    /// A member that joins again starts a fresh lease.
    pub(super) fn forget(&mut self, node: &NodeId) {
        self.last_heard.remove(node);
    }
}

impl Membership {
    /// Sets the lease: a member silent this long is declared gone at the next [`Event::Tick`].
    ///
    /// [`Event::Tick`]: super::Event::Tick
    pub fn set_lease(&mut self, lease: Duration) {
        self.leases.lease = Some(lease);
    }

    pub fn lease(&self) -> Option<Duration> {
        self.leases.lease
    }

    pub(super) fn tick(&mut self, now: Duration) -> Vec<Action> {
        let Some(lease) = self.leases.lease else {
            return Vec::new();
        };
        let mut expired = Vec::new();
        for m in self.members.values().filter(|m| m.connected) {
            let last = *self.leases.last_heard.entry(m.node_id).or_insert(now);
            if now.saturating_sub(last) > lease {
                expired.push((m.node_id, m.session));
            }
        }
        let mut out = Vec::new();
        for (node, session) in expired {
            if let Some(m) = self.members.get_mut(&node) {
                m.connected = false;
            }
            self.leases.forget(&node);
            out.push(Action::LeaseExpired { node, session });
            out.extend(self.stage_lost(node, Departure::MissedLease));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{member, ready, MODEL};
    use super::super::{Action, Event, Membership, Phase};
    use std::time::Duration;

    const LEASE: Duration = Duration::from_millis(1000);
    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn two_stage_ring() -> (Membership, tessera_net::NodeId, tessera_net::NodeId) {
        let mut m = Membership::new();
        m.set_lease(LEASE);
        let (a, b) = (member(1), member(2));
        m.handle(Event::Joined(Box::new(a.clone())));
        m.handle(Event::Joined(Box::new(b.clone())));
        m.handle(Event::Plan {
            model: MODEL,
            stages: vec![(a.node_id, 0..2), (b.node_id, 2..4)],
            n_layer: 4,
            max_context: 64,
        });
        ready(&mut m);
        (m, a.node_id, b.node_id)
    }

    #[test]
    fn a_member_heard_within_its_lease_stays() {
        let (mut m, a, b) = two_stage_ring();
        assert!(m.handle(Event::Tick { now: ms(0) }).is_empty());
        for t in (250..=3000).step_by(250) {
            for n in [a, b] {
                m.handle(Event::Heard {
                    node: n,
                    session: 1,
                    now: ms(t),
                });
            }
            assert!(m.handle(Event::Tick { now: ms(t + 100) }).is_empty());
        }
        assert_eq!(m.epoch().unwrap().phase, Phase::Ready);
    }

    #[test]
    fn a_silent_stage_expires_and_its_epoch_is_replanned_on_the_survivor() {
        let (mut m, a, b) = two_stage_ring();
        m.handle(Event::Tick { now: ms(0) });
        m.handle(Event::Heard {
            node: a,
            session: 1,
            now: ms(900),
        });
        // Exactly one lease of silence is still within it.
        assert!(m.handle(Event::Tick { now: ms(1000) }).is_empty());
        let acts = m.handle(Event::Tick { now: ms(1001) });
        assert_eq!(
            acts[0],
            Action::LeaseExpired {
                node: b,
                session: 1
            }
        );
        assert!(!m.member(&b).unwrap().connected);
        let e = m.epoch().unwrap();
        assert_eq!(e.phase, Phase::Loading, "re-planned at once");
        assert_eq!(
            e.stages.iter().map(|s| s.node_id).collect::<Vec<_>>(),
            vec![a]
        );
    }

    #[test]
    fn a_message_in_flight_when_the_lease_expired_does_not_revive_the_session() {
        let (mut m, a, b) = two_stage_ring();
        m.handle(Event::Tick { now: ms(0) });
        m.handle(Event::Heard {
            node: a,
            session: 1,
            now: ms(1500),
        });
        m.handle(Event::Tick { now: ms(1500) });
        let epoch = m.epoch().unwrap().id;
        // b's heartbeat was on the wire when its lease ran out: it arrives after.
        assert!(m
            .handle(Event::Heard {
                node: b,
                session: 1,
                now: ms(1501)
            })
            .is_empty());
        assert!(!m.member(&b).unwrap().connected);
        // Its session ending afterwards changes nothing either (no second re-plan).
        assert!(m
            .handle(Event::Left {
                node: b,
                session: 1
            })
            .is_empty());
        assert_eq!(m.epoch().unwrap().id, epoch);
        // A load report of the lost epoch it still sends is stale.
        assert!(m
            .handle(Event::LoadFailed {
                node: b,
                epoch: epoch - 1,
                reason: "late".into()
            })
            .is_empty());
    }

    #[test]
    fn a_rejoined_member_gets_a_fresh_lease() {
        let (mut m, a, b) = two_stage_ring();
        m.handle(Event::Tick { now: ms(0) });
        m.handle(Event::Heard {
            node: a,
            session: 1,
            now: ms(1100),
        });
        m.handle(Event::Tick { now: ms(1100) });
        let mut b2 = member(2);
        b2.session = 2;
        m.handle(Event::Joined(Box::new(b2)));
        // Timed from the first tick after the join, not from its old silence.
        assert!(m.handle(Event::Tick { now: ms(1200) }).is_empty());
        m.handle(Event::Heard {
            node: a,
            session: 1,
            now: ms(2000),
        });
        assert!(m.handle(Event::Tick { now: ms(2100) }).is_empty());
        assert!(m.member(&b).unwrap().connected);
        let acts = m.handle(Event::Tick { now: ms(2201) });
        assert!(acts.contains(&Action::LeaseExpired {
            node: b,
            session: 2
        }));
    }

    #[test]
    fn only_a_stage_of_the_epoch_can_fail_it() {
        let (mut m, a, _) = two_stage_ring();
        let outsider = member(9);
        m.handle(Event::Joined(Box::new(outsider.clone())));
        let epoch = m.epoch().unwrap().id;
        for e in [
            Event::LoadFailed {
                node: outsider.node_id,
                epoch,
                reason: "forged".into(),
            },
            Event::LinkFailed {
                node: outsider.node_id,
                epoch,
                reason: "forged".into(),
                peer: Some(a),
            },
        ] {
            assert_eq!(
                m.handle(e),
                vec![Action::Refused {
                    node: outsider.node_id,
                    why: crate::authz::Refusal::NotAStageOfEpoch { epoch }
                }]
            );
            assert_eq!(m.epoch().unwrap().phase, Phase::Ready);
        }
        // A stage's own report still counts.
        m.handle(Event::LinkFailed {
            node: a,
            epoch,
            reason: "peer gone".into(),
            peer: None,
        });
        assert!(matches!(
            m.epoch().unwrap().phase,
            Phase::Failed(_) | Phase::Loading
        ));
    }
}
