//! A local stand-in for the Hugging Face Hub, serving repositories held in memory over a real
//! socket. It implements the routes [`crate::pull()`] uses, as the Hub answers them:
//!
//! - `GET /api/models/{org}/{name}/revision/main?blobs=true`: `{"sha": commit, "siblings":
//!   [{"rfilename", "size", "lfs": {"sha256", "size", "pointerSize"}}]}`;
//! - `GET /{org}/{name}/resolve/{rev}/{path}`: `302` to the storage route, with
//!   `X-Linked-Etag: "{sha256}"`, `X-Linked-Size` and `X-Repo-Commit`, as the Hub answers
//!   for LFS files;
//! - `GET /storage/{sha256}`: the bytes, `200`, or `206` with `Content-Range` from a
//!   `Range: bytes=N-` header.
//!
//! Unknown repositories and files get `404`, and with [`StandIn::require_token`] every route
//! answers `401` without `Authorization: Bearer TOKEN`. Faults, for tests: a transfer cut after
//! some bytes (a pull killed mid-file), and a file served with one byte changed. Every request
//! is recorded ([`StandIn::requests`]). HTTP/1.1, one connection per request.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use sha2::{Digest, Sha256};

/// A request the stand-in answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub path: String,
    /// The start of a `Range: bytes=N-` header.
    pub range_from: Option<u64>,
    pub status: u16,
}

/// A file the stand-in serves: (path in the repository, bytes, SHA-256).
type ServedFile = (String, Arc<Vec<u8>>, String);

#[derive(Default)]
struct State {
    /// repo → (commit, files).
    repos: HashMap<String, (String, Vec<ServedFile>)>,
    /// sha256 → bytes.
    blobs: HashMap<String, Arc<Vec<u8>>>,
    /// sha256 → bytes after which the next transfer of it is cut (or stalls, `true`).
    cut_after: HashMap<String, (u64, bool)>,
    /// sha256 → offset of a byte served changed.
    corrupt_at: HashMap<String, u64>,
    token: Option<String>,
    seen: Vec<Seen>,
}

/// The running stand-in; stops when dropped.
pub struct StandIn {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl StandIn {
    /// Listens on a free loopback port.
    pub fn start() -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (state, stop) = (Arc::clone(&state), Arc::clone(&stop));
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let state = Arc::clone(&state);
                    std::thread::spawn(move || {
                        let _ = serve(conn, &state);
                    });
                }
            })
        };
        Ok(Self {
            addr,
            state,
            stop,
            thread: Some(thread),
        })
    }

    /// The base URL, for `HF_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Adds (or replaces) repository `repo` with these files; its commit is derived from them.
    pub fn add_repo(&self, repo: &str, files: Vec<(String, Vec<u8>)>) {
        let mut st = lock(&self.state);
        let mut commit_hasher = Sha256::new();
        commit_hasher.update(repo.as_bytes());
        let mut entries = Vec::with_capacity(files.len());
        for (path, bytes) in files {
            let sha = sha256_hex(&bytes);
            commit_hasher.update(sha.as_bytes());
            let bytes = Arc::new(bytes);
            st.blobs.insert(sha.clone(), Arc::clone(&bytes));
            entries.push((path, bytes, sha));
        }
        let commit: String = commit_hasher
            .finalize()
            .iter()
            .take(20)
            .map(|b| format!("{b:02x}"))
            .collect();
        st.repos.insert(repo.to_string(), (commit, entries));
    }

    /// The next transfer of the file with this content is cut after `bytes` bytes.
    pub fn cut_next_transfer(&self, content: &[u8], bytes: u64) {
        lock(&self.state)
            .cut_after
            .insert(sha256_hex(content), (bytes, false));
    }

    /// The next transfer of the file with this content sends `bytes` bytes, then nothing more
    /// while its connection stays open: a download in progress, for a test to kill its client.
    pub fn stall_next_transfer(&self, content: &[u8], bytes: u64) {
        lock(&self.state)
            .cut_after
            .insert(sha256_hex(content), (bytes, true));
    }

    /// Transfers of the file with this content change the byte at `offset` (the listing keeps
    /// the true SHA-256).
    pub fn corrupt(&self, content: &[u8], offset: u64) {
        lock(&self.state)
            .corrupt_at
            .insert(sha256_hex(content), offset);
    }

    pub fn heal(&self, content: &[u8]) {
        lock(&self.state).corrupt_at.remove(&sha256_hex(content));
    }

    /// Every route answers 401 without `Authorization: Bearer {token}`.
    pub fn require_token(&self, token: &str) {
        lock(&self.state).token = Some(token.to_string());
    }

    pub fn requests(&self) -> Vec<Seen> {
        lock(&self.state).seen.clone()
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop.
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Answers one request on `conn`.
fn serve(conn: TcpStream, state: &Mutex<State>) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut head = String::new();
    let mut line = String::new();
    while reader.read_line(&mut line)? > 0 && head.len() < 16 << 10 {
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
        line.clear();
    }
    let mut lines = head.lines();
    let request = lines.next().unwrap_or_default();
    let mut parts = request.split(' ');
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let mut headers = HashMap::new();
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let range_from = headers
        .get("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<u64>().ok());
    let reply = route(method, target, &headers, range_from, state);
    lock(state).seen.push(Seen {
        path: target.to_string(),
        range_from,
        status: reply.status,
    });
    reply.send(conn)
}

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Send only this many body bytes, then close (a cut transfer) or stall (`true`).
    cut: Option<(u64, bool)>,
}

impl Reply {
    fn new(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.into(),
            cut: None,
        }
    }

    fn header(mut self, k: &str, v: impl Into<String>) -> Self {
        self.headers.push((k.into(), v.into()));
        self
    }

    fn send(self, mut conn: TcpStream) -> std::io::Result<()> {
        let reason = match self.status {
            200 => "OK",
            206 => "Partial Content",
            302 => "Found",
            401 => "Unauthorized",
            404 => "Not Found",
            416 => "Range Not Satisfiable",
            _ => "Other",
        };
        let mut out = format!("HTTP/1.1 {} {reason}\r\n", self.status);
        for (k, v) in &self.headers {
            out.push_str(&format!("{k}: {v}\r\n"));
        }
        out.push_str(&format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            self.body.len()
        ));
        conn.write_all(out.as_bytes())?;
        let n = self
            .cut
            .map_or(self.body.len(), |(c, _)| (c as usize).min(self.body.len()));
        conn.write_all(&self.body[..n])?;
        conn.flush()?;
        if let Some((_, true)) = self.cut {
            // Hold the connection open, sending nothing, until the client is gone.
            let mut probe = [0u8; 1];
            let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(300)));
            let _ = std::io::Read::read(&mut conn, &mut probe);
        }
        if self.cut.is_some() {
            // Drop the connection with the body unfinished.
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
        Ok(())
    }
}

fn route(
    method: &str,
    target: &str,
    headers: &HashMap<String, String>,
    range_from: Option<u64>,
    state: &Mutex<State>,
) -> Reply {
    let mut st = lock(state);
    if method != "GET" {
        return Reply::new(405, "only GET");
    }
    if let Some(t) = &st.token {
        if headers.get("authorization") != Some(&format!("Bearer {t}")) {
            return Reply::new(401, r#"{"error":"Invalid credentials"}"#);
        }
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let Some(repo) = rest.strip_suffix("/revision/main") else {
            return Reply::new(404, "no such route");
        };
        let Some((commit, files)) = st.repos.get(repo) else {
            return Reply::new(404, r#"{"error":"Repository not found"}"#);
        };
        let blobs = query.split('&').any(|q| q == "blobs=true");
        let siblings: Vec<serde_json::Value> = files
            .iter()
            .map(|(p, bytes, sha)| {
                if blobs {
                    serde_json::json!({"rfilename": p, "size": bytes.len(),
                        "lfs": {"sha256": sha, "size": bytes.len(), "pointerSize": 134}})
                } else {
                    serde_json::json!({"rfilename": p})
                }
            })
            .collect();
        let body = serde_json::json!({"id": repo, "sha": commit, "siblings": siblings});
        return Reply::new(200, body.to_string()).header("Content-Type", "application/json");
    }
    if let Some(sha) = path.strip_prefix("/storage/") {
        let Some(bytes) = st.blobs.get(sha).cloned() else {
            return Reply::new(404, "no such object");
        };
        let mut body = bytes.to_vec();
        if let Some(&at) = st.corrupt_at.get(sha) {
            if let Some(b) = body.get_mut(at as usize) {
                *b ^= 0xff;
            }
        }
        let len = body.len() as u64;
        let mut reply = match range_from {
            Some(from) if from >= len => {
                return Reply::new(416, "").header("Content-Range", format!("bytes */{len}"))
            }
            Some(from) => Reply::new(206, body.split_off(from as usize))
                .header("Content-Range", format!("bytes {from}-{}/{len}", len - 1)),
            None => Reply::new(200, body),
        };
        reply = reply
            .header("ETag", format!("\"{sha}\""))
            .header("Accept-Ranges", "bytes");
        reply.cut = st.cut_after.remove(sha);
        return reply;
    }
    // /{org}/{name}/resolve/{rev}/{path...}
    let segs: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    if let [org, name, "resolve", _rev, file] = segs[..] {
        let repo = format!("{org}/{name}");
        let Some((commit, files)) = st.repos.get(&repo) else {
            return Reply::new(404, "Repository not found");
        };
        let file = file.replace("%20", " ");
        let Some((_, bytes, sha)) = files.iter().find(|(p, _, _)| *p == file) else {
            return Reply::new(404, "Entry not found");
        };
        return Reply::new(302, "")
            .header("Location", format!("/storage/{sha}"))
            .header("X-Linked-Etag", format!("\"{sha}\""))
            .header("X-Linked-Size", bytes.len().to_string())
            .header("X-Repo-Commit", commit.clone());
    }
    drop(st);
    Reply::new(404, "no such route")
}
