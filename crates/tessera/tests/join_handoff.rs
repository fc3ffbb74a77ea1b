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

/// The `command:` of each service in `packaging/compose.yaml`, folded (`>`) onto one line, with
/// `${NAME:-default}` read as its default.
fn compose_commands() -> Vec<(String, Vec<String>)> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/compose.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim() != "command: >" {
            continue;
        }
        let service = lines[..i]
            .iter()
            .rev()
            .find(|l| l.starts_with("  ") && !l.starts_with("   "))
            .and_then(|l| l.trim().split_once(':'))
            .map(|(name, _)| name.to_string())
            .unwrap();
        let indent = line.len() - line.trim_start().len();
        let folded: Vec<&str> = lines[i + 1..]
            .iter()
            .take_while(|l| l.len() - l.trim_start().len() > indent)
            .map(|l| l.trim())
            .collect();
        let mut command = folded.join(" ");
        while let Some(start) = command.find("${") {
            let end = start + command[start..].find('}').unwrap();
            let default = command[start..end].split_once(":-").unwrap().1.to_string();
            command.replace_range(start..=end, &default);
        }
        out.push((
            service,
            command.split_whitespace().map(str::to_string).collect(),
        ));
    }
    out
}

fn flag<'a>(args: &'a [String], name: &str) -> &'a str {
    let at = args
        .iter()
        .position(|a| a == name)
        .unwrap_or_else(|| panic!("no {name}"));
    &args[at + 1]
}

/// Every service's flags parse (the container would start, not stop at a typo), and the
/// pieces of the handoff meet: the nodes wait on the file the head copies its line to, and the
/// head advertises its own service name.
#[test]
fn the_compose_file_passes_flags_tessera_accepts() {
    let commands = compose_commands();
    let names: Vec<&str> = commands.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(names, ["head", "node-a", "node-b"]);
    for (service, args) in &commands {
        let mut with_help: Vec<&str> = args.iter().map(String::as_str).collect();
        with_help.push("--help");
        let out = tessera(&with_help);
        assert!(
            out.status.success(),
            "{service}: tessera {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let head = &commands[0].1;
    let copy = flag(head, "--join-copy");
    let (host, _) = flag(head, "--coordinator-advertise")
        .rsplit_once(':')
        .unwrap();
    assert_eq!(host, "head", "the head advertises its service name");
    for (service, args) in &commands[1..] {
        assert_eq!(
            flag(args, "--join-file"),
            copy,
            "{service} reads the head's copy"
        );
        assert!(
            args.iter().any(|a| a == "--join-wait"),
            "{service} waits for it"
        );
        assert_eq!(
            flag(args, "--name"),
            service,
            "{service} is named after its service"
        );
    }
}
