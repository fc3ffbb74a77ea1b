//! Enrolment refused: a node with a forged join token, and a second key claiming a name that
//! belongs to another node; neither joins, and each is told why.

use std::process::{Command, Output, Stdio};

use crate::common::{bin, event_in, model, run_with_timeout, JSON_LOGS};
use crate::{Cluster, TIMEOUT};

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
