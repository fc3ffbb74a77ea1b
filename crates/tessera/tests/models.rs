//! Several models behind one `tessera serve -m A -m B -m C`: each request runs on the model
//! its `model` field names, loaded when first asked for; under a `--models-memory` budget that
//! fits any two, asking for the third unloads the idle model used least recently; every answer
//! equals the one its model gives served alone. Ollama's `/api/ps` says what is loaded.

mod common;

use common::{get, model_path, post, Server};
use serde_json::json;

/// Three small real-format models (a llama, a dense and a mixture-of-experts qwen3).
const MODELS: [(&str, &str); 3] = [
    ("stories260K", "stories260K.gguf"),
    ("small-qwen3-Q8_0", "test/small-qwen3-Q8_0.gguf"),
    ("small-qwen3moe-Q4_K", "test/small-qwen3moe-Q4_K.gguf"),
];

fn completion(addr: &str, model: &str) -> String {
    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": model, "prompt": "Once upon a time", "max_tokens": 16,
                "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{model}: {}", r.body);
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

/// The models loaded now, by Ollama's `/api/ps`, sorted.
fn loaded(addr: &str) -> Vec<String> {
    let r = get(addr, "/api/ps", None);
    assert_eq!(r.status, 200, "{}", r.body);
    let mut names: Vec<String> = r.json()["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

fn sorted(names: [&str; 2]) -> Vec<String> {
    let mut v: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

#[test]
fn three_models_under_a_budget_for_two_unload_the_least_recently_used_and_answer_as_alone() {
    let alone: Vec<String> = MODELS
        .iter()
        .map(|(name, file)| {
            let s = Server::start(&["-m", &model_path(file)]);
            completion(&s.addr, name)
        })
        .collect();
    let sizes: Vec<u64> = MODELS
        .iter()
        .map(|(_, f)| std::fs::metadata(model_path(f)).unwrap().len())
        .collect();
    // Any two fit; all three do not.
    let budget = (sizes.iter().sum::<u64>() - 1).to_string();
    let mut args = vec!["--models-memory", &budget];
    let paths: Vec<String> = MODELS.iter().map(|(_, f)| model_path(f)).collect();
    for p in &paths {
        args.extend(["-m", p]);
    }
    let s = Server::start(&args);
    let [a, b, c] = MODELS.map(|(n, _)| n);
    assert!(
        loaded(&s.addr).is_empty(),
        "nothing loads before it is asked for"
    );
    let listed = get(&s.addr, "/v1/models", None).json();
    assert_eq!(listed["data"].as_array().unwrap().len(), 3, "{listed}");

    // Two models at once.
    let (ta, tb) = std::thread::scope(|scope| {
        let ta = scope.spawn(|| completion(&s.addr, a));
        let tb = scope.spawn(|| completion(&s.addr, b));
        (ta.join().unwrap(), tb.join().unwrap())
    });
    assert_eq!((ta, tb), (alone[0].clone(), alone[1].clone()));
    assert_eq!(loaded(&s.addr), sorted([a, b]));

    // a used last: the third unloads b.
    assert_eq!(completion(&s.addr, a), alone[0]);
    assert_eq!(completion(&s.addr, c), alone[2]);
    assert_eq!(loaded(&s.addr), sorted([a, c]));
    // And b back unloads a, now the least recently used.
    assert_eq!(completion(&s.addr, b), alone[1]);
    assert_eq!(loaded(&s.addr), sorted([b, c]));

    // A name no model has: the front end's own 404.
    let r = post(
        &s.addr,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x", "max_tokens": 1}),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
}
