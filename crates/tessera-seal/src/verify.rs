//! Verification by replication, as a policy machine: a share of answers (per device tier) is re-run
//! on a second worker and the token ids compared exactly; on a mismatch a third worker decides, and
//! the odd one out is quarantined with its reputation lowered.
//!
//! Exact comparison is sound because Tessera's kernels are deterministic and sampling depends only
//! on (seed, position), so an honest worker on the same kernel path produces the same tokens,
//! greedy or seeded. Across kernel paths (AVX-512, AVX2, scalar…) logits may differ in the last
//! bits and flip a token, so unless [`VerifyConfig::cross_kernel_comparable`] says otherwise, only
//! workers on the primary's kernel path are asked to replicate.
//!
//! Which answers are checked, and which peer checks them, follow from a secret seed and the job id
//! (keyed blake3): deterministic for tests and replays, unpredictable to workers. No clock, no I/O.

use std::collections::{BTreeMap, BTreeSet};

use crate::claims::{KernelPath, NodeKey};
use crate::envelope::JobId;
use crate::tier::DeviceTier;

/// A worker as verification sees it (from its claims).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub node: NodeKey,
    pub kernel_path: KernelPath,
    pub tier: DeviceTier,
    /// The operator who certified it, where known: an answer is never checked by a machine of
    /// the same operator (who could make both answers alike).
    pub operator: Option<NodeKey>,
}

/// What two answers are compared by: a keyed hash of the token ids, the key derived from the
/// request body. Equal digests mean equal token ids (the comparison is exact); and since the key
/// comes from the sealed request, a coordinator that sees digests (in a result's authenticated
/// header, [`crate::ResultHeader::answer`]) learns whether two workers agreed and nothing about
/// the tokens, so verification works in sealed mode too.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AnswerDigest([u8; 32]);

const ANSWER_KEY_CONTEXT: &str = "tessera-seal 2026 answer digest key v1";

impl AnswerDigest {
    /// The digest of generated token ids for the request `request_body` (the bytes sealed).
    pub fn of_tokens(request_body: &[u8], tokens: &[u32]) -> Self {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        Self::of_bytes(request_body, &bytes)
    }

    /// The digest of any answer bytes (where token ids are not at hand).
    pub fn of_bytes(request_body: &[u8], answer: &[u8]) -> Self {
        let key = blake3::derive_key(ANSWER_KEY_CONTEXT, request_body);
        Self(*blake3::keyed_hash(&key, answer).as_bytes())
    }

    pub fn from_bytes(b: [u8; 32]) -> Self {
        Self(b)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for AnswerDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AnswerDigest({})", crate::canonical::hex(&self.0[..8]))
    }
}

impl std::fmt::Display for AnswerDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&crate::canonical::hex(&self.0))
    }
}

impl std::str::FromStr for AnswerDigest {
    type Err = crate::FormatError;
    fn from_str(s: &str) -> Result<Self, crate::FormatError> {
        crate::canonical::unhex(s, "answer digest").map(Self)
    }
}
crate::keys::serde_via_string!(AnswerDigest);

/// Inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyEvent {
    /// A job's answer from the worker that ran it; `peers` are the other workers that hold the
    /// model (candidates to replicate it).
    Answered {
        job: JobId,
        worker: Worker,
        answer: AnswerDigest,
        peers: Vec<Worker>,
        /// Check it whatever the tier's rate (the client asked for verified answers only).
        always: bool,
    },
    /// A replica asked for by [`VerifyAction::Replicate`] answered.
    ReplicaAnswered {
        job: JobId,
        worker: NodeKey,
        answer: AnswerDigest,
    },
    /// A replica could not run (left, refused, timed out): another peer is tried.
    ReplicaFailed { job: JobId, worker: NodeKey },
}

/// Outputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyAction {
    /// Run the same request (same seed and sampling) on `to`, and report its answer. `round` is 2
    /// for the second opinion, 3 for the tie-break.
    Replicate { job: JobId, to: NodeKey, round: u8 },
    /// The replicas agreed with the answer.
    Agreed { job: JobId, workers: Vec<NodeKey> },
    /// `node` disagreed with two others: stop routing to it.
    Quarantine {
        job: JobId,
        node: NodeKey,
        reputation: Reputation,
    },
    /// Verification could not conclude.
    Inconclusive { job: JobId, reason: Inconclusive },
}

/// Why a verification did not conclude.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inconclusive {
    /// No other unquarantined worker on a comparable kernel path holds the model.
    NoComparablePeer { round: u8 },
    /// Three workers gave three different answers: nobody is quarantined on that.
    AllDiffer,
}

/// A worker's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reputation {
    /// Verifications where it sided with the majority.
    pub agreed: u32,
    /// Verifications where it was the odd one out.
    pub disagreed: u32,
    pub quarantined: bool,
}

impl Reputation {
    /// Higher is better: agreements minus a heavy penalty per disagreement.
    pub fn score(&self) -> i64 {
        i64::from(self.agreed) - 100 * i64::from(self.disagreed)
    }
}

/// Settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyConfig {
    /// Secret seed for choosing jobs and peers.
    pub seed: [u8; 32],
    /// Share of answers verified per tier, in thousandths (default: [`DeviceTier::policy`]).
    pub per_mille: BTreeMap<DeviceTier, u32>,
    /// Whether different kernel paths give bit-identical tokens (so may be compared).
    pub cross_kernel_comparable: bool,
}

impl VerifyConfig {
    pub fn new(seed: [u8; 32]) -> Self {
        Self {
            seed,
            per_mille: DeviceTier::ALL
                .into_iter()
                .map(|t| (t, t.policy().verify_per_mille))
                .collect(),
            cross_kernel_comparable: false,
        }
    }
}

/// Counts behind the cost of verification: replicas run per answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VerifyStats {
    pub answers: u64,
    pub selected: u64,
    pub replicas_requested: u64,
    pub agreed: u64,
    pub quarantined: u64,
    pub inconclusive: u64,
}

#[derive(Debug, Clone)]
struct Pending {
    kernel_path: KernelPath,
    operator: Option<NodeKey>,
    peers: Vec<Worker>,
    /// Answers so far, in order: the primary's first.
    answers: Vec<(NodeKey, AnswerDigest)>,
    /// The replica being waited for, and its round.
    waiting: (NodeKey, u8),
    /// Everyone asked so far (answered or failed): not asked again.
    asked: BTreeSet<NodeKey>,
}

/// The verification machine.
#[derive(Debug, Clone)]
pub struct Verifier {
    config: VerifyConfig,
    pending: BTreeMap<JobId, Pending>,
    reputation: BTreeMap<NodeKey, Reputation>,
    stats: VerifyStats,
}

impl Verifier {
    pub fn new(config: VerifyConfig) -> Self {
        Self {
            config,
            pending: BTreeMap::new(),
            reputation: BTreeMap::new(),
            stats: VerifyStats::default(),
        }
    }

    /// Whether an answer to `job` from a worker of `tier` is verified: a keyed hash of the job id
    /// against the tier's rate.
    pub fn selects(&self, job: JobId, tier: DeviceTier) -> bool {
        let rate = self.config.per_mille.get(&tier).copied().unwrap_or(0);
        self.draw(b"select", job, 0) % 1000 < u64::from(rate)
    }

    pub fn is_quarantined(&self, node: &NodeKey) -> bool {
        self.reputation.get(node).is_some_and(|r| r.quarantined)
    }

    pub fn reputation(&self, node: &NodeKey) -> Reputation {
        self.reputation.get(node).copied().unwrap_or_default()
    }

    pub fn stats(&self) -> VerifyStats {
        self.stats
    }

    /// Takes one event; returns what to do.
    pub fn handle(&mut self, event: VerifyEvent) -> Vec<VerifyAction> {
        let mut out = Vec::new();
        match event {
            VerifyEvent::Answered {
                job,
                worker,
                answer,
                peers,
                always,
            } => {
                self.stats.answers += 1;
                if self.pending.contains_key(&job) || !(always || self.selects(job, worker.tier)) {
                    return out;
                }
                self.stats.selected += 1;
                let mut p = Pending {
                    kernel_path: worker.kernel_path.clone(),
                    operator: worker.operator,
                    peers,
                    answers: vec![(worker.node, answer)],
                    waiting: (worker.node, 1),
                    asked: BTreeSet::from([worker.node]),
                };
                if self.ask(job, &mut p, 2, &mut out) {
                    self.pending.insert(job, p);
                }
            }
            VerifyEvent::ReplicaAnswered {
                job,
                worker,
                answer,
            } => {
                let Some(mut p) = self.pending.remove(&job) else {
                    return out;
                };
                if p.waiting.0 != worker {
                    self.pending.insert(job, p);
                    return out;
                }
                p.answers.push((worker, answer));
                if self.conclude(job, &mut p, &mut out) {
                    return out;
                }
                self.pending.insert(job, p);
            }
            VerifyEvent::ReplicaFailed { job, worker } => {
                let Some(mut p) = self.pending.remove(&job) else {
                    return out;
                };
                if p.waiting.0 != worker {
                    self.pending.insert(job, p);
                    return out;
                }
                let round = p.waiting.1;
                if self.ask(job, &mut p, round, &mut out) {
                    self.pending.insert(job, p);
                }
            }
        }
        out
    }

    /// With a new answer in: decides, or asks a third worker. Returns whether the job is done.
    fn conclude(&mut self, job: JobId, p: &mut Pending, out: &mut Vec<VerifyAction>) -> bool {
        match &p.answers[..] {
            [(a, ta), (b, tb)] => {
                if ta == tb {
                    let workers = vec![*a, *b];
                    self.agree(job, workers, out);
                    true
                } else {
                    !self.ask(job, p, 3, out)
                }
            }
            [(a, ta), (b, tb), (c, tc)] => {
                let (odd, majority) = if ta == tc {
                    (*b, vec![*a, *c])
                } else if tb == tc {
                    (*a, vec![*b, *c])
                } else if ta == tb {
                    // Unreachable in practice (round 3 follows a mismatch), kept total.
                    (*c, vec![*a, *b])
                } else {
                    self.stats.inconclusive += 1;
                    out.push(VerifyAction::Inconclusive {
                        job,
                        reason: Inconclusive::AllDiffer,
                    });
                    return true;
                };
                let r = self.reputation.entry(odd).or_default();
                r.disagreed += 1;
                r.quarantined = true;
                let reputation = *r;
                self.stats.quarantined += 1;
                out.push(VerifyAction::Quarantine {
                    job,
                    node: odd,
                    reputation,
                });
                self.agree(job, majority, out);
                true
            }
            _ => true,
        }
    }

    fn agree(&mut self, job: JobId, workers: Vec<NodeKey>, out: &mut Vec<VerifyAction>) {
        for w in &workers {
            self.reputation.entry(*w).or_default().agreed += 1;
        }
        self.stats.agreed += 1;
        out.push(VerifyAction::Agreed { job, workers });
    }

    /// Asks the next eligible peer for `round`; when none is left, says so and returns false.
    fn ask(&mut self, job: JobId, p: &mut Pending, round: u8, out: &mut Vec<VerifyAction>) -> bool {
        let mut eligible: Vec<&Worker> = p
            .peers
            .iter()
            .filter(|w| !p.asked.contains(&w.node) && !self.is_quarantined(&w.node))
            .filter(|w| self.config.cross_kernel_comparable || w.kernel_path == p.kernel_path)
            .filter(|w| p.operator.is_none() || w.operator != p.operator)
            .collect();
        // Checks go to machines that stay (workstations, servers) when there are any.
        if eligible.iter().any(|w| !w.tier.policy().expected_to_leave) {
            eligible.retain(|w| !w.tier.policy().expected_to_leave);
        }
        eligible.sort_by_key(|w| w.node);
        eligible.dedup_by_key(|w| w.node);
        if eligible.is_empty() {
            self.stats.inconclusive += 1;
            out.push(VerifyAction::Inconclusive {
                job,
                reason: Inconclusive::NoComparablePeer { round },
            });
            return false;
        }
        let pick = self.draw(b"peer", job, u64::from(round) << 32 | p.asked.len() as u64);
        let to = eligible[(pick % eligible.len() as u64) as usize].node;
        p.asked.insert(to);
        p.waiting = (to, round);
        self.stats.replicas_requested += 1;
        out.push(VerifyAction::Replicate { job, to, round });
        true
    }

    fn draw(&self, what: &[u8], job: JobId, n: u64) -> u64 {
        let mut h = blake3::Hasher::new_keyed(&self.config.seed);
        h.update(what);
        h.update(job.as_bytes());
        h.update(&n.to_be_bytes());
        u64::from_be_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(i: u8, path: &str) -> Worker {
        Worker {
            node: NodeKey::from_bytes([i; 32]),
            kernel_path: KernelPath::new(path),
            tier: DeviceTier::Phone,
            operator: None,
        }
    }

    /// The tokens an honest worker produces for job `j`.
    fn honest(j: JobId) -> Vec<u32> {
        j.as_bytes().iter().map(|&b| u32::from(b) * 7 + 1).collect()
    }

    fn digest(tokens: &[u32]) -> AnswerDigest {
        AnswerDigest::of_tokens(b"{\"prompt\":\"p\"}", tokens)
    }

    /// Runs verification to its end: replicas answer with `answer(worker, job)`.
    fn run(
        v: &mut Verifier,
        job: JobId,
        primary: &Worker,
        peers: &[Worker],
        answer: &dyn Fn(&NodeKey, JobId) -> Vec<u32>,
    ) -> Vec<VerifyAction> {
        let mut all = Vec::new();
        let mut next = v.handle(VerifyEvent::Answered {
            job,
            worker: primary.clone(),
            answer: digest(&answer(&primary.node, job)),
            peers: peers.to_vec(),
            always: false,
        });
        while let Some(a) = next.first().cloned() {
            all.extend(next.iter().cloned());
            next = match a {
                VerifyAction::Replicate { job, to, .. } => v.handle(VerifyEvent::ReplicaAnswered {
                    job,
                    worker: to,
                    answer: digest(&answer(&to, job)),
                }),
                _ => Vec::new(),
            };
        }
        all
    }

    fn all_verified() -> VerifyConfig {
        let mut c = VerifyConfig::new([42; 32]);
        c.per_mille.insert(DeviceTier::Phone, 1000);
        c
    }

    #[test]
    fn honest_workers_are_never_quarantined_over_200_verified_requests() {
        let mut v = Verifier::new(all_verified());
        let ws: Vec<Worker> = (1..=4).map(|i| worker(i, "avx2")).collect();
        for j in 0..200u128 {
            let job = JobId::from_bytes(j.to_be_bytes());
            let primary = &ws[j as usize % 4];
            let acts = run(&mut v, job, primary, &ws, &|_, j| honest(j));
            assert!(
                matches!(acts.last(), Some(VerifyAction::Agreed { .. })),
                "{acts:?}"
            );
        }
        let s = v.stats();
        assert_eq!((s.selected, s.agreed, s.quarantined), (200, 200, 0));
        // One replica per verified answer: the cost of verification at rate 1.
        assert_eq!(s.replicas_requested, 200);
        assert!(ws.iter().all(|w| !v.is_quarantined(&w.node)));
    }

    #[test]
    fn a_worker_that_alters_its_tokens_is_caught_and_quarantined() {
        let mut v = Verifier::new(all_verified());
        let ws: Vec<Worker> = (1..=4).map(|i| worker(i, "avx2")).collect();
        let liar = ws[2].node;
        let answer = |w: &NodeKey, j: JobId| {
            let mut t = honest(j);
            if *w == liar {
                *t.last_mut().unwrap() += 1;
            }
            t
        };
        let mut caught_at = None;
        for j in 0..50u128 {
            let job = JobId::from_bytes(j.to_be_bytes());
            let primary = &ws[j as usize % 4];
            let acts = run(&mut v, job, primary, &ws, &answer);
            if acts
                .iter()
                .any(|a| matches!(a, VerifyAction::Quarantine { node, .. } if *node == liar))
            {
                caught_at.get_or_insert(j);
            }
        }
        // The liar answers as primary on job 2: verified at rate 1, it is caught then at latest.
        assert!(caught_at.is_some_and(|j| j <= 2), "{caught_at:?}");
        assert!(v.is_quarantined(&liar));
        assert!(v.reputation(&liar).score() < 0);
        for w in ws.iter().filter(|w| w.node != liar) {
            assert!(!v.is_quarantined(&w.node));
            assert!(v.reputation(&w.node).score() > 0);
        }
        // Once quarantined it is never asked to replicate again.
        let job = JobId::from_bytes([0xee; 16]);
        let acts = run(&mut v, job, &ws[0], &ws, &answer);
        assert!(acts
            .iter()
            .all(|a| !matches!(a, VerifyAction::Replicate { to, .. } if *to == liar)));
    }

    #[test]
    fn only_workers_on_the_same_kernel_path_are_compared() {
        let mut v = Verifier::new(all_verified());
        let primary = worker(1, "avx512");
        let peers = vec![worker(2, "avx2"), worker(3, "scalar"), worker(4, "avx512")];
        for j in 0..20u128 {
            let job = JobId::from_bytes(j.to_be_bytes());
            for a in run(&mut v, job, &primary, &peers, &|_, j| honest(j)) {
                if let VerifyAction::Replicate { to, .. } = a {
                    assert_eq!(to, peers[2].node);
                }
            }
        }
        // With no peer on its path, verification says so instead of comparing across paths.
        let job = JobId::from_bytes([0xab; 16]);
        let acts = run(&mut v, job, &primary, &peers[..2], &|_, j| honest(j));
        assert_eq!(
            acts,
            vec![VerifyAction::Inconclusive {
                job,
                reason: Inconclusive::NoComparablePeer { round: 2 }
            }]
        );
        // When paths are declared bit-identical, any path may replicate.
        let mut c = all_verified();
        c.cross_kernel_comparable = true;
        let mut v = Verifier::new(c);
        let acts = run(&mut v, job, &primary, &peers[..2], &|_, j| honest(j));
        assert!(matches!(acts.last(), Some(VerifyAction::Agreed { .. })));
    }

    #[test]
    fn three_different_answers_quarantine_nobody() {
        let mut v = Verifier::new(all_verified());
        let ws: Vec<Worker> = (1..=3).map(|i| worker(i, "avx2")).collect();
        let job = JobId::from_bytes([5; 16]);
        let acts = run(&mut v, job, &ws[0], &ws, &|w, _| {
            vec![u32::from(w.as_bytes()[0])]
        });
        assert_eq!(
            acts.last(),
            Some(&VerifyAction::Inconclusive {
                job,
                reason: Inconclusive::AllDiffer
            })
        );
        assert!(ws.iter().all(|w| !v.is_quarantined(&w.node)));
    }

    #[test]
    fn an_answer_the_client_wants_verified_is_checked_whatever_the_rate() {
        let mut v = Verifier::new(VerifyConfig::new([1; 32]));
        let ws: Vec<Worker> = (1..=2).map(|i| worker(i, "avx2")).collect();
        for j in 0..50u8 {
            let job = JobId::from_bytes([j; 16]);
            let mut c = VerifyConfig::new([1; 32]);
            c.per_mille.insert(DeviceTier::Phone, 0);
            let mut v0 = Verifier::new(c);
            let ev = |always| VerifyEvent::Answered {
                job,
                worker: ws[0].clone(),
                answer: digest(&honest(job)),
                peers: ws.clone(),
                always,
            };
            assert!(v0.handle(ev(false)).is_empty(), "rate 0 checks nothing");
            let a = v.handle(ev(true));
            assert!(
                matches!(a[..], [VerifyAction::Replicate { to, .. }] if to == ws[1].node),
                "{a:?}"
            );
        }
    }

    #[test]
    fn an_answer_is_never_checked_by_a_worker_of_the_same_operator() {
        let op = |w: Worker, o: u8| Worker {
            operator: Some(NodeKey::from_bytes([o; 32])),
            ..w
        };
        let primary = op(worker(1, "avx2"), 9);
        let same = op(worker(2, "avx2"), 9);
        let other = op(worker(3, "avx2"), 8);
        for j in 0..40u8 {
            let mut v = Verifier::new(all_verified());
            let job = JobId::from_bytes([j; 16]);
            let a = v.handle(VerifyEvent::Answered {
                job,
                worker: primary.clone(),
                answer: digest(&honest(job)),
                peers: vec![same.clone(), other.clone()],
                always: false,
            });
            assert!(
                matches!(a[..], [VerifyAction::Replicate { to, .. }] if to == other.node),
                "{a:?}"
            );
            // With only a peer of the same operator, the check cannot conclude.
            let mut v = Verifier::new(all_verified());
            let a = v.handle(VerifyEvent::Answered {
                job,
                worker: primary.clone(),
                answer: digest(&honest(job)),
                peers: vec![same.clone()],
                always: false,
            });
            assert!(
                matches!(a[..], [VerifyAction::Inconclusive { .. }]),
                "{a:?}"
            );
        }
    }

    #[test]
    fn answers_are_checked_on_workstations_and_servers_when_there_are_any() {
        let tiered = |i: u8, tier| Worker {
            tier,
            ..worker(i, "avx2")
        };
        let primary = tiered(1, DeviceTier::Phone);
        let peers = vec![
            tiered(2, DeviceTier::Phone),
            tiered(3, DeviceTier::Laptop),
            tiered(4, DeviceTier::Workstation),
            tiered(5, DeviceTier::Server),
        ];
        let mut chosen = BTreeSet::new();
        for j in 0..60u8 {
            let mut v = Verifier::new(all_verified());
            let job = JobId::from_bytes([j; 16]);
            let a = v.handle(VerifyEvent::Answered {
                job,
                worker: primary.clone(),
                answer: digest(&honest(job)),
                peers: peers.clone(),
                always: false,
            });
            let [VerifyAction::Replicate { to, .. }] = a[..] else {
                panic!("{a:?}")
            };
            chosen.insert(to);
        }
        assert_eq!(chosen, BTreeSet::from([peers[2].node, peers[3].node]));
    }

    #[test]
    fn a_failed_replica_is_replaced_by_another_peer() {
        let mut v = Verifier::new(all_verified());
        let ws: Vec<Worker> = (1..=3).map(|i| worker(i, "avx2")).collect();
        let job = JobId::from_bytes([6; 16]);
        let a = v.handle(VerifyEvent::Answered {
            job,
            worker: ws[0].clone(),
            answer: digest(&honest(job)),
            peers: ws.clone(),
            always: false,
        });
        let [VerifyAction::Replicate { to: first, .. }] = a[..] else {
            panic!("{a:?}")
        };
        let a = v.handle(VerifyEvent::ReplicaFailed { job, worker: first });
        let [VerifyAction::Replicate {
            to: second,
            round: 2,
            ..
        }] = a[..]
        else {
            panic!("{a:?}")
        };
        assert_ne!(first, second);
        assert_ne!(second, ws[0].node);
    }

    #[test]
    fn answer_digests_are_equal_for_equal_tokens_and_keyed_by_the_request() {
        let t = [1u32, 2, 3];
        assert_eq!(digest(&t), digest(&t));
        assert_ne!(digest(&t), digest(&[1, 2, 4]));
        // Without the sealed request, the coordinator cannot test a guess of the tokens.
        assert_ne!(
            AnswerDigest::of_tokens(b"request a", &t),
            AnswerDigest::of_tokens(b"request b", &t)
        );
    }

    #[test]
    fn selection_is_deterministic_and_follows_the_tier_rate() {
        let v = Verifier::new(VerifyConfig::new([7; 32]));
        let again = Verifier::new(VerifyConfig::new([7; 32]));
        let n = 20_000u128;
        for tier in DeviceTier::ALL {
            let picked = (0..n)
                .filter(|j| {
                    let job = JobId::from_bytes(j.to_be_bytes());
                    assert_eq!(v.selects(job, tier), again.selects(job, tier));
                    v.selects(job, tier)
                })
                .count() as f64;
            let rate = f64::from(tier.policy().verify_per_mille) / 1000.0;
            let expected = rate * n as f64;
            // Five standard deviations of a binomial draw.
            let sd = (n as f64 * rate * (1.0 - rate)).sqrt();
            assert!(
                (picked - expected).abs() < 5.0 * sd,
                "{tier}: {picked} vs {expected}"
            );
        }
    }
}
