//! The official OpenAI Python client (`tests/openai_api.py`) against a running server.

use std::path::PathBuf;
use std::process::Command;

/// Whether python3 with the `openai` package is available; under CI (`CI=true`) it must be.
pub fn openai_client_available() -> bool {
    let have = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI must install the openai package (pip install openai)"
        );
    }
    have
}

/// Runs `tests/openai_api.py` against `url` (killed after 300 s) and asserts that it passed.
pub fn run_openai_script(url: &str) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_api.py");
    let out = Command::new("timeout")
        .arg("300")
        .arg("python3")
        .arg(script)
        .arg(url)
        .output()
        .expect("running python3");
    let log = format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{log}");
    assert!(out.status.success(), "openai_api.py failed\n{log}");
}
