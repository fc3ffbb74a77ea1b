//! A gguf-split model runs as the whole file: its parts, written from a fixture, give logits
//! bit-identical to the unsplit file's over a prefill and greedy decode steps.

mod common;

use common::assert_bits_eq;
use tessera_engine::ops::argmax;
use tessera_engine::{ExpertStreaming, LoadSpec, Model};
use tessera_model::{GgufFile, ModelConfig, SplitOptions};

const PROMPT: [u32; 6] = [1, 403, 407, 261, 378, 42];
const DECODE_STEPS: usize = 4;

/// The logits of the prompt's last token and of each greedy decode step after it.
fn run(model: &Model) -> Vec<Vec<f32>> {
    let mut kv = common::kv_for(model);
    let mut logits = model.forward_last(&PROMPT, &mut kv).unwrap();
    let mut out = vec![logits.last().to_vec()];
    for _ in 0..DECODE_STEPS {
        let t = argmax(logits.last()) as u32;
        logits = model.forward_last(&[t], &mut kv).unwrap();
        out.push(logits.last().to_vec());
    }
    out
}

/// `name` split into three parts (the first metadata only, when asked) in `dir`, opened.
fn split_in_three(dir: &std::path::Path, name: &str, metadata_only_first: bool) -> GgufFile {
    let whole = common::open(name);
    let per_part = whole
        .tensors()
        .len()
        .div_ceil(3 - usize::from(metadata_only_first));
    let options = SplitOptions {
        max_tensors: per_part,
        metadata_only_first,
    };
    let parts = tessera_model::gguf::write_parts(&whole, &dir.join("m"), options).unwrap();
    assert_eq!(parts.len(), 3, "{name}");
    GgufFile::open(&parts[0]).unwrap()
}

#[test]
fn split_gguf_logits_are_bit_identical_to_the_whole_file() {
    for (name, metadata_only_first) in [
        ("stories260K.gguf", false),
        ("tiny-qwen3moe-Q8_0.gguf", true),
        ("tiny-qwen3-Q4_0.gguf", false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let joined = split_in_three(dir.path(), name, metadata_only_first);
        assert!(joined.is_split());
        let whole = run(&common::full(&common::open(name), 2));
        let split = run(&common::full(&joined, 2));
        for (i, (w, s)) in whole.iter().zip(&split).enumerate() {
            assert_bits_eq(w, s, &format!("{name}, step {i}"));
        }
        // A stage of the split model equals the same stage of the whole (a node's load).
        let cfg = ModelConfig::from_gguf(&joined).unwrap();
        let stage = common::load(&joined, LoadSpec::stage(&cfg, 0..cfg.n_layer), 1);
        assert_bits_eq(&run(&stage)[0], &whole[0], &format!("{name}, stage"));
    }
}

#[test]
fn streaming_experts_from_a_split_model_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let joined = split_in_three(dir.path(), "tiny-qwen3moe-Q8_0.gguf", false);
    let cfg = ModelConfig::from_gguf(&joined).unwrap();
    let err = Model::load_streaming(
        &joined,
        LoadSpec::full(&cfg),
        ExpertStreaming::with_budget(1 << 30),
        1,
        &mut |_, _| {},
    )
    .expect_err("refused")
    .to_string();
    assert!(err.contains("split model"), "{err}");
}
