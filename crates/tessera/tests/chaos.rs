//! Fault tests of the fabric with real processes on 127.0.0.1: a `tessera coordinator`, three
//! `tessera node` agents (one stage each, `--split 0..1,1..2,2..3`) and four concurrent
//! `tessera run --json` clients. A node is killed (`kill -9`), frozen (SIGSTOP) or cut off
//! (a link emulator between it and the coordinator) in the middle of the generations; every
//! generation must still complete, and its text must equal the one-process run's, byte for byte.
//! The same holds for an expert-only node of an expert split (`--experts`) killed mid-run: its
//! experts move to the survivors in a new epoch, and move back when it returns.
//!
//! Detection time (fault → the clients told their run is paused) and time to resume (fault →
//! the first token after the resumption) are printed, never asserted beyond generous timeouts.
//!
//! The coordinator's own faults (restart, an outage with no capacity left) are in
//! `chaos_coordinator.rs`; the processes and clusters these tests start are in `common/chaos.rs`.

mod common;

use std::time::{Duration, Instant};

use common::chaos::{
    clients_under_way, finish_all, messages, reference_text, run_to_end, text_of, tokens_seen,
    Cluster, Proc, TIMEOUT,
};
use common::model;
use serde_json::Value;

/// The four concurrent generations: two greedy, two seeded, long enough for a fault to land
/// in the middle.
fn workloads() -> Vec<Vec<&'static str>> {
    let n = "400";
    vec![
        vec!["-p", "Once upon a time", "-n", n, "--temperature", "0"],
        vec!["-p", "The cat sat", "-n", n, "--temperature", "0"],
        vec![
            "-p",
            "Lily and Ben",
            "-n",
            n,
            "--temperature",
            "0.9",
            "--seed",
            "7",
            "--repeat-penalty",
            "1.1",
        ],
        vec![
            "-p",
            "A dog",
            "-n",
            n,
            "--temperature",
            "0.8",
            "--seed",
            "11",
        ],
    ]
}

/// What happened to one client around a fault at `fault`.
#[derive(Debug)]
struct Recovery {
    paused_after: Option<Duration>,
    resumed_token_after: Option<Duration>,
    pauses: usize,
}

fn recovery(msgs: &[(Instant, Value)], fault: Instant) -> Recovery {
    let paused = msgs.iter().find(|(_, m)| m["type"] == "paused");
    let pauses = msgs.iter().filter(|(_, m)| m["type"] == "paused").count();
    let resumed_at = msgs
        .iter()
        .position(|(_, m)| m["type"] == "resumed")
        .and_then(|i| msgs[i..].iter().find(|(_, m)| m["type"] == "token"));
    Recovery {
        paused_after: paused.map(|(t, _)| t.saturating_duration_since(fault)),
        resumed_token_after: resumed_at.map(|(t, _)| t.saturating_duration_since(fault)),
        pauses,
    }
}

enum Fault {
    Kill,
    Freeze,
}

/// Four generations on a 3-stage ring; `fault` hits node `victim` once every client has
/// streamed its first tokens. Every generation completes with the one-process text.
fn survive(victim: &str, fault: Fault) {
    survive_with(victim, fault, &[]);
}

/// [`survive`], every client run with `extra` flags that must not change its text.
fn survive_with(victim: &str, fault: Fault, extra: &[&'static str]) {
    let path = model("test/small-qwen3-Q8_0.gguf");
    let want: Vec<String> = workloads()
        .iter()
        .map(|f| reference_text(&path, f))
        .collect();
    let loads: Vec<Vec<&str>> = workloads()
        .into_iter()
        .map(|f| [&f[..], extra].concat())
        .collect();
    let mut c = Cluster::start(&path, "0..1,1..2,2..3");
    for n in ["a", "b", "c"] {
        c.add_node(n);
    }
    c.wait_ready();
    // Wait for every client's first tokens, then strike.
    let mut clients = clients_under_way(&c, &loads);
    let struck = Instant::now();
    let progress: Vec<usize> = clients.iter().map(tokens_seen).collect();
    match fault {
        Fault::Kill => c.node(victim).signal("-KILL"),
        Fault::Freeze => c.node(victim).signal("-STOP"),
    }
    let what = match fault {
        Fault::Kill => "kill -9",
        Fault::Freeze => "SIGSTOP",
    };
    eprintln!("chaos: {what} of {victim} with tokens so far {progress:?}");
    if let Fault::Freeze = fault {
        // Frozen past its lease, then thawed: it comes back and is folded in again.
        c.coordinator
            .wait_event(&[("event", "lease_expired"), ("node", victim)]);
        std::thread::sleep(Duration::from_millis(500));
        c.node(victim).signal("-CONT");
    }
    let mut outs = Vec::new();
    for (i, p) in clients.iter_mut().enumerate() {
        let status = p.finish();
        let msgs = messages(p);
        assert!(
            status.success(),
            "client {i} failed: {:?}",
            msgs.iter().map(|(_, m)| m).collect::<Vec<_>>()
        );
        let prompt = loads[i][1];
        assert_eq!(text_of(prompt, &msgs), want[i], "client {i}: text");
        assert!(
            !msgs.iter().any(|(_, m)| m["type"] == "error"),
            "client {i} saw an error"
        );
        outs.push(msgs);
    }
    if extra.contains(&"--speculate") {
        // The ring did speculate: some run's sampling stage had drafts accepted.
        let accepted = |msgs: &Vec<(Instant, Value)>| {
            msgs.iter()
                .filter(|(_, m)| m["type"] == "done")
                .flat_map(|(_, m)| m["stage_stats"].as_array().cloned().unwrap_or_default())
                .map(|s| s["drafts_accepted"].as_u64().unwrap_or(0))
                .sum::<u64>()
        };
        assert!(
            outs.iter().map(accepted).sum::<u64>() > 0,
            "no draft was accepted"
        );
    }
    let mut interrupted = 0;
    for (i, msgs) in outs.iter().enumerate() {
        let r = recovery(msgs, struck);
        if r.pauses > 0 {
            interrupted += 1;
        }
        eprintln!(
            "chaos: {what} of {victim}: client {i}: paused after {:?} (detection), first token after resuming {:?} (time to resume), {} pause(s)",
            r.paused_after, r.resumed_token_after, r.pauses
        );
    }
    assert!(
        interrupted > 0,
        "the fault landed after every generation had finished; nothing was resumed"
    );
    if let Fault::Freeze = fault {
        // The thawed node rejoined and is folded back in: three stages again.
        c.node(victim).wait_event_nth(&[("event", "joined")], 2);
        folded_in(&mut c, victim);
        let msgs = run_to_end(&c, "after", &loads[0]);
        assert_eq!(text_of(loads[0][1], &msgs), want[0]);
        assert_eq!(
            started_stages(&msgs),
            3,
            "the thawed node is folded back in"
        );
    }
}

#[test]
fn kill_of_the_middle_stage_resumes_every_generation_with_the_same_text() {
    survive("b", Fault::Kill);
}

/// Speculation on the ring (`--speculate 4`): a run resumed after a `kill -9` of the middle
/// stage replays the accepted tokens only and gives the text of one process.
#[test]
fn kill_of_the_middle_stage_mid_speculation_resumes_every_generation_with_the_same_text() {
    survive_with("b", Fault::Kill, &["--speculate", "4"]);
}

#[test]
fn kill_of_the_first_stage_resumes_every_generation_with_the_same_text() {
    survive("a", Fault::Kill);
}

#[test]
fn kill_of_the_last_stage_resumes_every_generation_with_the_same_text() {
    survive("c", Fault::Kill);
}

#[test]
fn frozen_stage_is_declared_gone_planned_around_and_folded_back_in() {
    survive("b", Fault::Freeze);
}

/// Waits until the epoch `node` loaded after rejoining is ready: the new split is made beside
/// the serving one and takes requests only then (make before break).
fn folded_in(c: &mut Cluster, node: &str) {
    let loaded = c.node(node).wait_event_nth(&[("event", "loaded")], 2);
    let epoch = loaded["epoch"].clone();
    c.coordinator
        .wait_event_where(&[("event", "epoch_ready")], 1, |e| e["epoch"] == epoch);
}

fn started_stages(msgs: &[(Instant, Value)]) -> usize {
    msgs.iter()
        .find(|(_, m)| m["type"] == "started")
        .map_or(0, |(_, m)| m["stages"].as_array().unwrap().len())
}

#[test]
fn cut_link_is_planned_around_and_the_healed_node_is_folded_back_in() {
    let path = model("test/small-qwen3-Q8_0.gguf");
    let loads = workloads();
    let want: Vec<String> = loads.iter().map(|f| reference_text(&path, f)).collect();
    let mut c = Cluster::start(&path, "0..1,1..2,2..3");
    c.add_node("a");
    c.add_node("b");
    // Node c reaches the coordinator through a link emulator (its ring links are direct).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let upstream: std::net::SocketAddr = c.addr().parse().unwrap();
    let (emu, via) = rt
        .block_on(tessera_linkemu::LinkEmulator::start(
            "127.0.0.1:0".parse().unwrap(),
            upstream,
            tessera_linkemu::LinkShape::default(),
        ))
        .unwrap();
    let token = c.join.rsplit_once('@').unwrap().0.to_string();
    c.add_node_via("c", &format!("{token}@{via}"));
    c.wait_ready();
    let mut clients = clients_under_way(&c, &loads);
    let struck = Instant::now();
    emu.handle().partition();
    c.coordinator
        .wait_event(&[("event", "lease_expired"), ("node", "c")]);
    let detected = struck.elapsed();
    let mut interrupted = 0;
    for (i, p) in clients.iter_mut().enumerate() {
        assert!(p.finish().success(), "client {i}");
        let msgs = messages(p);
        assert_eq!(text_of(loads[i][1], &msgs), want[i], "client {i}: text");
        let r = recovery(&msgs, struck);
        if r.pauses > 0 {
            // Paused, then resumed (the text above is whole): a token after the resumption.
            assert!(r.resumed_token_after.is_some(), "client {i}: {r:?}");
            interrupted += 1;
        }
        eprintln!(
            "chaos: partition of c: client {i}: paused after {:?}, first token after resuming {:?}",
            r.paused_after, r.resumed_token_after
        );
    }
    assert!(
        interrupted > 0,
        "the partition landed after every generation had finished; nothing was resumed"
    );
    // The coordinator says the same: runs paused on the lost epoch and resumed on another.
    let paused = c.coordinator.events(&[("event", "run_paused")]);
    let resumed = c.coordinator.events(&[("event", "run_resumed")]);
    assert!(paused.len() >= interrupted, "{paused:?}");
    for p in &paused {
        let r = resumed
            .iter()
            .find(|r| r["seq"] == p["seq"])
            .unwrap_or_else(|| panic!("{p} and never resumed: {resumed:?}"));
        assert_ne!(
            r["epoch"], p["epoch"],
            "resumed on the lost epoch: {r} after {p}"
        );
    }
    eprintln!("chaos: partition of c: the coordinator declared it gone after {detected:?}");
    // The survivors serve meanwhile, on two stages.
    let msgs = run_to_end(&c, "during", &loads[0]);
    assert_eq!(text_of(loads[0][1], &msgs), want[0]);
    assert_eq!(started_stages(&msgs), 2);
    // Healed: c notices the silence, reconnects, and is folded back in (three stages again).
    emu.handle().heal();
    let healed = Instant::now();
    c.node("c").wait_event_nth(&[("event", "joined")], 2);
    folded_in(&mut c, "c");
    eprintln!(
        "chaos: partition of c: rejoined and loaded {:?} after the heal",
        healed.elapsed()
    );
    let msgs = run_to_end(&c, "after", &loads[1]);
    assert_eq!(text_of(loads[1][1], &msgs), want[1]);
    assert_eq!(
        started_stages(&msgs),
        3,
        "the healed node is folded back in"
    );
    drop(emu);
    drop(rt);
}

/// Starts an expert node (an `--experts` owner) with `extra` flags and waits until it joined.
fn add_expert_node(c: &mut Cluster, name: &str, extra: &[&str]) {
    let mut args = c.node_args(name);
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--join".to_string(), c.join.clone()]);
    let mut p = Proc::spawn_with_events(name, &args);
    p.wait_event(&[("event", "joined")]);
    c.nodes.push(p);
}

/// Waits for every client: each succeeds with its one-process text, and at least one was
/// paused and resumed by the fault at `struck`.
fn all_complete(
    clients: &mut [Proc],
    loads: &[Vec<&str>],
    want: &[String],
    struck: Instant,
    what: &str,
) {
    let mut interrupted = 0;
    for (i, msgs) in finish_all(clients, loads, want).iter().enumerate() {
        let r = recovery(msgs, struck);
        interrupted += usize::from(r.pauses > 0);
        eprintln!(
            "chaos: {what}: client {i}: paused after {:?}, first token after resuming {:?}",
            r.paused_after, r.resumed_token_after
        );
    }
    assert!(
        interrupted > 0,
        "the fault landed after every generation had finished; nothing was resumed"
    );
}

/// The run report's placement of node `name` (`done` message).
fn placed<'a>(msgs: &'a [(Instant, Value)], name: &str) -> &'a Value {
    let report = msgs
        .iter()
        .find(|(_, m)| m["type"] == "done")
        .map(|(_, m)| m)
        .expect("a report");
    report["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("{name} is not in {report}"))
}

/// An expert split over three nodes of a qwen3moe model: `a` is the home stage (all layers and
/// some experts), `b` and `c` hold only experts. `c` is killed (`kill -9`) mid-generation: a new
/// epoch keeps the ring on `a` and hands `c`'s experts to the survivor with the most room (`a`:
/// `b` and `c` run under a budget), the generations resume with the one-process text, and
/// when `c` returns the configured split is placed again.
#[test]
fn kill_of_an_expert_node_moves_its_experts_and_resumes_every_generation() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let all = workloads();
    let loads = [all[0].clone(), all[2].clone()];
    let want: Vec<String> = loads.iter().map(|f| reference_text(&path, f)).collect();
    // 8 experts in each of 3 layers.
    let mut c = Cluster::start_with(&path, "0..3", &["--experts", "0+3+6@a,1+4+7@b,2+5@c"]);
    let budget = ["--memory-budget", "64MiB"];
    c.add_node("a");
    add_expert_node(&mut c, "b", &budget);
    add_expert_node(&mut c, "c", &budget);
    for n in ["a", "b", "c"] {
        c.node(n).wait_event(&[("event", "loaded")]);
    }
    let mut clients = clients_under_way(&c, &loads);
    let struck = Instant::now();
    c.node("c").signal("-KILL");
    c.coordinator
        .wait_event(&[("event", "lease_expired"), ("node", "c")]);
    // The survivors take c's experts: a, the home, has the most room; b keeps its own.
    let a_holds =
        c.coordinator
            .wait_event_where(&[("event", "experts_placed"), ("node", "a")], 1, |e| {
                e["experts"]
                    .as_str()
                    .is_some_and(|x| x.split(',').any(|i| i == "2"))
            });
    assert_eq!(a_holds["experts"], "0,2,3,5,6", "{a_holds}");
    let epoch = a_holds["epoch"].to_string();
    let b_holds = c.coordinator.wait_event(&[
        ("event", "experts_placed"),
        ("node", "b"),
        ("epoch", &epoch),
    ]);
    assert_eq!(b_holds["experts"], "1,4,7", "{b_holds}");
    all_complete(
        &mut clients,
        &loads,
        &want,
        struck,
        "kill -9 of expert node c",
    );
    // Meanwhile the home and b serve (two nodes in the epoch), with the same text.
    for n in ["a", "b"] {
        c.node(n).wait_event_nth(&[("event", "loaded")], 2);
    }
    let msgs = run_to_end(&c, "during", &loads[0]);
    assert_eq!(text_of(loads[0][1], &msgs), want[0]);
    assert_eq!(started_stages(&msgs), 2);
    // c returns (same key and data, no token): the configured split is placed again.
    let mut args = c.node_args("c");
    args.extend(budget.iter().map(|s| s.to_string()));
    let mut back = Proc::spawn_with_events("c-again", &args);
    back.wait_event(&[("event", "joined")]);
    back.wait_event(&[("event", "loaded")]);
    // It is made beside the serving split and serves new runs once ready (the third epoch).
    c.coordinator.wait_event_nth(&[("event", "epoch_ready")], 3);
    let msgs = run_to_end(&c, "after", &loads[1]);
    assert_eq!(text_of(loads[1][1], &msgs), want[1]);
    assert_eq!(started_stages(&msgs), 3, "c is folded back in");
    c.nodes.push(back);
}

/// The home `a` holds half the experts within its budget; the expert node `b` holds the other
/// half. `b` is killed mid-generation: `a` alone must take every expert, more than its budget
/// holds, so it streams experts from disk (keeping only part of them in memory), and the
/// generation resumes with the one-process text.
#[test]
fn a_home_given_more_experts_than_its_budget_streams_them_after_a_loss() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    // Short enough for a's KV cache within its budget; long enough to be cut.
    let loads = [vec![
        "-p",
        "Once upon a time",
        "-n",
        "120",
        "--temperature",
        "0",
    ]];
    let want: Vec<String> = loads.iter().map(|f| reference_text(&path, f)).collect();
    // The model is 5.7 MiB: 0.9 MiB without its experts, 0.6 MiB per expert of every layer.
    // a holds about 3.3 MiB of it at first, 5.7 MiB after the loss.
    let budget: u64 = 9 << 19; // 4.5 MiB
    let mut c = Cluster::start_with(&path, "0..3", &["--experts", "0-3@a,4-7@b"]);
    add_expert_node(&mut c, "a", &["--memory-budget", &budget.to_string()]);
    add_expert_node(&mut c, "b", &[]);
    for n in ["a", "b"] {
        c.node(n).wait_event(&[("event", "loaded")]);
    }
    let mut clients = clients_under_way(&c, &loads);
    let struck = Instant::now();
    c.node("b").signal("-KILL");
    // a takes b's experts, beyond its budget (it streams them: its load below shows it).
    let a_holds =
        c.coordinator
            .wait_event_where(&[("event", "experts_placed"), ("node", "a")], 1, |e| {
                e["experts"]
                    .as_str()
                    .is_some_and(|x| x.split(',').any(|i| i == "4"))
            });
    assert_eq!(a_holds["experts"], "0,1,2,3,4,5,6,7", "{a_holds}");
    all_complete(
        &mut clients,
        &loads,
        &want,
        struck,
        "kill -9 of expert node b",
    );
    // The home alone: every expert, streamed within its budget, the same text.
    let msgs = run_to_end(&c, "alone", &loads[0]);
    assert_eq!(text_of(loads[0][1], &msgs), want[0]);
    assert_eq!(started_stages(&msgs), 1);
    let a = placed(&msgs, "a");
    let resident = a["load"]["resident_bytes"].as_u64().unwrap();
    eprintln!(
        "chaos: the home alone, budget {budget} bytes: {}",
        a["load"]
    );
    let file = std::fs::metadata(&path).unwrap().len();
    assert!(resident <= budget && resident < file, "{a}");
}

/// A constrained, sampled generation with log-probabilities survives the loss of its sampling
/// stage: the resumed attempt replays the grammar over the tokens so far, so its tokens and
/// their log-probabilities equal an uninterrupted run's, and the text is the schema's JSON.
#[test]
fn kill_of_the_sampling_stage_mid_json_replays_the_grammar_and_logprobs() {
    let path = model("test/small-qwen3-Q8_0.gguf");
    let schema = r#"{"type": "object", "properties": {
        "story": {"type": "string", "minLength": 300, "maxLength": 300},
        "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["story", "n"], "additionalProperties": false}"#;
    let flags = [
        "-p",
        "Once upon a time",
        "-n",
        "400",
        "--temperature",
        "0.9",
        "--seed",
        "7",
        "--json-schema",
        schema,
        "--top-logprobs",
        "2",
    ];
    let mut c = Cluster::start(&path, "0..1,1..2,2..3");
    for n in ["a", "b", "c"] {
        c.add_node(n);
    }
    c.wait_ready();
    let tokens = |msgs: &[(Instant, Value)]| -> Vec<(Value, Value)> {
        msgs.iter()
            .filter(|(_, m)| m["type"] == "token" && m["token"] != u32::MAX)
            .map(|(_, m)| (m["token"].clone(), m["logprobs"].clone()))
            .collect()
    };
    let want = tokens(&run_to_end(&c, "uninterrupted", &flags));
    // Where the grammar allows one token only, it is the only alternative.
    assert!(want.iter().all(|(t, lp)| lp["token"] == *t
        && lp["top"]
            .as_array()
            .is_some_and(|top| (1..=2).contains(&top.len()))));
    let mut p = c.client("interrupted", &flags);
    let deadline = Instant::now() + TIMEOUT;
    while tokens_seen(&p) < 2 {
        assert!(Instant::now() < deadline, "no tokens");
        p.drain();
        std::thread::sleep(Duration::from_millis(1));
    }
    let struck = Instant::now();
    c.node("c").signal("-KILL");
    let status = p.finish();
    let msgs = messages(&p);
    assert!(
        status.success(),
        "{:?}",
        msgs.iter().map(|(_, m)| m).collect::<Vec<_>>()
    );
    let r = recovery(&msgs, struck);
    assert!(
        r.pauses > 0,
        "the kill landed after the generation had finished"
    );
    assert_eq!(
        tokens(&msgs),
        want,
        "tokens and log-probabilities after the replay"
    );
    let text: String = msgs
        .iter()
        .filter(|(_, m)| m["type"] == "token")
        .map(|(_, m)| m["text"].as_str().unwrap_or(""))
        .collect();
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert_eq!(
        v["story"].as_str().map(|s| s.chars().count()),
        Some(300),
        "{v}"
    );
    eprintln!(
        "chaos: kill -9 of the sampling stage mid-JSON: paused after {:?}, first token after resuming {:?}",
        r.paused_after, r.resumed_token_after
    );
}

/// Starts node `name` whose data listener peers reach only through a link emulator in this
/// process (`--advertise` names the emulator; the coordinator link is direct), and waits until
/// it joined. Cutting the emulator cuts exactly the links other nodes dial to it.
fn add_node_behind_emulator(
    c: &mut Cluster,
    rt: &tokio::runtime::Runtime,
    name: &str,
    extra: &[&str],
) -> tessera_linkemu::LinkEmulator {
    // The node's UDP port, chosen here so that the emulator can forward to it.
    let listen = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (emu, via) = rt
        .block_on(tessera_linkemu::LinkEmulator::start(
            "127.0.0.1:0".parse().unwrap(),
            listen,
            tessera_linkemu::LinkShape::default(),
        ))
        .unwrap();
    let mut args = c.node_args(name);
    let at = args.iter().position(|a| a == "--listen").unwrap();
    args[at + 1] = listen.to_string();
    args.extend(["--advertise".to_string(), via.to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--join".to_string(), c.join.clone()]);
    let mut p = Proc::spawn_with_events(name, &args);
    p.wait_event(&[("event", "joined")]);
    c.nodes.push(p);
    emu
}

/// After a data link was cut: the coordinator failed the epoch for the lost link (a stage
/// reported it; no lease expired, the control links are intact), every run it paused was
/// resumed on another epoch, and every client got the one-process text.
fn recovered_from_the_lost_link(
    c: &mut Cluster,
    clients: &mut [Proc],
    loads: &[Vec<&str>],
    want: &[String],
    struck: Instant,
    link: &str,
) {
    let failed = c
        .coordinator
        .wait_event_where(&[("event", "epoch_failed")], 1, |e| {
            e["reason"].as_str().is_some_and(|r| r.contains(link))
        });
    eprintln!(
        "chaos: cut {link}: the epoch failed after {:?}: {}",
        struck.elapsed(),
        failed["reason"]
    );
    all_complete(clients, loads, want, struck, &format!("cut {link}"));
    let paused = c.coordinator.events(&[("event", "run_paused")]);
    let resumed = c.coordinator.events(&[("event", "run_resumed")]);
    assert!(!paused.is_empty(), "no run was paused");
    for p in &paused {
        assert_eq!(p["epoch"], failed["epoch"], "paused on another epoch: {p}");
        let r = resumed
            .iter()
            .find(|r| r["seq"] == p["seq"])
            .unwrap_or_else(|| panic!("{p} and never resumed: {resumed:?}"));
        assert_ne!(r["epoch"], p["epoch"], "resumed on the lost epoch: {r}");
    }
    let expired = c.coordinator.events(&[("event", "lease_expired")]);
    assert!(expired.is_empty(), "{expired:?}");
}

/// A two-stage ring whose link from `a` to `b` (b's data listener sits behind a link
/// emulator) is cut mid-generation: a stage reports the lost link, the epoch fails, the runs
/// pause and resume on a plan without that link (one of the two alone), with the one-process
/// text.
#[test]
fn cut_ring_link_between_two_stages_pauses_and_resumes_every_generation() {
    let path = model("test/small-qwen3-Q8_0.gguf");
    let all = workloads();
    let loads = [all[0].clone(), all[2].clone()];
    let want: Vec<String> = loads.iter().map(|f| reference_text(&path, f)).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut c = Cluster::start(&path, "0..1,1..3");
    c.add_node("a");
    let emu = add_node_behind_emulator(&mut c, &rt, "b", &[]);
    c.wait_ready();
    let mut clients = clients_under_way(&c, &loads);
    let struck = Instant::now();
    emu.handle().partition();
    recovered_from_the_lost_link(&mut c, &mut clients, &loads, &want, struck, "ring link");
    // Only the ring link went through the emulator: its traffic stopped at the cut.
    let stats = emu.handle().stats();
    assert!(stats.to_upstream.dropped_partition > 0, "{stats:?}");
    drop(emu);
    drop(rt);
}

/// An expert split: `a` holds every layer and experts 0-3, the expert node `b` (behind a link
/// emulator) experts 4-7. The expert link a → b is cut mid-generation: a stage reports it,
/// the epoch fails, a plan without that link gives b's experts to a (or the ring to b), and
/// the runs resume with the one-process text.
#[test]
fn cut_expert_link_from_the_home_pauses_and_resumes_every_generation() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let all = workloads();
    let loads = [all[0].clone(), all[2].clone()];
    let want: Vec<String> = loads.iter().map(|f| reference_text(&path, f)).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut c = Cluster::start_with(&path, "0..3", &["--experts", "0-3@a,4-7@b"]);
    add_expert_node(&mut c, "a", &[]);
    let emu = add_node_behind_emulator(&mut c, &rt, "b", &[]);
    for n in ["a", "b"] {
        c.node(n).wait_event(&[("event", "loaded")]);
    }
    let mut clients = clients_under_way(&c, &loads);
    let struck = Instant::now();
    emu.handle().partition();
    recovered_from_the_lost_link(&mut c, &mut clients, &loads, &want, struck, "expert link");
    let stats = emu.handle().stats();
    assert!(stats.to_upstream.dropped_partition > 0, "{stats:?}");
    drop(emu);
    drop(rt);
}
