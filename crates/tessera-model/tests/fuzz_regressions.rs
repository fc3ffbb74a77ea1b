//! Every input the fuzzers once crashed on (`fuzz/regressions/<target>/`), replayed through
//! the same calls as its fuzz target on every test run, with the reason each is refused.
//! `.ci/fuzz` replays them under libFuzzer as well.

use std::path::PathBuf;

use tessera_model::{GgufFile, ModelConfig};

fn regressions(target: &str) -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/regressions")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

/// What each known input must be refused for (a substring of the error), by file name.
const GGUF_REASONS: &[(&str, &str)] =
    &[("block-count-16M", "16777216 layers cannot fit in a file of")];

#[test]
fn gguf_regressions_are_refused_with_their_reason() {
    let files = regressions("gguf");
    assert_eq!(
        files.len(),
        GGUF_REASONS.len(),
        "a reason for every input: {files:?}"
    );
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        let (_, reason) = GGUF_REASONS
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("no reason recorded for {name}"));
        let bytes = std::fs::read(&f).unwrap();
        // As the fuzz target: parse, then build the config on whatever parses.
        let g = GgufFile::parse(&bytes).unwrap_or_else(|e| panic!("{name} no longer parses: {e}"));
        let err = ModelConfig::from_gguf(&g).expect_err(&name).to_string();
        assert!(err.contains(reason), "{name}: {err}");
    }
}
