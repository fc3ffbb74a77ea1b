//! [`RunMachine`]: one generation's lifecycle as a pure state machine.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::membership::CoordToNodeEq;
use tessera_sampling::GrammarSpec;
use tessera_sampling::SamplingParams;
use tessera_sampling::TokenLogprobs;

use crate::authz::Refusal;
use tessera_net::NodeId;
use tessera_proto::{
    BoundaryTrace, CoordToNode, FinishReason, NodeToCoord, OpenSeq, StagePlacement, StageSeqStats,
};

/// How long stages may take to open a sequence.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest silence between two tokens of a running sequence.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(300);
/// How long stages may take to report a closed sequence.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a run whose epoch was lost waits for a new one before it fails.
pub const RESUME_TIMEOUT: Duration = Duration::from_secs(300);

/// What a run asks for, validated once ([`RunSpec::new`]) before a machine is made.
#[derive(Clone, Debug)]
pub struct RunSpec {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
    /// End-of-generation tokens (empty: generate to the length).
    pub eog: Vec<u32>,
    pub prefill_chunk: usize,
    pub trace: bool,
    /// Constrain the tokens to a grammar (the sampling stage applies it; a resumed attempt
    /// replays it over the tokens generated so far).
    pub grammar: Option<GrammarSpec>,
    /// Report each token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Drafts per ring turn (prompt lookup; 0: no speculation). Changes no token.
    pub speculate: usize,
    /// The answer the client predicts, in tokens: drafts come from it (with `speculate`).
    pub prediction: Vec<u32>,
}

/// Why a request cannot become a run.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum InvalidRun {
    #[error("max_new_tokens must be at least 1")]
    NoTokensWanted,
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token {0} is outside the vocabulary")]
    OutsideVocabulary(u32),
    /// The same check, and the same words, as every HTTP front end's.
    #[error("{0}")]
    Sampling(#[from] tessera_sampling::OutOfRange),
}

impl RunSpec {
    /// Checks a request against the model once; the machine trusts what it is given.
    pub fn new(
        prompt: Vec<u32>,
        vocab_size: usize,
        sampling: SamplingParams,
        max_new_tokens: usize,
        eog: Vec<u32>,
    ) -> Result<Self, InvalidRun> {
        if max_new_tokens == 0 {
            return Err(InvalidRun::NoTokensWanted);
        }
        if prompt.is_empty() {
            return Err(InvalidRun::EmptyPrompt);
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(InvalidRun::OutsideVocabulary(bad));
        }
        sampling.validate()?;
        Ok(Self {
            prompt,
            sampling,
            max_new_tokens,
            eog,
            prefill_chunk: 64,
            trace: false,
            grammar: None,
            logprobs: None,
            speculate: 0,
            prediction: Vec::new(),
        })
    }
}

/// A ready epoch's stages, as the run sees them.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub epoch: u64,
    pub stages: Vec<StagePlacement>,
}

impl Placement {
    /// The stages of cell epoch `epoch`, if it is a cell's latest (the coordinator's and the
    /// simulator's view of a placement alike).
    pub fn of(m: &crate::membership::Membership, epoch: u64) -> Option<Self> {
        let e = m.epoch_with_id(epoch)?;
        let stages = e
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| StagePlacement {
                stage: i,
                node_id: s.node_id,
                name: m
                    .member(&s.node_id)
                    .map_or(String::new(), |m| m.name.clone()),
                layers: s.layers.clone(),
                load: s.loaded.clone().unwrap_or_default(),
                link_to_next: s.link,
            })
            .collect();
        Some(Self { epoch, stages })
    }

    fn nodes(&self) -> Vec<NodeId> {
        self.stages.iter().map(|s| s.node_id).collect()
    }

    /// The node that samples: the last ring stage (expert-only nodes, with no layers, follow
    /// the ring in an expert split and never sample).
    fn sampler(&self) -> Option<NodeId> {
        self.stages
            .iter()
            .rev()
            .find(|s| !s.layers.is_empty())
            .or(self.stages.last())
            .map(|s| s.node_id)
    }
}

/// The timers a run arms. A fired timer carries the number it was armed with; a stale one
/// (re-armed or no longer relevant since) is ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimerKind {
    /// Stages opening the sequence.
    Open,
    /// The next token.
    Step,
    /// A stage's error, waiting to see whether the epoch is lost under it (then the run
    /// resumes instead of failing).
    LossGrace,
    /// A new epoch after the run's was lost.
    Resume,
    /// Stages reporting the sequence closed.
    Close,
}

/// A timer as armed: its kind and its arming number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timer {
    pub kind: TimerKind,
    pub n: u64,
}

/// Inputs.
#[derive(Clone, Debug)]
pub enum Input {
    /// A ready epoch to run on: the first one, or the next after a loss. `attempt_seq` is a
    /// fresh stage-side id for this attempt (late messages of a lost attempt are told apart).
    EpochReady {
        placement: Placement,
        attempt_seq: u64,
    },
    /// The run's epoch is no longer the live, ready one.
    EpochLost { epoch: u64, why: String },
    /// A message from a node about this run (the shell routes by the attempt's id; the
    /// machine checks the sender).
    Node { from: NodeId, msg: NodeToCoord },
    /// A message could not be delivered to `to` (its session is gone).
    Undeliverable { to: NodeId },
    /// The run's owner gave up.
    Cancel,
    /// A timer fired.
    Timer(Timer),
}

/// What a run streams to whoever started it.
#[derive(Clone, Debug, PartialEq)]
pub enum RunEvent {
    /// The first attempt started: on this epoch and placement, with these prompt tokens, the
    /// first `cached_tokens` of them taken from caches the stages kept.
    Started {
        epoch: u64,
        stages: Vec<StagePlacement>,
        prompt_tokens: Vec<u32>,
        cached_tokens: usize,
    },
    /// The next token (`pos`: its position in the sequence), with its log-probabilities when
    /// the run asked.
    Token {
        pos: usize,
        token: u32,
        logprobs: Option<TokenLogprobs>,
    },
    Trace(BoundaryTrace),
    /// The epoch was lost; the run waits for the next one.
    Paused {
        reason: String,
    },
    /// Resumed on `epoch` after `generated` tokens.
    Resumed {
        epoch: u64,
        generated: usize,
    },
}

/// How a run ended, with what the report needs.
#[derive(Clone, Debug, PartialEq)]
pub struct RunOutcome {
    pub reason: FinishReason,
    pub error: Option<String>,
    /// The last placement the run used (`None`: it never started).
    pub placement: Option<Placement>,
    /// Every token generated.
    pub generated: Vec<u32>,
    /// The stages' statistics of the last attempt, by stage index.
    pub stage_stats: BTreeMap<usize, StageSeqStats>,
    /// From the first `Start` to the first token.
    pub time_to_first_token: Option<Duration>,
    /// Tokens after the first, and the time they took.
    pub decode: Option<(usize, Duration)>,
    /// The run ended with no attempt running: it never started, or it was waiting for an
    /// epoch after a loss.
    pub stranded: bool,
}

/// Outputs.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    Send {
        to: NodeId,
        msg: Box<CoordToNodeEq>,
    },
    /// Deliver [`Input::EpochReady`] for the next ready epoch that is not `lost` (or the
    /// current one, for the first attempt: `lost` is `None`).
    AwaitEpoch {
        lost: Option<u64>,
    },
    Event(RunEvent),
    ArmTimer {
        timer: Timer,
        after: Duration,
    },
    /// A node said something about this run that it may not say (it is not a stage of the
    /// attempt, or not its sampler): not acted on; the shell counts and logs it.
    Refused {
        from: NodeId,
        why: crate::authz::Refusal,
    },
    /// The run is over; nothing more comes out of the machine.
    Done(Box<RunOutcome>),
}

pub use crate::fault::Fault;

/// One attempt: the run on one epoch under one stage-side id.
#[derive(Clone, Debug)]
struct Attempt {
    seq: u64,
    placement: Placement,
    nodes: Vec<NodeId>,
    sampler: Option<NodeId>,
}

#[derive(Clone, Debug)]
enum State {
    /// Waiting for a ready epoch: the first (`lost: None`) or the next after a loss.
    WaitingEpoch {
        lost: Option<u64>,
    },
    Opening {
        attempt: Attempt,
        /// The stages that opened it, with the prompt positions each holds in a kept cache.
        opened: Vec<(NodeId, usize)>,
    },
    Running {
        attempt: Attempt,
    },
    /// A stage reported an error: if the epoch goes within the grace, resume; else fail.
    Failing {
        attempt: Attempt,
        error: String,
    },
    Closing {
        attempt: Attempt,
        reason: FinishReason,
        error: Option<String>,
        waiting: Vec<NodeId>,
    },
    Done,
}

/// One generation's lifecycle: open the sequence on every stage of a ready epoch, start it,
/// relay its tokens, close it; pause when the epoch is lost and resume on the next by
/// re-prefilling prompt + generated (sampling depends only on (seed, position) and kernels are
/// batch-invariant, so the continuation is the one the run would have had).
///
/// Pure: inputs with the shell's `now` in, outputs out; no clock, no channels, no I/O. Only the
/// run's own stages are heard, and only its sampling stage may send tokens or finish it.
#[derive(Debug)]
pub struct RunMachine {
    spec: RunSpec,
    /// The loss-grace: two leases.
    grace: Duration,
    state: State,
    generated: Vec<u32>,
    /// The last placement used.
    placement: Option<Placement>,
    stats: BTreeMap<usize, StageSeqStats>,
    started_at: Option<Duration>,
    first_token_at: Option<Duration>,
    last_token_at: Option<Duration>,
    /// Tokens received since the first start, for the decode rate.
    tokens_timed: usize,
    timers: u64,
    fault: Option<Fault>,
    /// Messages from nodes the machine refused to hear (not a stage of the attempt, or not
    /// allowed to say that).
    refused: u64,
    /// Refusals made while handling the current input, put out ahead of its other outputs.
    refusals: Vec<Output>,
}

impl RunMachine {
    /// A run waiting for its first epoch; `lease` sets the grace for a stage error to turn out
    /// to be an epoch loss. The first output is [`Output::AwaitEpoch`].
    pub fn new(spec: RunSpec, lease: Duration) -> (Self, Vec<Output>) {
        let m = Self {
            spec,
            grace: lease * 2,
            state: State::WaitingEpoch { lost: None },
            generated: Vec::new(),
            placement: None,
            stats: BTreeMap::new(),
            started_at: None,
            first_token_at: None,
            last_token_at: None,
            tokens_timed: 0,
            timers: 0,
            fault: None,
            refused: 0,
            refusals: Vec::new(),
        };
        (m, vec![Output::AwaitEpoch { lost: None }])
    }

    /// Turns a deliberate bug on (tests of the simulator only).
    pub fn inject_fault(&mut self, fault: Fault) {
        self.fault = Some(fault);
    }

    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Messages refused so far (a sender that is not the run's stage, or not its sampler).
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// The stage-side id of the current attempt, if one is open.
    pub fn attempt_seq(&self) -> Option<u64> {
        match &self.state {
            State::Opening { attempt, .. }
            | State::Running { attempt }
            | State::Failing { attempt, .. }
            | State::Closing { attempt, .. } => Some(attempt.seq),
            _ => None,
        }
    }

    /// Applies one input at `now`; returns what to do.
    pub fn handle(&mut self, now: Duration, input: Input) -> Vec<Output> {
        let mut out = Vec::new();
        let state = std::mem::replace(&mut self.state, State::Done);
        self.state = match (state, input) {
            (State::Done, _) => State::Done,

            // A ready epoch: open the sequence on it.
            (
                State::WaitingEpoch { lost },
                Input::EpochReady {
                    placement,
                    attempt_seq,
                },
            ) if Some(placement.epoch) != lost => {
                self.open(lost.is_some(), placement, attempt_seq, &mut out)
            }
            (State::WaitingEpoch { .. }, Input::Cancel) => {
                self.finish(FinishReason::Cancelled, None, &mut out)
            }
            (State::WaitingEpoch { lost: Some(e) }, Input::Timer(t))
                if self.current(t, TimerKind::Resume) =>
            {
                self.finish(
                    FinishReason::Error,
                    Some(format!(
                        "service unavailable: the run's epoch {e} was lost and no new epoch \
                         became ready within {RESUME_TIMEOUT:?}"
                    )),
                    &mut out,
                )
            }

            // Opening: count the stages' answers.
            (
                State::Opening {
                    attempt,
                    mut opened,
                },
                Input::Node { from, msg },
            ) if self.heard(&attempt, from, &msg) => match msg {
                NodeToCoord::Opened { cached, .. } => {
                    if !opened.iter().any(|(n, _)| *n == from) {
                        opened.push((from, cached));
                    }
                    if opened.len() == attempt.nodes.len() {
                        let reuse = agreed_reuse(&attempt.placement, &opened);
                        self.start(now, attempt, reuse, &mut out)
                    } else {
                        State::Opening { attempt, opened }
                    }
                }
                NodeToCoord::OpenFailed { reason, .. } => {
                    let error = format!("node {}: {reason}", from.short());
                    self.arm(TimerKind::LossGrace, self.grace, &mut out);
                    State::Failing { attempt, error }
                }
                NodeToCoord::Finished { reason, error, .. } => {
                    let error = error.unwrap_or_else(|| reason.to_string());
                    self.arm(TimerKind::LossGrace, self.grace, &mut out);
                    State::Failing { attempt, error }
                }
                NodeToCoord::Trace(t) => {
                    out.push(Output::Event(RunEvent::Trace(t)));
                    State::Opening { attempt, opened }
                }
                _ => State::Opening { attempt, opened },
            },
            (State::Opening { attempt, .. }, Input::Timer(t))
                if self.current(t, TimerKind::Open) =>
            {
                let error = "timed out: stages opening the sequence".to_string();
                self.close(attempt, FinishReason::Error, Some(error), &mut out)
            }

            // Running: relay tokens; the sampler ends the sequence.
            (State::Running { attempt }, Input::Node { from, msg })
                if self.heard(&attempt, from, &msg) =>
            {
                match msg {
                    NodeToCoord::Token {
                        pos,
                        token,
                        logprobs,
                        ..
                    } => {
                        self.token(now, pos, token, logprobs, &mut out);
                        self.arm(TimerKind::Step, STEP_TIMEOUT, &mut out);
                        State::Running { attempt }
                    }
                    NodeToCoord::Trace(t) => {
                        out.push(Output::Event(RunEvent::Trace(t)));
                        State::Running { attempt }
                    }
                    NodeToCoord::Finished {
                        reason: FinishReason::Error,
                        error,
                        ..
                    } => {
                        let error = error.map_or("the sequence failed".to_string(), |e| {
                            format!("node {}: {e}", from.short())
                        });
                        self.arm(TimerKind::LossGrace, self.grace, &mut out);
                        State::Failing { attempt, error }
                    }
                    NodeToCoord::Finished { reason, error, .. } => {
                        let error = error.map(|e| format!("node {}: {e}", from.short()));
                        self.close(attempt, reason, error, &mut out)
                    }
                    _ => State::Running { attempt },
                }
            }
            (State::Running { attempt }, Input::Timer(t)) if self.current(t, TimerKind::Step) => {
                let error = "timed out: the next token".to_string();
                self.close(attempt, FinishReason::Error, Some(error), &mut out)
            }

            // Failing: the error was not explained by an epoch loss in time.
            (State::Failing { attempt, error }, Input::Timer(t))
                if self.current(t, TimerKind::LossGrace) =>
            {
                self.close(attempt, FinishReason::Error, Some(error), &mut out)
            }
            (State::Failing { attempt, error }, Input::Node { from, msg }) => {
                if let (true, NodeToCoord::Trace(t)) = (self.heard(&attempt, from, &msg), msg) {
                    out.push(Output::Event(RunEvent::Trace(t)));
                }
                State::Failing { attempt, error }
            }

            // The epoch is lost under an open attempt: free what survives of it, pause.
            (
                State::Opening { attempt, .. }
                | State::Running { attempt }
                | State::Failing { attempt, .. },
                Input::EpochLost { epoch, why },
            ) if epoch == attempt.placement.epoch => self.pause(attempt, why, &mut out),

            (
                State::Opening { attempt, .. }
                | State::Running { attempt }
                | State::Failing { attempt, .. },
                Input::Cancel,
            ) => self.close(attempt, FinishReason::Cancelled, None, &mut out),

            // Closing: collect every stage's statistics (or give up on those gone).
            (
                State::Closing {
                    attempt,
                    reason,
                    error,
                    mut waiting,
                },
                input,
            ) => {
                match input {
                    Input::Node { from, msg } if self.heard(&attempt, from, &msg) => match msg {
                        NodeToCoord::Closed { stats, .. } => {
                            waiting.retain(|n| *n != from);
                            // By who answered: a stage that never opened the sequence (it
                            // was cancelled first) answers default statistics, stage 0's.
                            let stage = attempt
                                .placement
                                .stages
                                .iter()
                                .position(|s| s.node_id == from)
                                .unwrap_or(stats.stage);
                            self.stats.insert(stage, *stats);
                        }
                        NodeToCoord::Trace(t) => out.push(Output::Event(RunEvent::Trace(t))),
                        _ => {}
                    },
                    Input::Undeliverable { to } => waiting.retain(|n| *n != to),
                    Input::EpochLost { epoch, .. } if epoch == attempt.placement.epoch => {
                        // Nodes gone with the epoch will not answer; those still up will.
                    }
                    Input::Timer(t) if self.current(t, TimerKind::Close) => waiting.clear(),
                    _ => {}
                }
                if waiting.is_empty() {
                    self.finish(reason, error, &mut out)
                } else {
                    State::Closing {
                        attempt,
                        reason,
                        error,
                        waiting,
                    }
                }
            }

            // Anything else is stale or not for this state: a late message of a lost attempt
            // (or one refused by `heard`), a timer re-armed since, an epoch other than the run's.
            (state, _) => state,
        };
        if self.refusals.is_empty() {
            out
        } else {
            let mut all = std::mem::take(&mut self.refusals);
            all.extend(out);
            all
        }
    }

    /// Whether `msg` from `from` is for the current attempt and `from` may say it: stages of
    /// the attempt may open, fail, trace and close it; only the sampler sends tokens or
    /// finishes it normally. Counts refusals.
    fn heard(&mut self, attempt: &Attempt, from: NodeId, msg: &NodeToCoord) -> bool {
        let Some(seq) = msg.seq() else {
            return false;
        };
        if seq != attempt.seq {
            // A late message of an earlier attempt: stale, not hostile.
            return false;
        }
        if self.fault == Some(Fault::HearAnySender) {
            return true;
        }
        let allowed = attempt.nodes.contains(&from)
            && match msg {
                NodeToCoord::Token { .. } => attempt.sampler == Some(from),
                NodeToCoord::Finished { reason, .. } => {
                    *reason == FinishReason::Error || attempt.sampler == Some(from)
                }
                _ => true,
            };
        if !allowed {
            self.refused += 1;
            let why = if !attempt.nodes.contains(&from) {
                Refusal::NotAStageOfSequence { seq }
            } else {
                Refusal::NotTheSampler { seq }
            };
            self.refusals.push(Output::Refused { from, why });
        }
        allowed
    }

    fn current(&self, t: Timer, kind: TimerKind) -> bool {
        t.kind == kind && t.n == self.timers
    }

    /// Arms `kind`; any timer armed before is stale from now on.
    fn arm(&mut self, kind: TimerKind, after: Duration, out: &mut Vec<Output>) {
        self.timers += 1;
        out.push(Output::ArmTimer {
            timer: Timer {
                kind,
                n: self.timers,
            },
            after,
        });
    }

    fn open(
        &mut self,
        resuming: bool,
        placement: Placement,
        attempt_seq: u64,
        out: &mut Vec<Output>,
    ) -> State {
        let mut history = self.generated.clone();
        if resuming && self.fault == Some(Fault::ResumeOneTokenShort) {
            history.pop();
        }
        let prompt: Vec<u32> = self.spec.prompt.iter().chain(&history).copied().collect();
        let open = OpenSeq {
            seq: attempt_seq,
            epoch: placement.epoch,
            prompt,
            sampling: self.spec.sampling.clone(),
            max_new_tokens: self.spec.max_new_tokens - history.len(),
            eog: self.spec.eog.clone(),
            prefill_chunk: self.spec.prefill_chunk.max(1),
            trace: self.spec.trace,
            grammar: self.spec.grammar.clone(),
            logprobs: self.spec.logprobs,
            // The grammar state is rebuilt from the tokens generated so far.
            replayed: history.len(),
            speculate: self.spec.speculate.min(OpenSeq::MAX_SPECULATE),
            prediction: self.spec.prediction.clone(),
        };
        let attempt = Attempt {
            seq: attempt_seq,
            nodes: placement.nodes(),
            sampler: placement.sampler(),
            placement: placement.clone(),
        };
        for n in &attempt.nodes {
            out.push(Output::Send {
                to: *n,
                msg: Box::new(CoordToNodeEq(CoordToNode::Open(open.clone()))),
            });
        }
        if resuming {
            out.push(Output::Event(RunEvent::Resumed {
                epoch: placement.epoch,
                generated: self.generated.len(),
            }));
        }
        self.placement = Some(placement);
        self.arm(TimerKind::Open, OPEN_TIMEOUT, out);
        State::Opening {
            attempt,
            opened: Vec::new(),
        }
    }

    fn start(
        &mut self,
        now: Duration,
        attempt: Attempt,
        reuse: usize,
        out: &mut Vec<Output>,
    ) -> State {
        if self.started_at.is_none() {
            self.started_at = Some(now);
            out.push(Output::Event(RunEvent::Started {
                epoch: attempt.placement.epoch,
                stages: attempt.placement.stages.clone(),
                prompt_tokens: self.spec.prompt.clone(),
                cached_tokens: reuse,
            }));
        }
        out.push(Output::Send {
            to: attempt.nodes[0],
            msg: Box::new(CoordToNodeEq(CoordToNode::Start {
                seq: attempt.seq,
                reuse,
            })),
        });
        self.arm(TimerKind::Step, STEP_TIMEOUT, out);
        State::Running { attempt }
    }

    fn token(
        &mut self,
        now: Duration,
        pos: usize,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        out: &mut Vec<Output>,
    ) {
        if self.first_token_at.is_none() {
            self.first_token_at = Some(now);
        } else {
            self.tokens_timed += 1;
        }
        self.last_token_at = Some(now);
        self.generated.push(token);
        out.push(Output::Event(RunEvent::Token {
            pos,
            token,
            logprobs,
        }));
    }

    fn pause(&mut self, attempt: Attempt, why: String, out: &mut Vec<Output>) -> State {
        // A stage that is still up frees the sequence now; the others lost it with the epoch.
        for n in &attempt.nodes {
            out.push(Output::Send {
                to: *n,
                msg: Box::new(CoordToNodeEq(CoordToNode::Close {
                    seq: attempt.seq,
                    keep: Vec::new(),
                })),
            });
        }
        if self.generated.len() >= self.spec.max_new_tokens {
            return self.finish(FinishReason::Length, None, out);
        }
        let lost = attempt.placement.epoch;
        out.push(Output::Event(RunEvent::Paused { reason: why }));
        out.push(Output::AwaitEpoch { lost: Some(lost) });
        self.arm(TimerKind::Resume, RESUME_TIMEOUT, out);
        State::WaitingEpoch { lost: Some(lost) }
    }

    fn close(
        &mut self,
        attempt: Attempt,
        reason: FinishReason,
        error: Option<String>,
        out: &mut Vec<Output>,
    ) -> State {
        self.stats.clear();
        // A sequence that ended well leaves its caches for a prompt that begins the same (a
        // chat's next turn): the stages keep the positions they hold of what it fed.
        let keep: Vec<u32> = if reason == FinishReason::Error {
            Vec::new()
        } else {
            self.spec
                .prompt
                .iter()
                .chain(&self.generated)
                .copied()
                .collect()
        };
        for n in &attempt.nodes {
            out.push(Output::Send {
                to: *n,
                msg: Box::new(CoordToNodeEq(CoordToNode::Close {
                    seq: attempt.seq,
                    keep: keep.clone(),
                })),
            });
        }
        self.arm(TimerKind::Close, CLOSE_TIMEOUT, out);
        let waiting = attempt.nodes.clone();
        State::Closing {
            attempt,
            reason,
            error,
            waiting,
        }
    }

    fn finish(
        &mut self,
        reason: FinishReason,
        mut error: Option<String>,
        out: &mut Vec<Output>,
    ) -> State {
        if reason == FinishReason::Error && error.is_none() {
            error = Some("the sequence failed".into());
        }
        let time_to_first_token = match (self.started_at, self.first_token_at) {
            (Some(s), Some(f)) => Some(f.saturating_sub(s)),
            _ => None,
        };
        let decode = match (self.first_token_at, self.last_token_at) {
            (Some(a), Some(b)) if self.tokens_timed > 0 => {
                Some((self.tokens_timed, b.saturating_sub(a)))
            }
            _ => None,
        };
        let stranded = self.started_at.is_none()
            || matches!(self.state, State::WaitingEpoch { .. } | State::Done);
        out.push(Output::Done(Box::new(RunOutcome {
            stranded,
            reason,
            error,
            placement: self.placement.clone(),
            generated: self.generated.clone(),
            stage_stats: std::mem::take(&mut self.stats),
            time_to_first_token,
            decode,
        })));
        State::Done
    }
}

/// The prompt positions a sequence starts from: the fewest any stage holding layers has kept
/// (expert-only nodes keep no positions and do not count), so every stage has them.
fn agreed_reuse(placement: &Placement, opened: &[(NodeId, usize)]) -> usize {
    placement
        .stages
        .iter()
        .filter(|s| !s.layers.is_empty())
        .map(|s| {
            opened
                .iter()
                .find(|(n, _)| *n == s.node_id)
                .map_or(0, |(_, c)| *c)
        })
        .min()
        .unwrap_or(0)
}
