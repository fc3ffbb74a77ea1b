//! Disk: free space on the measured directory's filesystem, and its sequential write and read
//! bandwidth.
//!
//! Free space is `statvfs`'s space available to this user. The bandwidth test writes a
//! temporary file in the directory (never more than a quarter of the free space: never fill the
//! disk to measure it) in 4 MiB blocks of pseudo-random data, so compressing or deduplicating
//! filesystems cannot shortcut it, with the write time including the final fsync; then reads it
//! back bypassing the page cache where the platform allows (`O_DIRECT`, `F_NOCACHE`), falling
//! back to a buffered read labelled possibly cached. On a virtual machine the hypervisor's cache
//! may still serve reads, and the method says so. The file is removed however the probe ends.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_model::human_bytes;

use super::{ms, record, DiskInfo, DiskRate, ProbeOptions, ProbeRecord, ProbeStatus};
use crate::direct_read::measure_read_bandwidth;
use crate::sys;

/// Removes the probe file however the probe ends.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const DISK_BLOCK: usize = 4 << 20;

pub(super) fn probe_disk(
    dir: &Path,
    opts: &ProbeOptions,
    virtualized: Option<bool>,
    probes: &mut Vec<ProbeRecord>,
) -> DiskInfo {
    let t = Instant::now();
    let (free_bytes, total_bytes) = match sys::fs_space(dir) {
        Ok((f, t)) => (Some(f), Some(t)),
        Err(e) => {
            probes.push(record(
                "disk space",
                t,
                ProbeStatus::Failed,
                Some(format!("statvfs {}: {e}", dir.display())),
            ));
            (None, None)
        }
    };
    if free_bytes.is_some() {
        probes.push(record("disk space", t, ProbeStatus::Ok, None));
    }
    let mut info = DiskInfo {
        dir: dir.to_owned(),
        free_bytes,
        total_bytes,
        space_method: "statvfs: f_bavail × f_frsize (space available to this user)".into(),
        write: None,
        read: None,
    };

    // Leave room: never fill the disk to measure it.
    let mut size = opts.disk_test_bytes.max(DISK_BLOCK as u64);
    if let Some(free) = free_bytes {
        size = size.min(free / 4);
    }
    let size = size / DISK_BLOCK as u64 * DISK_BLOCK as u64;
    if size == 0 {
        probes.push(ProbeRecord {
            name: "disk bandwidth".into(),
            status: ProbeStatus::Skipped,
            duration_ms: 0.0,
            detail: Some("too little free space for a test file".into()),
        });
        return info;
    }

    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let path = dir.join(format!(
        ".tessera-disk-probe-{}-{nanos}.tmp",
        std::process::id()
    ));
    let _guard = RemoveOnDrop(path.clone());

    let t = Instant::now();
    match disk_write(&path, size, opts.probe_time_limit) {
        Ok(rate) => {
            probes.push(record("disk write", t, ProbeStatus::Ok, None));
            info.write = Some(rate);
        }
        Err(e) => {
            probes.push(record(
                "disk write",
                t,
                ProbeStatus::Failed,
                Some(format!("{}: {e}", path.display())),
            ));
            return info;
        }
    }

    let t = Instant::now();
    match disk_read(&path, virtualized) {
        Ok(rate) => {
            probes.push(record("disk read", t, ProbeStatus::Ok, None));
            info.read = Some(rate);
        }
        Err(e) => probes.push(record(
            "disk read",
            t,
            ProbeStatus::Failed,
            Some(format!("{}: {e}", path.display())),
        )),
    }
    info
}

/// Fills a block with pseudo-random bytes (so compressing or deduplicating filesystems cannot
/// shortcut the test); `seed` varies per block.
fn fill_pseudo_random(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

fn disk_write(path: &Path, size: u64, limit: Duration) -> std::io::Result<DiskRate> {
    use std::io::Write;
    let mut block = vec![0u8; DISK_BLOCK];
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    let start = Instant::now();
    let mut written = 0u64;
    let mut n = 0u64;
    let mut fill = Duration::ZERO;
    while written < size {
        let f = Instant::now();
        fill_pseudo_random(&mut block, n + 1);
        fill += f.elapsed();
        file.write_all(&block)?;
        written += DISK_BLOCK as u64;
        n += 1;
        if start.elapsed() >= limit {
            break;
        }
    }
    file.sync_all()?;
    // Generating the data is not disk time.
    let secs = (start.elapsed() - fill).as_secs_f64().max(1e-9);
    Ok(DiskRate {
        bytes_per_s: written as f64 / secs,
        bytes: written,
        possibly_cached: false,
        method: format!(
            "sequential 4 MiB writes of pseudo-random data, then fsync; time includes the fsync{}",
            if written < size {
                format!(" (stopped at {} by the time limit)", human_bytes(written))
            } else {
                String::new()
            }
        ),
        duration_ms: ms(start.elapsed()),
    })
}

fn disk_read(path: &Path, virtualized: Option<bool>) -> std::io::Result<DiskRate> {
    // The file just written, in the blocks it was written in, read the way expert streaming
    // reads (the same reader), so the planner prices streaming with the rate streaming gets.
    let len = std::fs::metadata(path)?.len();
    let ranges: Vec<(u64, u64)> = (0..len)
        .step_by(DISK_BLOCK)
        .map(|off| (off, (len - off).min(DISK_BLOCK as u64)))
        .collect();
    let start = Instant::now();
    let (gb_s, uncached) = measure_read_bandwidth(path, &ranges, 1, true)?;
    let mut method = format!(
        "sequential 4 MiB reads of the file just written, {}",
        if uncached {
            sys::DIRECT_METHOD
        } else {
            "buffered reads, each followed by posix_fadvise(DONTNEED) (direct reads unavailable)"
        }
    );
    if virtualized == Some(true) {
        method.push_str("; this is a virtual machine, so the hypervisor's cache may serve reads");
    }
    Ok(DiskRate {
        bytes_per_s: gb_s * 1e9,
        bytes: len,
        possibly_cached: !uncached,
        method,
        duration_ms: ms(start.elapsed()),
    })
}
