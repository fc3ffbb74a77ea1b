//! A few-line HTTP/1.1 client over `TcpStream` (`Connection: close`, chunked bodies decoded),
//! SSE parsing and Prometheus samples.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

pub fn send(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    auth: Option<&str>,
) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connecting");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.unwrap_or("");
    let auth = auth.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

pub fn read_response(s: TcpStream) -> Response {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').unwrap();
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut raw = Vec::new();
    r.read_to_end(&mut raw).unwrap();
    let body = if chunked { dechunk(&raw) } else { raw };
    Response {
        status,
        headers,
        body: String::from_utf8(body).unwrap(),
    }
}

pub fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = std::str::from_utf8(&raw[..eol])
            .unwrap()
            .split(';')
            .next()
            .unwrap();
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&raw[eol + 2..eol + 2 + n]);
        raw = &raw[eol + 2 + n + 2..];
    }
}

pub fn post(addr: &str, path: &str, body: &serde_json::Value) -> Response {
    read_response(send(addr, "POST", path, Some(&body.to_string()), None))
}

pub fn get(addr: &str, path: &str, auth: Option<&str>) -> Response {
    read_response(send(addr, "GET", path, None, auth))
}

/// The `data:` payloads of an SSE body, `[DONE]` included.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(str::to_string)
        .collect()
}

/// Text and finish reason of a streamed chat completion; checks the stream's shape.
pub fn streamed_chat(addr: &str, body: &serde_json::Value) -> (String, String) {
    let r = post(addr, "/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let data = sse_data(&r.body);
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        r.body
    );
    let mut text = String::new();
    let mut finish = String::new();
    for d in &data[..data.len() - 1] {
        let v: serde_json::Value = serde_json::from_str(d).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        let c = &v["choices"][0];
        if let Some(t) = c["delta"]["content"].as_str() {
            text.push_str(t);
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish)
}

/// A Prometheus sample without labels.
pub fn metric(addr: &str, name: &str) -> f64 {
    let m = get(addr, "/metrics", None);
    m.body
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
        .parse()
        .unwrap()
}

pub fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every sample of a labelled Prometheus metric: (labels, value).
pub fn metric_samples(addr: &str, name: &str) -> Vec<(String, f64)> {
    let m = get(addr, "/metrics", None);
    m.body
        .lines()
        .filter_map(|l| l.strip_prefix(name))
        .filter_map(|r| r.strip_prefix('{'))
        .filter_map(|r| {
            let (labels, value) = r.rsplit_once("} ")?;
            Some((labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Starts a streamed request and reads it until `n` SSE `data: {` lines have arrived; the
/// open stream (dropping it disconnects the client mid-stream).
pub fn stream_until(addr: &str, path: &str, body: &str, n: usize) -> BufReader<TcpStream> {
    let s = send(addr, "POST", path, Some(body), None);
    let mut r = BufReader::new(s);
    let mut seen = 0;
    let mut line = String::new();
    while seen < n {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "stream ended early");
        if line.contains("data: {") {
            seen += 1;
        }
    }
    r
}

/// What a two-turn chat gave: both answers, and each turn's prompt and cached token counts.
#[derive(Debug)]
pub struct TwoTurns {
    pub first: String,
    pub second: String,
    pub prompt: [u64; 2],
    pub cached: [u64; 2],
}

/// A chat whose second turn re-sends the first (a long history, its answer, a follow-up), greedy,
/// 16 tokens a turn, against `model` at `addr`.
pub fn two_turn_chat(addr: &str, model: &str) -> TwoTurns {
    let history: String = (0..15)
        .map(|i| format!("Lily saw {} birds in the park. ", i + 2))
        .collect();
    let turn = |messages: &serde_json::Value| {
        let r = post(
            addr,
            "/v1/chat/completions",
            &serde_json::json!({"model": model, "messages": messages,
                                "max_tokens": 16, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let usage = &v["usage"];
        let prompt = usage["prompt_tokens"].as_u64().unwrap();
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        (text, prompt, cached)
    };
    let (first, p1, c1) = turn(&serde_json::json!([{"role": "user", "content": history}]));
    let (second, p2, c2) = turn(&serde_json::json!([
        {"role": "user", "content": history},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "What happened next?"},
    ]));
    TwoTurns {
        first,
        second,
        prompt: [p1, p2],
        cached: [c1, c2],
    }
}
