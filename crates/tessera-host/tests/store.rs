//! The shard store against real GGUF files: fetch a subset, reopen it with the GGUF reader,
//! survive restarts and interruptions, reject corruption, adopt a full local copy.

mod common;

use std::cell::Cell;
use std::io;
use std::path::Path;

use common::{test_model, TempDir};
use tessera_host::store::{VerifyReport, DEFAULT_CHUNK_SIZE};
use tessera_host::{
    fetch, ChunkRef, ChunkSource, ContentHash, FetchReport, FileSource, Manifest, Part, ShardStore,
    StoreError,
};
use tessera_model::GgufFile;

const MODEL: &str = "tiny-qwen3-Q8_0.gguf";
/// Small chunks so that tensors span several and interruption lands mid-tensor.
const CHUNK: u32 = 4096;

fn manifest(chunk: u32) -> Manifest {
    Manifest::from_gguf_with(test_model(MODEL), chunk, &mut |_, _| {}).unwrap()
}

/// Layers 0 and 1 plus the embedding: what a first pipeline stage needs.
fn stage0_names(m: &Manifest) -> Vec<String> {
    let mut names = m.layer_tensor_names(0..2);
    names.push("token_embd.weight".into());
    names
}

fn no_progress() -> impl FnMut(&tessera_host::FetchProgress<'_>) {
    |_| {}
}

fn fetch_all_from_file(store: &ShardStore, m: &Manifest, names: &[String]) -> FetchReport {
    let source = FileSource::open(test_model(MODEL)).unwrap();
    fetch(store, m, names, &source, &mut no_progress()).unwrap()
}

/// The named tensors in `path` hold exactly the original's bytes.
fn assert_tensors_equal_original(path: &Path, names: &[String]) {
    let original = GgufFile::open(test_model(MODEL)).unwrap();
    let local = GgufFile::open(path).unwrap();
    assert_eq!(local.tensors(), original.tensors());
    for name in names {
        let a = original
            .tensor_bytes(original.tensor(name).unwrap())
            .unwrap();
        let b = local.tensor_bytes(local.tensor(name).unwrap()).unwrap();
        assert!(a == b, "tensor {name} differs from the original");
    }
}

/// A source that serves the first `ok` chunks, then fails like a dropped connection.
struct FailsAfter<'a> {
    inner: &'a FileSource,
    ok: usize,
    served: Cell<usize>,
}

impl ChunkSource for FailsAfter<'_> {
    fn read_chunk(&self, chunk: &ChunkRef) -> io::Result<Vec<u8>> {
        if self.served.get() >= self.ok {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "peer went away",
            ));
        }
        self.served.set(self.served.get() + 1);
        self.inner.read_chunk(chunk)
    }
}

/// A source that flips one byte of the chunk with the given id.
struct Corrupts<'a> {
    inner: &'a FileSource,
    id: u32,
}

impl ChunkSource for Corrupts<'_> {
    fn read_chunk(&self, chunk: &ChunkRef) -> io::Result<Vec<u8>> {
        let mut b = self.inner.read_chunk(chunk)?;
        if chunk.id == self.id {
            b[0] ^= 0x5a;
        }
        Ok(b)
    }
}

/// A source that must not be asked for anything.
struct Refuses;

impl ChunkSource for Refuses {
    fn read_chunk(&self, chunk: &ChunkRef) -> io::Result<Vec<u8>> {
        panic!("nothing should be downloaded, but {chunk} was requested");
    }
}

#[test]
fn manifest_describes_the_file() {
    let path = test_model(MODEL);
    let bytes = std::fs::read(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    let mut last = (0, 0);
    let m = Manifest::from_gguf_with(&path, CHUNK, &mut |done, total| {
        assert!(done >= last.0, "progress goes forward");
        last = (done, total);
    })
    .unwrap();
    assert_eq!(last, (bytes.len() as u64, bytes.len() as u64));

    assert_eq!(m.model_hash, ContentHash::of(&bytes));
    assert_eq!(m.file_len, bytes.len() as u64);
    assert_eq!(m.chunk_size, CHUNK);
    assert_eq!((m.header.offset, m.header.len), (0, g.data_offset()));
    assert_eq!(
        m.header.hash,
        ContentHash::of(&bytes[..g.data_offset() as usize])
    );
    assert_eq!(m.tensors.len(), g.tensors().len());
    for (s, t) in m.tensors.iter().zip(g.tensors()) {
        assert_eq!((&s.name, s.offset, s.len), (&t.name, t.offset, t.n_bytes));
        let data = &bytes[t.offset as usize..(t.offset + t.n_bytes) as usize];
        assert_eq!(s.hash, ContentHash::of(data));
        let want: Vec<_> = data.chunks(CHUNK as usize).map(ContentHash::of).collect();
        assert_eq!(s.chunks, want, "chunk hashes of {}", t.name);
    }
    assert_eq!(m.layer_tensor_names(0..2).len(), 22);
    assert!(m
        .layer_tensor_names(0..2)
        .iter()
        .all(|n| n.starts_with("blk.0.") || n.starts_with("blk.1.")));

    // JSON round trip, through a file.
    let dir = TempDir::new("manifest");
    m.save(dir.path().join("m.json")).unwrap();
    assert_eq!(Manifest::load(dir.path().join("m.json")).unwrap(), m);

    // The default chunk size covers each of these small tensors in one chunk.
    let d = Manifest::from_gguf(&path).unwrap();
    assert_eq!(d.chunk_size, DEFAULT_CHUNK_SIZE);
    assert_eq!(d.model_hash, m.model_hash);
    assert!(d.tensors.iter().all(|t| t.chunks.len() == 1));
}

#[test]
fn malformed_manifests_are_refused() {
    let m = manifest(CHUNK);
    let mut bad = m.clone();
    bad.tensors[3].chunks.pop();
    assert!(matches!(bad.validate(), Err(StoreError::BadManifest(_))));
    let mut bad = m.clone();
    bad.tensors[3].offset = m.file_len - 1;
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains(&m.tensors[3].name), "{err}");
    let mut bad = m.clone();
    bad.tensors[4].offset = bad.tensors[3].offset;
    assert!(bad.validate().unwrap_err().to_string().contains("overlaps"));
    let mut bad = m.clone();
    bad.tensors[4].name = bad.tensors[3].name.clone();
    assert!(bad.validate().unwrap_err().to_string().contains("twice"));
    // A store will not act on a malformed manifest.
    let dir = TempDir::new("badmanifest");
    let store = ShardStore::open(dir.path()).unwrap();
    assert!(store.missing_chunks(&bad, &["token_embd.weight"]).is_err());
}

#[test]
fn fetches_only_the_assigned_tensors_into_a_gguf_the_reader_opens() {
    let m = manifest(CHUNK);
    let names = stage0_names(&m);
    assert_eq!(names.len(), 23);
    let dir = TempDir::new("subset");
    let store = ShardStore::open(dir.path()).unwrap();
    assert!(!store.has_all(&m, &names).unwrap());

    let mut calls = 0;
    let mut last_done = 0;
    let source = FileSource::open(test_model(MODEL)).unwrap();
    let report = fetch(&store, &m, &names, &source, &mut |p| {
        calls += 1;
        assert!(p.bytes_done > last_done && p.bytes_done <= p.bytes_total);
        last_done = p.bytes_done;
    })
    .unwrap();

    // Bytes transferred = header + exactly those tensors, computed from the GGUF itself.
    let g = GgufFile::open(test_model(MODEL)).unwrap();
    let tensor_bytes: u64 = names.iter().map(|n| g.tensor(n).unwrap().n_bytes).sum();
    assert_eq!(report.bytes_transferred, g.data_offset() + tensor_bytes);
    assert_eq!(report.bytes_needed, report.bytes_transferred);
    assert_eq!(report.bytes_already_present, 0);
    assert_eq!(report.chunks_transferred as usize, calls);
    assert_eq!(report.chunks_rejected, 0);
    assert!(report.bytes_transferred < m.file_len * 2 / 3, "{report:?}");

    // The sparse file opens with the normal reader and holds the original bytes.
    let path = store.path_for(&m);
    assert_eq!(
        path,
        dir.path()
            .join("models")
            .join(m.model_hash.to_hex())
            .join("model.gguf")
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), m.file_len);
    assert_tensors_equal_original(&path, &names);
    // Tensors not assigned were never received: their range is a hole of zeros.
    let local = GgufFile::open(&path).unwrap();
    for name in m.layer_tensor_names(2..4) {
        let b = local.tensor_bytes(local.tensor(&name).unwrap()).unwrap();
        assert!(b.iter().all(|&x| x == 0), "{name} should not be present");
    }

    assert!(store.has_all(&m, &names).unwrap());
    assert!(store.has_all(&m, &["blk.0.attn_q.weight"]).unwrap());
    assert!(!store.has_all(&m, &["blk.2.attn_q.weight"]).unwrap());
    let rest = store
        .missing_chunks(&m, &m.layer_tensor_names(2..4))
        .unwrap();
    assert!(!rest.is_empty());
    assert!(rest.iter().all(
        |c| matches!(&c.part, Part::Tensor(n) if n.starts_with("blk.2.") || n.starts_with("blk.3."))
    ));
}

#[test]
fn unknown_tensor_names_are_errors() {
    let m = manifest(CHUNK);
    let dir = TempDir::new("unknown");
    let store = ShardStore::open(dir.path()).unwrap();
    let err = store
        .missing_chunks(&m, &["blk.99.attn_q.weight"])
        .unwrap_err();
    assert!(
        matches!(err, StoreError::UnknownTensor { ref name, .. } if name == "blk.99.attn_q.weight")
    );
    assert!(err.to_string().contains("blk.99.attn_q.weight"), "{err}");
    let e = fetch(&store, &m, &["nope"], &Refuses, &mut no_progress()).unwrap_err();
    assert_eq!(e.partial.bytes_transferred, 0);
}

#[test]
fn a_second_fetch_after_restart_transfers_nothing() {
    let m = manifest(CHUNK);
    let names = stage0_names(&m);
    let dir = TempDir::new("restart");
    {
        let store = ShardStore::open(dir.path()).unwrap();
        let first = fetch_all_from_file(&store, &m, &names);
        assert!(first.bytes_transferred > 0);
        // Same store, same request: nothing to do.
        let again = fetch(&store, &m, &names, &Refuses, &mut no_progress()).unwrap();
        assert_eq!(again.bytes_transferred, 0);
    }
    // "Restart": a new store on the same directory, with a manifest re-read from JSON.
    let m2: Manifest = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
    let store = ShardStore::open(dir.path()).unwrap();
    assert!(store.missing_chunks(&m2, &names).unwrap().is_empty());
    let report = fetch(&store, &m2, &names, &Refuses, &mut no_progress()).unwrap();
    assert_eq!(report.bytes_transferred, 0);
    assert_eq!(report.chunks_transferred, 0);
    assert_eq!(report.bytes_already_present, report.bytes_needed);
    assert_tensors_equal_original(&store.path_for(&m2), &names);

    // Widening the assignment transfers only the new tensors.
    let more = m.layer_tensor_names(2..3);
    let wider: Vec<String> = names.iter().chain(&more).cloned().collect();
    let r = fetch_all_from_file(&store, &m, &wider);
    assert_eq!(
        r.bytes_transferred,
        m.bytes_for(&more).unwrap() - m.header.len
    );
}

#[test]
fn an_interrupted_fetch_resumes_where_it_stopped() {
    let m = manifest(CHUNK);
    let names = stage0_names(&m);
    let all = m.chunks_for(&names).unwrap();
    let dir = TempDir::new("resume");
    let file = FileSource::open(test_model(MODEL)).unwrap();
    let n_ok = 17;
    let first_bytes: u64 = all[..n_ok].iter().map(|c| u64::from(c.len)).sum();
    {
        let store = ShardStore::open(dir.path()).unwrap();
        let flaky = FailsAfter {
            inner: &file,
            ok: n_ok,
            served: Cell::new(0),
        };
        let err = fetch(&store, &m, &names, &flaky, &mut no_progress()).unwrap_err();
        assert!(matches!(err.error, StoreError::Source { .. }), "{err}");
        assert_eq!(err.partial.chunks_transferred, n_ok as u64);
        assert_eq!(err.partial.bytes_transferred, first_bytes);
        let msg = err.to_string();
        assert!(
            msg.contains("peer went away") && msg.contains("resumes"),
            "{msg}"
        );
        assert_eq!(
            store.missing_chunks(&m, &names).unwrap().len(),
            all.len() - n_ok
        );
    }
    // After a restart, only the rest is transferred.
    let store = ShardStore::open(dir.path()).unwrap();
    assert_eq!(
        store.missing_chunks(&m, &names).unwrap(),
        all[n_ok..].to_vec()
    );
    let report = fetch(&store, &m, &names, &file, &mut no_progress()).unwrap();
    assert_eq!(report.chunks_transferred as usize, all.len() - n_ok);
    assert_eq!(report.bytes_transferred, report.bytes_needed - first_bytes);
    assert_eq!(report.bytes_already_present, first_bytes);
    assert_tensors_equal_original(&store.path_for(&m), &names);
}

#[test]
fn a_crash_before_the_state_is_saved_loses_no_verified_bytes() {
    let m = manifest(CHUNK);
    let names = stage0_names(&m);
    let all = m.chunks_for(&names).unwrap();
    let dir = TempDir::new("crash");
    let file = FileSource::open(test_model(MODEL)).unwrap();
    {
        // The state would only be saved after 1000 chunks; "crash" (no drop, no flush) first.
        let store = ShardStore::open(dir.path()).unwrap().with_flush_every(1000);
        for c in &all[..10] {
            store
                .write_chunk(&m, c, &file.read_chunk(c).unwrap())
                .unwrap();
        }
        std::mem::forget(store);
    }
    // No state file: the store trusts only what hashes right on disk, and finds those 10.
    let store = ShardStore::open(dir.path()).unwrap();
    assert_eq!(
        store.missing_chunks(&m, &names).unwrap(),
        all[10..].to_vec()
    );
}

#[test]
fn corrupted_chunks_are_rejected() {
    let m = manifest(CHUNK);
    let names = stage0_names(&m);
    let all = m.chunks_for(&names).unwrap();
    // A chunk in the middle of a multi-chunk tensor.
    let victim = all
        .iter()
        .find(|c| {
            c.index == 1 && matches!(&c.part, Part::Tensor(n) if n == "blk.1.ffn_down.weight")
        })
        .unwrap()
        .clone();
    let dir = TempDir::new("corrupt");
    let store = ShardStore::open(dir.path()).unwrap();
    let file = FileSource::open(test_model(MODEL)).unwrap();

    let err = fetch(
        &store,
        &m,
        &names,
        &Corrupts {
            inner: &file,
            id: victim.id,
        },
        &mut no_progress(),
    )
    .unwrap_err();
    match &err.error {
        StoreError::HashMismatch { part, index, .. } => {
            assert_eq!(part, &Part::Tensor("blk.1.ffn_down.weight".into()));
            assert_eq!(*index, 1);
        }
        e => panic!("expected a hash mismatch, got {e}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("chunk 1 of tensor `blk.1.ffn_down.weight`") && msg.contains("rejected"),
        "{msg}"
    );
    assert_eq!(err.partial.chunks_rejected, 1);
    // The bad chunk was not recorded; a clean retry fills it and the rest.
    let missing = store.missing_chunks(&m, &names).unwrap();
    assert_eq!(missing[0], victim);
    let report = fetch(&store, &m, &names, &file, &mut no_progress()).unwrap();
    assert_eq!(report.chunks_transferred as usize, missing.len());
    assert_tensors_equal_original(&store.path_for(&m), &names);

    // write_chunk directly: wrong bytes, wrong length, a chunk from another numbering.
    let dir2 = TempDir::new("corrupt2");
    let store = ShardStore::open(dir2.path()).unwrap();
    let good = file.read_chunk(&victim).unwrap();
    let mut bad = good.clone();
    bad[100] ^= 1;
    let e = store.write_chunk(&m, &victim, &bad).unwrap_err();
    assert!(e.to_string().contains("blk.1.ffn_down.weight"), "{e}");
    let e = store.write_chunk(&m, &victim, &good[..10]).unwrap_err();
    assert!(
        matches!(e, StoreError::WrongLength { expected, actual: 10, .. } if expected == u64::from(victim.len))
    );
    let mut wrong = victim.clone();
    wrong.offset += 1;
    assert!(matches!(
        store.write_chunk(&m, &wrong, &good),
        Err(StoreError::UnknownChunk { .. })
    ));
    assert!(store.missing_chunks(&m, &names).unwrap().contains(&victim));
    store.write_chunk(&m, &victim, &good).unwrap();
    assert!(!store.missing_chunks(&m, &names).unwrap().contains(&victim));
}

#[test]
fn verify_finds_damaged_bytes_and_the_next_fetch_repairs_them() {
    let m = manifest(CHUNK);
    let names = stage0_names(&m);
    let dir = TempDir::new("verify");
    let store = ShardStore::open(dir.path()).unwrap();
    fetch_all_from_file(&store, &m, &names);
    let n = m.chunks_for(&names).unwrap().len() as u64;
    assert_eq!(
        store.verify(&m).unwrap(),
        VerifyReport {
            chunks_checked: n,
            chunks_bad: 0
        }
    );

    // Damage one byte of blk.0.attn_q.weight on disk.
    let t = m.tensor("blk.0.attn_q.weight").unwrap();
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(store.path_for(&m))
            .unwrap();
        f.seek(SeekFrom::Start(t.offset + 5)).unwrap();
        f.write_all(&[0xff]).unwrap();
    }
    assert_eq!(
        store.verify(&m).unwrap(),
        VerifyReport {
            chunks_checked: n,
            chunks_bad: 1
        }
    );
    let missing = store.missing_chunks(&m, &names).unwrap();
    assert_eq!(missing.len(), 1);
    assert_eq!(missing[0].part, Part::Tensor("blk.0.attn_q.weight".into()));
    let r = fetch_all_from_file(&store, &m, &names);
    assert_eq!(r.chunks_transferred, 1);
    assert_tensors_equal_original(&store.path_for(&m), &names);
}

#[test]
fn altered_bytes_in_the_cache_are_refused_at_load_with_the_tensor_named() {
    let m = manifest(CHUNK);
    let names = stage0_names(&m);
    let needs = tessera_host::store::Need::whole_tensors(&names);
    let dir = TempDir::new("check-needs");
    {
        let store = ShardStore::open(dir.path()).unwrap();
        fetch_all_from_file(&store, &m, &names);
        let n = m.chunks_for(&names).unwrap().len() as u64;
        assert_eq!(store.check_needs(&m, &needs).unwrap(), n);
    }
    // Edit a byte of blk.1.attn_k.weight in the cache while no store has it open: the state
    // file still says every chunk is here and good.
    let t = m.tensor("blk.1.attn_k.weight").unwrap();
    let path = {
        let store = ShardStore::open(dir.path()).unwrap();
        store.path_for(&m)
    };
    {
        use std::io::{Read, Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let mut b = [0u8];
        f.seek(SeekFrom::Start(t.offset + 9)).unwrap();
        f.read_exact(&mut b).unwrap();
        f.seek(SeekFrom::Start(t.offset + 9)).unwrap();
        f.write_all(&[!b[0]]).unwrap();
    }
    let store = ShardStore::open(dir.path()).unwrap();
    assert!(store.missing_chunks(&m, &names).unwrap().is_empty());
    let e = store.check_needs(&m, &needs).unwrap_err();
    assert!(matches!(e, StoreError::HashMismatch { .. }), "{e}");
    assert!(e.to_string().contains("blk.1.attn_k.weight"), "{e}");
    // The bad chunk is missing now: the next fetch brings it back, and the check passes.
    let missing = store.missing_chunks(&m, &names).unwrap();
    assert_eq!(missing.len(), 1);
    assert_eq!(missing[0].part, Part::Tensor("blk.1.attn_k.weight".into()));
    fetch_all_from_file(&store, &m, &names);
    store.check_needs(&m, &needs).unwrap();
    assert_tensors_equal_original(&store.path_for(&m), &names);
}

#[test]
fn a_new_chunking_of_the_same_model_reuses_the_bytes_on_disk() {
    let small = manifest(CHUNK);
    let big = manifest(3 * CHUNK);
    let names = stage0_names(&small);
    let dir = TempDir::new("rechunk");
    let store = ShardStore::open(dir.path()).unwrap();
    fetch_all_from_file(&store, &small, &names);
    // The coordinator switched chunk size: the store re-hashes what it holds, receives nothing.
    let r = fetch(&store, &big, &names, &Refuses, &mut no_progress()).unwrap();
    assert_eq!(r.bytes_transferred, 0);
    drop(store);
    let store = ShardStore::open(dir.path()).unwrap();
    assert!(store.has_all(&big, &names).unwrap());
}

#[test]
fn an_adopted_full_copy_downloads_nothing() {
    let dir = TempDir::new("adopt");
    let copy = dir.path().join("my-model.gguf");
    std::fs::copy(test_model(MODEL), &copy).unwrap();
    let data = dir.path().join("data");
    let all_names: Vec<String>;
    let m = {
        let store = ShardStore::open(&data).unwrap();
        let m = store.adopt(&copy).unwrap();
        assert_eq!(m, Manifest::from_gguf(test_model(MODEL)).unwrap());
        all_names = m.tensors.iter().map(|t| t.name.clone()).collect();
        assert_eq!(store.path_for(&m), copy.canonicalize().unwrap());
        assert!(store.has_all(&m, &all_names).unwrap());
        let r = fetch(&store, &m, &all_names, &Refuses, &mut no_progress()).unwrap();
        assert_eq!(r.bytes_transferred, 0);
        assert_eq!(r.bytes_already_present, r.bytes_needed);
        m
    };
    // After a restart, and with the coordinator's own (differently chunked) manifest.
    let store = ShardStore::open(&data).unwrap();
    let coordinator = manifest(CHUNK);
    assert_eq!(coordinator.model_hash, m.model_hash);
    assert!(store.has_all(&coordinator, &all_names).unwrap());
    assert_eq!(store.path_for(&coordinator), copy.canonicalize().unwrap());
    assert_eq!(store.verify(&m).unwrap().chunks_bad, 0);
    drop(store);

    // The adopted file is replaced by something else: the adoption lapses, nothing is assumed.
    std::fs::write(&copy, b"not the model any more").unwrap();
    let store = ShardStore::open(&data).unwrap();
    assert!(!store.has_all(&m, &["token_embd.weight"]).unwrap());
    let r = fetch_all_from_file(&store, &m, &["token_embd.weight".to_string()]);
    assert_eq!(
        r.bytes_transferred,
        m.header.len + m.tensor("token_embd.weight").unwrap().len
    );
    assert_ne!(store.path_for(&m), copy.canonicalize().unwrap());
}

#[cfg(unix)]
#[test]
fn the_local_file_is_sparse() {
    use std::os::unix::fs::MetadataExt;
    let path = test_model("small-qwen3-Q8_0.gguf");
    let m = Manifest::from_gguf_with(&path, 64 << 10, &mut |_, _| {}).unwrap();
    let names = m.layer_tensor_names(0..1);
    let dir = TempDir::new("sparse");
    let store = ShardStore::open(dir.path()).unwrap();
    let source = FileSource::open(&path).unwrap();
    let r = fetch(&store, &m, &names, &source, &mut no_progress()).unwrap();
    let meta = std::fs::metadata(store.path_for(&m)).unwrap();
    let allocated = meta.blocks() * 512;
    assert_eq!(meta.len(), m.file_len);
    assert!(
        allocated < m.file_len / 2,
        "{allocated} bytes allocated for {} received of a {}-byte file",
        r.bytes_transferred,
        m.file_len
    );
}
