//! The model built into the binary, so `tessera generate` works on a fresh machine with no network.
//!
//! stories260K (MIT, Andrej Karpathy's llama2.c "tinyllamas"; see models/LICENSE-stories260K.txt)
//! is 1.2 MB. The engine memory-maps models from files, so on first use the bytes are written to
//! the user's cache directory under a name that includes their hash.

use std::path::PathBuf;

use anyhow::Context;

const BYTES: &[u8] = include_bytes!("../../../models/stories260K.gguf");
pub const NAME: &str = "stories260K";

/// Path of the built-in model, writing it to the cache on first use.
pub fn path() -> anyhow::Result<PathBuf> {
    let hash = blake3::hash(BYTES).to_hex();
    let dir = cache_dir().join("models");
    let path = dir.join(format!("{NAME}-{}.gguf", &hash[..16]));
    if std::fs::metadata(&path).map(|m| m.len()).ok() == Some(BYTES.len() as u64) {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Write then rename, so a concurrent reader never sees half a file.
    let tmp = dir.join(format!(".{NAME}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, BYTES).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TESSERA_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("tessera");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache").join("tessera");
    }
    std::env::temp_dir().join("tessera")
}

/// The model to use: the one given (`hf:ORG/NAME[:QUANT]` pulled from the Hub first), or the
/// built-in one.
pub fn resolve(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match model {
        Some(p) => match p.to_str().and_then(tessera_hub::ModelName::from_model_arg) {
            Some(name) => crate::cmd::pull::pull(&name?),
            None => Ok(p),
        },
        None => path(),
    }
}
