//! Attacks on the HTTP API of a real `tessera serve` on 127.0.0.1: client text echoed back in
//! bulk, megabyte stop strings, and slowloris connections. Each is refused (or bounded) for its
//! reason, a concurrent normal request gets the text an undisturbed one gets, and the server
//! keeps serving. What each attack cost (the server's peak RSS, the size of `/api/status` and
//! the dashboard, the normal request's latency beside an undisturbed one) is printed for the
//! note, never asserted.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{get, post, Server};
use serde_json::json;

/// The normal request: greedy, so its text is fixed.
fn normal(addr: &str) -> (String, Duration) {
    let t0 = Instant::now();
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "stories260K", "max_tokens": 60, "temperature": 0,
                "messages": [{"role": "user", "content": "Once upon a time"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let text = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    (text, t0.elapsed())
}

fn peak_rss_kib(server: &Server) -> u64 {
    std::fs::read_to_string(format!("/proc/{}/status", server.child.id()))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_huge_model_field_is_never_echoed_in_bulk() {
    let server = Server::start(&[]);
    let (want, base) = normal(&server.addr);
    let huge = "m".repeat(3_900_000);
    let body = json!({"model": huge, "messages": [{"role": "user", "content": "x"}]});
    let t0 = Instant::now();
    for _ in 0..40 {
        let r = post(&server.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 404);
        let e = r.json();
        assert_eq!(e["error"]["code"], "model_not_found");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.len() < 1024, "{} bytes of error", msg.len());
    }
    let attack = t0.elapsed();
    let (text, under) = normal(&server.addr);
    assert_eq!(text, want);
    let status = get(&server.addr, "/api/status", None);
    let page = get(&server.addr, "/", None);
    assert!(status.body.len() < 256 << 10, "{} bytes", status.body.len());
    assert!(page.body.len() < 256 << 10, "{} bytes", page.body.len());
    println!(
        "attack table: 40 requests with a 3.9 MB model field ({attack:?}): refused 404, \
         /api/status {} B, dashboard {} B, peak RSS {} KiB, normal request {under:?} \
         (undisturbed {base:?})",
        status.body.len(),
        page.body.len(),
        peak_rss_kib(&server)
    );
}

#[test]
fn megabyte_stop_strings_are_refused() {
    let server = Server::start(&[]);
    let (want, base) = normal(&server.addr);
    let stop: Vec<String> = (0..4)
        .map(|i| format!("{i}{}", "s".repeat(999_999)))
        .collect();
    let body = json!({"model": "stories260K", "max_tokens": 60, "stop": stop,
                      "messages": [{"role": "user", "content": "Once upon a time"}]});
    let attacker = {
        let addr = server.addr.clone();
        std::thread::spawn(move || {
            (0..8)
                .map(|_| post(&addr, "/v1/chat/completions", &body))
                .collect::<Vec<_>>()
        })
    };
    let (text, under) = normal(&server.addr);
    for r in attacker.join().unwrap() {
        assert_eq!(r.status, 400, "{}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["param"], "stop");
        assert!(e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 1024"));
    }
    assert_eq!(text, want);
    println!(
        "attack table: 8 requests with four 1 MB stop strings: refused 400; peak RSS {} KiB, \
         normal request {under:?} (undisturbed {base:?})",
        peak_rss_kib(&server)
    );
}

/// 400 connections that send half a request line and then a byte now and then: the server
/// closes each once its header-read timeout passes, and serves normal requests meanwhile.
#[test]
fn slowloris_connections_are_closed_and_others_are_served() {
    let server = Server::start(&[]);
    let (want, base) = normal(&server.addr);
    let mut held: Vec<TcpStream> = (0..400)
        .map(|_| {
            let mut s = TcpStream::connect(&server.addr).unwrap();
            s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                .unwrap();
            s
        })
        .collect();
    let (text, under) = normal(&server.addr);
    assert_eq!(text, want);
    // Keep trickling; the server must end every connection (EOF or reset), not wait forever.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut open = held.len();
    while open > 0 {
        assert!(
            Instant::now() < deadline,
            "{open} slow connections still open"
        );
        open = 0;
        for s in &mut held {
            let _ = s.write_all(b"a");
            s.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
            let mut b = [0u8; 256];
            match s.read(&mut b) {
                Ok(0) => {}
                Ok(_) => {} // an error response (408) counts as closed once read
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    open += 1
                }
                Err(_) => {}
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(normal(&server.addr).0, want);
    println!(
        "attack table: 400 slowloris connections: all closed by the header-read timeout; peak \
         RSS {} KiB, normal request {under:?} (undisturbed {base:?})",
        peak_rss_kib(&server)
    );
}
