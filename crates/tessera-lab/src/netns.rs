//! Network namespaces: one per emulated host, made and removed with `ip netns` (so they show
//! in `ip netns list` and survive nothing but a `tessera lab clean`), entered per thread with
//! `setns(2)`.
//!
//! A socket belongs to the namespace of the thread that created it, for its whole life. So the
//! lab makes sockets "on" a host ([`Netns::run_in`]: a short-lived thread enters the namespace,
//! creates the socket and hands it back) and this process can then use it from any thread: the
//! selftest's probes and the lab's HTTP client need no helper process.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::Command;

use crate::error::{LabError, Result};

/// Where `ip netns` keeps its namespaces.
pub const NETNS_DIR: &str = "/var/run/netns";

/// One network namespace made by the lab.
#[derive(Debug)]
pub struct Netns {
    name: String,
    /// An open handle, to enter it (and to keep it alive while we hold it).
    file: File,
}

impl Netns {
    /// Makes the namespace `name` (failing if it exists) with its loopback up.
    pub fn create(name: &str) -> Result<Self> {
        ip(&["netns", "add", name])?;
        let ns = Self::open(name)?;
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Opens an existing namespace.
    pub fn open(name: &str) -> Result<Self> {
        let path = PathBuf::from(NETNS_DIR).join(name);
        let file = File::open(&path)
            .map_err(|e| LabError::io(format!("opening {}", path.display()), e))?;
        Ok(Self {
            name: name.to_string(),
            file,
        })
    }

    /// Its name (`ip -n NAME ...`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `f` on a fresh thread inside this namespace and returns what it made. Sockets and
    /// devices created there stay in the namespace after the thread ends.
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> std::io::Result<T> + Send) -> Result<T> {
        let fd = self.file.as_raw_fd();
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: setns on a valid namespace fd affects only this thread.
                if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                f()
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the namespace thread panicked")))
        })
        .map_err(|e| LabError::io(format!("in namespace {}", self.name), e))
    }

    /// Makes `cmd` start inside this namespace (it is entered between fork and exec).
    pub fn prepare(&self, cmd: &mut Command) -> Result<()> {
        let file = self
            .file
            .try_clone()
            .map_err(|e| LabError::io("duplicating a namespace handle", e))?;
        // SAFETY: the closure makes one async-signal-safe system call on an fd it owns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// Processes inside this namespace (as `ip netns pids` finds them).
    pub fn pids(&self) -> Vec<u32> {
        let Ok(me) = self.file.metadata() else {
            return Vec::new();
        };
        pids_in(me.dev(), me.ino())
    }

    /// Kills (SIGKILL) every process inside, then removes the namespace.
    pub fn destroy(self) -> Result<()> {
        kill_all(&self.pids());
        let name = self.name.clone();
        drop(self);
        ip(&["netns", "delete", &name])
    }
}

/// Processes whose network namespace is (`dev`, `ino`).
fn pids_in(dev: u64, ino: u64) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::metadata(format!("/proc/{pid}/ns/net"))
                .is_ok_and(|m| m.dev() == dev && m.ino() == ino)
        })
        .collect()
}

/// SIGKILL to each pid, then waits (briefly) until they are gone.
pub(crate) fn kill_all(pids: &[u32]) {
    for &pid in pids {
        // SAFETY: kill has no memory effects.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
    }
    for _ in 0..200 {
        if pids
            .iter()
            .all(|p| !std::path::Path::new(&format!("/proc/{p}")).exists() || is_zombie(*p))
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// The namespaces `ip netns` knows whose name starts with `prefix`.
pub fn list(prefix: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(NETNS_DIR) else {
        return Vec::new();
    };
    let mut v: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect();
    v.sort();
    v
}

/// Runs `ip ARGS`, mapping failure to its stderr.
pub(crate) fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| LabError::io("running `ip` (iproute2)", e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(LabError::Command {
            command: format!("ip {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}
