//! A gguf-split model in the store: described, served, fetched and adopted as the one file its
//! parts make, so a node receives a plain GGUF whose tensors are the original's.

mod common;

use common::{test_model, TempDir};
use tessera_host::{fetch, FileSource, Manifest, ShardStore};
use tessera_model::{GgufFile, SplitOptions};

const MODEL: &str = "tiny-qwen3-Q8_0.gguf";
const CHUNK: u32 = 4096;

/// The model split in three parts under `dir`; the first part's path.
fn split(dir: &TempDir) -> std::path::PathBuf {
    let whole = GgufFile::open(test_model(MODEL)).unwrap();
    let options = SplitOptions {
        max_tensors: whole.tensors().len().div_ceil(3),
        metadata_only_first: false,
    };
    let parts = tessera_model::gguf::write_parts(&whole, &dir.path().join("m"), options).unwrap();
    assert_eq!(parts.len(), 3);
    parts[0].clone()
}

#[test]
fn a_split_model_is_described_and_fetched_as_its_merged_file() {
    let dir = TempDir::new("split");
    let first = split(&dir);
    let joined = GgufFile::open(&first).unwrap();
    // The manifest of the parts is the manifest of the merged file written out.
    let merged_path = dir.path().join("merged.gguf");
    std::fs::write(
        &merged_path,
        joined.image_range(0..joined.file_len()).unwrap(),
    )
    .unwrap();
    let m = Manifest::from_gguf_with(&first, CHUNK, &mut |_, _| {}).unwrap();
    let m_merged = Manifest::from_gguf_with(&merged_path, CHUNK, &mut |_, _| {}).unwrap();
    assert_eq!(m, m_merged);

    // A node fetches every tensor from the parts and holds a plain GGUF equal to the original.
    let store = ShardStore::open(dir.path().join("node")).unwrap();
    let source = FileSource::open(&first).unwrap();
    let names: Vec<String> = m.tensors.iter().map(|t| t.name.clone()).collect();
    fetch(&store, &m, &names, &source, &mut |_| {}).unwrap();
    let local = store.open_model(&m).unwrap();
    assert!(!local.is_split());
    let original = GgufFile::open(test_model(MODEL)).unwrap();
    assert_eq!(local.metadata(), original.metadata());
    for t in original.tensors() {
        let l = local.tensor(&t.name).unwrap();
        assert_eq!(
            local.tensor_bytes(l).unwrap(),
            original.tensor_bytes(t).unwrap()
        );
    }

    // A node given the parts adopts them whole: nothing to fetch, and they verify.
    let adopter = ShardStore::open(dir.path().join("adopter")).unwrap();
    let adopted = adopter.adopt(&first).unwrap();
    assert_eq!(adopted.model_hash, m.model_hash);
    assert!(adopter.missing_chunks(&m, &names).unwrap().is_empty());
    let report = adopter.verify(&m).unwrap();
    assert_eq!(report.chunks_bad, 0);
    assert!(adopter.open_model(&m).unwrap().is_split());
}
