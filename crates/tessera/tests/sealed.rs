//! Sealed jobs with real processes on 127.0.0.1: a `tessera coordinator` whose `--split` holds
//! single-node cells, their nodes (each publishes a sealing key in signed claims), and
//! `tessera client submit`, which tokenizes, seals the request to each candidate worker and
//! opens the one answer.
//!
//! - The answer is the one-process text, and the coordinator's memory, logs and data never
//!   hold the prompt or the answer.
//! - A coordinator that rewrites an envelope's recipient or expiry gets an authentication error
//!   from the worker, never an answer; one that delivers an envelope twice gets a replay
//!   refusal; a resubmitted job is refused.
//! - Killing the worker that holds a job hands it to the next candidate; the client gets one
//!   answer.
//! - A worker that alters its tokens is caught by verification and quarantined, and the client
//!   gets the honest answer; honest workers are never quarantined in 200 verified jobs.
//! - A gateway (`tessera serve --sealed-via-file`) seals plain OpenAI requests the same way.

mod common;

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use common::chaos::{messages, Proc};
use common::model;
use common::sealed::{cluster, finished, news, of_type, one_process, submit, MODEL};
use serde_json::Value;

#[test]
fn a_sealed_job_gives_the_one_process_text_and_the_coordinator_never_holds_prompt_or_answer() {
    let marker = "Zanzibar quokkas negotiate";
    let (mut c, _) = cluster(&[("n0", &[]), ("n1", &[])], &[]);
    let mut p = submit(
        &c,
        "client",
        &["-p", marker, "-n", "48", "--temperature", "0"],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(ok, "{msgs:?}");
    let a = of_type(&msgs, "answer");
    assert_eq!(a.len(), 1, "{msgs:?}");
    let text = a[0]["text"].as_str().unwrap();
    assert_eq!(format!("{marker}{text}\n"), one_process(marker, "48"));
    assert!(
        text.len() >= 24,
        "a completion long enough to search for: {text:?}"
    );

    // Search everything the coordinator has: its memory, its output, its data directory.
    let secrets = [marker.as_bytes(), text.trim().as_bytes()];
    let pid: u32 = c.coordinator.pid().parse().unwrap();
    let memory = process_memory(pid);
    assert!(
        memory.len() > 1 << 20,
        "read {} bytes of memory",
        memory.len()
    );
    c.coordinator.drain();
    let logs: Vec<u8> = c
        .coordinator
        .seen
        .iter()
        .flat_map(|(_, l)| l.bytes().chain([b'\n']))
        .collect();
    let mut data = Vec::new();
    read_tree(&c.dir.path().join("coord"), &mut data);
    assert!(!data.is_empty());
    for s in secrets {
        for (what, hay) in [("memory", &memory), ("logs", &logs), ("data", &data)] {
            assert!(
                find(hay, s).is_none(),
                "the coordinator's {what} holds {:?}",
                String::from_utf8_lossy(s)
            );
        }
    }
    // The search finds what is there: the model's file name, which the coordinator holds.
    assert!(find(&memory, b"small-qwen3-Q8_0").is_some());
}

#[test]
fn a_coordinator_that_rewrites_the_recipient_or_the_expiry_gets_an_authentication_error() {
    for fault in ["rewrite-recipient", "rewrite-ttl"] {
        let (c, _) = cluster(&[("n0", &[]), ("n1", &[])], &["--fault-sealed", fault]);
        let mut p = submit(&c, "client", &["-p", "Once upon a time", "-n", "8"]);
        let (ok, msgs) = finished(&mut p);
        assert!(!ok, "{fault}: the job must fail: {msgs:?}");
        assert!(of_type(&msgs, "answer").is_empty(), "{fault}: {msgs:?}");
        let refused = news(&msgs, "refused");
        assert_eq!(
            refused.len(),
            2,
            "{fault}: one refusal per envelope: {msgs:?}"
        );
        for r in &refused {
            assert_eq!(r["reason"], "authentication", "{fault}: {r}");
        }
    }
}

#[test]
fn a_replayed_envelope_is_refused_by_the_worker_and_a_resubmitted_job_by_the_coordinator() {
    // No verification: a replica run chosen at the tier's rate (5% of jobs) would be replayed
    // too and refused a second time.
    let (mut c, names) = cluster(
        &[("n0", &[]), ("n1", &[])],
        &["--fault-sealed", "replay", "--verify-per-mille", "0"],
    );
    let mut p = submit(
        &c,
        "client",
        &[
            "-p",
            "Once upon a time",
            "-n",
            "16",
            "--temperature",
            "0",
            "--resubmit",
        ],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(ok, "{msgs:?}");
    // The worker refused the copy. Its own event says so: the client may have its answer, and
    // be gone, before the coordinator relays the refusal.
    let worker = &names[news(&msgs, "dispatched")[0]["to"].as_str().unwrap()];
    let e = c.node(worker).wait_event(&[("event", "sealed_refused")]);
    assert!(e["reason"].as_str().unwrap().starts_with("replayed"), "{e}");
    assert_eq!(e["attempt"], 1);
    for r in news(&msgs, "refused") {
        assert_eq!(
            (&r["reason"], &r["attempt"]),
            (&"replayed".into(), &1.into())
        );
    }
    // The replay did not move the job: attempt 1 answered, once.
    let a = of_type(&msgs, "answer");
    assert_eq!(a.len(), 1);
    assert_eq!(a[0]["attempt"], 1);
    let resubmitted: Vec<&Value> = msgs.iter().filter(|m| m["type"] == "resubmitted").collect();
    assert_eq!(resubmitted.len(), 1, "{msgs:?}");
    assert_eq!(
        resubmitted[0]["failure"]["kind"], "already_submitted",
        "{}",
        resubmitted[0]
    );
}

#[test]
fn killing_the_worker_holding_a_job_hands_it_to_the_next_and_the_client_gets_one_answer() {
    // No verification: the lease is what is tested, and a replica run chosen at the tier's
    // rate would have no second live worker to go to.
    let (mut c, names) = cluster(&[("n0", &[]), ("n1", &[])], &["--verify-per-mille", "0"]);
    let prompt = "Lily and Ben";
    let mut p = submit(
        &c,
        "client",
        &["-p", prompt, "-n", "300", "--temperature", "0"],
    );
    // Wait until the first holder reports progress, then kill it.
    let first = p.wait_event_where(&[], 1, |m| m["news"]["event"] == "progress");
    assert_eq!(first["news"]["attempt"], 1);
    let dispatched = messages(&p)
        .into_iter()
        .find(|(_, m)| m["news"]["event"] == "dispatched")
        .map(|(_, m)| m)
        .unwrap();
    let holder = &names[dispatched["news"]["to"].as_str().unwrap()];
    c.node(holder).signal("-KILL");
    let (ok, msgs) = finished(&mut p);
    assert!(ok, "{msgs:?}");
    assert_eq!(news(&msgs, "expired").len(), 1, "{msgs:?}");
    let a = of_type(&msgs, "answer");
    assert_eq!(a.len(), 1, "one answer: {msgs:?}");
    assert_eq!(a[0]["attempt"], 2);
    let want = one_process(prompt, "300");
    assert_eq!(
        format!("{prompt}{}\n", a[0]["text"].as_str().unwrap()),
        want
    );
}

#[test]
fn a_worker_that_alters_its_tokens_is_quarantined_and_the_client_gets_the_honest_answer() {
    let (mut c, names) = cluster(
        &[
            ("n0", &[]),
            ("liar", &["--fault-alter-tokens"]),
            ("n2", &[]),
        ],
        &["--verify-per-mille", "1000"],
    );
    let prompt = "The cat sat";
    // Three jobs: the first candidate rotates, so the liar answers first once.
    let mut p = submit(
        &c,
        "client",
        &[
            "-p",
            prompt,
            "-n",
            "12",
            "--temperature",
            "0",
            "--jobs",
            "3",
            "--workers",
            "3",
        ],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(ok, "{msgs:?}");
    let want = one_process(prompt, "12");
    let a = of_type(&msgs, "answer");
    assert_eq!(a.len(), 3);
    for x in &a {
        assert_eq!(x["verified"], true, "{x}");
        assert_eq!(format!("{prompt}{}\n", x["text"].as_str().unwrap()), want);
    }
    let q = c.coordinator.wait_event(&[("event", "quarantined")]);
    assert_eq!(names[q["node"].as_str().unwrap()], "liar");
    assert_eq!(c.coordinator.events(&[("event", "quarantined")]).len(), 1);
}

#[test]
fn honest_workers_are_never_quarantined_in_200_verified_jobs() {
    let (mut c, _) = cluster(&[("n0", &[]), ("n1", &[])], &["--verify-per-mille", "1000"]);
    let mut p = submit(
        &c,
        "client",
        &[
            "-p",
            "A dog",
            "-n",
            "3",
            "--temperature",
            "0.9",
            "--seed",
            "5",
            "--jobs",
            "200",
        ],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(ok, "{msgs:?}");
    let a = of_type(&msgs, "answer");
    assert_eq!(a.len(), 200);
    assert!(a.iter().all(|x| x["verified"] == true));
    assert_eq!(news(&msgs, "verifying").len(), 200);
    assert!(c.coordinator.events(&[("event", "quarantined")]).is_empty());
}

#[test]
fn workers_on_the_scalar_avx2_and_avx512_paths_agree_on_every_verified_answer() {
    let (mut c, _) = cluster(
        &[
            ("scalar", &["--max-isa", "scalar"]),
            ("avx2", &["--max-isa", "avx2"]),
            ("avx512", &["--max-isa", "avx512"]),
        ],
        &["--verify-per-mille", "1000"],
    );
    let paths: std::collections::BTreeSet<String> = c
        .coordinator
        .events(&[("event", "claims")])
        .iter()
        .filter(|e| e["models"] == 1)
        .map(|e| e["kernel_path"].as_str().unwrap().to_string())
        .collect();
    // A machine without AVX-512 runs its best below the cap: two paths then.
    assert!(
        paths.contains("scalar") && paths.contains("avx2"),
        "{paths:?}"
    );
    let mut p = submit(
        &c,
        "client",
        &[
            "-p",
            "Lily and Ben",
            "-n",
            "24",
            "--temperature",
            "0.8",
            "--seed",
            "11",
            "--jobs",
            "9",
            "--workers",
            "3",
        ],
    );
    let (ok, msgs) = finished(&mut p);
    assert!(ok, "{msgs:?}");
    let a = of_type(&msgs, "answer");
    assert_eq!(a.len(), 9);
    assert!(a.iter().all(|x| x["verified"] == true), "{a:?}");
    // Seeded sampling on three kernel paths: one text.
    let texts: std::collections::BTreeSet<&str> =
        a.iter().map(|x| x["text"].as_str().unwrap()).collect();
    assert_eq!(texts.len(), 1, "{texts:?}");
    assert!(c.coordinator.events(&[("event", "quarantined")]).is_empty());
}

#[test]
fn a_gateway_seals_plain_openai_requests_to_the_workers_of_an_untrusted_coordinator() {
    let (c, _) = cluster(&[("n0", &[]), ("n1", &[])], &[]);
    // The line is a secret: from a file, it stays out of the process list.
    let (gw, addr) = gateway(&c, "gateway", &[]);
    let argv = std::fs::read(format!("/proc/{}/cmdline", gw.pid())).unwrap();
    let token = c.operator.split('@').next().unwrap();
    assert!(!String::from_utf8_lossy(&argv).contains(token));
    let prompt = "Once upon a time";
    let want = one_process(prompt, "24");
    for _ in 0..2 {
        let r = common::http::post(
            &addr,
            "/v1/completions",
            &serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 24,
                                "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(format!("{prompt}{text}\n"), want);
    }
    // What a sealed job cannot do is refused, not ignored.
    let r = common::http::post(
        &addr,
        "/v1/completions",
        &serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4, "logprobs": 2}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
}

/// A sealed gateway in front of `c`'s coordinator, with `flags`; its address.
fn gateway(c: &common::chaos::Cluster, name: &str, flags: &[&str]) -> (Proc, String) {
    let via = c.dir.path().join(format!("{name}.token"));
    std::fs::write(&via, &c.operator).unwrap();
    let mut args: Vec<String> = [
        "serve",
        "-m",
        &model(MODEL).display().to_string(),
        "--model-name",
        "m",
        "--sealed-via-file",
        &via.display().to_string(),
        "--data-dir",
        &c.dir.path().join(name).display().to_string(),
        "--listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(flags.iter().map(|s| s.to_string()));
    let mut gw = Proc::spawn_with_events(name, &args);
    let addr = gw.announced("listening", "addr");
    (gw, addr)
}

/// How each front end marked one answer, whole and streamed: `(what, verified)`, with `None`
/// where the mark is missing. A whole response's header must agree with its body.
fn marks(addr: &str) -> Vec<(&'static str, Option<bool>)> {
    use common::http::{post, sse_data};
    let msgs = serde_json::json!([{"role": "user", "content": "Once upon a time"}]);
    let whole = |path: &str, body: Value, at: fn(&Value) -> &Value| {
        let r = post(addr, path, &body);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        let v = r.json();
        let mark = at(&v).as_bool();
        let header = r.header("x-tessera-verified").map(|h| h == "true");
        assert_eq!(header, mark, "{path}: the header and the body disagree");
        mark
    };
    let streamed = |path: &str, mut body: Value, last: fn(&[Value]) -> Option<&Value>| {
        body["stream"] = true.into();
        let r = post(addr, path, &body);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        let events: Vec<Value> = if path == "/api/chat" {
            r.body
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        } else {
            sse_data(&r.body)
                .iter()
                .filter(|d| *d != "[DONE]")
                .map(|d| serde_json::from_str(d).unwrap())
                .collect()
        };
        last(&events).and_then(|e| e["verified"].as_bool())
    };
    let chat = serde_json::json!({"model": "m", "messages": msgs, "max_tokens": 8});
    let completion = serde_json::json!({"model": "m", "prompt": "Once", "max_tokens": 8});
    let responses = serde_json::json!({"model": "m", "input": "Once upon a time",
                                       "max_output_tokens": 8});
    let ollama = serde_json::json!({"model": "m", "messages": msgs, "stream": false,
                                    "options": {"num_predict": 8}});
    let ollama_streamed = serde_json::json!({"model": "m", "messages": msgs,
                                             "options": {"num_predict": 8}});
    vec![
        (
            "chat",
            whole("/v1/chat/completions", chat.clone(), |v| {
                &v["choices"][0]["verified"]
            }),
        ),
        (
            "chat stream",
            streamed("/v1/chat/completions", chat.clone(), |es| {
                es.iter()
                    .map(|e| &e["choices"][0])
                    .find(|c| !c["finish_reason"].is_null())
            }),
        ),
        (
            "completion",
            whole("/v1/completions", completion, |v| {
                &v["choices"][0]["verified"]
            }),
        ),
        (
            "messages",
            whole("/v1/messages", chat.clone(), |v| &v["verified"]),
        ),
        (
            "messages stream",
            streamed("/v1/messages", chat.clone(), |es| {
                es.iter().find(|e| e["type"] == "message_delta")
            }),
        ),
        (
            "responses",
            whole("/v1/responses", responses.clone(), |v| &v["verified"]),
        ),
        (
            "responses stream",
            streamed("/v1/responses", responses, |es| {
                es.iter()
                    .find(|e| {
                        e["type"] == "response.completed" || e["type"] == "response.incomplete"
                    })
                    .map(|e| &e["response"])
            }),
        ),
        (
            "ollama chat",
            whole("/api/chat", ollama, |v| &v["verified"]),
        ),
        (
            "ollama chat stream",
            streamed("/api/chat", ollama_streamed, |es| es.last()),
        ),
    ]
}

#[test]
fn every_front_end_marks_whether_a_second_worker_verified_the_answer() {
    let (c, _) = cluster(&[("n0", &[]), ("n1", &[])], &[]);
    // One worker per job: nobody checks it, and every answer says so.
    let (_alone, addr) = gateway(&c, "alone", &["--sealed-workers", "1"]);
    for (what, mark) in marks(&addr) {
        assert_eq!(mark, Some(false), "{what}");
    }
    // Verified only: every answer was checked by the other worker, and says so.
    let (_checked, addr) = gateway(&c, "checked", &["--verified-only"]);
    for (what, mark) in marks(&addr) {
        assert_eq!(mark, Some(true), "{what}");
    }
}

/// The readable memory of process `pid` (every mapping /proc/PID/maps marks readable).
fn process_memory(pid: u32) -> Vec<u8> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut out = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        if !perms.starts_with('r') || line.ends_with("[vvar]") {
            continue;
        }
        let (a, b) = range.split_once('-').unwrap();
        let (a, b) = (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        );
        let mut buf = vec![0u8; (b - a) as usize];
        if mem.seek(SeekFrom::Start(a)).is_ok() && mem.read_exact(&mut buf).is_ok() {
            out.extend_from_slice(&buf);
        }
    }
    out
}

fn read_tree(dir: &Path, out: &mut Vec<u8>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            read_tree(&p, out);
        } else if let Ok(b) = std::fs::read(&p) {
            out.extend_from_slice(&b);
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
