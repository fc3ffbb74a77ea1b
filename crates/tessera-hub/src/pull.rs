//! The I/O edge: list a repository, choose the model's files ([`crate::listing`]), and bring
//! each into the cache ([`crate::cache`]): reused when its blob is there, else downloaded into
//! `{sha256}.incomplete` (resumed with an HTTP `Range` from what an earlier, interrupted pull
//! left), verified against the Hub's SHA-256, then moved to its blob and linked into the
//! snapshot.
//!
//! Routes used (all under `HF_ENDPOINT`, default `https://huggingface.co`, with
//! `Authorization: Bearer $HF_TOKEN` when set):
//! - `GET /api/models/{repo}/revision/main?blobs=true`: the commit and each file's SHA-256;
//! - `GET /{repo}/resolve/{commit}/{path}`: the file, through redirects (followed by hand, the
//!   token sent only to the endpoint's own origin), from a byte offset with `Range`; its
//!   `X-Linked-Etag` (or `ETag`), when it is a SHA-256, must agree with the listing.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::cache::HubCache;
use crate::error::{io_err, HubError, Result};
use crate::listing::{RepoFile, RepoListing, MAX_LISTING_BYTES};
use crate::name::ModelName;

/// The revision pulled.
pub const REVISION: &str = "main";
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
const MAX_REDIRECTS: u32 = 10;
/// Bytes read from the network between progress reports and writes.
const BUF_BYTES: usize = 1 << 20;

/// Where and how to pull from.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// Without a trailing `/`.
    pub endpoint: String,
    pub token: Option<String>,
    /// Use only what the cache holds; never touch the network.
    pub offline: bool,
    pub cache: HubCache,
    /// Times a file's transfer is resumed after a dropped connection within one pull.
    pub retries: u32,
}

impl HubConfig {
    /// From `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` and the cache variables
    /// ([`HubCache::from_env`]).
    pub fn from_env() -> Result<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let cache = HubCache::from_env().ok_or_else(|| HubError::Io {
            path: PathBuf::from("~/.cache/huggingface/hub"),
            source: std::io::Error::other("no HF_HUB_CACHE, HF_HOME or HOME to put the cache in"),
        })?;
        Ok(Self {
            endpoint: var("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.into())
                .trim_end_matches('/')
                .to_string(),
            token: var("HF_TOKEN"),
            offline: var("HF_HUB_OFFLINE").is_some_and(|v| {
                matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
            }),
            cache,
            retries: 3,
        })
    }
}

/// What a pull reports as it goes (for a progress display).
#[derive(Debug)]
pub enum PullEvent<'a> {
    /// The listing named this commit and these files.
    Resolved {
        commit: &'a str,
        files: &'a [RepoFile],
    },
    /// A file already in the cache: not downloaded.
    Reused {
        file: &'a str,
        bytes: u64,
    },
    /// A download starts, or resumes from `from` bytes.
    Downloading {
        file: &'a str,
        from: u64,
        total: Option<u64>,
    },
    Progress {
        file: &'a str,
        done: u64,
    },
    /// A transfer dropped and is resumed.
    Retrying {
        file: &'a str,
        error: &'a HubError,
    },
    Verified {
        file: &'a str,
    },
}

/// A model in the cache, ready to open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pulled {
    pub commit: String,
    /// The snapshot paths of its files, in order: open the first (a split model's first part).
    pub files: Vec<PathBuf>,
    pub bytes_downloaded: u64,
    pub files_reused: usize,
}

/// Brings the model `name` names into the cache and returns where its files are.
pub fn pull(
    config: &HubConfig,
    name: &ModelName,
    on_event: &mut dyn FnMut(PullEvent<'_>),
) -> Result<Pulled> {
    if config.offline {
        return pull_offline(config, name);
    }
    let client = Client::new(config);
    let listing = client.listing(&name.repo)?;
    let files = listing.choose(name)?;
    on_event(PullEvent::Resolved {
        commit: &listing.commit,
        files: &files,
    });
    let mut out = Pulled {
        commit: listing.commit.clone(),
        files: Vec::with_capacity(files.len()),
        bytes_downloaded: 0,
        files_reused: 0,
    };
    for f in &files {
        let sha = f.sha256.as_deref().ok_or_else(|| HubError::NoMatch {
            repo: name.repo.clone(),
            what: format!(
                "{} has no SHA-256 in the listing (not stored in LFS), so it cannot be verified",
                f.path
            ),
        })?;
        let blob = config.cache.blob(&name.repo, sha);
        let held = std::fs::metadata(&blob).ok().map(|m| m.len());
        if held.is_some() && (f.size.is_none() || held == f.size) {
            on_event(PullEvent::Reused {
                file: &f.path,
                bytes: held.unwrap_or(0),
            });
            out.files_reused += 1;
        } else {
            let mut attempt = 0;
            loop {
                match client.download(&name.repo, &listing.commit, f, sha, on_event) {
                    Ok(n) => {
                        out.bytes_downloaded += n;
                        break;
                    }
                    Err(e) if e.is_retryable() && attempt < config.retries => {
                        attempt += 1;
                        on_event(PullEvent::Retrying {
                            file: &f.path,
                            error: &e,
                        });
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        out.files.push(
            config
                .cache
                .link(&name.repo, &listing.commit, &f.path, sha)?,
        );
    }
    config
        .cache
        .write_ref(&name.repo, REVISION, &listing.commit)?;
    Ok(out)
}

/// The model as the cache holds it, from the commit `refs/main` records.
fn pull_offline(config: &HubConfig, name: &ModelName) -> Result<Pulled> {
    let offline = |what: String| HubError::Offline {
        repo: name.repo.clone(),
        what,
    };
    let commit = config.cache.read_ref(&name.repo, REVISION).ok_or_else(|| {
        offline(format!(
            "the cache ({}) holds no snapshot of it",
            config.cache.root().display()
        ))
    })?;
    let snapshot = config.cache.snapshot_file(&name.repo, &commit, "");
    let mut files = Vec::new();
    list_files(&snapshot, "", &mut files, 0);
    let listing = RepoListing {
        commit: commit.clone(),
        files,
    };
    let chosen = listing
        .choose(name)
        .map_err(|e| offline(format!("its cached snapshot does not hold the model: {e}")))?;
    Ok(Pulled {
        files: chosen
            .iter()
            .map(|f| config.cache.snapshot_file(&name.repo, &commit, &f.path))
            .collect(),
        commit,
        bytes_downloaded: 0,
        files_reused: chosen.len(),
    })
}

/// The files under a snapshot folder whose links resolve (a bounded walk).
fn list_files(dir: &Path, prefix: &str, out: &mut Vec<RepoFile>, depth: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten().take(10_000) {
        let name = e.file_name().to_string_lossy().into_owned();
        let path = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let p = e.path();
        if p.is_dir() && depth < 8 {
            list_files(&p, &path, out, depth + 1);
        } else if p.is_file() {
            out.push(RepoFile {
                path,
                size: std::fs::metadata(&p).ok().map(|m| m.len()),
                sha256: None,
            });
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
}

/// An HTTP agent for one endpoint.
struct Client<'a> {
    config: &'a HubConfig,
    agent: ureq::Agent,
}

impl<'a> Client<'a> {
    fn new(config: &'a HubConfig) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .max_redirects(0)
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .user_agent(concat!("tessera/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Self { config, agent }
    }

    /// Sends a GET, following redirects by hand so the token goes only to the endpoint.
    fn get(
        &self,
        url: &str,
        range_from: u64,
    ) -> Result<(String, ureq::http::Response<ureq::Body>, Option<String>)> {
        let mut url = url.to_string();
        // The SHA-256 the Hub states beside the redirect to its storage.
        let mut linked: Option<String> = None;
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent.get(&url);
            if let Some(t) = &self.config.token {
                if same_origin(&url, &self.config.endpoint) {
                    req = req.header("Authorization", format!("Bearer {t}"));
                }
            }
            if range_from > 0 {
                req = req.header("Range", format!("bytes={range_from}-"));
            }
            let resp = req.call().map_err(|e| HubError::Network {
                url: url.clone(),
                what: e.to_string(),
            })?;
            for h in ["x-linked-etag", "etag"] {
                if linked.is_none() {
                    linked = resp
                        .headers()
                        .get(h)
                        .and_then(|v| v.to_str().ok())
                        .map(|v| {
                            v.trim_start_matches("W/")
                                .trim_matches('"')
                                .to_ascii_lowercase()
                        })
                        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()));
                }
            }
            let status = resp.status().as_u16();
            if matches!(status, 301 | 302 | 303 | 307 | 308) {
                let loc = resp
                    .headers()
                    .get("location")
                    .and_then(|v| v.to_str().ok())
                    .ok_or_else(|| HubError::Network {
                        url: url.clone(),
                        what: format!("HTTP {status} without a Location"),
                    })?;
                url = join_url(&url, loc);
                continue;
            }
            return Ok((url, resp, linked));
        }
        Err(HubError::Network {
            url,
            what: format!("more than {MAX_REDIRECTS} redirects"),
        })
    }

    fn listing(&self, repo: &str) -> Result<RepoListing> {
        let url = format!(
            "{}/api/models/{repo}/revision/{REVISION}?blobs=true",
            self.config.endpoint
        );
        let (url, resp, _) = self.get(&url, 0)?;
        check_status(&url, resp.status().as_u16(), &[200])?;
        let mut body = Vec::new();
        resp.into_body()
            .into_reader()
            .take(MAX_LISTING_BYTES + 1)
            .read_to_end(&mut body)
            .map_err(|e| HubError::Network {
                url: url.clone(),
                what: e.to_string(),
            })?;
        RepoListing::parse(repo, &body)
    }

    /// Downloads `file` into its blob, resuming a `.incomplete` an earlier pull left, and
    /// verifies it; returns the bytes received.
    fn download(
        &self,
        repo: &str,
        commit: &str,
        file: &RepoFile,
        sha256: &str,
        on_event: &mut dyn FnMut(PullEvent<'_>),
    ) -> Result<u64> {
        let cache = &self.config.cache;
        let part = cache.incomplete(repo, sha256);
        let blobs = part.parent().expect("blobs folder");
        std::fs::create_dir_all(blobs).map_err(io_err(blobs))?;
        let mut out = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&part)
            .map_err(io_err(&part))?;
        let mut have = out.metadata().map_err(io_err(&part))?.len();
        if file.size.is_some_and(|s| have > s) {
            have = 0;
        }
        let url = format!(
            "{}/{repo}/resolve/{commit}/{}",
            self.config.endpoint,
            encode_path(&file.path)
        );
        let (url, resp, linked) = self.get(&url, have)?;
        if let Some(l) = linked.filter(|l| l != sha256) {
            return Err(HubError::BadListing {
                repo: repo.into(),
                what: format!(
                    "{} is listed with SHA-256 {sha256} but served as {l}",
                    file.path
                ),
            });
        }
        let status = resp.status().as_u16();
        check_status(&url, status, &[200, 206, 416])?;
        if status == 206 {
            // The part must start where ours ends, or the bytes would land in the wrong place.
            let start = resp
                .headers()
                .get("content-range")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("bytes "))
                .and_then(|v| v.split('-').next())
                .and_then(|v| v.parse::<u64>().ok());
            if start != Some(have) {
                return Err(HubError::Network {
                    url,
                    what: format!("asked for bytes from {have}, the answer starts at {start:?}"),
                });
            }
        }
        if status == 416 && file.size != Some(have) {
            // Our partial file does not fit the file served: start again on the next try.
            drop(out);
            let _ = std::fs::remove_file(&part);
            return Err(HubError::Network {
                url,
                what: format!("{} bytes held do not fit the file; starting again", have),
            });
        }
        if status == 200 {
            // The whole file (the server ignored the range, or the range was wrong): restart.
            have = 0;
        }
        out.set_len(have).map_err(io_err(&part))?;
        // What is already there counts toward the hash; then the rest as it arrives.
        let mut hasher = Sha256::new();
        hash_prefix(&mut out, have, &mut hasher).map_err(io_err(&part))?;
        out.seek(SeekFrom::Start(have)).map_err(io_err(&part))?;
        on_event(PullEvent::Downloading {
            file: &file.path,
            from: have,
            total: file.size,
        });
        let mut received = 0u64;
        if status != 416 {
            let mut body = resp.into_body().into_reader();
            let mut buf = vec![0u8; BUF_BYTES];
            loop {
                let n = match body.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        // Keep what arrived: the next try resumes from it.
                        let _ = out.sync_data();
                        return Err(HubError::Network {
                            url,
                            what: format!("transfer of {} dropped: {e}", file.path),
                        });
                    }
                };
                out.write_all(&buf[..n]).map_err(io_err(&part))?;
                hasher.update(&buf[..n]);
                received += n as u64;
                if file.size.is_some_and(|s| have + received > s) {
                    break;
                }
                on_event(PullEvent::Progress {
                    file: &file.path,
                    done: have + received,
                });
            }
        }
        out.sync_all().map_err(io_err(&part))?;
        drop(out);
        let found = hex(&hasher.finalize());
        let len = have + received;
        if found != sha256 || file.size.is_some_and(|s| s != len) {
            let _ = std::fs::remove_file(&part);
            return Err(HubError::Corrupt {
                repo: repo.into(),
                file: file.path.clone(),
                expected: sha256.into(),
                found,
            });
        }
        let blob = cache.blob(repo, sha256);
        std::fs::rename(&part, &blob).map_err(io_err(&blob))?;
        on_event(PullEvent::Verified { file: &file.path });
        Ok(received)
    }
}

fn hash_prefix(f: &mut File, len: u64, hasher: &mut Sha256) -> std::io::Result<()> {
    f.seek(SeekFrom::Start(0))?;
    let mut left = len;
    let mut buf = vec![0u8; BUF_BYTES];
    while left > 0 {
        let n = f.read(&mut buf[..(left.min(BUF_BYTES as u64)) as usize])?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(())
}

fn check_status(url: &str, status: u16, ok: &[u16]) -> Result<()> {
    if ok.contains(&status) {
        return Ok(());
    }
    let hint = match status {
        401 | 403 => ": the repository is gated or private (set HF_TOKEN)",
        404 => ": no such repository, revision or file",
        429 => ": rate limited, try again later",
        _ => "",
    };
    Err(HubError::Http {
        url: url.into(),
        status,
        hint: hint.into(),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> &str {
    let after = url.find("://").map_or(0, |i| i + 3);
    let end = url[after..].find('/').map_or(url.len(), |i| after + i);
    &url[..end]
}

fn same_origin(a: &str, b: &str) -> bool {
    origin(a).eq_ignore_ascii_case(origin(b))
}

/// A redirect's `Location`, absolute or relative to `base`.
fn join_url(base: &str, loc: &str) -> String {
    if loc.contains("://") {
        loc.to_string()
    } else if loc.starts_with('/') {
        format!("{}{loc}", origin(base))
    } else {
        let dir = base.rfind('/').map_or(base, |i| &base[..=i]);
        format!("{dir}{loc}")
    }
}

/// Percent-encodes a repository path for a URL, keeping its `/`.
fn encode_path(p: &str) -> String {
    let mut s = String::with_capacity(p.len());
    for b in p.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_resolve_and_the_token_stays_home() {
        assert_eq!(join_url("http://h:1/a/b", "/c"), "http://h:1/c");
        assert_eq!(join_url("http://h:1/a/b", "c"), "http://h:1/a/c");
        assert_eq!(join_url("http://h:1/a/b", "https://cdn/x"), "https://cdn/x");
        assert!(same_origin("http://h:1/a", "http://h:1"));
        assert!(!same_origin("http://h:2/a", "http://h:1"));
        assert!(!same_origin(
            "https://cdn.example/x",
            "https://huggingface.co"
        ));
        assert_eq!(encode_path("Q8_0/m a#.gguf"), "Q8_0/m%20a%23.gguf");
    }
}
