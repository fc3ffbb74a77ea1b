//! A head and its nodes started together with no token copied by hand, as
//! `packaging/compose.yaml` starts them: the head (`serve --nodes-expected`) writes its join
//! line, naming the address nodes dial (`--coordinator-advertise`), to a second file
//! (`--join-copy`); a node started before that file exists waits for it (`--join-wait`) and
//! joins through the name it holds.

mod common;

use std::net::{ToSocketAddrs, UdpSocket};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{bin, node_args, run_with_timeout, Proc};

const TIMEOUT: Duration = Duration::from_secs(60);

/// A UDP port free a moment ago on `ip` (the head must name its port before it binds).
fn free_udp_port(ip: std::net::IpAddr) -> u16 {
    UdpSocket::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn tessera(args: &[&str]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    run_with_timeout(cmd, TIMEOUT)
}

#[test]
fn a_node_started_first_waits_for_the_join_copy_and_dials_the_advertised_name() {
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    let copy = shared.join("join.token");
    let copy_s = copy.display().to_string();

    let mut args = node_args(dir.path(), "n1");
    args.extend(["--join-file".into(), copy_s.clone()]);
    args.extend(["--join-wait".into(), "60".into()]);
    let mut node = Proc::spawn_with_events("node", &args, TIMEOUT);

    // The head binds where `localhost` leads (the node resolves the name the same way) and
    // advertises the name, so the line differs from the bound address it would otherwise hold.
    let ip = ("localhost", 0)
        .to_socket_addrs()
        .unwrap()
        .next()
        .unwrap()
        .ip();
    let port = free_udp_port(ip);
    let listen = std::net::SocketAddr::new(ip, port).to_string();
    let advertised = format!("localhost:{port}");
    assert!(!copy.exists(), "the node is started before the line exists");
    let mut head = Proc::spawn_with_events(
        "head",
        &[
            "serve".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--nodes-expected".into(),
            "1".into(),
            "--coordinator-listen".into(),
            listen,
            "--coordinator-advertise".into(),
            advertised.clone(),
            "--join-copy".into(),
            copy_s,
            "--data-dir".into(),
            dir.path().join("head").display().to_string(),
        ],
        TIMEOUT,
    );
    let join = head.announced("join_token", "token");
    assert!(
        join.ends_with(&format!("@{advertised}")),
        "the join line names the advertised address: {join}"
    );
    node.wait_event(&[("event", "joined")]);
    let written = std::fs::read_to_string(&copy).unwrap();
    assert_eq!(written.trim(), join, "the copy holds the announced line");
    let own = std::fs::read_to_string(dir.path().join("head/join.token")).unwrap();
    assert_eq!(own, written, "the data directory's file is the same line");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&copy).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the copy is owner-only");
    }
}

#[test]
fn a_node_gives_up_when_no_join_line_appears_within_the_wait() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("never-written");
    let mut args: Vec<String> = node_args(dir.path(), "n1");
    args.extend(["--join-file".into(), missing.display().to_string()]);
    args.extend(["--join-wait".into(), "1".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = tessera(&args);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the node ran without a join line");
    assert!(
        said.contains("no join line appeared within 1 s") && said.contains("never-written"),
        "{said}"
    );
}

#[test]
fn the_handoff_flags_are_refused_where_they_mean_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let cases: [(&[&str], &str); 4] = [
        (
            &["serve", "--join-copy", "/tmp/x"],
            "--coordinator-advertise and --join-copy are for distributed mode",
        ),
        (
            &["serve", "--coordinator-advertise", "head:7070"],
            "--coordinator-advertise and --join-copy are for distributed mode",
        ),
        (
            &[
                "serve",
                "--nodes-expected",
                "1",
                "--coordinator-advertise",
                "0.0.0.0:7070",
            ],
            "cannot be dialled",
        ),
        (
            &["node", "--data-dir", &d, "--join-wait", "5"],
            "--join-file",
        ),
    ];
    for (args, want) in cases {
        let out = tessera(args);
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(said.contains(want), "{args:?}: {said}");
    }
}
