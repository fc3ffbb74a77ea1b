//! `tessera up` end to end: one command starts a coordinator, the gateway and three node
//! processes on loopback; the tests drive it over real sockets with the official OpenAI client,
//! a bare HTTP client and headless Chromium, then stop it with SIGINT and check that every node
//! process is gone.
//!
//! Clusters are started one at a time (a lock), each in its own run directory, and killed on
//! drop (the nodes too: `tessera up` is asked to stop, and the test kills any pid it printed).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::up::{alive, Up};
use common::{
    dashboard_dom, get, metric, metric_samples, model_path, openai_client_available, post,
    screenshot, send, stream_until, streamed_chat, wait_for, CHROMIUM,
};

/// One cluster at a time: each is four processes on a small machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn run_openai_script(url: &str) {
    if !openai_client_available() {
        eprintln!("skipping the openai client check: python3 with `openai` is not available");
        return;
    }
    common::run_openai_script(url);
    run_agent_api_scripts(url);
}

/// What agents and apps use, through the ring: tools, grammar-constrained output, logprobs,
/// n > 1, every parameter honoured or refused by name (`api_features.py`); Anthropic Messages
/// and the Responses API (`anthropic_api.py`); issue 36's API fixes (`api_fixes.py`); Ollama's
/// API (`ollama_api.py`); embeddings refused with a 501 on both (`embeddings_api.py`); an
/// OpenAI Agents SDK agent with a tool (`agents_sdk.py`).
fn run_agent_api_scripts(url: &str) {
    if !common::python_modules_available(&["openai", "jsonschema", "anthropic"]) {
        eprintln!("skipping the agent API checks: python3 with `openai`, `jsonschema` and `anthropic` is not available");
        return;
    }
    common::run_python_script("api_features.py", &[url, "cluster"]);
    common::run_python_script("anthropic_api.py", &[url]);
    // A loopback page's origin: the cluster is started without --cors-origin.
    common::run_python_script("api_fixes.py", &[url, "http://localhost:5173"]);
    if common::python_modules_available(&["ollama"]) {
        common::run_python_script("ollama_api.py", &[url, "cluster"]);
        common::run_python_script("embeddings_api.py", &[url, "cluster"]);
    }
    if common::python_modules_available(&["agents"]) {
        common::run_python_script("agents_sdk.py", &[url, "cluster"]);
    }
    if common::python_modules_available(&["pydantic_ai"]) {
        common::run_python_script("agent_loop.py", &[url]);
    }
}

fn concurrent_streams_match_alone(addr: &str) {
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
    let alone: Vec<(String, String)> = (0..32).map(|i| streamed_chat(addr, &request(i))).collect();
    assert!(alone.iter().all(|(t, _)| !t.is_empty()));
    let steps0 = metric(addr, "tessera_steps_total");
    let tokens0 = metric(addr, "tessera_generated_tokens_total");
    let t0 = Instant::now();
    let together: Vec<(String, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..32)
            .map(|i| {
                let req = request(i);
                s.spawn(move || streamed_chat(addr, &req))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let elapsed = t0.elapsed();
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(
            a, t,
            "request {i}: batched output differs from the same request alone"
        );
    }
    // Batching: stage 0's frame accounting bounds the ring steps taken from above.
    let steps = metric(addr, "tessera_steps_total") - steps0;
    let tokens = metric(addr, "tessera_generated_tokens_total") - tokens0;
    eprintln!(
        "32 concurrent streams over 3 nodes: {tokens} tokens in at most {steps} ring steps, \
         {:.2}s",
        elapsed.as_secs_f64()
    );
    assert!(
        steps < tokens,
        "{tokens} tokens took {steps} ring steps: nothing was batched"
    );
}

fn dashboard_shows_the_cluster(addr: &str) {
    if !Path::new(CHROMIUM).exists() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI must install chromium (apt-get install -y chromium)"
        );
        eprintln!("skipping the dashboard check: {CHROMIUM} is not installed");
        return;
    }
    let status = get(addr, "/api/status", None).json();
    let nodes: Vec<String> = status["cluster"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(nodes.len(), 3, "{status}");
    let plan = &status["cluster"]["plan"];
    let epoch = plan["epoch"].as_u64().unwrap();
    assert_eq!(plan["assignments"].as_array().unwrap().len(), 3, "{plan}");
    assert_eq!(plan["strategy"], "stage split");
    let profile = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chromium-profile-up");
    let url = format!("http://{addr}/");
    dashboard_dom(&profile, &url, &nodes, epoch);
    let shot = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/dashboard-up.png");
    screenshot(&profile, &url, &shot);
}

fn sigint_stops_everything(up: &mut Up) {
    for &p in &up.node_pids {
        assert!(alive(p), "node {p} is not running before the stop");
    }
    let ok = Command::new("kill")
        .args(["-INT", &up.proc.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = up.proc.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "tessera up did not exit on SIGINT"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "tessera up exited with {status}");
    for &p in &up.node_pids {
        assert!(!alive(p), "node process {p} outlived tessera up");
    }
}

#[test]
fn one_command_cluster_serves_openai_batches_shows_dashboard_and_stops_on_ctrl_c() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut up = Up::start(&[]);
    assert!(
        up.proc
            .announced("sample", "text")
            .starts_with("Once upon a time"),
        "no sample completion"
    );
    let url = up.url();
    let addr = up.addr.clone();
    // The plan and every node in /health-style status before any traffic.
    let status = get(&addr, "/api/status", None).json();
    assert!(status["cluster"]["not_serving"].is_null(), "{status}");
    run_openai_script(&url);
    concurrent_streams_match_alone(&addr);
    dashboard_shows_the_cluster(&addr);
    sigint_stops_everything(&mut up);
}

/// The agent API on a synthetic qwen3 split over a 2-stage ring: the sampling stage (the
/// second node) applies the grammars and reports the log-probabilities.
#[test]
fn agent_api_works_through_a_two_stage_ring_of_synthetic_qwen3() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let model = model_path("test/small-qwen3-Q8_0.gguf");
    let up = Up::start_nodes(2, &["--model", &model, "--no-sample"]);
    let status = get(&up.addr, "/api/status", None).json();
    let plan = &status["cluster"]["plan"];
    assert_eq!(plan["assignments"].as_array().unwrap().len(), 2, "{plan}");
    assert_eq!(plan["strategy"], "stage split", "{plan}");
    run_agent_api_scripts(&up.url());
    constrained_output_is_the_same_alone_and_in_a_batch_of_16(&up.addr, "small-qwen3-Q8_0");
}

/// The sampling stage masks each sequence with its own grammar: a constrained request's output
/// does not depend on what shares its ring steps.
fn constrained_output_is_the_same_alone_and_in_a_batch_of_16(addr: &str, model: &str) {
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
            "model": model,
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
    let alone: Vec<(String, String)> = (0..16).map(|i| streamed_chat(addr, &request(i))).collect();
    for (text, finish) in &alone {
        let v: serde_json::Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {text:?} ({finish})"));
        assert!(v["age"].as_u64().is_some_and(|a| a < 100), "{v}");
        assert_eq!(finish, "stop");
    }
    let together: Vec<(String, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let req = request(i);
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
fn a_client_that_disconnects_mid_stream_frees_kv_on_every_stage() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    // Runs to the length limit at temperature 0, so the stream is still going when we leave.
    let model = model_path("test/small-qwen3moe-Q8_0.gguf");
    let up = Up::start(&[
        "--model",
        &model,
        "--no-sample",
        "--max-batch",
        "2",
        "--max-queue",
        "1",
    ]);
    let addr = up.addr.clone();
    let per_node = || metric_samples(&addr, "tessera_node_kv_bytes");
    let baseline = per_node();
    assert_eq!(baseline.len(), 3, "{baseline:?}");
    assert!(baseline.iter().all(|(_, v)| *v == 0.0), "{baseline:?}");
    let body = serde_json::json!({
        "model": "small-qwen3moe-Q8_0",
        "prompt": "Once upon a time",
        "temperature": 0,
        "max_tokens": 400,
        "stream": true,
    })
    .to_string();
    let r = stream_until(&addr, "/v1/completions", &body, 3);
    // Mid-stream: every stage holds KV for the sequence.
    let during = per_node();
    assert!(during.iter().all(|(_, v)| *v > 0.0), "{during:?}");
    assert_eq!(metric(&addr, "tessera_active_sequences"), 1.0);
    drop(r);
    wait_for(
        "KV to return to baseline on every stage",
        Duration::from_secs(20),
        || {
            metric(&addr, "tessera_active_sequences") == 0.0
                && per_node() == baseline
                && metric(&addr, "tessera_kv_cache_bytes") == 0.0
        },
    );
    assert_eq!(metric(&addr, "tessera_cancelled_total"), 1.0);
    // Still serving.
    let r = post(
        &addr,
        "/v1/completions",
        &serde_json::json!({"model": "small-qwen3moe-Q8_0", "prompt": "Hi", "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Admission: two running, one waiting, the next is refused with 429 and Retry-After.
    let streams: Vec<_> = (0..3)
        .map(|_| send(&addr, "POST", "/v1/completions", Some(&body), None))
        .collect();
    wait_for(
        "two running and one queued",
        Duration::from_secs(20),
        || {
            metric(&addr, "tessera_active_sequences") == 2.0
                && metric(&addr, "tessera_queue_depth") == 1.0
        },
    );
    let r = post(
        &addr,
        "/v1/completions",
        &serde_json::json!({"model": "small-qwen3moe-Q8_0", "prompt": "Hi", "max_tokens": 4}),
    );
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.header("retry-after").is_some());
    drop(streams);
    let mut last = (f64::NAN, f64::NAN, Vec::new());
    let freed = (0..300).any(|_| {
        last = (
            metric(&addr, "tessera_active_sequences"),
            metric(&addr, "tessera_queue_depth"),
            per_node(),
        );
        let done = last.0 == 0.0 && last.2 == baseline;
        if !done {
            std::thread::sleep(Duration::from_millis(100));
        }
        done
    });
    assert!(
        freed,
        "every stage to free the cancelled sequences: active, queued, KV per node = {last:?}"
    );
}

#[test]
fn distributed_serve_says_why_it_is_not_serving_until_nodes_join() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["serve", "--listen", "127.0.0.1:0", "--nodes-expected", "2"])
        .args(["--coordinator-listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .env("TESSERA_LOG", "warn")
        .env(common::JSON_LOGS.0, common::JSON_LOGS.1)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting tessera serve");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut addr = None;
    let mut join = None;
    for l in lines.by_ref().map_while(Result::ok) {
        if let Some(e) = common::event_in(&l, &[("event", "join_token")]) {
            join = e["token"].as_str().map(str::to_string);
        }
        if let Some(e) = common::event_in(&l, &[("event", "listening")]) {
            addr = e["addr"].as_str().map(str::to_string);
            break;
        }
    }
    // Keep draining stdout so the server never writes to a closed pipe.
    std::thread::spawn(move || lines.for_each(drop));
    let addr = addr.expect("a listen line");
    assert!(
        join.is_some_and(|j| j.contains('@')),
        "no join token printed"
    );
    let r = post(
        &addr,
        "/v1/completions",
        &serde_json::json!({"model": "stories260K", "prompt": "Hi", "max_tokens": 4}),
    );
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("waiting for nodes"), "{}", r.body);
}

/// Prefix reuse on a 2-stage ring through the API: a chat's second turn re-sends the first,
/// both stages start from the caches they kept (`cached_tokens`), the answers equal one
/// process's without reuse, and `/metrics` and the dashboard count the reused tokens.
#[test]
fn a_rings_second_chat_turn_reuses_the_kept_prefix_and_answers_as_one_process() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let up = Up::start_nodes(2, &["--no-sample"]);
    let plan = &get(&up.addr, "/api/status", None).json()["cluster"]["plan"];
    assert_eq!(plan["assignments"].as_array().unwrap().len(), 2, "{plan}");
    let a = common::http::two_turn_chat(&up.addr, "stories260K");
    let ([p1, p2], [c1, c2]) = (a.prompt, a.cached);
    assert_eq!(c1, 0, "nothing was kept before the first turn");
    assert!(
        c2 + 4 >= p1 && c2 < p2,
        "cached {c2} of {p2}; the first prompt was {p1}"
    );
    assert_eq!(
        metric(&up.addr, "tessera_prompt_cached_tokens_total"),
        c2 as f64
    );
    let page = get(&up.addr, "/", None);
    assert!(
        page.body.contains(&format!("{c2} prompt tokens reused")),
        "the dashboard does not show the reused tokens"
    );
    let plain = common::Server::start(&["--prefix-cache", "0"]);
    let b = common::http::two_turn_chat(&plain.addr, "stories260K");
    assert_eq!(b.cached[1], 0);
    assert_eq!(
        (b.prompt[1], &b.first, &b.second),
        (p2, &a.first, &a.second),
        "reuse changed the answer"
    );
}

/// Speculation on a ring through the API (`tessera up --speculate 4`): completions that copy
/// their prompt give the text and log-probabilities of one process without speculation,
/// greedy and seeded.
#[test]
fn a_speculating_ring_answers_through_the_api_as_one_process() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let up = Up::start_nodes(2, &["--no-sample", "--speculate", "4"]);
    let plain = common::Server::start(&[]);
    let prompt = "Once upon a time, there was a little girl named Lily. She liked to play \
                  outside. Once upon a time, there was a little";
    for sampling in [
        serde_json::json!({"temperature": 0}),
        serde_json::json!({"temperature": 0.8, "seed": 5}),
    ] {
        let mut body = serde_json::json!({"model": "stories260K", "prompt": prompt,
                                          "max_tokens": 40, "logprobs": 2});
        for (k, v) in sampling.as_object().unwrap() {
            body[k] = v.clone();
        }
        let answer = |addr: &str| {
            let r = post(addr, "/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()["choices"][0].clone()
        };
        let (ring, one) = (answer(&up.addr), answer(&plain.addr));
        assert_eq!(ring["text"], one["text"], "{sampling}");
        assert!(one["logprobs"]["token_logprobs"].is_array(), "{one}");
        assert_eq!(ring["logprobs"], one["logprobs"], "{sampling}");
    }
    // The ring did speculate, and `/metrics` says how well.
    let accepted = metric(&up.addr, "tessera_speculation_accepted_tokens_total");
    assert!(accepted > 0.0, "no draft was accepted");
    assert!(metric(&up.addr, "tessera_speculation_draft_tokens_total") >= accepted);
}
