//! Shared helpers for the engine's model tests.
#![allow(dead_code)]

pub mod moe;

use std::ops::Range;
use std::path::PathBuf;
use std::process::Command;

use tessera_engine::{Hidden, KvCache, KvShape, KvType, LoadSpec, LocalExperts, Model, SeqStep};
use tessera_model::{GgufFile, ModelConfig};

/// A command that runs this test binary again (for tests that need a fresh process per case).
///
/// Under a cargo runner (`CARGO_TARGET_<TRIPLE>_RUNNER`, e.g. `qemu-aarch64 -L /usr/aarch64-linux-gnu`
/// for CI's aarch64 step), the child is started through that runner too: qemu-user does not
/// catch `execve`, and without `binfmt_misc` the kernel cannot run an aarch64 file itself, so
/// starting the binary directly fails. The runner is split on whitespace, as cargo splits it.
/// Natively (no runner set) the binary is started directly.
pub fn self_command() -> Command {
    let exe = std::env::current_exe().expect("the test binary's path");
    let runner = std::env::var(runner_env()).unwrap_or_default();
    let mut words = runner.split_whitespace();
    match words.next() {
        Some(program) => {
            let mut c = Command::new(program);
            c.args(words).arg(exe);
            c
        }
        None => Command::new(exe),
    }
}

/// `CARGO_TARGET_<TRIPLE>_RUNNER` for the triple this binary was compiled for.
fn runner_env() -> String {
    let env = if cfg!(target_env = "gnu") {
        "-gnu"
    } else if cfg!(target_env = "musl") {
        "-musl"
    } else {
        ""
    };
    let vendor = if cfg!(target_vendor = "apple") {
        "apple"
    } else if cfg!(target_vendor = "pc") {
        "pc"
    } else {
        "unknown"
    };
    let triple = format!(
        "{}-{vendor}-{}{env}",
        std::env::consts::ARCH,
        std::env::consts::OS
    );
    format!(
        "CARGO_TARGET_{}_RUNNER",
        triple.to_uppercase().replace('-', "_")
    )
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn model_path(name: &str) -> PathBuf {
    let p = repo_root().join("models").join(name);
    if p.exists() {
        p
    } else {
        repo_root().join("models/test").join(name)
    }
}

pub fn open(name: &str) -> GgufFile {
    GgufFile::open(model_path(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

pub fn load(g: &GgufFile, spec: LoadSpec, threads: usize) -> Model {
    Model::load(g, spec, threads, &mut |_, _| {}).expect("load")
}

pub fn full(g: &GgufFile, threads: usize) -> Model {
    Model::load_full(g, threads).expect("load")
}

/// [`load`] with a KV cache type.
pub fn load_kv(g: &GgufFile, spec: LoadSpec, threads: usize, t: KvType) -> Model {
    load(g, spec, threads).with_kv_type(t).expect("kv type")
}

/// [`full`] with a KV cache type.
pub fn full_kv(g: &GgufFile, threads: usize, t: KvType) -> Model {
    full(g, threads).with_kv_type(t).expect("kv type")
}

/// The KV cache types this model's heads allow (Q8_0 needs heads of whole 32-blocks).
pub fn kv_types(g: &GgufFile) -> Vec<KvType> {
    let shape = KvShape::from_config(&ModelConfig::from_gguf(g).expect("config"));
    KvType::ALL
        .into_iter()
        .filter(|t| t.check(shape).is_ok())
        .collect()
}

pub fn kv_for(m: &Model) -> KvCache {
    m.new_kv(m.config().context_length)
}

/// Runs `layers` of `m` on `h` for `step` with `kv`, `m` computing its own experts: one stage
/// of a pipeline (or the whole model) in the split tests.
pub fn run_local(
    m: &Model,
    layers: Range<usize>,
    h: &mut Hidden,
    step: &[SeqStep],
    kv: &mut KvCache,
) {
    m.run_layers(layers, h, step, &mut [kv], &mut LocalExperts(m))
        .unwrap();
}

/// Bitwise equality of float slices, with the first difference on failure.
pub fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
    }
}
