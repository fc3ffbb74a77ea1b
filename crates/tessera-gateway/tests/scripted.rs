//! The HTTP layer against the in-memory backend twin ([`tessera_gateway::testing`]): the
//! paths a single-process backend cannot reach (503 while no plan serves, a three-node
//! cluster on the dashboard and in `/metrics`) and text handling across token boundaries.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use tessera_api::{Backend, ServedModel};
use tessera_gateway::testing::{three_node_status, ScriptedBackend};
use tessera_gateway::{Gateway, GatewayConfig};
use tessera_model::GgufFile;

fn served() -> ServedModel {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/stories260K.gguf");
    ServedModel::from_gguf("stories260K", &GgufFile::open(path).unwrap(), usize::MAX).unwrap()
}

/// Serves `backend` on a loopback port in a background runtime.
fn start(backend: Arc<ScriptedBackend>) -> (SocketAddr, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let gw = Gateway::new(backend, GatewayConfig::default());
    rt.spawn(tessera_gateway::serve(listener, gw, std::future::pending()));
    (addr, rt)
}

/// (status, head, body) of one HTTP/1.1 exchange; chunked bodies are left as they are.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head.to_string(), body.to_string())
}

#[test]
fn no_plan_serving_is_503_with_the_reason() {
    let backend = Arc::new(ScriptedBackend::new(
        served(),
        three_node_status("stories260K", 5),
        vec![],
    ));
    backend.set_status(|s| s.not_serving = Some("replanning after node b7c9 left".into()));
    let (addr, _rt) = start(backend);
    let (status, head, body) = http(
        addr,
        "POST",
        "/v1/completions",
        r#"{"model":"stories260K","prompt":"Once"}"#,
    );
    assert_eq!(status, 503, "{body}");
    assert!(head.to_ascii_lowercase().contains("retry-after:"));
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "server_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("node b7c9 left"));
    let (status, _, body) = http(addr, "GET", "/health", "");
    assert_eq!(status, 503);
    assert!(body.contains("replanning"));
}

#[test]
fn three_nodes_and_their_plan_reach_the_dashboard_and_metrics() {
    let backend = Arc::new(ScriptedBackend::new(
        served(),
        three_node_status("stories260K", 5),
        vec![],
    ));
    let (addr, _rt) = start(backend.clone());
    let (status, _, page) = http(addr, "GET", "/", "");
    assert_eq!(status, 200);
    for n in backend.status().nodes {
        assert!(
            page.contains(&format!("id=\"node-{}\"", n.id)),
            "{} missing",
            n.id
        );
        assert!(page.contains(&n.name));
    }
    assert!(page.contains(r#"id="plan" data-epoch="3""#));
    assert!(page.contains("stage split"));
    let (_, _, metrics) = http(addr, "GET", "/metrics", "");
    assert!(metrics.contains("tessera_plan_epoch 3"));
    assert!(metrics.contains(r#"tessera_node_memory_used_bytes{node="b7c9",name="gaming-pc"}"#));
    assert!(metrics.contains(r#"tessera_link_bytes_total{from="a1f3",to="b7c9"} 50331648"#));
    let (_, _, status) = http(addr, "GET", "/api/status", "");
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(v["cluster"]["nodes"].as_array().unwrap().len(), 3);
}

#[test]
fn a_stop_string_across_tokens_ends_the_text_and_cancels_the_sequence() {
    let s = served();
    let script = s.tokenizer.encode("Hello world. More text here", false);
    let backend = Arc::new(
        ScriptedBackend::new(s, three_node_status("stories260K", 5), script)
            .paced(Duration::from_millis(1)),
    );
    let (addr, _rt) = start(backend);
    let (status, _, body) = http(
        addr,
        "POST",
        "/v1/completions",
        r#"{"model":"stories260K","prompt":"x","max_tokens":100,"stop":["d. M"]}"#,
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    // SentencePiece pieces carry their leading space.
    assert_eq!(v["choices"][0]["text"], " Hello worl");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}
