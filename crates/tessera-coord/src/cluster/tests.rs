//! The composition's behaviour, as specs: inputs in, outputs read.

use crate::cluster::{RunRefused, Unavailable};
use std::time::Duration;

use tessera_net::{NodeId, NodeIdentity};
use tessera_proto::{CoordToNode, FinishReason, LoadReport, NodeToCoord};

use super::{Cluster, ClusterConfig, ClusterInput, ClusterOutput, RunNews};
use crate::membership::{Member, Membership};
use crate::run::{RunEvent, RunSpec};

const LEASE: Duration = Duration::from_secs(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn member(i: u8) -> Member {
    let id = NodeIdentity::from_seed([i; 32]);
    let addr = format!("127.0.0.1:{}", 4000 + u16::from(i))
        .parse()
        .unwrap();
    Member {
        session: u64::from(i),
        ..Member::hello(id.public_key(), format!("n{i}"), addr)
    }
}

fn cluster() -> Cluster {
    Cluster::new(
        ClusterConfig {
            model: tessera_host::ContentHash([7; 32]),
            n_layer: 4,
            kv_shape: tessera_model::kv::KvShape {
                n_head_kv: 1,
                k_head_dim: 1,
                v_head_dim: 1,
                shared_v: false,
            },
            max_context: 64,
            initial_split: None,
        },
        Membership::new(),
        LEASE,
    )
}

fn msg(c: &mut Cluster, at: u64, node: &Member, msg: NodeToCoord) -> Vec<ClusterOutput> {
    c.handle(
        ms(at),
        ClusterInput::Node {
            node: node.node_id,
            session: node.session,
            msg,
        },
    )
}

/// Node 1 alone, joined and planned as a ring of one stage, loaded and linked: epoch ready.
fn one_node_ready(c: &mut Cluster) -> (Member, u64) {
    let a = member(1);
    c.handle(ms(0), ClusterInput::Joined(Box::new(a.clone())));
    c.handle(
        ms(0),
        ClusterInput::Plan {
            stages: vec![(a.node_id, 0..4)],
        },
    );
    let epoch = c.membership().epoch().unwrap().id;
    msg(
        c,
        1,
        &a,
        NodeToCoord::Loaded {
            epoch,
            report: LoadReport::default(),
        },
    );
    msg(c, 2, &a, NodeToCoord::Linked { epoch, link: None });
    assert!(c.membership().serves(epoch));
    (a, epoch)
}

fn spec(max_new_tokens: usize) -> Box<RunSpec> {
    Box::new(
        RunSpec::new(
            vec![1, 2, 3],
            100,
            Default::default(),
            max_new_tokens,
            vec![],
        )
        .unwrap(),
    )
}

fn sent(out: &[ClusterOutput]) -> Vec<(NodeId, CoordToNode)> {
    out.iter()
        .filter_map(|o| match o {
            ClusterOutput::ToNode { to, msg } => Some((*to, (**msg).clone())),
            _ => None,
        })
        .collect()
}

fn tokens(out: &[ClusterOutput]) -> Vec<u32> {
    out.iter()
        .filter_map(|o| match o {
            ClusterOutput::Run {
                news: RunNews::Event(RunEvent::Token { token, .. }),
                ..
            } => Some(*token),
            _ => None,
        })
        .collect()
}

/// Submits run 1 on the ready cell and has node 1 open it: the run is streaming.
fn running(c: &mut Cluster, a: &Member, max_new_tokens: usize) {
    let out = c.handle(
        ms(10),
        ClusterInput::Submit {
            run: 1,
            spec: spec(max_new_tokens),
            stages: None,
            positions: 3 + max_new_tokens as u64,
        },
    );
    assert!(
        matches!(&sent(&out)[..], [(n, CoordToNode::Open(o))] if *n == a.node_id && o.seq == 1),
        "{out:?}"
    );
    let out = msg(c, 11, a, NodeToCoord::Opened { seq: 1, cached: 0 });
    assert!(matches!(
        &sent(&out)[..],
        [(_, CoordToNode::Start { seq: 1, .. })]
    ));
}

#[test]
fn a_request_is_seated_on_the_ready_cell_and_streams_what_its_sampler_sends() {
    let mut c = cluster();
    let (a, epoch) = one_node_ready(&mut c);
    running(&mut c, &a, 2);
    assert_eq!(c.cells().seated(epoch), 1);
    let out = msg(
        &mut c,
        12,
        &a,
        NodeToCoord::Token {
            seq: 1,
            pos: 3,
            token: 42,
            logprobs: None,
        },
    );
    assert_eq!(tokens(&out), [42]);
}

#[test]
fn tokens_touch_only_their_run_and_leave_the_timer_table_its_size() {
    let mut c = cluster();
    let (a, _) = one_node_ready(&mut c);
    running(&mut c, &a, 500);
    let armed = c.timers_armed();
    for i in 0..400u64 {
        let out = msg(
            &mut c,
            20 + i,
            &a,
            NodeToCoord::Token {
                seq: 1,
                pos: 3 + i as usize,
                token: 7,
                logprobs: None,
            },
        );
        // One token in, that token out: no epoch record, no message to any node.
        assert!(
            matches!(
                &out[..],
                [ClusterOutput::Run {
                    run: 1,
                    news: RunNews::Event(RunEvent::Token { .. })
                }]
            ),
            "{out:?}"
        );
    }
    assert_eq!(
        c.timers_armed(),
        armed,
        "re-armed timers replace themselves"
    );
}

#[test]
fn a_node_silent_for_a_lease_is_one_output_that_closes_its_session_and_tells_the_desk() {
    let mut c = cluster();
    let (a, b) = (member(1), member(2));
    c.handle(ms(0), ClusterInput::Joined(Box::new(a.clone())));
    c.handle(ms(0), ClusterInput::Joined(Box::new(b.clone())));
    // Leases are timed from the first tick after a join.
    c.handle(ms(0), ClusterInput::Timeout);
    let mut expired = Vec::new();
    let mut at = 0;
    while at < 3_000 && expired.is_empty() {
        at = c.poll_timeout().unwrap().as_millis() as u64;
        // Node 1 keeps talking; node 2 is silent.
        msg(
            &mut c,
            at,
            &a,
            NodeToCoord::Heartbeat { expert_cache: None },
        );
        expired = c.handle(ms(at), ClusterInput::Timeout);
        expired.retain(|o| matches!(o, ClusterOutput::LeaseExpired { .. }));
    }
    assert!(
        matches!(&expired[..], [ClusterOutput::LeaseExpired { node, session: 2 }] if *node == b.node_id),
        "{expired:?}"
    );
    assert!(at >= LEASE.as_millis() as u64);
    assert!(!c.membership().member(&b.node_id).unwrap().connected);
    assert!(c.membership().member(&a.node_id).unwrap().connected);
}

#[test]
fn a_run_hears_its_epoch_lost_when_its_node_leaves_without_being_polled() {
    let mut c = cluster();
    let (a, epoch) = one_node_ready(&mut c);
    running(&mut c, &a, 5);
    let out = c.handle(
        ms(30),
        ClusterInput::Left {
            node: a.node_id,
            session: a.session,
        },
    );
    assert!(out.iter().any(|o| matches!(
        o,
        ClusterOutput::Run {
            run: 1,
            news: RunNews::Event(RunEvent::Paused { .. })
        }
    )));
    assert!(out
        .iter()
        .any(|o| matches!(o, ClusterOutput::NodeLeft { node, .. } if *node == a.node_id)));
    assert!(!c.membership().serves(epoch));
}

#[test]
fn a_request_with_no_cell_and_none_coming_is_refused_with_the_reason() {
    let mut c = cluster();
    let out = c.handle(
        ms(0),
        ClusterInput::Submit {
            run: 1,
            spec: spec(3),
            stages: None,
            positions: 6,
        },
    );
    let why = out.into_iter().find_map(|o| match o {
        ClusterOutput::Run {
            run: 1,
            news: RunNews::Ended(Err(r)),
        } => Some(r),
        _ => None,
    });
    assert!(matches!(
        why,
        Some(RunRefused::Unavailable(Unavailable::NoAssignment))
    ));
    assert_eq!(c.runs(), 0);
}

#[test]
fn a_finished_run_leaves_its_seat_and_routes() {
    let mut c = cluster();
    let (a, epoch) = one_node_ready(&mut c);
    running(&mut c, &a, 1);
    msg(
        &mut c,
        12,
        &a,
        NodeToCoord::Token {
            seq: 1,
            pos: 3,
            token: 9,
            logprobs: None,
        },
    );
    msg(
        &mut c,
        13,
        &a,
        NodeToCoord::Finished {
            seq: 1,
            reason: FinishReason::Length,
            generated: 1,
            error: None,
        },
    );
    let out = msg(
        &mut c,
        14,
        &a,
        NodeToCoord::Closed {
            seq: 1,
            stats: Default::default(),
        },
    );
    let ended = out.iter().find_map(|o| match o {
        ClusterOutput::Run {
            run: 1,
            news: RunNews::Ended(Ok(outcome)),
        } => Some(outcome.generated.clone()),
        _ => None,
    });
    assert_eq!(ended, Some(vec![9]));
    assert_eq!(c.runs(), 0);
    assert_eq!(c.cells().seated(epoch), 0);
    assert_eq!(c.timers_armed(), 1, "only the lease clock is left");
}
