//! Attacks by insiders, with real processes on 127.0.0.1: a `tessera coordinator` with two
//! `tessera node` stages (`--split 0..2,2..5`) and victims running `tessera run`, while a
//! scripted peer that enrolled with a valid token (the node join token, or a client token an
//! operator issued) says what its credential and assignment do not allow.
//!
//! Each attack must be refused, for its reason (read from the coordinator's answer where the
//! attacker gets one, else from the coordinator's log), the victim's text must equal an
//! undisturbed one-process run byte for byte, and service must continue. What each attack cost
//! (the coordinator's peak RSS, its log bytes, the victim's latency beside an undisturbed run)
//! is printed for the note, never asserted.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::chaos::{messages, reference_text, text_of, Cluster, Proc};
use common::model;
use tessera_net::{Connection, Endpoint, FramedStream, NodeIdentity};
use tessera_node::agent::JoinTarget;
use tessera_proto::{
    frame, stream, ClientToCoord, CoordToClient, FinishReason, Hello, NodeToCoord, Role,
    RunRequest, PROTOCOL_VERSION,
};

const SPLIT: &str = "0..2,2..5";

/// The victim's generation: long enough for attacks to land in the middle.
fn victim_flags() -> Vec<&'static str> {
    vec!["-p", "Once upon a time", "-n", "200", "--temperature", "0"]
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A cluster of two stages, ready.
fn cluster() -> Cluster {
    let mut c = Cluster::start(&model("stories260K.gguf"), SPLIT);
    c.add_node("a");
    c.add_node("b");
    c.wait_ready();
    c
}

/// A scripted peer: its own key, enrolled with `line`'s token, on a control session that
/// announced `role` and `name`. Returns the session and the coordinator's first answer.
async fn peer(
    line: &str,
    role: Role,
    name: &str,
) -> (Endpoint, Connection, FramedStream, serde_json::Value) {
    let target: JoinTarget = line.parse().unwrap();
    let id = NodeIdentity::generate().unwrap();
    let ep = Endpoint::bind(
        "127.0.0.1:0".parse().unwrap(),
        &id,
        tessera_net::AllowList::new(),
    )
    .unwrap();
    let conn = ep.enroll(target.addr, &target.token).await.unwrap();
    let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
    s.reader.set_max_len(4 << 20);
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        role,
        name: name.into(),
        inventory: None,
        memory_budget_bytes: Some(1 << 30),
        models: vec![],
    };
    s.writer
        .write_message(frame::MSG, &NodeToCoord::Hello(hello))
        .await
        .unwrap();
    let first: serde_json::Value = match tokio::time::timeout(
        Duration::from_secs(30),
        s.reader.read_message::<serde_json::Value>(frame::MSG),
    )
    .await
    {
        Ok(Ok(v)) => v,
        other => serde_json::json!({ "type": "closed", "why": format!("{other:?}") }),
    };
    (ep, conn, s, first)
}

/// The coordinator's peak RSS, KiB.
fn peak_rss_kib(p: &Proc) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", p.pid())).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Bytes of log the coordinator has written so far.
fn log_bytes(p: &mut Proc) -> usize {
    p.drain();
    p.seen.iter().map(|(_, l)| l.len() + 1).sum()
}

/// Runs the victim to the end: its text and how long it took.
fn victim(c: &Cluster, name: &str) -> (String, Duration, Vec<serde_json::Value>) {
    let t0 = Instant::now();
    let mut p = c.client(name, &victim_flags());
    let status = p.finish();
    let took = t0.elapsed();
    let msgs = messages(&p);
    assert!(status.success(), "{name}: {:?}", p.seen);
    let text = text_of("Once upon a time", &msgs);
    (text, took, msgs.into_iter().map(|(_, m)| m).collect())
}

/// Prints one line of the attack table.
fn report(attack: &str, c: &mut Cluster, log_before: usize, base: Duration, under: Duration) {
    let rss = peak_rss_kib(&c.coordinator);
    let log = log_bytes(&mut c.coordinator) - log_before;
    println!(
        "attack table: {attack}: refused; coordinator peak RSS {rss} KiB, log +{log} B, \
         victim {under:?} (undisturbed {base:?})"
    );
}

/// A node that is not a stage reports the epoch's load and link failures, and sprays forged
/// tokens and finishes at every sequence id a victim could have; the victim's text is the
/// undisturbed one and its run is never paused.
#[test]
fn a_bystander_node_cannot_fail_the_epoch_or_write_into_another_users_answer() {
    let want = reference_text(&model("stories260K.gguf"), &victim_flags());
    let mut c = cluster();
    let (base_text, base, _) = victim(&c, "undisturbed");
    assert_eq!(base_text, want);
    let log_before = log_bytes(&mut c.coordinator);
    let stop = Arc::new(AtomicBool::new(false));
    let attacker = {
        let (line, stop) = (c.join.clone(), stop.clone());
        std::thread::spawn(move || {
            rt().block_on(async move {
                let (_ep, _conn, mut s, first) = peer(&line, Role::Node, "mallory").await;
                assert_eq!(first["type"], "welcome", "{first}");
                // Read (and drop) what the coordinator sends, so its stream never blocks.
                let mut reader = s.reader;
                tokio::spawn(async move { while let Ok(Some(_)) = reader.read_frame().await {} });
                let mut sent = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut msgs = vec![NodeToCoord::Heartbeat { expert_cache: None }];
                    for epoch in 1..=3 {
                        msgs.push(NodeToCoord::LoadFailed {
                            epoch,
                            reason: "forged".into(),
                        });
                        msgs.push(NodeToCoord::LinkFailed {
                            epoch,
                            reason: "forged".into(),
                            peer: None,
                        });
                    }
                    for seq in 1..=64 {
                        msgs.push(NodeToCoord::Token {
                            seq,
                            pos: 5,
                            token: 42,
                            logprobs: None,
                        });
                        msgs.push(NodeToCoord::Finished {
                            seq,
                            reason: FinishReason::Length,
                            generated: 1,
                            error: None,
                        });
                    }
                    for m in &msgs {
                        s.writer.write_message(frame::MSG, m).await.unwrap();
                    }
                    sent += msgs.len() as u64;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                sent
            })
        })
    };
    // Let the attack start before the victim does.
    c.coordinator.wait_event(&[("event", "refused")]);
    let (text, under, msgs) = victim(&c, "victim");
    stop.store(true, Ordering::Relaxed);
    let sent = attacker.join().unwrap();
    assert_eq!(text, want, "the victim's text was changed");
    assert!(
        !msgs.iter().any(|m| m["type"] == "paused"),
        "the victim's epoch was failed"
    );
    let refused = c.coordinator.events(&[("event", "refused")]);
    let reasons: Vec<&str> = refused
        .iter()
        .map(|e| e["reason"].as_str().unwrap_or(""))
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains("only a stage of epoch")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("only a stage of sequence")),
        "{reasons:?}"
    );
    // Log lines are bounded: a burst, then about one a second, however many were refused.
    assert!(
        (reasons.len() as u64) < sent / 10,
        "{} log lines for {sent} messages",
        reasons.len()
    );
    // Service continues.
    assert_eq!(victim(&c, "after").0, want);
    report(
        &format!("{sent} forged LoadFailed/LinkFailed/Token/Finished from a bystander node"),
        &mut c,
        log_before,
        base,
        under,
    );
}

/// A key enrolled with the node token announces itself as a client: refused, with the reason.
#[test]
fn a_node_credential_cannot_act_as_a_client_and_names_are_bounded() {
    let c = Cluster::start(&model("stories260K.gguf"), SPLIT);
    rt().block_on(async {
        let (_e, _c, _s, first) = peer(&c.join, Role::Client, "sneaky").await;
        assert_eq!(first["type"], "refused", "{first}");
        let why = first["reason"].as_str().unwrap();
        assert!(why.contains("enrolled with a node credential"), "{why}");

        let huge = "n".repeat(3 << 20);
        let (_e, _c, _s, first) = peer(&c.join, Role::Node, &huge).await;
        assert_eq!(first["type"], "refused");
        let why = first["reason"].as_str().unwrap();
        assert!(why.contains("1 to 64 bytes") && why.len() < 200, "{why}");

        let (_e, _c, _s, first) = peer(&c.join, Role::Node, "x\nnode joined: forged").await;
        assert_eq!(first["type"], "refused");
        assert!(first["reason"]
            .as_str()
            .unwrap()
            .contains("control characters"));
    });
}

/// Issues a token through `tessera token create` over the operator's session; its line.
fn create_token(c: &Cluster, flags: &[&str]) -> String {
    let out = common::run_with_timeout(
        {
            let mut cmd = std::process::Command::new(common::bin());
            cmd.args([
                "token",
                "create",
                "--coordinator",
                &c.operator,
                "--data-dir",
            ])
            .arg(c.dir.path().join("operator"))
            .args(flags)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
            cmd
        },
        Duration::from_secs(60),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn run_request(stages: Option<&str>, n: usize) -> ClientToCoord {
    ClientToCoord::Run(Box::new(RunRequest {
        prompt: Some("Once upon a time".into()),
        prompt_tokens: None,
        max_new_tokens: n,
        sampling: tessera_sampling::SamplingParams::greedy(),
        stages: stages.map(|s| tessera_placement::assignment::parse_split(s).unwrap()),
        prefill_chunk: 64,
        trace: false,
        stop_at_eog: false,
        grammar: None,
        logprobs: None,
        speculate: 0,
        prediction: None,
    }))
}

/// A client (its credential from `tessera token create --role client`) cancels other users'
/// runs, asks for a run that names stages on a node it would control, administers tokens,
/// and floods the coordinator with 300 runs: each is refused for its reason, the victim's
/// text is the undisturbed one, and the plan stays the operator's.
#[test]
fn a_client_cannot_cancel_others_runs_replan_the_cluster_or_flood_it() {
    let want = reference_text(&model("stories260K.gguf"), &victim_flags());
    let mut c = cluster();
    let (_, base, _) = victim(&c, "undisturbed");
    let client_line = create_token(&c, &["--role", "client", "--uses", "1"]);
    let log_before = log_bytes(&mut c.coordinator);
    let stop = Arc::new(AtomicBool::new(false));
    let attacker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            rt().block_on(async move {
                let (_ep, _conn, s, first) = peer(&client_line, Role::Client, "eve").await;
                assert_eq!(first["type"], "welcome", "{first}");
                let FramedStream {
                    mut reader,
                    mut writer,
                    ..
                } = s;
                // Runs answered so far (done, or refused as too many).
                let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let answers = {
                    let answered = answered.clone();
                    tokio::spawn(async move {
                        let mut errors: Vec<String> = Vec::new();
                        let mut done = 0usize;
                        let mut admin = Vec::new();
                        while let Ok(m) = reader.read_message::<CoordToClient>(frame::MSG).await {
                            match m {
                                CoordToClient::Error { message } => {
                                    // Refusals of a cancel, a placement or an admin request
                                    // answer those; anything else answers a run (refused as
                                    // too many, or one of its own runs its cancels hit).
                                    let other =
                                        ["only the client", "naming stages", "administering"];
                                    if !other.iter().any(|o| message.contains(o)) {
                                        answered.fetch_add(1, Ordering::Relaxed);
                                    }
                                    errors.push(message)
                                }
                                CoordToClient::Done(_) => {
                                    answered.fetch_add(1, Ordering::Relaxed);
                                    done += 1
                                }
                                CoordToClient::Admin(r) => admin.push(r),
                                _ => {}
                            }
                        }
                        (errors, done, admin)
                    })
                };
                let w = &mut writer;
                w.write_message(frame::MSG, &run_request(Some("0..5"), 4))
                    .await
                    .unwrap();
                w.write_message(
                    frame::MSG,
                    &ClientToCoord::Admin(tessera_proto::AdminRequest::ListTokens),
                )
                .await
                .unwrap();
                for _ in 0..300 {
                    w.write_message(frame::MSG, &run_request(None, 8))
                        .await
                        .unwrap();
                }
                let mut cancels = 0;
                while !stop.load(Ordering::Relaxed) {
                    for seq in 1..=64 {
                        w.write_message(frame::MSG, &ClientToCoord::Cancel { seq })
                            .await
                            .unwrap();
                        cancels += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                // Every run is answered before the session ends (ending it cancels the rest).
                let deadline = Instant::now() + Duration::from_secs(120);
                while answered.load(Ordering::Relaxed) < 300 && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let _ = w.finish().await;
                let (errors, done, admin) = answers.await.unwrap();
                (errors, done, admin, cancels)
            })
        })
    };
    c.coordinator.wait_event(&[("event", "refused")]);
    let (text, under, msgs) = victim(&c, "victim");
    stop.store(true, Ordering::Relaxed);
    assert_eq!(text, want, "the victim's text was changed");
    assert!(!msgs.iter().any(|m| m["type"] == "paused"));
    // The plan is still the operator's: two stages on a and b.
    let started = msgs.iter().find(|m| m["type"] == "started").unwrap();
    let names: Vec<&str> = started["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a", "b"]);
    let (errors, done, admin, cancels) = attacker.join().unwrap();
    assert!(admin.is_empty(), "{admin:?}");
    let count = |what: &str| errors.iter().filter(|e| e.contains(what)).count();
    assert_eq!(count("that needs an operator credential"), 1, "{errors:?}");
    assert_eq!(count("administering credentials needs an operator"), 1);
    assert!(count("only the client that started run") > 0);
    let too_many = count("too many runs in flight");
    let other = ["only the client", "naming stages", "administering"];
    let runs_failed = errors
        .iter()
        .filter(|e| !other.iter().any(|o| e.contains(o)))
        .count();
    assert!(too_many > 0, "300 runs were all admitted");
    assert!(
        too_many >= 150,
        "only {too_many} refused: one client got more than its share"
    );
    assert_eq!(done + runs_failed, 300, "every run is answered");
    println!(
        "attack table: client: {cancels} cancels of others' runs, 1 run naming stages, 1 admin \
         request, 300 runs ({done} admitted, {too_many} refused as too many)"
    );
    report(
        "client cancels, re-plan, admin and 300 runs",
        &mut c,
        log_before,
        base,
        under,
    );
    // Service continues.
    assert_eq!(victim(&c, "after").0, want);
}
