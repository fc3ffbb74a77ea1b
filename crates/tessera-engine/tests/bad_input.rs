//! Guards error handling: bad requests and bad files are errors that name what is wrong,
//! never panics.

mod common;

use tessera_engine::{EngineError, LoadSpec, LocalExperts, Model, SeqStep};
use tessera_model::{GgufFile, ModelConfig};

#[test]
fn prompt_longer_than_context_is_an_error_naming_the_limit() {
    let g = common::open("stories260K.gguf");
    let m = common::full(&g, 1);
    let n_ctx = m.config().context_length;
    let prompt = vec![5u32; n_ctx + 1];
    let mut kv = common::kv_for(&m);
    let err = m.forward(&prompt, &mut kv).unwrap_err();
    assert!(matches!(err, EngineError::ContextOverflow { .. }), "{err}");
    assert!(err.to_string().contains(&n_ctx.to_string()), "{err}");
    assert_eq!(kv.len(), 0, "a refused step leaves the cache untouched");
    // A smaller cache capacity is a limit too.
    let mut small = m.new_kv(4);
    let err = m.forward(&[1, 2, 3, 4, 5], &mut small).unwrap_err();
    assert!(err.to_string().contains("limit is 4"), "{err}");
    // And a step past the end of a nearly full cache.
    let mut kv = m.new_kv(3);
    m.forward(&[1, 2, 3], &mut kv).unwrap();
    let err = m.step(&mut [(4, &mut kv)]).unwrap_err();
    assert!(err.to_string().contains("limit is 3"), "{err}");
}

#[test]
fn running_layers_that_are_not_loaded_is_an_error() {
    let g = common::open("stories260K.gguf");
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let m = common::load(&g, LoadSpec::stage(&cfg, 0..2), 1);
    let mut kv = m.new_kv(16);
    let mut h = m.embed(&[1, 2]).unwrap();
    let step = [SeqStep {
        n_tokens: 2,
        start_pos: 0,
    }];
    let err = m
        .run_layers(2..5, &mut h, &step, &mut [&mut kv], &mut LocalExperts(&m))
        .unwrap_err();
    assert!(matches!(err, EngineError::LayersNotLoaded { .. }), "{err}");
    assert!(
        err.to_string().contains("2..5") && err.to_string().contains("0..2"),
        "{err}"
    );
    // The first stage has no head; the second no embedding.
    assert!(matches!(m.head(&h), Err(EngineError::NotLoaded { .. })));
    let last = common::load(&g, LoadSpec::stage(&cfg, 2..5), 1);
    assert!(matches!(
        last.embed(&[1]),
        Err(EngineError::NotLoaded { .. })
    ));
    // Out-of-vocabulary tokens and mismatched batches are refused.
    assert!(matches!(
        m.embed(&[100_000]),
        Err(EngineError::BadToken { .. })
    ));
    let err = m
        .run_layers(
            0..2,
            &mut h,
            &[SeqStep {
                n_tokens: 3,
                start_pos: 0,
            }],
            &mut [&mut kv],
            &mut LocalExperts(&m),
        )
        .unwrap_err();
    assert!(matches!(err, EngineError::BadInput(_)), "{err}");
    // A bad layer range in a spec.
    let err = Model::load(&g, LoadSpec::stage(&cfg, 3..9), 1, &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("3..9"), "{err}");
}

#[test]
fn asking_for_an_expert_that_is_not_held_is_an_error() {
    let g = common::open("tiny-qwen3moe-f32.gguf");
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let mut spec = LoadSpec::full(&cfg);
    spec.experts = tessera_engine::ExpertSelection::same_in_every_layer(&[0], cfg.n_layer);
    let m = common::load(&g, spec, 1);
    let mut kv = m.new_kv(16);
    let err = m.forward(&[1, 2, 3, 4], &mut kv).unwrap_err();
    assert!(matches!(err, EngineError::ExpertNotLoaded { .. }), "{err}");
}

/// Rewrites the type id of tensor `name` in a GGUF image (its tensor-info record).
fn set_tensor_type(bytes: &mut [u8], name: &str, type_id: u32) {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .expect("tensor info record");
    let p = at + needle.len();
    let n_dims = u32::from_le_bytes(bytes[p..p + 4].try_into().unwrap()) as usize;
    let t = p + 4 + 8 * n_dims;
    bytes[t..t + 4].copy_from_slice(&type_id.to_le_bytes());
}

#[test]
fn unsupported_tensor_type_is_an_error_naming_the_tensor() {
    let mut bytes = std::fs::read(common::model_path("tiny-qwen3-f32.gguf")).unwrap();
    set_tensor_type(&mut bytes, "blk.1.attn_k.weight", 9); // Q8_1: not supported
    let dir = std::env::temp_dir().join(format!("tessera-bad-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("q8_1.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let result = GgufFile::open(&path)
        .map_err(EngineError::from)
        .and_then(|g| Model::load_full(&g, 1));
    let err = result.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("blk.1.attn_k.weight") && msg.contains("Q8_1"),
        "{msg}"
    );
    // A part that does not hold layer 1 loads fine: the bad tensor is never read.
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let m = Model::load(&g, LoadSpec::stage(&cfg, 0..1), 1, &mut |_, _| {}).unwrap();
    assert_eq!(m.spec().layers, 0..1);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn truncated_file_is_an_error() {
    let bytes = std::fs::read(common::model_path("tiny-qwen3-f32.gguf")).unwrap();
    let dir = std::env::temp_dir().join(format!("tessera-trunc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("trunc.gguf");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert!(GgufFile::open(&path).is_err());
    std::fs::remove_dir_all(&dir).ok();
}
