//! The few operating-system calls std does not expose, each behind `cfg` with an honest
//! "unknown" (`None` or an `Unsupported` error) where a platform lacks them.

use std::fs::File;
use std::io;
use std::path::Path;

/// Free space available to an unprivileged user and total size of the filesystem holding
/// `path`, in bytes (`statvfs`: `f_bavail × f_frsize`, `f_blocks × f_frsize`).
#[cfg(unix)]
pub fn fs_space(path: &Path) -> io::Result<(u64, u64)> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid NUL-terminated string and `st` points to writable memory of the
    // right type; statvfs fully initialises it when it returns 0.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: rc == 0, so statvfs initialised the struct.
    let st = unsafe { st.assume_init() };
    // The field types differ between platforms (u32 on some, u64 on others).
    #[allow(clippy::unnecessary_cast)]
    let (frsize, bavail, blocks) = (st.f_frsize as u64, st.f_bavail as u64, st.f_blocks as u64);
    Ok((bavail.saturating_mul(frsize), blocks.saturating_mul(frsize)))
}

#[cfg(not(unix))]
pub fn fs_space(_path: &Path) -> io::Result<(u64, u64)> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "free-space query not implemented on this platform",
    ))
}

/// The host name, if the system reports one.
#[cfg(unix)]
pub fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its full length; gethostname writes at most that many
    // bytes. POSIX does not promise NUL termination on truncation, so we search for it below.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).trim().to_string();
    (!name.is_empty()).then_some(name)
}

#[cfg(not(unix))]
pub fn hostname() -> Option<String> {
    std::env::var("COMPUTERNAME").ok()
}

/// Logical processors online in the whole machine (`sysconf(_SC_NPROCESSORS_ONLN)`), which can
/// exceed what this process may use (affinity masks, cgroup quotas).
#[cfg(unix)]
pub fn cpus_online() -> Option<usize> {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).ok().filter(|&n| n > 0)
}

#[cfg(not(unix))]
pub fn cpus_online() -> Option<usize> {
    None
}

/// Alignment of `O_DIRECT` offsets, lengths and buffers (a page: enough for any logical block
/// size up to 4 KiB).
pub const DIRECT_ALIGN: usize = 4096;

/// How [`open_direct`] keeps reads out of the page cache on this platform.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub const DIRECT_METHOD: &str = "O_DIRECT";
#[cfg(any(target_os = "macos", target_os = "ios"))]
pub const DIRECT_METHOD: &str = "F_NOCACHE";
#[cfg(not(any(
    target_os = "linux",
    target_os = "android",
    target_os = "macos",
    target_os = "ios"
)))]
pub const DIRECT_METHOD: &str = "none";

/// Opens `path` for reads that bypass the page cache: `O_DIRECT` on Linux, `F_NOCACHE` on
/// macOS; `None` elsewhere or where the file system refuses (tmpfs, some network file systems).
/// Reads then use [`DIRECT_ALIGN`]ed offsets, lengths and buffers (which `F_NOCACHE` does not
/// need but accepts). Shared by the disk probe and the engine's expert streaming
/// ([`crate::direct_read`]), so both read the way the other measured.
pub fn open_direct(path: &Path) -> Option<File> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok()
    }
    #[cfg(any(target_os = "macos", target_os = "ios"))]
    {
        use std::os::unix::io::AsRawFd;
        let file = File::open(path).ok()?;
        // SAFETY: fcntl on a descriptor we own; F_NOCACHE takes an int argument.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) };
        (rc != -1).then_some(file)
    }
    #[cfg(not(any(
        target_os = "linux",
        target_os = "android",
        target_os = "macos",
        target_os = "ios"
    )))]
    {
        let _ = path;
        None
    }
}

/// Asks the kernel to drop the clean cached pages of `off..off + len` (`len` 0: to the end of
/// the file). True if the advice was accepted; advice only, so callers go on either way.
pub fn drop_cached_range(file: &File, off: u64, len: u64) -> bool {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is open.
        let rc = unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                off as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        rc == 0
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let _ = (file, off, len);
        false
    }
}

/// A numeric sysctl value by name (macOS: `hw.memsize`, …).
#[cfg(any(target_os = "macos", target_os = "ios"))]
pub fn sysctl_u64(name: &str) -> Option<u64> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut value: u64 = 0;
    let mut len = std::mem::size_of::<u64>();
    // SAFETY: value/len describe a writable u64; newp is null (read only).
    let rc = unsafe {
        libc::sysctlbyname(
            c.as_ptr(),
            (&mut value as *mut u64).cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    (rc == 0 && len == std::mem::size_of::<u64>()).then_some(value)
}

/// A string sysctl value by name (macOS: `machdep.cpu.brand_string`).
#[cfg(any(target_os = "macos", target_os = "ios"))]
pub fn sysctl_string(name: &str) -> Option<String> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0u8; 256];
    let mut len = buf.len();
    // SAFETY: buf/len describe writable memory; newp is null (read only).
    let rc = unsafe {
        libc::sysctlbyname(
            c.as_ptr(),
            buf.as_mut_ptr().cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    if rc != 0 {
        return None;
    }
    buf.truncate(len);
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let s = String::from_utf8_lossy(&buf[..end]).trim().to_string();
    (!s.is_empty()).then_some(s)
}
