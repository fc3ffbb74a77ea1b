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
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tessera_model::human_bytes;

use crate::sys;

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

// ---------------------------------------------------------------------------------------------
// RAM, CPU

fn read_cpuinfo() -> Option<String> {
    if cfg!(any(target_os = "linux", target_os = "android")) {
        std::fs::read_to_string("/proc/cpuinfo").ok()
    } else {
        None
    }
}

/// The first value of `key` in /proc/cpuinfo.
fn cpuinfo_field<'a>(cpuinfo: &'a str, key: &str) -> Option<&'a str> {
    cpuinfo.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key)
            .then(|| v.trim())
            .filter(|v| !v.is_empty())
    })
}

fn cpuinfo_flags(cpuinfo: &str) -> Option<Vec<String>> {
    cpuinfo_field(cpuinfo, "flags")
        .or_else(|| cpuinfo_field(cpuinfo, "Features"))
        .map(|f| f.split_whitespace().map(str::to_string).collect())
}

/// Parses `/proc/meminfo`-style text: (MemTotal, MemAvailable) in bytes.
#[cfg_attr(not(any(target_os = "linux", target_os = "android")), allow(dead_code))]
fn parse_meminfo(text: &str) -> (Option<u64>, Option<u64>) {
    let field = |key: &str| {
        text.lines().find_map(|line| {
            let rest = line.strip_prefix(key)?.strip_prefix(':')?;
            let mut parts = rest.split_whitespace();
            let n: u64 = parts.next()?.parse().ok()?;
            let mult = match parts.next() {
                Some("kB") => 1024,
                None => 1,
                Some(_) => return None,
            };
            n.checked_mul(mult)
        })
    };
    (field("MemTotal"), field("MemAvailable"))
}

/// cgroup v2 memory limit of this process, if one is set.
#[cfg_attr(not(any(target_os = "linux", target_os = "android")), allow(dead_code))]
fn cgroup_memory_limit() -> Option<u64> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let path = Path::new("/sys/fs/cgroup")
        .join(rel.trim_start_matches('/'))
        .join("memory.max");
    let text = std::fs::read_to_string(path).ok()?;
    text.trim().parse().ok()
}

fn memory_info() -> MemoryInfo {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let (total, available) = std::fs::read_to_string("/proc/meminfo")
            .map(|t| parse_meminfo(&t))
            .unwrap_or((None, None));
        MemoryInfo {
            total_bytes: total,
            available_bytes: available,
            cgroup_limit_bytes: cgroup_memory_limit(),
            method: "/proc/meminfo MemTotal, MemAvailable; cgroup v2 memory.max".into(),
        }
    }
    #[cfg(any(target_os = "macos", target_os = "ios"))]
    {
        MemoryInfo {
            total_bytes: sys::sysctl_u64("hw.memsize"),
            available_bytes: None,
            cgroup_limit_bytes: None,
            method: "sysctl hw.memsize; available memory not probed on macOS".into(),
        }
    }
    #[cfg(not(any(
        target_os = "linux",
        target_os = "android",
        target_os = "macos",
        target_os = "ios"
    )))]
    {
        MemoryInfo {
            total_bytes: None,
            available_bytes: None,
            cgroup_limit_bytes: None,
            method: "no memory probe for this platform".into(),
        }
    }
}

fn cpu_model_name(cpuinfo: Option<&str>) -> Option<String> {
    #[cfg(any(target_os = "macos", target_os = "ios"))]
    {
        let _ = cpuinfo;
        sys::sysctl_string("machdep.cpu.brand_string")
    }
    #[cfg(not(any(target_os = "macos", target_os = "ios")))]
    {
        let cpuinfo = cpuinfo?;
        if let Some(name) = ["model name", "Hardware", "Processor", "cpu model"]
            .iter()
            .find_map(|k| cpuinfo_field(cpuinfo, k))
        {
            return Some(name.to_string());
        }
        // Many aarch64 kernels name no model: the board's device-tree model, then the raw ids.
        if let Ok(model) = std::fs::read_to_string("/proc/device-tree/model") {
            let model = model.trim_matches(char::from(0)).trim();
            if !model.is_empty() {
                return Some(model.to_string());
            }
        }
        match (
            cpuinfo_field(cpuinfo, "CPU implementer"),
            cpuinfo_field(cpuinfo, "CPU part"),
        ) {
            (Some(i), Some(p)) => Some(format!("CPU implementer {i}, part {p}")),
            _ => None,
        }
    }
}

fn cpu_features() -> (Vec<String>, Vec<String>) {
    let mut found = Vec::new();
    let mut checked = Vec::new();
    let mut check = |name: &str, present: bool| {
        checked.push(name.to_string());
        if present {
            found.push(name.to_string());
        }
    };
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    {
        check("avx", std::arch::is_x86_feature_detected!("avx"));
        check("avx2", std::arch::is_x86_feature_detected!("avx2"));
        check("fma", std::arch::is_x86_feature_detected!("fma"));
        check("f16c", std::arch::is_x86_feature_detected!("f16c"));
        check("avx512f", std::arch::is_x86_feature_detected!("avx512f"));
        check(
            "avx512_vnni",
            std::arch::is_x86_feature_detected!("avx512vnni"),
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        check("neon", std::arch::is_aarch64_feature_detected!("neon"));
        check(
            "dotprod",
            std::arch::is_aarch64_feature_detected!("dotprod"),
        );
    }
    let _ = &mut check;
    (found, checked)
}

fn cpu_info(cpuinfo: Option<&str>) -> CpuInfo {
    let (features, features_checked) = cpu_features();
    let model_source = if cfg!(any(target_os = "macos", target_os = "ios")) {
        "sysctl machdep.cpu.brand_string"
    } else {
        "/proc/cpuinfo"
    };
    CpuInfo {
        model_name: cpu_model_name(cpuinfo),
        logical_cores: sys::cpus_online(),
        usable_cores: std::thread::available_parallelism().ok().map(|n| n.get()),
        features,
        features_checked,
        method: format!(
            "model: {model_source}; logical cores: sysconf(_SC_NPROCESSORS_ONLN); usable cores: \
             std::thread::available_parallelism (affinity and cgroup quota); features: runtime \
             CPUID/HWCAP detection"
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Memory bandwidth

fn read_words(words: &[u64]) -> u64 {
    // Eight independent accumulators so the adds do not serialise on one register.
    let mut acc = [0u64; 8];
    for c in words.chunks_exact(8) {
        acc[0] = acc[0].wrapping_add(c[0]);
        acc[1] = acc[1].wrapping_add(c[1]);
        acc[2] = acc[2].wrapping_add(c[2]);
        acc[3] = acc[3].wrapping_add(c[3]);
        acc[4] = acc[4].wrapping_add(c[4]);
        acc[5] = acc[5].wrapping_add(c[5]);
        acc[6] = acc[6].wrapping_add(c[6]);
        acc[7] = acc[7].wrapping_add(c[7]);
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

/// Runs `pass` until `reps` passes are done or `limit` has elapsed (at least one pass);
/// returns the best rate, bytes per pass / seconds, and the passes run.
fn best_rate(
    reps: u32,
    limit: Duration,
    bytes_per_pass: f64,
    mut pass: impl FnMut(),
) -> (f64, u32) {
    let start = Instant::now();
    let mut best = 0.0f64;
    let mut done = 0;
    while done < reps.max(1) {
        let t = Instant::now();
        pass();
        let secs = t.elapsed().as_secs_f64().max(1e-9);
        best = best.max(bytes_per_pass / secs);
        done += 1;
        if start.elapsed() >= limit {
            break;
        }
    }
    (best, done)
}

fn probe_memory_bandwidth(opts: &ProbeOptions, threads: usize) -> Result<MemoryBandwidth, String> {
    let started = Instant::now();
    // One buffer: the read test sums all of it; the copy test copies its first half onto its
    // second half. Keeping the footprint to one buffer halves the page-faulting set-up time.
    let words = (opts.memory_buffer_bytes / 8).max(1 << 11) / 16 * 16;
    let bytes = (words * 8) as f64;
    // Filling with a non-zero value touches every page now, so page faults stay out of the
    // timed passes.
    let mut buf = Vec::new();
    buf.try_reserve_exact(words)
        .map_err(|e| format!("could not allocate {}: {e}", human_bytes(bytes as u64)))?;
    buf.resize(words, 0x0123_4567_89ab_cdefu64);

    let limit = opts.probe_time_limit / 4;
    let reps = opts.memory_reps;
    let half = words / 2;
    let per_thread_copy = half.div_ceil(threads).div_ceil(8) * 8;
    let per_thread_read = words.div_ceil(threads).div_ceil(8) * 8;

    let (copy1, p1) = best_rate(reps, limit, bytes, || {
        let (src, dst) = buf.split_at_mut(half);
        dst.copy_from_slice(src);
        black_box(dst);
    });
    let (read1, p2) = best_rate(reps, limit, bytes, || {
        black_box(read_words(black_box(&buf)));
    });
    let (copy_n, p3) = best_rate(reps, limit, bytes, || {
        let (src, dst) = buf.split_at_mut(half);
        std::thread::scope(|s| {
            for (d, sv) in dst
                .chunks_mut(per_thread_copy)
                .zip(src.chunks(per_thread_copy))
            {
                s.spawn(move || {
                    d.copy_from_slice(sv);
                    black_box(d);
                });
            }
        });
    });
    let (read_n, p4) = best_rate(reps, limit, bytes, || {
        std::thread::scope(|s| {
            for sv in buf.chunks(per_thread_read) {
                s.spawn(move || black_box(read_words(black_box(sv))));
            }
        });
    });

    Ok(MemoryBandwidth {
        copy_single_thread: copy1,
        read_single_thread: read1,
        copy_all_threads: copy_n,
        read_all_threads: read_n,
        threads,
        buffer_bytes: bytes as u64,
        passes: p1.min(p2).min(p3).min(p4),
        method: format!(
            "best of up to {reps} passes over a {} buffer: read = sum of its 64-bit words; copy = \
             copy_from_slice of its first half onto its second, counted as bytes read + written \
             (STREAM convention); all-threads tests split the work across {threads} threads",
            human_bytes(bytes as u64)
        ),
        duration_ms: ms(started.elapsed()),
    })
}

// ---------------------------------------------------------------------------------------------
// Compute: the built-in f32 FMA loop

/// Iterations per timed block of the FMA kernels.
const FMA_BLOCK_ITERS: u64 = 50_000;

/// One block of the kernel; returns (flops done, a value to keep the work observable).
type FmaKernel = fn(u64) -> (f64, f32);

fn fma_block_portable(iters: u64) -> (f64, f32) {
    let mut acc = [1.0f32; 16];
    let (m, a) = (black_box(0.999_999f32), black_box(1e-6f32));
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = *x * m + a;
        }
    }
    (iters as f64 * 16.0 * 2.0, acc.iter().sum())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,avx2,fma")]
#[allow(unused_unsafe)]
unsafe fn fma_block_avx2_inner(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: the caller checked that the CPU has AVX2 and FMA.
    unsafe {
        let m = _mm256_set1_ps(black_box(0.999_999));
        let a = _mm256_set1_ps(black_box(1e-6));
        // Ten independent accumulators cover the FMA latency (4 cycles) on two ports.
        let (mut x0, mut x1, mut x2, mut x3, mut x4) = (m, m, m, m, m);
        let (mut x5, mut x6, mut x7, mut x8, mut x9) = (m, m, m, m, m);
        for _ in 0..iters {
            x0 = _mm256_fmadd_ps(x0, m, a);
            x1 = _mm256_fmadd_ps(x1, m, a);
            x2 = _mm256_fmadd_ps(x2, m, a);
            x3 = _mm256_fmadd_ps(x3, m, a);
            x4 = _mm256_fmadd_ps(x4, m, a);
            x5 = _mm256_fmadd_ps(x5, m, a);
            x6 = _mm256_fmadd_ps(x6, m, a);
            x7 = _mm256_fmadd_ps(x7, m, a);
            x8 = _mm256_fmadd_ps(x8, m, a);
            x9 = _mm256_fmadd_ps(x9, m, a);
        }
        let s = _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)),
            _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(x4, x5), _mm256_add_ps(x6, x7)),
                _mm256_add_ps(x8, x9),
            ),
        );
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }
}

#[cfg(target_arch = "x86_64")]
fn fma_block_avx2(iters: u64) -> (f64, f32) {
    // SAFETY: only selected by `fma_kernel` after runtime detection of AVX2 and FMA.
    let v = unsafe { fma_block_avx2_inner(iters) };
    (iters as f64 * 10.0 * 8.0 * 2.0, v)
}

fn fma_kernel() -> (FmaKernel, &'static str) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return (
            fma_block_avx2,
            "AVX2 FMA (vfmadd on 8-lane f32 vectors, 10 independent accumulators)",
        );
    }
    (
        fma_block_portable,
        "portable f32 multiply then add (not fused; vectorised only if the compiler manages)",
    )
}

/// Runs the kernel for about `time`; returns (flops, elapsed).
fn fma_run(kernel: FmaKernel, time: Duration) -> (f64, Duration) {
    let start = Instant::now();
    let mut flops = 0.0;
    loop {
        let (f, v) = kernel(black_box(FMA_BLOCK_ITERS));
        black_box(v);
        flops += f;
        if start.elapsed() >= time {
            return (flops, start.elapsed());
        }
    }
}

fn fma_loop_rate(threads: usize, limit: Duration) -> ComputeRate {
    let (kernel, how) = fma_kernel();
    let each = (limit / 2).max(Duration::from_millis(5));
    let (f1, t1) = fma_run(kernel, each);
    let single = f1 / t1.as_secs_f64().max(1e-9);
    let start = Instant::now();
    let total: f64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| s.spawn(move || fma_run(kernel, each).0))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    });
    let all = total / start.elapsed().as_secs_f64().max(1e-9);
    ComputeRate {
        ops_per_s: all,
        single_thread_ops_per_s: Some(single),
        threads,
        source: FALLBACK_COMPUTE_SOURCE.into(),
        detail: format!(
            "{how}; {} ms per test; an estimate of peak f32 arithmetic, not of the engine's \
             quantized kernels",
            each.as_millis()
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Disk

/// Removes the probe file however the probe ends.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const DISK_BLOCK: usize = 4 << 20;

fn probe_disk(
    dir: &Path,
    opts: &ProbeOptions,
    virtualized: Option<bool>,
    probes: &mut Vec<ProbeRecord>,
) -> DiskInfo {
    let t = Instant::now();
    let (free_bytes, total_bytes) = match sys::fs_space(dir) {
        Ok((f, t)) => (Some(f), Some(t)),
        Err(e) => {
            probes.push(record(
                "disk space",
                t,
                ProbeStatus::Failed,
                Some(format!("statvfs {}: {e}", dir.display())),
            ));
            (None, None)
        }
    };
    if free_bytes.is_some() {
        probes.push(record("disk space", t, ProbeStatus::Ok, None));
    }
    let mut info = DiskInfo {
        dir: dir.to_owned(),
        free_bytes,
        total_bytes,
        space_method: "statvfs: f_bavail × f_frsize (space available to this user)".into(),
        write: None,
        read: None,
    };

    // Leave room: never fill the disk to measure it.
    let mut size = opts.disk_test_bytes.max(DISK_BLOCK as u64);
    if let Some(free) = free_bytes {
        size = size.min(free / 4);
    }
    let size = size / DISK_BLOCK as u64 * DISK_BLOCK as u64;
    if size == 0 {
        probes.push(ProbeRecord {
            name: "disk bandwidth".into(),
            status: ProbeStatus::Skipped,
            duration_ms: 0.0,
            detail: Some("too little free space for a test file".into()),
        });
        return info;
    }

    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let path = dir.join(format!(
        ".tessera-disk-probe-{}-{nanos}.tmp",
        std::process::id()
    ));
    let _guard = RemoveOnDrop(path.clone());

    let t = Instant::now();
    match disk_write(&path, size, opts.probe_time_limit) {
        Ok(rate) => {
            probes.push(record("disk write", t, ProbeStatus::Ok, None));
            info.write = Some(rate);
        }
        Err(e) => {
            probes.push(record(
                "disk write",
                t,
                ProbeStatus::Failed,
                Some(format!("{}: {e}", path.display())),
            ));
            return info;
        }
    }

    let t = Instant::now();
    match disk_read(&path, opts.probe_time_limit, virtualized) {
        Ok(rate) => {
            probes.push(record("disk read", t, ProbeStatus::Ok, None));
            info.read = Some(rate);
        }
        Err(e) => probes.push(record(
            "disk read",
            t,
            ProbeStatus::Failed,
            Some(format!("{}: {e}", path.display())),
        )),
    }
    info
}

/// Fills a block with pseudo-random bytes (so compressing or deduplicating filesystems cannot
/// shortcut the test); `seed` varies per block.
fn fill_pseudo_random(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

fn disk_write(path: &Path, size: u64, limit: Duration) -> std::io::Result<DiskRate> {
    use std::io::Write;
    let mut block = vec![0u8; DISK_BLOCK];
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    let start = Instant::now();
    let mut written = 0u64;
    let mut n = 0u64;
    let mut fill = Duration::ZERO;
    while written < size {
        let f = Instant::now();
        fill_pseudo_random(&mut block, n + 1);
        fill += f.elapsed();
        file.write_all(&block)?;
        written += DISK_BLOCK as u64;
        n += 1;
        if start.elapsed() >= limit {
            break;
        }
    }
    file.sync_all()?;
    // Generating the data is not disk time.
    let secs = (start.elapsed() - fill).as_secs_f64().max(1e-9);
    Ok(DiskRate {
        bytes_per_s: written as f64 / secs,
        bytes: written,
        possibly_cached: false,
        method: format!(
            "sequential 4 MiB writes of pseudo-random data, then fsync; time includes the fsync{}",
            if written < size {
                format!(" (stopped at {} by the time limit)", human_bytes(written))
            } else {
                String::new()
            }
        ),
        duration_ms: ms(start.elapsed()),
    })
}

fn disk_read(path: &Path, limit: Duration, virtualized: Option<bool>) -> std::io::Result<DiskRate> {
    use std::io::Read;
    let mut un = sys::open_uncached(path)?;
    let mut storage = vec![0u8; DISK_BLOCK + un.alignment];
    let off = storage.as_ptr().align_offset(un.alignment);
    let buf = &mut storage[off..off + DISK_BLOCK];
    let start = Instant::now();
    let mut read = 0u64;
    loop {
        let n = match un.file.read(buf) {
            Ok(n) => n,
            // Some filesystems accept O_DIRECT at open and refuse the read.
            Err(e) if read == 0 && !un.possibly_cached && un.alignment > 1 => {
                let file = std::fs::File::open(path)?;
                let dropped = sys::drop_cached_pages(&file);
                un = sys::UncachedRead {
                    file,
                    method: if dropped {
                        "buffered read after posix_fadvise(DONTNEED) (O_DIRECT read refused)"
                    } else {
                        "buffered read (O_DIRECT read refused)"
                    },
                    possibly_cached: true,
                    alignment: 1,
                };
                let _ = e;
                continue;
            }
            Err(e) => return Err(e),
        };
        if n == 0 {
            break;
        }
        read += n as u64;
        if start.elapsed() >= limit {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    let mut method = format!(
        "sequential 4 MiB reads of the file just written, {}",
        un.method
    );
    if virtualized == Some(true) {
        method.push_str("; this is a virtual machine, so the hypervisor's cache may serve reads");
    }
    Ok(DiskRate {
        bytes_per_s: read as f64 / secs,
        bytes: read,
        possibly_cached: un.possibly_cached,
        method,
        duration_ms: ms(start.elapsed()),
    })
}

// ---------------------------------------------------------------------------------------------
// Memory budget

/// How much memory the operator lets this node use: an absolute size or a share of total RAM.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemoryBudget {
    Bytes(u64),
    /// Percent of total RAM, in (0, 100].
    PercentOfTotal(f64),
}

/// A budget string that does not parse, or a budget that does not fit the machine.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BudgetError {
    #[error(
        "empty memory budget: give a size such as \"6GiB\", \"512MiB\" or a share such as \"80%\""
    )]
    Empty,
    #[error("memory budget {input:?}: {what}")]
    Malformed { input: String, what: String },
    #[error(
        "memory budget {input:?}: unit {unit:?} is ambiguous; write {unit}iB (powers of 1024) \
         or {unit}B (powers of 1000)"
    )]
    AmbiguousUnit { input: String, unit: String },
    #[error("memory budget {input:?}: a share of RAM must be more than 0% and at most 100%")]
    PercentOutOfRange { input: String },
    #[error("memory budget {input:?}: zero bytes admits no work")]
    Zero { input: String },
    #[error(
        "memory budget {} ({budget} bytes) exceeds this node's total RAM, {} ({total} bytes)",
        human_bytes(*budget),
        human_bytes(*total)
    )]
    ExceedsTotal { budget: u64, total: u64 },
    #[error("memory budget {spec}: a share of RAM needs the total RAM, which this node could not measure; give an absolute size")]
    TotalUnknown { spec: String },
}

impl MemoryBudget {
    /// Parses "6GiB", "1.5 GiB", "512MiB", "8GB", "4096" (bytes), "80%". Binary units (KiB,
    /// MiB, GiB, TiB, or Ki/Mi/Gi/Ti) are powers of 1024, decimal ones (KB, MB, GB, TB) powers
    /// of 1000; bare K/M/G/T are refused as ambiguous. Units are case-insensitive.
    pub fn parse(input: &str) -> Result<Self, BudgetError> {
        let s = input.trim();
        if s.is_empty() {
            return Err(BudgetError::Empty);
        }
        let malformed = |what: &str| BudgetError::Malformed {
            input: input.to_string(),
            what: what.to_string(),
        };
        if let Some(num) = s.strip_suffix('%') {
            let p: f64 = num
                .trim()
                .parse()
                .map_err(|_| malformed("expected a number before '%'"))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(BudgetError::PercentOutOfRange {
                    input: input.to_string(),
                });
            }
            return Ok(Self::PercentOfTotal(p));
        }
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (num, unit) = (&s[..split], s[split..].trim());
        if num.is_empty() {
            return Err(malformed("expected a number, e.g. \"6GiB\" or \"80%\""));
        }
        let mult: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kib" | "ki" => 1 << 10,
            "mib" | "mi" => 1 << 20,
            "gib" | "gi" => 1 << 30,
            "tib" | "ti" => 1 << 40,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            "k" | "m" | "g" | "t" => {
                return Err(BudgetError::AmbiguousUnit {
                    input: input.to_string(),
                    unit: unit.to_ascii_uppercase(),
                })
            }
            _ => {
                return Err(malformed(&format!(
                    "unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB or %)"
                )))
            }
        };
        let bytes = if num.contains('.') {
            let v: f64 = num.parse().map_err(|_| malformed("not a number"))?;
            let b = (v * mult as f64).floor();
            if !b.is_finite() || b >= u64::MAX as f64 {
                return Err(malformed("too large"));
            }
            b as u64
        } else {
            num.parse::<u64>()
                .ok()
                .and_then(|n| n.checked_mul(mult))
                .ok_or_else(|| malformed("too large"))?
        };
        if bytes == 0 {
            return Err(BudgetError::Zero {
                input: input.to_string(),
            });
        }
        Ok(Self::Bytes(bytes))
    }

    /// The budget in bytes on a machine with `total_ram` bytes (`None`: unknown). An absolute
    /// budget above total RAM is refused; with total RAM unknown it is taken at its word, but
    /// a percentage cannot be resolved.
    pub fn resolve(&self, total_ram: Option<u64>) -> Result<u64, BudgetError> {
        match *self {
            Self::Bytes(b) => match total_ram {
                Some(total) if b > total => Err(BudgetError::ExceedsTotal { budget: b, total }),
                _ => Ok(b),
            },
            Self::PercentOfTotal(p) => {
                let total = total_ram.ok_or_else(|| BudgetError::TotalUnknown {
                    spec: self.to_string(),
                })?;
                Ok((total as f64 * p / 100.0).floor() as u64)
            }
        }
    }
}

impl FromStr for MemoryBudget {
    type Err = BudgetError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Bytes(b) => {
                for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
                    if b % (1u64 << shift) == 0 {
                        return write!(f, "{}{unit}", b >> shift);
                    }
                }
                write!(f, "{b}B")
            }
            Self::PercentOfTotal(p) => write!(f, "{p}%"),
        }
    }
}

/// The node refuses work beyond its budget; this says by how much and against which figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BudgetRefusal {
    /// Bytes the work needs.
    pub requested: u64,
    /// The limit it was checked against; `None` when there is none to check against.
    pub limit: Option<u64>,
    /// What the limit is, in words ("memory budget \"6GiB\"", "available RAM (no budget set)").
    pub limit_source: String,
    pub total_ram: Option<u64>,
    pub available_ram: Option<u64>,
}

impl fmt::Display for BudgetRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = |n: u64| format!("{} ({n} bytes)", human_bytes(n));
        let opt = |n: Option<u64>| n.map_or_else(|| "unknown".to_string(), human_bytes);
        write!(f, "node refuses work needing {}: ", b(self.requested))?;
        match self.limit {
            Some(limit) => write!(
                f,
                "its {} is {}, {} short",
                self.limit_source,
                b(limit),
                human_bytes(self.requested.saturating_sub(limit))
            )?,
            None => write!(f, "{}", self.limit_source)?,
        }
        write!(
            f,
            " (total RAM {}, available {})",
            opt(self.total_ram),
            opt(self.available_ram)
        )
    }
}

impl std::error::Error for BudgetRefusal {}

impl Inventory {
    /// Resolves `budget` against this node's usable RAM (total, lowered by a cgroup limit) and
    /// records it; returns the budget in bytes.
    pub fn set_budget(&mut self, budget: &MemoryBudget) -> Result<u64, BudgetError> {
        let bytes = budget.resolve(self.memory.usable_total_bytes())?;
        self.memory_budget = Some(ResolvedBudget {
            bytes,
            spec: budget.to_string(),
        });
        Ok(bytes)
    }

    /// [`Inventory::set_budget`], by value.
    pub fn with_budget(mut self, budget: &MemoryBudget) -> Result<Self, BudgetError> {
        self.set_budget(budget)?;
        Ok(self)
    }

    /// Whether this node takes on work needing `bytes` of memory. The limit is the memory budget
    /// when one is set; otherwise the RAM available when measured. With neither known, the
    /// node refuses: it cannot promise what it cannot measure.
    pub fn accepts(&self, bytes: u64) -> Result<(), BudgetRefusal> {
        let (limit, limit_source) = match (&self.memory_budget, self.memory.available_bytes) {
            (Some(b), _) => (Some(b.bytes), format!("memory budget \"{}\"", b.spec)),
            (None, Some(avail)) => (Some(avail), "available RAM (no budget set)".to_string()),
            (None, None) => (
                None,
                "no memory budget is set and available RAM is unknown".to_string(),
            ),
        };
        match limit {
            Some(limit) if bytes <= limit => Ok(()),
            _ => Err(BudgetRefusal {
                requested: bytes,
                limit,
                limit_source,
                total_ram: self.memory.total_bytes,
                available_ram: self.memory.available_bytes,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        let p = |s| MemoryBudget::parse(s).unwrap();
        assert_eq!(p("6GiB"), MemoryBudget::Bytes(6 << 30));
        assert_eq!(p("6 GiB"), MemoryBudget::Bytes(6 << 30));
        assert_eq!(p("6gib"), MemoryBudget::Bytes(6 << 30));
        assert_eq!(p("6Gi"), MemoryBudget::Bytes(6 << 30));
        assert_eq!(p("512MiB"), MemoryBudget::Bytes(512 << 20));
        assert_eq!(p("1.5GiB"), MemoryBudget::Bytes(3 << 29));
        assert_eq!(p("8GB"), MemoryBudget::Bytes(8_000_000_000));
        assert_eq!(p("2TiB"), MemoryBudget::Bytes(2 << 40));
        assert_eq!(p("4096"), MemoryBudget::Bytes(4096));
        assert_eq!(p("4096B"), MemoryBudget::Bytes(4096));
        assert_eq!(p(" 80% "), MemoryBudget::PercentOfTotal(80.0));
        assert_eq!(p("12.5%"), MemoryBudget::PercentOfTotal(12.5));
        assert_eq!("6GiB".parse::<MemoryBudget>().unwrap(), p("6GiB"));
    }

    #[test]
    fn display_round_trips() {
        for s in ["6GiB", "512MiB", "80%", "4097B", "3KiB"] {
            let b = MemoryBudget::parse(s).unwrap();
            assert_eq!(b.to_string(), s);
            assert_eq!(MemoryBudget::parse(&b.to_string()).unwrap(), b);
        }
    }

    #[test]
    fn rejects_bad_strings() {
        for s in [
            "",
            "  ",
            "GiB",
            "six GiB",
            "6 GiBs",
            "-1GiB",
            "6XB",
            "1.2.3GiB",
            "0",
            "0GiB",
            "0%",
            "101%",
            "-5%",
            "abc%",
            "%",
            "99999999999999999999",
            "20000000TiB",
            "6G",
            "6 m",
        ] {
            assert!(MemoryBudget::parse(s).is_err(), "{s:?} should not parse");
        }
        assert!(matches!(
            MemoryBudget::parse("6G"),
            Err(BudgetError::AmbiguousUnit { .. })
        ));
        let msg = MemoryBudget::parse("6G").unwrap_err().to_string();
        assert!(msg.contains("GiB") && msg.contains("GB"), "{msg}");
    }

    #[test]
    fn resolves_against_total() {
        let total = Some(16u64 << 30);
        assert_eq!(MemoryBudget::Bytes(6 << 30).resolve(total), Ok(6 << 30));
        assert_eq!(
            MemoryBudget::PercentOfTotal(50.0).resolve(total),
            Ok(8 << 30)
        );
        assert_eq!(
            MemoryBudget::PercentOfTotal(100.0).resolve(total),
            Ok(16 << 30)
        );
        let err = MemoryBudget::Bytes(32 << 30).resolve(total).unwrap_err();
        assert_eq!(
            err,
            BudgetError::ExceedsTotal {
                budget: 32 << 30,
                total: 16 << 30
            }
        );
        assert!(err.to_string().contains("32.00 GiB"), "{err}");
        assert!(err.to_string().contains("16.00 GiB"), "{err}");
        // Unknown total: an absolute budget is taken at its word, a share cannot be resolved.
        assert_eq!(MemoryBudget::Bytes(6 << 30).resolve(None), Ok(6 << 30));
        assert!(matches!(
            MemoryBudget::PercentOfTotal(80.0).resolve(None),
            Err(BudgetError::TotalUnknown { .. })
        ));
    }

    #[test]
    fn meminfo_parsing() {
        let text = "MemTotal:       24683652 kB\nMemFree:        23113088 kB\nMemAvailable:   24265756 kB\n";
        assert_eq!(
            parse_meminfo(text),
            (Some(24683652 * 1024), Some(24265756 * 1024))
        );
        assert_eq!(parse_meminfo("garbage"), (None, None));
    }

    #[test]
    fn cpuinfo_fields() {
        let text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 hypervisor\n";
        assert_eq!(cpuinfo_field(text, "model name"), Some("AMD EPYC"));
        assert_eq!(
            cpuinfo_flags(text).unwrap(),
            vec!["fpu", "avx2", "hypervisor"]
        );
        assert_eq!(cpuinfo_field(text, "Hardware"), None);
    }
}
