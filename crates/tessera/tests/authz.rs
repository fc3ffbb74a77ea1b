//! Enrolment, revocation, model bytes and secrets, attacked from outside against a real
//! `tessera coordinator` on 127.0.0.1 (issue #35's red-team cases), each refusal asserted beside
//! a normal action that still succeeds:
//!
//! - a claim with the right token id and a zero proof does not use up a single-use token, and
//!   a claim announcing 15 MiB is refused from its header, unread;
//! - forty idle half-open enrolments (and more re-opened all along) do not stop real token
//!   holders from enrolling within 2 s each;
//! - `token revoke` (with its keys, the default for a single-use token) and `node revoke` close
//!   every connection of the key within a second; its in-flight run ends unanswered and a new
//!   session is refused;
//! - a client or operator credential, and a node with no assignment, get no model bytes, while
//!   the stage nodes load theirs over the network;
//! - the README's cluster-by-hand commands run with no token in any process's argv.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::chaos::{Cluster, Proc};
use common::token::{created, enrol_as, ok};
use common::{bin, event_in, model, run_with_timeout};
use tessera_net::{stream_kind, Endpoint, FrameHeader, NodeIdentity};
use tessera_node::agent::JoinTarget;
use tessera_proto::{
    frame, stream, ClientToCoord, CoordToClient, ModelReply, ModelRequest, RunRequest,
};

/// The enrolment claim frame kind (tessera-net's own; a hostile client writes it by hand).
const KIND_ENROL_CLAIM: u16 = 0xFF20;
const KIND_ENROL_REFUSED: u16 = 0xFF22;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// `tessera ARGS --coordinator-file COORD/operator.token --data-dir DIR/operator`.
fn operator(c: &Cluster, args: &[&str]) -> Output {
    operator_in(c.dir.path(), args)
}

/// [`operator`] for the cluster in `dir`.
fn operator_in(dir: &std::path::Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .arg("--coordinator-file")
        .arg(dir.join("coord/operator.token"))
        .arg("--data-dir")
        .arg(dir.join("operator"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    run_with_timeout(cmd, Duration::from_secs(60))
}

/// `tessera token create FLAGS`: the new token's line and its id.
fn create(c: &Cluster, flags: &[&str]) -> (String, String) {
    created(&operator(c, &[&["token", "create"], flags].concat()))
}

fn enrol(line: &str) -> Result<(), String> {
    rt().block_on(enrol_as(line, &NodeIdentity::generate().unwrap()))
}

/// Runs `act`, then waits for the next event of `p` with these fields (one not seen before
/// `act`): the time `act` returned and the time the event's line arrived.
fn next_event(p: &mut Proc, fields: &[(&str, &str)], act: impl FnOnce()) -> (Instant, Instant) {
    let before = p.events(fields).len();
    act();
    let acted = Instant::now();
    p.wait_event_nth(fields, before + 1);
    let at = p
        .seen
        .iter()
        .filter(|(_, l)| event_in(l, fields).is_some())
        .nth(before)
        .map(|(t, _)| *t)
        .unwrap();
    (acted, at)
}

#[test]
fn a_zero_proof_claim_does_not_use_up_a_single_use_token_and_a_huge_claim_is_refused_unread() {
    let c = Cluster::start(&model("stories260K.gguf"), "0..5");
    let (once, once_id) = create(&c, &["--role", "node", "--uses", "1"]);
    let target: JoinTarget = once.parse().unwrap();
    let coordinator = target.token.coordinator().unwrap();
    rt().block_on(async {
        let id = NodeIdentity::generate().unwrap();
        let ep = Endpoint::bind(
            "127.0.0.1:0".parse().unwrap(),
            &id,
            tessera_net::AllowList::new(),
        )
        .unwrap();
        // The right token id, a proof of zeros.
        let conn = ep.connect(target.addr, coordinator).await.unwrap();
        let mut s = conn.open_stream(stream_kind::ENROL).await.unwrap();
        let mut claim = target.token.id().0.to_vec();
        claim.extend_from_slice(&[0u8; 32]);
        s.writer
            .write_frame(KIND_ENROL_CLAIM, &claim)
            .await
            .unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(10), s.reader.recv())
            .await
            .expect("an answer")
            .expect("a reply frame");
        assert_eq!(reply.kind, KIND_ENROL_REFUSED);
        let why = String::from_utf8_lossy(&reply.payload).to_string();
        assert!(why.contains("not accepted"), "{why}");
        conn.close("done");

        // A claim frame announcing 15 MiB: refused from its header, the rest never read.
        let conn = ep.connect(target.addr, coordinator).await.unwrap();
        let mut s = conn.open_stream(stream_kind::ENROL).await.unwrap();
        let header = FrameHeader {
            kind: KIND_ENROL_CLAIM,
            len: 15 << 20,
        };
        let w = s.writer.get_mut();
        let t0 = Instant::now();
        // The coordinator may refuse from the header and close before these bytes are written:
        // a write that finds the connection closed is that refusal, not a failure.
        if w.write_all(&header.encode()).await.is_ok() {
            let _ = w.write_all(&[0x5a; 4096]).await;
        }
        let closed = tokio::time::timeout(Duration::from_secs(5), conn.closed()).await;
        assert!(closed.is_ok(), "a 15 MiB claim kept the connection open");
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        ep.close();
    });
    // The token was not used up by either: its holder enrols, once.
    let list = ok(&operator(&c, &["token", "list"]));
    let row = list.lines().find(|l| l.starts_with(&once_id)).unwrap();
    assert!(
        row.split_whitespace().nth(2) == Some("1"),
        "uses left: {row}"
    );
    enrol(&once).unwrap();
    let why = enrol(&once).unwrap_err();
    assert!(why.contains("used as many times"), "{why}");
}

#[test]
fn forty_idle_half_open_enrolments_do_not_stop_a_real_token_holder() {
    let c = Cluster::start(&model("stories260K.gguf"), "0..5");
    let target: JoinTarget = c.join.parse().unwrap();
    let (addr, coordinator) = (target.addr, target.token.coordinator().unwrap());
    let rt = rt();
    // Forty connections from unknown keys that finish the handshake and never send a byte,
    // held open; and one more re-opened, then another, all along.
    let strangers: Vec<Endpoint> = (0..4)
        .map(|_| {
            let id = NodeIdentity::generate().unwrap();
            let _g = rt.enter();
            Endpoint::bind(
                "127.0.0.1:0".parse().unwrap(),
                &id,
                tessera_net::AllowList::new(),
            )
            .unwrap()
        })
        .collect();
    let idle = rt.block_on(async {
        let mut held = Vec::new();
        for i in 0..40 {
            if let Ok(conn) = strangers[i % 4].connect(addr, coordinator).await {
                held.push(conn);
            }
        }
        held
    });
    assert!(
        idle.len() >= 32,
        "only {} idle connections opened",
        idle.len()
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reopener = {
        let (ep, stop) = (strangers[0].clone(), stop.clone());
        rt.spawn(async move {
            let mut opened = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(c) = ep.connect(addr, coordinator).await {
                    opened += 1;
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        drop(c);
                    });
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            opened
        })
    };
    // Four real token holders, spread over 4 s (the last ones after the first idle ones' 3 s
    // first-message deadline, among re-opened ones), each in within 2 s.
    for i in 0..4 {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(1200));
        }
        let id = NodeIdentity::generate().unwrap();
        let t0 = Instant::now();
        let r = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(2), enrol_as(&c.join, &id)).await
        });
        let took = t0.elapsed();
        assert!(
            matches!(r, Ok(Ok(()))),
            "real enrolment {i}: {r:?} after {took:?}"
        );
        println!("attack table: real enrolment {i} beside 40+ idle ones: {took:?}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reopened = rt.block_on(reopener).unwrap();
    // The idle ones hold nothing: each was evicted or closed at its first-message deadline.
    rt.block_on(async {
        for (i, conn) in idle.iter().enumerate() {
            tokio::time::timeout(Duration::from_secs(5), conn.closed())
                .await
                .unwrap_or_else(|_| panic!("idle connection {i} still open"));
        }
    });
    println!(
        "attack table: {} idle held, {reopened} re-opened during",
        idle.len()
    );
    drop(idle);
}

/// A run request for `n` tokens that does not stop early.
fn long_run(n: usize) -> ClientToCoord {
    ClientToCoord::Run(Box::new(RunRequest {
        prompt: Some("Once upon a time".into()),
        prompt_tokens: None,
        max_new_tokens: n,
        sampling: tessera_sampling::SamplingParams::greedy(),
        stages: None,
        prefill_chunk: 16,
        trace: false,
        stop_at_eog: false,
        grammar: None,
        logprobs: None,
        speculate: 0,
        prediction: None,
    }))
}

#[test]
fn revoked_keys_lose_every_connection_within_a_second_and_their_runs_with_them() {
    let mut c = Cluster::start(&model("stories260K.gguf"), "0..5");
    c.add_node("a");
    c.wait_ready();
    let (client_line, client_token) = create(&c, &["--role", "client", "--uses", "1"]);
    let client_target: JoinTarget = client_line.parse().unwrap();
    let rt = rt();
    let me = NodeIdentity::generate().unwrap();
    // The client key holds two sessions on two connections; a run is in flight on the first.
    let (ep1, conn1, mut s1) = rt
        .block_on(tessera_client::session::connect_client(
            &me,
            client_target.addr,
            &client_target.token,
        ))
        .unwrap();
    let (ep2, conn2, _s2) = rt
        .block_on(tessera_client::session::connect_client(
            &me,
            client_target.addr,
            &client_target.token,
        ))
        .unwrap();
    let (first_token, got_token) = std::sync::mpsc::channel();
    let reader = rt.spawn(async move {
        s1.writer
            .write_message(frame::MSG, &long_run(400))
            .await
            .unwrap();
        let mut done = false;
        let mut told = false;
        while let Ok(m) = s1.reader.read_message::<CoordToClient>(frame::MSG).await {
            match m {
                CoordToClient::Token { .. } if !told => {
                    told = true;
                    let _ = first_token.send(());
                }
                CoordToClient::Done(_) => done = true,
                _ => {}
            }
        }
        done
    });
    got_token
        .recv_timeout(Duration::from_secs(120))
        .expect("the run started");
    // Hold the run in flight: its stage is frozen (well within its 3 s lease).
    c.node("a").signal("-STOP");
    let closed1 = rt.spawn(async move {
        conn1.closed().await;
        Instant::now()
    });
    let closed2 = rt.spawn(async move {
        conn2.closed().await;
        Instant::now()
    });
    let out = operator(&c, &["token", "revoke", &client_token[..8]]);
    let revoked_at = Instant::now();
    let said = ok(&out);
    assert!(
        said.contains("and the keys"),
        "single-use: its key too: {said}"
    );
    for (n, h) in [(1, closed1), (2, closed2)] {
        let at = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(5), h).await })
            .unwrap_or_else(|_| panic!("connection {n} still open 5 s after the revocation"))
            .unwrap();
        let after = at.saturating_duration_since(revoked_at);
        assert!(
            after < Duration::from_secs(1),
            "connection {n} closed {after:?} after"
        );
        println!("attack table: revoked client's connection {n} closed {after:?} after the CLI");
    }
    c.node("a").signal("-CONT");
    let done = rt.block_on(reader).unwrap();
    assert!(!done, "the revoked key's in-flight run was answered");
    // Another key is served as usual.
    let mut p = c.client("other", &["-p", "Once upon a time", "-n", "8"]);
    assert!(p.finish().success(), "{:?}", p.seen);
    // A new session of the key is refused.
    let again = rt.block_on(tessera_client::session::connect_client(
        &me,
        client_target.addr,
        &client_target.token,
    ));
    let why = match again {
        Ok(_) => panic!("a revoked key connected again"),
        Err(e) => e.to_string(),
    };
    assert!(why.contains("revoked"), "{why}");
    ep1.close();
    ep2.close();

    // A multi-use node token revoked with its keys, and a node revoked by name: each node's
    // connection closes within a second.
    let (node_line, node_token) = create(&c, &["--role", "node"]);
    c.add_node_via("b", &node_line);
    let dir = c.dir.path().to_path_buf();
    let (cli_done, left) = next_event(
        &mut c.coordinator,
        &[("event", "node_left"), ("node", "b")],
        || {
            ok(&operator_in(
                &dir,
                &["token", "revoke", &node_token[..8], "--with-keys"],
            ));
        },
    );
    let after = left.saturating_duration_since(cli_done);
    assert!(after < Duration::from_secs(1), "b left {after:?} after");
    let (cli_done, left) = next_event(
        &mut c.coordinator,
        &[("event", "node_left"), ("node", "a")],
        || {
            ok(&operator_in(&dir, &["node", "revoke", "a"]));
        },
    );
    let after = left.saturating_duration_since(cli_done);
    assert!(after < Duration::from_secs(1), "a left {after:?} after");
}

/// Asks for the manifest and a few chunks over a MODEL stream of `conn`: each reply.
async fn ask_model(conn: &tessera_net::Connection) -> Vec<ModelReply> {
    let mut s = conn.open_stream(stream::MODEL).await.unwrap();
    let model = tessera_node::store::ContentHash([0; 32]);
    let mut replies = Vec::new();
    for req in [
        ModelRequest::Manifest { model },
        ModelRequest::Chunks {
            model,
            ids: vec![0, 1, 2],
        },
    ] {
        s.writer.write_message(frame::MSG, &req).await.unwrap();
        let f = s.reader.recv().await.unwrap();
        assert_eq!(f.kind, frame::MSG, "no chunk frames");
        replies.push(f.json::<ModelReply>().unwrap());
    }
    replies
}

#[test]
fn a_client_credential_gets_no_model_bytes() {
    let mut c = Cluster::start(&model("stories260K.gguf"), "0..5");
    // The stage node receives its part over the network: the normal action.
    c.add_node("stage");
    c.wait_ready();
    let (client_line, _) = create(&c, &["--role", "client"]);
    let rt = rt();
    for (who, line) in [("client", &client_line), ("operator", &c.operator)] {
        let target: JoinTarget = line.parse().unwrap();
        let me = NodeIdentity::generate().unwrap();
        let replies = rt.block_on(async {
            let (ep, conn, _s) =
                tessera_client::session::connect_client(&me, target.addr, &target.token)
                    .await
                    .unwrap();
            let r = ask_model(&conn).await;
            ep.close();
            r
        });
        for r in replies {
            match r {
                ModelReply::Error { message } => {
                    assert!(message.contains("only to node credentials"), "{message}")
                }
                other => panic!("a {who} credential got {other:?}"),
            }
        }
    }
    // A node credential with no assignment: the manifest (no weights), no chunk.
    let target: JoinTarget = c.join.parse().unwrap();
    let me = NodeIdentity::generate().unwrap();
    let replies = rt.block_on(async {
        let ep = Endpoint::bind(
            "127.0.0.1:0".parse().unwrap(),
            &me,
            tessera_net::AllowList::new(),
        )
        .unwrap();
        let conn = ep.enroll(target.addr, &target.token).await.unwrap();
        let r = ask_model(&conn).await;
        ep.close();
        r
    });
    assert!(
        !matches!(&replies[0], ModelReply::Error { message } if message.contains("node credentials")),
        "{:?}",
        replies[0]
    );
    match &replies[1] {
        ModelReply::Error { message } => {
            assert!(message.contains("holds no assignment"), "{message}")
        }
        other => panic!("an unassigned node got {other:?}"),
    }
}

/// Whether `pid`'s argv holds a join or operator token.
fn argv_has_token(pid: &str) -> bool {
    let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&argv).contains("tsr1-")
}

#[test]
fn the_documented_cluster_commands_run_with_no_token_in_argv() {
    // `tessera coordinator …` (the cluster's harness starts it as the README does) writes
    // the lines it prints to owner-only files.
    let mut c = Cluster::start(&model("stories260K.gguf"), "0..5");
    assert!(!argv_has_token(&c.coordinator.pid()));
    let coord = c.dir.path().join("coord");
    let files = c.coordinator.wait_event(&[("event", "token_files")]);
    let join_file = coord.join("join.token");
    assert_eq!(files["join"], join_file.display().to_string());
    assert_eq!(std::fs::read_to_string(&join_file).unwrap().trim(), c.join);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&join_file).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "readable by others: {mode:o}");
    }
    // `tessera node --join-file …`
    let mut args = c.node_args("n");
    args.extend(["--join-file".into(), join_file.display().to_string()]);
    let mut node = Proc::spawn_with_events("n", &args);
    node.wait_event(&[("event", "joined")]);
    assert!(!argv_has_token(&node.pid()));
    node.wait_event(&[("event", "loaded")]);
    // `tessera run --coordinator-file …`
    let run = |extra: &[&str], env: Option<&str>| {
        let mut cmd = Command::new(bin());
        cmd.args(["run", "--data-dir"])
            .arg(c.dir.path().join("client"))
            .args(["-p", "Once upon a time", "-n", "8"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(v) = env {
            cmd.env("TESSERA_TOKEN", v);
        }
        run_with_timeout(cmd, Duration::from_secs(120))
    };
    let op_file = coord.join("operator.token").display().to_string();
    let out = run(&["--coordinator-file", &op_file], None);
    let text = ok(&out);
    assert!(text.starts_with("Once upon a time"), "{text}");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("warning"));
    // … or with the line in TESSERA_TOKEN.
    let out = run(&[], Some(&c.operator));
    assert_eq!(ok(&out), text);
    // Given on the command line it still works, with a warning.
    let out = run(&["--coordinator", &c.operator], None);
    assert_eq!(ok(&out), text);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("visible to every user in the process list"),
        "{err}"
    );
    // `tessera token create|list|revoke` and `tessera node revoke` with the operator file.
    let (_, id) = create(&c, &["--role", "client", "--uses", "1"]);
    let list = ok(&operator(&c, &["token", "list"]));
    assert!(list.contains(&id), "{list}");
    ok(&operator(&c, &["token", "revoke", &id]));
    ok(&operator(&c, &["node", "revoke", "n"]));
}
