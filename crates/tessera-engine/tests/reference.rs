//! Guards agreement with llama.cpp: every reference file in `reference/` (see its README).
//! F32 models: greedy continuation exactly, top-5 log-probs within 1e-4. Quantized and
//! F16/BF16 models: teacher forcing, top-1 where llama.cpp's margin > 0.01, top-5 log-probs
//! within 0.02.

mod common;

use serde_json::Value;
use tessera_engine::ops::{argmax, log_softmax};
use tessera_engine::KvType;

const F32_LOGPROB_TOL: f64 = 1e-4;
const QUANT_LOGPROB_TOL: f64 = 0.02;
const MARGIN: f64 = 0.01;
/// For [`KNOWN_KERNEL_DRIFT`] files: still catches a broken layer, not the kernels' rounding.
const LOOSE_LOGPROB_TOL: f64 = 0.15;
const LOOSE_MARGIN: f64 = 0.3;
/// With an F16 KV cache (llama.cpp's references used F32), on the files whose activations stay
/// in floats (F32, F16, BF16 weights): keys and values rounded to 11 significant bits and the
/// fused attention's online softmax move log-probs by up to ~0.04 (measured: 5e-3 to 3.7e-2).
/// Files with 8-bit activations or routed experts are not held to a bound with an F16 cache:
/// there a change in the last bits of an attention output flips an activation rounding or an
/// expert choice of these random-weight models (measured up to 0.26 on dense Q4_0/Q8_0 and
/// 0.2 on K-quants, 1.5–7 on MoE), as it does between any two attention implementations.
const F16_CACHE_LOGPROB_TOL: f64 = 0.05;
const F16_CACHE_MARGIN: f64 = 0.05;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// (id, logprob) of llama.cpp's top 5 and its margin at one position.
fn top5(v: &Value) -> (Vec<(u32, f64)>, f64) {
    let t = v["top5"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["id"].as_u64().unwrap() as u32,
                x["logprob"].as_f64().unwrap(),
            )
        })
        .collect();
    (t, v["margin"].as_f64().unwrap())
}

/// Checks one file; returns a list of failures (empty when it passes) and the worst log-prob
/// difference seen.
fn check_file(path: &std::path::Path, loose: bool, kv_type: KvType) -> (Vec<String>, f64) {
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let model_name = doc["model"].as_str().unwrap();
    let f16_cache = kv_type != KvType::F32;
    let exact = (model_name.contains("stories260K") || model_name.contains("f32")) && !f16_cache;
    let g = common::open(model_name);
    // llama.cpp's reference runs used an F32 cache.
    let model = common::full_kv(&g, 2, kv_type);
    let mut failures = Vec::new();
    let mut worst = 0.0f64;
    for (ri, r) in doc["results"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&r["prompt_token_ids"]);
        let expected = ids(&r["generated_token_ids"]);
        let positions = r["top5"].as_array().unwrap();
        // Log-prob rows at each generated position, from teacher forcing (all models) in one
        // forward over prompt + reference continuation.
        let mut kv = common::kv_for(&model);
        let mut all = prompt.clone();
        all.extend_from_slice(&expected[..expected.len() - 1]);
        let logits = model.forward(&all, &mut kv).unwrap();
        // llama-server reports top-5 entries per *emitted piece*: after a byte token that leaves
        // UTF-8 incomplete, entries skip positions (their `pos` field counts entries, not
        // tokens). Align each entry to the next generated position with its `chosen_id`.
        let mut next = 0;
        for pos in positions {
            let chosen = pos["chosen_id"].as_u64().unwrap() as u32;
            let Some(off) = expected[next..].iter().position(|&t| t == chosen) else {
                failures.push(format!("prompt {ri}: cannot align top-5 entry {pos}"));
                break;
            };
            let i = next + off;
            next = i + 1;
            let row = logits.row(prompt.len() - 1 + i);
            let lp = log_softmax(row);
            let (t5, margin) = top5(pos);
            let (tol, min_margin) = if exact {
                (F32_LOGPROB_TOL, MARGIN)
            } else if f16_cache {
                (F16_CACHE_LOGPROB_TOL, F16_CACHE_MARGIN.max(MARGIN))
            } else if loose {
                (LOOSE_LOGPROB_TOL, LOOSE_MARGIN)
            } else {
                (QUANT_LOGPROB_TOL, MARGIN)
            };
            for &(id, want) in &t5 {
                let d = (lp[id as usize] - want).abs();
                worst = worst.max(d);
                if d > tol {
                    failures.push(format!(
                        "prompt {ri} pos {i}: logprob of {id} {} vs llama.cpp {want} (diff {d:.2e})",
                        lp[id as usize]
                    ));
                }
            }
            if (exact || margin > min_margin) && argmax(row) as u32 != t5[0].0 {
                failures.push(format!(
                    "prompt {ri} pos {i}: top-1 {} vs llama.cpp {} (margin {margin})",
                    argmax(row),
                    t5[0].0
                ));
            }
        }
        if exact {
            // Free-running greedy generation must reproduce the ids exactly.
            let mut kv = common::kv_for(&model);
            let mut logits = model.forward_last(&prompt, &mut kv).unwrap();
            let mut got = Vec::new();
            for _ in 0..expected.len() {
                let t = argmax(logits.last()) as u32;
                got.push(t);
                logits = model.forward_last(&[t], &mut kv).unwrap();
            }
            if got != expected {
                failures.push(format!(
                    "prompt {ri}: greedy ids differ\n  got      {got:?}\n  expected {expected:?}"
                ));
            }
        }
    }
    (failures, worst)
}

/// Quantized files whose teacher-forced log-probs drift past 0.02 (up to ~0.13) while every
/// other file agrees to ~1e-5. For these K-quant files llama.cpp itself does not agree with
/// itself: with its tensors dumped (`llama-eval-callback`, ggml 0.25.3, the reference build),
/// the Q/K/V projections of the same row differ in the last bits between a prompt batch and one
/// token at a time (Q4_K: repacked gemm vs gemv; Q6_K: ~200 of 256 outputs), and an 8-bit
/// activation rounding later turns that into a visible difference. The reference's generated
/// positions come from its one-token path; this engine is batch-invariant and, on the checked
/// position (small-qwen3-Q6_K, prompt 1, generated row 10), equals llama.cpp's *batch* result to
/// 1e-6. These files are checked with a loose bound by
/// `quantized_models_match_llama_cpp_by_teacher_forcing`, and by
/// `drift_only_where_llama_cpp_disagrees_with_itself`, which pins the exact positions where
/// the strict bound does not hold.
const KNOWN_KERNEL_DRIFT: [&str; 2] = ["small-qwen3-Q4_K", "small-qwen3-Q6_K"];

fn reference_files() -> Vec<std::path::PathBuf> {
    let dir = common::repo_root().join("reference");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    files
}

/// Checks the files `select` picks (loosely where `loose` says so); returns the names that
/// failed.
fn check_files(
    select: impl Fn(&str) -> bool,
    loose: impl Fn(&str) -> bool,
    kv_type: KvType,
) -> Vec<String> {
    let mut failed = Vec::new();
    for f in reference_files() {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        if !select(&name) {
            continue;
        }
        let (fails, worst) = check_file(&f, loose(&name), kv_type);
        let status = match (fails.is_empty(), loose(&name)) {
            (false, _) => "FAILED",
            (true, true) => "ok within the loose bound",
            (true, false) => "ok",
        };
        println!(
            "{name}: {status} (worst log-prob diff {worst:.2e}, {} failing checks)",
            fails.len()
        );
        for x in fails.iter().take(5) {
            println!("    {x}");
        }
        if !fails.is_empty() {
            failed.push(name);
        }
    }
    failed
}

fn is_f32(name: &str) -> bool {
    name.contains("stories260K") || name.contains("-f32")
}

fn drifts(name: &str) -> bool {
    KNOWN_KERNEL_DRIFT
        .iter()
        .any(|d| name.strip_suffix("-public.json") == Some(d))
}

#[test]
fn f32_models_match_llama_cpp_greedy_exactly() {
    let failed = check_files(is_f32, |_| false, KvType::F32);
    assert!(failed.is_empty(), "files failing: {failed:?}");
}

#[test]
fn quantized_models_match_llama_cpp_by_teacher_forcing() {
    let failed = check_files(|n| !is_f32(n), drifts, KvType::F32);
    assert!(failed.is_empty(), "files failing: {failed:?}");
}

/// The strict check on [`KNOWN_KERNEL_DRIFT`] files fails at exactly these checks (file, prompt,
/// generated positions) — the positions downstream of llama.cpp's batch/one-token disagreement —
/// and nowhere else; each stays within [`LOOSE_LOGPROB_TOL`] (the loose check). A new failing
/// position (a real regression) or a vanished one (the drift understood and fixed) fails the
/// test, so the list stays exact.
const DRIFT_POSITIONS: &[(&str, usize, &[usize])] = &[
    (
        "small-qwen3-Q4_K",
        0,
        &[
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 18, 21, 23, 24, 25, 28, 29, 30,
            31,
        ],
    ),
    (
        "small-qwen3-Q4_K",
        2,
        &[
            0, 2, 3, 4, 5, 6, 8, 11, 12, 13, 14, 15, 16, 17, 19, 20, 21, 22, 23, 24, 25, 26, 27,
            28, 29, 30, 31,
        ],
    ),
    ("small-qwen3-Q6_K", 0, &[6]),
    (
        "small-qwen3-Q6_K",
        1,
        &[
            10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
        ],
    ),
];

#[test]
fn drift_only_where_llama_cpp_disagrees_with_itself() {
    let mut seen: Vec<(String, usize, usize)> = Vec::new();
    for f in reference_files() {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        if !drifts(&name) {
            continue;
        }
        let (loose_fails, _) = check_file(&f, true, KvType::F32);
        assert!(
            loose_fails.is_empty(),
            "{name} beyond the loose bound: {loose_fails:?}"
        );
        let (strict_fails, worst) = check_file(&f, false, KvType::F32);
        println!("{name}: worst log-prob diff {worst:.3e}");
        let file = name.strip_suffix("-public.json").unwrap().to_string();
        for x in &strict_fails {
            println!("    {x}");
            let (ri, i) = prompt_and_position(x);
            if !seen.contains(&(file.clone(), ri, i)) {
                seen.push((file.clone(), ri, i));
            }
        }
    }
    seen.sort();
    let mut want: Vec<(String, usize, usize)> = DRIFT_POSITIONS
        .iter()
        .flat_map(|&(f, r, ps)| ps.iter().map(move |&p| (f.to_string(), r, p)))
        .collect();
    want.sort();
    let listed: String = seen
        .iter()
        .map(|(f, r, p)| format!("    ({f}, prompt {r}, position {p})\n"))
        .collect();
    assert_eq!(
        seen, want,
        "the strict check now fails at other places than DRIFT_POSITIONS lists; they are:\n{listed}"
    );
}

/// `(prompt, position)` of a failure line `"prompt R pos I: ..."`.
fn prompt_and_position(line: &str) -> (usize, usize) {
    let mut w = line.split_whitespace();
    let (Some("prompt"), Some(r), Some("pos"), Some(i)) = (w.next(), w.next(), w.next(), w.next())
    else {
        panic!("not a per-position failure: {line}");
    };
    (
        r.trim_end_matches(':').parse().unwrap(),
        i.trim_end_matches(':').parse().unwrap(),
    )
}

#[test]
fn f16_cache_stays_within_its_tolerance_of_llama_cpp() {
    // Teacher-forced, with the default F16 cache and the fused attention (see
    // F16_CACHE_LOGPROB_TOL for which files and why).
    let float_acts = |n: &str| is_f32(n) || n.contains("-F16-") || n.contains("-BF16-");
    let failed = check_files(float_acts, |_| false, KvType::F16);
    assert!(failed.is_empty(), "files failing: {failed:?}");
}
