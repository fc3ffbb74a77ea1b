//! Fault tests of the coordinator itself, with real processes on 127.0.0.1: a restarted
//! coordinator keeps its members (recorded keys, no re-enrolment), refuses keys that never
//! enrolled and continues the epoch numbering; with no node left to hold the model, a new request
//! is refused with the reason at once while a running generation waits, and resumes with the
//! one-process text when a node returns.
//!
//! Faults of the nodes are in `chaos.rs`; the processes and clusters are in `common/chaos.rs`.

mod common;

use std::time::{Duration, Instant};

use common::chaos::{
    messages, reference_text, run_to_end, text_of, tokens_seen, Cluster, Proc, TIMEOUT,
};
use common::model;

/// The events `event` that `p` printed so far.
fn count(p: &mut Proc, event: &str) -> usize {
    p.events(&[("event", event)]).len()
}

#[test]
fn restarted_coordinator_keeps_members_refuses_strangers_and_continues_epochs() {
    let path = model("test/small-qwen3-Q8_0.gguf");
    let flags = ["-p", "Once upon a time", "-n", "16", "--temperature", "0"];
    let want = reference_text(&path, &flags);
    let mut c = Cluster::start(&path, "0..1,1..2,2..3");
    for n in ["a", "b", "c"] {
        c.add_node(n);
    }
    c.wait_ready();
    let msgs = run_to_end(&c, "before", &flags);
    assert_eq!(text_of(flags[1], &msgs), want);
    let enrolled = count(&mut c.coordinator, "enrolled");
    assert_eq!(enrolled, 4, "three nodes and the client enrolled");
    c.restart_coordinator();
    // The nodes come back on their own, with their recorded keys: no enrolment.
    for n in ["a", "b", "c"] {
        c.node(n).wait_event_nth(&[("event", "joined")], 2);
    }
    let last = c.coordinator.wait_event(&[("event", "epochs_continue")])["after"]
        .as_u64()
        .unwrap();
    assert_eq!(last, 1, "the coordinator's own shutdown planned nothing");
    // The split applies again as a new epoch: 2, never 1 again.
    for n in ["a", "b", "c"] {
        c.node(n)
            .wait_event(&[("event", "assigned"), ("epoch", "2")]);
    }
    let msgs = run_to_end(&c, "after", &flags);
    assert_eq!(text_of(flags[1], &msgs), want);
    let report = msgs
        .iter()
        .find(|(_, m)| m["type"] == "done")
        .map(|(_, m)| m.clone())
        .unwrap();
    assert_eq!(
        report["epoch"], 2,
        "the epoch continues from the stored one"
    );
    assert_eq!(
        count(&mut c.coordinator, "enrolled"),
        0,
        "nobody re-enrolled"
    );
    // A key that never enrolled, pointed at the coordinator without the token, is refused.
    let stranger = c.dir.path().join("stranger");
    std::fs::create_dir_all(&stranger).unwrap();
    std::fs::copy(
        c.dir.path().join("a").join("coordinator.json"),
        stranger.join("coordinator.json"),
    )
    .unwrap();
    let mut args = c.node_args("stranger");
    args[2] = stranger.display().to_string();
    let mut s = Proc::spawn_with_events("stranger", &args);
    let stranger_id = s.wait_event(&[("event", "identity")])["node_id"]
        .as_str()
        .unwrap()
        .to_string();
    s.wait_event(&[("event", "listening")]);
    // Two failed attempts (not a fixed sleep: the stranger's own report of each attempt ends
    // the wait), never a join.
    s.wait_event_nth(&[("event", "session_failed")], 2);
    assert_eq!(count(&mut s, "joined"), 0, "an unenrolled key got in");
    assert_eq!(count(&mut c.coordinator, "enrolled"), 0);
    // The coordinator refused that key, for that reason: it tried to talk without enrolling.
    let why = c
        .coordinator
        .events(&[("event", "refused_connection"), ("peer", &stranger_id)]);
    assert!(
        !why.is_empty(),
        "the coordinator did not refuse {stranger_id}"
    );
    assert!(
        why.iter().all(|e| e["reason"]
            .as_str()
            .is_some_and(|r| r.ends_with("expected an enrolment stream"))),
        "{why:?}"
    );
}

#[test]
fn with_no_capacity_requests_get_a_reason_and_service_resumes_when_a_node_returns() {
    let path = model("test/small-qwen3-Q8_0.gguf");
    let flags = vec!["-p", "Once upon a time", "-n", "400", "--temperature", "0"];
    let want = reference_text(&path, &flags);
    let mut c = Cluster::start(&path, "0..3");
    c.add_node("a");
    c.wait_ready();
    let mut running = c.client("running", &flags);
    let deadline = Instant::now() + TIMEOUT;
    while tokens_seen(&running) < 2 {
        assert!(Instant::now() < deadline, "no tokens");
        running.drain();
        std::thread::sleep(Duration::from_millis(1));
    }
    c.node("a").signal("-KILL");
    c.coordinator
        .wait_event(&[("event", "lease_expired"), ("node", "a")]);
    // Nobody can hold the model: a new request is refused with the reason, at once.
    let mut refused = c.client("refused", &flags);
    assert!(!refused.finish().success());
    let why = refused
        .seen
        .iter()
        .map(|(_, l)| l.as_str())
        .find(|l| l.contains("service unavailable"))
        .map(str::to_string);
    assert!(
        why.as_deref()
            .is_some_and(|w| w.contains("no feasible plan")),
        "{:?}",
        refused.seen
    );
    eprintln!("chaos: outage: {}", why.unwrap());
    // The node comes back (same key, no token): the waiting run resumes and completes.
    let args = c.node_args("a");
    let mut back = Proc::spawn_with_events("a-again", &args);
    back.wait_event(&[("event", "joined")]);
    assert!(running.finish().success());
    let msgs = messages(&running);
    assert_eq!(text_of(flags[1], &msgs), want);
    assert!(msgs.iter().any(|(_, m)| m["type"] == "resumed"));
    c.nodes.push(back);
}
