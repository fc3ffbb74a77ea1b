//! Memory for repacked weights, on huge pages where the OS gives them.
//!
//! Decode reads every active weight once per token, front to back. On 4 KiB pages that is a
//! page walk for every 4 KiB it streams (a 900 MiB F16 model: 230,000 a token) and the hardware
//! prefetchers start over at each page. A model's matrices are therefore built into large slabs
//! ([`WeightArena`]), 2 MiB-aligned and marked for transparent huge pages (`MADV_HUGEPAGE`, Linux)
//! before they are first touched, so matrices smaller than a huge page share them too (a
//! 1,024-column Q4_0 or an MoE expert's matrix is well under 2 MiB). Measured on a 2-core Zen 4
//! capped to AVX2, dense bench model decode, alternated, 4 pairs each: F16 1 thread 20.5 → 23.7
//! tok/s, 2 threads 28.1 → 32.7.
//!
//! Matrices that come and go — a streamed expert's, built when it is read and dropped when it
//! is evicted — take their ranges from a [`SlotPool`] instead: a dropped matrix's range goes
//! back to the pool and is lent again to the next matrix of its length, so streamed experts
//! sit on huge pages as a loaded model's do (bench-qwen3moe-q4_0 with 640 of its 648 MiB of
//! experts in the cache, decoding: 181–183 → 195–228 tok/s, three runs alternated with `Vec`s
//! on a 2-core Zen 4) and a build writes into memory already faulted in.
//!
//! Where the OS has no transparent huge pages (or they are off) a slab is plain memory and
//! nothing else changes.

use std::alloc::Layout;
use std::collections::{HashMap, VecDeque};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

/// A transparent huge page on x86-64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;
/// The first slab's size; each next one is twice the last, up to [`MAX_SLAB`], unless one
/// matrix needs more. Few slabs per model, so little memory lost at their ends: a slab is
/// left when a matrix does not fit what remains of it, and of that remainder only the huge
/// page it ends in, partly used, is resident (dense Q4_0 bench model: 8 slabs of 32 MiB cost
/// 9.5 MiB more resident than `Vec`s did).
const SLAB: usize = 32 << 20;
const MAX_SLAB: usize = 512 << 20;
/// Matrices in a slab start on a cache line.
const ALIGN: usize = 64;

/// The bytes of one repacked matrix: its own `Vec`, or its range of a slab.
pub(crate) struct WeightBuffer(Storage);

enum Storage {
    Owned(Vec<u8>),
    Slab(SlabRange),
}

/// `len` bytes at `start` of `slab`, which no other buffer overlaps; zero unless `written`
/// (lent mutably since they were zeroed, or lent again by a pool).
struct SlabRange {
    slab: Arc<Slab>,
    start: usize,
    len: usize,
    written: bool,
    /// The pool the range goes back to when dropped; `None`: an arena's, freed with its slab.
    pool: Option<Arc<Mutex<Pool>>>,
}

impl SlabRange {
    fn bytes(&self) -> *mut u8 {
        // SAFETY: `start` lies inside the slab (`Carver::carve`).
        unsafe { self.slab.ptr.as_ptr().add(self.start) }
    }
}

impl Drop for SlabRange {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            lock(&pool).give_back(Arc::clone(&self.slab), self.start, self.len);
        }
    }
}

impl WeightBuffer {
    /// `len` zero bytes: in this buffer's slab range when it has exactly `len` (the arena or
    /// pool reserved it for this matrix; zeroed there, so not again unless written since),
    /// else in a `Vec` reusing this one's allocation.
    pub(crate) fn zeroed(mut self, len: usize) -> Self {
        match &mut self.0 {
            // The range goes back to its pool (or slab) as `self` drops.
            Storage::Slab(r) if r.len != len => return Self(Storage::Owned(vec![0; len])),
            Storage::Slab(r) => {
                if r.written {
                    // SAFETY: the range is this buffer's alone (see `deref_mut`).
                    unsafe { r.bytes().write_bytes(0, r.len) };
                    r.written = false;
                }
            }
            Storage::Owned(v) => {
                v.clear();
                v.resize(len, 0);
            }
        }
        self
    }

    /// Bytes held alive for this buffer: a `Vec`'s whole allocation, or the slab range.
    pub(crate) fn capacity(&self) -> usize {
        match &self.0 {
            Storage::Owned(v) => v.capacity(),
            Storage::Slab(r) => r.len,
        }
    }
}

impl std::fmt::Debug for WeightBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.0 {
            Storage::Owned(_) => "owned",
            Storage::Slab(r) if r.pool.is_some() => "in a pool's slab",
            Storage::Slab(_) => "in a slab",
        };
        write!(f, "WeightBuffer({} bytes, {kind})", self.len())
    }
}

impl From<Vec<u8>> for WeightBuffer {
    fn from(v: Vec<u8>) -> Self {
        Self(Storage::Owned(v))
    }
}

impl std::ops::Deref for WeightBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Storage::Owned(v) => v,
            // SAFETY: the range lies inside the slab, was zeroed or written through this
            // buffer before it was lent, and is written only through it (`deref_mut`); the Arc
            // keeps the slab alive.
            Storage::Slab(r) => unsafe { std::slice::from_raw_parts(r.bytes(), r.len) },
        }
    }
}

impl std::ops::DerefMut for WeightBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Storage::Owned(v) => v,
            // SAFETY: as `deref`; an arena or pool hands each range to one buffer at a time,
            // so `&mut self` is the only access to these bytes.
            Storage::Slab(r) => unsafe {
                r.written = true;
                std::slice::from_raw_parts_mut(r.bytes(), r.len)
            },
        }
    }
}

/// One huge-page-aligned allocation that matrices are carved from.
struct Slab {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a slab is plain memory; who reads or writes which bytes is governed by the
// `WeightBuffer`s over it, each of which owns a disjoint range.
unsafe impl Send for Slab {}
// SAFETY: as above.
unsafe impl Sync for Slab {}

impl Slab {
    /// `size` bytes (a multiple of [`HUGE_PAGE`]), marked for huge pages before any is touched.
    fn new(size: usize) -> Self {
        let layout = Layout::from_size_align(size, HUGE_PAGE).expect("slab size fits a layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        #[cfg(target_os = "linux")]
        // SAFETY: the range is this allocation, page-aligned; the advice only changes how the
        // kernel backs it (a no-op where transparent huge pages are off).
        unsafe {
            libc::madvise(ptr.as_ptr().cast(), size, libc::MADV_HUGEPAGE);
        }
        Self { ptr, layout }
    }

    /// Hands the whole pages inside `start..start + len` back to the OS (Linux; elsewhere
    /// nothing): they read as zeros and are faulted in again when next written. Whether it did.
    fn release(&self, start: usize, len: usize) -> bool {
        #[cfg(target_os = "linux")]
        {
            const PAGE: usize = 4096;
            let base = self.ptr.as_ptr() as usize;
            let from = (base + start).next_multiple_of(PAGE);
            let to = (base + start + len) / PAGE * PAGE;
            if to > from {
                // SAFETY: whole pages of this allocation that no buffer holds (the range is
                // free in its pool); they are zero-filled when touched again.
                unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_DONTNEED) };
            }
            true
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (start, len);
            false
        }
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: allocated in `Slab::new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Carves ranges from slabs in order: the next fits in the current slab or starts a new one.
struct Carver {
    slab: Option<Arc<Slab>>,
    /// Bytes of the current slab already carved.
    used: usize,
    /// The size of the next slab ([`SLAB`] doubling).
    next: usize,
}

impl Carver {
    fn new() -> Self {
        Self {
            slab: None,
            used: 0,
            next: SLAB,
        }
    }

    /// A range of `len` (> 0) bytes that nothing else was given. A range larger than a slab
    /// gets a slab of its own.
    fn carve(&mut self, len: usize) -> (Arc<Slab>, usize) {
        let start = self.used.next_multiple_of(ALIGN);
        let room = self.slab.as_ref().map_or(0, |s| s.layout.size());
        let (slab, start) = match &self.slab {
            Some(slab) if start + len <= room => (Arc::clone(slab), start),
            _ => {
                let slab = Arc::new(Slab::new(len.max(self.next).next_multiple_of(HUGE_PAGE)));
                self.next = (2 * self.next).min(MAX_SLAB);
                self.slab = Some(Arc::clone(&slab));
                (slab, 0)
            }
        };
        self.used = start + len;
        (slab, start)
    }
}

/// Hands out zeroed [`WeightBuffer`]s from huge-page slabs, in order, for the matrices a
/// model loads (see the module doc).
pub(crate) struct WeightArena(Carver);

impl WeightArena {
    pub(crate) fn new() -> Self {
        Self(Carver::new())
    }

    /// `len` zero bytes for one matrix.
    pub(crate) fn take(&mut self, len: usize) -> WeightBuffer {
        if len == 0 {
            return WeightBuffer::from(Vec::new());
        }
        let (slab, start) = self.0.carve(len);
        let r = SlabRange {
            slab,
            start,
            len,
            written: true,
            pool: None,
        };
        // This first write is what faults the range's pages in, huge where the OS allows.
        WeightBuffer(Storage::Slab(r)).zeroed(len)
    }
}

/// [`WeightBuffer`]s from huge-page slabs for matrices that come and go (see the module doc):
/// a buffer dropped goes back to the pool, and [`SlotPool::take`] lends a free range of the
/// length asked for before it carves a new one. Free ranges are kept resident up to `keep`
/// bytes; beyond that their pages go back to the OS (the range stays, to be lent again).
#[derive(Clone)]
pub(crate) struct SlotPool(Arc<Mutex<Pool>>);

struct Pool {
    carver: Carver,
    /// Free ranges by length: resident ones at the back (lent first), released ones in front.
    free: HashMap<usize, VecDeque<FreeRange>>,
    /// Bytes of the free ranges still resident.
    resident_free: u64,
    keep: u64,
}

struct FreeRange {
    slab: Arc<Slab>,
    start: usize,
    resident: bool,
}

fn lock(pool: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    pool.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pool {
    fn give_back(&mut self, slab: Arc<Slab>, start: usize, len: usize) {
        let list = self.free.entry(len).or_default();
        if self.resident_free + len as u64 <= self.keep || !slab.release(start, len) {
            self.resident_free += len as u64;
            list.push_back(FreeRange {
                slab,
                start,
                resident: true,
            });
        } else {
            list.push_front(FreeRange {
                slab,
                start,
                resident: false,
            });
        }
    }
}

impl SlotPool {
    /// A pool keeping up to `keep` bytes of free ranges resident.
    pub(crate) fn new(keep: u64) -> Self {
        Self(Arc::new(Mutex::new(Pool {
            carver: Carver::new(),
            free: HashMap::new(),
            resident_free: 0,
            keep,
        })))
    }

    /// A free range of `len` bytes, if the pool has one, back in the pool when the buffer (or
    /// the matrix built into it) is dropped: it holds the last matrix's bytes (or zeros) until
    /// it is `zeroed`, as every build does first. Quick: a caller may hold its own lock.
    pub(crate) fn lend_free(&self, len: usize) -> Option<WeightBuffer> {
        let mut pool = lock(&self.0);
        let f = pool.free.get_mut(&len)?.pop_back()?;
        if f.resident {
            pool.resident_free -= len as u64;
        }
        drop(pool);
        Some(WeightBuffer(Storage::Slab(SlabRange {
            slab: f.slab,
            start: f.start,
            len,
            written: true,
            pool: Some(Arc::clone(&self.0)),
        })))
    }

    /// A new range of `len` zero bytes, back in the pool when dropped (zeroing it faults it
    /// in: call it outside other locks).
    pub(crate) fn carve(&self, len: usize) -> WeightBuffer {
        if len == 0 {
            return WeightBuffer::from(Vec::new());
        }
        let (slab, start) = lock(&self.0).carver.carve(len);
        let r = SlabRange {
            slab,
            start,
            len,
            written: true,
            pool: Some(Arc::clone(&self.0)),
        };
        WeightBuffer(Storage::Slab(r)).zeroed(len)
    }

    /// Gives the pages of resident free ranges back to the OS until at most `keep` bytes of
    /// them stay resident (the ranges stay, to be lent again; Linux, elsewhere nothing): the
    /// owner's memory is over its bound and the pool's free memory is what can go at once.
    pub(crate) fn release_beyond(&self, keep: u64) {
        let mut pool = lock(&self.0);
        let pool = &mut *pool;
        let lens: Vec<usize> = pool.free.keys().copied().collect();
        for len in lens {
            let list = pool.free.get_mut(&len).expect("a listed length");
            while pool.resident_free > keep {
                let Some(f) = list.pop_back() else { break };
                if !f.resident || !f.slab.release(f.start, len) {
                    list.push_back(f);
                    break;
                }
                pool.resident_free -= len as u64;
                list.push_front(FreeRange {
                    resident: false,
                    ..f
                });
            }
        }
    }

    /// Bytes of free ranges the pool keeps resident (memory the process holds for it).
    pub(crate) fn free_bytes(&self) -> u64 {
        lock(&self.0).resident_free
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_buffers_are_zeroed_disjoint_and_outlive_the_arena() {
        let mut arena = WeightArena::new();
        let mut a = arena.take(100);
        let mut b = arena.take(SLAB); // does not fit what is left: a slab of its own
        let mut c = arena.take(3);
        assert_eq!((a.len(), b.len(), c.len()), (100, SLAB, 3));
        assert!(a.iter().chain(b.iter()).chain(c.iter()).all(|&x| x == 0));
        a.fill(1);
        b.fill(2);
        c.fill(3);
        drop(arena);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
        assert!(c.iter().all(|&x| x == 3));
        // Slabs start on a huge page; what is carved from them on a cache line.
        assert_eq!(a.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(c.as_ptr() as usize % ALIGN, 0);
        // The reserved length stays in the slab, zeroed again once written; any other length
        // moves to a Vec.
        let a = a.zeroed(100);
        assert_eq!(&*a, &[0; 100]);
        let a = a.zeroed(7);
        assert_eq!(&*a, &[0; 7]);
    }

    fn take(pool: &SlotPool, len: usize) -> WeightBuffer {
        pool.lend_free(len).unwrap_or_else(|| pool.carve(len))
    }

    #[test]
    fn a_pool_lends_a_dropped_range_again_to_its_length_and_releases_what_it_need_not_keep() {
        let pool = SlotPool::new(1000);
        let mut a = take(&pool, 600);
        assert!(a.iter().all(|&x| x == 0));
        a.fill(7);
        let at = a.as_ptr();
        assert_eq!(a.as_ptr() as usize % ALIGN, 0);
        drop(a);
        assert_eq!(pool.free_bytes(), 600);
        // Another length gets a range of its own; the same length gets the dropped one, with
        // its bytes until zeroed (every build zeroes first).
        let b = take(&pool, 300);
        assert_ne!(b.as_ptr(), at);
        let a = take(&pool, 600);
        assert_eq!((a.as_ptr(), pool.free_bytes()), (at, 0));
        assert!(a.iter().all(|&x| x == 7));
        let a = a.zeroed(600);
        assert!(a.iter().all(|&x| x == 0));
        // Past `keep` bytes of free ranges, a dropped one is not kept resident (Linux: its
        // whole pages go back to the OS) and not counted; it is lent again all the same.
        let c = take(&pool, 600);
        let c_at = c.as_ptr();
        drop(a);
        drop(c);
        let (mut d, e) = if cfg!(target_os = "linux") {
            assert_eq!(pool.free_bytes(), 600);
            let d = take(&pool, 600);
            let e = take(&pool, 600);
            assert_eq!(pool.free_bytes(), 0);
            assert!([d.as_ptr(), e.as_ptr()].contains(&c_at));
            (d, e)
        } else {
            (take(&pool, 600), take(&pool, 600))
        };
        d.fill(1);
        // Released on demand down to what may stay: the range is kept, lent again all the same.
        let e_at = e.as_ptr();
        drop(e);
        if cfg!(target_os = "linux") {
            assert_eq!(pool.free_bytes(), 600);
            pool.release_beyond(599);
            assert_eq!(pool.free_bytes(), 0);
        }
        let e = take(&pool, 600);
        assert_eq!(e.as_ptr(), e_at);
        // A range outlives its pool's handle: it goes back to the pool's state, freed with
        // the last range.
        drop(pool);
        assert!(d.iter().all(|&x| x == 1));
        drop((b, d, e));
    }
}
