//! Positioned reads of a file, kept out of the page cache if asked — the engine's expert
//! streaming reads a model's experts with it, and the host's disk probe measures with it, so
//! the figure the planner prices streaming with is the one streaming gets: on Linux `O_DIRECT`
//! reads of 4 KiB-aligned supersets of the ranges into aligned, pooled buffers; elsewhere, or
//! where the file system refuses `O_DIRECT`, buffered reads followed by
//! `posix_fadvise(DONTNEED)`.

use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::sys::{drop_cached_range, open_direct, DIRECT_ALIGN};

/// Positioned reads of the model file, kept out of the page cache if asked.
pub struct Reader {
    file: File,
    /// The same file opened with `O_DIRECT` (when asked for and allowed).
    direct: Option<File>,
    /// Cleared when a direct read is refused (then buffered reads are used).
    direct_ok: AtomicBool,
    drop_page_cache: bool,
    bufs: Arc<BufPool>,
}

impl Reader {
    pub fn open(path: &std::path::Path, drop_page_cache: bool) -> std::io::Result<Self> {
        let file = File::open(path)?;
        let direct = if drop_page_cache {
            open_direct(path)
        } else {
            None
        };
        Ok(Self {
            file,
            direct_ok: AtomicBool::new(direct.is_some()),
            direct,
            drop_page_cache,
            bufs: Arc::default(),
        })
    }

    pub fn direct(&self) -> bool {
        self.direct_ok.load(Ordering::Relaxed)
    }

    /// Bytes of read buffers allocated now (in use by reads and kept for the next ones).
    pub fn buffer_bytes(&self) -> u64 {
        self.bufs.allocated.load(Ordering::Relaxed) as u64
    }

    /// Reads `len` bytes at `off` into a fresh buffer: `O_DIRECT` of the aligned superset when
    /// possible, else a buffered read (then dropped from the page cache if asked).
    pub fn read_range(&self, off: u64, len: u64) -> std::io::Result<RawBuf> {
        if let (Some(d), true) = (&self.direct, self.direct()) {
            let a0 = off & !(ALIGN - 1);
            let end = (off + len).next_multiple_of(ALIGN);
            let mut buf = self
                .bufs
                .take((end - a0) as usize, (off - a0) as usize, len as usize);
            match read_direct(d, buf.all_mut(), a0, (off + len - a0) as usize) {
                Ok(()) => return Ok(buf),
                Err(e) if e.raw_os_error() == Some(libc_einval()) => {
                    // The file system refuses this direct read: buffered from now on.
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let mut buf = self.bufs.take(len as usize, 0, len as usize);
        read_at(&self.file, &mut buf.all_mut()[..len as usize], off)?;
        if self.drop_page_cache {
            drop_cached_range(&self.file, off, len);
        }
        Ok(buf)
    }
}

/// [`DIRECT_ALIGN`] as a file offset.
const ALIGN: u64 = DIRECT_ALIGN as u64;

/// A [`DIRECT_ALIGN`]-aligned allocation of `cap` initialized bytes.
struct RawAlloc {
    ptr: std::ptr::NonNull<u8>,
    cap: usize,
}

// SAFETY: RawAlloc owns its allocation exclusively (like a Vec<u8>).
unsafe impl Send for RawAlloc {}

impl RawAlloc {
    fn layout(cap: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(cap.max(1), DIRECT_ALIGN).expect("layout")
    }

    fn zeroed(cap: usize) -> Self {
        let layout = Self::layout(cap);
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, cap }
    }
}

impl Drop for RawAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
    }
}

/// Read buffers returned by dropped [`RawBuf`]s, reused by later reads (no allocation, zeroing
/// or page faults per read).
#[derive(Default)]
struct BufPool {
    free: Mutex<Vec<RawAlloc>>,
    /// Bytes of all buffers allocated and not freed (in use or in `free`).
    allocated: AtomicUsize,
}

/// Buffers a pool keeps at most (three ranges for each of four readers).
const POOL_MAX: usize = 12;

impl BufPool {
    /// A buffer of `cap` bytes or more holding a range at `start..start + len`.
    fn take(self: &Arc<Self>, cap: usize, start: usize, len: usize) -> RawBuf {
        assert!(start + len <= cap);
        let reuse = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.iter()
                .position(|a| a.cap >= cap)
                .map(|i| free.swap_remove(i))
        };
        let alloc = reuse.unwrap_or_else(|| {
            self.allocated.fetch_add(cap, Ordering::Relaxed);
            RawAlloc::zeroed(cap)
        });
        RawBuf {
            alloc: Some(alloc),
            pool: Some(Arc::clone(self)),
            start,
            len,
        }
    }
}

/// An aligned byte buffer holding one range at `start..start + len` (returned to its pool when
/// dropped).
pub struct RawBuf {
    alloc: Option<RawAlloc>,
    pool: Option<Arc<BufPool>>,
    pub start: usize,
    pub len: usize,
}

// SAFETY: shared access to the (owned) allocation is read-only.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    fn all_mut(&mut self) -> &mut [u8] {
        match &self.alloc {
            // SAFETY: `cap` initialized bytes owned by self.
            Some(a) => unsafe { std::slice::from_raw_parts_mut(a.ptr.as_ptr(), a.cap) },
            None => &mut [],
        }
    }
}

impl AsRef<[u8]> for RawBuf {
    fn as_ref(&self) -> &[u8] {
        match &self.alloc {
            // SAFETY: `cap` initialized bytes owned by self.
            Some(a) => unsafe { std::slice::from_raw_parts(a.ptr.as_ptr(), a.cap) },
            None => &[],
        }
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        if let (Some(a), Some(pool)) = (self.alloc.take(), &self.pool) {
            let mut free = pool.free.lock().unwrap_or_else(|p| p.into_inner());
            if free.len() < POOL_MAX {
                free.push(a);
            } else {
                pool.allocated.fetch_sub(a.cap, Ordering::Relaxed);
            }
        }
    }
}

/// Measures the read bandwidth (GB/s) a [`Reader`] achieves on `ranges` (offset, length) of
/// `path`, read by `parallelism` threads at once, the way the expert store reads experts
/// (`O_DIRECT` when `drop_page_cache` and allowed, else buffered reads followed by
/// `posix_fadvise(DONTNEED)`). For benchmarks: the disk-bound limit of streaming.
pub fn measure_read_bandwidth(
    path: &std::path::Path,
    ranges: &[(u64, u64)],
    parallelism: usize,
    drop_page_cache: bool,
) -> std::io::Result<(f64, bool)> {
    let reader = Reader::open(path, drop_page_cache)?;
    let n = parallelism.max(1);
    let next = AtomicUsize::new(0);
    let t = std::time::Instant::now();
    let res: std::io::Result<()> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(off, len)) = ranges.get(i) else {
                            return Ok(());
                        };
                        std::hint::black_box(reader.read_range(off, len)?);
                    }
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().unwrap_or(Ok(())))
    });
    res?;
    let bytes: u64 = ranges.iter().map(|r| r.1).sum();
    Ok((
        bytes as f64 / t.elapsed().as_secs_f64() / 1e9,
        reader.direct(),
    ))
}

fn libc_einval() -> i32 {
    #[cfg(unix)]
    {
        libc::EINVAL
    }
    #[cfg(not(unix))]
    {
        22
    }
}

/// Reads at least `need` bytes at `off` (aligned) into `buf` (aligned, a multiple of the
/// alignment long) with direct I/O; a short read at the end of the file is fine once `need`
/// bytes are in.
#[cfg(unix)]
fn read_direct(f: &File, buf: &mut [u8], off: u64, need: usize) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut done = 0;
    while done < need {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "end of file inside the range",
                ))
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(not(unix))]
fn read_direct(f: &File, buf: &mut [u8], off: u64, need: usize) -> std::io::Result<()> {
    read_at(f, &mut buf[..need], off)
}

#[cfg(unix)]
fn read_at(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(buf, off)
}

#[cfg(not(unix))]
fn read_at(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = f.try_clone()?;
    f.seek(SeekFrom::Start(off))?;
    f.read_exact(buf)
}
