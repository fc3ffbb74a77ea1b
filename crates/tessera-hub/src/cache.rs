//! The Hugging Face Hub's cache layout, shared with `huggingface_hub`, `hf download` and
//! llama.cpp's `-hf`, so a file any of them fetched is not fetched again:
//!
//! ```text
//! {root}/models--ORG--NAME/blobs/{sha256}                 the file's bytes, named by content
//! {root}/models--ORG--NAME/blobs/{sha256}.incomplete      a download under way (resumed)
//! {root}/models--ORG--NAME/snapshots/{commit}/{path}      a relative symlink to the blob
//! {root}/models--ORG--NAME/refs/{revision}                the commit a revision last resolved to
//! ```
//!
//! The root is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub`, as `huggingface_hub` chooses it.

use std::path::{Path, PathBuf};

use crate::error::{io_err, Result};

/// One cache root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubCache {
    root: PathBuf,
}

impl HubCache {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The root the environment names (see the module doc); `None` without even a home.
    pub fn from_env() -> Option<Self> {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let root = var("HF_HUB_CACHE")
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
            .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))?;
        Some(Self::new(root))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `models--ORG--NAME`: the repository's folder.
    pub fn repo_dir(&self, repo: &str) -> PathBuf {
        self.root
            .join(format!("models--{}", repo.replace('/', "--")))
    }

    pub fn blob(&self, repo: &str, sha256: &str) -> PathBuf {
        self.repo_dir(repo).join("blobs").join(sha256)
    }

    pub fn incomplete(&self, repo: &str, sha256: &str) -> PathBuf {
        self.repo_dir(repo)
            .join("blobs")
            .join(format!("{sha256}.incomplete"))
    }

    /// Where a file of a commit appears (`path` is `/`-separated and was checked safe).
    pub fn snapshot_file(&self, repo: &str, commit: &str, path: &str) -> PathBuf {
        let mut p = self.repo_dir(repo).join("snapshots").join(commit);
        p.extend(path.split('/'));
        p
    }

    /// The commit `revision` last resolved to, if recorded.
    pub fn read_ref(&self, repo: &str, revision: &str) -> Option<String> {
        let s = std::fs::read_to_string(self.repo_dir(repo).join("refs").join(revision)).ok()?;
        let s = s.trim();
        (s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())).then(|| s.to_string())
    }

    pub fn write_ref(&self, repo: &str, revision: &str, commit: &str) -> Result<()> {
        let dir = self.repo_dir(repo).join("refs");
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let path = dir.join(revision);
        std::fs::write(&path, commit).map_err(io_err(&path))
    }

    /// Makes `snapshots/{commit}/{path}` a relative symlink to the blob (replacing what was
    /// there), as the Hub's own tools do.
    pub fn link(&self, repo: &str, commit: &str, path: &str, sha256: &str) -> Result<PathBuf> {
        let at = self.snapshot_file(repo, commit, path);
        let parent = at.parent().expect("a snapshot file has a folder");
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        // From snapshots/{commit}/a/b/file up to the repository folder: 2 + the folders of path.
        let depth = 2 + path.matches('/').count();
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(sha256);
        if std::fs::symlink_metadata(&at).is_ok() {
            std::fs::remove_file(&at).map_err(io_err(&at))?;
        }
        symlink(&target, &at).map_err(io_err(&at))?;
        Ok(at)
    }
}

#[cfg(unix)]
fn symlink(target: &Path, at: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, at)
}

#[cfg(not(unix))]
fn symlink(target: &Path, at: &Path) -> std::io::Result<()> {
    // Without symlinks the Hub's tools copy the blob into the snapshot.
    let blob = at.parent().expect("has a folder").join(target);
    std::fs::copy(blob, at).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_links_resolve_to_blobs() {
        let dir = std::env::temp_dir().join(format!("tessera-hub-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let c = HubCache::new(&dir);
        let sha = "ab".repeat(32);
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let blob = c.blob("o/r", &sha);
        std::fs::create_dir_all(blob.parent().unwrap()).unwrap();
        std::fs::write(&blob, b"bytes").unwrap();
        for path in ["top.gguf", "Q8_0/deep/m.gguf"] {
            let at = c.link("o/r", commit, path, &sha).unwrap();
            assert_eq!(std::fs::read(&at).unwrap(), b"bytes", "{path}");
            // Linking again replaces the link.
            c.link("o/r", commit, path, &sha).unwrap();
        }
        assert!(c.repo_dir("o/r").ends_with("models--o--r"));
        assert_eq!(c.read_ref("o/r", "main"), None);
        c.write_ref("o/r", "main", commit).unwrap();
        assert_eq!(c.read_ref("o/r", "main").as_deref(), Some(commit));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
