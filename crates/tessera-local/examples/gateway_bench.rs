//! Gateway benchmark (not a test): throughput of 1, 4 and 8 concurrent streams, batched versus
//! the same requests one at a time, and the time to first token the gateway adds over the
//! engine alone.
//!
//! ```text
//! cargo run --release -p tessera-local --example gateway_bench -- models/test/tiny-qwen3-Q4_0.gguf [THREADS] [TOKENS]
//! ```
//!
//! The server runs in this process (LocalBackend + axum on 127.0.0.1:0); clients are plain
//! threads speaking HTTP/1.1 over TcpStream, reading SSE until `[DONE]`.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_api::ServedModel;
use tessera_engine::Model;
use tessera_gateway::{Gateway, GatewayConfig};
use tessera_local::{LocalBackend, LocalConfig};
use tessera_model::GgufFile;
use tessera_sampling::sample;
use tessera_sampling::SamplingParams;

/// Streams one completion; returns (time to first token, tokens, total time).
fn stream(
    addr: SocketAddr,
    model: &str,
    prompt: &str,
    max_tokens: usize,
) -> (Duration, usize, Duration) {
    let body = serde_json::json!({
        "model": model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
        "stream": true, "stream_options": {"include_usage": true},
    })
    .to_string();
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    let mut ttft = None;
    let mut tokens = 0;
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap() == 0 {
            break;
        }
        let Some(d) = line.trim_end().strip_prefix("data: ") else {
            continue;
        };
        if d == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(d).unwrap();
        if ttft.is_none()
            && v["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        {
            ttft = Some(t0.elapsed());
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
        }
    }
    (ttft.unwrap_or_default(), tokens, t0.elapsed())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .map_or("models/test/tiny-qwen3-Q4_0.gguf", String::as_str);
    let threads: usize = args.get(2).map_or(2, |t| t.parse().unwrap());
    let max_tokens: usize = args.get(3).map_or(128, |t| t.parse().unwrap());
    let gguf = GgufFile::open(path).unwrap();
    let name = "bench";

    // Engine alone: prefill the prompt and sample the first token, in process.
    let model = Model::load_full(&gguf, threads).unwrap();
    let served = ServedModel::from_gguf(name, &gguf, usize::MAX).unwrap();
    let prompt = "Once upon a time";
    let tokens = served.tokenizer.encode(prompt, true);
    let engine_ttft = median(
        (0..30)
            .map(|_| {
                let t0 = Instant::now();
                let mut kv = model.new_kv(served.context_length);
                let logits = model.forward_last(&tokens, &mut kv).unwrap();
                let _ = sample(
                    logits.last(),
                    &SamplingParams::greedy(),
                    &tokens,
                    tokens.len() as u64,
                );
                t0.elapsed()
            })
            .collect(),
    );

    let backend = LocalBackend::start(name, &gguf, model, LocalConfig::default()).unwrap();
    let gateway = Gateway::new(Arc::new(backend), GatewayConfig::default());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(tessera_gateway::serve(
        listener,
        gateway,
        std::future::pending(),
    ));

    // Gateway time to first token, one request at a time.
    let _ = stream(addr, name, prompt, 4);
    let gw_ttft = median((0..30).map(|_| stream(addr, name, prompt, 1).0).collect());
    println!("model {path}, {threads} threads, {max_tokens} tokens per stream");
    println!(
        "time to first token: engine alone {:.2} ms, through the gateway {:.2} ms (adds {:.2} ms)",
        engine_ttft.as_secs_f64() * 1e3,
        gw_ttft.as_secs_f64() * 1e3,
        (gw_ttft.as_secs_f64() - engine_ttft.as_secs_f64()) * 1e3
    );

    let prompts = |n: usize| -> Vec<String> {
        (0..n)
            .map(|i| format!("Once upon a time, story {i}"))
            .collect()
    };
    println!(
        "{:>7} {:>14} {:>14} {:>7} {:>14}",
        "streams", "batched tok/s", "serial tok/s", "ratio", "tokens/stream"
    );
    for n in [1usize, 4, 8] {
        let ps = prompts(n);
        // Alternate the two ways three times and keep the best of each (the machine is shared).
        let (mut serial, mut batched, mut per_stream) = (0f64, 0f64, 0usize);
        for _ in 0..3 {
            let t0 = Instant::now();
            let total: usize = ps.iter().map(|p| stream(addr, name, p, max_tokens).1).sum();
            serial = serial.max(total as f64 / t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            let total: usize = std::thread::scope(|s| {
                let hs: Vec<_> = ps
                    .iter()
                    .map(|p| s.spawn(move || stream(addr, name, p, max_tokens).1))
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).sum()
            });
            batched = batched.max(total as f64 / t0.elapsed().as_secs_f64());
            per_stream = total / n;
        }
        println!(
            "{n:>7} {batched:>14.1} {serial:>14.1} {:>7.2} {per_stream:>14}",
            batched / serial
        );
    }
}
