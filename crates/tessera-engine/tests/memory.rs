//! Guards partial loading: a process holding layers `[0, L/2)` keeps measurably fewer bytes
//! resident than one holding the whole model — by the model's own count and by the process's
//! resident set, measured in a fresh child process per case (the test runs itself again with
//! `TESSERA_MEMORY_CASE` set).

mod common;

use tessera_engine::LoadSpec;
use tessera_model::ModelConfig;

/// The largest model in the repository (6 MB, 8 layers): nothing outside it is read.
fn model() -> std::path::PathBuf {
    common::model_path("small-qwen3moe-Q8_0.gguf")
}

const TEST: &str = "memory_half_model_is_smaller_than_whole";

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    let pages: u64 = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4
}

/// Child side: loads `case` and prints its figures.
fn memory_child(case: &str) {
    let g = tessera_model::GgufFile::open(model()).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let before = rss_kib();
    let spec = match case {
        "half" => LoadSpec::stage(&cfg, 0..cfg.n_layer / 2),
        _ => LoadSpec::full(&cfg),
    };
    let m = tessera_engine::Model::load(&g, spec, 1, &mut |_, _| {}).unwrap();
    // Touch the weights as a forward pass would (the first stage runs its layers).
    let mut kv = m.new_kv(8);
    let mut h = m.embed(&[1, 2, 3]).unwrap();
    let l = m.spec().layers.clone();
    m.run_layers(
        l,
        &mut h,
        &[tessera_engine::SeqStep {
            n_tokens: 3,
            start_pos: 0,
        }],
        &mut [&mut kv],
        &mut tessera_engine::LocalExperts(&m),
    )
    .unwrap();
    let after = rss_kib();
    println!(
        "MEMORY resident_bytes={} rss_delta_kib={}",
        m.resident_bytes(),
        after.saturating_sub(before)
    );
}

fn run_child(case: &str) -> (u64, u64) {
    let out = common::self_command()
        .args(["--exact", TEST, "--nocapture"])
        .env("TESSERA_MEMORY_CASE", case)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("MEMORY "))
        .unwrap_or_else(|| {
            panic!(
                "child printed no figures:\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let field = |k: &str| -> u64 {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(k))
            .unwrap()
            .parse()
            .unwrap()
    };
    (field("resident_bytes="), field("rss_delta_kib=") * 1024)
}

#[test]
fn memory_half_model_is_smaller_than_whole() {
    if let Ok(case) = std::env::var("TESSERA_MEMORY_CASE") {
        return memory_child(&case);
    }
    let (half_res, half_rss) = run_child("half");
    let (full_res, full_rss) = run_child("full");
    println!("model {}", model().display());
    println!("layers [0, L/2): resident_bytes {half_res}, RSS growth {half_rss} bytes");
    println!("whole model:     resident_bytes {full_res}, RSS growth {full_rss} bytes");
    assert!(
        half_res * 10 < full_res * 7,
        "resident bytes: half {half_res} vs full {full_res}"
    );
    assert!(
        half_rss * 10 < full_rss * 8,
        "RSS growth: half {half_rss} vs full {full_rss}"
    );
}

#[test]
fn a_stage_looks_its_embedding_up_where_it_lies_in_the_file() {
    let g = tessera_model::GgufFile::open(model()).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let load = |spec| tessera_engine::Model::load(&g, spec, 1, &mut |_, _| {}).unwrap();
    let first = load(LoadSpec::stage(&cfg, 0..cfg.n_layer / 2));
    let whole = load(LoadSpec::full(&cfg));
    // The first stage keeps no copy of the table: its rows are read from the mapping.
    let w = first.weights();
    assert!(w.token_embd.is_none() && w.token_rows.is_some());
    let rows = w.token_rows.as_ref().unwrap();
    assert_eq!(rows.rows(), cfg.vocab_size);
    // The same values as the whole model's lookup (a tied head's repacked matrix, or the same
    // rows where the head is untied).
    let tokens: Vec<u32> = vec![0, 1, 7, cfg.vocab_size as u32 - 1];
    let (a, b) = (first.embed(&tokens).unwrap(), whole.embed(&tokens).unwrap());
    assert_eq!(a.data, b.data);
    assert!(a.data.iter().any(|&x| x != 0.0));
    assert!(first.embed(&[cfg.vocab_size as u32]).is_err());
}
