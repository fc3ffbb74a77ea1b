//! GGUF header parser: `GgufFile::parse` must never panic and must allocate in proportion to
//! its input; whatever parses goes on through the model config, profile and tokenizer readers.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_model::{GgufFile, ModelConfig, ModelProfile, Tokenizer};

#[path = "common.rs"]
mod common;

#[global_allocator]
static ALLOC: common::BoundedAlloc = common::BoundedAlloc;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufFile::parse(data) else {
        return;
    };
    // Everything a parsed file promises: accessors agree with each other and stay in the file.
    assert_eq!(g.file_len(), data.len() as u64);
    for t in g.tensors() {
        assert!(g.tensor(&t.name).is_some());
        assert!(
            t.offset >= g.data_offset(),
            "tensor {} before the data section",
            t.name
        );
        assert!(t.offset.saturating_add(t.n_bytes) <= g.file_len());
        let _ = t.n_elements();
    }
    for (k, v) in g.metadata() {
        assert!(g.meta(k).is_some());
        let _ = (
            v.as_u64(),
            v.as_f64(),
            v.as_str(),
            v.as_bool(),
            v.as_array(),
        );
    }
    if let Ok(cfg) = ModelConfig::from_gguf(&g) {
        let _ = (cfg.is_moe(), cfg.q_dim(), cfg.kv_dim());
        let _ = cfg.expected_tensors();
    }
    if let Ok(p) = ModelProfile::from_gguf(&g) {
        let _ = (p.weight_bytes(), p.active_bytes_per_token());
        let _ = p.to_string();
    }
    if let Ok(tok) = Tokenizer::from_gguf(&g) {
        let ids = tok.encode("Once upon a time, \u{1F600} <s>", true);
        let _ = tok.decode(&ids);
    }
});
