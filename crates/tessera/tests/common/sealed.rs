//! A sealed federation: a `tessera coordinator` of single-node cells, its nodes, and
//! `tessera client submit --json`, with what a test reads from the client's messages.

use std::collections::BTreeMap;

use serde_json::Value;

use super::chaos::{messages, reference_text, Cluster, Proc};
use super::model;

/// Small enough for many jobs per test, real enough to have a chat of layers.
pub const MODEL: &str = "test/small-qwen3-Q8_0.gguf";

/// A cluster of single-node cells, one per node (`name`, extra node flags), every node's claims
/// for the model received by the coordinator. Returns it with each node's key → name.
pub fn cluster(
    nodes: &[(&str, &[&str])],
    coordinator: &[&str],
) -> (Cluster, BTreeMap<String, String>) {
    let split = vec!["0..3"; nodes.len()].join(",");
    let mut c = Cluster::start_with(&model(MODEL), &split, coordinator);
    for (name, extra) in nodes {
        let join = c.join.clone();
        c.add_node_with(name, &join, extra);
    }
    c.wait_ready();
    wait_claims(&mut c, nodes.len());
    let keys = node_names(&mut c);
    (c, keys)
}

fn holds_the_model(e: &Value) -> bool {
    e["models"].as_u64() == Some(1)
}

/// Waits until the coordinator has had `n` claims holding the model.
pub fn wait_claims(c: &mut Cluster, n: usize) {
    c.coordinator
        .wait_event_where(&[("event", "claims")], n, holds_the_model);
}

/// Each node's key → name, from the claims holding the model.
pub fn node_names(c: &mut Cluster) -> BTreeMap<String, String> {
    c.coordinator
        .events(&[("event", "claims")])
        .into_iter()
        .filter(holds_the_model)
        .map(|e| {
            let s = |k: &str| e[k].as_str().unwrap().to_string();
            (s("node"), s("name"))
        })
        .collect()
}

/// `tessera client submit --json` against `c`, with its own client key.
pub fn submit(c: &Cluster, name: &str, flags: &[&str]) -> Proc {
    let mut args: Vec<String> = vec![
        "client".into(),
        "submit".into(),
        "--coordinator".into(),
        c.operator.clone(),
        "--data-dir".into(),
        c.dir.path().join(name).display().to_string(),
        "-m".into(),
        model(MODEL).display().to_string(),
        "--json".into(),
    ];
    args.extend(flags.iter().map(|s| s.to_string()));
    Proc::spawn(name, &args)
}

/// Waits for the client to exit: whether it succeeded, and every message it printed.
pub fn finished(p: &mut Proc) -> (bool, Vec<Value>) {
    let ok = p.finish().success();
    (ok, messages(p).into_iter().map(|(_, v)| v).collect())
}

/// The client's messages of `type` `t` (`answer`, `refused_answer`, …).
pub fn of_type(msgs: &[Value], t: &str) -> Vec<Value> {
    msgs.iter().filter(|m| m["type"] == t).cloned().collect()
}

/// The client's news lines of kind `event`.
pub fn news(msgs: &[Value], event: &str) -> Vec<Value> {
    msgs.iter()
        .filter(|m| m["news"]["event"] == event)
        .map(|m| m["news"].clone())
        .collect()
}

/// The text `tessera generate` gives: the prompt and the completion.
pub fn one_process(prompt: &str, n: &str) -> String {
    reference_text(
        &model(MODEL),
        &["-p", prompt, "-n", n, "--temperature", "0"],
    )
}
