//! Q4_1 and Q5_1 files (issue #30): `tiny-qwen3-f32` quantized by `llama-quantize --pure` load,
//! and their logits follow the F32 model's within the quantization noise. Their agreement with
//! llama.cpp is in `reference` (tiny-qwen3-Q4_1, small-qwen3-Q4_1 and small-qwen3-Q5_1 under the
//! strict tolerance; tiny-qwen3-Q5_1 has no reference file: one activation rounding at a tie
//! goes the other way, see models/README.md), their
//! bit-identity across instruction sets in `isa_paths`.

mod common;

const PROMPT: [u32; 6] = [1, 317, 391, 266, 267, 290];

fn prompt_logits(name: &str) -> Vec<f32> {
    let g = common::open(&format!("test/{name}"));
    let m = common::full(&g, 2);
    let mut kv = common::kv_for(&m);
    m.forward(&PROMPT, &mut kv).expect("prefill").data
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[test]
fn q4_1_and_q5_1_files_follow_the_f32_model() {
    let f32_logits = prompt_logits("tiny-qwen3-f32.gguf");
    // The same tool's Q4_0 equals llama-quantize's `tiny-qwen3-Q4_0` byte for byte: that file
    // is the yardstick for 4-bit noise on this model.
    let cos: Vec<f64> = [
        "tiny-qwen3-Q4_0.gguf",
        "tiny-qwen3-Q4_1.gguf",
        "tiny-qwen3-Q5_1.gguf",
    ]
    .iter()
    .map(|name| {
        let got = prompt_logits(name);
        assert_eq!(got.len(), f32_logits.len(), "{name}");
        assert!(got.iter().all(|v| v.is_finite()), "{name}");
        let c = cosine(&got, &f32_logits);
        eprintln!("{name}: cosine with F32 {c:.5}");
        c
    })
    .collect();
    // Q4_1 (an offset per block) is at least as close as Q4_0; 5 bits closer still.
    assert!(
        cos[1] >= cos[0] && cos[2] > cos[1] && cos[2] > 0.95,
        "{cos:?}"
    );
}
