//! What a sealing client can check for itself, with real processes on 127.0.0.1: a `tessera
//! coordinator` of single-node cells, its nodes, and `tessera client submit`.
//!
//! - A worker that reports the honest digest but ships altered tokens is caught by the client
//!   on every answer (the coordinator's comparison of digests cannot see it).
//! - A coordinator that lists a worker of its own makes a client that pins an operator key
//!   refuse to seal to it, naming the key; with no certified worker at all nothing is sealed.
//! - Model bytes altered in a node's cache are refused at load, naming the tensor.
//! - With `--verified-only`, no wrong answer from a node with altered weights reaches the
//!   client in 200 jobs.
//! - A job resubmitted after the coordinator restarted is refused by it, and an envelope
//!   replayed to a restarted worker is refused by the worker.
//! - A job longer than every worker's context fails at once, naming the sizes.

mod common;

use std::path::{Path, PathBuf};

use common::chaos::{Cluster, Proc};
use common::model;
use common::sealed::{
    cluster, finished, news, node_names, of_type, one_process, submit, wait_claims, MODEL,
};
use serde_json::Value;

/// `tessera client operator-key --dir DIR`: the operator's public key.
fn operator_key(dir: &Path) -> String {
    let out = std::process::Command::new(common::bin())
        .args(["client", "operator-key", "--dir"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The node's cached copy of the model and the manifest it was received against.
fn cached_model(node_dir: &Path) -> (PathBuf, Value) {
    let models = node_dir.join("models");
    let dir = std::fs::read_dir(&models)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("model.gguf").is_file())
        .unwrap_or_else(|| panic!("no cached model under {}", models.display()));
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    (dir.join("model.gguf"), manifest)
}

/// Overwrites tensor `name` in `file` with zeros (its offset and length from `manifest`).
fn zero_tensor(file: &Path, manifest: &Value, name: &str) {
    use std::io::{Seek, SeekFrom, Write};
    let t = manifest["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("no tensor {name}"));
    let (offset, len) = (t["offset"].as_u64().unwrap(), t["len"].as_u64().unwrap());
    let mut f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&vec![0u8; len as usize]).unwrap();
    f.sync_all().unwrap();
}

/// Stops node `name`, zeroes tensor `tensor` in its cache, and starts it again (it reconnects
/// to the recorded coordinator and is given its cell again) with `extra` flags.
fn alter_cache_and_restart(c: &mut Cluster, name: &str, tensor: &str, extra: &[&str]) -> Proc {
    let i = c.nodes.iter().position(|p| p.name == name).unwrap();
    let mut old = c.nodes.remove(i);
    old.signal("-TERM");
    old.wait_exit();
    let (file, manifest) = cached_model(&c.dir.path().join(name));
    zero_tensor(&file, &manifest, tensor);
    let mut args = c.node_args(name);
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::spawn_with_events(name, &args)
}

#[test]
fn a_worker_that_reports_the_honest_digest_but_ships_altered_tokens_is_caught_on_every_answer() {
    let (c, names) = cluster(
        &[("n0", &[]), ("cheat", &["--fault-ship-altered-tokens"])],
        &["--verify-per-mille", "0"],
    );
    let cheat = names
        .iter()
        .find(|(_, n)| *n == "cheat")
        .map(|(k, _)| k.clone())
        .unwrap();
    let prompt = "The cat sat";
    let mut p = submit(
        &c,
        "client",
        &[
            "-p",
            prompt,
            "-n",
            "8",
            "--temperature",
            "0",
            "--jobs",
            "6",
            "--workers",
            "2",
        ],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(!ok, "refused answers make the run fail: {msgs:?}");
    // The first candidate rotates: three jobs went first to each worker, and each ran where it
    // was dispatched first (no refusals, no verification).
    let first: Vec<String> = news(&msgs, "dispatched")
        .iter()
        .map(|n| names[n["to"].as_str().unwrap()].clone())
        .collect();
    assert_eq!(first.len(), 6, "{msgs:?}");
    let to_cheat = first.iter().filter(|n| *n == "cheat").count();
    assert_eq!(to_cheat, 3, "{first:?}");
    let refused = of_type(&msgs, "refused_answer");
    assert_eq!(
        refused.len(),
        to_cheat,
        "every answer of the cheat: {msgs:?}"
    );
    for r in &refused {
        let reason = r["reason"].as_str().unwrap();
        assert!(
            reason.contains(&cheat) && reason.contains("does not match the digest"),
            "{reason}"
        );
    }
    let want = one_process(prompt, "8");
    let answers = of_type(&msgs, "answer");
    assert_eq!(answers.len(), 6 - to_cheat);
    for a in &answers {
        assert_eq!(format!("{prompt}{}\n", a["text"].as_str().unwrap()), want);
        assert_eq!(a["verified"], false, "rate 0: nothing was checked");
    }
}

#[test]
fn a_coordinator_that_lists_a_worker_of_its_own_makes_the_client_refuse_to_seal_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let op_dir = dir.path().join("operator");
    let operator = operator_key(&op_dir);
    let op_flag = op_dir.display().to_string();
    let (c, names) = cluster(
        &[
            ("n0", &["--operator-dir", &op_flag]),
            ("n1", &["--operator-dir", &op_flag]),
        ],
        &["--fault-sealed", "list-own-worker"],
    );
    // Pinning the operator: the coordinator's own worker is refused by key, the job runs on a
    // certified one.
    let prompt = "Once upon a time";
    let mut p = submit(
        &c,
        "client",
        &[
            "-p",
            prompt,
            "-n",
            "8",
            "--temperature",
            "0",
            "--trust",
            &operator,
        ],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(ok, "{msgs:?}");
    let refused = of_type(&msgs, "uncertified");
    assert_eq!(refused.len(), 1, "{msgs:?}");
    let reason = refused[0]["reason"].as_str().unwrap();
    assert!(reason.contains("no operator certificate"), "{reason}");
    for n in news(&msgs, "dispatched") {
        assert!(names.contains_key(n["to"].as_str().unwrap()), "{n}");
    }
    let a = of_type(&msgs, "answer");
    assert_eq!(a.len(), 1);
    assert_eq!(
        format!("{prompt}{}\n", a[0]["text"].as_str().unwrap()),
        one_process(prompt, "8")
    );

    // Pinning an operator who certified none of them: nothing is sealed, and the refusal names
    // every listed key, the coordinator's own worker's among them.
    let stranger = operator_key(&dir.path().join("another-operator"));
    let mut p = submit(
        &c,
        "client2",
        &["-p", prompt, "-n", "8", "--trust", &stranger],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(!ok, "{msgs:?}");
    assert!(news(&msgs, "dispatched").is_empty(), "{msgs:?}");
    let r = of_type(&msgs, "refused");
    assert_eq!(r.len(), 1, "{msgs:?}");
    let reason = r[0]["reason"].as_str().unwrap();
    assert!(reason.contains("nothing was sealed"), "{reason}");
    for key in names.keys() {
        assert!(reason.contains(key.as_str()), "{key} in {reason}");
    }
    assert!(reason.contains("no operator certificate"), "{reason}");
}

#[test]
fn altered_model_bytes_in_a_nodes_cache_are_refused_at_load_with_the_tensor_named() {
    let (mut c, _) = cluster(&[("n0", &[])], &[]);
    let mut n0 = alter_cache_and_restart(&mut c, "n0", "blk.1.attn_k.weight", &[]);
    let refused = n0.wait_event(&[("event", "cache_refused")]);
    let error = refused["error"].as_str().unwrap();
    assert!(error.contains("blk.1.attn_k.weight"), "{refused}");
    // Received again, it loads and answers as one process does.
    n0.wait_event(&[("event", "loaded")]);
    c.nodes.push(n0);
    wait_claims(&mut c, 2);
    let prompt = "Lily and Ben";
    let mut p = submit(
        &c,
        "client",
        &["-p", prompt, "-n", "8", "--temperature", "0"],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(ok, "{msgs:?}");
    let a = of_type(&msgs, "answer");
    assert_eq!(
        format!("{prompt}{}\n", a[0]["text"].as_str().unwrap()),
        one_process(prompt, "8")
    );
}

#[test]
fn with_verified_only_no_wrong_answer_from_a_node_with_altered_weights_reaches_the_client() {
    let (mut c, _) = cluster(&[("n0", &[]), ("n1", &[]), ("bad", &[])], &[]);
    // The bad node skips the load-time check (as a cheat's own build would) and serves weights
    // with the output norm zeroed.
    let bad = alter_cache_and_restart(
        &mut c,
        "bad",
        "output_norm.weight",
        &["--fault-unchecked-weights"],
    );
    c.nodes.push(bad);
    c.node("bad").wait_event(&[("event", "loaded")]);
    wait_claims(&mut c, 4);
    let names = node_names(&mut c);
    let prompt = "A dog";
    let mut p = submit(
        &c,
        "client",
        &[
            "-p",
            prompt,
            "-n",
            "3",
            "--temperature",
            "0",
            "--jobs",
            "200",
            "--workers",
            "3",
            "--verified-only",
        ],
    );
    let (_, msgs) = finished(&mut p);
    let want = one_process(prompt, "3");
    let answers = of_type(&msgs, "answer");
    for a in &answers {
        assert_eq!(a["verified"], true, "{a}");
        assert_eq!(
            format!("{prompt}{}\n", a["text"].as_str().unwrap()),
            want,
            "a wrong answer reached the client: {a}"
        );
    }
    // Every job ended in an answer or a refusal, and the bad node was caught: its weights do
    // change the answer.
    assert_eq!(
        answers.len() + of_type(&msgs, "refused_answer").len(),
        200,
        "{:?}",
        &msgs[msgs.len().saturating_sub(5)..]
    );
    assert!(answers.len() >= 190, "{} answered", answers.len());
    let q = c.coordinator.wait_event(&[("event", "quarantined")]);
    assert_eq!(names[q["node"].as_str().unwrap()], "bad");
}

#[test]
fn a_coordinator_and_a_worker_refuse_a_replay_after_a_restart() {
    let (mut c, _) = cluster(&[("n0", &[])], &["--verify-per-mille", "0"]);
    let saved = c.dir.path().join("job.envelopes").display().to_string();
    let mut p = submit(
        &c,
        "client",
        &[
            "-p",
            "Once",
            "-n",
            "4",
            "--resubmit",
            "--save-envelopes",
            &saved,
        ],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(ok, "{msgs:?}");
    assert_eq!(of_type(&msgs, "answer").len(), 1);

    // The coordinator restarts: the job id is still refused.
    c.restart_coordinator();
    c.coordinator
        .wait_event_where(&[("event", "claims")], 1, |e| e["models"] == 1);
    let mut p = submit(&c, "again", &["-p", "x", "--submit-saved", &saved]);
    let (ok, msgs) = finished(&mut p);
    assert!(ok, "{msgs:?}");
    let r = of_type(&msgs, "resubmitted");
    assert_eq!(r[0]["failure"]["kind"], "already_submitted", "{msgs:?}");
    assert!(news(&msgs, "dispatched").is_empty(), "{msgs:?}");

    // The worker restarts, and a coordinator that forgot the job (its record deleted) passes
    // the same envelope on: the worker refuses it as a replay.
    let i = c.nodes.iter().position(|p| p.name == "n0").unwrap();
    let mut old = c.nodes.remove(i);
    old.signal("-TERM");
    old.wait_exit();
    let mut n0 = Proc::spawn_with_events("n0", &c.node_args("n0"));
    n0.wait_event(&[("event", "joined")]);
    c.nodes.push(n0);
    // Unlinked while it runs: the restarted coordinator starts a new, empty record.
    std::fs::remove_file(c.dir.path().join("coord").join("sealed.redb")).unwrap();
    c.restart_coordinator();
    c.coordinator
        .wait_event_where(&[("event", "claims")], 1, |e| e["models"] == 1);
    let _p = submit(&c, "third", &["-p", "x", "--submit-saved", &saved]);
    let refused = c.node("n0").wait_event(&[("event", "sealed_refused")]);
    assert!(
        refused["reason"].as_str().unwrap().contains("replayed"),
        "{refused}"
    );
}

#[test]
fn a_job_longer_than_every_workers_context_fails_at_once_naming_the_sizes() {
    let (c, _) = cluster(&[("n0", &[]), ("n1", &[])], &[]);
    let mut p = submit(
        &c,
        "client",
        &["-p", "Once upon a time", "-n", "100000", "--ignore-eos"],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(!ok, "{msgs:?}");
    assert!(news(&msgs, "dispatched").is_empty(), "{msgs:?}");
    let skipped = news(&msgs, "skipped");
    assert_eq!(skipped.len(), 2, "{msgs:?}");
    let failed = news(&msgs, "failed");
    let reason = &failed[0]["reason"];
    assert_eq!(reason["kind"], "no_worker_fits", "{reason}");
    let passed_over = reason["passed_over"].as_array().unwrap();
    assert_eq!(passed_over.len(), 2, "{reason}");
    assert!(
        passed_over.iter().all(|p| p["why"]["kind"] == "no_room"),
        "{reason}"
    );
    assert!(
        skipped.iter().all(|s| s["reason"]["kind"] == "no_room"),
        "{msgs:?}"
    );
}

#[test]
fn a_gateway_with_verified_only_answers_with_verified_answers_and_refuses_the_rest() {
    let (c, _) = cluster(&[("n0", &[]), ("n1", &[])], &["--verify-per-mille", "0"]);
    let gateway = |name: &str, workers: &str| {
        let args: Vec<String> = [
            "serve",
            "-m",
            &model(MODEL).display().to_string(),
            "--model-name",
            "m",
            "--sealed-via",
            &c.operator,
            "--sealed-workers",
            workers,
            "--verified-only",
            "--data-dir",
            &c.dir.path().join(name).display().to_string(),
            "--listen",
            "127.0.0.1:0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut gw = Proc::spawn_with_events(name, &args);
        let addr = gw.announced("listening", "addr");
        (gw, addr)
    };
    let prompt = "Once upon a time";
    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 8,
                                  "temperature": 0});
    // Sealed to both workers: every answer is checked on the second (whatever the rate).
    let (_gw, addr) = gateway("gw2", "2");
    let r = common::http::post(&addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let text = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(format!("{prompt}{text}\n"), one_process(prompt, "8"));
    // Sealed to one worker only: nobody can check it, so it is not released.
    let (_gw1, addr) = gateway("gw1", "1");
    let r = common::http::post(&addr, "/v1/completions", &body);
    assert_ne!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("not verified"), "{}", r.body);
}
