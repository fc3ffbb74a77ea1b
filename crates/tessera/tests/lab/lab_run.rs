//! `tessera lab run`: every plan of a scenario measured with one process's text — the stage
//! ring, the expert split and one node streaming; the calibrated scenario it saves given back
//! to the planner; a scaling curve over the first hosts; and a speculating ring beside the
//! plain one.

use std::path::PathBuf;
use std::time::Duration;

use crate::common::{self, model};
use crate::{lab_can_run, tessera_json};

/// `tessera lab run` on the MoE scenario: the stage ring, the expert split (a coordinator
/// restarted with `--experts`) and the best single node streaming from its disk the experts its
/// budget cannot hold (an expert split homed on it owning every expert) are measured, each
/// with the text of one process; and the calibrated scenario it saves predicts the ring as
/// calibration did when given back to `--plan auto`, and is planned by `tessera plan`.
#[test]
fn lab_run_measures_the_ring_the_expert_split_and_one_node_streaming_with_one_process_text() {
    if !lab_can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let scenario =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tessera-lab/scenarios/moe-experts.toml");
    let saved = dir.path().join("calibrated.toml");
    let report = tessera_json::<&std::ffi::OsStr>(
        [
            "lab".as_ref(),
            "run".as_ref(),
            "--json".as_ref(),
            "--dir".as_ref(),
            dir.path().join("run").as_os_str(),
            "--save-calibrated".as_ref(),
            saved.as_os_str(),
            scenario.as_os_str(),
        ],
        Duration::from_secs(150),
    );
    // The two hosts share this machine: what its cores compute at once was measured, one
    // decoder alone and then one per host.
    let machine = &report["machine"];
    assert_eq!(machine["copies"], 2, "{report:#}");
    for rate in ["alone_tok_s", "together_tok_s"] {
        assert!(machine[rate].as_f64().unwrap() > 0.0, "{report:#}");
    }
    let rows = report["rows"].as_array().unwrap();
    let measured = |strategy: &str| {
        rows.iter()
            .find(|r| r["strategy"] == strategy && r["measured"].is_object())
            .unwrap_or_else(|| panic!("no measured {strategy} plan: {report:#}"))
    };
    for s in ["stage", "expert", "single"] {
        let r = measured(s);
        let m = &r["measured"];
        assert!(m["decode_tokens_per_s"].as_f64().unwrap() > 0.0, "{r:#}");
        assert!(m["ttft_ms"].as_f64().unwrap() > 0.0, "{r:#}");
        // Hidden states cross the switch every token of a ring; one node alone sends nothing
        // to the others. An expert split sends a layer's rows only to an owner of an expert
        // the router picked: the planner may leave the owner a single expert (one CI run
        // measured `home[0..3) streaming 1 MiB + owner{e7..8}`), which this short greedy text
        // never routes to, so its traffic is not asserted here (`tests/moe_split.rs` checks
        // the split's traffic on splits it sets).
        let wire = m["wire_bytes_per_token"].as_f64().unwrap();
        match s {
            "single" => assert!(wire < 1.0, "{r:#}"),
            "stage" => assert!(wire > 0.0, "{r:#}"),
            _ => assert!(wire >= 0.0, "{r:#}"),
        }
        // Every measured request's text is one process's.
        let text = &r["text"];
        assert!(text["checked"].as_u64().unwrap() >= 1, "{r:#}");
        assert_eq!(text["identical"], text["checked"], "{r:#}");
        assert!(r["measured_rank"].as_u64().is_some(), "{r:#}");
        assert!(
            r["calibrated"]["decode_tokens_per_s"].as_f64().is_some(),
            "{r:#}"
        );
    }
    // The single node streams: its plan leaves experts on disk.
    let single = measured("single");
    assert!(
        single["description"]
            .as_str()
            .unwrap()
            .contains("streaming"),
        "{single:#}"
    );
    assert!(
        !report["one_process_text"].as_str().unwrap().is_empty(),
        "{report:#}"
    );
    // The loop closed: the saved graph given back to the coordinator's `--plan auto`
    // (`--calibrated`) predicts the ring as calibration did.
    let ring = measured("stage");
    // "home[0..2) -> owner[2..3)" as a split: "home=0..2,owner=2..3".
    let split = ring["description"]
        .as_str()
        .unwrap()
        .replace('[', "=")
        .replace(')', "")
        .replace(" -> ", ",");
    let second = tessera_json::<&std::ffi::OsStr>(
        [
            "lab".as_ref(),
            "run".as_ref(),
            "--json".as_ref(),
            "--split".as_ref(),
            split.as_ref(),
            "--dir".as_ref(),
            dir.path().join("again").as_os_str(),
            "--calibrated".as_ref(),
            saved.as_os_str(),
            scenario.as_os_str(),
        ],
        Duration::from_secs(150),
    );
    let ring_again = second["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["description"] == ring["description"])
        .unwrap_or_else(|| panic!("the same ring again: {second:#}"));
    let (was, now) = (
        ring["calibrated"]["decode_tokens_per_s"].as_f64().unwrap(),
        ring_again["predicted"]["decode_tokens_per_s"]
            .as_f64()
            .unwrap(),
    );
    assert!(
        (now - was).abs() <= 0.01 * was,
        "calibrated {was} tok/s, predicted from the calibrated graph {now}"
    );
    let mut plan = std::process::Command::new(common::bin());
    plan.args(["plan", "--model"])
        .arg(model("test/small-qwen3moe-Q8_0.gguf"))
        .arg("--nodes")
        .arg(&saved)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let out = common::run_with_timeout(plan, Duration::from_secs(30));
    assert!(
        out.status.success(),
        "tessera plan on the calibrated scenario: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `tessera lab run --hosts 1,2`: the MoE scenario on its first host, then on both, each run
/// on the same caps; every plan measured in each with one process's text, and the one-host run
/// holds only single-node plans.
#[test]
fn lab_run_hosts_gives_a_scaling_curve_of_runs_on_the_first_hosts() {
    if !lab_can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let scenario =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tessera-lab/scenarios/moe-experts.toml");
    let points = tessera_json::<&std::ffi::OsStr>(
        [
            "lab".as_ref(),
            "run".as_ref(),
            "--json".as_ref(),
            "--hosts".as_ref(),
            "1,2".as_ref(),
            "--dir".as_ref(),
            dir.path().as_os_str(),
            scenario.as_os_str(),
        ],
        Duration::from_secs(240),
    );
    let points = points.as_array().unwrap();
    assert_eq!(points.len(), 2, "{points:#?}");
    for (p, hosts) in points.iter().zip([1, 2]) {
        assert_eq!(p["hosts"], hosts, "{p:#}");
        let rows = p["report"]["rows"].as_array().unwrap();
        let measured: Vec<&serde_json::Value> =
            rows.iter().filter(|r| r["measured"].is_object()).collect();
        assert!(!measured.is_empty(), "{p:#}");
        for r in &measured {
            assert_eq!(r["text"]["identical"], r["text"]["checked"], "{r:#}");
        }
        if hosts == 1 {
            assert!(rows.iter().all(|r| r["strategy"] == "single"), "{p:#}");
        } else {
            assert!(measured.iter().any(|r| r["strategy"] != "single"), "{p:#}");
        }
    }
}

/// A workload that speculates: each plan's requests are measured again speculating by prompt
/// lookup, alternated with the plain ones; the ring's speculating requests give one process's
/// text, and the report counts the drafts sent and accepted.
#[test]
fn lab_run_measures_a_speculating_ring_beside_the_plain_one_with_one_process_text() {
    if !lab_can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let scenarios = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tessera-lab/scenarios");
    // A story that begins again: prompt lookup finds what followed the first time.
    let text = std::fs::read_to_string(scenarios.join("must-split.toml"))
        .unwrap()
        .replace(
            "gguf = \"../../../models/test/small-qwen3-Q8_0.gguf\"",
            &format!("gguf = {:?}", model("stories260K.gguf")),
        )
        .replace(
            "prompt = \"Once upon a time\"",
            "prompt = \"Once upon a time, there was a little girl named Lily. She liked to \
             play outside. Once upon a time, there was a little\"",
        )
        .replace("tokens = 128", "tokens = 48\nspeculate = 4")
        // The two nodes 10 ms apart, the coordinator 0.3 ms from each (the default link): the
        // planner must be given the path between the nodes, which only they can measure.
        .replace(
            "[model]",
            "[[link]]\nnodes = [\"pi-a\", \"pi-b\"]\nrtt_ms = 10\nbandwidth = \"1Gbit/s\"\n\n[model]",
        );
    assert!(
        text.contains("speculate = 4") && text.contains("stories260K") && text.contains("Lily"),
        "{text}"
    );
    assert!(text.contains("rtt_ms = 10"), "{text}");
    let scenario = dir.path().join("speculating.toml");
    std::fs::write(&scenario, text).unwrap();
    let report = tessera_json::<&std::ffi::OsStr>(
        [
            "lab".as_ref(),
            "run".as_ref(),
            "--json".as_ref(),
            "--split".as_ref(),
            "pi-a=0..2,pi-b=2..5".as_ref(),
            "--dir".as_ref(),
            dir.path().join("run").as_os_str(),
            scenario.as_os_str(),
        ],
        Duration::from_secs(150),
    );
    let rows = report["rows"].as_array().unwrap();
    let ring = rows
        .iter()
        .find(|r| r["strategy"] == "stage" && r["measured"].is_object())
        .unwrap_or_else(|| panic!("no measured ring: {report:#}"));
    let sp = &ring["speculation"]["Ok"];
    assert_eq!(sp["k"], 4, "{ring:#}");
    assert!(
        sp["decode_tokens_per_s"].as_f64().unwrap() > 0.0,
        "{ring:#}"
    );
    assert!(sp["speedup"].as_f64().unwrap() > 0.0, "{ring:#}");
    // One speculating request after each plain one.
    assert_eq!(sp["text"]["checked"], ring["text"]["checked"], "{ring:#}");
    assert_eq!(sp["text"]["identical"], sp["text"]["checked"], "{ring:#}");
    // The story repeats, so lookup finds drafts and some are accepted.
    let (drafted, accepted) = (
        sp["drafted"].as_u64().unwrap(),
        sp["accepted"].as_u64().unwrap(),
    );
    assert!(
        drafted > 0 && accepted > 0 && accepted <= drafted,
        "{ring:#}"
    );
    assert!(sp["verifications"].as_u64().unwrap() > 0, "{ring:#}");
    // The link between the nodes as they measured it, not the coordinator's 0.3 ms to each.
    let links = report["links"].as_array().unwrap();
    assert_eq!(links.len(), 1, "{report:#}");
    let l = &links[0];
    assert_eq!(l["imposed_rtt_ms"].as_f64().unwrap(), 10.0, "{l:#}");
    let rtt = l["measured_rtt_ms"].as_f64().unwrap();
    assert!((8.0..20.0).contains(&rtt), "{l:#}");
    assert!(
        l["method"]
            .as_str()
            .unwrap()
            .starts_with("measured between"),
        "{l:#}"
    );
}
