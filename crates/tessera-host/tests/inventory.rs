//! The node measures itself: plausible figures on this machine, each labelled with its method,
//! and a budget the node enforces.

mod common;

use std::time::Duration;

use common::TempDir;
use tessera_host::inventory::{ProbeStatus, FALLBACK_COMPUTE_SOURCE};
use tessera_host::{measure, ComputeRate, Inventory, MemoryBudget, ProbeOptions};

#[test]
fn measures_this_machine() {
    let dir = TempDir::new("inventory");
    let opts = ProbeOptions {
        disk_dir: Some(dir.path().to_owned()),
        ..ProbeOptions::default()
    };
    let inv = measure(&opts);
    println!("{}", serde_json::to_string_pretty(&inv).unwrap());

    let mem = &inv.memory;
    assert!(mem.total_bytes.unwrap() > 0);
    assert!(mem.available_bytes.unwrap() > 0);
    assert!(mem.available_bytes <= mem.total_bytes);
    assert!(!mem.method.is_empty());

    let cpu = &inv.cpu;
    assert!(cpu.logical_cores.unwrap() >= 1);
    assert!(cpu.usable_cores.unwrap() >= 1);
    assert!(cpu.model_name.as_deref().is_some_and(|n| !n.is_empty()));
    assert!(cpu
        .features
        .iter()
        .all(|f| cpu.features_checked.contains(f)));
    #[cfg(target_arch = "x86_64")]
    assert!(cpu.features_checked.iter().any(|f| f == "avx2"));

    let bw = inv
        .memory_bandwidth
        .as_ref()
        .expect("memory bandwidth measured");
    // Figures, not speeds: how fast this machine is is not the test's business (a busy CI
    // core may be slow); that each figure was measured, is a rate, and came from bounded work is.
    for (what, v) in [
        ("copy 1T", bw.copy_single_thread),
        ("read 1T", bw.read_single_thread),
        ("copy all", bw.copy_all_threads),
        ("read all", bw.read_all_threads),
    ] {
        assert!(v.is_finite() && v > 0.0, "memory {what}: {v} B/s");
    }
    let defaults = ProbeOptions::default();
    assert_eq!(bw.buffer_bytes, defaults.memory_buffer_bytes as u64);
    assert!(
        (1..=defaults.memory_reps).contains(&bw.passes),
        "{} passes, at most {} asked for",
        bw.passes,
        defaults.memory_reps
    );
    assert!(bw.threads >= 1 && bw.threads <= cpu.usable_cores.unwrap());

    let compute = inv.compute.as_ref().unwrap();
    assert_eq!(compute.source, FALLBACK_COMPUTE_SOURCE);
    assert!(
        compute.ops_per_s.is_finite() && compute.ops_per_s > 0.0,
        "{compute:?}"
    );
    let one = compute.single_thread_ops_per_s.unwrap();
    assert!(one.is_finite() && one > 0.0, "{compute:?}");

    let disk = inv.disk.as_ref().unwrap();
    assert!(disk.free_bytes.unwrap() > 0);
    assert!(disk.total_bytes.unwrap() >= disk.free_bytes.unwrap());
    let read = disk.read.as_ref().expect("disk read measured");
    let write = disk.write.as_ref().expect("disk write measured");
    // Bounded work: the write stops at the test size (whole 4 MiB blocks), the read reads
    // back no more than was written; each rate is its bytes over its time (the duration
    // reported is read a moment after the rate's own clock, and the write's time leaves out
    // generating the data, so each rate is at least bytes / duration).
    assert!(write.bytes > 0 && write.bytes <= defaults.disk_test_bytes.next_multiple_of(4 << 20));
    assert!(
        read.bytes > 0 && read.bytes <= write.bytes,
        "{read:?} {write:?}"
    );
    assert!(!read.method.is_empty() && !write.method.is_empty());
    let rate = |r: &tessera_host::inventory::DiskRate| r.bytes as f64 / (r.duration_ms / 1e3);
    for r in [read, write] {
        assert!(r.bytes_per_s.is_finite(), "{r:?}");
        assert!(
            r.bytes_per_s >= rate(r) * 0.999,
            "rate is not bytes over time: {r:?}"
        );
    }
    // The probe cleans up after itself.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    assert!(inv.gpus.is_empty() && inv.gpu_backends.is_empty());
    assert!(inv.measured_at_unix_ms > 1_600_000_000_000);
    assert!(
        inv.probes.iter().all(|p| p.status == ProbeStatus::Ok),
        "{:?}",
        inv.probes
    );
    // JSON round trip (floats may lose their last digit in serde_json's default parser).
    let json = serde_json::to_string(&inv).unwrap();
    let back: Inventory = serde_json::from_str(&json).unwrap();
    assert_eq!(
        (&back.host, &back.memory, &back.cpu),
        (&inv.host, &inv.memory, &inv.cpu)
    );
    assert_eq!(back.probes.len(), inv.probes.len());
}

fn quick() -> ProbeOptions {
    ProbeOptions {
        memory_buffer_bytes: 8 << 20,
        memory_reps: 1,
        probe_time_limit: Duration::from_millis(20),
        ..ProbeOptions::default()
    }
}

#[test]
fn the_engine_plugs_in_its_own_compute_probe() {
    let opts = ProbeOptions {
        compute_probe: Some(Box::new(|| ComputeRate {
            ops_per_s: 1.5e11,
            single_thread_ops_per_s: None,
            threads: 2,
            source: "engine q4_0 matmul".into(),
            detail: "4096×4096 q4_0 × f32 vector".into(),
        })),
        ..quick()
    };
    let inv = measure(&opts);
    let c = inv.compute.unwrap();
    assert_eq!(c.source, "engine q4_0 matmul");
    assert_eq!(c.ops_per_s, 1.5e11);
    assert!(inv.disk.is_none(), "no disk_dir, no disk probe");
    assert!(inv
        .probes
        .iter()
        .any(|p| p.name == "disk" && p.status == ProbeStatus::Skipped));

    // A probe that panics leaves the figure unknown, not invented.
    let opts = ProbeOptions {
        compute_probe: Some(Box::new(|| panic!("kernel not built for this CPU"))),
        ..quick()
    };
    let inv = measure(&opts);
    assert!(inv.compute.is_none());
    assert!(inv
        .probes
        .iter()
        .any(|p| p.name.starts_with("compute") && p.status == ProbeStatus::Failed));
}

/// An inventory with known memory figures, for budget tests.
fn node(total: Option<u64>, available: Option<u64>) -> Inventory {
    let mut inv = measure(&quick());
    inv.memory.total_bytes = total;
    inv.memory.available_bytes = available;
    inv.memory.cgroup_limit_bytes = None;
    inv
}

#[test]
fn the_node_refuses_work_beyond_its_budget() {
    let mut inv = node(Some(16 << 30), Some(12 << 30));
    assert_eq!(inv.set_budget(&"6GiB".parse().unwrap()), Ok(6 << 30));
    assert!(inv.accepts(5 << 30).is_ok());
    assert!(inv.accepts(6 << 30).is_ok());
    let refusal = inv.accepts(7 << 30).unwrap_err();
    assert_eq!(refusal.requested, 7 << 30);
    assert_eq!(refusal.limit, Some(6 << 30));
    let msg = refusal.to_string();
    println!("{msg}");
    for needle in [
        "7.00 GiB",
        "7516192768 bytes",
        "memory budget \"6GiB\"",
        "6.00 GiB",
        "1.00 GiB short",
        "total RAM 16.00 GiB",
        "available 12.00 GiB",
    ] {
        assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
    }

    // A share of RAM resolves against total RAM.
    let inv2 = node(Some(16 << 30), Some(12 << 30))
        .with_budget(&MemoryBudget::parse("50%").unwrap())
        .unwrap();
    assert_eq!(inv2.memory_budget.as_ref().unwrap().bytes, 8 << 30);
    assert!(inv2.accepts(9 << 30).is_err());

    // A budget larger than the machine is refused when set.
    let err = node(Some(16 << 30), None)
        .with_budget(&MemoryBudget::parse("32GiB").unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("exceeds"), "{err}");

    // No budget: available RAM is the limit. Neither known: refuse, saying why.
    let inv3 = node(Some(16 << 30), Some(12 << 30));
    assert!(inv3.accepts(11 << 30).is_ok());
    assert!(inv3
        .accepts(13 << 30)
        .unwrap_err()
        .to_string()
        .contains("available RAM (no budget set)"));
    let inv4 = node(None, None);
    let msg = inv4.accepts(1).unwrap_err().to_string();
    assert!(msg.contains("unknown"), "{msg}");
    assert!(node(None, None)
        .with_budget(&MemoryBudget::parse("80%").unwrap())
        .is_err());
    // An absolute budget on a machine whose RAM is unknown is taken at its word.
    let inv5 = node(None, None)
        .with_budget(&MemoryBudget::parse("2GiB").unwrap())
        .unwrap();
    assert!(inv5.accepts(1 << 30).is_ok());
}
