//! Each capped host's disk read rate, measured by the lab under the host's cap before any node
//! starts, for the planner to price streaming with.
//!
//! A node's quick probe reads 8 MiB of a file in its data directory: under the cgroup throttle
//! that was within the throttle's first slice, so it reported the disk's uncapped rate (1049
//! MB/s under the eMMC profile's 300 MB/s cap, in a release run of moe-bigger-than-any), and
//! the data directory is not where the model is read from. The lab instead reads the model as
//! each host sees it (through its emulated disk, [`crate::disk::emulated`]) as `lab selftest`
//! does (1 MiB direct reads, 4 in flight, the first 300 ms left out) from inside the host's
//! cgroup.

use serde::Serialize;
use tessera_plan::{BytesPerSec, ResourceGraph};

use crate::disk::measure::{direct_reads, ReadLoad};
use crate::error::{LabError, Result};
use crate::lab::Lab;
use crate::scenario::Scenario;

/// What a host read under its cap.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiskRate {
    pub node: String,
    /// The cap's profile.
    pub profile: String,
    pub bytes_per_s: f64,
}

/// Measures each scenario node whose host has a disk profile (host `i + 1` is node `i`),
/// reading the model as the host sees it (through its emulated disk: the scenario puts the
/// model's directory on every host's disk) from inside the host's cgroup.
pub fn measure(lab: &Lab, scenario: &Scenario) -> Result<Vec<DiskRate>> {
    let capped: Vec<(usize, &str)> = scenario
        .graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| lab.disk(i + 1).is_some())
        .map(|(i, n)| (i + 1, n.name.as_str()))
        .collect();
    if capped.is_empty() {
        return Ok(Vec::new());
    }
    let len = std::fs::metadata(&scenario.model)
        .map_err(|e| LabError::io(format!("reading {}", scenario.model.display()), e))?
        .len();
    let mut rates = Vec::new();
    for (host, node) in capped {
        let profile = lab.disk(host).expect("filtered");
        let cg = lab
            .cgroup(host)
            .ok_or_else(|| LabError::Spec(format!("{node}: a capped host without a cgroup")))?;
        let enter = || cg.enter_thread();
        let seen = lab.through_disk(host, &scenario.model);
        let r = direct_reads((seen.as_path(), len), &ReadLoad::bandwidth(), &enter)
            .map_err(|e| LabError::io(format!("reading {node}'s disk under its cap"), e))?;
        rates.push(DiskRate {
            node: node.to_string(),
            profile: profile.name.to_string(),
            bytes_per_s: r.bytes_per_s,
        });
    }
    Ok(rates)
}

/// Puts each measured rate in place of what the node's probe measured, one line each saying
/// so; a node whose graph has no disk (its probe failed) is left without one, and said.
pub fn apply(graph: &mut ResourceGraph, rates: &[DiskRate]) -> Vec<String> {
    let mut lines = Vec::new();
    for r in rates {
        let Some(n) = graph.nodes.iter_mut().find(|n| n.name == r.node) else {
            continue;
        };
        match &mut n.disk {
            Some(t) => {
                lines.push(format!(
                    "measured by the lab: {}'s disk reads {:.0} MB/s under its {} cap (1 MiB \
                     direct reads, 4 in flight); its node's quick probe read {:.0} MB/s: the \
                     planner prices streaming with the lab's",
                    r.node,
                    r.bytes_per_s / 1e6,
                    r.profile,
                    t.bandwidth.0 / 1e6
                ));
                t.bandwidth = BytesPerSec(r.bytes_per_s);
            }
            None => lines.push(format!(
                "{}: its node measured no disk, so the planner streams nothing there (the lab \
                 read {:.0} MB/s under its {} cap)",
                r.node,
                r.bytes_per_s / 1e6,
                r.profile
            )),
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_plan::{Bytes, Tier};

    #[test]
    fn the_lab_rate_replaces_the_probe_rate_and_says_so() {
        let mut g = ResourceGraph::from_toml(
            r#"
            [[node]]
            name = "a"
            profile = "laptop-16gb"
            disk_bandwidth = "1049MB/s"
            [[node]]
            name = "b"
            profile = "laptop-16gb"
            "#,
        )
        .unwrap();
        g.nodes[1].disk = None;
        let rates = [
            DiskRate {
                node: "a".into(),
                profile: "emmc".into(),
                bytes_per_s: 300e6,
            },
            DiskRate {
                node: "b".into(),
                profile: "emmc".into(),
                bytes_per_s: 301e6,
            },
        ];
        let lines = apply(&mut g, &rates);
        assert_eq!(g.nodes[0].disk.map(|t| t.bandwidth.0), Some(300e6));
        assert!(
            lines[0].contains("300 MB/s") && lines[0].contains("1049 MB/s"),
            "{lines:?}"
        );
        assert!(g.nodes[1].disk.is_none());
        assert!(lines[1].contains("no disk"), "{lines:?}");
        // A disk keeps its capacity.
        let before = Tier {
            capacity: Bytes::gib(1),
            bandwidth: BytesPerSec(1.0),
        };
        g.nodes[0].disk = Some(before);
        apply(&mut g, &rates[..1]);
        assert_eq!(g.nodes[0].disk.unwrap().capacity, before.capacity);
    }
}
