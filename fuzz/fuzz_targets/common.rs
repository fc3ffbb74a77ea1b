//! Shared by every target: an allocator that turns any single oversized allocation into a crash.
//!
//! libFuzzer's `-malloc_limit_mb` needs a sanitizer's malloc hooks, which a stable-toolchain
//! build (`--sanitizer none`) does not have; `-rss_limit_mb` only sees the total. This wrapper
//! makes "allocation is bounded by the input" a checked property: a parser that trusts a length
//! field and reserves gigabytes aborts here with the offending input saved as a crash.

use std::alloc::{GlobalAlloc, Layout, System};

/// Largest single allocation any target may make. Inputs are at most a few hundred KiB, so an
/// honest parser never comes near this.
pub const MAX_ALLOC: usize = 64 << 20;

pub struct BoundedAlloc;

impl BoundedAlloc {
    #[inline]
    fn check(size: usize) {
        if size > MAX_ALLOC {
            // Unwinding out of an allocator is not allowed: report, then abort (libFuzzer saves
            // the input on SIGABRT). The backtrace's own allocations are small, so they pass.
            let msg = b"fuzz: single allocation over MAX_ALLOC (64 MiB): unbounded allocation\n";
            // SAFETY: writing a static buffer to stderr.
            unsafe { libc_write(2, msg.as_ptr(), msg.len()) };
            eprintln!(
                "fuzz: requested {size} bytes at\n{}",
                std::backtrace::Backtrace::force_capture()
            );
            std::process::abort();
        }
    }
}

extern "C" {
    #[link_name = "write"]
    fn libc_write(fd: i32, buf: *const u8, n: usize) -> isize;
}

// SAFETY: forwards to the system allocator after a size check.
unsafe impl GlobalAlloc for BoundedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::check(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::check(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::check(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
