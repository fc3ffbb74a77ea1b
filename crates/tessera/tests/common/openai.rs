//! The official OpenAI Python client (`tests/openai_api.py`) against a running server.

use std::path::PathBuf;
use std::process::Command;

/// Whether python3 with the `openai` package is available; under CI (`CI=true`) it must be.
pub fn openai_client_available() -> bool {
    python_modules_available(&["openai"])
}

/// Runs `tests/openai_api.py` against `url` (killed after 300 s) and asserts that it passed.
pub fn run_openai_script(url: &str) {
    run_script("openai_api.py", &[url], 300);
}

/// Whether python3 can import every one of `modules`; under CI (`CI=true`) it must (the
/// packages are installed by `.ci/run`), so a missing one fails the test instead of skipping.
pub fn python_modules_available(modules: &[&str]) -> bool {
    let code = modules
        .iter()
        .map(|m| format!("import {m}"))
        .collect::<Vec<_>>()
        .join("; ");
    let have = Command::new("python3")
        .args(["-c", &code])
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI must install the python packages {modules:?} (see .ci/run)"
        );
    }
    have
}

/// Runs `tests/SCRIPT` with `args` (killed after 600 s) and asserts that it passed.
pub fn run_python_script(script: &str, args: &[&str]) {
    run_script(script, args, 600);
}

/// Runs `tests/SCRIPT` with `args` under python3, killed after `timeout_s` seconds, and
/// asserts that it passed; its output is printed either way.
fn run_script(script: &str, args: &[&str], timeout_s: u32) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(script);
    let out = Command::new("timeout")
        .arg(timeout_s.to_string())
        .arg("python3")
        .arg(path)
        .args(args)
        .output()
        .expect("running python3");
    let log = format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{log}");
    assert!(out.status.success(), "{script} failed\n{log}");
}
