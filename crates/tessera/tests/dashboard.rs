//! The dashboard in a real browser: headless Chromium loads `/` of a running `tessera serve`,
//! the test checks in the DOM that every node and the plan are shown, and saves a screenshot
//! to `target/dashboard.png`. A second test drives Chromium over the DevTools protocol and
//! watches the page's JavaScript (`app.js`) turn a request sent after the page loaded into live
//! figures, a request row and a sparkline; any JavaScript error fails it.
//!
//! Needs Debian's `chromium` (`apt-get install -y chromium`). Without it the test is skipped,
//! except under CI (`CI=true`), where it fails.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};

use common::cdp::Browser;
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
    if !have_chromium() {
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

/// Fails (under CI) or skips (elsewhere, saying so) when Chromium is missing.
fn have_chromium() -> bool {
    if Path::new(CHROMIUM).exists() {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "CI must install chromium (apt-get install -y chromium)"
    );
    eprintln!("skipping: {CHROMIUM} is not installed");
    false
}

#[test]
fn dashboard_javascript_shows_a_new_request_live_without_errors() {
    if !have_chromium() {
        return;
    }
    let server = Server::start(&[]);
    let profile = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chromium-profile-cdp");
    let mut b = Browser::start(&profile);
    b.navigate(&format!("http://{}/", server.addr));

    // The server rendered an idle page: no requests, a flat sparkline (app.js draws [0, 0]).
    let rows = "document.querySelectorAll('#requests tr.okrow').length";
    assert_eq!(b.eval(rows), 0);
    let text = |b: &mut Browser, id: &str| -> String {
        b.eval(&format!("document.getElementById('{id}').innerText"))
            .as_str()
            .unwrap()
            .to_string()
    };
    let requests_before = text(&mut b, "requests");
    let kpis_before = text(&mut b, "kpis");
    let spark = "document.querySelector('#spark .line').getAttribute('d')";
    let flat = b.eval(spark);
    assert!(
        flat.as_str().is_some_and(|d| d.starts_with('M')),
        "app.js drew no sparkline: {flat}"
    );
    // The live indicator turns on only when app.js has received a server-sent event.
    b.wait_until("the live indicator (an event reached app.js)", |b| {
        b.eval("document.getElementById('live').classList.contains('on')") == true
    });

    // A request sent after the page loaded can reach the page only through app.js.
    let body = serde_json::json!({"model": "stories260K", "temperature": 0, "max_tokens": 48,
        "messages": [{"role": "user", "content": "Tell me a story about a robot."}]});
    let reply = http(
        &server.addr,
        "POST",
        "/v1/chat/completions",
        &body.to_string(),
    );
    let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
    let id = reply["id"].as_str().expect("a completion id").to_string();
    b.wait_until("the request list to show the new request", |b| {
        text(b, "requests").contains(&id)
    });
    assert_ne!(text(&mut b, "requests"), requests_before);
    assert_eq!(b.eval(rows), 1, "one successful request row");
    b.wait_until("the live figures to change", |b| {
        text(b, "kpis") != kpis_before
    });
    b.wait_until("the sparkline to rise", |b| b.eval(spark) != flat);

    // The error collector works: an uncaught exception thrown in the page is seen.
    assert!(
        b.errors.is_empty(),
        "JavaScript errors on the dashboard: {:?}",
        b.errors
    );
    b.eval("setTimeout(function () { throw new Error('probe-7f3a'); }, 0); 1");
    b.wait_until("the probe exception to be reported", |b| {
        let _ = b.eval("1");
        b.errors.iter().any(|e| e.contains("probe-7f3a"))
    });
    assert_eq!(b.errors.len(), 1, "{:?}", b.errors);
}
