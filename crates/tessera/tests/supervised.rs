//! Long-running commands as a supervisor runs them.
//!
//! - They stop on SIGTERM when started as a child process whose stdout and stderr are pipes
//!   nobody reads (Python's `subprocess.Popen(stdout=PIPE)`, a script's background job), not
//!   the leader of its process group. Their logs fill the pipes first (`TESSERA_LOG=trace`),
//!   which once stalled every thread that logged and left `tessera up` and its nodes running
//!   after SIGTERM.
//! - What `tessera up` prints for a person is sentences: no `Name { field: … }` debug
//!   structures and no hashes or keys longer than 12 characters.
//! - The systemd units in `packaging/systemd/` verify, and every flag they and their example
//!   environment files pass is one `tessera` accepts.

mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{cache_dir, get, wait_for};

/// The budget the issue sets: everything gone within 5 s of the signal.
const STOP_WITHIN: Duration = Duration::from_secs(5);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `tessera ARGS` with both outputs piped and never read.
fn start_unread(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .env("TESSERA_CACHE_DIR", cache_dir())
        .env("TESSERA_LOG", "trace")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting tessera")
}

fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}

/// Serves some traffic so the logs overflow the pipes, then sends SIGTERM and checks that
/// the process exits cleanly, and `others` are gone, within [`STOP_WITHIN`].
fn traffic_then_sigterm(child: Child, addr: &str, others: &[u32]) {
    for _ in 0..50 {
        assert_eq!(get(addr, "/v1/models", None).status, 200);
    }
    sigterm_stops(child, "tessera");
    let left: Vec<u32> = others.iter().copied().filter(|&p| running(p)).collect();
    for &p in &left {
        let _ = Command::new("kill")
            .args(["-KILL", &p.to_string()])
            .status();
    }
    assert!(left.is_empty(), "still running after SIGTERM: {left:?}");
}

#[test]
fn serve_with_unread_pipes_stops_on_sigterm() {
    let addr = format!("127.0.0.1:{}", free_port());
    let child = start_unread(&["serve", "--listen", &addr]);
    wait_for("serve to answer", Duration::from_secs(60), || {
        std::net::TcpStream::connect(&addr).is_ok()
    });
    traffic_then_sigterm(child, &addr, &[]);
}

#[test]
fn up_with_unread_pipes_stops_with_every_node_on_sigterm() {
    let addr = format!("127.0.0.1:{}", free_port());
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().display().to_string();
    let child = start_unread(&[
        "up",
        "--listen",
        &addr,
        "--nodes",
        "2",
        "--threads",
        "1",
        "--no-sample",
        "--run-dir",
        &run_dir,
    ]);
    let pid = child.id();
    wait_for("the cluster to serve", Duration::from_secs(180), || {
        std::net::TcpStream::connect(&addr).is_ok() && get(&addr, "/health", None).status == 200
    });
    let nodes = children_of(pid);
    assert_eq!(nodes.len(), 2, "node processes: {nodes:?}");
    traffic_then_sigterm(child, &addr, &nodes);
}

/// Waits for `child` to exit after SIGTERM: cleanly, within [`STOP_WITHIN`].
fn sigterm_stops(mut child: Child, what: &str) {
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > STOP_WITHIN {
            let _ = child.kill();
            panic!("{what} still running {STOP_WITHIN:?} after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{what} exited with {status}");
}

#[test]
fn a_coordinator_and_a_node_with_unread_pipes_stop_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let mut coordinator = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["coordinator", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("coordinator"))
        .env("TESSERA_CACHE_DIR", cache_dir())
        .env("TESSERA_LOG", "trace")
        .env(common::JSON_LOGS.0, common::JSON_LOGS.1)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the coordinator");
    // Read stdout only as far as the join token; nobody reads either pipe after that.
    let mut out = BufReader::new(coordinator.stdout.take().unwrap());
    let mut line = String::new();
    let join = loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "no join token");
        if let Some(e) = common::event_in(line.trim(), &[("event", "join_token")]) {
            break e["token"].as_str().unwrap().to_string();
        }
    };
    let join_file = dir.path().join("join");
    std::fs::write(&join_file, &join).unwrap();
    let node_dir = dir.path().join("node");
    let node = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "node",
            "--listen",
            "127.0.0.1:0",
            "--name",
            "n1",
            "--quick-probe",
        ])
        .args(["--threads", "1", "--data-dir"])
        .arg(&node_dir)
        .arg("--join-file")
        .arg(&join_file)
        .env("TESSERA_CACHE_DIR", cache_dir())
        .env("TESSERA_LOG", "trace")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the node");
    // The node pins the coordinator once enrolled.
    wait_for("the node to enrol", Duration::from_secs(60), || {
        node_dir.join("coordinator.json").exists()
    });
    sigterm_stops(node, "the node");
    sigterm_stops(coordinator, "the coordinator");
    drop(out);
}

/// A word of 13 or more letters and digits mixing both: a hash, a key or a token.
fn long_hash(line: &str) -> Option<&str> {
    line.split(|c: char| !c.is_ascii_alphanumeric()).find(|w| {
        w.len() > 12
            && w.chars().any(|c| c.is_ascii_digit())
            && w.chars().any(|c| c.is_ascii_alphabetic())
    })
}

#[test]
fn up_prints_sentences_without_debug_structures_or_long_hashes() {
    let dir = tempfile::tempdir().unwrap();
    // A port of our own, so that the API can say when the cluster serves.
    let addr = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["up", "--listen", &addr, "--threads", "1", "--run-dir"])
        .arg(dir.path())
        .env("TESSERA_CACHE_DIR", cache_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting tessera up");
    // Both streams, in the order lines arrive, from start to exit.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    for out in [
        Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);
    // Serving: every start-up line is out. Then stopped, so the stop's lines are checked too.
    wait_for("up to accept connections", Duration::from_secs(180), || {
        std::net::TcpStream::connect(&addr).is_ok()
    });
    wait_for(
        "up's /health to answer 200",
        Duration::from_secs(180),
        || get(&addr, "/health", None).status == 200,
    );
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    // The readers end when the processes holding the pipes have exited.
    let mut lines = Vec::new();
    while let Ok(l) = rx.recv_timeout(Duration::from_secs(60)) {
        lines.push(l);
    }
    let text = lines.join("\n");
    for said in ["listening on", "Ctrl-C stops"] {
        assert!(
            lines.iter().any(|l| l.starts_with(said)),
            "no line starting {said:?}:\n{text}"
        );
    }
    for l in &lines {
        assert!(
            !l.contains(" { ") && !l.contains("{ "),
            "a debug structure: {l}\n{text}"
        );
        assert_eq!(long_hash(l), None, "a long hash in: {l}\n{text}");
    }
}

fn packaging() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../packaging/systemd")
}

/// `systemd-analyze verify` on each unit, with this build's binary where the unit expects
/// `/usr/local/bin/tessera` (verify checks that the command exists).
#[test]
fn the_systemd_units_verify() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipping: systemd-analyze is not installed");
        return;
    }
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("units");
    std::fs::create_dir_all(&dir).unwrap();
    for unit in ["tessera-serve.service", "tessera-node.service"] {
        let text = std::fs::read_to_string(packaging().join(unit)).unwrap();
        assert!(text.contains("ExecStart=/usr/local/bin/tessera "), "{unit}");
        let here = dir.join(unit);
        std::fs::write(
            &here,
            text.replace("/usr/local/bin/tessera", env!("CARGO_BIN_EXE_tessera")),
        )
        .unwrap();
        let out = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(&here)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && said.trim().is_empty(),
            "{unit}: {said}"
        );
    }
}

/// The flags in each unit's `ExecStart` and in its example environment file (every example
/// line, commented or not) parse: `tessera` would start with them, not stop at a typo.
#[test]
fn the_units_pass_flags_tessera_accepts() {
    for (command, env, var, fixed) in [
        (
            "serve",
            "serve.env",
            "TESSERA_SERVE_ARGS",
            vec!["--api-key-file", "/k"],
        ),
        (
            "node",
            "node.env",
            "TESSERA_NODE_ARGS",
            vec!["--data-dir", "/d", "--join-file", "/j"],
        ),
    ] {
        let text = std::fs::read_to_string(packaging().join(env)).unwrap();
        let examples: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim_start_matches("# ").strip_prefix(var))
            .filter_map(|l| l.strip_prefix('='))
            .collect();
        assert!(!examples.is_empty(), "{env} has no {var} line");
        for args in examples {
            let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
                .arg(command)
                .args(&fixed)
                .args(args.split_whitespace())
                .arg("--help")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "tessera {command} {args}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
