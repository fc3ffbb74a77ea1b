//! Floods at the transport, against a real `tessera coordinator` with two stages on 127.0.0.1:
//! a thousand connections from unknown keys that push data and never enrol, handshakes that
//! fail by the thousand, and junk UDP datagrams. The coordinator must buffer little, log a
//! bounded number of lines (counting the rest), and keep serving: a victim's text is the
//! undisturbed one; and a grammar built to exhaust the compiler is refused before any node
//! compiles it. Costs are printed for the note, never asserted.

mod common;

use std::time::{Duration, Instant};

use common::chaos::{messages, reference_text, text_of, Cluster, Proc};
use common::model;
use tessera_net::{Endpoint, NodeIdentity};
use tessera_node::agent::JoinTarget;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn flags() -> Vec<&'static str> {
    vec!["-p", "Once upon a time", "-n", "120", "--temperature", "0"]
}

fn victim(c: &Cluster, name: &str) -> (String, Duration) {
    let t0 = Instant::now();
    let mut p = c.client(name, &flags());
    assert!(p.finish().success(), "{name}: {:?}", p.seen);
    (text_of("Once upon a time", &messages(&p)), t0.elapsed())
}

fn rss_kib(p: &Proc, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{}/status", p.pid()))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn log_bytes(p: &mut Proc) -> usize {
    p.drain();
    p.seen.iter().map(|(_, l)| l.len() + 1).sum()
}

#[test]
fn unenrolled_floods_and_failed_handshakes_cost_little_and_log_little() {
    let want = reference_text(&model("stories260K.gguf"), &flags());
    let mut c = Cluster::start(&model("stories260K.gguf"), "0..2,2..5");
    c.add_node("a");
    c.add_node("b");
    c.wait_ready();
    let (_, base) = victim(&c, "undisturbed");
    let target: JoinTarget = c.join.parse().unwrap();
    let coordinator = target.token.coordinator().unwrap();
    let rss_before = rss_kib(&c.coordinator, "VmRSS:");
    let log_before = log_bytes(&mut c.coordinator);

    // 1. A thousand connections from unknown keys, each pushing 1 MiB on a stream and never
    //    claiming a token.
    let pushed = rt().block_on(async {
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let id = NodeIdentity::generate().unwrap();
            let ep = Endpoint::bind(
                "127.0.0.1:0".parse().unwrap(),
                &id,
                tessera_net::AllowList::new(),
            )
            .unwrap();
            for _ in 0..100 {
                let ep = ep.clone();
                tasks.push(tokio::spawn(async move {
                    let Ok(conn) = ep.connect(target.addr, coordinator).await else {
                        return 0usize;
                    };
                    let Ok(mut s) = conn.open_stream(0x0001).await else {
                        return 0;
                    };
                    let chunk = vec![0x5au8; 64 << 10];
                    let mut sent = 0;
                    let _ = tokio::time::timeout(Duration::from_secs(3), async {
                        while sent < 1 << 20 {
                            if s.writer.get_mut().write_all(&chunk).await.is_err() {
                                break;
                            }
                            sent += chunk.len();
                        }
                    })
                    .await;
                    // Hold the connection until the flood is over.
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    drop(conn);
                    sent
                }));
            }
        }
        let mut total = 0;
        for t in tasks {
            total += t.await.unwrap_or(0);
        }
        total
    });
    let rss_flood = rss_kib(&c.coordinator, "VmHWM:");

    // 2. Two thousand handshakes that fail: the dialer expects another server key.
    rt().block_on(async {
        let id = NodeIdentity::generate().unwrap();
        let ep = Endpoint::bind(
            "127.0.0.1:0".parse().unwrap(),
            &id,
            tessera_net::AllowList::new(),
        )
        .unwrap();
        let wrong = NodeIdentity::generate().unwrap().node_id();
        let mut tasks = Vec::new();
        for _ in 0..2000 {
            let ep = ep.clone();
            tasks.push(tokio::spawn(async move {
                let _ = ep.connect(target.addr, wrong).await;
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
    });

    // 3. Forty thousand junk datagrams.
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut junk = [0u8; 1200];
    for i in 0..40_000u32 {
        junk[..4].copy_from_slice(&i.to_le_bytes());
        junk[0] |= 0xc0; // looks like a long-header (Initial) packet
        let _ = udp.send_to(&junk, target.addr);
    }

    let (text, under) = victim(&c, "victim");
    assert_eq!(text, want, "the victim's text changed");
    let log = log_bytes(&mut c.coordinator) - log_before;
    let refusals = c.coordinator.events(&[("event", "refused_connection")]);
    let refusal_lines = refusals.len() + c.coordinator.events(&[("event", "refused")]).len();
    // A burst and then about a line a second, not one per attempt.
    assert!(
        refusal_lines < 200,
        "{refusal_lines} refusal lines for 3,000 refused attempts"
    );
    // Each logged refusal carries the count of all of them: far more than were logged.
    let counted = refusals
        .iter()
        .filter_map(|e| e["refused"].as_u64())
        .max()
        .unwrap_or(0);
    assert!(
        counted > refusal_lines as u64,
        "{counted} refusals counted, {refusal_lines} logged"
    );
    println!(
        "attack table: 1000 unenrolled connections pushing data ({pushed} bytes accepted by \
         their streams), 2000 failed handshakes, 40000 junk datagrams: coordinator RSS \
         {rss_before} KiB before, peak {rss_flood} KiB during the flood, log +{log} B \
         ({refusal_lines} lines), victim {under:?} (undisturbed {base:?})"
    );
}

/// A client's grammar built to exhaust the compiler (a chain of 800 `$ref`s, each a property
/// of the one before), sent over QUIC by `tessera run --json-schema`: the coordinator refuses
/// it naming the limit before any node sees it, no process exits, and the next run gets its
/// usual text. Such a grammar once aborted all three nodes in turn, as failover re-sent it to
/// each next node.
#[test]
fn a_hostile_grammar_over_quic_is_refused_and_every_node_lives() {
    let want = reference_text(&model("stories260K.gguf"), &flags());
    let mut c = Cluster::start(&model("stories260K.gguf"), "0..2,2..4,4..5");
    for n in ["a", "b", "c"] {
        c.add_node(n);
    }
    c.wait_ready();
    let mut defs = serde_json::Map::new();
    for i in 0..800 {
        let link = serde_json::json!({"type": "object",
            "properties": {"x": {"$ref": format!("#/$defs/d{}", i + 1)}}});
        defs.insert(format!("d{i}"), link);
    }
    defs.insert("d800".into(), serde_json::json!({"type": "integer"}));
    let schema = serde_json::json!({"$defs": defs, "$ref": "#/$defs/d0"}).to_string();
    let mut hostile = flags();
    hostile.extend(["--json-schema", schema.as_str()]);
    let mut p = c.client("hostile", &hostile);
    assert!(!p.finish().success(), "a hostile grammar ran");
    assert!(
        p.seen.iter().any(|(_, l)| l.contains("schema_depth")),
        "the refusal does not name the limit: {:?}",
        p.seen
    );
    for n in ["a", "b", "c"] {
        assert!(!c.node(n).exited(), "node {n} exited");
    }
    assert!(!c.coordinator.exited(), "the coordinator exited");
    let (text, _) = victim(&c, "after");
    assert_eq!(text, want);
}
