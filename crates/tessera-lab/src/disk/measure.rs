//! Measuring a host's disk from inside its cgroup: `O_DIRECT` reads (no page cache, so every
//! byte comes from the device and passes its throttle), and whether the page cache it fills
//! is bounded by its memory cap.
//!
//! The direct reads run on threads that join the host's cgroup themselves (`enter`, called
//! first on each), so the kernel throttles their I/O as it throttles the host's processes.
//! The page cache is checked with a process started in the host (`dd`): a thread moved into a
//! v1 memory cgroup alone was not charged for the page cache it filled (measured here), a
//! process is.

use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The alignment `O_DIRECT` asks of offsets, lengths and buffers (a page covers every
/// logical block size in use).
const ALIGN: usize = 4096;

/// How to load the disk.
#[derive(Debug, Clone, Copy)]
pub struct ReadLoad {
    /// Bytes per read (a multiple of 4 KiB).
    pub block: usize,
    /// Reads in flight: one thread each.
    pub depth: usize,
    /// Left out at the start (the throttle's first slice, the threads starting).
    pub warmup: Duration,
    /// Measured.
    pub span: Duration,
}

impl ReadLoad {
    /// Large reads several at a time: what bounds them is bandwidth.
    pub fn bandwidth() -> Self {
        Self {
            block: 1 << 20,
            depth: 4,
            warmup: Duration::from_millis(300),
            span: Duration::from_millis(1500),
        }
    }

    /// Small reads many at a time: what bounds them is operations per second.
    pub fn iops() -> Self {
        Self {
            block: 4096,
            depth: 8,
            ..Self::bandwidth()
        }
    }
}

/// What a load achieved.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Rate {
    pub bytes_per_s: f64,
    pub ops_per_s: f64,
}

/// A file of pseudo-random bytes, out of the page cache, removed when dropped.
#[derive(Debug)]
pub struct TestFile {
    pub path: PathBuf,
    pub len: u64,
}

impl TestFile {
    /// Writes `len` bytes (rounded up to MiB) at `path`, syncs them and drops them from the
    /// page cache, so that reads go to the disk.
    pub fn create(path: &Path, len: u64) -> std::io::Result<Self> {
        let mib = len.div_ceil(1 << 20);
        let mut f = File::create(path)?;
        let file = Self {
            path: path.to_path_buf(),
            len: mib << 20,
        };
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut chunk = vec![0u8; 1 << 20];
        for _ in 0..mib {
            for w in chunk.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&x.to_le_bytes());
            }
            f.write_all(&chunk)?;
        }
        f.sync_all()?;
        drop_cache(&f);
        Ok(file)
    }
}

impl Drop for TestFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Asks the kernel to drop `f`'s clean pages from the page cache.
fn drop_cache(f: &File) {
    use std::os::fd::AsRawFd as _;
    // SAFETY: advice on an open fd; no memory is touched.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// One thread's `O_DIRECT` reads of `block` bytes into an aligned buffer.
struct DirectReader {
    file: File,
    raw: Vec<u8>,
    skew: usize,
    block: usize,
}

impl DirectReader {
    fn open(path: &Path, block: usize) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)?;
        let raw = vec![0u8; block + ALIGN];
        let skew = raw.as_ptr().align_offset(ALIGN);
        Ok(Self {
            file,
            raw,
            skew,
            block,
        })
    }

    /// Reads `block` bytes at `at` (a multiple of the alignment).
    fn read_at(&mut self, at: u64) -> std::io::Result<()> {
        let buf = &mut self.raw[self.skew..self.skew + self.block];
        self.file.read_exact_at(buf, at)
    }
}

/// `load` of random aligned `O_DIRECT` reads over the first `len` bytes of `path`, each thread
/// first calling `enter` (joining the host's cgroup; its guard is dropped when the thread ends).
pub fn direct_reads<G>(
    (path, len): (&Path, u64),
    load: &ReadLoad,
    enter: &(dyn Fn() -> std::io::Result<G> + Sync),
) -> std::io::Result<Rate> {
    assert!(load.block.is_multiple_of(ALIGN) && load.block > 0 && load.depth > 0);
    let blocks = (len / load.block as u64).max(1);
    let (bytes, ops) = (AtomicU64::new(0), AtomicU64::new(0));
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..load.depth)
            .map(|t| {
                let (bytes, ops, stop) = (&bytes, &ops, &stop);
                s.spawn(move || -> std::io::Result<()> {
                    let _guard = enter()?;
                    let mut reader = DirectReader::open(path, load.block)?;
                    let mut x = 0x2545_F491_4F6C_DD1Du64 ^ (t as u64 + 1);
                    while !stop.load(Ordering::Relaxed) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let at = (x % blocks) * load.block as u64;
                        reader.read_at(at)?;
                        bytes.fetch_add(load.block as u64, Ordering::Relaxed);
                        ops.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                })
            })
            .collect();
        std::thread::sleep(load.warmup);
        let (b0, o0, t0) = (
            bytes.load(Ordering::Relaxed),
            ops.load(Ordering::Relaxed),
            Instant::now(),
        );
        std::thread::sleep(load.span);
        let (b1, o1, secs) = (
            bytes.load(Ordering::Relaxed),
            ops.load(Ordering::Relaxed),
            t0.elapsed().as_secs_f64(),
        );
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            w.join()
                .map_err(|_| std::io::Error::other("a reader panicked"))??;
        }
        Ok(Rate {
            bytes_per_s: (b1 - b0) as f64 / secs,
            ops_per_s: (o1 - o0) as f64 / secs,
        })
    })
}

/// The rate of one burst of `bytes` of sequential `O_DIRECT` reads over the first `len` bytes
/// of `path` after `idle` without reads ([`ReadLoad::bandwidth`]'s size and reads in flight), from
/// threads that first call `enter`: what a reader
/// that reads now and then (a ring stage streaming experts) gets, where [`direct_reads`]
/// measures a reader that never stops.
pub fn burst_after_idle<G>(
    (path, len): (&Path, u64),
    bytes: u64,
    idle: Duration,
    enter: &(dyn Fn() -> std::io::Result<G> + Sync),
) -> std::io::Result<f64> {
    let ReadLoad { block, depth, .. } = ReadLoad::bandwidth();
    let reads = (bytes / block as u64).max(1);
    let next = AtomicU64::new(0);
    std::thread::sleep(idle);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..depth)
            .map(|_| {
                let next = &next;
                s.spawn(move || -> std::io::Result<()> {
                    let _guard = enter()?;
                    let mut reader = DirectReader::open(path, block)?;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= reads {
                            return Ok(());
                        }
                        let at = (i * block as u64) % len.max(block as u64);
                        reader.read_at(at)?;
                    }
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| std::io::Error::other("a reader panicked"))??;
        }
        Ok::<(), std::io::Error>(())
    })?;
    Ok((reads * block as u64) as f64 / t0.elapsed().as_secs_f64())
}

/// Whether a host's page cache is held to its memory cap: files read twice through the page
/// cache, counting what each pass fetched from the disk.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PageCache {
    pub memory_cap: u64,
    /// A file well within the cap: the second pass should fetch nothing.
    pub small: Passes,
    /// A file several times the cap: the second pass should fetch at least what the cap
    /// could not hold.
    pub large: Passes,
    /// The host's page cache after the passes (the cgroup's `cache`/`file` figure).
    pub cached_after: Option<u64>,
}

/// Bytes fetched from the disk by each pass over a file.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Passes {
    pub len: u64,
    pub first: u64,
    pub again: u64,
}

impl PageCache {
    /// The page cache stayed within the cap: the small file was served from it the second
    /// time, the large one could not have been (more than the cap came from the disk again),
    /// and what was cached afterwards is within the cap.
    pub fn bounded(&self) -> bool {
        self.small.again <= self.small.len / 10
            && self.large.again + self.memory_cap >= self.large.len
            && self.cached_after.is_some_and(|c| c <= self.memory_cap)
    }
}

/// Reads `small` then `large` twice each, buffered, each pass by `fetched` (which runs a
/// reader of the file it is given inside the host and returns the bytes the pass fetched from
/// the disk: [`inblock_of`] for a real disk, an emulated disk's own count for a view);
/// `cached` reads the host's page cache figure afterwards.
pub fn page_cache(
    memory_cap: u64,
    small: &TestFile,
    large: &TestFile,
    fetched: impl Fn(&Path) -> std::io::Result<u64>,
    cached: impl FnOnce() -> Option<u64>,
) -> std::io::Result<PageCache> {
    let twice = |f: &TestFile| -> std::io::Result<Passes> {
        Ok(Passes {
            len: f.len,
            first: fetched(&f.path)?,
            again: fetched(&f.path)?,
        })
    };
    Ok(PageCache {
        memory_cap,
        small: twice(small)?,
        large: twice(large)?,
        cached_after: cached(),
    })
}

/// Runs `cmd` to its successful end: the bytes it caused to be fetched from a block device (its
/// `ru_inblock`, the kernel's `read_bytes` in 512-byte units, read-ahead included; a FUSE
/// file's reads are not counted).
pub fn inblock_of(mut cmd: Command) -> std::io::Result<u64> {
    let child = cmd.spawn()?;
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: rusage is plain data, filled by wait4.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child; both out-pointers are valid.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if r != pid {
        return Err(std::io::Error::last_os_error());
    }
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        return Err(std::io::Error::other(format!(
            "{cmd:?} failed (wait status {status})"
        )));
    }
    Ok(usage.ru_inblock as u64 * 512)
}

/// The value of `name` in a `name: value` or `name value` listing.
pub fn field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once([':', ' '])?;
        (k == name).then(|| v.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_from_both_listing_styles() {
        assert_eq!(
            field("rchar: 5\nread_bytes: 4096\n", "read_bytes"),
            Some(4096)
        );
        assert_eq!(field("cache 123\nrss 9\n", "cache"), Some(123));
        assert_eq!(field("total_cache 7\n", "cache"), None);
    }

    #[test]
    fn a_bounded_page_cache_needs_all_three_signs() {
        let mib = 1u64 << 20;
        let ok = PageCache {
            memory_cap: 64 * mib,
            small: Passes {
                len: 16 * mib,
                first: 16 * mib,
                again: 0,
            },
            large: Passes {
                len: 192 * mib,
                first: 192 * mib,
                again: 190 * mib,
            },
            cached_after: Some(60 * mib),
        };
        assert!(ok.bounded());
        // The large file served from a cache beyond the cap: not bounded.
        let mut unbounded = ok.clone();
        unbounded.large.again = 0;
        assert!(!unbounded.bounded());
        let mut over = ok.clone();
        over.cached_after = Some(100 * mib);
        assert!(!over.bounded());
        // Nothing cached at all (the small file fetched twice) is another failure.
        let mut uncached = ok;
        uncached.small.again = 16 * mib;
        assert!(!uncached.bounded());
    }

    #[test]
    fn direct_reads_of_a_file_count_whole_blocks() {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        let f = TestFile::create(&dir.path().join("t"), 4 << 20).unwrap();
        assert_eq!(f.len, 4 << 20);
        let load = ReadLoad {
            block: 64 << 10,
            depth: 2,
            warmup: Duration::from_millis(10),
            span: Duration::from_millis(50),
        };
        match direct_reads((f.path.as_path(), f.len), &load, &|| Ok(())) {
            Ok(r) => {
                assert!(r.ops_per_s > 0.0);
                let per_op = r.bytes_per_s / r.ops_per_s;
                assert!((per_op - 65536.0).abs() < 1.0, "{per_op}");
            }
            // A file system without O_DIRECT (tmpfs) refuses the open.
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}"),
        }
    }
}
