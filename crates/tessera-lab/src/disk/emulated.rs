//! An emulated disk: views of directories (FUSE) whose reads take the time a disk of a
//! [`DiskProfile`]'s rates would take, one read after another. Everything else (writes,
//! renames, listings) passes through to the real directory untimed: the lab emulates reads.
//!
//! Why not only the cgroup throttle ([`super::DiskCap`]): the throttle bounds a host's
//! *average* rate over its slice, so a read after a pause runs at this machine's own disk
//! speed until the slice catches up (`tessera lab selftest`'s "burst after idle" check
//! measured 1.4–1.8 GB/s under caps of 90–550 MB/s). A host that reads now and then — a ring
//! stage streaming its experts while the token is on the other stages — then reads far faster
//! than the disk it stands for. A real disk has no such credit: each read takes its size over
//! the disk's rate, after the reads before it ([`DiskClock`]).
//!
//! Each host with a disk gets its own disk (its own clock, its own page cache: the kernel
//! caches a FUSE file's pages per mount, charged to the memory cgroup of the reader), one view
//! per directory it holds, each mounted in a directory of the lab's and bound over the real
//! directory in the host's own mount namespace ([`crate::lab::Lab::command`]), so the host's
//! processes use the same paths as before. The data comes from the real files, read by this process outside every host's
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
    paths: Vec<Option<PathBuf>>,
    numbers: HashMap<PathBuf, u64>,
}

impl Inodes {
    fn number(&mut self, path: PathBuf) -> u64 {
        if let Some(&n) = self.numbers.get(&path) {
            return n;
        }
        self.paths.push(Some(path.clone()));
        let n = self.paths.len() as u64; // the root is 1
        self.numbers.insert(path, n);
        n
    }

    fn path(&self, ino: INodeNo) -> Option<PathBuf> {
        let i = usize::try_from(ino.0).ok()?.checked_sub(1)?;
        self.paths.get(i)?.clone()
    }

    /// `path` is gone (removed, or renamed over).
    fn forget(&mut self, path: &Path) {
        if let Some(n) = self.numbers.remove(path) {
            self.paths[n as usize - 1] = None;
        }
    }

    /// `from` (and everything under it) is now `to`.
    fn rename(&mut self, from: &Path, to: &Path) {
        self.forget(to);
        let moved: Vec<(PathBuf, u64)> = self
            .numbers
            .iter()
            .filter(|(p, _)| p.starts_with(from))
            .map(|(p, &n)| (p.clone(), n))
            .collect();
        for (old, n) in moved {
            // (`join("")` would add a trailing `/`, which names a directory.)
            let rel = old.strip_prefix(from).expect("filtered");
            let new = if rel.as_os_str().is_empty() {
                to.to_path_buf()
            } else {
                to.join(rel)
            };
            self.numbers.remove(&old);
            self.numbers.insert(new.clone(), n);
            self.paths[n as usize - 1] = Some(new);
        }
    }
}

/// The FUSE file system of one view: reads timed by the disk's clock, everything else passed
/// to the real directory at once (writes are not what the lab emulates).
struct View {
    inodes: Mutex<Inodes>,
    open: Mutex<HashMap<u64, Arc<File>>>,
    next_handle: AtomicU64,
    clock: Arc<Mutex<DiskClock>>,
    queue: mpsc::Sender<Pending>,
    stats: Arc<DiskStats>,
}

fn errno(e: &std::io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

/// What a view shows `m` as: directories and regular files only (symlinks, sockets and the
/// like are not there).
fn kind(m: &std::fs::Metadata) -> Option<FileType> {
    if m.is_dir() {
        Some(FileType::Directory)
    } else if m.is_file() {
        Some(FileType::RegularFile)
    } else {
        None
    }
}

/// The attributes of `m` (a directory or a regular file, [`kind`]) as inode `ino`.
fn attr(ino: u64, m: &std::fs::Metadata) -> FileAttr {
    let kind = kind(m).unwrap_or(FileType::RegularFile);
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
        perm: (m.mode() & 0o7777) as u16,
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

    fn child(&self, parent: INodeNo, name: &OsStr) -> Result<PathBuf, Errno> {
        Ok(self.path(parent)?.join(name))
    }

    /// The entry for `path`, numbered.
    fn entry(&self, path: PathBuf) -> Result<FileAttr, Errno> {
        let m = std::fs::symlink_metadata(&path).map_err(|e| errno(&e))?;
        if kind(&m).is_none() {
            return Err(Errno::ENOENT);
        }
        let ino = self.inodes.lock().expect("inodes").number(path);
        Ok(attr(ino, &m))
    }

    /// Removes `name` with `how` (a file or an empty directory), forgetting its number.
    fn remove(
        &self,
        parent: INodeNo,
        name: &OsStr,
        how: fn(&Path) -> std::io::Result<()>,
        reply: fuser::ReplyEmpty,
    ) {
        match self.child(parent, name) {
            Ok(p) => {
                let r = how(&p);
                if r.is_ok() {
                    self.inodes.lock().expect("inodes").forget(&p);
                }
                done(r, reply)
            }
            Err(e) => reply.error(e),
        }
    }

    fn handle(&self, f: File) -> FileHandle {
        let h = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.open.lock().expect("open").insert(h, Arc::new(f));
        FileHandle(h)
    }

    fn file(&self, fh: FileHandle) -> Result<Arc<File>, Errno> {
        self.open
            .lock()
            .expect("open")
            .get(&fh.0)
            .cloned()
            .ok_or(Errno::EBADF)
    }
}

/// Opens `path` as `flags` asks (without `O_DIRECT`: this process reads the real file as it
/// likes; the host's direct reads are the view's).
fn open_real(path: &Path, flags: i32, mode: Option<u32>) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let access = flags & libc::O_ACCMODE;
    let mut o = std::fs::OpenOptions::new();
    o.read(access != libc::O_WRONLY)
        .write(access != libc::O_RDONLY)
        .custom_flags(flags & (libc::O_TRUNC | libc::O_EXCL));
    if let Some(mode) = mode {
        o.create(true).mode(mode);
    }
    o.open(path)
}

/// Replies `Ok(())` as `ok`, an error as its errno.
fn done(r: std::io::Result<()>, reply: fuser::ReplyEmpty) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(&e)),
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
        match self.child(parent, name).and_then(|p| self.entry(p)) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
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

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        use std::os::unix::fs::PermissionsExt as _;
        let r = self.path(ino).and_then(|p| {
            if let Some(len) = size {
                let f = std::fs::OpenOptions::new().write(true).open(&p);
                f.and_then(|f| f.set_len(len)).map_err(|e| errno(&e))?;
            }
            if let Some(mode) = mode {
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode & 0o7777))
                    .map_err(|e| errno(&e))?;
            }
            std::fs::metadata(&p).map_err(|e| errno(&e))
        });
        match r {
            Ok(m) => reply.attr(&TTL, &attr(ino.0, &m)),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let r = self.child(parent, name).and_then(|p| {
            std::fs::create_dir(&p).map_err(|e| errno(&e))?;
            self.entry(p)
        });
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: fuser::ReplyEmpty) {
        self.remove(parent, name, |p| std::fs::remove_file(p), reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: fuser::ReplyEmpty) {
        self.remove(parent, name, |p| std::fs::remove_dir(p), reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: fuser::ReplyEmpty,
    ) {
        let no_replace = flags == fuser::RenameFlags::RENAME_NOREPLACE;
        if !(flags.is_empty() || no_replace) {
            return reply.error(Errno::from_i32(libc::EINVAL));
        }
        match (self.child(parent, name), self.child(newparent, newname)) {
            (Ok(from), Ok(to)) => {
                // (Not atomic: nothing else writes a host's view while it runs.)
                let r = if no_replace && std::fs::symlink_metadata(&to).is_ok() {
                    Err(std::io::Error::from_raw_os_error(libc::EEXIST))
                } else {
                    std::fs::rename(&from, &to)
                };
                if r.is_ok() {
                    self.inodes.lock().expect("inodes").rename(&from, &to);
                }
                done(r, reply)
            }
            (Err(e), _) | (_, Err(e)) => reply.error(e),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        // The new name gets a number of its own: the kernel treats it as another file, which
        // only matters to a host that writes through one name and reads through the other.
        let r = self.path(ino).and_then(|from| {
            let to = self.child(newparent, newname)?;
            std::fs::hard_link(&from, &to).map_err(|e| errno(&e))?;
            self.entry(to)
        });
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self
            .path(ino)
            .and_then(|p| open_real(&p, flags.0, None).map_err(|e| errno(&e)))
        {
            // What a host cached stays cached across its opens (only its own writes change
            // the files, and they pass through its page cache).
            Ok(f) => reply.opened(self.handle(f), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: fuser::ReplyCreate,
    ) {
        let r = self.child(parent, name).and_then(|p| {
            let f = open_real(&p, flags, Some(mode & !umask)).map_err(|e| errno(&e))?;
            Ok((self.entry(p)?, f))
        });
        match r {
            Ok((a, f)) => reply.created(
                &TTL,
                &a,
                Generation(0),
                self.handle(f),
                FopenFlags::FOPEN_KEEP_CACHE,
            ),
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
        let file = match self.file(fh) {
            Ok(f) => f,
            Err(e) => return reply.error(e),
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

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: fuser::WriteFlags,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: fuser::ReplyWrite,
    ) {
        match self
            .file(fh)
            .and_then(|f| f.write_all_at(data, offset).map_err(|e| errno(&e)))
        {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: fuser::ReplyEmpty,
    ) {
        match self.file(fh) {
            Ok(f) => done(
                if datasync {
                    f.sync_data()
                } else {
                    f.sync_all()
                },
                reply,
            ),
            Err(e) => reply.error(e),
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

    fn statfs(&self, _req: &Request, ino: INodeNo, reply: fuser::ReplyStatfs) {
        let r = self.path(ino).and_then(|p| {
            let c = c_path(&p).map_err(|e| errno(&e))?;
            // SAFETY: statvfs fills the plain struct it is given, from a valid C string.
            let (r, v) = unsafe {
                let mut v: libc::statvfs = std::mem::zeroed();
                (libc::statvfs(c.as_ptr(), &mut v), v)
            };
            if r != 0 {
                return Err(errno(&std::io::Error::last_os_error()));
            }
            Ok(v)
        });
        match r {
            // The real file system's space: what a host may store on its disk.
            Ok(v) => reply.statfs(
                v.f_blocks,
                v.f_bfree,
                v.f_bavail,
                v.f_files,
                v.f_ffree,
                v.f_bsize as u32,
                v.f_namemax as u32,
                v.f_frsize as u32,
            ),
            Err(e) => reply.error(e),
        }
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
                    let m = std::fs::symlink_metadata(e.path()).ok()?;
                    Some((e.path(), kind(&m)?))
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

/// One directory shown through a disk: unmounted (and its mount point removed) when dropped.
pub struct MountedView {
    /// The directory it shows.
    pub source: PathBuf,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    session: Option<fuser::BackgroundSession>,
}

impl Drop for MountedView {
    fn drop(&mut self) {
        // Unmounts (lazily: a host process still holding a file keeps it until it exits).
        drop(self.session.take());
        let _ = std::fs::remove_dir(&self.mount_point);
    }
}

/// The file system name every view mounts with: `tessera lab clean` unmounts what a dead lab
/// left by it.
pub const FS_NAME: &str = "tlab-disk";

/// One host's disk: a clock its reads queue on, shown through one view per directory it
/// holds.
pub struct EmulatedDisk {
    pub profile: DiskProfile,
    pub stats: Arc<DiskStats>,
    clock: Arc<Mutex<DiskClock>>,
    queue: mpsc::Sender<Pending>,
    views: Vec<MountedView>,
}

impl EmulatedDisk {
    /// A disk of `profile`'s rates, holding nothing yet.
    pub fn new(profile: &DiskProfile) -> std::io::Result<Self> {
        if !Path::new("/dev/fuse").exists() {
            return Err(std::io::Error::other(
                "an emulated disk is a FUSE file system and /dev/fuse is missing (modprobe fuse)",
            ));
        }
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("disk-{}", profile.name))
            .spawn(move || deliver(rx))?;
        Ok(Self {
            profile: *profile,
            stats: Arc::new(DiskStats::default()),
            clock: Arc::new(Mutex::new(DiskClock::new(profile))),
            queue: tx,
            views: Vec::new(),
        })
    }

    /// Shows `source` through this disk at `mount_point` (made here, empty).
    pub fn add_view(&mut self, source: &Path, mount_point: &Path) -> std::io::Result<()> {
        let source = source.canonicalize()?;
        std::fs::create_dir_all(mount_point)?;
        let mut inodes = Inodes::default();
        inodes.number(source.clone());
        let view = View {
            inodes: Mutex::new(inodes),
            open: Mutex::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
            clock: self.clock.clone(),
            queue: self.queue.clone(),
            stats: self.stats.clone(),
        };
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            fuser::MountOption::FSName(FS_NAME.into()),
            fuser::MountOption::Subtype(self.profile.name.into()),
        ];
        // Hosts run as root, like this process; `allow_other` would need a configured fuse.
        let session = fuser::spawn_mount(view, mount_point, &config)?;
        self.views.push(MountedView {
            source,
            mount_point: mount_point.to_path_buf(),
            session: Some(session),
        });
        Ok(())
    }

    /// The directories it shows.
    pub fn views(&self) -> &[MountedView] {
        &self.views
    }

    /// `path` (inside one of the views' sources) as seen through this disk: through the view
    /// of the innermost source holding it, as the host sees it (an outer view reaches an
    /// inner directory's files by the real path, and where the inner view's mount point lies
    /// inside the outer source, through the inner view again: one read served twice).
    pub fn through(&self, path: &Path) -> Option<PathBuf> {
        self.views
            .iter()
            .filter_map(|v| Some((v, path.strip_prefix(&v.source).ok()?)))
            .max_by_key(|(v, _)| v.source.components().count())
            .map(|(v, rel)| v.mount_point.join(rel))
    }
}

/// `p` for a system call (an error where it holds a NUL byte).
pub(super) fn c_path(p: &Path) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt as _;
    std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other)
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
    fn a_rename_moves_the_numbers_of_the_name_and_everything_under_it() {
        let mut i = Inodes::default();
        let root = i.number("/r".into());
        let (d, f, g) = (
            i.number("/r/d".into()),
            i.number("/r/d/f".into()),
            i.number("/r/g".into()),
        );
        i.rename(Path::new("/r/d"), Path::new("/r/e"));
        assert_eq!(i.path(INodeNo(d)), Some("/r/e".into()));
        assert_eq!(i.path(INodeNo(f)), Some("/r/e/f".into()));
        // Renamed over: the old file's number names nothing.
        i.rename(Path::new("/r/e/f"), Path::new("/r/g"));
        assert_eq!(i.path(INodeNo(f)), Some("/r/g".into()));
        assert_eq!(i.path(INodeNo(g)), None);
        assert_eq!(i.number("/r/g".into()), f);
        assert_eq!(i.path(INodeNo(root)), Some("/r".into()));
    }

    #[test]
    fn small_reads_are_held_to_the_iops() {
        let c = DiskClock::new(&emmc());
        assert_eq!(c.service(4096), Duration::from_secs_f64(1.0 / 6000.0));
        assert!(c.service(1 << 20) > c.service(4096));
    }
}
