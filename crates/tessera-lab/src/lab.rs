//! A lab: hosts (one network namespace each, a TAP device, an address, optional cgroup
//! limits) joined by one [`Switch`], all removed when the [`Lab`] is dropped — and, after a
//! crash, by [`clean`].
//!
//! Every name the lab makes starts with [`PREFIX`] and carries the process id of the lab that
//! made it (`tlab-PID-N-HOST`), so [`clean`] can tell a dead lab's leftovers from a live one's.

use std::fs::File;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use tessera_linkemu::Impairment;

use crate::cgroup::{Cgroup, Limits};
use crate::disk::emulated::EmulatedDisk;
use crate::disk::{BlockDevice, DiskCap, DiskProfile};
use crate::error::{LabError, Result};
use crate::netns::Netns;
use crate::packet::{Subnet, MAX_HOSTS};
use crate::switch::Switch;

/// The prefix of every namespace and cgroup a lab makes.
pub const PREFIX: &str = "tlab-";
/// Round trips measured for the switch's floor at start (~0.2 ms each).
const FLOOR_PINGS: usize = 200;
/// Default MTU of the hosts' devices: jumbo frames, so a 1 Gbit/s link is ~14k packets/s
/// through the switch rather than ~83k (QUIC keeps to ~1.2–1.5 kB datagrams whatever it is).
pub const DEFAULT_MTU: u32 = 9000;

/// One host to make.
#[derive(Debug, Clone, PartialEq)]
pub struct HostSpec {
    /// The name scenarios and commands use.
    pub name: String,
    /// What its cgroup imposes.
    pub limits: Limits,
    /// The disk it reads at: [`LabSpec::disk_dirs`] through a view of its own that takes the
    /// disk's time for every read ([`crate::disk::emulated`]), and its cgroup's caps on the
    /// devices holding [`LabSpec::disk_paths`].
    pub disk: Option<DiskProfile>,
}

impl HostSpec {
    /// A host without limits.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            limits: Limits::default(),
            disk: None,
        }
    }

    /// Gives the host a disk of `profile`'s rates.
    pub fn disk(mut self, profile: DiskProfile) -> Self {
        self.disk = Some(profile);
        self
    }
}

/// A link between two hosts, the same each way.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkSpec {
    pub a: String,
    pub b: String,
    pub each_way: Impairment,
}

/// A whole lab.
#[derive(Debug, Clone, PartialEq)]
pub struct LabSpec {
    pub hosts: Vec<HostSpec>,
    /// Every pair not in `links`.
    pub default_link: Impairment,
    pub links: Vec<LinkSpec>,
    pub mtu: u32,
    /// Seeds the switch's loss and jitter draws.
    pub seed: u64,
    /// Where the hosts' data lives (their data directories, the model): a host with a
    /// [`HostSpec::disk`] has its reads capped on each of these paths' disks.
    pub disk_paths: Vec<std::path::PathBuf>,
    /// The directories a host's disk holds (the model's, the nodes' data): a host with a
    /// [`HostSpec::disk`] sees each through its own emulated disk at the same path, every
    /// read taking the disk's time ([`crate::disk::emulated`]).
    pub disk_dirs: Vec<std::path::PathBuf>,
    /// Shorten every link's delay by the switch's own round trip ([`Lab::switch_floor`]), so
    /// that a round trip measures what was asked for (none can be shorter than the floor).
    pub compensate_switch: bool,
}

impl LabSpec {
    /// `hosts` joined by perfect links.
    pub fn new(hosts: Vec<HostSpec>) -> Self {
        Self {
            hosts,
            default_link: Impairment::default(),
            links: Vec::new(),
            mtu: DEFAULT_MTU,
            seed: 1,
            disk_paths: vec![std::env::temp_dir()],
            disk_dirs: Vec::new(),
            compensate_switch: true,
        }
    }

    /// Every link shaped by `each_way` unless listed.
    pub fn default_link(mut self, each_way: Impairment) -> Self {
        self.default_link = each_way;
        self
    }

    /// Adds a link.
    pub fn link(mut self, a: &str, b: &str, each_way: Impairment) -> Self {
        self.links.push(LinkSpec {
            a: a.into(),
            b: b.into(),
            each_way,
        });
        self
    }

    fn index(&self, name: &str) -> Result<usize> {
        self.hosts
            .iter()
            .position(|h| h.name == name)
            .ok_or_else(|| LabError::Spec(format!("no host named {name:?}")))
    }

    fn validate(&self) -> Result<()> {
        if self.hosts.is_empty() || self.hosts.len() > MAX_HOSTS {
            return Err(LabError::Spec(format!(
                "a lab has 1 to {MAX_HOSTS} hosts, not {}",
                self.hosts.len()
            )));
        }
        for (i, h) in self.hosts.iter().enumerate() {
            if self.hosts[..i].iter().any(|o| o.name == h.name) {
                return Err(LabError::Spec(format!("host {:?} is listed twice", h.name)));
            }
        }
        for l in &self.links {
            let (a, b) = (self.index(&l.a)?, self.index(&l.b)?);
            if a == b {
                return Err(LabError::Spec(format!("a link from {:?} to itself", l.a)));
            }
        }
        if !(576..=65_535).contains(&self.mtu) {
            return Err(LabError::Spec(format!(
                "MTU {} is outside 576..=65535",
                self.mtu
            )));
        }
        Ok(())
    }
}

struct Host {
    name: String,
    ns: Option<Netns>,
    cgroup: Option<Cgroup>,
    disk: Option<DiskProfile>,
    /// Its emulated disk, showing [`LabSpec::disk_dirs`].
    emulated: Option<EmulatedDisk>,
}

/// A running lab; everything it made is removed when it is dropped.
pub struct Lab {
    id: String,
    net: Subnet,
    hosts: Vec<Host>,
    switch: Option<Switch>,
    /// The disks hosts' reads are capped on (empty when no host has a disk).
    disks: Vec<BlockDevice>,
    /// The switch's own round trip, measured at start (two hosts or more).
    floor: Option<std::time::Duration>,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl Lab {
    /// Makes the hosts, their devices and cgroups, and starts the switch. Leftovers of labs
    /// whose process has died are removed first.
    pub fn start(spec: &LabSpec) -> Result<Self> {
        crate::tun::check_supported()?;
        spec.validate()?;
        clean(false);
        let id = format!(
            "{PREFIX}{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let net = Subnet::default();
        let mut lab = Self {
            id,
            net,
            hosts: Vec::new(),
            switch: None,
            disks: Vec::new(),
            floor: None,
        };
        // The directories on each disk host's emulated disk, resolved once for all of them.
        let mut dirs = Vec::new();
        if spec.hosts.iter().any(|h| h.disk.is_some()) {
            dirs = disk_dirs(spec)?;
            for p in &spec.disk_paths {
                let d = crate::disk::device_of(p)?;
                if !lab.disks.iter().any(|x| x.id == d.id) {
                    lab.disks.push(d);
                }
            }
        }
        let mut ports: Vec<File> = Vec::new();
        for (i, h) in spec.hosts.iter().enumerate() {
            let name = format!("{}-{i}", lab.id);
            let ns = Netns::create(&name)?;
            lab.hosts.push(Host {
                name: h.name.clone(),
                ns: Some(ns),
                cgroup: None,
                disk: h.disk,
                emulated: None,
            });
            let ns = lab.hosts[i].ns.as_ref().expect("just made");
            ports.push(crate::tun::create(
                ns,
                crate::packet::mac(i),
                net.host(i),
                Subnet::PREFIX,
                spec.mtu,
            )?);
            let mut limits = h.limits.clone();
            if let Some(p) = h.disk {
                limits.disk = Some(DiskCap {
                    devices: lab.disks.iter().map(|d| d.id).collect(),
                    read_bps: p.read_bps,
                    read_iops: p.read_iops,
                });
            }
            lab.hosts[i].cgroup = Cgroup::create(&name, &limits)?;
            if let Some(p) = h.disk.filter(|_| !dirs.is_empty()) {
                let mut disk = EmulatedDisk::new(&p)
                    .map_err(|e| LabError::io(format!("starting {}'s disk", h.name), e))?;
                for (k, dir) in dirs.iter().enumerate() {
                    let at = std::env::temp_dir().join(format!("{name}-disk{k}"));
                    disk.add_view(dir, &at).map_err(|e| {
                        LabError::io(
                            format!("mounting {}'s disk over {}", h.name, dir.display()),
                            e,
                        )
                    })?;
                }
                lab.hosts[i].emulated = Some(disk);
            }
        }
        let switch = Switch::start(ports, Impairment::default(), spec.seed)?;
        lab.switch = Some(switch);
        if spec.compensate_switch && lab.hosts.len() >= 2 {
            // The median of sequential round trips through the switch with no delay: what it
            // costs on its own, on this machine, now.
            let (median, _) = crate::selftest::rtt_between(&lab, 0, 1, FLOOR_PINGS)?;
            let floor = std::time::Duration::from_secs_f64(median);
            lab.switch().set_compensation(floor / 2);
            lab.floor = Some(floor);
        }
        let switch = lab.switch();
        for a in 0..spec.hosts.len() {
            for b in 0..spec.hosts.len() {
                if a != b {
                    switch.set_one_way(a, b, spec.default_link);
                }
            }
        }
        for l in &spec.links {
            switch.set_link(spec.index(&l.a)?, spec.index(&l.b)?, l.each_way);
        }
        Ok(lab)
    }

    /// The switch's own round trip with no delay asked for, measured when the lab started
    /// (`None` with one host, or when [`LabSpec::compensate_switch`] is off). Each link's
    /// delay is shortened by half of it each way, so a round trip measures what was asked
    /// for; a round trip below it cannot be emulated.
    pub fn switch_floor(&self) -> Option<std::time::Duration> {
        self.floor
    }

    /// The disks the hosts' reads are capped on, as resolved from [`LabSpec::disk_paths`].
    pub fn disks(&self) -> &[BlockDevice] {
        &self.disks
    }

    /// Host `i`'s disk profile, if it has one.
    pub fn disk(&self, i: usize) -> Option<DiskProfile> {
        self.hosts[i].disk
    }

    /// `path` as host `i` reads it: through its emulated disk where `path` lies in one of
    /// [`LabSpec::disk_dirs`] (for this process's own threads; the host's processes see
    /// the views at the real paths).
    pub fn through_disk(&self, i: usize, path: &Path) -> std::path::PathBuf {
        let real = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        self.hosts[i]
            .emulated
            .as_ref()
            .and_then(|d| d.through(&real))
            .unwrap_or_else(|| path.to_path_buf())
    }

    /// Host `i`'s emulated disk, if it has a disk and [`LabSpec::disk_dirs`] are given.
    pub fn emulated_disk(&self, i: usize) -> Option<&EmulatedDisk> {
        self.hosts[i].emulated.as_ref()
    }

    /// Host `i`'s cgroup, if it has limits.
    pub fn cgroup(&self, i: usize) -> Option<&Cgroup> {
        self.hosts[i].cgroup.as_ref()
    }

    /// This lab's id (the prefix of its namespaces' and cgroups' names).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether the lab has no hosts (never, once started).
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The index of the host called `name`.
    pub fn host(&self, name: &str) -> Result<usize> {
        self.hosts
            .iter()
            .position(|h| h.name == name)
            .ok_or_else(|| LabError::Spec(format!("no host named {name:?}")))
    }

    /// Host `i`'s name.
    pub fn name(&self, i: usize) -> &str {
        &self.hosts[i].name
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        self.net.host(i)
    }

    /// Host `i`'s namespace name (for `ip netns exec`).
    pub fn netns(&self, i: usize) -> &str {
        self.ns(i).name()
    }

    fn ns(&self, i: usize) -> &Netns {
        self.hosts[i]
            .ns
            .as_ref()
            .expect("a started lab's hosts have namespaces")
    }

    /// The switch, to reshape, partition and heal links and read their counters.
    pub fn switch(&self) -> &Switch {
        self.switch.as_ref().expect("a started lab has a switch")
    }

    /// A command that runs `program` on host `i`: in its namespace and cgroup, and in a mount
    /// namespace of its own where its emulated disks are bound over the real directories.
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Result<Command> {
        let mut cmd = Command::new(program);
        self.ns(i).prepare(&mut cmd)?;
        if let Some(cg) = &self.hosts[i].cgroup {
            cg.prepare(&mut cmd)?;
        }
        if let Some(d) = &self.hosts[i].emulated {
            crate::disk::mounts::bind_in_child(&mut cmd, d.views())?;
        }
        Ok(cmd)
    }

    /// Imposes every host's CPU quota (`on`), or lifts them all. A cluster lifts them while
    /// its nodes start, so that each node's probe measures the unthrottled host and the lab
    /// scales the measured figures by exactly the quota it imposes.
    pub fn set_cpu_quotas(&self, on: bool) -> Result<()> {
        for h in &self.hosts {
            if let Some(cg) = &h.cgroup {
                cg.set_cpu_quota(on)?;
            }
        }
        Ok(())
    }

    /// Runs `f` on a thread inside host `i`'s namespace: sockets it makes belong to host `i`.
    pub fn run_in<T: Send>(
        &self,
        i: usize,
        f: impl FnOnce() -> std::io::Result<T> + Send,
    ) -> Result<T> {
        self.ns(i).run_in(f)
    }

    /// A TCP connection from host `i` to `addr` (host `i`'s own loopback included).
    pub fn connect(&self, i: usize, addr: std::net::SocketAddr) -> Result<std::net::TcpStream> {
        self.run_in(i, || {
            std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(10))
        })
    }

    /// Processes running on host `i`.
    pub fn pids(&self, i: usize) -> Vec<u32> {
        self.ns(i).pids()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Processes first (so nothing sends), then the switch (closing the TAP devices), then
        // the namespaces and cgroups.
        for h in &self.hosts {
            if let Some(ns) = &h.ns {
                crate::netns::kill_all(&ns.pids());
            }
        }
        self.switch = None;
        for h in &mut self.hosts {
            h.emulated = None;
            if let Some(ns) = h.ns.take() {
                let _ = ns.destroy();
            }
            if let Some(cg) = h.cgroup.take() {
                cg.destroy();
            }
        }
    }
}

/// [`LabSpec::disk_dirs`] as directories, each once.
fn disk_dirs(spec: &LabSpec) -> Result<Vec<std::path::PathBuf>> {
    let mut out: Vec<std::path::PathBuf> = Vec::new();
    for d in &spec.disk_dirs {
        let c = d
            .canonicalize()
            .map_err(|e| LabError::io(format!("finding {}", d.display()), e))?;
        if !c.is_dir() {
            return Err(LabError::Spec(format!(
                "{} is not a directory",
                d.display()
            )));
        }
        if !out.contains(&c) {
            out.push(c);
        }
    }
    Ok(out)
}

/// What [`clean`] removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Cleaned {
    pub namespaces: Vec<String>,
    pub cgroups: Vec<String>,
    /// Emulated disks' mount points.
    pub views: Vec<String>,
}

/// Removes the namespaces (killing their processes) and cgroups of labs whose process is gone
/// — or, with `all`, of every lab on this machine, live ones included.
pub fn clean(all: bool) -> Cleaned {
    let mut out = Cleaned::default();
    for name in crate::netns::list(PREFIX) {
        if all || !owner_alive(&name) {
            if let Ok(ns) = Netns::open(&name) {
                if ns.destroy().is_ok() {
                    out.namespaces.push(name);
                }
            } else if crate::netns::ip(&["netns", "delete", &name]).is_ok() {
                out.namespaces.push(name);
            }
        }
    }
    for dir in crate::cgroup::list(PREFIX) {
        let name = last_name(&dir);
        if all || !owner_alive(&name) {
            crate::cgroup::remove(&dir);
            if !dir.exists() {
                out.cgroups.push(dir.display().to_string());
            }
        }
    }
    for at in crate::disk::mounts::leftover_views() {
        let name = last_name(&at);
        if name.starts_with(PREFIX)
            && (all || !owner_alive(&name))
            && crate::disk::mounts::unmount_leftover(&at).is_ok()
        {
            out.views.push(at.display().to_string());
        }
    }
    out
}

/// The last component of `path` (empty where it has none or it is not UTF-8).
fn last_name(path: &Path) -> String {
    path.file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string()
}

/// Whether the process named in `tlab-PID-...` still runs.
fn owner_alive(name: &str) -> bool {
    name.strip_prefix(PREFIX)
        .and_then(|r| r.split('-').next())
        .and_then(|p| p.parse::<u32>().ok())
        .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
}
