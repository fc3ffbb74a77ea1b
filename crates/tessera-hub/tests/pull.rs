//! `pull` against the local Hub stand-in (a real server on a loopback socket): a split quant
//! pulled after a transfer killed mid-file resumes where it stopped, a corrupted byte is refused
//! naming the file, and files already in the cache (ours or another tool's) are not fetched again.

use std::path::{Path, PathBuf};

use tessera_hub::stand_in::StandIn;
use tessera_hub::{pull, HubCache, HubConfig, HubError, ModelName, Pulled};
use tessera_model::{GgufFile, SplitOptions};

const REPO: &str = "tessera-test/tiny-qwen3-GGUF";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/test")
        .join(name)
}

/// A repository with a Q8_0 split in three parts under `Q8_0/`, a single-file Q4_0 and a README.
fn repository(work: &Path) -> Vec<(String, Vec<u8>)> {
    let whole = GgufFile::open(fixture("tiny-qwen3-Q8_0.gguf")).unwrap();
    let options = SplitOptions {
        max_tensors: whole.tensors().len().div_ceil(3),
        metadata_only_first: false,
    };
    let parts =
        tessera_model::gguf::write_parts(&whole, &work.join("tiny-qwen3-Q8_0"), options).unwrap();
    let mut files: Vec<(String, Vec<u8>)> = parts
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            (format!("Q8_0/{name}"), std::fs::read(p).unwrap())
        })
        .collect();
    files.push((
        "tiny-qwen3-Q4_0.gguf".into(),
        std::fs::read(fixture("tiny-qwen3-Q4_0.gguf")).unwrap(),
    ));
    files.push(("README.md".into(), b"# tiny\n".to_vec()));
    files
}

fn config(hub: &StandIn, cache: &Path) -> HubConfig {
    HubConfig {
        endpoint: hub.endpoint(),
        token: None,
        offline: false,
        cache: HubCache::new(cache),
        retries: 0,
    }
}

fn q8() -> ModelName {
    ModelName::parse("hf:tessera-test/tiny-qwen3-GGUF:Q8_0").unwrap()
}

/// The pulled split model reads as the original fixture, tensor for tensor.
fn assert_is_the_fixture(pulled: &Pulled) {
    assert_eq!(pulled.files.len(), 3);
    let g = GgufFile::open(&pulled.files[0]).unwrap();
    assert!(g.is_split());
    let original = GgufFile::open(fixture("tiny-qwen3-Q8_0.gguf")).unwrap();
    assert_eq!(g.metadata(), original.metadata());
    for t in original.tensors() {
        let p = g.tensor(&t.name).unwrap();
        assert_eq!(
            g.tensor_bytes(p).unwrap(),
            original.tensor_bytes(t).unwrap()
        );
    }
}

fn storage_requests(hub: &StandIn) -> Vec<(String, Option<u64>)> {
    hub.requests()
        .into_iter()
        .filter(|s| s.path.starts_with("/storage/"))
        .map(|s| (s.path, s.range_from))
        .collect()
}

#[test]
fn a_pull_killed_mid_file_resumes_verifies_and_then_reuses_the_cache() {
    let work = tempfile::tempdir().unwrap();
    let hub = StandIn::start().unwrap();
    let files = repository(work.path());
    let part2 = files[1].1.clone();
    hub.add_repo(REPO, files.clone());
    let cfg = config(&hub, &work.path().join("hub"));

    // The transfer of part 2 dies after 5000 bytes: the pull fails, keeping what arrived.
    hub.cut_next_transfer(&part2, 5000);
    let err = pull(&cfg, &q8(), &mut |_| {}).unwrap_err();
    assert!(err.is_retryable(), "{err}");
    let incomplete: Vec<_> = std::fs::read_dir(cfg.cache.repo_dir(REPO).join("blobs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "incomplete"))
        .collect();
    assert_eq!(incomplete.len(), 1);
    assert_eq!(std::fs::metadata(&incomplete[0]).unwrap().len(), 5000);

    // The next pull resumes part 2 from byte 5000 and fetches part 3; part 1 is not fetched again.
    let before = storage_requests(&hub).len();
    let pulled = pull(&cfg, &q8(), &mut |_| {}).unwrap();
    let resumed = &storage_requests(&hub)[before..];
    assert_eq!(resumed.len(), 2, "{resumed:?}");
    assert_eq!(resumed[0].1, Some(5000), "part 2 resumed at the cut");
    assert_eq!(resumed[1].1, None, "part 3 from the start");
    let part3 = files[2].1.len() as u64;
    assert_eq!(pulled.bytes_downloaded, part2.len() as u64 - 5000 + part3);
    assert_eq!(pulled.files_reused, 1);
    assert_is_the_fixture(&pulled);
    assert!(pulled.files[0].ends_with("Q8_0/tiny-qwen3-Q8_0-00001-of-00003.gguf"));
    assert!(!incomplete[0].exists());

    // Pulled again: every file is in the cache, nothing is downloaded.
    let before = storage_requests(&hub).len();
    let again = pull(&cfg, &q8(), &mut |_| {}).unwrap();
    assert_eq!((again.bytes_downloaded, again.files_reused), (0, 3));
    assert_eq!(storage_requests(&hub).len(), before);
    assert_eq!(again.files, pulled.files);

    // Offline, the cache answers without the network.
    drop(hub);
    let offline = HubConfig {
        offline: true,
        ..cfg.clone()
    };
    assert_eq!(
        pull(&offline, &q8(), &mut |_| {}).unwrap().files,
        pulled.files
    );
    let err = pull(
        &offline,
        &ModelName::parse("o/absent").unwrap(),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(matches!(err, HubError::Offline { .. }), "{err}");
}

#[test]
fn a_corrupted_byte_is_refused_naming_the_file() {
    let work = tempfile::tempdir().unwrap();
    let hub = StandIn::start().unwrap();
    let files = repository(work.path());
    hub.add_repo(REPO, files.clone());
    hub.corrupt(&files[2].1, 100);
    let cfg = config(&hub, &work.path().join("hub"));
    let err = pull(&cfg, &q8(), &mut |_| {}).unwrap_err();
    match &err {
        HubError::Corrupt { file, .. } => {
            assert_eq!(file, "Q8_0/tiny-qwen3-Q8_0-00003-of-00003.gguf")
        }
        e => panic!("expected a corrupt download, got {e}"),
    }
    assert!(err
        .to_string()
        .contains("tiny-qwen3-Q8_0-00003-of-00003.gguf"));
    assert!(!err.is_retryable());
    // Nothing of the bad file is kept: neither a blob nor a partial download.
    let blobs = cfg.cache.repo_dir(REPO).join("blobs");
    let kept = std::fs::read_dir(&blobs).unwrap().count();
    assert_eq!(kept, 2, "parts 1 and 2 only");
    hub.heal(&files[2].1);
    assert_is_the_fixture(&pull(&cfg, &q8(), &mut |_| {}).unwrap());
}

#[test]
fn files_another_tool_put_in_the_cache_are_reused() {
    let work = tempfile::tempdir().unwrap();
    let hub = StandIn::start().unwrap();
    let files = repository(work.path());
    hub.add_repo(REPO, files.clone());
    let cfg = config(&hub, &work.path().join("hub"));
    // As huggingface_hub leaves a file: the blob named by its SHA-256.
    use sha2::Digest;
    for (_, bytes) in &files[..3] {
        let sha: String = sha2::Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let blob = cfg.cache.blob(REPO, &sha);
        std::fs::create_dir_all(blob.parent().unwrap()).unwrap();
        std::fs::write(blob, bytes).unwrap();
    }
    let pulled = pull(&cfg, &q8(), &mut |_| {}).unwrap();
    assert_eq!((pulled.bytes_downloaded, pulled.files_reused), (0, 3));
    assert!(storage_requests(&hub).is_empty());
    assert_is_the_fixture(&pulled);
    // The single-file quant is another model of the same repository, downloaded whole.
    let q4 = ModelName::parse("tessera-test/tiny-qwen3-GGUF:q4_0").unwrap();
    let pulled = pull(&cfg, &q4, &mut |_| {}).unwrap();
    assert_eq!(pulled.files.len(), 1);
    assert_eq!(
        std::fs::read(&pulled.files[0]).unwrap(),
        std::fs::read(fixture("tiny-qwen3-Q4_0.gguf")).unwrap()
    );
}

#[test]
fn a_gated_repository_needs_the_token_and_unknown_names_are_named() {
    let work = tempfile::tempdir().unwrap();
    let hub = StandIn::start().unwrap();
    hub.add_repo(REPO, repository(work.path()));
    hub.require_token("hf_secret");
    let mut cfg = config(&hub, &work.path().join("hub"));
    let err = pull(&cfg, &q8(), &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("401") && err.contains("HF_TOKEN"), "{err}");
    cfg.token = Some("hf_secret".into());
    assert_is_the_fixture(&pull(&cfg, &q8(), &mut |_| {}).unwrap());

    let err = pull(&cfg, &ModelName::parse("o/absent").unwrap(), &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("404"), "{err}");
    let err = pull(
        &cfg,
        &ModelName::parse(&format!("{REPO}:Q6_K")).unwrap(),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("no GGUF file is quantized Q6_K") && err.contains("Q8_0/tiny-qwen3-Q8_0"),
        "{err}"
    );
}
