//! Inventory and links → resource graph: every node's measured RAM, memory bandwidth, compute,
//! disk and budget, and the measured links between nodes, each figure with when and how it was
//! measured (how each inventory figure maps is described in the [`crate::planning`] docs).

use std::collections::BTreeMap;

use tessera_host::Inventory;
use tessera_net::LinkMeasurement;
use tessera_plan::{
    Bytes, BytesPerSec, FlopsPerSec, LinkSpec, Node, Policy, ResourceGraph, Source, Tier,
    RUNTIME_OVERHEAD_RAM,
};

/// The share of the memory read test's bandwidth the engine's batch-1 decode streams weights at.
///
/// The read test is a tight summing loop over a large buffer; a decode step streams every weight
/// once through the quantized matvec, interleaving dequantisation with the loads, and reaches
/// less. On the loopback test host (2 vCPUs, `bench-qwen3-dense-q8_0`, 480 MiB) decode streamed
/// 0.51 to 0.69 of the read test's figure over five runs; planning with the raw figure predicted
/// up to twice the measured tokens/s. The node's compute probe (an 8-token Q8_0 matmul) is not
/// the binding term at batch 1 for models larger than the caches, so it is used as measured.
/// Calibration replaces both with what the executed plan measured.
pub const DECODE_STREAM_EFFICIENCY: f64 = 0.6;

/// A measured link between two nodes of the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredLink {
    pub a: String,
    pub b: String,
    pub link: LinkMeasurement,
    /// How it was obtained, for the evidence table.
    pub method: String,
}

/// Node-to-node links composed from the coordinator's measured links to each node, when the
/// nodes have not measured each other yet: the round trip is the larger of the two, the
/// bandwidth the smaller (the evidence says so).
pub fn links_via_coordinator(links: &[(&str, LinkMeasurement)]) -> Vec<MeasuredLink> {
    let mut out = Vec::new();
    for (i, (a, la)) in links.iter().enumerate() {
        for (b, lb) in &links[i + 1..] {
            out.push(MeasuredLink {
                a: (*a).to_string(),
                b: (*b).to_string(),
                link: LinkMeasurement {
                    rtt_min: la.rtt_min.max(lb.rtt_min),
                    rtt_median: la.rtt_median.max(lb.rtt_median),
                    bytes_per_s: la.bytes_per_s.min(lb.bytes_per_s),
                    measured_at_unix_ms: la.measured_at_unix_ms.min(lb.measured_at_unix_ms),
                },
                method: format!(
                    "composed from the coordinator's links to {a} and {b} (larger fastest round \
                     trip, smaller bulk rate)"
                ),
            });
        }
    }
    out
}

/// A link one node measured to another ([`node_links`]): from, to, the measurement.
pub type PeerMeasurement<'a> = (&'a str, &'a str, LinkMeasurement);

/// Node-to-node links: where the nodes measured each other (`measured`, either direction or
/// both), that, taking the larger round trip and the smaller bulk rate of the two directions;
/// else composed from the coordinator's links to each ([`links_via_coordinator`]). The path
/// between two nodes is what a plan's hops cross; the coordinator's links only bound it when
/// the coordinator sits between them.
pub fn node_links(
    coordinator: &[(&str, LinkMeasurement)],
    measured: &[PeerMeasurement<'_>],
) -> Vec<MeasuredLink> {
    let between = |a: &str, b: &str| -> Vec<LinkMeasurement> {
        measured
            .iter()
            .filter(|(x, y, _)| (*x == a && *y == b) || (*x == b && *y == a))
            .map(|(_, _, l)| *l)
            .collect()
    };
    links_via_coordinator(coordinator)
        .into_iter()
        .map(|composed| {
            let ls = between(&composed.a, &composed.b);
            let Some(first) = ls.first().copied() else {
                return composed;
            };
            let link = ls.iter().skip(1).fold(first, |acc, l| LinkMeasurement {
                rtt_min: acc.rtt_min.max(l.rtt_min),
                rtt_median: acc.rtt_median.max(l.rtt_median),
                bytes_per_s: acc.bytes_per_s.min(l.bytes_per_s),
                measured_at_unix_ms: acc.measured_at_unix_ms.min(l.measured_at_unix_ms),
            });
            let method = if ls.len() > 1 {
                format!(
                    "measured between {} and {} by both (larger round trip, smaller bulk rate)",
                    composed.a, composed.b
                )
            } else {
                format!(
                    "measured between {} and {} by one of them",
                    composed.a, composed.b
                )
            };
            MeasuredLink {
                link,
                method,
                ..composed
            }
        })
        .collect()
}

fn host_key(inv: &Inventory) -> Option<(String, String, u64)> {
    Some((
        inv.host.hostname.clone()?,
        inv.cpu.model_name.clone().unwrap_or_default(),
        inv.memory.total_bytes?,
    ))
}

fn measured(at_ms: u64, method: impl Into<String>) -> Source {
    Source::Measured {
        at_unix_s: at_ms / 1000,
        method: method.into(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The node's memory read bandwidth and compute rate, as measured by its own probes.
fn node_rates(inv: &Inventory) -> Option<(f64, f64)> {
    let bw = inv.memory_bandwidth.as_ref()?;
    let comp = inv.compute.as_ref()?;
    let threads = node_threads(inv).unwrap_or(comp.threads).max(1);
    let rate = match comp.single_thread_ops_per_s {
        Some(single) if threads < comp.threads => (single * threads as f64).min(comp.ops_per_s),
        _ => comp.ops_per_s,
    };
    Some((bw.read_all_threads, rate))
}

/// The node's compute threads: those its memory test ran with (the agent's `--threads`).
fn node_threads(inv: &Inventory) -> Option<usize> {
    inv.memory_bandwidth
        .as_ref()
        .map(|b| b.threads)
        .or(inv.cpu.usable_cores)
}

/// Builds the resource graph from the nodes' inventories and the measured links. A node whose
/// RAM, memory bandwidth or compute was not measured is left out (with an `excluded` evidence
/// row saying why): unknown is not a default. Pairs with no measured link are unreachable.
pub fn resource_graph(
    nodes: &[(&str, &Inventory)],
    links: &[MeasuredLink],
    policy: &Policy,
) -> ResourceGraph {
    let mut g = ResourceGraph {
        policy: policy.clone(),
        ..ResourceGraph::default()
    };
    let mut hosts: BTreeMap<(String, String, u64), Vec<&str>> = BTreeMap::new();
    for (name, inv) in nodes {
        if let Some(k) = host_key(inv) {
            hosts.entry(k).or_default().push(name);
        }
    }
    for (name, inv) in nodes {
        let subject = format!("node {name}");
        let at = inv.measured_at_unix_ms;
        let (Some(total), Some(bw), Some(comp)) = (
            inv.memory.usable_total_bytes(),
            inv.memory_bandwidth.as_ref(),
            inv.compute.as_ref(),
        ) else {
            g.set_evidence(
                &subject,
                "excluded",
                "RAM, memory bandwidth or compute was not measured".into(),
                measured(at, "inventory"),
            );
            continue;
        };
        let peers: Vec<&str> = host_key(inv)
            .and_then(|k| hosts.get(&k))
            .map(|v| v.iter().copied().filter(|n| n != name).collect())
            .unwrap_or_default();
        let share = peers.len() as u64 + 1;
        let threads = node_threads(inv).unwrap_or(comp.threads).max(1);
        let (own_bw, own_rate) = node_rates(inv).unwrap_or((bw.read_all_threads, comp.ops_per_s));
        // Processes on one host run on the same memory and cores: one machine, whose figures are
        // the median of what its processes measured (each probe alone is noisy).
        let (host_bw, rate) = if share > 1 {
            let group: Vec<(f64, f64)> = nodes
                .iter()
                .filter(|(n, _)| n == name || peers.contains(n))
                .filter_map(|(_, i)| node_rates(i))
                .collect();
            (
                median(group.iter().map(|g| g.0).collect()),
                median(group.iter().map(|g| g.1).collect()),
            )
        } else {
            (own_bw, own_rate)
        };
        let limit = inv
            .memory_budget
            .as_ref()
            .map(|b| b.bytes)
            .or(inv.memory.available_bytes);
        let disk = inv.disk.as_ref().and_then(|d| {
            let r = d.read.as_ref()?;
            Some((d, r, d.free_bytes?))
        });
        let node = Node {
            name: (*name).to_string(),
            profile: None,
            vram: None,
            gpu_compute: FlopsPerSec(0.0),
            ram: Tier {
                capacity: Bytes(total / share),
                bandwidth: BytesPerSec(host_bw * DECODE_STREAM_EFFICIENCY),
            },
            ram_compute: FlopsPerSec(rate),
            disk: disk.map(|(_, r, free)| Tier {
                capacity: Bytes(free / share),
                bandwidth: BytesPerSec(r.bytes_per_s),
            }),
            memory_budget: limit.map(|l| Bytes(l) + RUNTIME_OVERHEAD_RAM),
        };
        g.add_node(node.clone(), measured(at, "inventory"));
        let host = inv.host.hostname.clone().unwrap_or_default();
        let shared_note = if share > 1 {
            format!(", shared by the {share} nodes on host {host}")
        } else {
            String::new()
        };
        g.set_evidence(
            &subject,
            "ram",
            node.ram.capacity.to_string(),
            measured(at, format!("{}{shared_note}", inv.memory.method)),
        );
        g.set_evidence(
            &subject,
            "mem_bandwidth",
            node.ram.bandwidth.to_string(),
            measured(
                at,
                format!(
                    "{} (read, {} threads, {} buffer: {}{}) x {DECODE_STREAM_EFFICIENCY} for \
                     batch-1 decode streaming",
                    bw.method,
                    bw.threads,
                    Bytes(bw.buffer_bytes),
                    BytesPerSec(own_bw),
                    if share > 1 {
                        format!("; host median {}", BytesPerSec(host_bw))
                    } else {
                        String::new()
                    }
                ),
            ),
        );
        let mut scaled = if threads < comp.threads && comp.single_thread_ops_per_s.is_some() {
            format!(
                "; {} threads of the probe's {}: single-thread rate x {threads}",
                threads, comp.threads
            )
        } else {
            String::new()
        };
        if share > 1 {
            scaled.push_str(&format!(
                "; this node {}, host median",
                FlopsPerSec(own_rate)
            ));
        }
        g.set_evidence(
            &subject,
            "ram_compute",
            node.ram_compute.to_string(),
            measured(
                at,
                format!(
                    "{} ({}, {} threads{scaled})",
                    comp.source, comp.detail, comp.threads
                ),
            ),
        );
        if let (Some((d, r, _)), Some(t)) = (disk, node.disk) {
            let cached = if r.possibly_cached {
                ", possibly from the page cache"
            } else {
                ""
            };
            g.set_evidence(
                &subject,
                "disk",
                t.capacity.to_string(),
                measured(at, format!("{} of {}", d.space_method, d.dir.display())),
            );
            g.set_evidence(
                &subject,
                "disk_bandwidth",
                t.bandwidth.to_string(),
                measured(at, format!("{}{cached}", r.method)),
            );
        }
        if let Some(b) = node.memory_budget {
            let what = match &inv.memory_budget {
                Some(rb) => format!("budget \"{}\"", rb.spec),
                None => "available RAM at start (no budget set)".into(),
            };
            g.set_evidence(
                &subject,
                "memory_budget",
                b.to_string(),
                measured(
                    at,
                    format!(
                        "the node's {what} for weights and KV cache, plus {RUNTIME_OVERHEAD_RAM} \
                         for the process"
                    ),
                ),
            );
        }
        if share > 1 {
            let start = inv.measured_at_unix_ms as f64;
            let end = start + inv.probe_duration_ms;
            let overlapping: Vec<&str> = nodes
                .iter()
                .filter(|(n, other)| {
                    peers.contains(n) && {
                        let s = other.measured_at_unix_ms as f64;
                        s < end && start < s + other.probe_duration_ms
                    }
                })
                .map(|(n, _)| *n)
                .collect();
            let mut note = format!(
                "with {} on host {host}: RAM divided among them; bandwidth and compute the \
                 host's (median of their probes), each node's in full (a ring at batch 1 runs \
                 one stage at a time; pipelined throughput would contend)",
                peers.join(", ")
            );
            if !overlapping.is_empty() {
                note.push_str(&format!(
                    "; its probes overlapped those of {}, so its rates may be low",
                    overlapping.join(", ")
                ));
            }
            g.set_evidence(&subject, "shared_host", note, measured(at, "inventory"));
        }
    }
    for l in links {
        if g.node(&l.a).is_none() || g.node(&l.b).is_none() || l.a == l.b {
            continue;
        }
        g.add_link(
            &l.a,
            &l.b,
            LinkSpec {
                // The fastest of the probe's pings: the path's own round trip. The median also
                // carries queueing behind whatever else the hosts did while probing (other
                // nodes' probes and model fetches at join): 9.4 ms for the lab's 6 ms Wi-Fi
                // link, 6.3 ms by the fastest.
                rtt_s: l.link.rtt_min.as_secs_f64(),
                bandwidth: BytesPerSec(l.link.bytes_per_s),
            },
            None,
            measured(l.link.measured_at_unix_ms, l.method.clone()),
        );
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planning::test_support::*;
    use std::time::Duration;

    fn source(g: &ResourceGraph, subject: &str, q: &str) -> Source {
        g.evidence
            .iter()
            .find(|e| e.subject == subject && e.quantity == q)
            .unwrap_or_else(|| panic!("no evidence for {subject} {q}: {:?}", g.evidence))
            .source
            .clone()
    }

    #[test]
    fn inventory_figures_become_measured_graph_figures() {
        let a = inv("alpha", 1_700_000_000_000, 4, Some(2 * GIB));
        let b = inv("beta", 1_700_000_001_500, 2, None);
        let links = links_via_coordinator(&[
            ("a", link(2, 100.0, 1_700_000_002_000)),
            ("b", link(3, 50.0, 1_700_000_003_000)),
        ]);
        assert_eq!(links.len(), 1);
        let g = resource_graph(&[("a", &a), ("b", &b)], &links, &Policy::default());
        let na = g.node("a").unwrap();
        assert_eq!(na.ram.capacity, Bytes(16 * GIB));
        assert_eq!(
            na.ram.bandwidth,
            BytesPerSec(16e9 * DECODE_STREAM_EFFICIENCY)
        );
        assert_eq!(na.ram_compute, FlopsPerSec(40e9));
        assert_eq!(
            na.memory_budget,
            Some(Bytes(2 * GIB) + RUNTIME_OVERHEAD_RAM)
        );
        assert!(na.vram.is_none() && na.disk.is_none());
        // Two of the probe's four threads: the single-thread rate twice.
        let nb = g.node("b").unwrap();
        assert_eq!(nb.ram_compute, FlopsPerSec(24e9));
        // No budget: the RAM available at start, plus the process.
        assert_eq!(
            nb.memory_budget,
            Some(Bytes(12 * GIB) + RUNTIME_OVERHEAD_RAM)
        );
        // The composed link: the larger round trip, the smaller rate.
        let l = g.link("a", "b").unwrap();
        assert!((l.rtt_s - 0.003).abs() < 1e-12);
        assert_eq!(l.bandwidth, BytesPerSec(50e6));
        for q in ["ram", "mem_bandwidth", "ram_compute", "memory_budget"] {
            match source(&g, "node a", q) {
                Source::Measured { at_unix_s, method } => {
                    assert_eq!(at_unix_s, 1_700_000_000);
                    assert!(!method.is_empty());
                }
                s => panic!("{q}: {s:?}"),
            }
        }
        match source(&g, "node b", "ram_compute") {
            Source::Measured { method, .. } => {
                assert!(method.contains("single-thread"), "{method}")
            }
            s => panic!("{s:?}"),
        }
        match source(&g, "link a-b", "rtt") {
            Source::Measured { at_unix_s, method } => {
                assert_eq!(at_unix_s, 1_700_000_002);
                assert!(method.contains("coordinator"), "{method}");
            }
            s => panic!("{s:?}"),
        }
        assert!(g.evidence.iter().all(|e| e.quantity != "shared_host"));
    }

    #[test]
    fn co_hosted_nodes_share_ram_and_overlapping_probes_are_noted() {
        let mut a = inv("box", 1_000_000, 2, Some(GIB));
        let mut b = inv("box", 1_000_500, 2, Some(GIB)); // probes overlap a's
        let c = inv("box", 1_005_000, 2, Some(GIB)); // after both
        a.memory_bandwidth.as_mut().unwrap().read_all_threads = 30e9;
        b.memory_bandwidth.as_mut().unwrap().read_all_threads = 10e9;
        let g = resource_graph(&[("a", &a), ("b", &b), ("c", &c)], &[], &Policy::default());
        for n in ["a", "b", "c"] {
            let node = g.node(n).unwrap();
            assert_eq!(node.ram.capacity, Bytes(16 * GIB / 3));
            // One machine: the median of its processes' probes, in full to each (batch-1 rings
            // run one stage at a time).
            assert_eq!(
                node.ram.bandwidth,
                BytesPerSec(16e9 * DECODE_STREAM_EFFICIENCY)
            );
            assert_eq!(node.ram_compute, FlopsPerSec(24e9));
        }
        let note = |n: &str| {
            g.evidence
                .iter()
                .find(|e| e.subject == format!("node {n}") && e.quantity == "shared_host")
                .unwrap()
                .value
                .clone()
        };
        assert!(note("a").contains("overlapped those of b"), "{}", note("a"));
        assert!(!note("c").contains("overlapped"), "{}", note("c"));
        // Without links, co-hosted nodes are still unreachable from each other.
        assert!(g.link("a", "b").is_none());
    }

    #[test]
    fn a_node_without_measured_figures_is_left_out() {
        let mut a = inv("alpha", 1_000_000, 4, None);
        a.compute = None;
        let b = inv("beta", 1_000_000, 4, None);
        let g = resource_graph(&[("a", &a), ("b", &b)], &[], &Policy::default());
        assert!(g.node("a").is_none());
        assert!(g.node("b").is_some());
        assert!(g
            .evidence
            .iter()
            .any(|e| e.subject == "node a" && e.quantity == "excluded"));
    }

    #[test]
    fn links_the_nodes_measured_replace_those_composed_from_the_coordinators() {
        let coord = [
            ("a", link(1, 100.0, 10)),
            ("b", link(1, 100.0, 10)),
            ("c", link(2, 50.0, 10)),
        ];
        let measured = [
            ("a", "b", link(40, 12.0, 20)),
            ("b", "a", link(41, 11.0, 21)),
            ("c", "a", link(20, 30.0, 22)),
        ];
        let links = node_links(&coord, &measured);
        let find = |a: &str, b: &str| links.iter().find(|l| l.a == a && l.b == b).unwrap();
        let ab = find("a", "b");
        assert_eq!(ab.link.rtt_median, Duration::from_millis(41));
        assert_eq!(ab.link.bytes_per_s, 11e6);
        assert!(ab.method.contains("by both"), "{}", ab.method);
        let ac = find("a", "c");
        assert_eq!(ac.link.rtt_median, Duration::from_millis(20));
        assert!(ac.method.contains("by one of them"), "{}", ac.method);
        // Not measured between b and c: composed from the coordinator's.
        let bc = find("b", "c");
        assert_eq!(bc.link.rtt_median, Duration::from_millis(2));
        assert!(bc.method.contains("composed"), "{}", bc.method);
    }
}
