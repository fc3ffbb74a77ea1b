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
//! Where the OS has no transparent huge pages (or they are off) a slab is plain memory and
//! nothing else changes. Matrices built outside an arena (an expert streamed from disk, whose
//! buffer is recycled when it is evicted) own a plain `Vec`.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

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

/// The bytes of one repacked matrix: its own `Vec`, or its range of an arena's slab.
pub(crate) struct WeightBuffer(Storage);

enum Storage {
    Owned(Vec<u8>),
    /// `len` bytes at `start` of `slab`, which no other buffer overlaps; zero unless
    /// `written` (lent mutably since they were zeroed).
    Slab {
        slab: Arc<Slab>,
        start: usize,
        len: usize,
        written: bool,
    },
}

impl WeightBuffer {
    /// `len` zero bytes: in this buffer's slab range when it has exactly `len` (the arena
    /// reserved it for this matrix; zeroed there, so not again unless written since), else in
    /// a `Vec` reusing this one's allocation.
    pub(crate) fn zeroed(mut self, len: usize) -> Self {
        match self.0 {
            Storage::Slab {
                len: have, written, ..
            } => {
                if have != len {
                    return Self(Storage::Owned(vec![0; len]));
                }
                if written {
                    self.fill(0);
                }
                if let Storage::Slab { written, .. } = &mut self.0 {
                    *written = false;
                }
                self
            }
            Storage::Owned(mut v) => {
                v.clear();
                v.resize(len, 0);
                Self(Storage::Owned(v))
            }
        }
    }

    /// Bytes held alive for this buffer: a `Vec`'s whole allocation, or the slab range.
    pub(crate) fn capacity(&self) -> usize {
        match &self.0 {
            Storage::Owned(v) => v.capacity(),
            Storage::Slab { len, .. } => *len,
        }
    }

    /// The `Vec` to build another matrix into; nothing for a slab range (the slab is freed
    /// with the last matrix in it).
    pub(crate) fn into_vec(self) -> Vec<u8> {
        match self.0 {
            Storage::Owned(v) => v,
            Storage::Slab { .. } => Vec::new(),
        }
    }
}

impl std::fmt::Debug for WeightBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.0 {
            Storage::Owned(_) => "owned",
            Storage::Slab { .. } => "in a slab",
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
            // SAFETY: the range lies inside the slab, was zeroed when it was reserved, and is
            // written only through this buffer (`deref_mut`); the Arc keeps the slab alive.
            Storage::Slab {
                slab, start, len, ..
            } => unsafe { std::slice::from_raw_parts(slab.ptr.as_ptr().add(*start), *len) },
        }
    }
}

impl std::ops::DerefMut for WeightBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Storage::Owned(v) => v,
            // SAFETY: as `deref`; the arena hands each range to one buffer only, so `&mut self`
            // is the only access to these bytes.
            Storage::Slab {
                slab,
                start,
                len,
                written,
            } => unsafe {
                *written = true;
                std::slice::from_raw_parts_mut(slab.ptr.as_ptr().add(*start), *len)
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
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: allocated in `Slab::new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Hands out zeroed [`WeightBuffer`]s from huge-page slabs, in order, for the matrices a
/// model loads (see the module doc).
pub(crate) struct WeightArena {
    slab: Option<Arc<Slab>>,
    /// Bytes of the current slab already handed out.
    used: usize,
    /// The size of the next slab ([`SLAB`] doubling).
    next: usize,
}

impl WeightArena {
    pub(crate) fn new() -> Self {
        Self {
            slab: None,
            used: 0,
            next: SLAB,
        }
    }

    /// `len` zero bytes for one matrix. A matrix larger than a slab gets a slab of its own.
    pub(crate) fn take(&mut self, len: usize) -> WeightBuffer {
        if len == 0 {
            return WeightBuffer::from(Vec::new());
        }
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
        // SAFETY: `start..start + len` lies in the slab and no buffer has been given it. This
        // first write is what faults its pages in, huge where the OS allows.
        unsafe { slab.ptr.as_ptr().add(start).write_bytes(0, len) };
        WeightBuffer(Storage::Slab {
            slab,
            start,
            len,
            written: false,
        })
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
        assert_eq!(b.into_vec().capacity(), 0);
    }
}
