//! What a node loads: exactly its stage's share of the model, read from its cache after a
//! restart (its own or the coordinator's), from a local copy of the model file, and nothing
//! beyond its memory budget.

use std::path::Path;

use crate::common::{model, report_of, tokens_of, Proc};
use crate::{Cluster, TIMEOUT};
use serde_json::Value;

/// Bytes of the header plus a stage's tensors, from the model's manifest.
fn share_bytes(path: &Path, layers: std::ops::Range<usize>, embed: bool, head: bool) -> u64 {
    let manifest = tessera_node::Manifest::from_gguf(path).unwrap();
    let a = tessera_proto::StageAssignment {
        epoch: 0,
        model: manifest.model_hash,
        stage: 0,
        n_stages: 1,
        layers,
        embed,
        head,
        next: None,
        prev: None,
        max_context: 1,
        kv_type: Default::default(),
        expert_budget: None,
    };
    let names = tessera_node::agent::stage_tensor_names(&manifest, &a);
    manifest.bytes_for(&names).unwrap()
}

fn loads(msgs: &[Value]) -> Vec<(u64, u64, u64)> {
    let started = msgs.iter().find(|m| m["type"] == "started").unwrap();
    started["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let l = &s["load"];
            (
                l["bytes_needed"].as_u64().unwrap(),
                l["bytes_transferred"].as_u64().unwrap(),
                l["bytes_already_present"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn node_receives_only_its_share_and_its_cache_survives_a_restart() {
    let path = model("stories260K.gguf");
    let file_len = std::fs::metadata(&path).unwrap().len();
    let mut c = Cluster::start(&path);
    c.add_node("a", &[]);
    c.add_node("b", &[]);
    let args = [
        "-p",
        "Once upon a time",
        "-n",
        "4",
        "--temperature",
        "0",
        "--split",
        "0..2,2..5",
    ];
    let (out, msgs) = c.run_json(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = loads(&msgs);
    let share_a = share_bytes(&path, 0..2, true, false);
    let share_b = share_bytes(&path, 2..5, false, true);
    assert_eq!(
        first[0],
        (share_a, share_a, 0),
        "stage 0 received exactly its share"
    );
    assert_eq!(
        first[1],
        (share_b, share_b, 0),
        "stage 1 received exactly its share"
    );
    assert!(share_a < file_len && share_b < file_len);

    // Restart node b without the token: it reconnects to the recorded coordinator and reads its
    // tensors from its cache.
    drop(c.nodes.pop());
    let mut b = Proc::spawn_with_events("b-again", &c.node_args("b", &[]), TIMEOUT);
    b.wait_event(&[("event", "joined")]);
    c.nodes.push(b);
    let (out, msgs) = c.run_json(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let second = loads(&msgs);
    assert_eq!(
        second[1],
        (share_b, 0, share_b),
        "nothing downloaded after the restart"
    );
    let report = report_of(&msgs);
    assert!(report["epoch"].as_u64().unwrap() > 1);
}

#[test]
fn nodes_rejoin_a_restarted_coordinator_and_serve_again() {
    let path = model("stories260K.gguf");
    let mut c = Cluster::start(&path);
    c.add_node("a", &[]);
    c.add_node("b", &[]);
    // Pin the stages to nodes: after the restart the nodes rejoin in either order.
    let plan = c.dir.path().join("plan.json");
    std::fs::write(
        &plan,
        r#"{"stages":[{"node":"a","layers":"0..2"},{"node":"b","layers":"2..5"}]}"#,
    )
    .unwrap();
    let plan = plan.display().to_string();
    let args = [
        "-p",
        "Once upon a time",
        "-n",
        "6",
        "--temperature",
        "0",
        "--plan",
        plan.as_str(),
    ];
    let (out, before) = c.run_json(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.restart_coordinator();
    for n in &mut c.nodes {
        n.wait_event_nth(&[("event", "joined")], 2);
    }
    let (out, after) = c.run_json(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(tokens_of(&after), tokens_of(&before));
    // The enrolled keys were remembered, and the nodes' caches kept their shares.
    assert!(
        loads(&after).iter().all(|l| l.1 == 0),
        "{:?}",
        loads(&after)
    );
}

#[test]
fn node_holding_the_model_file_reads_it_locally() {
    let path = model("stories260K.gguf");
    let mut c = Cluster::start(&path);
    c.add_node("a", &["--model", path.to_str().unwrap()]);
    let (out, msgs) = c.run_json(&[
        "-p",
        "Once",
        "-n",
        "2",
        "--temperature",
        "0",
        "--split",
        "0..5",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let l = loads(&msgs);
    assert_eq!(l[0].1, 0, "no bytes transferred");
    assert_eq!(l[0].0, l[0].2);
}

#[test]
fn assignment_beyond_the_memory_budget_is_refused() {
    let path = model("stories260K.gguf");
    let mut c = Cluster::start(&path);
    c.add_node("small", &["--memory-budget", "64KiB"]);
    let out = c.run(&["-p", "Once", "-n", "2", "--split", "0..5"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("budget"), "{err}");
}
