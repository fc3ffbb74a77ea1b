//! Failover in the lab: a node killed, then a host partitioned, mid-generation; the client's
//! text is one process's, and the pause that failover caused is seen.

use std::time::Duration;

use crate::common::{self, model};
use crate::lab_or_skip;
use tessera_lab::{HostSpec, LabSpec};
use tessera_linkemu::Impairment;

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
