//! The dashboard in a real browser: headless Chromium loads `/` of a running `tessera serve`,
//! the test checks in the DOM that every node and the plan are shown, and saves a screenshot
//! to `target/dashboard.png`.
//!
//! Needs Debian's `chromium` (`apt-get install -y chromium`). Without it the test is skipped,
//! except under CI (`CI=true`), where it fails.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const CHROMIUM: &str = "/usr/bin/chromium";

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start() -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .env(
                "TESSERA_CACHE_DIR",
                PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tessera-cache"),
            )
            .env("TESSERA_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting tessera serve");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        std::thread::spawn(move || {
            let mut sink = String::new();
            let _ = out.read_to_string(&mut sink);
        });
        Self { child, addr }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

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

/// Runs Chromium headless on `url` with `extra` flags, killing it after `timeout`.
fn chromium(profile: &Path, url: &str, extra: &[&str], timeout: Duration) -> Output {
    let mut child = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting chromium");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let stdout = reader.join().unwrap();
            return Output {
                status,
                stdout,
                stderr: Vec::new(),
            };
        }
        if t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
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
    let server = Server::start();
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
    let out = chromium(&profile, &url, &["--dump-dom"], Duration::from_secs(90));
    assert!(out.status.success(), "chromium --dump-dom failed");
    let dom = String::from_utf8_lossy(&out.stdout);
    for id in &nodes {
        assert!(
            dom.contains(&format!("id=\"node-{id}\"")),
            "node {id} is not on the page"
        );
    }
    assert!(
        dom.contains(&format!("id=\"plan\" data-epoch=\"{epoch}\"")),
        "the plan (epoch {epoch}) is not on the page"
    );
    assert!(
        dom.contains("Why this plan"),
        "the planner's explanation is missing"
    );
    assert!(
        dom.contains("model_not_found") || dom.contains("gpt-unknown"),
        "failures missing"
    );

    let shot = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let out = chromium(
        &profile,
        &url,
        &[
            "--window-size=1400,1250",
            &format!("--screenshot={}", shot.display()),
        ],
        Duration::from_secs(90),
    );
    assert!(out.status.success(), "chromium --screenshot failed");
    let png = std::fs::read(&shot).expect("the screenshot was written");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    eprintln!("dashboard screenshot: {}", shot.display());
}
