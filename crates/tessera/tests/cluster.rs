//! Scenario tests of the fabric with real processes: a `tessera coordinator`, `tessera node`
//! agents and `tessera run` clients on 127.0.0.1 (port 0, printed addresses), each with its own
//! temporary data directory, all killed when a test ends.
//!
//! The reference for every cluster run is the same engine in this test process: the greedy
//! tokens of `Generator` (what `tessera generate` runs), and the hidden state after each stage
//! boundary computed by one full model, hashed exactly as the stages hash what they send.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{
    bin, event_in, model, reference_boundaries, reference_tokens, report_of, run_with_timeout,
    tokens_of, traces_of, Proc, JSON_LOGS,
};
use serde_json::Value;
use tessera_model::{GgufFile, Tokenizer};
use tessera_sampling::SamplingParams;

const TIMEOUT: Duration = Duration::from_secs(60);

/// A coordinator and its nodes.
struct Cluster {
    dir: tempfile::TempDir,
    coordinator: Proc,
    model: PathBuf,
    join: String,
    /// The operator's credential: clients here name stages.
    operator: String,
    nodes: Vec<Proc>,
}

impl Cluster {
    fn start(model_path: &Path) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut coordinator = Self::spawn_coordinator(dir.path(), model_path, "127.0.0.1:0");
        let join = coordinator.announced("join_token", "token");
        let operator = coordinator.announced("operator_token", "token");
        Self {
            dir,
            coordinator,
            model: model_path.to_owned(),
            join,
            operator,
            nodes: Vec::new(),
        }
    }

    fn spawn_coordinator(dir: &Path, model_path: &Path, listen: &str) -> Proc {
        Proc::spawn_with_events(
            "coordinator",
            &[
                "coordinator".into(),
                "--model".into(),
                model_path.display().to_string(),
                "--listen".into(),
                listen.into(),
                "--data-dir".into(),
                dir.join("coord").display().to_string(),
            ],
            TIMEOUT,
        )
    }

    /// Stops the coordinator cleanly and starts it again on the same address and data.
    fn restart_coordinator(&mut self) {
        assert!(self.coordinator.terminate().success());
        let addr = self.join.rsplit_once('@').unwrap().1.to_string();
        self.coordinator = Self::spawn_coordinator(self.dir.path(), &self.model, &addr);
        let join = self.coordinator.announced("join_token", "token");
        assert_eq!(join, self.join, "the token and address survive a restart");
        let operator = self.coordinator.announced("operator_token", "token");
        assert_eq!(operator, self.operator);
    }

    fn node_args(&self, name: &str, extra: &[&str]) -> Vec<String> {
        let mut a = common::node_args(self.dir.path(), name);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    /// Starts a node that enrols with the token and waits until it has joined.
    fn add_node(&mut self, name: &str, extra: &[&str]) {
        let mut args = self.node_args(name, extra);
        args.extend(["--join".to_string(), self.join.clone()]);
        let mut p = Proc::spawn_with_events(name, &args, TIMEOUT);
        p.wait_event(&[("event", "joined")]);
        self.nodes.push(p);
    }

    /// Runs `tessera run --json` and returns its messages.
    fn run_json(&self, extra: &[&str]) -> (Output, Vec<Value>) {
        let out = self.run(&[&["--json"], extra].concat());
        let msgs = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        (out, msgs)
    }

    fn run(&self, extra: &[&str]) -> Output {
        run_client(&self.operator, &self.dir.path().join("client"), extra)
    }
}

/// Runs `tessera run` against the coordinator `join`, with its key in `client_dir`.
fn run_client(join: &str, client_dir: &Path, extra: &[&str]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(["run", "--coordinator", join, "--data-dir"])
        .arg(client_dir)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    run_with_timeout(cmd, TIMEOUT)
}

fn split_ends(split: &str) -> Vec<usize> {
    split
        .split(',')
        .map(|r| r.split_once("..").unwrap().1.parse().unwrap())
        .collect()
}

/// Clusters of one, two and three node processes on `model_name`, each running a ring of as
/// many stages: tokens equal to one process, every boundary's hidden state equal bit for bit,
/// and the printed text equal to `tessera generate`'s.
fn rings_match_one_process(model_name: &str, prompt_text: &str, splits: &[&str]) {
    let path = model(model_name);
    let g = GgufFile::open(&path).unwrap();
    let prompt = Tokenizer::from_gguf(&g).unwrap().encode(prompt_text, true);
    let n = 12;
    let chunk = 3; // several prefill chunks, pipelined across stages
    let want = reference_tokens(&path, &prompt, n, chunk);
    let generated_text = run_with_timeout(
        {
            let mut cmd = Command::new(bin());
            cmd.args(["generate", "-m"])
                .arg(&path)
                .args([
                    "-p",
                    prompt_text,
                    "-n",
                    &n.to_string(),
                    "--temperature",
                    "0",
                    "-t",
                    "1",
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            cmd
        },
        TIMEOUT,
    );
    assert!(generated_text.status.success());
    let mut c = Cluster::start(&path);
    for (split, name) in splits.iter().zip(["a", "b", "c"]) {
        // One more node process for each split: 1, 2, 3 nodes, as many stages.
        c.add_node(name, &[]);
        assert_eq!(split.split(',').count(), c.nodes.len());
        let (out, msgs) = c.run_json(&[
            "-p",
            prompt_text,
            "-n",
            &n.to_string(),
            "--temperature",
            "0",
            "--split",
            split,
            "--trace",
            "--prefill-chunk",
            &chunk.to_string(),
        ]);
        assert!(
            out.status.success(),
            "{split}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let started = msgs.iter().find(|m| m["type"] == "started").unwrap();
        let sent: Vec<u32> = serde_json::from_value(started["prompt_tokens"].clone()).unwrap();
        assert_eq!(sent, prompt, "{split}: prompt tokens");
        assert_eq!(tokens_of(&msgs), want, "{model_name} split {split}: tokens");
        let got = traces_of(&msgs);
        let expected = reference_boundaries(&path, &prompt, &want, chunk, &split_ends(split));
        assert_eq!(got, expected, "{model_name} split {split}: boundary hashes");
        let report = report_of(&msgs);
        assert_eq!(report["generated"].as_u64().unwrap() as usize, want.len());

        // The plain text output is what `tessera generate` prints (default prefill chunks).
        let run = c.run(&[
            "-p",
            prompt_text,
            "-n",
            &n.to_string(),
            "--temperature",
            "0",
            "--split",
            split,
        ]);
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&generated_text.stdout),
            "{model_name} split {split}: text"
        );
    }
}

#[test]
fn stage_rings_of_1_2_3_nodes_match_one_process_on_stories260k() {
    rings_match_one_process(
        "stories260K.gguf",
        "Once upon a time, there was a little dog",
        &["0..5", "0..3,3..5", "0..1,1..3,3..5"],
    );
}

#[test]
fn stage_rings_of_1_2_3_nodes_match_one_process_on_synthetic_qwen3() {
    rings_match_one_process(
        "test/small-qwen3-Q8_0.gguf",
        "The quick brown fox jumps over the lazy dog",
        &["0..3", "0..1,1..3", "0..1,1..2,2..3"],
    );
}

/// Speculation on a ring of three node processes (`tessera run --speculate 4`): the tokens
/// and log-probabilities are those without it, greedy and seeded, while the sampling stage's
/// drafts were accepted and the ring turned fewer times.
#[test]
fn speculation_on_a_three_stage_ring_gives_the_same_tokens_and_logprobs() {
    let path = model("stories260K.gguf");
    let mut c = Cluster::start(&path);
    for name in ["a", "b", "c"] {
        c.add_node(name, &[]);
    }
    // A story that begins again: prompt lookup finds what followed the first time.
    let prompt = "Once upon a time, there was a little girl named Lily. She liked to play \
                  outside. Once upon a time, there was a little";
    let tokens = |msgs: &[Value]| -> Vec<(Value, Value)> {
        msgs.iter()
            .filter(|m| m["type"] == "token")
            .map(|m| (m["token"].clone(), m["logprobs"].clone()))
            .collect()
    };
    for sampling in [
        &["--temperature", "0"][..],
        &["--temperature", "0.8", "--seed", "5"][..],
    ] {
        let base = [
            &[
                "-p",
                prompt,
                "-n",
                "40",
                "--split",
                "0..1,1..3,3..5",
                "--top-logprobs",
                "2",
            ][..],
            sampling,
        ]
        .concat();
        let (out, plain) = c.run_json(&base);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (out, spec) = c.run_json(&[&base[..], &["--speculate", "4"]].concat());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(tokens(&spec).len(), 40, "{sampling:?}");
        assert!(
            tokens(&spec)[0].1.is_object(),
            "log-probabilities are compared"
        );
        assert_eq!(tokens(&spec), tokens(&plain), "{sampling:?}");
        let (with, without) = (
            &report_of(&spec)["stage_stats"],
            &report_of(&plain)["stage_stats"],
        );
        assert!(
            with[2]["drafts_accepted"].as_u64().unwrap() > 0,
            "{sampling:?}: {with}"
        );
        assert_eq!(without[2]["drafted"].as_u64(), Some(0));
        let turns = |s: &Value| s[0]["decode"]["steps"].as_u64().unwrap();
        assert!(
            turns(with) < turns(without),
            "{sampling:?}: {with} against {without}"
        );
        // The answer predicted (`--prediction-file`): drafted from its first token, every
        // draft stands, the same tokens in fewer turns than lookup took.
        let text: String = plain
            .iter()
            .filter(|m| m["type"] == "token")
            .map(|m| m["text"].as_str().unwrap())
            .collect();
        let file = std::env::temp_dir().join(format!("prediction-{}.txt", std::process::id()));
        std::fs::write(&file, &text).unwrap();
        let predicted = [
            &base[..],
            &[
                "--speculate",
                "4",
                "--prediction-file",
                file.to_str().unwrap(),
            ],
        ]
        .concat();
        let (out, pred) = c.run_json(&predicted);
        let _ = std::fs::remove_file(&file);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(tokens(&pred), tokens(&plain), "{sampling:?}: predicted");
        let p = &report_of(&pred)["stage_stats"];
        assert_eq!(
            p[2]["drafts_accepted"], p[2]["drafted"],
            "{sampling:?}: {p}"
        );
        assert!(turns(p) < turns(with), "{sampling:?}: {p} against {with}");
    }
}

#[test]
fn concurrent_runs_share_the_ring_and_each_matches_one_process() {
    let path = model("stories260K.gguf");
    let prompts = [
        "Once upon a time",
        "The cat sat",
        "Lily and Ben went to the park",
    ];
    let generate = |p: &str| {
        let out = run_with_timeout(
            {
                let mut cmd = Command::new(bin());
                cmd.args(["generate", "-t", "1", "-m"])
                    .arg(&path)
                    .args(["-p", p, "-n", "40", "--temperature", "0"])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null());
                cmd
            },
            TIMEOUT,
        );
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let want: Vec<String> = prompts.iter().map(|p| generate(p)).collect();
    let mut c = Cluster::start(&path);
    c.add_node("a", &[]);
    c.add_node("b", &[]);
    let (join, client_dir) = (c.operator.as_str(), c.dir.path().join("client"));
    let client_dir = client_dir.as_path();
    let got: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                scope.spawn(move || {
                    let out = run_client(
                        join,
                        client_dir,
                        &[
                            "-p",
                            p,
                            "-n",
                            "40",
                            "--temperature",
                            "0",
                            "--split",
                            "0..2,2..5",
                        ],
                    );
                    assert!(
                        out.status.success(),
                        "{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    String::from_utf8_lossy(&out.stdout).into_owned()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);
}

#[test]
fn seeded_sampling_across_stages_matches_one_process() {
    let path = model("stories260K.gguf");
    let flags = [
        "-p",
        "Once upon a time",
        "-n",
        "24",
        "--temperature",
        "0.9",
        "--seed",
        "7",
        "--repeat-penalty",
        "1.1",
    ];
    let gen = run_with_timeout(
        {
            let mut cmd = Command::new(bin());
            cmd.args(["generate", "-t", "1", "-m"])
                .arg(&path)
                .args(flags)
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            cmd
        },
        TIMEOUT,
    );
    assert!(gen.status.success());
    let mut c = Cluster::start(&path);
    c.add_node("a", &[]);
    c.add_node("b", &[]);
    let run = c.run(&[&flags[..], &["--split", "0..3,3..5"]].concat());
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&gen.stdout)
    );
}

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

/// Runs `tessera` with `args` to its exit (it must exit: a refused node stops), its events as
/// JSON lines on stdout; its output.
fn run_to_exit(args: &[String]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .env(JSON_LOGS.0, JSON_LOGS.1)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    run_with_timeout(cmd, TIMEOUT)
}

/// Whether a process's stdout holds a `joined` event.
fn joined(stdout: &str) -> bool {
    stdout
        .lines()
        .any(|l| event_in(l, &[("event", "joined")]).is_some())
}

#[test]
fn node_with_a_wrong_token_is_refused() {
    let path = model("stories260K.gguf");
    let c = Cluster::start(&path);
    // Same coordinator id and address, another secret.
    let target: tessera_node::agent::JoinTarget = c.join.parse().unwrap();
    let addr = target.addr;
    let coordinator_id = target.token.coordinator().unwrap();
    let forged = tessera_net::JoinToken::generate(Some(coordinator_id)).unwrap();
    let mut args = c.node_args("intruder", &[]);
    args.extend(["--join".into(), format!("{forged}@{addr}")]);
    let out = run_to_exit(&args);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success());
    assert!(!joined(&stdout), "{stdout}");
    // The reason, as the coordinator sent it: the token, not a network error.
    let want = format!("enrolment refused by {addr}: the join token is not known");
    assert!(stderr.contains(&want), "expected {want:?} in:\n{stderr}");
}

#[test]
fn a_name_cannot_be_moved_to_another_key() {
    let path = model("stories260K.gguf");
    let mut c = Cluster::start(&path);
    c.add_node("alpha", &[]);
    let alpha_id = c.nodes[0].wait_event(&[("event", "identity")])["node_id"]
        .as_str()
        .expect("alpha's node id")
        .to_string();
    // A second node (its own key) with the token, claiming the same name.
    let mut args = c.node_args("alpha", &[]);
    args[2] = c.dir.path().join("other").display().to_string();
    args.extend(["--join".into(), c.join.clone()]);
    let out = run_to_exit(&args);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success());
    assert!(!joined(&stdout), "{stdout}");
    let want = format!("the name \"alpha\" belongs to node {alpha_id} (another key)");
    assert!(stderr.contains(&want), "expected {want:?} in:\n{stderr}");
}

/// In-process clients over the real transport, against the coordinator process.
mod wire {
    use super::*;
    use tessera_net::{Endpoint, NodeIdentity};
    use tessera_node::agent::JoinTarget;
    use tessera_proto::{
        frame, stream, ClientToCoord, CoordToClient, Hello, Role, PROTOCOL_VERSION,
    };

    fn hello(name: &str, version: u32) -> ClientToCoord {
        ClientToCoord::Hello(Hello {
            protocol_version: version,
            role: Role::Client,
            name: name.into(),
            inventory: None,
            memory_budget_bytes: None,
            models: vec![],
        })
    }

    /// A client endpoint on loopback with a fresh identity (inside a runtime).
    fn client_endpoint() -> Endpoint {
        let id = NodeIdentity::generate().unwrap();
        Endpoint::bind(
            "127.0.0.1:0".parse().unwrap(),
            &id,
            tessera_net::AllowList::new(),
        )
        .unwrap()
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn a_cancelled_sequence_stops_and_every_stage_closes_it() {
        let mut c = Cluster::start(&model("stories260K.gguf"));
        c.add_node("a", &[]);
        c.add_node("b", &[]);
        let target: JoinTarget = c.operator.parse().unwrap();
        rt().block_on(async {
            let ep = client_endpoint();
            let conn = ep.enroll(target.addr, &target.token).await.unwrap();
            let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
            s.writer
                .write_message(frame::MSG, &hello("canceller", PROTOCOL_VERSION))
                .await
                .unwrap();
            let w = s
                .reader
                .read_message::<CoordToClient>(frame::MSG)
                .await
                .unwrap();
            assert!(matches!(w, CoordToClient::Welcome { .. }));
            let req = tessera_proto::RunRequest {
                prompt: Some("Once upon a time".into()),
                prompt_tokens: None,
                max_new_tokens: 400,
                sampling: SamplingParams::greedy(),
                stages: Some(tessera_placement::assignment::parse_split("0..2,2..5").unwrap()),
                prefill_chunk: 64,
                trace: false,
                stop_at_eog: false,
                grammar: None,
                logprobs: None,
                speculate: 0,
                prediction: None,
            };
            s.writer
                .write_message(frame::MSG, &ClientToCoord::Run(Box::new(req)))
                .await
                .unwrap();
            let mut cancelled = false;
            let report = loop {
                match s
                    .reader
                    .read_message::<CoordToClient>(frame::MSG)
                    .await
                    .unwrap()
                {
                    CoordToClient::Token { seq, .. } if !cancelled => {
                        s.writer
                            .write_message(frame::MSG, &ClientToCoord::Cancel { seq })
                            .await
                            .unwrap();
                        cancelled = true;
                    }
                    CoordToClient::Done(r) => break r,
                    CoordToClient::Error { message } => panic!("{message}"),
                    _ => {}
                }
            };
            assert_eq!(report.reason, tessera_proto::FinishReason::Cancelled);
            assert!(report.generated < 400, "{}", report.generated);
            // Both stages closed the sequence (freeing its KV cache) and reported on it.
            assert_eq!(report.stage_stats.len(), 2);
            assert!(report.stage_stats.iter().all(|s| s.prefill.steps > 0));
        });
    }

    #[test]
    fn unenrolled_key_gets_nothing_without_the_token() {
        let c = Cluster::start(&model("stories260K.gguf"));
        let target: JoinTarget = c.join.parse().unwrap();
        rt().block_on(async {
            let ep = client_endpoint();
            // Dial with the coordinator pinned, but skip enrolment and talk straight away.
            let coord = target.token.coordinator().unwrap();
            let r = async {
                let conn = ep.connect(target.addr, coord).await?;
                let mut s = conn.open_stream(stream::CONTROL).await?;
                s.writer
                    .write_message(frame::MSG, &hello("x", PROTOCOL_VERSION))
                    .await?;
                let answer = s.reader.read_frame().await?;
                let after = s.reader.read_frame().await;
                Ok::<_, tessera_net::NetError>((answer, after))
            };
            let (answer, after) = tokio::time::timeout(Duration::from_secs(30), r)
                .await
                .expect("the coordinator neither answered nor refused")
                .expect("the refusal is readable");
            // Admitted for enrolment only: anything but an enrolment claim is refused with an
            // enrolment-refused frame (kind 0xFF22) carrying the reason, and nothing else
            // follows: no welcome, no message.
            let f = answer.expect("a refusal frame, not silence");
            assert_eq!(f.kind, 0xFF22, "not an enrolment refusal: {f:?}");
            assert_eq!(&f.payload[..], b"expected an enrolment stream");
            assert!(
                matches!(after, Ok(None) | Err(_)),
                "more after the refusal: {after:?}"
            );
        });
    }

    /// A node's own port (ring and expert streams) admits only keys the coordinator placed
    /// there: a fresh key, pinned to the node's id, gets no stream of either kind.
    #[test]
    fn unenrolled_key_is_refused_by_a_nodes_ring_and_expert_streams() {
        let mut c = Cluster::start(&model("stories260K.gguf"));
        c.add_node("a", &[]);
        let mut field = |event: &str, field: &str| {
            c.nodes[0].wait_event(&[("event", event)])[field]
                .as_str()
                .unwrap_or_else(|| panic!("no {field} in the node's {event} event"))
                .to_string()
        };
        let id: tessera_net::NodeId = field("identity", "node_id").parse().unwrap();
        let addr: std::net::SocketAddr = field("listening", "addr").parse().unwrap();
        rt().block_on(async {
            let ep = client_endpoint();
            for kind in [stream::RING, stream::EXPERT] {
                let r = async {
                    let conn = ep.connect(addr, id).await?;
                    let mut s = conn.open_stream(kind).await?;
                    s.writer.write_frame(frame::MSG, b"{}").await?;
                    s.reader.read_frame().await
                };
                let r = tokio::time::timeout(Duration::from_secs(30), r)
                    .await
                    .expect("the node neither answered nor refused");
                let err = r.expect_err("an unenrolled key got a stream").to_string();
                eprintln!("REFUSAL(node {kind}): {err}");
                assert!(
                    err.contains("unknown node key"),
                    "stream {kind:#06x}: {err}"
                );
            }
        });
    }

    #[test]
    fn oversized_malformed_and_wrong_version_frames_fail_only_their_stream() {
        let c = Cluster::start(&model("stories260K.gguf"));
        let target: JoinTarget = c.operator.parse().unwrap();
        rt().block_on(async {
            let ep = client_endpoint();
            let conn = ep.enroll(target.addr, &target.token).await.unwrap();

            // 1. A header declaring a 1 GiB frame: refused before allocation, stream closed.
            let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
            let mut h = vec![0x54, 1];
            h.extend_from_slice(&frame::MSG.to_be_bytes());
            h.extend_from_slice(&(1u32 << 30).to_be_bytes());
            s.writer.get_mut().write_all(&h).await.unwrap();
            let r = tokio::time::timeout(Duration::from_secs(10), s.reader.read_frame()).await;
            assert!(
                matches!(r, Ok(Ok(None)) | Ok(Err(_))),
                "oversized frame: {r:?}"
            );

            // 2. A frame of the right size that is not JSON.
            let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
            s.writer
                .write_frame(frame::MSG, b"{not json")
                .await
                .unwrap();
            let r = tokio::time::timeout(Duration::from_secs(10), s.reader.read_frame()).await;
            assert!(
                matches!(r, Ok(Ok(None)) | Ok(Err(_))),
                "malformed frame: {r:?}"
            );

            // 3. Another wire version: a clear error on the coordinator, this stream only.
            let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
            let mut h = vec![0x54, 9];
            h.extend_from_slice(&frame::MSG.to_be_bytes());
            h.extend_from_slice(&2u32.to_be_bytes());
            h.extend_from_slice(b"{}");
            s.writer.get_mut().write_all(&h).await.unwrap();
            let r = tokio::time::timeout(Duration::from_secs(10), s.reader.read_frame()).await;
            assert!(
                matches!(r, Ok(Ok(None)) | Ok(Err(_))),
                "wrong version: {r:?}"
            );

            // 4. Another protocol version in the hello: refused by name.
            let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
            s.writer
                .write_message(frame::MSG, &hello("old", 99))
                .await
                .unwrap();
            match s
                .reader
                .read_message::<CoordToClient>(frame::MSG)
                .await
                .unwrap()
            {
                CoordToClient::Refused { reason } => {
                    assert!(reason.contains("protocol version mismatch"), "{reason}")
                }
                other => panic!("{other:?}"),
            }

            // The same connection still serves a well-formed session.
            let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
            s.writer
                .write_message(frame::MSG, &hello("fine", PROTOCOL_VERSION))
                .await
                .unwrap();
            let w = s
                .reader
                .read_message::<CoordToClient>(frame::MSG)
                .await
                .unwrap();
            assert!(matches!(w, CoordToClient::Welcome { .. }), "{w:?}");
            s.writer
                .write_message(frame::MSG, &ClientToCoord::Status)
                .await
                .unwrap();
            let st = s
                .reader
                .read_message::<CoordToClient>(frame::MSG)
                .await
                .unwrap();
            assert!(matches!(st, CoordToClient::Status { .. }), "{st:?}");
        });
    }
}
