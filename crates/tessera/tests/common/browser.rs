//! Headless Chromium for the dashboard tests.

use std::io::Read;
use std::time::{Duration, Instant};

pub const CHROMIUM: &str = "/usr/bin/chromium";

/// Runs Chromium headless on `url` with `extra` flags, killing it after `timeout`.
pub fn chromium(
    profile: &std::path::Path,
    url: &str,
    extra: &[&str],
    timeout: Duration,
) -> std::process::Output {
    use std::process::{Command, Stdio};
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
            return std::process::Output {
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

/// The dashboard at `url` as headless Chromium renders it (`--dump-dom`), after checking that it
/// shows every node of `nodes` (by id), the plan of `epoch` and the planner's explanation.
pub fn dashboard_dom(profile: &std::path::Path, url: &str, nodes: &[String], epoch: u64) -> String {
    let out = chromium(profile, url, &["--dump-dom"], Duration::from_secs(90));
    assert!(out.status.success(), "chromium --dump-dom failed");
    let dom = String::from_utf8_lossy(&out.stdout).into_owned();
    for id in nodes {
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
    dom
}

/// Saves a 1400x1250 screenshot of `url` to `shot` with headless Chromium and checks that it
/// is a PNG.
pub fn screenshot(profile: &std::path::Path, url: &str, shot: &std::path::Path) {
    let _ = std::fs::remove_file(shot);
    let out = chromium(
        profile,
        url,
        &[
            "--window-size=1400,1250",
            &format!("--screenshot={}", shot.display()),
        ],
        Duration::from_secs(90),
    );
    assert!(out.status.success(), "chromium --screenshot failed");
    let png = std::fs::read(shot).expect("the screenshot was written");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    eprintln!("dashboard screenshot: {}", shot.display());
}
