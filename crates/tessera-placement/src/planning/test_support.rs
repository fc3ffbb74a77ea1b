//! Test helpers shared by the planning tests: a node's measured inventory and a measured link.

use std::time::Duration;
use tessera_host::inventory::{
    ComputeRate, CpuInfo, HostInfo, MemoryBandwidth, MemoryInfo, ResolvedBudget,
};
use tessera_host::Inventory;
use tessera_net::LinkMeasurement;

pub(super) const GIB: u64 = 1 << 30;

pub(super) fn inv(host: &str, at_ms: u64, threads: usize, budget: Option<u64>) -> Inventory {
    Inventory {
        schema: 1,
        measured_at_unix_ms: at_ms,
        probe_duration_ms: 1000.0,
        host: HostInfo {
            hostname: Some(host.into()),
            os: "linux".into(),
            arch: "x86_64".into(),
            virtualized: None,
        },
        memory: MemoryInfo {
            total_bytes: Some(16 * GIB),
            available_bytes: Some(12 * GIB),
            cgroup_limit_bytes: None,
            method: "/proc/meminfo".into(),
        },
        cpu: CpuInfo {
            model_name: Some("cpu".into()),
            logical_cores: Some(4),
            usable_cores: Some(4),
            features: vec![],
            features_checked: vec![],
            method: "cpuinfo".into(),
        },
        memory_bandwidth: Some(MemoryBandwidth {
            copy_single_thread: 10e9,
            read_single_thread: 8e9,
            copy_all_threads: 20e9,
            read_all_threads: 16e9,
            threads,
            buffer_bytes: 256 << 20,
            passes: 3,
            method: "memcpy and sum".into(),
            duration_ms: 300.0,
        }),
        compute: Some(ComputeRate {
            ops_per_s: 40e9,
            single_thread_ops_per_s: Some(12e9),
            threads: 4,
            source: "engine q8_0 matmul".into(),
            detail: "1024x1024".into(),
        }),
        disk: None,
        gpus: vec![],
        gpu_backends: vec![],
        memory_budget: budget.map(|b| ResolvedBudget {
            bytes: b,
            spec: format!("{b}"),
        }),
        probes: vec![],
    }
}

pub(super) fn link(ms: u64, mb_s: f64, at_ms: u64) -> LinkMeasurement {
    LinkMeasurement {
        rtt_min: Duration::from_millis(ms),
        rtt_median: Duration::from_millis(ms),
        bytes_per_s: mb_s * 1e6,
        measured_at_unix_ms: at_ms,
    }
}
