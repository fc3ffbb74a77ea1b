//! `tessera coordinator --plan auto`: the coordinator waits for the expected nodes, plans from
//! the inventories in their hellos, and applies the chosen stage split or expert split. Real
//! processes on 127.0.0.1; the assertions are on decisions (which node holds which layers or
//! experts, within which budget, producing which tokens), never on timings.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{bin, model, reference_tokens, report_of, run_with_timeout, tokens_of, Proc};
use serde_json::Value;
use tessera_model::{GgufFile, ModelConfig, Tokenizer};

const TIMEOUT: Duration = Duration::from_secs(90);

fn parse_range(s: &str) -> (usize, usize) {
    let (a, b) = s.split_once("..").unwrap();
    (a.parse().unwrap(), b.parse().unwrap())
}

/// `tessera coordinator --plan auto --nodes-expected N` on `model`; its join and operator
/// tokens.
fn auto_coordinator(dir: &Path, model: &Path, expected: usize) -> (Proc, String, String) {
    auto_coordinator_with(dir, model, expected, &[])
}

/// [`auto_coordinator`] with more arguments.
fn auto_coordinator_with(
    dir: &Path,
    model: &Path,
    expected: usize,
    extra: &[String],
) -> (Proc, String, String) {
    let mut coordinator = Proc::spawn_with_events(
        "coordinator",
        &[
            "coordinator".into(),
            "--model".into(),
            model.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            dir.join("coord").display().to_string(),
            "--max-context".into(),
            "64".into(),
            "--plan".into(),
            "auto".into(),
            "--nodes-expected".into(),
            expected.to_string(),
        ]
        .into_iter()
        .chain(extra.iter().cloned())
        .collect::<Vec<String>>(),
        TIMEOUT,
    );
    let join = coordinator.announced("join_token", "token");
    let operator = coordinator.announced("operator_token", "token");
    (coordinator, join, operator)
}

/// A node with a memory budget, started once it has joined (so that the probes of nodes on
/// this one host do not overlap).
fn budget_node(dir: &Path, join: &str, name: &str, budget: u64) -> Proc {
    let args: Vec<String> = [
        "node",
        "--data-dir",
        &dir.join(name).display().to_string(),
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
        join,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut p = Proc::spawn_with_events(name, &args, TIMEOUT);
    p.wait_event(&[("event", "joined")]);
    p
}

/// `tessera run --json` greedily on the coordinator's current plan; its messages.
fn run_greedy(dir: &Path, join: &str, prompt_text: &str, n: usize, chunk: usize) -> Vec<Value> {
    let mut cmd = Command::new(bin());
    cmd.args(["run", "--coordinator", join, "--data-dir"])
        .arg(dir.join("client"))
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
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Two nodes whose budgets are each too small for stories260K (as the planner counts memory:
/// weights, KV cache, buffers): the coordinator plans a two-stage ring from their inventories,
/// every stage stays within its node's budget, and the ring generates what one process does.
#[test]
fn plan_auto_splits_within_budgets_and_matches_one_process() {
    let path = model("stories260K.gguf");
    let dir = tempfile::tempdir().unwrap();
    let budgets = [("small", 5u64 << 18), ("large", 3u64 << 19)]; // 1.25 MiB and 1.5 MiB
    let (mut coordinator, join, operator) = auto_coordinator(dir.path(), &path, 2);
    let nodes: Vec<Proc> = budgets
        .iter()
        .map(|(name, budget)| budget_node(dir.path(), &join, name, *budget))
        .collect();
    let placed = coordinator.wait_event(&[("event", "plan_auto")])["ring"]
        .as_str()
        .unwrap()
        .to_string();

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
    let msgs = run_greedy(dir.path(), &operator, prompt_text, n, chunk);
    assert_eq!(tokens_of(&msgs), want);
    let report = report_of(&msgs);
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

/// A calibrated graph (`--calibrated`) that states an SD card's 20 MB/s for each node's disk,
/// written under `dir`: what the plan of an expert split is made on, whatever this machine's
/// disk probe measures.
fn sd_cards(dir: &Path, nodes: &[(&str, u64)]) -> PathBuf {
    let path = dir.join("sd-cards.toml");
    let mut cluster = String::new();
    for (name, _) in nodes {
        cluster += &format!(
            "[[node]]\nname = \"{name}\"\nprofile = \"laptop-16gb\"\ndisk_bandwidth = \"20MB/s\"\n"
        );
    }
    std::fs::write(&path, cluster).unwrap();
    path
}

/// Three nodes of one host whose budgets hold a qwen3moe model on no single node, no ring of
/// whole layers and no weight bank, all in memory, but hold it as a home node with attention,
/// embedding, head and some experts, and the other experts on the small nodes (a few experts of
/// every layer each, no whole layer). (Streaming the experts it cannot hold from its own disk, which
/// runs too, would beat the split on a fast disk: the VM's disk measures 1-5 GB/s as its
/// hypervisor caches it, so a calibrated graph (`--calibrated`) states an SD card's 20 MB/s for
/// every node's disk, as it would for boards that stream from one.)
/// The coordinator plans that expert split from their inventories, applies it (a ring of the
/// home alone plus expert-only nodes), and the cluster generates what one process does.
#[test]
fn plan_auto_executes_an_expert_split_and_matches_one_process() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The whole model is 5.7 MiB, a layer 1.8 MiB, one expert of every layer 0.6 MiB; the
    // planner also counts KV, activations and the process.
    let budgets = [
        ("home", 13u64 << 19), // 6.5 MiB
        ("x", 13u64 << 18),    // 3.25 MiB
        ("y", 13u64 << 18),
    ];
    let calibrated = sd_cards(dir.path(), &budgets);
    let (mut coordinator, join, operator) = auto_coordinator_with(
        dir.path(),
        &path,
        budgets.len(),
        &["--calibrated".into(), calibrated.display().to_string()],
    );
    let nodes: Vec<Proc> = budgets
        .iter()
        .map(|(name, budget)| budget_node(dir.path(), &join, name, *budget))
        .collect();
    let split = coordinator.wait_event(&[("event", "plan_auto_experts")])["experts"]
        .as_str()
        .unwrap()
        .to_string();
    let ring = coordinator.wait_event(&[("event", "plan_auto")])["ring"]
        .as_str()
        .unwrap()
        .to_string();
    eprintln!("plan auto: ring {ring}, experts {split}");
    assert_eq!(ring.trim(), format!("home=0..{}", cfg.n_layer));

    // The decision, as written to plan-auto.json: an expert split homed on "home", every
    // expert of every layer held once, each node within its budget.
    let doc: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("coord/plan-auto.json")).unwrap())
            .unwrap();
    let plan = &doc["outcome"]["plan"];
    eprintln!(
        "plan auto notes: {}",
        doc["outcome"]["explanation"]["notes"]
    );
    assert_eq!(plan["strategy"], "expert", "{}", doc["outcome"]);
    let assignments = plan["cells"][0]["assignments"].as_array().unwrap();
    assert_eq!(assignments[0]["node"], "home");
    let mut held: Vec<(String, u64, u64)> = Vec::new();
    for a in assignments {
        let m = &a["memory"];
        assert!(m["total"].as_u64() <= m["budget"].as_u64(), "{a}");
        let x = &a["experts"];
        if x.is_null() {
            // A home may keep no experts.
            continue;
        }
        assert_eq!(x["layers"]["start"], 0, "{a}");
        assert_eq!(x["layers"]["end"], cfg.n_layer, "{a}");
        held.push((
            a["node"].as_str().unwrap().to_string(),
            x["experts"]["start"].as_u64().unwrap(),
            x["experts"]["end"].as_u64().unwrap(),
        ));
    }
    assert!(held.len() >= 2, "{held:?}");
    assert_eq!(held.last().unwrap().2, cfg.n_expert as u64);
    // The applied split is the plan's: `a-b@node` per owner.
    let want_split: Vec<String> = held
        .iter()
        .map(|(n, a, b)| {
            if b - a == 1 {
                format!("{a}@{n}")
            } else {
                format!("{a}-{}@{n}", b - 1)
            }
        })
        .collect();
    assert_eq!(split.trim(), want_split.join(","));

    // The run: the home ring plus expert-only nodes, the tokens those of one process.
    let prompt_text = "Once upon a time, in a quiet village";
    let prompt = Tokenizer::from_gguf(&g).unwrap().encode(prompt_text, true);
    let (n, chunk) = (12, 4);
    let want = reference_tokens(&path, &prompt, n, chunk);
    let msgs = run_greedy(dir.path(), &operator, prompt_text, n, chunk);
    assert_eq!(
        tokens_of(&msgs),
        want,
        "expert split planned by --plan auto"
    );
    let report = report_of(&msgs);
    let mut ran: Vec<(String, String)> = report["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_string(),
                s["layers"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    ran.sort();
    let mut want_ran: Vec<(String, String)> = assignments
        .iter()
        .map(|a| {
            let name = a["node"].as_str().unwrap().to_string();
            let layers = if name == "home" {
                format!("0..{}", cfg.n_layer)
            } else {
                "0..0".to_string()
            };
            (name, layers)
        })
        .collect();
    want_ran.sort();
    assert_eq!(ran, want_ran);
    let trips: u64 = report["stage_stats"]
        .as_array()
        .unwrap()
        .iter()
        .map(|st| st["decode"]["expert_round_trips"].as_u64().unwrap_or(0))
        .sum();
    assert!(trips > 0, "no expert requests in {report}");
    for s in report["stages"].as_array().unwrap() {
        let budget = budgets.iter().find(|b| b.0 == s["name"]).unwrap().1;
        assert!(
            s["load"]["resident_bytes"].as_u64().unwrap() <= budget,
            "{s}"
        );
    }
    drop(nodes);
}

/// `tessera serve --plan auto` with the same budgets (and the same calibrated SD cards, given
/// to `serve --calibrated`): the dashboard's status shows the expert split the epoch runs — the home's ring stage with its share of every layer's experts, and each
/// expert-only node with no layers and its share — and the API answers through it.
#[test]
fn the_dashboard_shows_the_expert_split_of_a_served_cluster() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let cfg = ModelConfig::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let budgets = [
        ("home", 15u64 << 19), // 7.5 MiB
        ("x", 13u64 << 18),    // 3.25 MiB
        ("y", 13u64 << 18),
    ];
    let args: Vec<String> = [
        "serve",
        "--model",
        &path.display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--coordinator-listen",
        "127.0.0.1:0",
        "--data-dir",
        &dir.path().join("coord").display().to_string(),
        "--ctx",
        "64",
        "--nodes-expected",
        "3",
        "--plan",
        "auto",
        "--calibrated",
        &sd_cards(dir.path(), &budgets).display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut serve = Proc::spawn_with_events("serve", &args, TIMEOUT);
    let join = serve.announced("join_token", "token");
    let nodes: Vec<Proc> = budgets
        .iter()
        .map(|(name, budget)| budget_node(dir.path(), &join, name, *budget))
        .collect();
    let addr = serve.announced("listening", "addr").trim().to_string();

    // Poll the dashboard's status until the expert split's epoch is serving.
    let deadline = std::time::Instant::now() + TIMEOUT;
    let plan = loop {
        let status = common::get(&addr, "/api/status", None).json();
        let plan = &status["cluster"]["plan"];
        // The split is planned before its ring has loaded and linked: wait until it serves.
        let serving = common::get(&addr, "/health", None).status == 200;
        if plan["strategy"] == "expert split" && serving {
            break plan.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no expert split in {status}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let assignments = plan["assignments"].as_array().unwrap();
    let total: u64 = assignments
        .iter()
        .map(|a| a["experts"].as_u64().unwrap())
        .sum();
    assert_eq!(total, cfg.n_expert as u64, "every expert once: {plan}");
    let stages: Vec<&Value> = assignments
        .iter()
        .filter(|a| a["layers"][1].as_u64() > a["layers"][0].as_u64())
        .collect();
    assert_eq!(stages.len(), 1, "one ring stage, the home: {plan}");
    assert_eq!(stages[0]["layers"][1], cfg.n_layer, "{plan}");
    let expert_only: Vec<&Value> = assignments
        .iter()
        .filter(|a| a["layers"][0] == a["layers"][1] && a["experts"].as_u64() > Some(0))
        .collect();
    assert!(!expert_only.is_empty(), "no expert-only node in {plan}");

    // The dashboard page itself shows it: the strategy, the experts per layer, and each
    // assignment's share of the experts as a bar of its own.
    let page = common::get(&addr, "/", None);
    assert_eq!(page.status, 200);
    let html = &page.body;
    assert!(
        html.contains(r#"<span class="strategy">expert split</span>"#),
        "{html}"
    );
    assert!(
        html.contains(&format!(" · {} experts per layer", cfg.n_expert)),
        "{html}"
    );
    for a in assignments {
        let e = a["experts"].as_u64().unwrap();
        let bar = format!(r#"title="{e} of {} experts per layer""#, cfg.n_expert);
        assert!(
            e == 0 || html.contains(&bar),
            "no expert bar for {a} in the page"
        );
    }
    assert_eq!(
        html.matches(r#"<div class="experts c"#).count(),
        assignments
            .iter()
            .filter(|a| a["experts"].as_u64() > Some(0))
            .count(),
        "one expert bar per assignment holding experts"
    );

    // And the API answers through it, once every stage has loaded (503 until then).
    let reply = loop {
        let reply = common::post(
            &addr,
            "/v1/completions",
            &serde_json::json!({"model": "small-qwen3moe-Q8_0", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}),
        );
        if reply.status != 503 || std::time::Instant::now() > deadline {
            break reply;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(reply.status, 200, "{}", reply.body);
    drop(nodes);
}

/// `tessera serve --nodes-expected 2 --plan auto` without `--ctx`, on two nodes whose budgets
/// hold the model but not its full context (512 positions) at the gateway's batch: the
/// coordinator chooses the largest context that fits, says which (the `plan_auto` event), and
/// serves a request within it; a prompt longer than it is refused, saying the limit.
#[test]
fn serve_without_ctx_chooses_the_largest_context_the_budgets_hold() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let cfg = ModelConfig::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<String> = [
        "serve",
        "--model",
        &path.display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--coordinator-listen",
        "127.0.0.1:0",
        "--data-dir",
        &dir.path().join("coord").display().to_string(),
        "--nodes-expected",
        "2",
        "--plan",
        "auto",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut serve = Proc::spawn_with_events("serve", &args, TIMEOUT);
    let join = serve.announced("join_token", "token");
    let _nodes: Vec<Proc> = ["a", "b"]
        .iter()
        .map(|name| budget_node(dir.path(), &join, name, 12 << 20))
        .collect();
    let addr = serve.announced("listening", "addr").trim().to_string();
    let planned = serve.wait_event(&[("event", "plan_auto")]);
    let context = planned["context"].as_u64().unwrap() as usize;
    assert!(
        context > 0 && context < cfg.context_length && context.is_multiple_of(256),
        "context {context} of the model's {}: {planned}",
        cfg.context_length
    );

    // It serves within that context, once the plan has loaded (503 until then).
    let deadline = std::time::Instant::now() + TIMEOUT;
    let complete = |prompt: &str| {
        common::post(
            &addr,
            "/v1/completions",
            &serde_json::json!({"model": "small-qwen3moe-Q8_0", "prompt": prompt, "max_tokens": 4, "temperature": 0}),
        )
    };
    let reply = loop {
        let reply = complete("Once upon a time");
        if reply.status != 503 || std::time::Instant::now() > deadline {
            break reply;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(reply.status, 200, "{}", reply.body);
    let long = "Once upon a time there was a cat. ".repeat(context / 4);
    let refused = complete(&long);
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(
        refused.body.contains(&context.to_string()),
        "the refusal names the context limit: {}",
        refused.body
    );
}

/// Two nodes whose budgets hold a qwen3moe model neither alone nor as a ring of whole layers
/// in memory, with this machine's fast disks: the coordinator's plan streams experts from
/// disk (one node, run as a split homed on it, or a ring whose stages stream: whichever the
/// planner prices faster here), each node that streams is told by its assignment how many
/// bytes of experts the plan keeps in its memory (its expert cache reports that budget), and
/// the cluster generates what one process does.
#[test]
fn plan_auto_tells_each_streaming_node_its_planned_expert_budget() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let budgets = [("a", 7u64 << 19), ("b", 7u64 << 19)];
    let (mut coordinator, join, operator) =
        auto_coordinator_with(dir.path(), &path, budgets.len(), &[]);
    let nodes: Vec<Proc> = budgets
        .iter()
        .map(|(name, budget)| budget_node(dir.path(), &join, name, *budget))
        .collect();
    let ring = coordinator.wait_event(&[("event", "plan_auto")])["ring"]
        .as_str()
        .unwrap()
        .to_string();
    let doc: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("coord/plan-auto.json")).unwrap())
            .unwrap();
    let plan = &doc["outcome"]["plan"];
    // What the plan keeps in each streaming node's memory, as the coordinator computed it.
    let record: tessera_plan::AutoPlanRecord = serde_json::from_value(doc.clone()).unwrap();
    let profile = tessera_model::ModelProfile::from_gguf(&g).unwrap();
    let planner =
        tessera_placement::planning::planner_model(&profile, Default::default(), "m").unwrap();
    let want_budgets = tessera_placement::planning::expert_budgets(&planner, &record.outcome.plan);
    eprintln!(
        "plan auto: {ring}; expert budgets {want_budgets:?}; notes {}",
        doc["outcome"]["explanation"]["notes"]
    );
    assert!(!want_budgets.is_empty(), "the plan streams nothing: {plan}");
    assert!(want_budgets.iter().all(|(_, b)| *b > 0), "{want_budgets:?}");

    let prompt_text = "Once upon a time";
    let prompt = Tokenizer::from_gguf(&g).unwrap().encode(prompt_text, true);
    let (n, chunk) = (6, 4);
    let want = reference_tokens(&path, &prompt, n, chunk);
    let msgs = run_greedy(dir.path(), &operator, prompt_text, n, chunk);
    assert_eq!(tokens_of(&msgs), want, "{ring}");
    // Each streaming node's expert cache runs under the budget its assignment carried.
    for (node, budget) in &want_budgets {
        let e = coordinator.wait_event(&[("event", "expert_cache"), ("node", node.as_str())]);
        assert_eq!(e["budget_bytes"].as_u64(), Some(*budget), "{node}: {e}");
    }
    assert!(cfg.n_expert > 0);
    drop(nodes);
}
