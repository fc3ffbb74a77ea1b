//! Speculative decoding through the API: `tessera serve --speculate …` as a real process answers
//! every request with the same text, log-probabilities and finish reasons as a server without
//! speculation — greedy and seeded, with stop strings, under a JSON schema, alone and in a
//! batch — and `/metrics` shows that drafts were accepted. Flags that would be ignored are
//! refused.

mod common;

use std::process::Command;

use common::{metric, model_path, post, Server};
use serde_json::{json, Value};

/// A paragraph given twice and begun again: prompt lookup has something to copy.
const COPY: &str = "Lily had a red ball. She liked to play with it in the park every day. \
    Lily had a red ball. She liked to play with it in the park every day. Lily had a red";

fn requests() -> Vec<(&'static str, &'static str, Value)> {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "pet": {"enum": ["cat", "dog", "bird"]}
        },
        "required": ["name", "pet"],
        "additionalProperties": false
    });
    vec![
        (
            "greedy completion with logprobs",
            "/v1/completions",
            json!({"model": "stories260K", "prompt": COPY, "max_tokens": 48,
                   "temperature": 0, "logprobs": 3}),
        ),
        (
            "seeded completion with logprobs",
            "/v1/completions",
            json!({"model": "stories260K", "prompt": COPY, "max_tokens": 48,
                   "temperature": 0.9, "seed": 11, "logprobs": 2}),
        ),
        (
            "seeded completion with a stop string",
            "/v1/completions",
            json!({"model": "stories260K", "prompt": COPY, "max_tokens": 64,
                   "temperature": 0.7, "seed": 3, "stop": ["park"]}),
        ),
        (
            "seeded chat under a JSON schema",
            "/v1/chat/completions",
            json!({"model": "stories260K",
                   "messages": [{"role": "user", "content": "Lily and her dog. Lily and her"}],
                   "max_tokens": 60, "temperature": 0.9, "seed": 5, "logprobs": true,
                   "top_logprobs": 2,
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": schema}}}),
        ),
        (
            "greedy chat",
            "/v1/chat/completions",
            json!({"model": "stories260K",
                   "messages": [{"role": "user", "content": COPY}],
                   "max_tokens": 40, "temperature": 0}),
        ),
    ]
}

/// The parts of each answer that must not depend on speculation.
fn answers(addr: &str, concurrent: bool) -> Vec<Value> {
    let ask = |(what, path, body): &(&str, &str, Value)| {
        let r = post(addr, path, body);
        assert_eq!(r.status, 200, "{what}: {}", r.body);
        let v = r.json();
        json!({"what": what, "choices": v["choices"],
               "completion_tokens": v["usage"]["completion_tokens"]})
    };
    let reqs = requests();
    if !concurrent {
        return reqs.iter().map(ask).collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = reqs.iter().map(|r| s.spawn(move || ask(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn speculation_keeps_every_answer_and_reports_its_acceptance() {
    let plain = Server::start(&[]);
    let expected = answers(&plain.addr, false);
    drop(plain);
    let stories = model_path("stories260K.gguf");
    for flags in [
        vec!["--speculate", "lookup", "--draft-max", "6"],
        // The model as its own draft: every greedy draft agrees.
        vec!["--draft-model", stories.as_str(), "--draft-max", "4"],
    ] {
        let server = Server::start(&flags);
        let alone = answers(&server.addr, false);
        for (a, e) in alone.iter().zip(&expected) {
            assert_eq!(a, e, "{flags:?}: differs from plain decoding");
        }
        // Together in one batch: sequences of different k share forward passes.
        let together = answers(&server.addr, true);
        assert_eq!(together, expected, "{flags:?}: differs in a batch");
        let drafted = metric(&server.addr, "tessera_speculation_draft_tokens_total");
        let accepted = metric(&server.addr, "tessera_speculation_accepted_tokens_total");
        let rate = metric(&server.addr, "tessera_speculation_acceptance_rate");
        assert!(
            drafted > 0.0 && accepted > 0.0,
            "{flags:?}: {drafted} {accepted}"
        );
        assert!((rate - accepted / drafted).abs() < 1e-3, "{rate}");
    }
}

/// Chat's `prediction` (OpenAI's predicted outputs) on a server started without speculation:
/// the answer's own text predicted is drafted from and accepted, a wrong prediction costs only
/// rejected drafts, and either way the choices (text, log-probabilities, finish reason) are
/// those without it — greedy, seeded and under a JSON schema. A prediction of another shape is
/// a 400 naming it.
#[test]
fn a_prediction_changes_no_answer_and_the_right_one_is_accepted() {
    let server = Server::start(&[]);
    let chat = |body: &Value| {
        let r = post(&server.addr, "/v1/chat/completions", body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let bodies: Vec<Value> = requests()
        .into_iter()
        .filter(|(_, path, _)| *path == "/v1/chat/completions")
        .map(|(_, _, body)| body)
        .chain([json!({"model": "stories260K",
                       "messages": [{"role": "user", "content": COPY}],
                       "max_tokens": 40, "temperature": 0.8, "seed": 2,
                       "logprobs": true, "top_logprobs": 2})])
        .collect();
    assert_eq!(bodies.len(), 3);
    for body in bodies {
        let plain = chat(&body);
        let text = plain["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let before = metric(&server.addr, "tessera_speculation_accepted_tokens_total");
        // As OpenAI's client sends it: a string, or text parts.
        for prediction in [
            json!({"type": "content", "content": [{"type": "text", "text": text}]}),
            json!({"type": "content", "content": "Tom saw a big green frog in the pond."}),
        ] {
            let mut asked = body.clone();
            asked["prediction"] = prediction.clone();
            let got = chat(&asked);
            assert_eq!(got["choices"], plain["choices"], "{prediction}");
        }
        let accepted = metric(&server.addr, "tessera_speculation_accepted_tokens_total");
        assert!(
            accepted > before,
            "{body}: no draft of the right prediction was accepted"
        );
    }
    for bad in [
        json!({"type": "text", "content": "x"}),
        json!({"type": "content", "content": 5}),
        json!({"type": "content", "content": [{"type": "image_url"}]}),
    ] {
        let r = post(
            &server.addr,
            "/v1/chat/completions",
            &json!({"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}],
                    "prediction": bad}),
        );
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], "prediction", "{bad}");
    }
}

/// `tessera generate` in one process prints the same text with and without speculation.
#[test]
fn generate_prints_the_same_text_with_speculation() {
    let stories = model_path("stories260K.gguf");
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args([
                "generate",
                "-m",
                stories.as_str(),
                "-p",
                COPY,
                "-n",
                "60",
                "-t",
                "1",
            ])
            .args(extra)
            .env("TESSERA_LOG", "warn")
            .output()
            .expect("running tessera generate");
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    for sampling in [&["--temperature", "0"][..], &["--seed", "9"][..]] {
        let plain = run(sampling);
        for spec in [
            &["--speculate", "lookup"][..],
            &["--draft-model", stories.as_str(), "--draft-max", "3"][..],
        ] {
            let args: Vec<&str> = sampling.iter().chain(spec).copied().collect();
            assert_eq!(run(&args), plain, "{args:?}");
        }
    }
}

#[test]
fn speculation_flags_are_refused_where_they_would_be_ignored() {
    let stories = model_path("stories260K.gguf");
    for (args, says) in [
        (vec!["--speculate", "draft"], "needs --draft-model"),
        (
            vec!["--speculate", "lookup", "--draft-model", stories.as_str()],
            "only used with --speculate draft",
        ),
        (vec!["--draft-max", "4"], "--draft-max needs"),
        (
            vec![
                "--speculate",
                "draft",
                "--draft-model",
                stories.as_str(),
                "--nodes-expected",
                "2",
            ],
            "speculates by prompt lookup",
        ),
        (
            vec![
                "--speculate",
                "lookup",
                "--draft-max",
                "17",
                "--nodes-expected",
                "2",
            ],
            "at most 16",
        ),
        (
            vec!["--speculate", "lookup", "--sealed-via", "127.0.0.1:1"],
            "sealed jobs do not speculate",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(&args)
            .output()
            .expect("running tessera serve");
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
