//! The node measures itself.
//!
//! [`measure`] returns an [`Inventory`]: RAM, CPU model, cores and features, memory bandwidth,
//! compute rate, disk read bandwidth and free space, and the (empty, for now) list of GPUs.
//! Every figure says how it was obtained (`method`/`source`), every probe is bounded in time,
//! and a figure that could not be measured is `None`, with the reason in [`Inventory::probes`]:
//! unknown is uncertainty, not a default.
//!
//! [`MemoryBudget`] parses the operator's budget ("6GiB", "512MiB", "80%") and
//! [`Inventory::accepts`] refuses work beyond it, naming the figures.

use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::sys;

mod budget;
mod compute;
mod disk;
mod host;
mod memory_bandwidth;

pub use budget::{BudgetError, BudgetRefusal, MemoryBudget};

use compute::fma_loop_rate;
use disk::probe_disk;
use host::{cpu_info, cpuinfo_flags, memory_info, read_cpuinfo};
use memory_bandwidth::probe_memory_bandwidth;

/// Version of the [`Inventory`] JSON layout.
pub const INVENTORY_SCHEMA: u32 = 1;

/// Label of the built-in compute estimate, see [`ComputeRate::source`].
pub const FALLBACK_COMPUTE_SOURCE: &str = "f32 fma loop";

/// A caller-supplied compute probe: the engine plugs its own quantized matmul in here, so the
/// figure is the rate of the kernel that will actually run (e.g. `"engine q4_0 matmul"`).
pub type ComputeProbe = Box<dyn Fn() -> ComputeRate + Send + Sync>;

/// What to measure and how long each measurement may take.
pub struct ProbeOptions {
    /// Size of the memory-bandwidth test buffer (the copy test copies one half onto the other).
    /// Should be well above the last-level cache. Default 256 MiB.
    pub memory_buffer_bytes: usize,
    /// Passes per memory test; the best is kept. Default 3 (fewer if the time limit is hit).
    pub memory_reps: u32,
    /// Threads for the all-threads tests. `None`: every core this process may use.
    pub threads: Option<usize>,
    /// Directory whose filesystem is measured (the model cache). `None`: no disk probe.
    pub disk_dir: Option<PathBuf>,
    /// Size of the temporary file written and read back by the disk probe. Default 256 MiB.
    pub disk_test_bytes: u64,
    /// Soft time limit per probe (memory bandwidth, compute, disk write, disk read). Each probe
    /// always completes at least one pass, so it can overrun by one pass. Default 400 ms.
    pub probe_time_limit: Duration,
    /// The engine's own compute probe; `None` uses the built-in f32 FMA loop, labelled as such.
    pub compute_probe: Option<ComputeProbe>,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        Self {
            memory_buffer_bytes: 256 << 20,
            memory_reps: 3,
            threads: None,
            disk_dir: None,
            disk_test_bytes: 256 << 20,
            probe_time_limit: Duration::from_millis(400),
            compute_probe: None,
        }
    }
}

impl fmt::Debug for ProbeOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProbeOptions")
            .field("memory_buffer_bytes", &self.memory_buffer_bytes)
            .field("memory_reps", &self.memory_reps)
            .field("threads", &self.threads)
            .field("disk_dir", &self.disk_dir)
            .field("disk_test_bytes", &self.disk_test_bytes)
            .field("probe_time_limit", &self.probe_time_limit)
            .field(
                "compute_probe",
                &self.compute_probe.as_ref().map(|_| "<caller probe>"),
            )
            .finish()
    }
}

/// Everything the node knows about itself, with how each figure was obtained.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Inventory {
    pub schema: u32,
    /// When the probe started (Unix time, milliseconds).
    pub measured_at_unix_ms: u64,
    /// Wall time of the whole probe.
    pub probe_duration_ms: f64,
    pub host: HostInfo,
    pub memory: MemoryInfo,
    pub cpu: CpuInfo,
    /// `None` if the probe failed (see `probes`).
    pub memory_bandwidth: Option<MemoryBandwidth>,
    /// `None` if the probe failed (see `probes`).
    pub compute: Option<ComputeRate>,
    /// `None` when no directory was given to measure.
    pub disk: Option<DiskInfo>,
    /// GPUs found. No GPU backend is compiled in yet, so this is empty; see `gpu_backends`.
    pub gpus: Vec<GpuInfo>,
    /// GPU backends compiled into this build and probed (e.g. "cuda", "metal"). Empty: none.
    pub gpu_backends: Vec<String>,
    /// The operator's memory budget once set ([`Inventory::set_budget`]).
    pub memory_budget: Option<ResolvedBudget>,
    /// Every probe that ran or was skipped, with its duration and outcome.
    pub probes: Vec<ProbeRecord>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostInfo {
    pub hostname: Option<String>,
    /// `std::env::consts::OS`.
    pub os: String,
    /// `std::env::consts::ARCH`.
    pub arch: String,
    /// Whether the CPU reports running under a hypervisor (x86 `hypervisor` flag); `None` when
    /// not determinable. Under a hypervisor, disk figures may include the host's caches.
    pub virtualized: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryInfo {
    pub total_bytes: Option<u64>,
    /// Memory the kernel estimates can be allocated without swapping.
    pub available_bytes: Option<u64>,
    /// A memory limit imposed on this process's control group, if any (cgroup v2 `memory.max`).
    pub cgroup_limit_bytes: Option<u64>,
    pub method: String,
}

impl MemoryInfo {
    /// The most memory this process could ever use: total RAM, lowered by a cgroup limit.
    pub fn usable_total_bytes(&self) -> Option<u64> {
        match (self.total_bytes, self.cgroup_limit_bytes) {
            (Some(t), Some(c)) => Some(t.min(c)),
            (t, None) => t,
            (None, Some(c)) => Some(c),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuInfo {
    pub model_name: Option<String>,
    /// Logical processors online in the machine.
    pub logical_cores: Option<usize>,
    /// Logical processors this process may use (affinity mask, cgroup CPU quota).
    pub usable_cores: Option<usize>,
    /// Features found, by their `is_*_feature_detected!` names.
    pub features: Vec<String>,
    /// Features looked for: one listed here but absent from `features` is known absent; one not
    /// listed here was not checked.
    pub features_checked: Vec<String>,
    pub method: String,
}

/// Memory bandwidth in bytes per second, best of the passes run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryBandwidth {
    /// Copy test, STREAM convention: bytes read plus bytes written per second.
    pub copy_single_thread: f64,
    /// Read-only test (summing 64-bit words): bytes read per second.
    pub read_single_thread: f64,
    pub copy_all_threads: f64,
    pub read_all_threads: f64,
    pub threads: usize,
    pub buffer_bytes: u64,
    /// Passes per test actually run (the time limit may cut the requested count).
    pub passes: u32,
    pub method: String,
    pub duration_ms: f64,
}

/// A measured compute rate. One multiply-add counts as two floating-point (or integer)
/// operations, so rates from different kernels are comparable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ComputeRate {
    /// Operations per second using `threads` threads.
    pub ops_per_s: f64,
    pub single_thread_ops_per_s: Option<f64>,
    pub threads: usize,
    /// Which kernel produced the figure: `"f32 fma loop"` (the built-in estimate, an upper bound
    /// on what real kernels reach) or the caller's, e.g. `"engine q4_0 matmul"`.
    pub source: String,
    /// How, in words (instruction set, shapes, duration).
    pub detail: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskInfo {
    /// The directory measured (the model cache).
    pub dir: PathBuf,
    /// Free space available to this user on that filesystem.
    pub free_bytes: Option<u64>,
    pub total_bytes: Option<u64>,
    pub space_method: String,
    /// Sequential write bandwidth (including the final fsync). `None`: the probe failed.
    pub write: Option<DiskRate>,
    /// Sequential read bandwidth of the file just written. `None`: the probe failed.
    pub read: Option<DiskRate>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskRate {
    pub bytes_per_s: f64,
    pub bytes: u64,
    /// True when nothing guaranteed the bytes came from the device rather than a cache.
    pub possibly_cached: bool,
    pub method: String,
    pub duration_ms: f64,
}

/// A GPU found by a compiled-in backend (none yet: the seam is here so the planner and the
/// dashboard already read the field).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub backend: String,
    pub name: String,
    pub vram_total_bytes: Option<u64>,
    pub vram_free_bytes: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeStatus {
    Ok,
    Skipped,
    Failed,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProbeRecord {
    pub name: String,
    pub status: ProbeStatus,
    pub duration_ms: f64,
    /// Why a probe was skipped or failed, or a note on how it ran.
    pub detail: Option<String>,
}

/// A budget resolved to bytes, with the text it was given as.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedBudget {
    pub bytes: u64,
    pub spec: String,
}

/// Measures this node. Bounded in time: each probe stops after about
/// [`ProbeOptions::probe_time_limit`] (after at least one pass).
pub fn measure(opts: &ProbeOptions) -> Inventory {
    let started = Instant::now();
    let measured_at_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let mut probes = Vec::new();

    let cpuinfo = read_cpuinfo();
    let host = HostInfo {
        hostname: sys::hostname(),
        os: std::env::consts::OS.to_string(),
        arch: std::env::consts::ARCH.to_string(),
        virtualized: cpuinfo
            .as_deref()
            .and_then(cpuinfo_flags)
            .map(|flags| flags.iter().any(|f| f == "hypervisor")),
    };

    let t = Instant::now();
    let memory = memory_info();
    probes.push(record("memory size", t, ProbeStatus::Ok, None));

    let t = Instant::now();
    let cpu = cpu_info(cpuinfo.as_deref());
    probes.push(record("cpu", t, ProbeStatus::Ok, None));

    let threads = opts
        .threads
        .or(cpu.usable_cores)
        .or(cpu.logical_cores)
        .unwrap_or(1)
        .max(1);

    let t = Instant::now();
    let memory_bandwidth = match probe_memory_bandwidth(opts, threads) {
        Ok(b) => {
            probes.push(record("memory bandwidth", t, ProbeStatus::Ok, None));
            Some(b)
        }
        Err(e) => {
            probes.push(record("memory bandwidth", t, ProbeStatus::Failed, Some(e)));
            None
        }
    };

    let t = Instant::now();
    let compute = match &opts.compute_probe {
        Some(probe) => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(probe)) {
            Ok(rate) => {
                probes.push(record("compute (caller probe)", t, ProbeStatus::Ok, None));
                Some(rate)
            }
            Err(_) => {
                probes.push(record(
                    "compute (caller probe)",
                    t,
                    ProbeStatus::Failed,
                    Some("the caller's compute probe panicked".into()),
                ));
                None
            }
        },
        None => {
            let rate = fma_loop_rate(threads, opts.probe_time_limit);
            probes.push(record("compute (f32 fma loop)", t, ProbeStatus::Ok, None));
            Some(rate)
        }
    };

    let disk = match &opts.disk_dir {
        Some(dir) => Some(probe_disk(dir, opts, host.virtualized, &mut probes)),
        None => {
            probes.push(ProbeRecord {
                name: "disk".into(),
                status: ProbeStatus::Skipped,
                duration_ms: 0.0,
                detail: Some("no directory given (ProbeOptions::disk_dir)".into()),
            });
            None
        }
    };

    Inventory {
        schema: INVENTORY_SCHEMA,
        measured_at_unix_ms,
        probe_duration_ms: ms(started.elapsed()),
        host,
        memory,
        cpu,
        memory_bandwidth,
        compute,
        disk,
        gpus: Vec::new(),
        gpu_backends: Vec::new(),
        memory_budget: None,
        probes,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn record(name: &str, since: Instant, status: ProbeStatus, detail: Option<String>) -> ProbeRecord {
    ProbeRecord {
        name: name.to_string(),
        status,
        duration_ms: ms(since.elapsed()),
        detail,
    }
}
