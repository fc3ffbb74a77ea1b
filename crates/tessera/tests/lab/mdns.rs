//! Discovery by mDNS in the lab: a node given only the join token finds the coordinator on
//! another host, through the switch, and serves a run.

use std::time::Duration;

use crate::common::{self, model};
use crate::{lab_or_skip, PROMPT};
use tessera_lab::{HostSpec, LabSpec};
use tessera_linkemu::Impairment;

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
    // The coordinator's next event with these fields; none if it says nothing for 60 s.
    let event = |fields: &[(&str, &str)]| loop {
        let l = lines.recv_timeout(Duration::from_secs(60)).ok()?;
        if let Some(e) = common::event_in(&l, fields) {
            return Some(e);
        }
    };
    let announced_token = |name: &str| {
        let e = event(&[("event", name)]);
        let e = e.unwrap_or_else(|| panic!("the coordinator announced no {name}"));
        e["token"].as_str().expect("a token").to_string()
    };
    let join = announced_token("join_token");
    // Clients name stages: the operator's credential.
    let operator = announced_token("operator_token");
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
    // The coordinator says when the node has joined.
    assert!(
        event(&[("event", "node_joined"), ("node", "a")]).is_some(),
        "the node never joined; coord→a {:?}; a→coord {:?}",
        lab.switch().stats(0, 1),
        lab.switch().stats(1, 0)
    );
    let out = run();
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
