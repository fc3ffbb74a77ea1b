//! Models by name end to end, against the local Hub stand-in (`tessera_hub::stand_in`, a real
//! server on a loopback socket) with `HF_ENDPOINT` pointing at it: `tessera pull` of a split
//! quant killed mid-file resumes where it stopped, a corrupted byte is refused naming the file,
//! a cached model is not fetched again; `tessera up --model hf:REPO:Q4_K_M` serves the split
//! model over three nodes with the same tokens and log-probs as `serve` of the unsplit file.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{event_in, model_path, post, wait_for, Proc, Server, JSON_LOGS};
use tessera_hub::stand_in::StandIn;
use tessera_model::{GgufFile, SplitOptions};

const REPO: &str = "tessera-test/small-qwen3-GGUF";
const NAME: &str = "tessera-test/small-qwen3-GGUF:Q4_K_M";
/// A Q4_K fixture, served under the Q4_K_M name a Hub repository would give it.
const FIXTURE: &str = "test/small-qwen3-Q4_K.gguf";

/// The stand-in repository: the fixture split in three parts, named as a Q4_K_M quant.
fn repository(work: &Path) -> Vec<(String, Vec<u8>)> {
    let whole = GgufFile::open(model_path(FIXTURE)).unwrap();
    let options = SplitOptions {
        max_tensors: whole.tensors().len().div_ceil(3),
        metadata_only_first: false,
    };
    let prefix = work.join("small-qwen3-Q4_K_M");
    let parts = tessera_model::gguf::write_parts(&whole, &prefix, options).unwrap();
    let mut files: Vec<(String, Vec<u8>)> = parts
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(p).unwrap())
        })
        .collect();
    files.push(("README.md".into(), b"# small-qwen3\n".to_vec()));
    files
}

/// `tessera` with the Hub environment: the stand-in's endpoint and a cache of the test's own.
fn tessera(hub: &StandIn, cache: &Path) -> Command {
    let mut cmd = Command::new(common::bin());
    cmd.env("HF_ENDPOINT", hub.endpoint())
        .env("HF_HUB_CACHE", cache)
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        .env("TESSERA_LOG", "warn");
    cmd
}

fn storage_requests(hub: &StandIn) -> Vec<Option<u64>> {
    hub.requests()
        .into_iter()
        .filter(|s| s.path.starts_with("/storage/"))
        .map(|s| s.range_from)
        .collect()
}

fn incomplete_len(cache: &Path) -> Option<u64> {
    let blobs = cache.join("models--tessera-test--small-qwen3-GGUF/blobs");
    std::fs::read_dir(blobs).ok()?.flatten().find_map(|e| {
        let p = e.path();
        (p.extension()? == "incomplete").then(|| std::fs::metadata(&p).ok().map(|m| m.len()))?
    })
}

#[test]
fn pull_killed_mid_file_resumes_verifies_and_reuses_the_cache() {
    let work = tempfile::tempdir().unwrap();
    let cache = work.path().join("hub");
    let hub = StandIn::start().unwrap();
    let files = repository(work.path());
    hub.add_repo(REPO, files.clone());

    // Part 2's transfer stalls after 100000 bytes; the pull is killed while it waits.
    const AT: u64 = 100_000;
    hub.stall_next_transfer(&files[1].1, AT);
    let mut first = tessera(&hub, &cache)
        .args(["pull", NAME])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("part 2 under way", Duration::from_secs(120), || {
        incomplete_len(&cache) == Some(AT)
    });
    first.kill().unwrap();
    first.wait().unwrap();

    // Pulled again: part 2 resumes at the byte it stopped at, part 1 is not fetched again.
    // What the pull did is read from its events (`TESSERA_LOG_FORMAT=json`: JSON lines on
    // stderr) and from the requests the stand-in received, not from its wording.
    let before = storage_requests(&hub).len();
    let out = tessera(&hub, &cache)
        .args(["pull", NAME])
        .env(JSON_LOGS.0, JSON_LOGS.1)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        storage_requests(&hub)[before..],
        [Some(AT), None],
        "{stderr}"
    );
    let events = |event: &str| -> Vec<serde_json::Value> {
        stderr
            .lines()
            .filter_map(|l| event_in(l, &[("event", event)]))
            .collect()
    };
    let file_of = |e: &serde_json::Value| e["file"].as_str().unwrap().to_string();
    let reused: Vec<String> = events("pull_reused").iter().map(file_of).collect();
    assert_eq!(reused, [files[0].0.clone()], "{stderr}");
    let started: Vec<(String, u64)> = events("pull_downloading")
        .iter()
        .map(|e| (file_of(e), e["from"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        started,
        [(files[1].0.clone(), AT), (files[2].0.clone(), 0)],
        "part 2 resumes at the byte it stopped at, part 3 starts afresh: {stderr}"
    );
    // Both downloaded parts were checked against their SHA-256, the resumed one included.
    let verified: Vec<String> = events("pull_verified").iter().map(file_of).collect();
    assert_eq!(
        verified,
        [files[1].0.clone(), files[2].0.clone()],
        "{stderr}"
    );
    // The event's message is the line a person reads without JSON.
    let resumed = &events("pull_downloading")[0];
    let said = resumed["message"].as_str().unwrap();
    assert!(said.contains("resuming at"), "{resumed}");
    let path = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    assert!(
        path.ends_with("small-qwen3-Q4_K_M-00001-of-00003.gguf"),
        "{path:?}"
    );
    assert!(path.starts_with(&cache));
    let pulled = GgufFile::open(&path).unwrap();
    let original = GgufFile::open(model_path(FIXTURE)).unwrap();
    for t in original.tensors() {
        let p = pulled.tensor(&t.name).unwrap();
        assert!(pulled.tensor_bytes(p).unwrap() == original.tensor_bytes(t).unwrap());
    }

    // A third pull downloads nothing; inspect reads the model by name from the cache.
    let before = storage_requests(&hub).len();
    let out = tessera(&hub, &cache)
        .args(["inspect", &format!("hf:{NAME}")])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("read from 3 gguf-split parts"), "{stdout}");
    assert_eq!(
        storage_requests(&hub).len(),
        before,
        "nothing downloaded again"
    );
}

#[test]
fn pull_refuses_a_corrupted_byte_naming_the_file() {
    let work = tempfile::tempdir().unwrap();
    let cache = work.path().join("hub");
    let hub = StandIn::start().unwrap();
    let files = repository(work.path());
    hub.add_repo(REPO, files.clone());
    hub.corrupt(&files[2].1, 4096);
    let out = tessera(&hub, &cache).args(["pull", NAME]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("small-qwen3-Q4_K_M-00003-of-00003.gguf") && stderr.contains("SHA-256"),
        "{stderr}"
    );
}

/// `up --model hf:REPO:Q4_K_M` pulls the split model and serves it over three nodes; its
/// greedy tokens and log-probs equal `serve` of the unsplit fixture in one process.
#[test]
fn up_serves_a_split_model_by_name_as_one_process_serves_the_whole_file() {
    let work = tempfile::tempdir().unwrap();
    let cache = work.path().join("hub");
    let hub = StandIn::start().unwrap();
    hub.add_repo(REPO, repository(work.path()));
    let mut cmd = tessera(&hub, &cache);
    cmd.args([
        "up",
        "--listen",
        "127.0.0.1:0",
        "--threads",
        "1",
        "--nodes",
        "3",
    ])
    .arg("--no-sample")
    .arg("--run-dir")
    .arg(work.path().join("run"))
    .arg("--model")
    .arg(format!("hf:{NAME}"))
    .env(common::JSON_LOGS.0, common::JSON_LOGS.1);
    let mut up = Proc::from_command("tessera up", cmd, Duration::from_secs(300));
    let pids: Vec<u32> = up
        .announced("nodes_started", "pids")
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 3);
    let addr = up.announced("listening", "addr");
    let request = |addr: &str, model: &str| {
        let body = serde_json::json!({
            "model": model, "prompt": "Once upon a time", "temperature": 0,
            "max_tokens": 12, "logprobs": 3,
        });
        let r = post(addr, "/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let j = r.json();
        (
            j["choices"][0]["text"].clone(),
            j["choices"][0]["logprobs"].clone(),
        )
    };
    let cluster = request(&addr, NAME);
    let _ = up.child.kill();
    let _ = up.child.wait();
    for p in pids {
        let _ = Command::new("kill")
            .args(["-KILL", &p.to_string()])
            .status();
    }
    let whole = model_path(FIXTURE);
    let server = Server::start(&["--model", &whole, "--threads", "1"]);
    let alone = request(&server.addr, "small-qwen3-Q4_K");
    assert!(cluster.1.is_object(), "{}", cluster.1);
    assert_eq!(
        cluster, alone,
        "the split model over 3 nodes answers as the whole file"
    );
}
