//! The shard store and the engine together: a partial copy of a model (what a node fetched for
//! its assignment) loads what was fetched and refuses, by name, what was not — never reading its
//! holes as zeros.

use std::path::Path;

use tessera_engine::{EngineError, ExpertSelection, ExpertStreaming, LoadSpec, Model};
use tessera_host::store::{expert_needs, fetch_needs, FileSource, Manifest, ShardStore};
use tessera_model::{GgufFile, ModelConfig, ModelError};

/// The holes of a partial copy are refused, not read as zeros: a load of what was fetched
/// works, one that reaches past it (a stage's other layers, experts never fetched, whole or
/// streamed) fails with `NotFetched` naming the tensor.
#[test]
fn a_partial_copy_refuses_what_it_never_received() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/test/tiny-qwen3moe-Q8_0.gguf");
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let m = Manifest::from_gguf_with(&path, 4 << 10, &mut |_, _| {}).unwrap();
    let dir = std::env::temp_dir().join(format!("tessera-store-partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = ShardStore::open(&dir).unwrap();
    let source = FileSource::open(&path).unwrap();
    // Layer 0 and the embedding, with experts 0..4 of 8.
    let mut names = m.layer_tensor_names(0..1);
    names.push("token_embd.weight".into());
    let held = vec![vec![0, 1, 2, 3]];
    let needs = expert_needs(&g, &names, &held).unwrap();
    fetch_needs(&store, &m, &needs, &source, &mut |_| {}).unwrap();
    let partial = store.open_model(&m).unwrap();
    assert!(partial.is_partial());

    let stage = |layers, experts| LoadSpec {
        experts,
        ..LoadSpec::stage(&cfg, layers)
    };
    let fetched = stage(0..1, ExpertSelection::PerLayer(held.clone()));
    Model::load(&partial, fetched.clone(), 1, &mut |_, _| {}).expect("what was fetched loads");
    let not_fetched = |e: EngineError, want: &str| match e {
        EngineError::Model(ModelError::NotFetched {
            tensor, start, end, ..
        }) => {
            assert!(tensor.contains(want), "{tensor} is not {want}");
            assert!(start < end);
        }
        other => panic!("expected NotFetched for {want}, got {other}"),
    };
    // A layer never fetched (layer 0 as fetched).
    let two = ExpertSelection::PerLayer(vec![held[0].clone(), (0..cfg.n_expert).collect()]);
    let err = Model::load(&partial, stage(0..2, two), 1, &mut |_, _| {}).unwrap_err();
    not_fetched(err, "blk.1.");
    // Experts 4.. of layer 0, loaded or streamed.
    let all = stage(0..1, ExpertSelection::All);
    let err = Model::load(&partial, all.clone(), 1, &mut |_, _| {}).unwrap_err();
    not_fetched(err, "_exps.weight");
    let streaming = ExpertStreaming::with_budget(64 << 20);
    let err =
        Model::load_streaming(&partial, all, streaming.clone(), 1, &mut |_, _| {}).unwrap_err();
    not_fetched(err, "blk.0.ffn_gate_exps.weight");
    Model::load_streaming(&partial, fetched, streaming, 1, &mut |_, _| {})
        .expect("the fetched experts stream");
    // The error names the bytes: the message says they were never received.
    let err = partial
        .tensor_bytes(partial.tensor("output_norm.weight").unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("never received"), "{err}");
    // The same bytes through the complete original read as usual.
    assert!(g
        .tensor_bytes(g.tensor("output_norm.weight").unwrap())
        .is_ok());
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}
