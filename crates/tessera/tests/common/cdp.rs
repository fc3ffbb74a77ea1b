//! Headless Chromium driven over the DevTools protocol (a WebSocket), so a test can watch the
//! dashboard's JavaScript run: evaluate expressions in the page, and collect every uncaught
//! exception and `console.error` the page raises.

use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tungstenite::{Message, WebSocket};

use super::CHROMIUM;

/// A headless Chromium with one page attached over the DevTools protocol; killed on drop.
pub struct Browser {
    ws: WebSocket<TcpStream>,
    /// Declared after `ws`, so the connection closes before the browser is killed.
    _chromium: Chromium,
    /// The page's session on the browser connection (flat mode): commands carry it.
    session: Option<String>,
    next_id: u64,
    /// JavaScript errors seen so far: uncaught exceptions, `console.error`, error log entries.
    pub errors: Vec<String>,
}

impl Browser {
    /// Starts Chromium with a fresh profile under `profile` and attaches to its first page.
    pub fn start(profile: &Path) -> Self {
        let _ = std::fs::remove_dir_all(profile);
        std::fs::create_dir_all(profile).unwrap();
        let mut cmd = Command::new(CHROMIUM);
        // Its own process group, so that its renderer and helper processes die with it.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting chromium");
        // Guarded from here on: a panic while connecting or attaching kills it too.
        let chromium = Chromium(child);
        let mut b = Self {
            ws: connect_browser(profile),
            _chromium: chromium,
            session: None,
            next_id: 0,
            errors: Vec::new(),
        };
        let target =
            b.call("Target.createTarget", json!({"url": "about:blank"}))["targetId"].clone();
        let attached = b.call(
            "Target.attachToTarget",
            json!({"targetId": target, "flatten": true}),
        );
        b.session = Some(attached["sessionId"].as_str().unwrap().to_string());
        for domain in ["Runtime.enable", "Log.enable", "Page.enable"] {
            b.call(domain, json!({}));
        }
        b
    }

    /// Sends one command and returns its `result`, collecting events that arrive meanwhile.
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = &self.session {
            msg["sessionId"] = json!(s);
        }
        self.ws.send(Message::text(msg.to_string())).unwrap();
        loop {
            let m = self.read();
            if m["id"].as_u64() == Some(id) {
                assert!(m.get("error").is_none(), "{method}: {m}");
                return m["result"].clone();
            }
            self.note_event(&m);
        }
    }

    fn read(&mut self) -> Value {
        loop {
            match self.ws.read().expect("DevTools connection") {
                Message::Text(t) => return serde_json::from_str(&t).unwrap(),
                Message::Close(_) => panic!("chromium closed the DevTools connection"),
                _ => continue,
            }
        }
    }

    fn note_event(&mut self, m: &Value) {
        let p = &m["params"];
        match m["method"].as_str() {
            Some("Runtime.exceptionThrown") => {
                let d = &p["exceptionDetails"];
                let text = d["exception"]["description"]
                    .as_str()
                    .or(d["text"].as_str())
                    .unwrap_or("?");
                self.errors.push(format!("uncaught: {text}"));
            }
            Some("Runtime.consoleAPICalled") if p["type"] == "error" => {
                self.errors.push(format!("console.error: {}", p["args"]));
            }
            // The browser asks for /favicon.ico by itself; the dashboard has none. Any other
            // failed load is the page's own error.
            Some("Log.entryAdded")
                if p["entry"]["level"] == "error"
                    && !p["entry"]["url"]
                        .as_str()
                        .is_some_and(|u| u.ends_with("/favicon.ico")) =>
            {
                self.errors.push(format!(
                    "log: {} ({})",
                    p["entry"]["text"].as_str().unwrap_or("?"),
                    p["entry"]["url"].as_str().unwrap_or("")
                ));
            }
            _ => {}
        }
    }

    /// Evaluates `expr` in the page; its value (JSON).
    pub fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
        );
        assert!(
            r.get("exceptionDetails").is_none(),
            "{expr} threw: {}",
            r["exceptionDetails"]
        );
        r["result"]["value"].clone()
    }

    /// Loads `url` and waits for its `load` event.
    pub fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url}));
        self.wait_until(&format!("loading {url}"), |b| {
            b.eval("document.readyState") == "complete"
        });
    }

    /// Polls `done` every 50 ms until it holds. A hang guard, not a speed claim: the wait
    /// fails with `what` only after a minute (the per-test timeout is the outer guard).
    pub fn wait_until(&mut self, what: &str, mut done: impl FnMut(&mut Self) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done(self) {
            assert!(Instant::now() < deadline, "never happened: {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The Chromium process (and its process group), killed when dropped: on every path out of a
/// test, a panic included.
struct Chromium(Child);

impl Drop for Chromium {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Chromium writes its DevTools port and the browser's WebSocket path to `DevToolsActivePort`
/// in the profile once it listens.
fn connect_browser(profile: &Path) -> WebSocket<TcpStream> {
    let file = profile.join("DevToolsActivePort");
    let deadline = Instant::now() + Duration::from_secs(60);
    let (port, path) = loop {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let mut lines = text.lines();
        if let (Some(Ok(port)), Some(path)) =
            (lines.next().map(|l| l.trim().parse::<u16>()), lines.next())
        {
            break (port, path.trim().to_string());
        }
        assert!(
            Instant::now() < deadline,
            "chromium wrote no DevToolsActivePort"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let url = format!("ws://127.0.0.1:{port}{path}");
    let (ws, _) = tungstenite::client(url.as_str(), stream).expect("DevTools WebSocket");
    ws
}
