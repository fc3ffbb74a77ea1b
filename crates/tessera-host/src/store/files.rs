//! File helpers of the store: atomic replacement (write, fsync, rename) and positioned reads and
//! writes.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::Path;

use super::error::io_err;
use super::StoreError;

/// Writes `bytes` to `path` so that readers see the old or the new content, never a mix:
/// write a temporary file, fsync it, rename it over `path`, fsync the directory.
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{file_name}.tmp"));
    let ctx = |what: &str| format!("{what} {}", tmp.display());
    let mut f = File::create(&tmp).map_err(io_err(ctx("creating")))?;
    f.write_all(bytes).map_err(io_err(ctx("writing")))?;
    f.sync_all().map_err(io_err(ctx("syncing")))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io_err(format!(
        "renaming {} to {}",
        tmp.display(),
        path.display()
    )))?;
    if let Some(dir) = path.parent() {
        // Makes the rename durable on Linux; not possible everywhere, and not fatal.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

pub(super) fn read_at(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut f = file;
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(buf)
}

pub(super) fn write_at(file: &File, offset: u64, buf: &[u8]) -> io::Result<()> {
    let mut f = file;
    f.seek(SeekFrom::Start(offset))?;
    f.write_all(buf)
}
