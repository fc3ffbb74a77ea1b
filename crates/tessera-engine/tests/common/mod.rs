//! Shared helpers for the engine's model tests.
#![allow(dead_code)]

use std::path::PathBuf;

use tessera_engine::{KvCache, LoadSpec, Model};
use tessera_model::GgufFile;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn model_path(name: &str) -> PathBuf {
    let p = repo_root().join("models").join(name);
    if p.exists() {
        p
    } else {
        repo_root().join("models/test").join(name)
    }
}

pub fn open(name: &str) -> GgufFile {
    GgufFile::open(model_path(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

pub fn load(g: &GgufFile, spec: LoadSpec, threads: usize) -> Model {
    Model::load(g, spec, threads, &mut |_, _| {}).expect("load")
}

pub fn full(g: &GgufFile, threads: usize) -> Model {
    Model::load_full(g, threads).expect("load")
}

pub fn kv_for(m: &Model) -> KvCache {
    m.new_kv(m.config().context_length)
}

/// Bitwise equality of float slices, with the first difference on failure.
pub fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
    }
}
