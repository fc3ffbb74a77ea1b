//! Tokenizer speed: encodes and decodes a megabyte of text (and one long word without merges)
//! with the SentencePiece vocabulary of `models/stories260K.gguf` and the byte-level BPE of
//! `models/test/tiny-qwen3-f32.gguf`, and prints MB/s. The tests check that the same inputs
//! round-trip; how fast is measured here.
//!
//! ```sh
//! cargo run --release -p tessera-model --example tokenizer_bench [-- --reps 5]
//! ```

use std::path::Path;
use std::time::Instant;

use tessera_model::{GgufFile, Tokenizer};

fn load(path: &Path) -> Tokenizer {
    let g = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(&g).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Best of `reps` runs of `f`, in seconds.
fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("--reps N"))
        .unwrap_or(3);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cases = [
        (
            "spm stories260K",
            root.join("models/stories260K.gguf"),
            "Once upon a time, there was a little girl named Lily. 🎉 Ünïcödé\n",
            "🦀",
        ),
        (
            "bpe qwen3",
            root.join("models/test/tiny-qwen3-f32.gguf"),
            "the world's 12345 worlds, hello\n\n  🎉 ",
            "the",
        ),
    ];
    println!("tokenizer             input            MB/s encode   MB/s decode   tokens");
    for (name, path, unit, word_unit) in cases {
        let t = load(&path);
        let text = unit.repeat(1_000_000 / unit.len() + 1);
        let word = word_unit.repeat(1_000_000 / word_unit.len());
        for (input, s) in [("1 MB of text", &text), ("1 MB, one word", &word)] {
            let mut ids = Vec::new();
            let enc = best(reps, || ids = t.encode(s, false));
            let dec = best(reps, || {
                std::hint::black_box(t.decode(&ids));
            });
            let mb = s.len() as f64 / 1e6;
            println!(
                "{name:<21} {input:<16} {:>11.2}   {:>11.2}   {}",
                mb / enc,
                mb / dec,
                ids.len()
            );
        }
    }
}
