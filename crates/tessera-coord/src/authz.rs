//! Who may say what: every message from an enrolled peer is checked against the role its
//! credential grants and the assignment it holds before the coordinator acts on it.
//!
//! Enrolment proves a key holds *some* credential; that is not permission to say anything. A
//! node operator holds the node join token, and in a federation node operators are strangers,
//! so the rules are written down here, as pure functions of (who sent it, what it says, what
//! the sender is currently assigned):
//!
//! - the **role** comes from the credential the key enrolled with ([`Grant`]), never from the
//!   hello: a node cannot act as a client, and a client cannot act as a node;
//! - only a **stage of epoch E** may report E's load or link (its success or failure): one
//!   `LoadFailed` from a bystander used to fail every request;
//! - only a **stage of a sequence** may report on it, and only the **stage that samples** it may
//!   send its tokens and its (non-error) finish: sequence ids are sequential, and routing by id
//!   alone let any node write into another user's answer;
//! - only the **client that started a run** may cancel it;
//! - only an **operator** credential may name stages in a run (re-plan the cluster); a client's
//!   run takes the placement the operator or the planner chose.
//!
//! The rules about roles and ownership are here, as pure functions ([`authorize_node`],
//! [`authorize_client`]: facts in, `Ok(())` or a typed [`Refusal`] out). The rules that depend
//! on an assignment live in the machines that hold it, so the simulator checks them too: the
//! membership machine refuses an epoch report from a non-stage, the run machine a sequence
//! message from a non-stage or a non-sampler; both answer with a [`Refusal`]. [`Gate`] is the
//! thin edge the server calls: it counts every refusal and logs them at a bounded rate.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tessera_net::NodeId;
use tessera_proto::{ClientToCoord, NodeToCoord, Role};

/// What a credential lets its holder be. Fixed when the key enrols (from the token it used)
/// and recorded with the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Grant {
    /// A node agent: holds assignments, reports on them.
    Node,
    /// A client: runs generations on the current placement, cancels its own runs.
    Client,
    /// A client that may also choose placements (name stages) and administer credentials.
    Operator,
}

impl Grant {
    /// The wire role a session with this credential must announce.
    pub fn role(self) -> Role {
        match self {
            Self::Node => Role::Node,
            Self::Client | Self::Operator => Role::Client,
        }
    }
}

impl fmt::Display for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Node => "node",
            Self::Client => "client",
            Self::Operator => "operator",
        })
    }
}

impl std::str::FromStr for Grant {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "node" => Ok(Self::Node),
            "client" => Ok(Self::Client),
            "operator" => Ok(Self::Operator),
            _ => Err(format!("unknown role {s:?} (node, client or operator)")),
        }
    }
}

/// Who sent a message: the authenticated key's id and the credential it enrolled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SenderFacts {
    pub node: NodeId,
    pub grant: Grant,
}

/// Why a message was not acted on. The membership machine refuses epoch reports with it and
/// the run machine refuses sequence messages with it; [`authorize_node`] and
/// [`authorize_client`] refuse by role and ownership.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("this message needs a {needs:?} credential; the sender enrolled as {has}")]
    WrongRole { needs: Role, has: Grant },
    #[error("only a stage of epoch {epoch} may report its load or link")]
    NotAStageOfEpoch { epoch: u64 },
    #[error("only a stage of sequence {seq} may report on it")]
    NotAStageOfSequence { seq: u64 },
    #[error("only the stage that samples sequence {seq} may send its tokens and its finish")]
    NotTheSampler { seq: u64 },
    #[error("only the client that started run {seq} may cancel it")]
    NotTheOwner { seq: u64 },
    #[error("naming stages re-plans the cluster: that needs an operator credential")]
    PlacementNeedsOperator,
    #[error("administering credentials needs an operator credential")]
    AdminNeedsOperator,
    #[error("a second hello")]
    SecondHello,
    #[error("{0}")]
    ModelBytes(ModelRefusal),
    #[error(
        "too many runs in flight (at most {MAX_RUNS_PER_CLIENT} per client, \
         {MAX_CLIENT_RUNS} for all clients); retry later"
    )]
    TooManyRuns,
}

/// Why a MODEL stream request was refused ([`crate::model_access`] decides which bytes an
/// assignment needs; the refusal is one of the gate's words, so it lives here).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ModelRefusal {
    #[error("model bytes go only to node credentials (this key enrolled as {0})")]
    NotANode(Grant),
    #[error("this node holds no assignment that needs chunk {chunk}")]
    NotAssigned { chunk: u32 },
}

/// Most runs QUIC clients may have in flight together (the HTTP gateway has its own slots and
/// queue); more are refused with [`Refusal::TooManyRuns`].
pub const MAX_CLIENT_RUNS: usize = 32;
/// Most runs one client key may have in flight, so one client cannot take every place.
pub const MAX_RUNS_PER_CLIENT: usize = 8;

pub use crate::enrolling::{MAX_ENROLLING, MAX_ENROLLING_PER_ADDRESS};

/// A log line from a peer's input: one line (control characters escaped), at most 300 bytes.
pub(crate) fn clip_line(s: &str) -> String {
    let mut out = String::with_capacity(s.len().min(304));
    for c in s.chars() {
        if out.len() >= 300 {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// May `sender` (on a node control session) say `msg` at all? Only a node credential speaks
/// on a node session, and only once hello. What a node may say about an epoch or a sequence
/// depends on the assignment, which the machines that hold it check: the membership machine
/// ([`crate::membership`]: only a stage of epoch E reports E's load or link) and the run
/// machine ([`crate::run`]: only a stage of a sequence reports on it, only its sampler sends
/// its tokens and its normal finish).
pub fn authorize_node(sender: &SenderFacts, msg: &NodeToCoord) -> Result<(), Refusal> {
    if sender.grant != Grant::Node {
        return Err(Refusal::WrongRole {
            needs: Role::Node,
            has: sender.grant,
        });
    }
    match msg {
        NodeToCoord::Hello(_) => Err(Refusal::SecondHello),
        _ => Ok(()),
    }
}

/// May `sender` (on a client control session) say `msg`? `owned` are the runs this session
/// started.
pub fn authorize_client(
    sender: &SenderFacts,
    msg: &ClientToCoord,
    owned: &[u64],
) -> Result<(), Refusal> {
    if sender.grant == Grant::Node {
        return Err(Refusal::WrongRole {
            needs: Role::Client,
            has: sender.grant,
        });
    }
    match msg {
        ClientToCoord::Hello(_) => Err(Refusal::SecondHello),
        ClientToCoord::Run(req) if req.stages.is_some() && sender.grant != Grant::Operator => {
            Err(Refusal::PlacementNeedsOperator)
        }
        ClientToCoord::Run(_)
        | ClientToCoord::Status
        | ClientToCoord::Holders { .. }
        | ClientToCoord::SealedSubmit(_) => Ok(()),
        ClientToCoord::Admin(_) if sender.grant == Grant::Operator => Ok(()),
        ClientToCoord::Admin(_) => Err(Refusal::AdminNeedsOperator),
        ClientToCoord::Cancel { seq } if owned.contains(seq) => Ok(()),
        ClientToCoord::Cancel { seq } => Err(Refusal::NotTheOwner { seq: *seq }),
    }
}

/// The edge around the rules: the refusal counters and a log that cannot be flooded (a
/// hostile peer can send refusable messages as fast as it likes). What the gate holds that
/// changes — the enrolments in progress, each client's runs, each key's connections — is the
/// core task's ([`crate::door::Door`]).
#[derive(Debug, Default)]
pub struct Gate {
    refused: AtomicU64,
    log: LogBudget,
    net_refused: AtomicU64,
    net_log: LogBudget,
}

impl Gate {
    pub fn new() -> Self {
        Self::default()
    }

    /// Connections and enrolments refused so far.
    pub fn refused_connections(&self) -> u64 {
        self.net_refused.load(Ordering::Relaxed)
    }

    /// Counts a refused connection or enrolment and logs `line` within the log budget (a
    /// flood of failed handshakes costs a counter, not a log line each), with the refused key
    /// (when known) and the reason as the event's fields.
    pub fn log_net(
        &self,
        peer: Option<NodeId>,
        reason: &dyn fmt::Display,
        line: impl FnOnce() -> String,
    ) {
        let n = self.net_refused.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(skipped) = self.net_log.admit(Instant::now()) {
            let line = line();
            tracing::warn!(
                event = "refused_connection",
                refused = n,
                peer = %peer.map_or_else(String::new, |p| p.to_string()),
                reason = %clip_line(&reason.to_string()),
                "{} [{n} refused connections in all{}]",
                clip_line(&line),
                if skipped > 0 {
                    format!(", {skipped} not logged")
                } else {
                    String::new()
                }
            );
        }
    }

    /// Messages refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Checks a message on a node's control session; counts and logs a refusal.
    pub(crate) fn check_node(
        &self,
        sender: &SenderFacts,
        msg: &NodeToCoord,
    ) -> Result<(), Refusal> {
        authorize_node(sender, msg).inspect_err(|e| self.refuse(sender.node, e))
    }

    /// Checks a client's message; counts and logs a refusal.
    pub(crate) fn check_client(
        &self,
        sender: &SenderFacts,
        msg: &ClientToCoord,
        owned: &[u64],
    ) -> Result<(), Refusal> {
        authorize_client(sender, msg, owned).inspect_err(|e| self.refuse(sender.node, e))
    }

    /// Counts a refusal (this gate's own, or one a machine made) and logs it within the
    /// log's budget.
    pub(crate) fn refuse(&self, from: NodeId, why: &Refusal) {
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(skipped) = self.log.admit(Instant::now()) {
            tracing::warn!(
                event = "refused",
                from = %from.short(),
                refused = n,
                reason = %why,
                "refused a message from {}: {why} [{n} refused in all{}]",
                from.short(),
                if skipped > 0 {
                    format!(", {skipped} not logged")
                } else {
                    String::new()
                }
            );
        }
    }
}

/// A token bucket for log lines: at most [`LogBudget::BURST`] lines at once, refilled at one
/// a second; the lines it holds back are counted and reported with the next. Lock-free (the
/// generic cell rate algorithm: one atomic "theoretical arrival time"), so that a flood of
/// refusals from many tasks costs each a compare-and-swap.
#[derive(Debug)]
pub(crate) struct LogBudget {
    origin: Instant,
    /// When the bucket is next full again, microseconds after `origin`, less one line's worth.
    tat_us: AtomicU64,
    skipped: AtomicU64,
}

impl Default for LogBudget {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            tat_us: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
        }
    }
}

impl LogBudget {
    const BURST: u64 = 10;
    /// One line's worth of refill, µs.
    const INTERVAL_US: u64 = 1_000_000;

    /// `Some(lines held back since the last one)` if a line may be written at `now`.
    pub(crate) fn admit(&self, now: Instant) -> Option<u64> {
        let now = now.saturating_duration_since(self.origin).as_micros() as u64;
        let tolerance = (Self::BURST - 1) * Self::INTERVAL_US;
        let mut tat = self.tat_us.load(Ordering::Relaxed);
        loop {
            let start = tat.max(now);
            if start - now > tolerance {
                self.skipped.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            match self.tat_us.compare_exchange_weak(
                tat,
                start + Self::INTERVAL_US,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(self.skipped.swap(0, Ordering::Relaxed)),
                Err(seen) => tat = seen,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_net::NodeIdentity;
    use tessera_proto::{RunRequest, StageSpec};
    use tessera_sampling::SamplingParams;

    fn id() -> NodeId {
        NodeIdentity::generate().unwrap().node_id()
    }

    fn node(n: NodeId) -> SenderFacts {
        SenderFacts {
            node: n,
            grant: Grant::Node,
        }
    }

    fn run(stages: Option<Vec<StageSpec>>) -> ClientToCoord {
        ClientToCoord::Run(Box::new(RunRequest {
            prompt: Some("hi".into()),
            prompt_tokens: None,
            max_new_tokens: 4,
            sampling: SamplingParams::default(),
            stages,
            prefill_chunk: 8,
            trace: false,
            stop_at_eog: true,
            grammar: None,
            logprobs: None,
            speculate: 0,
            prediction: None,
        }))
    }

    #[test]
    fn only_the_runs_owner_may_cancel_it() {
        let c = SenderFacts {
            node: id(),
            grant: Grant::Client,
        };
        assert_eq!(
            authorize_client(&c, &ClientToCoord::Cancel { seq: 4 }, &[4]),
            Ok(())
        );
        assert_eq!(
            authorize_client(&c, &ClientToCoord::Cancel { seq: 5 }, &[4]),
            Err(Refusal::NotTheOwner { seq: 5 })
        );
    }

    #[test]
    fn a_client_run_never_names_stages_unless_the_credential_is_operator() {
        let spec = Some(vec![StageSpec {
            node: Some("mine".into()),
            layers: 0..5,
        }]);
        let client = SenderFacts {
            node: id(),
            grant: Grant::Client,
        };
        let operator = SenderFacts {
            grant: Grant::Operator,
            ..client
        };
        assert_eq!(authorize_client(&client, &run(None), &[]), Ok(()));
        assert_eq!(
            authorize_client(&client, &run(spec.clone()), &[]),
            Err(Refusal::PlacementNeedsOperator)
        );
        assert_eq!(authorize_client(&operator, &run(spec), &[]), Ok(()));
    }

    #[test]
    fn roles_come_from_the_credential_never_from_the_session() {
        // A node's key on a client session (its hello said "client") is still a node.
        let n = node(id());
        assert_eq!(
            authorize_client(&n, &run(None), &[]),
            Err(Refusal::WrongRole {
                needs: Role::Client,
                has: Grant::Node
            })
        );
        let c = SenderFacts {
            node: id(),
            grant: Grant::Client,
        };
        assert_eq!(
            authorize_node(&c, &NodeToCoord::Heartbeat { expert_cache: None }),
            Err(Refusal::WrongRole {
                needs: Role::Node,
                has: Grant::Client
            })
        );
        assert_eq!(Grant::Operator.role(), Role::Client);
        assert_eq!("operator".parse::<Grant>(), Ok(Grant::Operator));
    }

    #[test]
    fn refusals_are_counted_and_their_log_lines_bounded() {
        let gate = Gate::default();
        let client = SenderFacts {
            node: id(),
            grant: Grant::Client,
        };
        let heartbeat = NodeToCoord::Heartbeat { expert_cache: None };
        for _ in 0..999 {
            assert!(gate.check_node(&client, &heartbeat).is_err());
        }
        // A machine's refusal is counted the same way.
        gate.refuse(client.node, &Refusal::NotAStageOfEpoch { epoch: 2 });
        assert_eq!(gate.refused(), 1000);
        assert!(gate.check_node(&node(id()), &heartbeat).is_ok());
        assert_eq!(clip_line("a\nb"), "a\\nb");
        assert!(clip_line(&"x".repeat(1 << 20)).len() < 310);
        let b = LogBudget::default();
        let t0 = Instant::now();
        let written = (0..1000).filter(|_| b.admit(t0).is_some()).count();
        assert_eq!(written as u64, LogBudget::BURST);
        // A second later one more line, which says how many were held back.
        assert_eq!(b.admit(t0 + std::time::Duration::from_secs(1)), Some(990));
    }
}
