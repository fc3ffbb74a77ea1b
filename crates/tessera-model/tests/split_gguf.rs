//! gguf-split models read as one: the parts of a real fixture open as the whole file's
//! metadata, tensor index and bytes, and parts that do not make one model are refused by name.

use std::path::{Path, PathBuf};

use tessera_model::{GgufFile, ModelError, ModelProfile, PartName, SplitOptions};

fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name)
}

/// Splits `name` into parts of at most `max_tensors` tensors under `dir`.
fn split(dir: &Path, name: &str, max_tensors: usize, metadata_only_first: bool) -> Vec<PathBuf> {
    let whole = GgufFile::open(model(name)).unwrap();
    let options = SplitOptions {
        max_tensors,
        metadata_only_first,
    };
    tessera_model::gguf::write_parts(&whole, &dir.join("m"), options).unwrap()
}

fn split_err(r: Result<GgufFile, ModelError>) -> String {
    match r {
        Err(e @ ModelError::Split { .. }) => e.to_string(),
        Err(e) => panic!("expected a split error, got {e}"),
        Ok(_) => panic!("expected a split error, the parts opened"),
    }
}

#[test]
fn split_parts_read_as_the_whole_file() {
    for (name, metadata_only_first) in [
        ("test/tiny-qwen3moe-Q8_0.gguf", false),
        ("stories260K.gguf", true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let parts = split(dir.path(), name, 7, metadata_only_first);
        assert!(parts.len() >= 3, "{name}: {} parts", parts.len());
        let whole = GgufFile::open(model(name)).unwrap();
        let joined = GgufFile::open(&parts[0]).unwrap();
        assert!(joined.is_split() && !whole.is_split());
        assert_eq!(
            joined.part_paths(),
            parts.iter().map(PathBuf::as_path).collect::<Vec<_>>()
        );
        assert!(
            joined.meta("split.count").is_none(),
            "split keys are dropped"
        );
        assert_eq!(joined.metadata(), whole.metadata(), "{name}");
        assert_eq!(joined.tensors().len(), whole.tensors().len());
        for (j, w) in joined.tensors().iter().zip(whole.tensors()) {
            assert_eq!(
                (&j.name, &j.shape, j.type_id),
                (&w.name, &w.shape, w.type_id)
            );
            assert_eq!(
                joined.tensor_bytes(j).unwrap(),
                whole.tensor_bytes(w).unwrap(),
                "{}",
                j.name
            );
            let (map, at) = joined
                .mapped_range(&j.name, j.offset..j.offset + j.n_bytes)
                .unwrap();
            assert_eq!(
                &map[at..at + j.n_bytes as usize],
                whole.tensor_bytes(w).unwrap()
            );
        }
        // The merged image parses as a GGUF file of its own: the one gguf-split --merge writes.
        let image = joined.image_range(0..joined.file_len()).unwrap();
        let reparsed = GgufFile::parse(&image).unwrap();
        assert_eq!(reparsed.metadata(), whole.metadata());
        for t in reparsed.tensors() {
            let w = whole.tensor(&t.name).unwrap();
            let bytes = &image[t.offset as usize..(t.offset + t.n_bytes) as usize];
            assert_eq!(bytes, whole.tensor_bytes(w).unwrap());
        }
        // Any range of the image reads the same whether borrowed or assembled.
        let step = joined.file_len() / 13 + 1;
        for start in (0..joined.file_len()).step_by(step as usize) {
            let end = (start + step * 2).min(joined.file_len());
            assert_eq!(
                &joined.image_range(start..end).unwrap()[..],
                &image[start as usize..end as usize]
            );
        }
        let p_whole = ModelProfile::from_gguf(&whole).unwrap();
        let p_joined = ModelProfile::from_gguf(&joined).unwrap();
        assert_eq!(p_joined.config, p_whole.config);
        assert_eq!(p_joined.parameter_count, p_whole.parameter_count);
    }
}

#[test]
fn a_missing_part_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let parts = split(dir.path(), "test/tiny-qwen3moe-Q8_0.gguf", 7, false);
    std::fs::remove_file(&parts[1]).unwrap();
    let err = split_err(GgufFile::open(&parts[0]));
    assert!(
        err.contains("part 2 of") && err.contains("is missing"),
        "{err}"
    );
    assert!(err.contains("m-00002-of-"), "{err}");
}

#[test]
fn a_part_other_than_the_first_points_at_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let parts = split(dir.path(), "test/tiny-qwen3moe-Q8_0.gguf", 7, false);
    let err = split_err(GgufFile::open(&parts[1]));
    assert!(err.contains("is part 2 of"), "{err}");
    assert!(err.contains("m-00001-of-"), "{err}");
}

#[test]
fn parts_of_different_models_or_counts_are_refused() {
    // Same prefix and part count, another model's part 2.
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let in_three = |name: &str| {
        let n = GgufFile::open(model(name)).unwrap().tensors().len();
        n.div_ceil(3)
    };
    let pa = split(
        a.path(),
        "test/tiny-qwen3moe-Q8_0.gguf",
        in_three("test/tiny-qwen3moe-Q8_0.gguf"),
        false,
    );
    let pb = split(
        b.path(),
        "stories260K.gguf",
        in_three("stories260K.gguf"),
        false,
    );
    assert_eq!((pa.len(), pb.len()), (3, 3));
    std::fs::copy(&pb[1], &pa[1]).unwrap();
    let err = split_err(GgufFile::open(&pa[0]));
    assert!(err.contains("different models"), "{err}");

    // A part renamed into a split of another count.
    let c = tempfile::tempdir().unwrap();
    let pc = split(c.path(), "test/tiny-qwen3moe-Q8_0.gguf", 7, false);
    let n = pc.len() as u32;
    let wrong = PartName::path(&c.path().join("m"), 1, n + 1);
    std::fs::rename(&pc[0], &wrong).unwrap();
    let err = split_err(GgufFile::open(&wrong));
    assert!(err.contains("cannot be found"), "{err}");

    // A first part renamed so its name does not say it is one.
    let plain = c.path().join("renamed.gguf");
    std::fs::rename(&wrong, &plain).unwrap();
    let err = split_err(GgufFile::open(&plain));
    assert!(err.contains("-00001-of-"), "{err}");
}
