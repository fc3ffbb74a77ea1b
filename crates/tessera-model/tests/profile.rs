//! Profiles of the real test models, and errors for bad files on disk.

use std::path::PathBuf;

use tessera_model::{Architecture, GgufFile, ModelError, ModelProfile};

fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name)
}

#[test]
fn stories260k_profile_matches_its_known_geometry() {
    let g = GgufFile::open(model("stories260K.gguf")).unwrap();
    let p = ModelProfile::from_gguf(&g).unwrap();
    let c = &p.config;
    assert_eq!(c.arch, Architecture::Llama);
    assert_eq!(
        (c.n_embd, c.n_layer, c.n_head, c.n_head_kv, c.head_dim),
        (64, 5, 8, 4, 8)
    );
    assert_eq!((c.n_ff, c.vocab_size, c.context_length), (172, 512, 512));
    assert_eq!(p.kv_bytes_per_token, 2 * 5 * 32 * 4);
    assert!(p.parameter_count > 250_000 && p.parameter_count < 300_000);
    let text = p.to_string();
    assert!(text.contains("llama"), "{text}");
}

#[test]
fn qwen3moe_profile_splits_experts() {
    let g = GgufFile::open(model("test/tiny-qwen3moe-Q8_0.gguf")).unwrap();
    let p = ModelProfile::from_gguf(&g).unwrap();
    assert_eq!(p.config.arch, Architecture::Qwen3Moe);
    assert_eq!(p.config.n_expert, 8);
    for l in &p.layers {
        assert_eq!(l.experts.len(), 8);
        assert!(l.experts.iter().all(|&e| e == l.experts[0] && e > 0));
        assert!(l.router > 0 && l.attention > 0);
    }
    // Every byte of every tensor is attributed to exactly one part.
    let attributed: u64 = p.layers.iter().map(|l| l.total()).sum::<u64>()
        + p.embedding_bytes
        + p.head_bytes
        + p.output_norm_bytes;
    assert_eq!(attributed, p.weight_bytes());
    assert!(p.active_bytes_per_token() < p.weight_bytes());
}

#[test]
fn truncated_file_names_the_file_and_tensor() {
    let bytes = std::fs::read(model("test/tiny-qwen3-Q8_0.gguf")).unwrap();
    let dir = std::env::temp_dir().join(format!("tessera-trunc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cut.gguf");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, ModelError::BadTensor { .. }), "{err}");
    assert!(err.to_string().contains("cut.gguf"), "{err}");
    assert!(err.to_string().contains("outside the file"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn missing_file_is_an_io_error_with_the_path() {
    let err = GgufFile::open("/nonexistent/x.gguf").unwrap_err();
    assert!(err.to_string().contains("/nonexistent/x.gguf"));
}

/// Found by the `gguf` fuzz target: a 3 KB file claiming 16M layers made the shape check build
/// hundreds of millions of expected tensor names before failing.
#[test]
fn regression_huge_block_count_is_refused_without_allocating() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/regressions/gguf/block-count-16M");
    let bytes = std::fs::read(path).unwrap();
    let g = GgufFile::parse(&bytes).unwrap();
    let err = ModelProfile::from_gguf(&g).unwrap_err().to_string();
    assert!(err.contains("block_count"), "{err}");
}
