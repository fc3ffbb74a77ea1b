//! The dashboard in a real browser: headless Chromium loads `/` of a running `tessera serve`,
//! the test checks in the DOM that every node and the plan are shown, and saves a screenshot
//! to `target/dashboard.png`.
//!
//! Needs Debian's `chromium` (`apt-get install -y chromium`). Without it the test is skipped,
//! except under CI (`CI=true`), where it fails.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};

use common::{dashboard_dom, screenshot, Server, CHROMIUM};

/// A bare HTTP/1.1 exchange; returns the body (requests here never use chunked bodies that
/// matter: the completion's JSON is read whole, the status JSON is not chunked).
fn http(addr: &str, method: &str, path: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    raw.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

#[test]
fn headless_chromium_shows_every_node_and_the_plan() {
    if !Path::new(CHROMIUM).exists() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI must install chromium (apt-get install -y chromium)"
        );
        eprintln!("skipping: {CHROMIUM} is not installed");
        return;
    }
    let server = Server::start(&[]);
    // Some traffic, so throughput, latency and the request table have something to show;
    // one refused request shows as a failure.
    for i in 0..4 {
        let body = serde_json::json!({"model": "stories260K", "temperature": 0,
            "max_tokens": 40 + 20 * i, "stream": i % 2 == 0,
            "messages": [{"role": "user", "content": "Tell me a story."}]});
        http(
            &server.addr,
            "POST",
            "/v1/chat/completions",
            &body.to_string(),
        );
    }
    http(
        &server.addr,
        "POST",
        "/v1/chat/completions",
        r#"{"model":"gpt-unknown","messages":[{"role":"user","content":"hi"}]}"#,
    );
    let status: serde_json::Value =
        serde_json::from_str(&http(&server.addr, "GET", "/api/status", "")).unwrap();
    let nodes: Vec<String> = status["cluster"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap().to_string())
        .collect();
    assert!(!nodes.is_empty());
    let epoch = status["cluster"]["plan"]["epoch"].as_u64().unwrap();

    let profile = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chromium-profile");
    let url = format!("http://{}/", server.addr);
    let dom = dashboard_dom(&profile, &url, &nodes, epoch);
    assert!(
        dom.contains("model_not_found") || dom.contains("gpt-unknown"),
        "failures missing"
    );

    let shot = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/dashboard.png");
    screenshot(&profile, &url, &shot);
}
