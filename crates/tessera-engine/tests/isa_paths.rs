//! Finds out whether logits depend on the kernel path (issue #15, verification by replication:
//! two workers' results can only be compared exactly if their paths agree). The instruction
//! set is fixed once per process, so the test runs itself again as a child per path with
//! `TESSERA_MAX_ISA` set, and compares the children's logits bit for bit.
//!
//! Finding: the scalar, AVX2 and AVX-512 paths (x86-64), and the scalar, NEON and
//! NEON + dotprod paths (aarch64, run under qemu-user in CI), give bit-identical logits
//! (prefill and decode) for every quantized type the fixtures cover, so replicas may be
//! compared across paths.
//!
//! The children are started through the cargo runner when one is set (`common::self_command`).

mod common;

use std::path::{Path, PathBuf};

use tessera_engine::kernels::{isa, kernel_path, Isa, MAX_ISA_ENV};
use tessera_engine::ops::argmax;

/// One fixture per weight type the kernels have (plus dense/MoE/latent-attention shapes; Q4_1
/// and Q5_1 in two widths: 2 and 8 blocks per row).
const FIXTURES: [&str; 26] = [
    "tiny-qwen3-Q4_0.gguf",
    "tiny-qwen3-Q4_1.gguf",
    "tiny-qwen3-Q5_1.gguf",
    "small-qwen3-Q4_1.gguf",
    "small-qwen3-Q5_1.gguf",
    "tiny-qwen3-Q8_0.gguf",
    "tiny-qwen3-f32.gguf",
    "small-qwen3-F16.gguf",
    "small-qwen3-BF16.gguf",
    "small-qwen3-Q2_K.gguf",
    "small-qwen3-Q3_K_M.gguf",
    "small-qwen3-Q4_K.gguf",
    "small-qwen3-Q5_K.gguf",
    "small-qwen3-Q6_K.gguf",
    "small-qwen3-IQ4_NL.gguf",
    "small-qwen3-IQ4_XS.gguf",
    "small-qwen3-IQ2_XXS.gguf",
    "small-qwen3-IQ2_XS.gguf",
    "small-qwen3-IQ2_S.gguf",
    "small-qwen3-IQ3_XXS.gguf",
    "small-qwen3-IQ3_S.gguf",
    "small-qwen3moe-Q4_K.gguf",
    "small-qwen3moe-IQ2_XXS.gguf",
    "tiny-gpt-oss-MXFP4.gguf",
    "tiny-deepseek2-mla-Q8_0.gguf",
    "tiny-deepseek2-mla-Q5_0.gguf",
];

const PROMPT: [u32; 6] = [1, 317, 391, 266, 267, 290];
const DECODE_STEPS: usize = 3;

/// Set in a child: the folder its logits go to.
const CHILD_OUT: &str = "TESSERA_ISA_PATHS_OUT";

/// Every position's logits of the prompt, then `DECODE_STEPS` greedy decode steps' logits.
fn logits(name: &str) -> Vec<f32> {
    let g = common::open(&format!("test/{name}"));
    let m = common::full(&g, 2);
    let mut kv = common::kv_for(&m);
    let mut out = m.forward(&PROMPT, &mut kv).expect("prefill").data;
    let mut next = argmax(&out[out.len() - m.config().vocab_size..]) as u32;
    for _ in 0..DECODE_STEPS {
        let l = m.forward_last(&[next], &mut kv).expect("decode");
        next = argmax(l.last()) as u32;
        out.extend_from_slice(l.last());
    }
    out
}

fn child(dir: &Path) {
    // First: an unknown name must panic here, at the first dispatch, not in this test's parse.
    let active = isa();
    let want: Isa = std::env::var(MAX_ISA_ENV).unwrap().parse().unwrap();
    // The cap took effect (the machine has every path this test asks for).
    assert_eq!(active, want);
    // What `tessera bench` and `inspect` print follows the cap: Q4_0 has a kernel on every
    // SIMD path, so it reports the active one.
    assert_eq!(kernel_path(tessera_model::GgmlType::Q4_0), active);
    for name in FIXTURES {
        let bytes: Vec<u8> = logits(name).iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// Runs this test in a child process capped to `cap`; returns its output folder.
fn run_child(cap: Isa) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-isa-{}-{cap}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = common::self_command()
        .args([
            "--exact",
            "logits_are_bit_identical_on_every_isa",
            "--nocapture",
        ])
        .env(MAX_ISA_ENV, cap.as_str())
        .env(CHILD_OUT, &dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cap} child failed:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    dir
}

fn read(dir: &Path, name: &str) -> Vec<f32> {
    std::fs::read(dir.join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn logits_are_bit_identical_on_every_isa() {
    if let Some(dir) = std::env::var_os(CHILD_OUT) {
        return child(Path::new(&dir));
    }
    let paths: Vec<Isa> = Isa::ALL.into_iter().filter(|i| i.available()).collect();
    // On x86-64 CI machines (AVX2 at least) there is always a pair to compare, and on
    // aarch64 (NEON is part of the architecture) too; under CI's `qemu-aarch64 -cpu max`,
    // which has the dot-product extension, all three aarch64 paths.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    assert!(paths.len() >= 2, "this machine has only {paths:?}");
    println!("kernel paths compared: {paths:?}");
    // CI's aarch64 step runs under `qemu-aarch64 -cpu max`: the dotprod path must be among
    // them there, or its kernels would go untested without a word.
    #[cfg(target_arch = "aarch64")]
    if std::env::var_os("CI").is_some() {
        assert!(
            paths.contains(&Isa::Dotprod),
            "CI without dotprod: {paths:?}"
        );
    }
    let dirs: Vec<(Isa, PathBuf)> = paths.iter().map(|&i| (i, run_child(i))).collect();
    let (base, base_dir) = &dirs[0];
    for name in FIXTURES {
        let want = read(base_dir, name);
        assert!(
            want.iter().all(|v| v.is_finite()),
            "{name}: non-finite logits"
        );
        for (other, dir) in &dirs[1..] {
            common::assert_bits_eq(
                &read(dir, name),
                &want,
                &format!("{name}: {other} vs {base}"),
            );
        }
    }
    for (_, dir) in dirs {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// A misspelt cap is refused at the first dispatch, naming the variable and the choices.
#[test]
fn an_unknown_isa_name_is_refused() {
    if std::env::var_os(CHILD_OUT).is_some() {
        return;
    }
    let out = common::self_command()
        .args(["--exact", "logits_are_bit_identical_on_every_isa"])
        .env(MAX_ISA_ENV, "avx3")
        .env(CHILD_OUT, std::env::temp_dir())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(r#"TESSERA_MAX_ISA="avx3": unknown instruction set "avx3": expected scalar, neon, dotprod, avx2 or avx512"#),
        "{text}"
    );
}
