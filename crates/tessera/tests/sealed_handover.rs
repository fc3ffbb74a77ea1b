//! A dead worker's sealed job moves within the node lease (issue #34, item 1), with real
//! processes on 127.0.0.1: a `tessera coordinator` (3 s node lease) with two single-node
//! cells, and `tessera client submit`.
//!
//! The worker holding a job is killed (`kill -9`) or frozen (`SIGSTOP`): its lease expires within the node lease,
//! the sealed desk hears of it in the same step, and the job is dispatched to the other worker
//! at once, long before the tier's job lease (about 20 s) would have moved it; the client gets
//! one answer. A job submitted after that never goes to the dead worker: its claims are no
//! longer listed.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::chaos::{messages, Cluster, Proc};
use common::model;
use serde_json::Value;

const MODEL: &str = "test/small-qwen3-Q8_0.gguf";

/// Two single-node cells whose claims the coordinator holds; each node's key → name.
fn cluster() -> (Cluster, BTreeMap<String, String>) {
    let path = model(MODEL);
    let mut c = Cluster::start_with(&path, "0..3,0..3", &["--verify-per-mille", "0"]);
    for name in ["n0", "n1"] {
        let join = c.join.clone();
        c.add_node_with(name, &join, &[]);
    }
    c.wait_ready();
    let holding = |e: &Value| e["models"].as_u64() == Some(1);
    c.coordinator
        .wait_event_where(&[("event", "claims")], 2, holding);
    let keys = c
        .coordinator
        .events(&[("event", "claims")])
        .into_iter()
        .filter(|e| holding(e))
        .map(|e| {
            let s = |k: &str| e[k].as_str().unwrap().to_string();
            (s("node"), s("name"))
        })
        .collect();
    (c, keys)
}

/// `tessera client submit --json` with the operator line in `TESSERA_TOKEN`.
fn submit(c: &Cluster, name: &str, n: &str) -> Proc {
    let args: Vec<String> = [
        "client",
        "submit",
        "--data-dir",
        &c.dir.path().join(name).display().to_string(),
        "-m",
        &model(MODEL).display().to_string(),
        "--json",
        "-p",
        "Lily and Ben",
        "-n",
        n,
        "--temperature",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    std::env::set_var("TESSERA_TOKEN", &c.operator);
    Proc::spawn(name, &args)
}

/// When the client's first news of kind `event` for `attempt` arrived (after waiting for it).
fn news_at(p: &mut Proc, event: &str, attempt: u64) -> (Instant, Value) {
    let pred = |m: &Value| m["news"]["event"] == event && m["news"]["attempt"] == attempt;
    p.wait_event_where(&[], 1, pred);
    messages(p)
        .into_iter()
        .find(|(_, m)| pred(m))
        .map(|(t, m)| (t, m["news"].clone()))
        .unwrap()
}

#[test]
fn a_killed_workers_sealed_job_moves_to_another_within_the_node_lease() {
    holder_lost("-KILL");
}

#[test]
fn a_frozen_workers_sealed_job_moves_to_another_within_the_node_lease() {
    holder_lost("-STOP");
}

/// Signals the holder of a sealed job with `signal` and checks the handover.
fn holder_lost(signal: &str) {
    let (mut c, names) = cluster();
    let mut p = submit(&c, "client", "200");
    let (_, dispatched) = news_at(&mut p, "dispatched", 1);
    p.wait_event_where(&[], 1, |m| m["news"]["event"] == "progress");
    let dead_key = dispatched["to"].as_str().unwrap().to_string();
    let dead = names[&dead_key].clone();
    c.node(&dead).signal(signal);
    let killed = Instant::now();
    // Moved within the 3 s node lease and a tick, not the tier's ~20 s job lease.
    let (expired, _) = news_at(&mut p, "expired", 1);
    let (again, moved) = news_at(&mut p, "dispatched", 2);
    assert_ne!(moved["to"].as_str().unwrap(), dead_key);
    let handover = again.saturating_duration_since(killed);
    assert!(
        handover < Duration::from_secs(6),
        "moved {handover:?} after the kill"
    );
    assert!(expired <= again);
    assert!(p.finish().success(), "{:?}", p.seen);
    let answered = messages(&p)
        .into_iter()
        .filter(|(_, m)| m["type"] == "answer")
        .collect::<Vec<_>>();
    assert_eq!(answered.len(), 1, "one answer");
    assert_eq!(answered[0].1["attempt"], 2);
    let done = answered[0].0.saturating_duration_since(killed);
    assert!(
        done < Duration::from_secs(20),
        "answered {done:?} after the kill"
    );
    println!(
        "attack table: kill {signal} of the holder: moved after {handover:?}, answered after {done:?}"
    );

    // A job submitted now goes only to the live worker: the dead one is not listed.
    let mut q = submit(&c, "client2", "8");
    assert!(q.finish().success(), "{:?}", q.seen);
    for (_, m) in messages(&q) {
        if m["news"]["event"] == "dispatched" {
            assert_ne!(m["news"]["to"].as_str().unwrap(), dead_key, "{m}");
        }
    }
}
