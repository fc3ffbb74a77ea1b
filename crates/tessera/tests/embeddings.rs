//! Embeddings served by `tessera serve` (a real process on a loopback port) equal, bit for bit,
//! what the engine computes for the same tokens in this test's own process
//! (`Model::sequence_embedding`: one sequence, one forward pass, a fresh cache), whether an
//! input is sent alone, with others in one request, by several clients at once, or split over
//! several passes because it is longer than one pass holds. Issue 36's acceptance line:
//! "Embeddings equal a reference computed in one process."

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use common::{metric, model_path, post, wait_for, Server};
use serde_json::{json, Value};
use tessera_engine::{Model, Pooling};
use tessera_gateway::embeddings::l2_normalize;
use tessera_model::{GgufFile, Tokenizer};

/// Texts to embed: short ones, and one of more than 256 tokens (the server's default rows
/// per pass), so it is run over two passes with its cache kept between them.
fn texts() -> Vec<String> {
    let long = "The little dog ran to the park and played with a red ball. ".repeat(20);
    vec![
        "Once upon a time".into(),
        "The cat sat on the mat.".into(),
        "Lily had a big, happy smile.".into(),
        long,
    ]
}

/// The engine's vectors for `texts` (normalized when `normalize`), computed here.
struct Reference {
    tokens: Vec<Vec<u32>>,
    raw: Vec<Vec<f32>>,
    normalized: Vec<Vec<f32>>,
}

fn reference(model_file: &str, texts: &[String]) -> Reference {
    let gguf = GgufFile::open(model_file).unwrap();
    let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
    let model = Model::load_full(&gguf, 2).unwrap();
    let pooling = Pooling::from_gguf(&gguf).unwrap();
    assert_eq!(
        pooling,
        Pooling::Mean,
        "a causal LM's file has no pooling key"
    );
    let tokens: Vec<Vec<u32>> = texts.iter().map(|t| tokenizer.encode(t, true)).collect();
    assert!(
        tokens.last().unwrap().len() > 256,
        "the long text must need two passes"
    );
    let raw: Vec<Vec<f32>> = tokens
        .iter()
        .map(|t| model.sequence_embedding(t, pooling).unwrap())
        .collect();
    let normalized = raw
        .iter()
        .map(|v| {
            let mut v = v.clone();
            l2_normalize(&mut v);
            v
        })
        .collect();
    Reference {
        tokens,
        raw,
        normalized,
    }
}

/// JSON numbers written from `f32`s, read back as the same `f32`s.
fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn openai(addr: &str, model: &str, input: Value, format: &str) -> (Vec<Vec<f32>>, Value) {
    let r = post(
        addr,
        "/v1/embeddings",
        &json!({"model": model, "input": input, "encoding_format": format}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    assert_eq!(body["object"], "list", "{body}");
    let vectors = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["index"], i, "{d}");
            assert_eq!(d["object"], "embedding", "{d}");
            match format {
                "float" => floats(&d["embedding"]),
                _ => base64::engine::general_purpose::STANDARD
                    .decode(d["embedding"].as_str().unwrap())
                    .unwrap()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            }
        })
        .collect();
    (vectors, body["usage"].clone())
}

fn served_equals_reference(model_file: &str, model: &str) {
    let texts = texts();
    let want = reference(model_file, &texts);
    let server = Server::start(&["--model", model_file, "--threads", "2"]);
    let addr = server.addr.clone();
    let all: Vec<Value> = texts.iter().map(|t| json!(t)).collect();

    // All inputs in one request, as floats and as base64.
    let (together, usage) = openai(&addr, model, json!(all), "float");
    let total: usize = want.tokens.iter().map(Vec::len).sum();
    assert_eq!(usage["prompt_tokens"], total, "{usage}");
    assert_eq!(usage["total_tokens"], total, "{usage}");
    for (i, (got, want)) in together.iter().zip(&want.normalized).enumerate() {
        assert_eq!(bits(got), bits(want), "{model}: input {i} in one request");
        let norm: f64 = got.iter().map(|&x| f64::from(x).powi(2)).sum();
        assert!((norm - 1.0).abs() < 1e-5, "not a unit vector: {norm}");
    }
    let (b64, _) = openai(&addr, model, json!(all), "base64");
    assert_eq!(
        b64.iter().map(|v| bits(v)).collect::<Vec<_>>(),
        together.iter().map(|v| bits(v)).collect::<Vec<_>>(),
        "{model}: base64 and float differ"
    );

    // Each alone, and all at once from several clients (they share passes).
    let alone: Vec<Vec<f32>> = texts
        .iter()
        .map(|t| openai(&addr, model, json!(t), "float").0.remove(0))
        .collect();
    let concurrent: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = texts
            .iter()
            .map(|t| {
                let addr = &addr;
                s.spawn(move || openai(addr, model, json!(t), "float").0.remove(0))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for i in 0..texts.len() {
        assert_eq!(
            bits(&alone[i]),
            bits(&want.normalized[i]),
            "{model}: {i} alone"
        );
        assert_eq!(
            bits(&concurrent[i]),
            bits(&want.normalized[i]),
            "{model}: {i} at once"
        );
    }

    // Token ids are run as given.
    let ids: Vec<Value> = want.tokens.iter().map(|t| json!(t)).collect();
    let (by_ids, _) = openai(&addr, model, json!(ids), "float");
    assert_eq!(
        bits(&by_ids[1]),
        bits(&want.normalized[1]),
        "{model}: token ids"
    );

    // Ollama's /api/embed: unit vectors; /api/embeddings: the pooled vector as is.
    let r = post(&addr, "/api/embed", &json!({"model": model, "input": all}));
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    assert_eq!(body["prompt_eval_count"], total, "{body}");
    for (i, v) in body["embeddings"].as_array().unwrap().iter().enumerate() {
        assert_eq!(
            bits(&floats(v)),
            bits(&want.normalized[i]),
            "{model}: /api/embed {i}"
        );
    }
    let r = post(
        &addr,
        "/api/embeddings",
        &json!({"model": model, "prompt": texts[0]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        bits(&floats(&r.json()["embedding"])),
        bits(&want.raw[0]),
        "{model}: /api/embeddings"
    );
}

#[test]
fn served_embeddings_equal_the_engine_in_one_process_stories260k() {
    served_equals_reference(&model_path("stories260K.gguf"), "stories260K");
}

#[test]
fn served_embeddings_equal_the_engine_in_one_process_small_qwen3() {
    served_equals_reference(
        &model_path("test/small-qwen3-Q8_0.gguf"),
        "small-qwen3-Q8_0",
    );
}

/// A 400 naming `param`, whose message contains `says`.
fn refused(r: &common::Response, param: &str, says: &str) {
    assert_eq!(r.status, 400, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["param"], param, "{e}");
    let message = e["message"].as_str().unwrap();
    assert!(message.contains(says), "{message:?} does not say {says:?}");
}

#[test]
fn embedding_limits_and_unhonoured_parameters_are_refused_naming_them() {
    let server = Server::start(&[]);
    let addr = server.addr.clone();
    let ask = |body: Value| post(&addr, "/v1/embeddings", &body);
    let m = "stories260K";

    // The table's limits (crates/tessera-gateway/src/limits.rs): 2048 inputs, 65,536 tokens.
    let many = vec![json!("a"); 2049];
    refused(&ask(json!({"model": m, "input": many})), "input", "2048");
    let full = vec![json!(vec![100u32; 500]); 132];
    refused(&ask(json!({"model": m, "input": full})), "input", "65536");
    // Each input within the context (512 positions).
    let r = ask(json!({"model": m, "input": [vec![100u32; 513]]}));
    refused(&r, "input", "512");
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    // Never accepted and ignored.
    refused(
        &ask(json!({"model": m, "input": "a", "dimensions": 8})),
        "dimensions",
        "dimensions",
    );
    refused(
        &ask(json!({"model": m, "input": "a", "encoding_format": "int8"})),
        "encoding_format",
        "int8",
    );
    refused(&ask(json!({"model": m, "input": ""})), "input", "empty");
    refused(
        &ask(json!({"model": m, "input": [99999]})),
        "input",
        "vocabulary",
    );
    let r = ask(json!({"model": "other", "input": "a"}));
    assert_eq!(r.status, 404, "{}", r.body);

    // Ollama: too long is cut to the context unless truncate is false.
    let long = "word ".repeat(600);
    let r = post(&addr, "/api/embed", &json!({"model": m, "input": long}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["prompt_eval_count"], 512);
    let r = post(
        &addr,
        "/api/embed",
        &json!({"model": m, "input": long, "truncate": false}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = post(
        &addr,
        "/api/embed",
        &json!({"model": m, "input": "a", "options": {"temperature": 0.5}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"].as_str().unwrap().contains("temperature"));
    let r = post(
        &addr,
        "/api/embed",
        &json!({"model": m, "input": vec!["a"; 2049]}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"].as_str().unwrap().contains("2048"));
    // Still serving after every refusal.
    let r = post(&addr, "/api/embed", &json!({"model": m, "input": "a"}));
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Large embedding requests do not hold generation back until they end: the engine runs one
/// bounded embedding pass between generation steps, so a chat sent while ~80 passes are
/// queued (it needs about ten steps) finishes before they do (an order of events, not a
/// timing).
#[test]
fn a_chat_finishes_while_large_embedding_requests_run() {
    let server = Server::start(&[]);
    let addr = server.addr.clone();
    let done = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let big: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    // 20 inputs of 500 tokens: 10,000 tokens, about 40 passes of 256 rows.
                    let input = vec![json!(vec![100u32; 500]); 20];
                    let body = json!({"model": "stories260K", "input": input});
                    let r = post(&addr, "/v1/embeddings", &body);
                    done.fetch_add(1, Ordering::SeqCst);
                    r
                })
            })
            .collect();
        // The passes have begun once the engine counts their rows as prompt tokens.
        wait_for("embedding passes", Duration::from_secs(300), || {
            metric(&addr, "tessera_prompt_tokens_total") > 0.0
        });
        let chat = json!({"model": "stories260K", "max_tokens": 8, "temperature": 0,
                          "messages": [{"role": "user", "content": "Once upon a time"}]});
        let r = post(&addr, "/v1/chat/completions", &chat);
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.json()["usage"]["completion_tokens"].as_u64().unwrap() > 0);
        assert!(
            done.load(Ordering::SeqCst) < 2,
            "the chat waited for every embedding request to finish"
        );
        for h in big {
            let r = h.join().unwrap();
            assert_eq!(r.status, 200, "{}", r.body);
            assert_eq!(r.json()["data"].as_array().unwrap().len(), 20);
        }
    });
}
