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
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut coordinator = Killed(cmd.spawn().unwrap());
    let lines = stdout_lines(&mut coordinator.0);
    let join = loop {
        let l = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("the coordinator printed no join token");
        if let Some(j) = l.strip_prefix("join token: ") {
            break j.to_string();
        }
    };
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
            &join,
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
