//! `tessera coordinator --plan auto`: the coordinator waits for the expected nodes, plans from
//! the inventories in their hellos, and applies the chosen stage split. Real processes on
//! 127.0.0.1; the assertions are on decisions (which node holds which layers, within which
//! budget, producing which tokens), never on timings.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{bin, model, reference_tokens, run_with_timeout, Proc};
use serde_json::Value;
use tessera_model::{GgufFile, Tokenizer};

const TIMEOUT: Duration = Duration::from_secs(90);

fn parse_range(s: &str) -> (usize, usize) {
    let (a, b) = s.split_once("..").unwrap();
    (a.parse().unwrap(), b.parse().unwrap())
}

/// Two nodes whose budgets are each too small for stories260K (as the planner counts memory:
/// weights, KV cache, buffers): the coordinator plans a two-stage ring from their inventories,
/// every stage stays within its node's budget, and the ring generates what one process does.
#[test]
fn plan_auto_splits_within_budgets_and_matches_one_process() {
    let path = model("stories260K.gguf");
    let dir = tempfile::tempdir().unwrap();
    let budgets = [("small", 2u64 << 20), ("large", 5u64 << 19)]; // 2 MiB and 2.5 MiB
    let mut coordinator = Proc::spawn(
        "coordinator",
        &[
            "coordinator".into(),
            "--model".into(),
            path.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            dir.path().join("coord").display().to_string(),
            "--max-context".into(),
            "64".into(),
            "--plan".into(),
            "auto".into(),
            "--nodes-expected".into(),
            "2".into(),
        ],
        TIMEOUT,
    );
    let join = coordinator.wait_for("join token: ");
    let mut nodes = Vec::new();
    for (name, budget) in budgets {
        let args: Vec<String> = [
            "node",
            "--data-dir",
            &dir.path().join(name).display().to_string(),
            "--listen",
            "127.0.0.1:0",
            "--name",
            name,
            "--threads",
            "1",
            "--quick-probe",
            "--memory-budget",
            &budget.to_string(),
            "--join",
            &join,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut p = Proc::spawn(name, &args, TIMEOUT);
        // One after another, so their probes do not overlap.
        p.wait_for("joined coordinator ");
        nodes.push(p);
    }
    let placed = coordinator.wait_for("plan auto: ");
    coordinator.wait_for("Chosen: stage");

    // The decision: both nodes, contiguous layers 0..5, ring order as planned.
    let stages: Vec<(String, (usize, usize))> = placed
        .split_whitespace()
        .map(|s| {
            let (n, r) = s.split_once('=').unwrap();
            (n.to_string(), parse_range(r))
        })
        .collect();
    assert_eq!(stages.len(), 2, "{placed}");
    assert_eq!(stages[0].1 .0, 0);
    assert_eq!(stages[0].1 .1, stages[1].1 .0);
    assert_eq!(stages[1].1 .1, 5);
    let mut names: Vec<&str> = stages.iter().map(|s| s.0.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["large", "small"]);

    // The plan the coordinator wrote: measured evidence, and memory within each budget.
    let doc: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("coord/plan-auto.json")).unwrap())
            .unwrap();
    let plan = &doc["outcome"]["plan"];
    assert_eq!(plan["strategy"], "stage");
    for a in plan["cells"][0]["assignments"].as_array().unwrap() {
        let m = &a["memory"];
        assert!(m["total"].as_u64() <= m["budget"].as_u64(), "{a}");
    }
    for e in plan["evidence"].as_array().unwrap() {
        assert_eq!(e["source"]["kind"], "measured", "{e}");
    }

    // The run: the placement is the plan's, each node within its budget, the tokens those of
    // one process.
    let g = GgufFile::open(&path).unwrap();
    let prompt_text = "Once upon a time";
    let prompt = Tokenizer::from_gguf(&g).unwrap().encode(prompt_text, true);
    let n = 16;
    let chunk = 4;
    let want = reference_tokens(&path, &prompt, n, chunk);
    let mut cmd = Command::new(bin());
    cmd.args(["run", "--coordinator", &join, "--data-dir"])
        .arg(dir.path().join("client"))
        .args([
            "--json",
            "-p",
            prompt_text,
            "-n",
            &n.to_string(),
            "--temperature",
            "0",
            "--prefill-chunk",
            &chunk.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = run_with_timeout(cmd, TIMEOUT);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let msgs: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let got: Vec<u32> = msgs
        .iter()
        .filter(|m| m["type"] == "token" && m["token"].as_u64() != Some(u64::from(u32::MAX)))
        .map(|m| m["token"].as_u64().unwrap() as u32)
        .collect();
    assert_eq!(got, want);
    let report = msgs.iter().find(|m| m["type"] == "done").unwrap();
    let ran: Vec<(String, (usize, usize))> = report["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_string(),
                parse_range(s["layers"].as_str().unwrap()),
            )
        })
        .collect();
    assert_eq!(ran, stages);
    for s in report["stages"].as_array().unwrap() {
        let budget = budgets
            .iter()
            .find(|b| b.0 == s["name"])
            .map(|b| b.1)
            .unwrap();
        assert!(
            s["load"]["resident_bytes"].as_u64().unwrap() <= budget,
            "{s}"
        );
    }
    drop(nodes);
}
