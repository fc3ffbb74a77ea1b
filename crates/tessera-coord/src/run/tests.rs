//! The run machine's behaviour, as specs: each test feeds inputs and reads the outputs.

use std::time::Duration;

use tessera_net::{NodeId, NodeIdentity};
use tessera_proto::{
    CoordToNode, FinishReason, LoadReport, NodeToCoord, StagePlacement, StageSeqStats,
};

use crate::authz::Refusal;

use super::{Fault, Input, Output, Placement, RunEvent, RunMachine, RunSpec, Timer, TimerKind};

const LEASE: Duration = Duration::from_secs(1);

fn node(i: u8) -> NodeId {
    NodeIdentity::from_seed([i; 32]).node_id()
}

fn t(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// A ring of `nodes`, two layers each.
fn placement(epoch: u64, nodes: &[u8]) -> Placement {
    Placement {
        epoch,
        stages: nodes
            .iter()
            .enumerate()
            .map(|(i, n)| StagePlacement {
                stage: i,
                node_id: node(*n),
                name: format!("n{n}"),
                layers: 2 * i..2 * i + 2,
                load: LoadReport::default(),
                link_to_next: None,
            })
            .collect(),
    }
}

fn machine(max_new_tokens: usize) -> RunMachine {
    let spec = RunSpec::new(
        vec![1, 2, 3],
        100,
        Default::default(),
        max_new_tokens,
        vec![],
    )
    .expect("valid");
    RunMachine::new(spec, LEASE).0
}

fn sends(out: &[Output]) -> Vec<(NodeId, CoordToNode)> {
    out.iter()
        .filter_map(|o| match o {
            Output::Send { to, msg } => Some((*to, msg.0.clone())),
            _ => None,
        })
        .collect()
}

fn events(out: &[Output]) -> Vec<RunEvent> {
    out.iter()
        .filter_map(|o| match o {
            Output::Event(e) => Some(e.clone()),
            _ => None,
        })
        .collect()
}

fn timer(out: &[Output], kind: TimerKind) -> Timer {
    out.iter()
        .find_map(|o| match o {
            Output::ArmTimer { timer, .. } if timer.kind == kind => Some(*timer),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no {kind:?} timer in {out:?}"))
}

fn done(out: &[Output]) -> &super::RunOutcome {
    out.iter()
        .find_map(|o| match o {
            Output::Done(d) => Some(&**d),
            _ => None,
        })
        .unwrap_or_else(|| panic!("not done: {out:?}"))
}

fn msg(m: &mut RunMachine, now: u64, from: u8, msg: NodeToCoord) -> Vec<Output> {
    m.handle(
        t(now),
        Input::Node {
            from: node(from),
            msg,
        },
    )
}

/// Epoch `epoch` on `nodes` becomes ready under `seq`, every stage opens: the run has started.
fn open_and_start(m: &mut RunMachine, epoch: u64, nodes: &[u8], seq: u64) -> Vec<Output> {
    let out = m.handle(
        t(0),
        Input::EpochReady {
            placement: placement(epoch, nodes),
            attempt_seq: seq,
        },
    );
    let opens = sends(&out);
    assert_eq!(opens.len(), nodes.len(), "an Open to every stage");
    let mut last = Vec::new();
    for n in nodes {
        last = msg(m, 1, *n, NodeToCoord::Opened { seq, cached: 0 });
    }
    last
}

fn token(seq: u64, pos: usize, token: u32) -> NodeToCoord {
    NodeToCoord::Token {
        seq,
        pos,
        token,
        logprobs: None,
    }
}

fn finished(seq: u64, reason: FinishReason, error: Option<&str>) -> NodeToCoord {
    NodeToCoord::Finished {
        seq,
        reason,
        generated: 0,
        error: error.map(str::to_string),
    }
}

fn closed(seq: u64, stage: usize) -> NodeToCoord {
    NodeToCoord::Closed {
        seq,
        stats: Box::new(StageSeqStats {
            stage,
            ..Default::default()
        }),
    }
}

#[test]
fn a_run_opens_on_every_stage_starts_the_first_and_closes_everywhere() {
    let mut m = machine(2);
    let out = open_and_start(&mut m, 5, &[1, 2], 10);
    assert!(
        matches!(&sends(&out)[..], [(n, CoordToNode::Start { seq: 10, reuse: 0 })] if *n == node(1))
    );
    assert!(matches!(
        events(&out)[0],
        RunEvent::Started { epoch: 5, .. }
    ));
    msg(&mut m, 10, 2, token(10, 3, 42));
    msg(&mut m, 20, 2, token(10, 4, 43));
    let out = msg(&mut m, 21, 2, finished(10, FinishReason::Length, None));
    let closes = sends(&out);
    assert_eq!(closes.len(), 2);
    assert!(closes
        .iter()
        .all(|(_, c)| matches!(c, CoordToNode::Close { seq: 10, .. })));
    assert!(msg(&mut m, 22, 1, closed(10, 0))
        .iter()
        .all(|o| !matches!(o, Output::Done(_))));
    let out = msg(&mut m, 23, 2, closed(10, 1));
    let d = done(&out);
    assert_eq!(d.reason, FinishReason::Length);
    assert_eq!(d.generated, vec![42, 43]);
    assert_eq!(d.stage_stats.len(), 2);
    assert_eq!(d.time_to_first_token, Some(t(9)));
    assert_eq!(d.decode, Some((1, t(10))));
}

#[test]
fn a_lost_epoch_pauses_the_run_and_the_next_resumes_it_from_prompt_plus_generated() {
    let mut m = machine(4);
    open_and_start(&mut m, 5, &[1, 2], 10);
    msg(&mut m, 10, 2, token(10, 3, 42));
    let out = m.handle(
        t(11),
        Input::EpochLost {
            epoch: 5,
            why: "stage node left".into(),
        },
    );
    assert!(events(&out).contains(&RunEvent::Paused {
        reason: "stage node left".into()
    }));
    assert!(out.contains(&Output::AwaitEpoch { lost: Some(5) }));
    // The survivors free the lost attempt's sequence.
    assert!(sends(&out)
        .iter()
        .all(|(_, c)| matches!(c, CoordToNode::Close { seq: 10, .. })));
    // The lost epoch itself is not taken again.
    assert!(m
        .handle(
            t(12),
            Input::EpochReady {
                placement: placement(5, &[1, 2]),
                attempt_seq: 11
            }
        )
        .is_empty());
    let out = m.handle(
        t(13),
        Input::EpochReady {
            placement: placement(6, &[1]),
            attempt_seq: 11,
        },
    );
    assert!(events(&out).contains(&RunEvent::Resumed {
        epoch: 6,
        generated: 1
    }));
    match &sends(&out)[..] {
        [(n, CoordToNode::Open(o))] => {
            assert_eq!(*n, node(1));
            assert_eq!(o.prompt, vec![1, 2, 3, 42], "prompt + generated");
            assert_eq!(o.max_new_tokens, 3, "the remaining budget");
            assert_eq!((o.seq, o.epoch), (11, 6));
        }
        other => panic!("{other:?}"),
    }
    let out = msg(&mut m, 14, 1, NodeToCoord::Opened { seq: 11, cached: 0 });
    assert!(
        matches!(&sends(&out)[..], [(n, CoordToNode::Start { seq: 11, reuse: 0 })] if *n == node(1))
    );
    assert!(
        events(&out).is_empty(),
        "Started is said once, for the first attempt"
    );
    msg(&mut m, 15, 1, token(11, 4, 43));
    assert_eq!(m.generated(), &[42, 43]);
}

/// A resumed attempt asks the stages for what the first asked — grammar, log-probabilities,
/// sampling — and says how many of its prompt tokens were generated, so the sampling stage
/// replays the grammar over them; log-probabilities reach the run's owner with each token.
#[test]
fn a_resumed_attempt_carries_the_grammar_and_logprobs_and_replays_the_generated_tokens() {
    let mut spec = RunSpec::new(
        vec![1, 2, 3],
        100,
        tessera_sampling::SamplingParams {
            temperature: 0.7,
            seed: 9,
            ..Default::default()
        },
        6,
        vec![0],
    )
    .expect("valid");
    spec.grammar = Some(tessera_sampling::GrammarSpec::JsonSchema(
        serde_json::json!({"type": "object"}),
    ));
    spec.logprobs = Some(3);
    let (mut m, _) = RunMachine::new(spec, LEASE);
    let out = m.handle(
        t(0),
        Input::EpochReady {
            placement: placement(5, &[1, 2]),
            attempt_seq: 10,
        },
    );
    let first = match &sends(&out)[..] {
        [(_, CoordToNode::Open(a)), (_, CoordToNode::Open(b))] => {
            assert_eq!(a, b, "every stage gets the same Open");
            a.clone()
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(first.replayed, 0);
    assert_eq!(first.logprobs, Some(3));
    for n in [1, 2] {
        msg(&mut m, 1, n, NodeToCoord::Opened { seq: 10, cached: 0 });
    }
    let lp = tessera_sampling::TokenLogprobs {
        token: 42,
        logprob: -0.5,
        top: vec![(42, -0.5), (7, -1.5)],
    };
    let out = msg(
        &mut m,
        10,
        2,
        NodeToCoord::Token {
            seq: 10,
            pos: 3,
            token: 42,
            logprobs: Some(lp.clone()),
        },
    );
    assert_eq!(
        events(&out),
        vec![RunEvent::Token {
            pos: 3,
            token: 42,
            logprobs: Some(lp)
        }]
    );
    msg(&mut m, 11, 2, token(10, 4, 43));
    m.handle(
        t(12),
        Input::EpochLost {
            epoch: 5,
            why: "stage node left".into(),
        },
    );
    let out = m.handle(
        t(13),
        Input::EpochReady {
            placement: placement(6, &[1]),
            attempt_seq: 11,
        },
    );
    let [(_, CoordToNode::Open(resumed))] = &sends(&out)[..] else {
        panic!("{out:?}");
    };
    let mut expected = first;
    expected.seq = 11;
    expected.epoch = 6;
    expected.prompt.extend([42, 43]);
    expected.max_new_tokens -= 2;
    expected.replayed = 2;
    assert_eq!(resumed, &expected);
}

#[test]
fn cancel_is_an_input_and_closes_the_sequence() {
    let mut m = machine(8);
    open_and_start(&mut m, 5, &[1, 2], 10);
    msg(&mut m, 10, 2, token(10, 3, 42));
    let out = m.handle(t(11), Input::Cancel);
    assert_eq!(sends(&out).len(), 2);
    // Node 2 is gone: its Close cannot be delivered; node 1 answers.
    m.handle(t(12), Input::Undeliverable { to: node(2) });
    let out = msg(&mut m, 13, 1, closed(10, 0));
    assert_eq!(done(&out).reason, FinishReason::Cancelled);
    assert_eq!(done(&out).generated, vec![42]);
}

#[test]
fn a_close_is_booked_by_the_stage_that_answered_even_with_default_statistics() {
    // Cancelled while opening: no stage ran anything, so every stage answers default
    // statistics (which say stage 0). Each answer is still that stage's: none is unconfirmed.
    let mut m = machine(8);
    m.handle(
        t(0),
        Input::EpochReady {
            placement: placement(5, &[1, 2, 3]),
            attempt_seq: 10,
        },
    );
    msg(&mut m, 1, 1, NodeToCoord::Opened { seq: 10, cached: 0 });
    let out = m.handle(t(2), Input::Cancel);
    assert_eq!(sends(&out).len(), 3);
    msg(&mut m, 3, 3, closed(10, 0));
    msg(&mut m, 4, 2, closed(10, 0));
    let out = msg(&mut m, 5, 1, closed(10, 0));
    let d = done(&out);
    assert_eq!(d.reason, FinishReason::Cancelled);
    assert_eq!(d.stage_stats.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
}

#[test]
fn cancel_while_paused_ends_at_once() {
    let mut m = machine(8);
    open_and_start(&mut m, 5, &[1, 2], 10);
    m.handle(
        t(11),
        Input::EpochLost {
            epoch: 5,
            why: "left".into(),
        },
    );
    let out = m.handle(t(12), Input::Cancel);
    assert_eq!(done(&out).reason, FinishReason::Cancelled);
    assert!(m.is_done());
}

#[test]
fn a_node_lost_during_prefill_resumes_from_the_prompt_alone() {
    let mut m = machine(4);
    open_and_start(&mut m, 5, &[1, 2], 10);
    // No token yet (still prefilling) when the epoch goes.
    m.handle(
        t(5),
        Input::EpochLost {
            epoch: 5,
            why: "stage node 2 left".into(),
        },
    );
    let out = m.handle(
        t(6),
        Input::EpochReady {
            placement: placement(6, &[1]),
            attempt_seq: 11,
        },
    );
    match &sends(&out)[..] {
        [(_, CoordToNode::Open(o))] => {
            assert_eq!(o.prompt, vec![1, 2, 3]);
            assert_eq!(o.max_new_tokens, 4);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_lost_epoch_during_resume_waits_for_the_next_one() {
    let mut m = machine(4);
    open_and_start(&mut m, 5, &[1, 2], 10);
    msg(&mut m, 10, 2, token(10, 3, 42));
    m.handle(
        t(11),
        Input::EpochLost {
            epoch: 5,
            why: "left".into(),
        },
    );
    m.handle(
        t(12),
        Input::EpochReady {
            placement: placement(6, &[1, 3]),
            attempt_seq: 11,
        },
    );
    msg(&mut m, 13, 1, NodeToCoord::Opened { seq: 11, cached: 0 });
    // Epoch 6 goes before node 3 opened the resumed sequence.
    let out = m.handle(
        t(14),
        Input::EpochLost {
            epoch: 6,
            why: "node 3 left".into(),
        },
    );
    assert!(out.contains(&Output::AwaitEpoch { lost: Some(6) }));
    let out = m.handle(
        t(15),
        Input::EpochReady {
            placement: placement(7, &[1]),
            attempt_seq: 12,
        },
    );
    match &sends(&out)[..] {
        [(_, CoordToNode::Open(o))] => assert_eq!(o.prompt, vec![1, 2, 3, 42]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_message_in_flight_from_a_lost_attempt_is_ignored() {
    let mut m = machine(4);
    open_and_start(&mut m, 5, &[1, 2], 10);
    msg(&mut m, 10, 2, token(10, 3, 42));
    m.handle(
        t(11),
        Input::EpochLost {
            epoch: 5,
            why: "lease expired".into(),
        },
    );
    // Node 2's next token was on the wire when its lease ran out.
    assert!(msg(&mut m, 12, 2, token(10, 4, 99)).is_empty());
    m.handle(
        t(13),
        Input::EpochReady {
            placement: placement(6, &[1]),
            attempt_seq: 11,
        },
    );
    assert!(msg(&mut m, 14, 2, token(10, 4, 99)).is_empty());
    assert_eq!(m.generated(), &[42]);
    assert_eq!(m.refused(), 0, "stale, not hostile");
}

#[test]
fn only_the_sampling_stage_may_send_tokens_or_finish_the_run() {
    let mut m = machine(4);
    open_and_start(&mut m, 5, &[1, 2], 10);
    // Stage 0 is in the run but does not sample; node 9 is not in the run at all. Each is
    // refused with its reason and nothing else happens.
    let refused = |from: u8, why: Refusal| {
        vec![Output::Refused {
            from: node(from),
            why,
        }]
    };
    let not_sampler = Refusal::NotTheSampler { seq: 10 };
    let not_stage = Refusal::NotAStageOfSequence { seq: 10 };
    assert_eq!(
        msg(&mut m, 10, 1, token(10, 3, 66)),
        refused(1, not_sampler.clone())
    );
    assert_eq!(
        msg(&mut m, 10, 9, token(10, 3, 66)),
        refused(9, not_stage.clone())
    );
    assert_eq!(
        msg(&mut m, 10, 9, finished(10, FinishReason::Length, None)),
        refused(9, not_stage)
    );
    assert_eq!(
        msg(
            &mut m,
            10,
            1,
            finished(10, FinishReason::EndOfGeneration, None)
        ),
        refused(1, not_sampler)
    );
    assert_eq!(m.refused(), 4);
    assert!(m.generated().is_empty());
    let out = msg(&mut m, 11, 2, token(10, 3, 42));
    assert_eq!(
        events(&out),
        vec![RunEvent::Token {
            pos: 3,
            token: 42,
            logprobs: None
        }]
    );
}

#[test]
fn a_stage_error_explained_by_the_epochs_loss_resumes_instead_of_failing() {
    let mut m = machine(4);
    open_and_start(&mut m, 5, &[1, 2], 10);
    // Stage 0 cannot reach its dead neighbour before the lease says it is dead.
    let out = msg(
        &mut m,
        10,
        1,
        finished(10, FinishReason::Error, Some("ring broken")),
    );
    let grace = out
        .iter()
        .find_map(|o| match o {
            Output::ArmTimer { timer, after } if timer.kind == TimerKind::LossGrace => Some(*after),
            _ => None,
        })
        .expect("a grace timer");
    assert_eq!(grace, LEASE * 2);
    let out = m.handle(
        t(11),
        Input::EpochLost {
            epoch: 5,
            why: "node 2 left".into(),
        },
    );
    assert!(out.contains(&Output::AwaitEpoch { lost: Some(5) }));
}

#[test]
fn a_stage_error_not_explained_in_time_fails_the_run_with_its_reason() {
    let mut m = machine(4);
    open_and_start(&mut m, 5, &[1, 2], 10);
    let out = msg(
        &mut m,
        10,
        1,
        finished(10, FinishReason::Error, Some("out of memory")),
    );
    let grace = timer(&out, TimerKind::LossGrace);
    m.handle(t(2010), Input::Timer(grace));
    msg(&mut m, 2011, 1, closed(10, 0));
    let out = msg(&mut m, 2012, 2, closed(10, 1));
    let d = done(&out);
    assert_eq!(d.reason, FinishReason::Error);
    assert!(
        d.error.as_deref().unwrap().contains("out of memory"),
        "{d:?}"
    );
}

#[test]
fn a_stale_timer_does_nothing() {
    let mut m = machine(4);
    let out = m.handle(
        t(0),
        Input::EpochReady {
            placement: placement(5, &[1]),
            attempt_seq: 10,
        },
    );
    let open = timer(&out, TimerKind::Open);
    msg(&mut m, 1, 1, NodeToCoord::Opened { seq: 10, cached: 0 });
    // The open timer fires after the stage opened: the run goes on.
    assert!(m.handle(t(30_000), Input::Timer(open)).is_empty());
    let out = msg(&mut m, 30_001, 1, token(10, 3, 7));
    assert_eq!(
        events(&out),
        vec![RunEvent::Token {
            pos: 3,
            token: 7,
            logprobs: None
        }]
    );
}

#[test]
fn no_new_epoch_within_the_resume_timeout_fails_the_run_with_the_reason() {
    let mut m = machine(4);
    open_and_start(&mut m, 5, &[1, 2], 10);
    let out = m.handle(
        t(11),
        Input::EpochLost {
            epoch: 5,
            why: "left".into(),
        },
    );
    let resume = timer(&out, TimerKind::Resume);
    let out = m.handle(t(300_011), Input::Timer(resume));
    let d = done(&out);
    assert_eq!(d.reason, FinishReason::Error);
    assert!(d
        .error
        .as_deref()
        .unwrap()
        .starts_with("service unavailable"));
}

#[test]
fn a_run_that_had_every_token_when_its_epoch_went_is_complete() {
    let mut m = machine(1);
    open_and_start(&mut m, 5, &[1, 2], 10);
    msg(&mut m, 10, 2, token(10, 3, 42));
    let out = m.handle(
        t(11),
        Input::EpochLost {
            epoch: 5,
            why: "left".into(),
        },
    );
    assert_eq!(done(&out).reason, FinishReason::Length);
}

#[test]
fn the_injected_fault_resumes_one_token_short() {
    let mut m = machine(4);
    m.inject_fault(Fault::ResumeOneTokenShort);
    open_and_start(&mut m, 5, &[1, 2], 10);
    msg(&mut m, 10, 2, token(10, 3, 42));
    m.handle(
        t(11),
        Input::EpochLost {
            epoch: 5,
            why: "left".into(),
        },
    );
    let out = m.handle(
        t(12),
        Input::EpochReady {
            placement: placement(6, &[1]),
            attempt_seq: 11,
        },
    );
    match &sends(&out)[..] {
        [(_, CoordToNode::Open(o))] => assert_eq!(o.prompt, vec![1, 2, 3]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_request_is_validated_once_with_a_typed_reason() {
    use super::InvalidRun;
    let spec = |p: Vec<u32>, n| RunSpec::new(p, 10, Default::default(), n, vec![]).map(|_| ());
    assert_eq!(spec(vec![1], 0), Err(InvalidRun::NoTokensWanted));
    assert_eq!(spec(vec![], 1), Err(InvalidRun::EmptyPrompt));
    assert_eq!(spec(vec![1, 10], 1), Err(InvalidRun::OutsideVocabulary(10)));
    assert_eq!(spec(vec![1, 9], 1), Ok(()));
    let hot = tessera_sampling::SamplingParams {
        temperature: 2.5,
        ..Default::default()
    };
    match RunSpec::new(vec![1], 10, hot, 1, vec![]) {
        Err(InvalidRun::Sampling(e)) => {
            assert_eq!(e.param, tessera_sampling::SamplingParam::Temperature)
        }
        other => panic!("{other:?}"),
    }
}

/// Prefix reuse: every stage says how many prompt positions it kept; the run starts at the
/// fewest (so every stage has them), an expert-only node (no layers) does not count, the
/// start reports them, and a run that ends well asks the stages to keep what it fed while one
/// that fails does not.
#[test]
fn a_run_starts_at_the_fewest_kept_positions_and_keeps_what_it_fed() {
    let mut m = machine(2);
    let mut p = placement(5, &[1, 2, 3]);
    p.stages[2].layers = 0..0;
    m.handle(
        t(0),
        Input::EpochReady {
            placement: p,
            attempt_seq: 10,
        },
    );
    msg(&mut m, 1, 1, NodeToCoord::Opened { seq: 10, cached: 2 });
    msg(&mut m, 1, 3, NodeToCoord::Opened { seq: 10, cached: 0 });
    let out = msg(&mut m, 1, 2, NodeToCoord::Opened { seq: 10, cached: 1 });
    assert!(
        matches!(&sends(&out)[..], [(n, CoordToNode::Start { seq: 10, reuse: 1 })] if *n == node(1)),
        "{out:?}"
    );
    assert!(matches!(
        events(&out)[0],
        RunEvent::Started {
            cached_tokens: 1,
            ..
        }
    ));
    msg(&mut m, 10, 2, token(10, 3, 42));
    let out = msg(
        &mut m,
        11,
        2,
        finished(10, FinishReason::EndOfGeneration, None),
    );
    let closes = sends(&out);
    assert_eq!(closes.len(), 3);
    for (_, c) in closes {
        assert!(
            matches!(&c, CoordToNode::Close { seq: 10, keep } if keep == &[1, 2, 3, 42]),
            "{c:?}"
        );
    }

    let mut m = machine(2);
    let out = open_and_start(&mut m, 5, &[1, 2], 10);
    assert!(matches!(
        &sends(&out)[..],
        [(_, CoordToNode::Start { reuse: 0, .. })]
    ));
    let out = msg(
        &mut m,
        5,
        2,
        finished(10, FinishReason::Error, Some("boom")),
    );
    let out = m.handle(t(5000), Input::Timer(timer(&out, TimerKind::LossGrace)));
    let closes = sends(&out);
    assert_eq!(closes.len(), 2);
    assert!(closes
        .iter()
        .all(|(_, c)| matches!(c, CoordToNode::Close { keep, .. } if keep.is_empty())));
}
