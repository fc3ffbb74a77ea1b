//! RAM, CPU: what the operating system reports about this host.
//!
//! RAM size and availability come from `/proc/meminfo` (MemTotal, MemAvailable), lowered by a
//! cgroup v2 `memory.max` limit where one is set ([`MemoryInfo::usable_total_bytes`]); on macOS
//! from `sysctl hw.memsize`. The CPU model comes from `/proc/cpuinfo` (on aarch64 kernels that
//! name no model, the board's device-tree model, then the raw ids), or `sysctl
//! machdep.cpu.brand_string` on macOS; the core counts from `sysconf` and
//! `std::thread::available_parallelism` (affinity and cgroup quota); the CPU features from
//! runtime CPUID/HWCAP detection, listing the features looked for so that an absent one is
//! known absent. These figures are read, not timed.

use std::path::Path;

use super::{CpuInfo, MemoryInfo};
use crate::sys;

pub(super) fn read_cpuinfo() -> Option<String> {
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

pub(super) fn cpuinfo_flags(cpuinfo: &str) -> Option<Vec<String>> {
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

pub(super) fn memory_info() -> MemoryInfo {
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

pub(super) fn cpu_info(cpuinfo: Option<&str>) -> CpuInfo {
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

#[cfg(test)]
mod tests {
    use super::*;

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
