//! The lab end to end: real `tessera serve` and `tessera node` processes on emulated hosts
//! (network namespaces joined by the lab's user-space switch), a greedy request through the
//! gateway's API, compared with one process.
//!
//! Needs root (namespaces, TUN devices). Without it the test says so and returns — except
//! under `CI=true`, where the machine is expected to be able to and the test fails instead.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{model, Server};
use tessera_lab::cluster::{Cluster, ClusterOptions};
use tessera_lab::{HostSpec, Lab, LabError, LabSpec};
use tessera_linkemu::Impairment;

const PROMPT: &str = "Once upon a time";
const TOKENS: usize = 40;
/// One-way delay of every link.
const LINK: Duration = Duration::from_millis(2);

/// Starts a lab, or returns `None` (with the reason on stderr) where this machine cannot make
/// one; under CI it must.
fn lab_or_skip(spec: &LabSpec) -> Option<Lab> {
    match Lab::start(spec) {
        Ok(lab) => Some(lab),
        Err(LabError::Unsupported(why)) if std::env::var("CI").as_deref() != Ok("true") => {
            eprintln!("lab test not run: {why}");
            None
        }
        Err(e) => panic!("starting the lab: {e}"),
    }
}

/// The text one process gives for the same request, through the same API.
fn one_process_text() -> String {
    let server = Server::start(&[
        "--model",
        &model("stories260K.gguf").display().to_string(),
        "-t",
        "1",
    ]);
    let body = serde_json::json!({
        "model": "stories260K", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
    });
    let r = common::post(&server.addr, "/v1/completions", &body).json();
    r["choices"][0]["text"]
        .as_str()
        .expect("a completion")
        .to_string()
}

/// Whether this machine can build a lab (root, namespaces); where it cannot, `lab_or_skip`
/// skips the test (and fails it under CI).
fn lab_can_run() -> bool {
    let probe = LabSpec::new(vec![HostSpec::new("a"), HostSpec::new("b")]);
    lab_or_skip(&probe).is_some()
}

/// Runs `tessera` with `args` (a command printing JSON), failing the test with its standard
/// error if it fails or outlives `timeout`; its JSON output.
fn tessera_json<S: AsRef<std::ffi::OsStr>>(
    args: impl IntoIterator<Item = S>,
    timeout: Duration,
) -> serde_json::Value {
    let mut cmd = std::process::Command::new(common::bin());
    cmd.args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let out = common::run_with_timeout(cmd, timeout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_stage_split_over_three_hosts_on_2ms_links_gives_the_text_of_one_process() {
    let spec = LabSpec::new(vec![
        HostSpec::new("coord"),
        HostSpec::new("a"),
        HostSpec::new("b"),
    ])
    .default_link(Impairment::default().delay(LINK));
    let Some(lab) = lab_or_skip(&spec) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(
        &lab,
        &ClusterOptions {
            tessera: PathBuf::from(common::bin()),
            model: model("stories260K.gguf"),
            dir: dir.path().to_path_buf(),
            coordinator: 0,
            nodes: vec![1, 2],
            split: None,
            threads: 1,
            timeout: Duration::from_secs(120),
        },
    )
    .unwrap_or_else(|e| panic!("starting the cluster in the lab: {e}"));
    // A warm-up, so the measured request does not pay the first sequence's set-up.
    cluster.complete(&lab, PROMPT, 4).unwrap();
    let c = cluster.complete(&lab, PROMPT, TOKENS).unwrap();
    assert_eq!(
        c.text,
        one_process_text(),
        "the lab's stage split and one process differ"
    );

    // Each decoded token crosses the ring: a → b → a, two one-way hops over 2 ms links. Below
    // that the switch did not impose the delay; the figure itself is printed.
    let step = c.decode_step_s().expect("several tokens were streamed");
    let hops = 2.0;
    eprintln!(
        "decode step {:.2} ms over {hops} hops of {:?} (hop cost beyond the link: {:.2} ms)",
        step * 1e3,
        LINK,
        (step - hops * LINK.as_secs_f64()) * 1e3 / hops
    );
    assert!(
        step >= hops * LINK.as_secs_f64(),
        "a token took {:.2} ms, less than its {hops} hops of {LINK:?}",
        step * 1e3
    );
    // Every packet between the hosts crossed the switch: the ring's traffic is on a ↔ b.
    let a_to_b = lab.switch().stats(1, 2);
    assert!(
        a_to_b.packets_out > 0 && a_to_b.dropped() == 0,
        "{a_to_b:?}"
    );
    drop(cluster);
    let id = lab.id().to_string();
    drop(lab);
    assert!(
        tessera_lab::netns::list(&id).is_empty(),
        "the lab's namespaces outlived it"
    );
}

/// Lines of a child's stdout, collected on a thread.
fn stdout_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead as _;
    let out = std::io::BufReader::new(child.stdout.take().expect("piped stdout"));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Kills a child when dropped.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_node_given_only_the_token_finds_the_coordinator_by_mdns_across_the_switch() {
    let spec = LabSpec::new(vec![HostSpec::new("coord"), HostSpec::new("a")])
        .default_link(Impairment::default().delay(Duration::from_millis(1)));
    let Some(lab) = lab_or_skip(&spec) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let stories = model("stories260K.gguf");
    let listen = format!("{}:7070", lab.addr(0));
    let mut cmd = lab.command(0, common::bin()).unwrap();
    cmd.args(["coordinator", "--mdns", "--listen", &listen, "--data-dir"])
        .arg(d.join("coord"))
        .arg("--model")
        .arg(&stories)
        .env(common::JSON_LOGS.0, common::JSON_LOGS.1)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut coordinator = Killed(cmd.spawn().unwrap());
    let lines = stdout_lines(&mut coordinator.0);
    let announced = |event: &str| loop {
        let l = lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("the coordinator announced no {event}"));
        if let Some(e) = common::event_in(&l, &[("event", event)]) {
            break e["token"].as_str().expect("a token").to_string();
        }
    };
    let join = announced("join_token");
    // Clients name stages: the operator's credential.
    let operator = announced("operator_token");
    let token = join.split('@').next().unwrap().to_string();
    assert!(
        join.ends_with(&listen),
        "{join} is not on the lab's address"
    );

    // The node gets the token alone: the coordinator's address can only come from mDNS,
    // multicast from host "coord" to host "a" through the switch.
    let mut cmd = lab.command(1, common::bin()).unwrap();
    cmd.args([
        "node",
        "--join",
        &token,
        "--name",
        "a",
        "--threads",
        "1",
        "--quick-probe",
    ])
    .arg("--data-dir")
    .arg(d.join("a"))
    .stdout(std::process::Stdio::null());
    let _node = Killed(cmd.spawn().unwrap());

    // A client on the coordinator's host runs a generation on that node: it can only succeed
    // once the node has found the coordinator and joined.
    let n_layer = {
        let g = tessera_model::GgufFile::open(&stories).unwrap();
        tessera_model::ModelConfig::from_gguf(&g).unwrap().n_layer
    };
    let run = || {
        let mut cmd = lab.command(0, common::bin()).unwrap();
        cmd.args([
            "run",
            "--coordinator",
            &operator,
            "--split",
            &format!("0..{n_layer}"),
        ])
        .args([
            "-p",
            PROMPT,
            "-n",
            "8",
            "--temperature",
            "0",
            "--json",
            "--data-dir",
        ])
        .arg(d.join("client"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        common::run_with_timeout(cmd, Duration::from_secs(120))
    };
    // Until the node has joined, the coordinator refuses the run and says so.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let out = loop {
        let out = run();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        if out.status.success() || !err.contains("nodes are connected") {
            break out;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the node never joined: {err}; coord→a {:?}; a→coord {:?}",
            lab.switch().stats(0, 1),
            lab.switch().stats(1, 0)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        out.status.success(),
        "the run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let msgs: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let report = common::report_of(&msgs);
    assert_eq!(report["stages"][0]["name"], "a", "{report}");
    assert_eq!(common::tokens_of(&msgs).len(), 8);
    // The discovery crossed the switch as multicast from the coordinator's host.
    assert!(lab.switch().stats(0, 1).packets_out > 0);
}

/// A child whose stdout and stderr lines are collected with their arrival times; killed on
/// drop.
struct Lines {
    child: std::process::Child,
    rx: std::sync::mpsc::Receiver<(std::time::Instant, String)>,
    seen: Vec<(std::time::Instant, String)>,
    name: String,
}

impl Lines {
    fn spawn(name: &str, mut cmd: std::process::Command) -> Self {
        use std::io::BufRead as _;
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let (tx, rx) = std::sync::mpsc::channel();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        let err = std::io::BufReader::new(child.stderr.take().unwrap());
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                let _ = tx.send((std::time::Instant::now(), l));
            }
        });
        std::thread::spawn(move || {
            for l in err.lines().map_while(Result::ok) {
                let _ = tx2.send((std::time::Instant::now(), l));
            }
        });
        Self {
            child,
            rx,
            seen: Vec::new(),
            name: name.into(),
        }
    }

    /// Waits for an event (a JSON line, `TESSERA_LOG_FORMAT=json`) whose fields have the given
    /// values; the event.
    fn wait_event(&mut self, fields: &[(&str, &str)]) -> serde_json::Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(e) = self
                .seen
                .iter()
                .find_map(|(_, l)| common::event_in(l, fields))
            {
                return e;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!("{}: no event {fields:?}; saw {:?}", self.name, self.seen),
            }
        }
    }

    /// The field `field` of the first `event` announced on stdout (see `Proc::announced`).
    fn announced(&mut self, event: &str, field: &str) -> String {
        self.wait_event(&[("event", event)])[field]
            .as_str()
            .unwrap_or_else(|| panic!("{event} has no {field}"))
            .to_string()
    }

    /// Waits until `n` token messages have arrived.
    fn wait_tokens(&mut self, n: usize) {
        while self
            .json()
            .iter()
            .filter(|(_, m)| m["type"] == "token")
            .count()
            < n
        {
            let (t, l) = self
                .rx
                .recv_timeout(Duration::from_secs(120))
                .unwrap_or_else(|_| panic!("{}: no tokens; saw {:?}", self.name, self.seen));
            self.seen.push((t, l));
        }
    }

    /// Waits for the exit and every line.
    fn finish(&mut self) -> std::process::ExitStatus {
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            while let Ok(l) = self.rx.try_recv() {
                self.seen.push(l);
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        while let Ok(l) = self.rx.recv_timeout(Duration::from_secs(5)) {
            self.seen.push(l);
        }
        status
    }

    fn json(&self) -> Vec<(std::time::Instant, serde_json::Value)> {
        self.seen
            .iter()
            .filter_map(|(t, l)| serde_json::from_str(l).ok().map(|v| (*t, v)))
            .collect()
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn failover_in_the_lab_a_killed_node_and_a_partitioned_host_leave_the_text_unchanged() {
    let names = ["coord", "a", "b", "c"];
    let spec = LabSpec::new(names.iter().map(|n| HostSpec::new(*n)).collect())
        .default_link(Impairment::default().delay(Duration::from_millis(1)));
    let Some(lab) = lab_or_skip(&spec) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let path = model("test/small-qwen3-Q8_0.gguf");
    let listen = format!("{}:7070", lab.addr(0));
    let mut cmd = lab.command(0, common::bin()).unwrap();
    cmd.args([
        "coordinator",
        "--listen",
        &listen,
        "--split",
        "0..1,1..2,2..3",
    ])
    .args(["--lease-ms", "1000", "--model"])
    .arg(&path)
    .arg("--data-dir")
    .arg(d.join("coord"))
    .env(common::JSON_LOGS.0, common::JSON_LOGS.1);
    let mut coordinator = Lines::spawn("coordinator", cmd);
    let join = coordinator.announced("join_token", "token");
    let operator = coordinator.announced("operator_token", "token");
    let mut nodes = Vec::new();
    for (i, name) in names.iter().enumerate().skip(1) {
        let mut cmd = lab.command(i, common::bin()).unwrap();
        cmd.args([
            "node",
            "--join",
            &join,
            "--name",
            name,
            "--threads",
            "1",
            "--quick-probe",
        ])
        .args(["--listen", &format!("{}:0", lab.addr(i)), "--data-dir"])
        .arg(d.join(name))
        .env(common::JSON_LOGS.0, common::JSON_LOGS.1);
        let mut p = Lines::spawn(name, cmd);
        p.wait_event(&[("event", "joined")]);
        nodes.push(p);
    }
    for p in &mut nodes {
        p.wait_event(&[("event", "loaded")]);
    }
    let flags = ["-p", "Once upon a time", "-n", "300", "--temperature", "0"];
    let want = common::chaos::reference_text(&path, &flags);
    let text_of = |msgs: &[(std::time::Instant, serde_json::Value)]| {
        let mut s = flags[1].to_string();
        for (_, m) in msgs.iter().filter(|(_, m)| m["type"] == "token") {
            s.push_str(m["text"].as_str().unwrap_or(""));
        }
        s + "\n"
    };
    let client = |name: &str| {
        let mut cmd = lab.command(0, common::bin()).unwrap();
        cmd.args(["run", "--coordinator", &operator, "--json"])
            .args(flags)
            .arg("--data-dir")
            .arg(d.join(name));
        Lines::spawn(name, cmd)
    };

    // 1. Node b is killed mid-generation.
    let mut c1 = client("client1");
    c1.wait_tokens(2);
    let struck = std::time::Instant::now();
    let _ = nodes[1].child.kill();
    assert!(c1.finish().success(), "{:?}", c1.seen);
    let msgs = c1.json();
    assert_eq!(text_of(&msgs), want, "after a killed node");
    let paused = msgs.iter().find(|(_, m)| m["type"] == "paused");
    assert!(
        paused.is_some(),
        "the kill landed after the generation ended"
    );
    eprintln!(
        "lab failover: kill -9 of b detected after {:?}",
        paused.unwrap().0.saturating_duration_since(struck)
    );

    // 2. Host c is cut off from every other host mid-generation.
    let mut c2 = client("client2");
    c2.wait_tokens(2);
    let struck = std::time::Instant::now();
    lab.switch().set_isolated(3, true);
    assert!(c2.finish().success(), "{:?}", c2.seen);
    let msgs = c2.json();
    assert_eq!(text_of(&msgs), want, "after a partitioned host");
    let paused = msgs.iter().find(|(_, m)| m["type"] == "paused");
    assert!(
        paused.is_some(),
        "the partition landed after the generation ended"
    );
    eprintln!(
        "lab failover: partition of c detected after {:?}",
        paused.unwrap().0.saturating_duration_since(struck)
    );
}

#[test]
fn tessera_lab_clean_removes_what_a_killed_lab_left_behind() {
    if tessera_lab::tun::check_supported().is_err() {
        // The same rule as every lab test: only where namespaces can be made, and always in CI.
        assert!(lab_or_skip(&LabSpec::new(vec![HostSpec::new("x")])).is_none());
        return;
    }
    // A selftest is a lab that runs for a while; kill it without warning once its hosts exist.
    let mut child = std::process::Command::new(common::bin())
        .args(["lab", "selftest"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let prefix = format!("{}{}-", tessera_lab::lab::PREFIX, child.id());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while tessera_lab::netns::list(&prefix).len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the selftest made no hosts"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !tessera_lab::netns::list(&prefix).is_empty(),
        "a killed lab cleans nothing itself"
    );

    let out = std::process::Command::new(common::bin())
        .args(["lab", "clean"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains(&prefix), "{said}");
    assert!(tessera_lab::netns::list(&prefix).is_empty(), "left: {said}");
}

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

/// `tessera lab hop` gives the hop figure on a switched link and on loopback: each from a
/// single node and a two-node ring that both ran, and the link's measured round trip.
#[test]
fn lab_hop_reports_what_a_hop_adds_on_a_switched_link_and_on_loopback() {
    if !lab_can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let figures: Vec<serde_json::Value> = serde_json::from_value(tessera_json::<&std::ffi::OsStr>(
        [
            "lab".as_ref(),
            "hop".as_ref(),
            "--json".as_ref(),
            "--tokens".as_ref(),
            "32".as_ref(),
            "--rounds".as_ref(),
            "2".as_ref(),
            "--dir".as_ref(),
            dir.path().as_os_str(),
        ],
        Duration::from_secs(120),
    ))
    .unwrap();
    assert_eq!(figures.len(), 2, "{figures:?}");
    assert_eq!(figures[0]["requested_rtt_ms"], 0.5);
    assert!(figures[1]["requested_rtt_ms"].is_null(), "loopback");
    for f in &figures {
        for k in [
            "measured_rtt_ms",
            "single_ms_per_token",
            "ring_ms_per_token",
            "added_per_hop_us",
        ] {
            assert!(f[k].as_f64().is_some_and(f64::is_finite), "{k}: {f}");
        }
        assert!(f["measured_rtt_ms"].as_f64().unwrap() > 0.0, "{f}");
        assert_eq!(f["goal_us"], 50.0);
    }
}

/// CPU seconds process `pid` has used (user and system).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = after
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|x| x.parse().unwrap())
        .collect();
    (f[0] + f[1]) as f64 / 100.0 // USER_HZ
}

/// The periods the host's CPU cgroup has been throttled in (`cpu.stat`, v1 or v2).
fn throttled_periods(lab: &Lab) -> u64 {
    let dir = tessera_lab::cgroup::list(lab.id())
        .into_iter()
        .find(|d| d.join("cpu.stat").exists())
        .expect("the host's CPU cgroup");
    let stat = std::fs::read_to_string(dir.join("cpu.stat")).unwrap();
    stat.lines()
        .find_map(|l| l.strip_prefix("nr_throttled "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A busy loop on the lab's host for `wall`: the CPU it got over the wall time.
fn burn(lab: &Lab, wall: Duration) -> f64 {
    let mut child = lab
        .command(0, "sh")
        .unwrap()
        .args(["-c", "while :; do :; done"])
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    std::thread::sleep(wall);
    let used = cpu_seconds(child.id());
    let share = used / t.elapsed().as_secs_f64();
    child.kill().unwrap();
    child.wait().unwrap();
    share
}

/// A host's CPU quota binds within a tiny model's request (a burst of milliseconds, which a
/// 100 ms CFS period would let run unthrottled), and lifting it — as a cluster does while its
/// nodes probe their hosts — stops the throttling. Only upper bounds on CPU are asserted: a
/// busy machine gives the loop less, never more.
#[test]
fn a_hosts_cpu_quota_binds_within_milliseconds_and_lifts_while_nodes_probe() {
    let mut host = HostSpec::new("slow");
    host.limits.cpu_quota = Some(0.2);
    let Some(lab) = lab_or_skip(&LabSpec::new(vec![host])) else {
        return;
    };
    let before = throttled_periods(&lab);
    let share = burn(&lab, Duration::from_millis(40));
    let throttled = throttled_periods(&lab) - before;
    // 40 ms is eight of the 5 ms periods a fifth of a core gets.
    assert!(throttled >= 3, "throttled in {throttled} periods of 40 ms");
    let share_long = burn(&lab, Duration::from_millis(600));
    assert!(
        share_long < 0.35,
        "a fifth of a core's quota gave {share_long:.2} cores"
    );
    eprintln!("quota 0.2: {share:.2} cores over 40 ms, {share_long:.2} over 600 ms");

    lab.set_cpu_quotas(false).unwrap();
    let before = throttled_periods(&lab);
    burn(&lab, Duration::from_millis(200));
    assert_eq!(
        throttled_periods(&lab),
        before,
        "throttled with the quota lifted"
    );

    lab.set_cpu_quotas(true).unwrap();
    let before = throttled_periods(&lab);
    burn(&lab, Duration::from_millis(40));
    assert!(
        throttled_periods(&lab) > before,
        "not throttled once imposed again"
    );
}
