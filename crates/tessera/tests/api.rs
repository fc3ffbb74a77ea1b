//! End to end: the real `tessera serve` binary on a loopback port, driven over real sockets.
//!
//! Each test starts its own server on 127.0.0.1 port 0 (the binary prints the bound address)
//! and stops it when done. The HTTP client (`common/http.rs`) is a few lines over `TcpStream` (HTTP/1.1,
//! `Connection: close`, chunked bodies decoded), so the test adds no dependencies.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{
    cache_dir, get, metric, model_path, openai_client_available, post, python_modules_available,
    read_response, run_openai_script, run_python_script, send, stream_until, streamed_chat,
    wait_for, Response, Server,
};

#[test]
fn official_openai_client_lists_chats_streams_and_gets_errors() {
    if !openai_client_available() {
        eprintln!("skipping: python3 with the `openai` package is not available");
        return;
    }
    let server = Server::start(&[]);
    run_openai_script(&server.url());
}

#[test]
fn official_clients_use_tools_schemas_logprobs_choices_and_every_parameter() {
    if !python_modules_available(&["openai", "jsonschema"]) {
        eprintln!("skipping: python3 with `openai` and `jsonschema` is not available");
        return;
    }
    let server = Server::start(&[]);
    run_python_script("api_features.py", &[&server.url(), "serve"]);
}

#[test]
fn official_anthropic_client_messages_streams_tools_and_counts_tokens() {
    if !python_modules_available(&["anthropic", "openai", "jsonschema"]) {
        eprintln!("skipping: python3 with `anthropic` is not available");
        return;
    }
    let server = Server::start(&[]);
    run_python_script("anthropic_api.py", &[&server.url()]);
}

/// Issue 36's API defects, each through the official client: parameters that ask for nothing,
/// llama.cpp's spellings, the Responses echo, a forced call cut by `max_tokens`, assistant
/// prefill and CORS.
#[test]
fn api_defects_are_fixed_through_the_official_clients() {
    if !python_modules_available(&["openai", "anthropic"]) {
        eprintln!("skipping: python3 with `openai` and `anthropic` is not available");
        return;
    }
    let origin = "https://app.example.com";
    let server = Server::start(&["--cors-origin", origin]);
    run_python_script("api_fixes.py", &[&server.url(), origin]);
}

#[test]
fn the_openai_agents_sdk_runs_an_agent_with_a_tool_through_responses() {
    if !python_modules_available(&["agents", "openai"]) {
        eprintln!("skipping: python3 with `openai-agents` is not available");
        return;
    }
    let server = Server::start(&[]);
    run_python_script("agents_sdk.py", &[&server.url(), "serve"]);
}

#[test]
fn official_ollama_client_chats_generates_lists_and_uses_tools_and_formats() {
    if !python_modules_available(&["ollama", "jsonschema"]) {
        eprintln!("skipping: python3 with `ollama` and `jsonschema` is not available");
        return;
    }
    let server = Server::start(&[]);
    run_python_script("ollama_api.py", &[&server.url(), "serve"]);
}

/// `client.embeddings.create` and `ollama.embed` against `tessera serve`.
#[test]
fn official_clients_get_embeddings() {
    if !python_modules_available(&["openai", "ollama"]) {
        eprintln!("skipping: python3 with `openai` and `ollama` is not available");
        return;
    }
    let server = Server::start(&[]);
    run_python_script("embeddings_api.py", &[&server.url(), "serve"]);
}

#[test]
fn an_agent_framework_drives_a_tool_loop() {
    if !python_modules_available(&["pydantic_ai", "openai"]) {
        eprintln!("skipping: python3 with `pydantic-ai` is not available");
        return;
    }
    let server = Server::start(&[]);
    run_python_script("agent_loop.py", &[&server.url()]);
}

#[test]
fn json_schema_output_is_the_same_alone_and_in_a_batch_of_16() {
    let server = Server::start(&["--max-batch", "16"]);
    let addr = server.addr.clone();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "pet": {"enum": ["cat", "dog", "bird"]}
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": false
    });
    let request = |i: usize| {
        serde_json::json!({
            "model": "stories260K",
            "messages": [{"role": "user", "content": format!("Person number {i}, who likes {}.",
                ["dogs", "cats", "birds", "trees"][i % 4])}],
            "temperature": if i.is_multiple_of(2) { 0.0 } else { 0.9 },
            "seed": i,
            "max_tokens": 80,
            "stream": true,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": schema, "strict": true}},
        })
    };
    let alone: Vec<(String, String)> = (0..16).map(|i| streamed_chat(&addr, &request(i))).collect();
    for (text, finish) in &alone {
        let v: serde_json::Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {text:?} ({finish})"));
        assert!(v["age"].as_u64().is_some_and(|a| a < 100), "{v}");
        assert_eq!(finish, "stop");
    }
    let together: Vec<(String, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let (addr, req) = (&addr, request(i));
                s.spawn(move || streamed_chat(addr, &req))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        alone, together,
        "constrained output differs alone and in a batch of 16"
    );
}

#[test]
fn thirty_two_concurrent_streams_each_match_the_request_run_alone() {
    let server = Server::start(&["--max-batch", "16"]);
    let addr = server.addr.clone();
    let request = |i: usize| {
        serde_json::json!({
            "model": "stories260K",
            "messages": [{"role": "user", "content": format!("Story number {i} about a {}.",
                ["dog", "cat", "bird", "tree"][i % 4])}],
            "temperature": 0,
            "max_tokens": 40 + (i % 5) * 8,
            "stream": true,
        })
    };
    let alone: Vec<(String, String)> = (0..32).map(|i| streamed_chat(&addr, &request(i))).collect();
    assert!(alone.iter().all(|(t, _)| !t.is_empty()));
    let steps0 = metric(&addr, "tessera_steps_total");
    let tokens0 = metric(&addr, "tessera_generated_tokens_total");
    let together: Vec<(String, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..32)
            .map(|i| {
                let addr = &addr;
                let req = request(i);
                s.spawn(move || streamed_chat(addr, &req))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(
            a, t,
            "request {i}: batched output differs from the same request alone"
        );
    }
    // Continuous batching: fewer forward steps than tokens generated.
    let steps = metric(&addr, "tessera_steps_total") - steps0;
    let tokens = metric(&addr, "tessera_generated_tokens_total") - tokens0;
    eprintln!("32 concurrent streams: {tokens} tokens in {steps} steps");
    assert!(
        steps < tokens,
        "{tokens} tokens took {steps} steps: nothing was batched"
    );
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_kv() {
    // A model that runs to the context limit at temperature 0 (no end-of-generation token), so
    // the stream is still going when the client leaves.
    let model = model_path("test/small-qwen3moe-Q8_0.gguf");
    let server = Server::start(&["--model", &model, "--threads", "1"]);
    let addr = server.addr.clone();
    assert_eq!(metric(&addr, "tessera_kv_cache_bytes"), 0.0);
    let body = serde_json::json!({
        "model": "small-qwen3moe-Q8_0",
        "prompt": "Once upon a time",
        "temperature": 0,
        "max_tokens": 500,
        "stream": true,
    })
    .to_string();
    let r = stream_until(&addr, "/v1/completions", &body, 2);
    // Mid-stream: the sequence holds KV now.
    let m = get(&addr, "/metrics", None).body;
    assert!(m.contains("\ntessera_active_sequences 1\n"), "{m}");
    assert!(!m.contains("\ntessera_kv_cache_bytes 0\n"), "{m}");
    drop(r);
    wait_for(
        "the sequence to be dropped",
        Duration::from_secs(10),
        || {
            metric(&addr, "tessera_active_sequences") == 0.0
                && metric(&addr, "tessera_kv_cache_bytes") == 0.0
        },
    );
    assert_eq!(metric(&addr, "tessera_cancelled_total"), 1.0);
    // The server still serves.
    let r = post(
        &addr,
        "/v1/completions",
        &serde_json::json!({"model": "small-qwen3moe-Q8_0", "prompt": "Hi", "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn a_full_queue_is_429_with_retry_after() {
    // Runs to max_tokens (no end-of-generation token at temperature 0): the slot stays busy.
    let model = model_path("test/small-qwen3moe-Q8_0.gguf");
    let server = Server::start(&[
        "--model",
        &model,
        "--threads",
        "1",
        "--max-batch",
        "1",
        "--max-queue",
        "1",
    ]);
    let addr = server.addr.clone();
    let body = serde_json::json!({
        "model": "small-qwen3moe-Q8_0", "prompt": "Once upon a time", "temperature": 0,
        "max_tokens": 400,
    });
    let responses: Vec<Response> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|_| s.spawn(|| post(&addr, "/v1/completions", &body)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok = responses.iter().filter(|r| r.status == 200).count();
    let limited: Vec<&Response> = responses.iter().filter(|r| r.status == 429).collect();
    assert_eq!(ok + limited.len(), 8, "only 200 and 429 expected");
    // The first is running or queued when the rest arrive (the engine may not have taken it
    // into the batch yet, so it can be the one holding the queue place).
    assert!(ok >= 1, "the running request completes");
    assert!(
        !limited.is_empty(),
        "8 requests on 1 slot and 1 queue place: some must be refused"
    );
    for r in limited {
        assert_eq!(r.header("retry-after"), Some("1"));
        let e = r.json();
        assert_eq!(e["error"]["code"], "rate_limit_exceeded", "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains("queue"));
    }
}

#[test]
fn a_prompt_longer_than_the_context_is_400() {
    let server = Server::start(&["--ctx", "64"]);
    // Over 16 KiB: tokenized off the async workers.
    let long = "Once upon a time there was a little dog. ".repeat(500);
    let r = post(
        &server.addr,
        "/v1/completions",
        &serde_json::json!({"model": "stories260K", "prompt": long}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let e = r.json();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length is 64"));
    // Fits the prompt, but not the completion asked for.
    let r = post(
        &server.addr,
        "/v1/chat/completions",
        &serde_json::json!({"model": "stories260K", "max_tokens": 60,
                            "messages": [{"role": "user", "content": "Hello there"}]}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
}

#[test]
fn malformed_and_unknown_model_requests_get_openai_errors() {
    let server = Server::start(&[]);
    let r = read_response(send(
        &server.addr,
        "POST",
        "/v1/chat/completions",
        Some("{oops"),
        None,
    ));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = post(
        &server.addr,
        "/v1/chat/completions",
        &serde_json::json!({"model": "stories260K", "messages": [{"role": "user", "content": 5}]}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = post(
        &server.addr,
        "/v1/chat/completions",
        &serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    let r = get(&server.addr, "/v1/nothing-here", None);
    assert_eq!(r.status, 404);
    assert!(r.json()["error"]["message"].is_string());
    // Stop strings end the text before them, with finish_reason "stop".
    let r = post(
        &server.addr,
        "/v1/completions",
        &serde_json::json!({"model": "stories260K", "prompt": "Once upon a time",
                            "temperature": 0, "max_tokens": 60, "stop": ["."]}),
    );
    let v = r.json();
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(!text.contains('.'), "{text:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn health_and_metrics_describe_the_served_plan() {
    let server = Server::start(&[]);
    let h = get(&server.addr, "/health", None);
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["plan_epoch"], 1);
    let m = get(&server.addr, "/metrics", None);
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    for name in [
        "tessera_tokens_per_second",
        "tessera_time_to_first_token_seconds_bucket",
        "tessera_queue_depth",
        "tessera_node_memory_used_bytes{node=\"local\"",
        "tessera_plan_epoch 1",
        "tessera_kv_cache_bytes",
    ] {
        assert!(m.body.contains(name), "/metrics lacks {name}");
    }
}

#[test]
fn the_api_key_guards_everything_but_health() {
    let server = Server::start(&["--api-key", "s3cret"]);
    assert_eq!(get(&server.addr, "/v1/models", None).status, 401);
    let r = get(&server.addr, "/v1/models", Some("wrong"));
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    assert_eq!(get(&server.addr, "/v1/models", Some("s3cret")).status, 200);
    // Metrics, status and the dashboard show node addresses and recent requests: keyed too.
    for path in ["/", "/api/status", "/metrics"] {
        let r = get(&server.addr, path, None);
        assert_eq!(r.status, 401, "{path}");
        // A browser is asked for the key (as the password of a login prompt).
        assert!(
            r.header("www-authenticate")
                .is_some_and(|h| h.starts_with("Basic")),
            "{path}"
        );
        assert_eq!(
            get(&server.addr, path, Some("s3cret")).status,
            200,
            "{path}"
        );
    }
    assert_eq!(get(&server.addr, "/health", None).status, 200);
}

#[test]
fn binding_beyond_loopback_without_a_key_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["serve", "--listen", "0.0.0.0:0"])
        .env("TESSERA_CACHE_DIR", cache_dir())
        .env_remove("TESSERA_API_KEY")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("API key"), "{err}");
}

/// A chat's second turn re-sends the first: the server reuses the first turn's keys and
/// values (reported as `cached_tokens`) and prefills only the new tail, and the answer is the
/// one a server without reuse gives.
#[test]
fn a_second_turn_reuses_the_first_turns_cache_and_answers_the_same() {
    let reusing = Server::start(&[]);
    let a = common::http::two_turn_chat(&reusing.addr, "stories260K");
    let ([p1, p2], [c1, c2]) = (a.prompt, a.cached);
    assert_eq!(c1, 0, "nothing was cached before the first turn");
    assert!(p1 > 150, "a long first turn ({p1} tokens)");
    // All of the first turn's prompt (but for where the template joins the turns) was reused.
    assert!(
        c2 + 4 >= p1 && c2 < p2,
        "cached {c2} of {p2}; the first prompt was {p1}"
    );
    let plain = Server::start(&["--prefix-cache", "0"]);
    let b = common::http::two_turn_chat(&plain.addr, "stories260K");
    assert_eq!(b.cached[1], 0, "--prefix-cache 0 reuses nothing");
    assert_eq!(
        (b.prompt[1], &b.first, &b.second),
        (p2, &a.first, &a.second),
        "reuse changed the answer"
    );
}

/// One range check serves every front end: five out-of-range sampling values get the same
/// error, word for word, from OpenAI's chat and completions, Anthropic's Messages, Responses,
/// Ollama's chat and `tessera run` (which refuses before it dials the coordinator).
#[test]
fn out_of_range_sampling_gets_one_error_from_every_front_end() {
    let server = Server::start(&[]);
    let cases = [
        (
            "temperature",
            2.5,
            "Invalid 'temperature': 2.5 is not between 0 and 2.",
        ),
        (
            "temperature",
            -1.0,
            "Invalid 'temperature': -1 is not between 0 and 2.",
        ),
        ("top_p", 1.5, "Invalid 'top_p': 1.5 is not between 0 and 1."),
        (
            "top_p",
            -0.5,
            "Invalid 'top_p': -0.5 is not between 0 and 1.",
        ),
        (
            "temperature",
            1e6,
            "Invalid 'temperature': 1000000 is not between 0 and 2.",
        ),
    ];
    let user = serde_json::json!([{"role": "user", "content": "hi"}]);
    let dir = tempfile_dir("validation");
    for (param, value, want) in cases {
        let mut errors = Vec::new();
        for (path, mut body) in [
            (
                "/v1/chat/completions",
                serde_json::json!({"messages": user}),
            ),
            ("/v1/completions", serde_json::json!({"prompt": "hi"})),
            (
                "/v1/messages",
                serde_json::json!({"messages": user, "max_tokens": 4}),
            ),
            ("/v1/responses", serde_json::json!({"input": "hi"})),
            (
                "/api/chat",
                serde_json::json!({"messages": user, "stream": false}),
            ),
        ] {
            body["model"] = "stories260K".into();
            if path == "/api/chat" {
                body["options"] = serde_json::json!({ param: value });
            } else {
                body[param] = value.into();
            }
            let r = post(&server.addr, path, &body);
            assert_eq!(r.status, 400, "{path}: {}", r.body);
            let e = r.json();
            let message = e["error"]["message"]
                .as_str()
                .or_else(|| e["error"].as_str())
                .unwrap_or_else(|| panic!("{path}: no message in {e}"));
            errors.push((path, message.to_string()));
        }
        let cli = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["run", "--coordinator", "x@127.0.0.1:9", "--prompt", "hi"])
            .arg("--data-dir")
            .arg(&dir)
            .arg(format!("--{}={value}", param.replace('_', "-")))
            .output()
            .unwrap();
        assert!(!cli.status.success());
        let stderr = String::from_utf8_lossy(&cli.stderr);
        errors.push((
            "tessera run",
            stderr.trim().trim_start_matches("error: ").into(),
        ));
        for (front, got) in errors {
            assert_eq!(got, want, "{front}, {param} = {value}");
        }
    }
}

fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let d = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}
