//! A small library of hardware and link profiles, so `tessera plan` can answer "what if" with no node
//! running. Every figure is an **estimate** derived from the vendor specification or typical public
//! measurements named in `source`; a live node's measured inventory replaces it.

use crate::units::{Bytes, BytesPerSec, FlopsPerSec};
use serde::Serialize;

/// Estimated figures for a kind of machine.
#[derive(Debug, Clone, Serialize)]
pub struct HardwareProfile {
    pub name: &'static str,
    pub description: &'static str,
    pub ram: Bytes,
    /// Bandwidth of the RAM tier as a compute unit sees it.
    pub mem_bandwidth: BytesPerSec,
    /// The unit that computes on RAM-resident weights (the CPU, or the GPU on unified memory).
    pub ram_compute: FlopsPerSec,
    pub vram: Bytes,
    pub vram_bandwidth: BytesPerSec,
    pub gpu_compute: FlopsPerSec,
    pub disk: Bytes,
    pub disk_bandwidth: BytesPerSec,
    /// A default contributor budget where the platform caps usable memory.
    pub memory_budget: Option<Bytes>,
    pub source: &'static str,
}

/// Estimated figures for a kind of link.
#[derive(Debug, Clone, Serialize)]
pub struct LinkProfile {
    pub name: &'static str,
    pub description: &'static str,
    pub rtt_s: f64,
    pub bandwidth: BytesPerSec,
    pub source: &'static str,
}

const GB: f64 = 1e9;
const TF: f64 = 1e12;

static HARDWARE: [HardwareProfile; 7] = [
    HardwareProfile {
        name: "rk3588-8gb-nvme",
        description: "RK3588 board (Rock 5B / Orange Pi 5 class), 8 GB LPDDR4X, NVMe on PCIe 3.0 x4",
        ram: Bytes::gib(8),
        mem_bandwidth: BytesPerSec(15.0 * GB),
        ram_compute: FlopsPerSec(0.1 * TF),
        vram: Bytes::ZERO,
        vram_bandwidth: BytesPerSec(0.0),
        gpu_compute: FlopsPerSec(0.0),
        disk: Bytes::gib(476),
        disk_bandwidth: BytesPerSec(1.5 * GB),
        memory_budget: None,
        source: "estimate: RK3588 datasheet (64-bit LPDDR4X-4224, 33.8 GB/s peak; PCIe 3.0 x4, 3.9 GB/s); \
                 public STREAM/memcpy runs on RK3588 boards report 10-20 GB/s; 4xA76+4xA55 NEON peak ~0.2 TFLOPS \
                 fp32, halved for quantised matmul; NVMe large-block reads ~1.5 GB/s on these boards",
    },
    HardwareProfile {
        name: "rtx3060-12gb",
        description: "Desktop with an RTX 3060 12 GB, 32 GB DDR4-3200 dual channel, NVMe",
        ram: Bytes::gib(32),
        mem_bandwidth: BytesPerSec(35.0 * GB),
        ram_compute: FlopsPerSec(0.5 * TF),
        vram: Bytes::gib(12),
        vram_bandwidth: BytesPerSec(360.0 * GB),
        gpu_compute: FlopsPerSec(12.7 * TF),
        disk: Bytes::gib(931),
        disk_bandwidth: BytesPerSec(3.0 * GB),
        memory_budget: None,
        source: "estimate: NVIDIA RTX 3060 specification (12 GB GDDR6, 192-bit, 360 GB/s; 12.7 TFLOPS fp32); \
                 DDR4-3200 dual channel 51.2 GB/s peak, ~70% achievable; 8-core AVX2 CPU ~0.5 TFLOPS",
    },
    HardwareProfile {
        name: "rtx4060ti-16gb",
        description: "Desktop with an RTX 4060 Ti 16 GB, 32 GB DDR4-3200 dual channel, NVMe",
        ram: Bytes::gib(32),
        mem_bandwidth: BytesPerSec(35.0 * GB),
        ram_compute: FlopsPerSec(0.5 * TF),
        vram: Bytes::gib(16),
        vram_bandwidth: BytesPerSec(288.0 * GB),
        gpu_compute: FlopsPerSec(22.1 * TF),
        disk: Bytes::gib(931),
        disk_bandwidth: BytesPerSec(3.0 * GB),
        memory_budget: None,
        source: "estimate: NVIDIA RTX 4060 Ti 16 GB specification (128-bit GDDR6, 288 GB/s; 22.1 TFLOPS fp32); \
                 host as rtx3060-12gb",
    },
    HardwareProfile {
        name: "gtx1650ti-4gb-laptop",
        description: "Laptop with a GTX 1650 Ti 4 GB, 16 GB DDR4 dual channel, NVMe",
        ram: Bytes::gib(16),
        mem_bandwidth: BytesPerSec(30.0 * GB),
        ram_compute: FlopsPerSec(0.3 * TF),
        vram: Bytes::gib(4),
        vram_bandwidth: BytesPerSec(192.0 * GB),
        gpu_compute: FlopsPerSec(3.0 * TF),
        disk: Bytes::gib(476),
        disk_bandwidth: BytesPerSec(2.0 * GB),
        memory_budget: None,
        source: "estimate: NVIDIA GTX 1650 Ti mobile specification (4 GB GDDR6, 128-bit at 12 Gbps = 192 GB/s; \
                 1024 CUDA cores at ~1.5 GHz boost = ~3.0 TFLOPS fp32); laptop DDR4 ~30 GB/s achievable",
    },
    HardwareProfile {
        name: "apple-m2-16gb",
        description: "Apple M2 with 16 GB unified memory (GPU computes on the RAM tier)",
        ram: Bytes::gib(16),
        mem_bandwidth: BytesPerSec(100.0 * GB),
        ram_compute: FlopsPerSec(3.6 * TF),
        vram: Bytes::ZERO,
        vram_bandwidth: BytesPerSec(0.0),
        gpu_compute: FlopsPerSec(0.0),
        disk: Bytes::gib(476),
        disk_bandwidth: BytesPerSec(3.0 * GB),
        memory_budget: Some(Bytes::gib(11)),
        source: "estimate: Apple M2 announcement (100 GB/s unified memory bandwidth; 10-core GPU 3.6 TFLOPS); \
                 budget 11 GiB because macOS caps the GPU working set near 2/3-3/4 of unified memory",
    },
    HardwareProfile {
        name: "cpu-server-64gb",
        description: "CPU server, 64 GB DDR4-2666 in 4 channels, 16 cores AVX2, NVMe",
        ram: Bytes::gib(64),
        mem_bandwidth: BytesPerSec(60.0 * GB),
        ram_compute: FlopsPerSec(0.8 * TF),
        vram: Bytes::ZERO,
        vram_bandwidth: BytesPerSec(0.0),
        gpu_compute: FlopsPerSec(0.0),
        disk: Bytes::gib(1863),
        disk_bandwidth: BytesPerSec(2.0 * GB),
        memory_budget: None,
        source: "estimate: 4 x DDR4-2666 = 85 GB/s peak, ~70% achievable; 16 cores x 2.5 GHz x 32 fp32 FLOP/cycle \
                 (AVX2 FMA) = 1.28 TFLOPS peak, ~60% achievable",
    },
    HardwareProfile {
        name: "laptop-16gb",
        description: "CPU-only laptop, 16 GB DDR4 dual channel, NVMe",
        ram: Bytes::gib(16),
        mem_bandwidth: BytesPerSec(30.0 * GB),
        ram_compute: FlopsPerSec(0.3 * TF),
        vram: Bytes::ZERO,
        vram_bandwidth: BytesPerSec(0.0),
        gpu_compute: FlopsPerSec(0.0),
        disk: Bytes::gib(476),
        disk_bandwidth: BytesPerSec(2.0 * GB),
        memory_budget: None,
        source: "estimate: DDR4-3200 dual channel 51.2 GB/s peak, ~60% achievable in a laptop; \
                 4-8 core AVX2 mobile CPU ~0.3 TFLOPS",
    },
];

static LINKS: [LinkProfile; 8] = [
    LinkProfile {
        name: "1gbe",
        description: "switched 1 Gb Ethernet",
        rtt_s: 0.3e-3,
        bandwidth: BytesPerSec(117.5e6),
        source:
            "estimate: 1000BASE-T line rate, ~941 Mbit/s TCP goodput; LAN ping typically 0.1-0.5 ms",
    },
    LinkProfile {
        name: "2.5gbe",
        description: "switched 2.5 Gb Ethernet",
        rtt_s: 0.25e-3,
        bandwidth: BytesPerSec(294e6),
        source: "estimate: 2.5GBASE-T line rate less ~6% TCP/IP overhead",
    },
    LinkProfile {
        name: "10gbe",
        description: "10 Gb Ethernet",
        rtt_s: 0.1e-3,
        bandwidth: BytesPerSec(1.17e9),
        source: "estimate: 10GBASE-T line rate less ~6% TCP/IP overhead; ping ~0.1 ms",
    },
    LinkProfile {
        name: "wifi",
        description: "Wi-Fi 5 (802.11ac) to a LAN",
        rtt_s: 4e-3,
        bandwidth: BytesPerSec(37.5e6),
        source: "estimate: typical 802.11ac client goodput ~300 Mbit/s; ping 2-10 ms with jitter",
    },
    LinkProfile {
        name: "wan-40ms",
        description: "wide-area link, 40 ms round trip",
        rtt_s: 40e-3,
        bandwidth: BytesPerSec(6.25e6),
        source: "estimate: a 40 ms round trip between sites on 50 Mbit/s consumer uplinks",
    },
    LinkProfile {
        name: "pcie-gen2-x1",
        description: "a GPU on a PCIe 2.0 x1 slot or riser, as a hop between two GPUs in one host",
        rtt_s: 0.05e-3,
        bandwidth: BytesPerSec(500e6),
        source: "estimate: PCIe 2.0 5 GT/s with 8b/10b = 500 MB/s per lane per direction; \
                 ~50 us per synchronised hand-off between devices",
    },
    LinkProfile {
        name: "pcie-gen3-x16",
        description: "a GPU on a PCIe 3.0 x16 slot, as a hop between two GPUs in one host",
        rtt_s: 0.02e-3,
        bandwidth: BytesPerSec(15.75e9),
        source: "estimate: PCIe 3.0 8 GT/s with 128b/130b = 985 MB/s per lane, x16",
    },
    LinkProfile {
        name: "loopback",
        description: "processes on one host over TCP loopback",
        rtt_s: 0.05e-3,
        bandwidth: BytesPerSec(5e9),
        source: "estimate: Linux TCP loopback ping-pong ~20-60 us, several GB/s for large messages",
    },
];

/// The hardware profile library.
pub fn hardware_profiles() -> &'static [HardwareProfile] {
    &HARDWARE
}

/// The link profile library.
pub fn link_profiles() -> &'static [LinkProfile] {
    &LINKS
}

/// A hardware profile by name (case-insensitive).
pub fn hardware(name: &str) -> Option<&'static HardwareProfile> {
    HARDWARE.iter().find(|p| p.name.eq_ignore_ascii_case(name))
}

/// A link profile by name (case-insensitive).
pub fn link(name: &str) -> Option<&'static LinkProfile> {
    LINKS.iter().find(|p| p.name.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_is_labelled_an_estimate_with_a_source() {
        for p in hardware_profiles() {
            assert!(p.source.starts_with("estimate:"), "{}", p.name);
            assert!(p.ram.0 > 0 && p.mem_bandwidth.0 > 0.0 && p.ram_compute.0 > 0.0);
            assert_eq!(p.vram.0 > 0, p.gpu_compute.0 > 0.0, "{}", p.name);
        }
        for l in link_profiles() {
            assert!(l.source.starts_with("estimate:"), "{}", l.name);
            assert!(l.rtt_s > 0.0 && l.bandwidth.0 > 0.0);
        }
        assert!(hardware("RTX3060-12GB").is_some());
        assert!(link("wan-40ms").is_some());
    }
}
