//! A repository's files as the Hub lists them, and which of them make the model asked for.
//! Pure: the listing comes in as bytes, the choice goes out as a list of files.
//!
//! The listing is `GET {endpoint}/api/models/{repo}/revision/{rev}?blobs=true`: the commit
//! (`sha`) and every file (`siblings`) with its size and, for files stored in LFS (every GGUF
//! file), the SHA-256 the download is verified against.

use std::path::Path;

use serde::Deserialize;
use tessera_model::PartName;

use crate::error::{HubError, Result};
use crate::name::ModelName;

/// Listings larger than this are refused before parsing.
pub const MAX_LISTING_BYTES: u64 = 32 << 20;
/// More files than this in one repository is not a model repository.
const MAX_FILES: usize = 100_000;
/// The quantization llama.cpp's `-hf` picks when none is named.
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// One revision of a repository: its commit and files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoListing {
    /// The commit the revision resolved to (40 hex digits): the snapshot's name in the cache.
    pub commit: String,
    pub files: Vec<RepoFile>,
}

/// One file of a repository.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoFile {
    /// Its path in the repository (`/`-separated).
    pub path: String,
    pub size: Option<u64>,
    /// SHA-256 of its contents (lowercase hex), for files stored in LFS.
    pub sha256: Option<String>,
}

#[derive(Deserialize)]
struct RawInfo {
    sha: String,
    #[serde(default)]
    siblings: Vec<RawSibling>,
}

#[derive(Deserialize)]
struct RawSibling {
    rfilename: String,
    size: Option<u64>,
    lfs: Option<RawLfs>,
}

#[derive(Deserialize)]
struct RawLfs {
    sha256: String,
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A path the cache can hold: relative, `/`-separated, no `..`, no empty or hidden parts.
fn safe_repo_path(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 1024
        && p.split('/').all(|c| {
            !c.is_empty() && c != "." && c != ".." && !c.contains('\\') && !c.contains('\0')
        })
}

impl RepoListing {
    /// Parses the Hub's answer for `repo`. Entries with paths the cache could not hold safely
    /// (absolute, `..`) are refused, as are malformed hashes.
    pub fn parse(repo: &str, body: &[u8]) -> Result<Self> {
        let bad = |what: String| HubError::BadListing {
            repo: repo.to_string(),
            what,
        };
        if body.len() as u64 > MAX_LISTING_BYTES {
            return Err(bad(format!("{} bytes is too large", body.len())));
        }
        let raw: RawInfo = serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
        if !is_hex(&raw.sha, 40) {
            return Err(bad(format!("commit '{}' is not 40 hex digits", raw.sha)));
        }
        if raw.siblings.len() > MAX_FILES {
            return Err(bad(format!("{} files is too many", raw.siblings.len())));
        }
        let mut files = Vec::with_capacity(raw.siblings.len());
        for s in raw.siblings {
            if !safe_repo_path(&s.rfilename) {
                return Err(bad(format!("file path '{}' is not safe", s.rfilename)));
            }
            let sha256 = match s.lfs {
                Some(l) if is_hex(&l.sha256, 64) => Some(l.sha256.to_ascii_lowercase()),
                Some(l) => return Err(bad(format!("SHA-256 '{}' is malformed", l.sha256))),
                None => None,
            };
            files.push(RepoFile {
                path: s.rfilename,
                size: s.size,
                sha256,
            });
        }
        Ok(Self {
            commit: raw.sha.to_ascii_lowercase(),
            files,
        })
    }

    /// The files that make the model `name` asks for: one GGUF file, or every part of a split
    /// one in order. Without a quantization, the repository's only GGUF model, else its
    /// [`DEFAULT_QUANT`]. Refuses (naming what is there) when nothing or several models match,
    /// and when a split model lacks a part.
    pub fn choose(&self, name: &ModelName) -> Result<Vec<RepoFile>> {
        let no_match = |what: String| HubError::NoMatch {
            repo: name.repo.clone(),
            what,
        };
        let models = self.models();
        let available = || {
            let mut names: Vec<String> = models.iter().map(|m| m.label.clone()).collect();
            names.truncate(30);
            if names.is_empty() {
                "it holds no GGUF model".to_string()
            } else {
                format!("it holds {}", names.join(", "))
            }
        };
        let pick = |quant: &str| -> Vec<&Model> {
            models
                .iter()
                .filter(|m| names_quant(&m.label, quant))
                .collect()
        };
        let chosen: Vec<&Model> = match &name.quant {
            Some(q) => pick(q),
            None if models.len() == 1 => models.iter().collect(),
            None => pick(DEFAULT_QUANT),
        };
        let model = match chosen[..] {
            [m] => m,
            [] => {
                let asked = name.quant.as_deref().map_or_else(
                    || format!("no quantization named and none is {DEFAULT_QUANT}"),
                    |q| format!("no GGUF file is quantized {q}"),
                );
                return Err(no_match(format!("{asked}; {}", available())));
            }
            _ => {
                let labels: Vec<&str> = chosen.iter().map(|m| m.label.as_str()).collect();
                return Err(no_match(format!(
                    "several models match: {}; name one by its quantization",
                    labels.join(", ")
                )));
            }
        };
        if model.parts.len() as u32 != model.count || model.parts.iter().any(Option::is_none) {
            let missing = (1..=model.count)
                .find(|&k| model.parts.get(k as usize - 1).is_none_or(Option::is_none))
                .unwrap_or(1);
            return Err(no_match(format!(
                "{} is split in {} parts but part {missing} is not in the repository",
                model.label, model.count
            )));
        }
        Ok(model
            .parts
            .iter()
            .map(|p| p.expect("checked above").clone())
            .collect())
    }

    /// The GGUF models in the listing: single files, and split parts grouped by prefix.
    fn models(&self) -> Vec<Model<'_>> {
        let mut out: Vec<Model<'_>> = Vec::new();
        for f in &self.files {
            let lower = f.path.to_ascii_lowercase();
            // Vision projectors ship beside the model; they are not a model of their own.
            if !lower.ends_with(".gguf")
                || lower
                    .rsplit('/')
                    .next()
                    .is_some_and(|n| n.starts_with("mmproj"))
            {
                continue;
            }
            match PartName::parse(Path::new(&f.path)) {
                Some(p) if p.count > 1 => {
                    let label = p.prefix.to_string_lossy().into_owned();
                    let i = match out
                        .iter()
                        .position(|m| m.label == label && m.count == p.count)
                    {
                        Some(i) => i,
                        None => {
                            out.push(Model {
                                label,
                                count: p.count,
                                parts: vec![None; p.count as usize],
                            });
                            out.len() - 1
                        }
                    };
                    out[i].parts[p.number as usize - 1] = Some(f);
                }
                _ => out.push(Model {
                    label: f.path.clone(),
                    count: 1,
                    parts: vec![Some(f)],
                }),
            }
        }
        out
    }
}

/// One GGUF model of a listing.
struct Model<'a> {
    /// The file's path, or a split model's path prefix.
    label: String,
    count: u32,
    /// By part number from 1; `None` where a part is not listed.
    parts: Vec<Option<&'a RepoFile>>,
}

/// Whether a model's path names quantization `quant`: the quantization appears (any case)
/// after a separator (`-`, `.`, `_`, `/`) and before a `-`, `.` or `/` or the end, so `Q4_K`
/// does not match `Q4_K_M`.
fn names_quant(label: &str, quant: &str) -> bool {
    let l = label.to_ascii_lowercase();
    let q = quant.to_ascii_lowercase();
    let l = l.strip_suffix(".gguf").unwrap_or(&l);
    l.match_indices(&q).any(|(i, _)| {
        let before = l[..i].chars().next_back();
        let after = l[i + q.len()..].chars().next();
        matches!(before, None | Some('-' | '.' | '_' | '/'))
            && matches!(after, None | Some('-' | '.' | '/'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(paths: &[&str]) -> RepoListing {
        let siblings: Vec<serde_json::Value> = paths
            .iter()
            .map(|p| serde_json::json!({"rfilename": p, "size": 10, "lfs": {"sha256": "ab".repeat(32), "size": 10}}))
            .collect();
        let body = serde_json::json!({"sha": "0123456789abcdef0123456789abcdef01234567", "siblings": siblings});
        RepoListing::parse("o/r", body.to_string().as_bytes()).unwrap()
    }

    fn chosen(l: &RepoListing, name: &str) -> Result<Vec<String>> {
        let n = ModelName::parse(name).unwrap();
        Ok(l.choose(&n)?.into_iter().map(|f| f.path).collect())
    }

    #[test]
    fn a_quant_picks_its_file_or_every_part_in_order() {
        let l = listing(&[
            "README.md",
            "m-Q4_K.gguf",
            "m-Q4_K_M.gguf",
            "Q8_0/m-Q8_0-00002-of-00002.gguf",
            "Q8_0/m-Q8_0-00001-of-00002.gguf",
            "mmproj-m-F16.gguf",
        ]);
        assert_eq!(chosen(&l, "o/r:q4_k_m").unwrap(), ["m-Q4_K_M.gguf"]);
        assert_eq!(chosen(&l, "o/r:Q4_K").unwrap(), ["m-Q4_K.gguf"]);
        assert_eq!(
            chosen(&l, "o/r:Q8_0").unwrap(),
            [
                "Q8_0/m-Q8_0-00001-of-00002.gguf",
                "Q8_0/m-Q8_0-00002-of-00002.gguf"
            ]
        );
        // No quant: Q4_K_M, as llama.cpp picks.
        assert_eq!(chosen(&l, "o/r").unwrap(), ["m-Q4_K_M.gguf"]);
        let err = chosen(&l, "o/r:IQ2_XXS").unwrap_err().to_string();
        assert!(
            err.contains("no GGUF file is quantized IQ2_XXS") && err.contains("m-Q4_K.gguf"),
            "{err}"
        );
    }

    #[test]
    fn a_missing_part_or_several_matches_are_refused() {
        let l = listing(&["m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00003-of-00003.gguf"]);
        let err = chosen(&l, "o/r:Q8_0").unwrap_err().to_string();
        assert!(err.contains("part 2 is not in the repository"), "{err}");
        let l = listing(&["a-Q8_0.gguf", "b-Q8_0.gguf"]);
        let err = chosen(&l, "o/r:Q8_0").unwrap_err().to_string();
        assert!(err.contains("several models match"), "{err}");
        // One model and no quant named: that one.
        let l = listing(&["only-BF16.gguf"]);
        assert_eq!(chosen(&l, "o/r").unwrap(), ["only-BF16.gguf"]);
    }

    #[test]
    fn unsafe_paths_and_malformed_hashes_are_refused() {
        for body in [
            r#"{"sha":"0123456789abcdef0123456789abcdef01234567","siblings":[{"rfilename":"../x.gguf"}]}"#,
            r#"{"sha":"0123456789abcdef0123456789abcdef01234567","siblings":[{"rfilename":"/x.gguf"}]}"#,
            r#"{"sha":"0123456789abcdef0123456789abcdef01234567","siblings":[{"rfilename":"x.gguf","lfs":{"sha256":"zz"}}]}"#,
            r#"{"sha":"main","siblings":[]}"#,
            r#"{"siblings":[]}"#,
        ] {
            assert!(
                RepoListing::parse("o/r", body.as_bytes()).is_err(),
                "{body}"
            );
        }
    }
}
