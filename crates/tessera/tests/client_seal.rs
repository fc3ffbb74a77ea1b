//! `tessera client`: a request sealed to a worker opens only with the worker's key, the answer
//! sealed back opens only with the client's, and an envelope whose routing header was rewritten
//! fails at the worker with an authentication error.

use std::path::Path;
use std::process::{Command, Output};

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .output()
        .expect("tessera runs")
}

fn ok(args: &[&str]) -> String {
    let out = tessera(args);
    assert!(
        out.status.success(),
        "tessera {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// `keygen` into `dir/name`; returns the public key it printed.
fn keygen(dir: &Path, name: &str) -> String {
    let path = dir.join(name);
    let printed = ok(&["client", "keygen", "--out", path.to_str().unwrap()]);
    printed
        .lines()
        .find_map(|l| l.strip_prefix("public key: "))
        .expect("keygen prints the public key")
        .trim()
        .to_string()
}

struct Sealed {
    envelope: std::path::PathBuf,
    job: String,
}

fn seal(dir: &Path, worker_public: &str) -> Sealed {
    let request = dir.join("request.json");
    std::fs::write(
        &request,
        r#"{"model":"qwen3-0.6b","messages":[{"role":"user","content":"MARKER-7f3a"}]}"#,
    )
    .unwrap();
    let envelope = dir.join("job.sealed");
    let header = ok(&[
        "client",
        "seal",
        "--request",
        request.to_str().unwrap(),
        "--to",
        worker_public,
        "--model",
        "qwen3-0.6b",
        "--context-tokens",
        "1024",
        "--ttl",
        "600",
        "--reply-key",
        dir.join("client.key").to_str().unwrap(),
        "--out",
        envelope.to_str().unwrap(),
    ]);
    let header: serde_json::Value = serde_json::from_str(&header).expect("seal prints its header");
    assert_eq!(header["model"], "qwen3-0.6b");
    assert_eq!(header["attempt"], 1);
    // The prompt travels sealed: the envelope's bytes do not contain it.
    let bytes = std::fs::read(&envelope).unwrap();
    assert!(!bytes.windows(11).any(|w| w == b"MARKER-7f3a"));
    Sealed {
        envelope,
        job: header["job"].as_str().unwrap().to_string(),
    }
}

#[test]
fn a_sealed_request_and_its_answer_round_trip_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let worker = keygen(d, "worker.key");
    keygen(d, "client.key");
    let sealed = seal(d, &worker);
    let env = sealed.envelope.to_str().unwrap();

    // The worker opens the request.
    let opened = ok(&[
        "client",
        "open",
        env,
        "--key",
        d.join("worker.key").to_str().unwrap(),
    ]);
    assert!(opened.contains("MARKER-7f3a"), "{opened}");
    // The client's key cannot open it.
    let out = tessera(&[
        "client",
        "open",
        env,
        "--key",
        d.join("client.key").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("authentication failed"));

    // The worker answers; only the client opens the answer.
    std::fs::write(d.join("answer.txt"), "the sealed answer").unwrap();
    let result = d.join("result.sealed");
    ok(&[
        "client",
        "reply",
        env,
        "--key",
        d.join("worker.key").to_str().unwrap(),
        "--answer",
        d.join("answer.txt").to_str().unwrap(),
        "--out",
        result.to_str().unwrap(),
    ]);
    let answer = ok(&[
        "client",
        "open",
        result.to_str().unwrap(),
        "--key",
        d.join("client.key").to_str().unwrap(),
        "--from",
        &worker,
        "--job",
        &sealed.job,
    ]);
    assert_eq!(answer, "the sealed answer");
    // An answer claimed to come from another worker is refused.
    let other = keygen(d, "other.key");
    let out = tessera(&[
        "client",
        "open",
        result.to_str().unwrap(),
        "--key",
        d.join("client.key").to_str().unwrap(),
        "--from",
        &other,
        "--job",
        &sealed.job,
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("authentication failed"));
}

#[test]
fn an_envelope_whose_header_was_rewritten_fails_authentication_at_the_worker() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let worker = keygen(d, "worker.key");
    keygen(d, "client.key");
    let sealed = seal(d, &worker);
    let bytes = std::fs::read(&sealed.envelope).unwrap();
    // Wire layout: 8-byte magic, u32 header length, then the canonical header: the domain tag
    // (u32 length + "tessera-seal job header v1"), the 16-byte job id, the u32 attempt, ...
    let tag = b"tessera-seal job header v1";
    assert_eq!(&bytes[16..16 + tag.len()], tag);
    let attempt_at = 16 + tag.len() + 16;
    assert_eq!(&bytes[attempt_at..attempt_at + 4], &1u32.to_be_bytes());
    let mut rewritten = bytes.clone();
    rewritten[attempt_at + 3] = 2; // the coordinator replays it as "attempt 2"
    let path = d.join("rewritten.sealed");
    std::fs::write(&path, &rewritten).unwrap();
    let out = tessera(&[
        "client",
        "open",
        path.to_str().unwrap(),
        "--key",
        d.join("worker.key").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("authentication failed: the job envelope was altered"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("MARKER-7f3a"));
}

#[test]
fn client_help_teaches_the_exchange() {
    let help = ok(&["client", "--help"]);
    for step in ["keygen", "seal", "open", "--reply-key", "--from", "--job"] {
        assert!(help.contains(step), "help lacks {step}: {help}");
    }
}
