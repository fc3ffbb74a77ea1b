//! Per-host memory caps, CPU shares and disk read caps with cgroups, v1 (one hierarchy per
//! controller, as on the machines here) or v2 (one unified hierarchy).
//!
//! A host's processes join its cgroup between fork and exec (writing `0`, "this process", to
//! each `cgroup.procs`), so they are capped from their first allocation.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::disk::DiskCap;
use crate::error::{LabError, Result};

/// Where cgroup hierarchies are mounted.
pub const ROOT: &str = "/sys/fs/cgroup";

/// What a host is given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Limits {
    /// Memory cap in bytes (the kernel reclaims, then kills, beyond it).
    pub memory: Option<u64>,
    /// The CPUs the host may run on, in cpuset syntax (`0`, `0-1`, `0,2`).
    pub cpus: Option<String>,
    /// CPU time per wall-clock second, in cores (`0.5`: half a core), by CFS quota over a
    /// short period ([`quota_period_us`]), so that it binds within a request of milliseconds.
    pub cpu_quota: Option<f64>,
    /// Read bandwidth and IOPS on the disks that hold the lab's data (see [`crate::disk`]).
    pub disk: Option<DiskCap>,
}

impl Limits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.memory.is_some()
            || self.cpus.is_some()
            || self.cpu_quota.is_some()
            || self.disk.is_some()
    }
}

/// Which cgroup interface the machine has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// The machine's cgroup interface.
pub fn version() -> Version {
    if Path::new(ROOT).join("cgroup.controllers").exists() {
        Version::V2
    } else {
        Version::V1
    }
}

/// One host's cgroup (a directory per v1 controller, or one v2 directory).
#[derive(Debug)]
pub struct Cgroup {
    dirs: Vec<PathBuf>,
    /// Where the CPU quota is written, and the quota, when there is one.
    cpu: Option<(PathBuf, f64)>,
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value)
        .map_err(|e| LabError::io(format!("writing {value:?} to {}", path.display()), e))
}

fn mkdir(path: &Path) -> Result<()> {
    std::fs::create_dir(path)
        .map_err(|e| LabError::io(format!("creating cgroup {}", path.display()), e))
}

impl Cgroup {
    /// Makes the cgroup `name` with `limits` (`None` when there are none to impose).
    pub fn create(name: &str, limits: &Limits) -> Result<Option<Self>> {
        if !limits.any() {
            return Ok(None);
        }
        let mut cg = Self {
            dirs: Vec::new(),
            cpu: None,
        };
        let result = match version() {
            Version::V1 => cg.create_v1(name, limits),
            Version::V2 => cg.create_v2(name, limits),
        };
        match result {
            Ok(()) => Ok(Some(cg)),
            Err(e) => {
                cg.destroy();
                Err(e)
            }
        }
    }

    fn create_v1(&mut self, name: &str, l: &Limits) -> Result<()> {
        let root = Path::new(ROOT);
        if let Some(bytes) = l.memory {
            let d = root.join("memory").join(name);
            mkdir(&d)?;
            self.dirs.push(d.clone());
            write(&d.join("memory.limit_in_bytes"), &bytes.to_string())?;
        }
        if let Some(cpus) = &l.cpus {
            let parent = root.join("cpuset");
            let d = parent.join(name);
            mkdir(&d)?;
            self.dirs.push(d.clone());
            write(&d.join("cpuset.cpus"), cpus)?;
            // A v1 cpuset takes no task until it has memory nodes: the parent's.
            let mems = std::fs::read_to_string(parent.join("cpuset.mems"))
                .map_err(|e| LabError::io("reading cpuset.mems", e))?;
            write(&d.join("cpuset.mems"), mems.trim())?;
        }
        if let Some(cores) = l.cpu_quota {
            let d = root.join("cpu").join(name);
            mkdir(&d)?;
            self.dirs.push(d.clone());
            write(
                &d.join("cpu.cfs_period_us"),
                &quota_period_us(cores).to_string(),
            )?;
            self.cpu = Some((d, cores));
            self.set_cpu_quota(true)?;
        }
        if let Some(disk) = &l.disk {
            let d = root.join("blkio").join(name);
            mkdir(&d)?;
            self.dirs.push(d.clone());
            let (bps, iops) = disk.v1_rules();
            for rule in bps {
                write(&d.join("blkio.throttle.read_bps_device"), &rule)?;
            }
            for rule in iops {
                write(&d.join("blkio.throttle.read_iops_device"), &rule)?;
            }
        }
        Ok(())
    }

    fn create_v2(&mut self, name: &str, l: &Limits) -> Result<()> {
        let root = Path::new(ROOT);
        // Children get a controller only when the parent delegates it.
        let _ = write(
            &root.join("cgroup.subtree_control"),
            "+memory +cpu +cpuset +io",
        );
        let d = root.join(name);
        mkdir(&d)?;
        self.dirs.push(d.clone());
        if let Some(bytes) = l.memory {
            write(&d.join("memory.max"), &bytes.to_string())?;
        }
        if let Some(cpus) = &l.cpus {
            write(&d.join("cpuset.cpus"), cpus)?;
        }
        if let Some(cores) = l.cpu_quota {
            self.cpu = Some((d.clone(), cores));
            self.set_cpu_quota(true)?;
        }
        if let Some(disk) = &l.disk {
            for rule in disk.v2_rules() {
                write(&d.join("io.max"), &rule)?;
            }
        }
        Ok(())
    }

    /// Imposes the CPU quota (`on`), or lifts it while keeping the cgroup. A no-op without one.
    pub fn set_cpu_quota(&self, on: bool) -> Result<()> {
        let Some((d, cores)) = &self.cpu else {
            return Ok(());
        };
        let (period, quota) = (quota_period_us(*cores), quota_us(*cores));
        match version() {
            Version::V1 => {
                let quota = if on { quota.to_string() } else { "-1".into() };
                write(&d.join("cpu.cfs_quota_us"), &quota)
            }
            Version::V2 => {
                let quota = if on { quota.to_string() } else { "max".into() };
                write(&d.join("cpu.max"), &format!("{quota} {period}"))
            }
        }
    }

    /// Makes `cmd` join this cgroup before it execs.
    pub fn prepare(&self, cmd: &mut Command) -> Result<()> {
        let files: Vec<File> = self
            .dirs
            .iter()
            .map(|d| {
                let p = d.join("cgroup.procs");
                OpenOptions::new()
                    .write(true)
                    .open(&p)
                    .map_err(|e| LabError::io(format!("opening {}", p.display()), e))
            })
            .collect::<Result<_>>()?;
        // SAFETY: the closure only calls write(2) on fds it owns; no allocation.
        unsafe {
            cmd.pre_exec(move || {
                for f in &files {
                    if libc::write(f.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// Moves the calling thread into this cgroup until the guard is dropped (cgroup v1, whose
    /// `tasks` file takes single threads; v2 moves whole processes only). The lab's own
    /// measurements use it to read from inside a host, as the host's processes would.
    pub fn enter_thread(&self) -> std::io::Result<ThreadInCgroup> {
        if version() != Version::V1 {
            return Err(std::io::Error::other(
                "moving one thread into a cgroup needs cgroup v1",
            ));
        }
        let mut guard = ThreadInCgroup { left: Vec::new() };
        for d in &self.dirs {
            std::fs::write(d.join("tasks"), "0")?;
            if let Some(parent) = d.parent() {
                guard.left.push(parent.join("tasks"));
            }
        }
        Ok(guard)
    }

    /// The page cache charged to this cgroup, bytes (v1 `cache`, v2 `file` of `memory.stat`);
    /// `None` without a memory controller.
    pub fn page_cache(&self) -> Option<u64> {
        let (file, key) = match version() {
            Version::V1 => ("memory.stat", "cache"),
            Version::V2 => ("memory.stat", "file"),
        };
        self.dirs.iter().find_map(|d| {
            let text = std::fs::read_to_string(d.join(file)).ok()?;
            crate::disk::measure::field(&text, key)
        })
    }

    /// The read caps in force, as the kernel lists them: v1 `read_bps_device` then
    /// `read_iops_device`, v2 `io.max`; `None` without a disk cap.
    pub fn read_caps(&self) -> Option<String> {
        let files: &[&str] = match version() {
            Version::V1 => &[
                "blkio.throttle.read_bps_device",
                "blkio.throttle.read_iops_device",
            ],
            Version::V2 => &["io.max"],
        };
        let text: String = self
            .dirs
            .iter()
            .flat_map(|d| files.iter().map(move |f| d.join(f)))
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .collect();
        (!text.trim().is_empty()).then_some(text)
    }

    /// Kills what is left inside and removes the directories.
    pub fn destroy(self) {
        for d in &self.dirs {
            remove(d);
        }
    }
}

/// A thread inside a host's cgroup ([`Cgroup::enter_thread`]); dropping it moves the thread
/// back to each hierarchy's root, so that the host's cgroup can be removed without it (removal
/// kills the processes inside).
#[derive(Debug)]
pub struct ThreadInCgroup {
    left: Vec<PathBuf>,
}

impl Drop for ThreadInCgroup {
    fn drop(&mut self) {
        for tasks in &self.left {
            let _ = std::fs::write(tasks, "0");
        }
    }
}

/// The shortest CFS period the lab trusts: the kernel throttles a group only when it next
/// accounts its runtime (at a scheduler tick, 4 ms at HZ=250), so a shorter period lets a
/// burst overrun its quota. Measured here, a single thread's CPU over wall time in bursts of
/// 15 ms under half a core: 0.57 with a 4 ms period, but 0.76 at 10 ms and 1.00 at 20 and
/// 100 ms (the burst fits in the first period's quota); at 2 ms a whole core's quota gave 0.66.
/// A tiny model's request decodes in such bursts, so the period must be short.
const SHORTEST_PERIOD_US: u64 = 4_000;

/// The kernel's smallest CFS quota.
const SMALLEST_QUOTA_US: u64 = 1_000;

/// The CFS period for a quota of `cores`: [`SHORTEST_PERIOD_US`], or longer where the quota
/// in it would fall below the kernel's 1 ms minimum (0.1 core: 10 ms).
fn quota_period_us(cores: f64) -> u64 {
    let period = (SMALLEST_QUOTA_US as f64 / cores.max(1e-3)).ceil() as u64;
    period.clamp(SHORTEST_PERIOD_US, 1_000_000)
}

/// CFS quota for `cores` per [`quota_period_us`] (at least the kernel's 1 ms).
fn quota_us(cores: f64) -> u64 {
    ((cores * quota_period_us(cores) as f64).round() as u64).max(SMALLEST_QUOTA_US)
}

/// Kills the tasks of cgroup directory `d` and removes it.
pub(crate) fn remove(d: &Path) {
    let pids: Vec<u32> = std::fs::read_to_string(d.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        // A lab's own thread measuring from inside a host must never take the lab down.
        .filter(|&p| p != std::process::id())
        .collect();
    crate::netns::kill_all(&pids);
    for _ in 0..100 {
        if std::fs::remove_dir(d).is_ok() || !d.exists() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Every cgroup directory whose name starts with `prefix`, in either interface.
pub fn list(prefix: &str) -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    let parents: Vec<PathBuf> = match version() {
        Version::V2 => vec![root.to_path_buf()],
        Version::V1 => ["memory", "cpuset", "cpu", "blkio"]
            .iter()
            .map(|c| root.join(c))
            .collect(),
    };
    let mut out = Vec::new();
    for p in parents {
        if let Ok(dir) = std::fs::read_dir(&p) {
            out.extend(
                dir.filter_map(|e| e.ok())
                    .filter(|e| {
                        e.file_name()
                            .to_str()
                            .is_some_and(|n| n.starts_with(prefix))
                    })
                    .map(|e| e.path()),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota_periods_are_short_yet_hold_the_kernels_smallest_quota() {
        assert_eq!((quota_period_us(0.5), quota_us(0.5)), (4_000, 2_000));
        assert_eq!((quota_period_us(2.0), quota_us(2.0)), (4_000, 8_000));
        assert_eq!((quota_period_us(0.25), quota_us(0.25)), (4_000, 1_000));
        assert_eq!((quota_period_us(0.1), quota_us(0.1)), (10_000, 1_000));
        assert_eq!((quota_period_us(0.2), quota_us(0.2)), (5_000, 1_000));
        // Beyond a second's period the quota cannot shrink further: the kernel's floor.
        assert_eq!((quota_period_us(1e-4), quota_us(1e-4)), (1_000_000, 1_000));
    }
}
