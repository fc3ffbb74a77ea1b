//! An emulated disk: a read-only view of a directory (FUSE) whose reads take the time a disk of
//! a [`DiskProfile`]'s rates would take, one read after another.
//!
//! Why not only the cgroup throttle ([`super::DiskCap`]): the throttle bounds a host's
//! *average* rate over its slice, so a read after a pause runs at this machine's own disk
//! speed until the slice catches up (`tessera lab selftest`'s "burst after idle" check
//! measured 1.4–1.8 GB/s under caps of 90–550 MB/s). A host that reads now and then — a ring
//! stage streaming its experts while the token is on the other stages — then reads far faster
//! than the disk it stands for. A real disk has no such credit: each read takes its size over
//! the disk's rate, after the reads before it ([`DiskClock`]).
//!
//! Each host with a disk gets its own view (its own clock, its own page cache: the kernel
//! caches a FUSE file's pages per mount, charged to the memory cgroup of the reader), mounted
//! in a directory of the lab's and bound over the real directory in the host's own mount
//! namespace ([`crate::lab::Lab::command`]), so the host's processes read the same paths as
//! before. The data comes from the real files, read by this process outside every host's
//! cgroup: what the view emulates is the device, and the device is not the host's.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::{FileExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry,
    ReplyOpen, Request,
};

use super::DiskProfile;

/// How long the kernel may keep names and attributes: the views' files do not change while a
/// lab runs, but the selftest writes its file after the view is mounted.
const TTL: Duration = Duration::from_secs(1);
/// The largest read the kernel sends in one request (and its read-ahead): as large as the
/// reads the expert store and the selftest make, so one of theirs is one of the disk's.
const MAX_READ: u32 = 1 << 20;

/// When each read completes on a disk that serves one read at a time: a read of `b` bytes
/// takes `max(b / bandwidth, 1 / IOPS)` from when it arrives or the read before it is done,
/// whichever is later. No credit builds up while the disk is idle.
#[derive(Debug, Clone, Copy)]
pub struct DiskClock {
    read_bps: f64,
    read_iops: f64,
    free_at: Option<Instant>,
}

impl DiskClock {
    pub fn new(profile: &DiskProfile) -> Self {
        Self {
            read_bps: profile.read_bps as f64,
            read_iops: profile.read_iops as f64,
            free_at: None,
        }
    }

    /// The time one read of `bytes` takes on its own.
    pub fn service(&self, bytes: u64) -> Duration {
        Duration::from_secs_f64((bytes as f64 / self.read_bps).max(1.0 / self.read_iops))
    }

    /// When a read of `bytes` arriving at `now` is done.
    pub fn complete(&mut self, now: Instant, bytes: u64) -> Instant {
        let start = self.free_at.map_or(now, |f| f.max(now));
        let done = start + self.service(bytes);
        self.free_at = Some(done);
        done
    }
}

/// What a view has served.
#[derive(Debug, Default)]
pub struct DiskStats {
    pub reads: AtomicU64,
    pub bytes: AtomicU64,
}

impl DiskStats {
    /// Bytes the kernel has asked the view for (every read that missed the page cache).
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// A read waiting for its time.
struct Pending {
    file: Arc<File>,
    offset: u64,
    size: u32,
    due: Instant,
    reply: ReplyData,
}

/// The names the kernel has looked up: inode number → real path.
#[derive(Default)]
struct Inodes {
    paths: Vec<PathBuf>,
    numbers: HashMap<PathBuf, u64>,
}

impl Inodes {
    fn number(&mut self, path: PathBuf) -> u64 {
        if let Some(&n) = self.numbers.get(&path) {
            return n;
        }
        self.paths.push(path.clone());
        let n = self.paths.len() as u64; // the root is 1
        self.numbers.insert(path, n);
        n
    }

    fn path(&self, ino: INodeNo) -> Option<PathBuf> {
        let i = usize::try_from(ino.0).ok()?.checked_sub(1)?;
        self.paths.get(i).cloned()
    }
}

/// The FUSE file system of one view.
struct View {
    inodes: Mutex<Inodes>,
    open: Mutex<HashMap<u64, Arc<File>>>,
    next_handle: AtomicU64,
    clock: Mutex<DiskClock>,
    queue: mpsc::Sender<Pending>,
    stats: Arc<DiskStats>,
}

fn errno(e: &std::io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

fn attr(ino: u64, m: &std::fs::Metadata) -> FileAttr {
    let kind = if m.is_dir() {
        FileType::Directory
    } else {
        FileType::RegularFile
    };
    let time = |s: i64| SystemTime::UNIX_EPOCH + Duration::from_secs(s.max(0) as u64);
    FileAttr {
        ino: INodeNo(ino),
        size: m.len(),
        blocks: m.blocks(),
        atime: time(m.atime()),
        mtime: time(m.mtime()),
        ctime: time(m.ctime()),
        crtime: time(m.mtime()),
        kind,
        // Read-only whatever the real file allows.
        perm: (m.mode() & 0o555) as u16,
        nlink: 1,
        uid: m.uid(),
        gid: m.gid(),
        rdev: 0,
        blksize: MAX_READ,
        flags: 0,
    }
}

impl View {
    fn path(&self, ino: INodeNo) -> Result<PathBuf, Errno> {
        self.inodes
            .lock()
            .expect("inodes")
            .path(ino)
            .ok_or(Errno::ENOENT)
    }
}

impl Filesystem for View {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Best effort: a kernel that offers less sends smaller reads, each still timed.
        let _ = config.set_max_readahead(MAX_READ);
        let _ = config.set_max_write(MAX_READ);
        let _ = config.add_capabilities(fuser::InitFlags::FUSE_ASYNC_DIO);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let path = match self.path(parent) {
            Ok(p) => p.join(name),
            Err(e) => return reply.error(e),
        };
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() || m.is_file() => {
                let ino = self.inodes.lock().expect("inodes").number(path);
                reply.entry(&TTL, &attr(ino, &m), Generation(0));
            }
            Ok(_) => reply.error(Errno::ENOENT),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self
            .path(ino)
            .and_then(|p| std::fs::metadata(p).map_err(|e| errno(&e)))
        {
            Ok(m) => reply.attr(&TTL, &attr(ino.0, &m)),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(Errno::from_i32(libc::EROFS));
        }
        match self
            .path(ino)
            .and_then(|p| File::open(p).map_err(|e| errno(&e)))
        {
            Ok(f) => {
                let h = self.next_handle.fetch_add(1, Ordering::Relaxed);
                self.open.lock().expect("open").insert(h, Arc::new(f));
                // The file does not change: what a host cached stays cached across opens.
                reply.opened(FileHandle(h), FopenFlags::FOPEN_KEEP_CACHE);
            }
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(file) = self.open.lock().expect("open").get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        let due = self
            .clock
            .lock()
            .expect("clock")
            .complete(Instant::now(), u64::from(size));
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes
            .fetch_add(u64::from(size), Ordering::Relaxed);
        let pending = Pending {
            file,
            offset,
            size,
            due,
            reply,
        };
        if let Err(mpsc::SendError(p)) = self.queue.send(pending) {
            p.reply.error(Errno::EIO);
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        _flush: bool,
        reply: fuser::ReplyEmpty,
    ) {
        self.open.lock().expect("open").remove(&fh.0);
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let dir = match self.path(ino) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        let mut names: Vec<(PathBuf, FileType)> = match std::fs::read_dir(&dir) {
            Ok(rd) => rd
                .filter_map(|e| {
                    let e = e.ok()?;
                    let m = std::fs::metadata(e.path()).ok()?;
                    let kind = if m.is_dir() {
                        FileType::Directory
                    } else if m.is_file() {
                        FileType::RegularFile
                    } else {
                        return None;
                    };
                    Some((e.path(), kind))
                })
                .collect(),
            Err(e) => return reply.error(errno(&e)),
        };
        names.sort_by(|a, b| a.0.cmp(&b.0));
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        for (i, (path, kind)) in names.into_iter().enumerate().skip(start) {
            let name = path.file_name().unwrap_or_default().to_owned();
            let n = self.inodes.lock().expect("inodes").number(path);
            if reply.add(INodeNo(n), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// Answers each read when its time comes. The data is read first (from the real file, most
/// often from this machine's page cache), so that reading it does not add to the disk's time.
fn deliver(queue: mpsc::Receiver<Pending>) {
    for p in queue {
        let mut buf = vec![0u8; p.size as usize];
        let got = read_full(&p.file, &mut buf, p.offset);
        let now = Instant::now();
        if p.due > now {
            std::thread::sleep(p.due - now);
        }
        match got {
            Ok(n) => p.reply.data(&buf[..n]),
            Err(e) => p.reply.error(errno(&e)),
        }
    }
}

/// Reads until `buf` is full or the file ends: the bytes read.
fn read_full(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A mounted view: unmounted (and its directory removed) when dropped.
pub struct EmulatedDisk {
    /// Where the view is mounted.
    pub mount_point: PathBuf,
    /// The directory it shows.
    pub source: PathBuf,
    pub stats: Arc<DiskStats>,
    session: Option<fuser::BackgroundSession>,
}

/// The file system name every view mounts with: `tessera lab clean` unmounts what a dead lab
/// left by it.
pub const FS_NAME: &str = "tlab-disk";

impl EmulatedDisk {
    /// Mounts a view of `source` at `mount_point` (made here, empty) reading at `profile`'s
    /// rates.
    pub fn mount(
        source: &Path,
        mount_point: &Path,
        profile: &DiskProfile,
    ) -> std::io::Result<Self> {
        let source = source.canonicalize()?;
        std::fs::create_dir_all(mount_point)?;
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("disk-{}", profile.name))
            .spawn(move || deliver(rx))?;
        let stats = Arc::new(DiskStats::default());
        let mut inodes = Inodes::default();
        inodes.number(source.clone());
        let view = View {
            inodes: Mutex::new(inodes),
            open: Mutex::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
            clock: Mutex::new(DiskClock::new(profile)),
            queue: tx,
            stats: stats.clone(),
        };
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            fuser::MountOption::RO,
            fuser::MountOption::FSName(FS_NAME.into()),
            fuser::MountOption::Subtype(profile.name.into()),
        ];
        // Hosts run as root, like this process; `allow_other` would need a configured fuse.
        let session = fuser::spawn_mount(view, mount_point, &config)?;
        Ok(Self {
            mount_point: mount_point.to_path_buf(),
            source,
            stats,
            session: Some(session),
        })
    }

    /// `path` (inside [`Self::source`]) as seen through the view.
    pub fn through(&self, path: &Path) -> Option<PathBuf> {
        let rel = path.strip_prefix(&self.source).ok()?;
        Some(self.mount_point.join(rel))
    }
}

impl Drop for EmulatedDisk {
    fn drop(&mut self) {
        // Unmounts (lazily: a host process still holding a file keeps it until it exits).
        drop(self.session.take());
        let _ = std::fs::remove_dir(&self.mount_point);
    }
}

/// Makes `cmd`'s process see `views` at their sources: a mount namespace of its own (private,
/// so nothing propagates back) with each view bound over the directory it shows.
pub fn bind_in_child(
    cmd: &mut std::process::Command,
    views: &[EmulatedDisk],
) -> crate::error::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::process::CommandExt as _;
    if views.is_empty() {
        return Ok(());
    }
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| crate::error::LabError::Spec(format!("{} has a NUL", p.display())))
    };
    let binds = views
        .iter()
        .map(|v| Ok((c(&v.mount_point)?, c(&v.source)?)))
        .collect::<crate::error::Result<Vec<_>>>()?;
    // SAFETY: between fork and exec the closure makes only system calls, on strings made
    // before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fail = || Err(std::io::Error::last_os_error());
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return fail();
            }
            let none = std::ptr::null();
            if libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                none.cast(),
            ) != 0
            {
                return fail();
            }
            for (view, source) in &binds {
                if libc::mount(
                    view.as_ptr(),
                    source.as_ptr(),
                    none,
                    libc::MS_BIND,
                    none.cast(),
                ) != 0
                {
                    return fail();
                }
            }
            Ok(())
        });
    }
    Ok(())
}

/// The mount points of views left mounted (by a lab whose process died): from
/// `/proc/self/mountinfo`, those mounted with [`FS_NAME`].
pub fn leftover_views() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    super::device::parse_mountinfo(&text)
        .into_iter()
        .filter(|m| m.source == FS_NAME)
        .map(|m| m.mount_point)
        .collect()
}

/// Unmounts a view left mounted and removes its directory.
pub fn unmount_leftover(mount_point: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(mount_point.as_os_str().as_bytes())
        .map_err(std::io::Error::other)?;
    // SAFETY: a valid C string; a lazy unmount touches nothing of ours.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    std::fs::remove_dir(mount_point)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emmc() -> DiskProfile {
        DiskProfile::named("emmc").unwrap()
    }

    #[test]
    fn a_read_after_idle_takes_its_full_time() {
        let mut c = DiskClock::new(&emmc());
        let t0 = Instant::now();
        let first = c.complete(t0, 3 << 20);
        // 3 MiB at 300 MB/s: 10.5 ms.
        assert_eq!(first - t0, Duration::from_secs_f64(3.0 * 1048576.0 / 300e6));
        // A second idle later the same read takes just as long: no credit was saved.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(c.complete(t1, 3 << 20) - t1, first - t0);
    }

    #[test]
    fn reads_in_flight_queue_behind_each_other() {
        let mut c = DiskClock::new(&emmc());
        let t0 = Instant::now();
        let done: Vec<Instant> = (0..4).map(|_| c.complete(t0, 1 << 20)).collect();
        let one = c.service(1 << 20);
        for (i, d) in done.iter().enumerate() {
            assert_eq!(*d - t0, one * (i as u32 + 1));
        }
    }

    #[test]
    fn small_reads_are_held_to_the_iops() {
        let c = DiskClock::new(&emmc());
        assert_eq!(c.service(4096), Duration::from_secs_f64(1.0 / 6000.0));
        assert!(c.service(1 << 20) > c.service(4096));
    }
}
