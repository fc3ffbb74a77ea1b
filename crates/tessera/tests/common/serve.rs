//! A `tessera serve` on a loopback port, the tests' cache directory and model paths.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// A running `tessera serve`, killed on drop.
pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Server {
    pub fn start(extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(extra)
            .env("TESSERA_CACHE_DIR", cache_dir())
            .env("TESSERA_LOG", "warn")
            .env(super::JSON_LOGS.0, super::JSON_LOGS.1)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting tessera serve");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line)
            .expect("reading the listen announcement");
        let addr = super::event_in(line.trim(), &[("event", "listening")])
            .and_then(|e| e["addr"].as_str().map(str::to_string))
            .unwrap_or_else(|| panic!("the first line announces no address: {line:?}"));
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sink = String::new();
            let _ = out.read_to_string(&mut sink);
        });
        Self { child, addr }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn cache_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tessera-cache")
}

pub fn model_path(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name)
        .display()
        .to_string()
}
