//! Writing a resource graph back as a cluster file, so a graph the planner corrected
//! (calibration) or measured can be planned on again by `tessera plan --nodes`. Every figure is
//! written in base units (bytes, bytes/s, FLOPS); a node or link with measured evidence gets
//! `measured_at`, so its figures stay labelled as measured.

use crate::resources::{link_subject, ResourceGraph, Source};

fn measured_at(g: &ResourceGraph, subject: &str) -> Option<u64> {
    g.evidence
        .iter()
        .filter(|e| e.subject == subject)
        .filter_map(|e| match e.source {
            Source::Measured { at_unix_s, .. } => Some(at_unix_s),
            _ => None,
        })
        .max()
}

fn table(pairs: Vec<(&str, toml::Value)>) -> toml::Table {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

fn float(x: f64) -> toml::Value {
    toml::Value::Float(x)
}

impl ResourceGraph {
    /// The graph as a cluster file that [`ResourceGraph::from_toml`] reads back to the same
    /// nodes, links, policy and runtime overhead (profiles are not named: their figures are
    /// written out).
    pub fn to_toml(&self) -> String {
        let mut doc = toml::Table::new();
        if self.token_overhead_s > 0.0 {
            doc.insert(
                "token_overhead_us".into(),
                float(self.token_overhead_s * 1e6),
            );
        }
        doc.insert("hop_overhead_us".into(), float(self.hop_overhead_s * 1e6));
        let p = &self.policy;
        let mut policy = table(vec![
            (
                "objective",
                toml::Value::String(format!("{:?}", p.objective).to_lowercase()),
            ),
            (
                "strategies",
                toml::Value::Array(
                    p.strategies
                        .iter()
                        .map(|s| toml::Value::String(s.name().into()))
                        .collect(),
                ),
            ),
            ("max_memory_share", float(p.max_memory_share)),
            ("context", toml::Value::Integer(p.context_tokens as i64)),
            (
                "prompt_tokens",
                toml::Value::Integer(p.prompt_tokens as i64),
            ),
            (
                "concurrency",
                toml::Value::Integer(i64::from(p.concurrency)),
            ),
        ]);
        if let Some(m) = p.min_tokens_per_s {
            policy.insert("min_tokens_per_s".into(), float(m));
        }
        if p.expert_reuse != 1.0 {
            policy.insert("expert_reuse".into(), float(p.expert_reuse));
        }
        doc.insert("policy".into(), toml::Value::Table(policy));
        if let Some(d) = self.default_link {
            let link = table(vec![
                ("rtt_ms", float(d.rtt_s * 1e3)),
                ("bandwidth", float(d.bandwidth.0)),
            ]);
            doc.insert(
                "defaults".into(),
                toml::Value::Table(table(vec![("link", toml::Value::Table(link))])),
            );
        }
        let nodes = self
            .nodes
            .iter()
            .map(|n| {
                let mut t = table(vec![
                    ("name", toml::Value::String(n.name.clone())),
                    ("ram", float(n.ram.capacity.0 as f64)),
                    ("mem_bandwidth", float(n.ram.bandwidth.0)),
                    ("cpu_compute", float(n.ram_compute.0)),
                ]);
                if let Some(v) = n.vram {
                    t.insert("vram".into(), float(v.capacity.0 as f64));
                    t.insert("vram_bandwidth".into(), float(v.bandwidth.0));
                    t.insert("compute".into(), float(n.gpu_compute.0));
                }
                if let Some(d) = n.disk {
                    t.insert("disk".into(), float(d.capacity.0 as f64));
                    t.insert("disk_bandwidth".into(), float(d.bandwidth.0));
                }
                if let Some(b) = n.memory_budget {
                    t.insert("memory_budget".into(), float(b.0 as f64));
                }
                if let Some(at) = measured_at(self, &format!("node {}", n.name)) {
                    t.insert("measured_at".into(), toml::Value::Integer(at as i64));
                }
                toml::Value::Table(t)
            })
            .collect();
        doc.insert("node".into(), toml::Value::Array(nodes));
        if !self.links.is_empty() {
            let links = self
                .links
                .iter()
                .map(|l| {
                    let mut t = table(vec![
                        (
                            "nodes",
                            toml::Value::Array(vec![
                                toml::Value::String(l.a.clone()),
                                toml::Value::String(l.b.clone()),
                            ]),
                        ),
                        ("rtt_ms", float(l.spec.rtt_s * 1e3)),
                        ("bandwidth", float(l.spec.bandwidth.0)),
                    ]);
                    if let Some(at) = measured_at(self, &link_subject(&l.a, &l.b)) {
                        t.insert("measured_at".into(), toml::Value::Integer(at as i64));
                    }
                    toml::Value::Table(t)
                })
                .collect();
            doc.insert("link".into(), toml::Value::Array(links));
        }
        if !self.machines.is_empty() {
            let machines = self
                .machines
                .iter()
                .map(|m| {
                    toml::Value::Table(table(vec![
                        ("name", toml::Value::String(m.name.clone())),
                        ("cores", float(m.cores)),
                        ("node_cores", float(m.node_cores)),
                        (
                            "nodes",
                            toml::Value::Array(
                                m.nodes.iter().cloned().map(toml::Value::String).collect(),
                            ),
                        ),
                    ]))
                })
                .collect();
            doc.insert("machine".into(), toml::Value::Array(machines));
        }
        toml::to_string(&doc).expect("a TOML table always serialises")
    }
}

#[cfg(test)]
mod tests {
    use crate::resources::ResourceGraph;

    #[test]
    fn a_written_graph_reads_back_to_the_same_figures() {
        let text = r#"
[policy]
objective = "latency"
strategies = ["single", "stage"]
concurrency = 4
context = 512
[defaults]
link = "1gbe"
[[node]]
name = "a"
profile = "laptop-16gb"
memory_budget = "3GiB"
[[node]]
name = "b"
ram = "8GiB"
mem_bandwidth = "15GB/s"
compute = "100GFLOPS"
disk = "100GiB"
disk_bandwidth = "1GB/s"
measured_at = 1700000000
[[link]]
nodes = ["a", "b"]
rtt_ms = 0.3
bandwidth = "1Gbit/s"
[[machine]]
name = "vm"
cores = 2
node_cores = 1.5
nodes = ["a", "b"]
"#;
        let mut g = ResourceGraph::from_toml(text).unwrap();
        g.token_overhead_s = 250e-6;
        g.hop_overhead_s = 80e-6;
        let back = ResourceGraph::from_toml(&g.to_toml()).unwrap();
        assert_eq!(back.nodes.len(), 2);
        for (x, y) in g.nodes.iter().zip(&back.nodes) {
            assert_eq!(
                (x.ram, x.ram_compute, x.vram, x.gpu_compute),
                (y.ram, y.ram_compute, y.vram, y.gpu_compute)
            );
            assert_eq!((x.disk, x.memory_budget), (y.disk, y.memory_budget));
        }
        assert_eq!(back.links, g.links);
        assert_eq!(back.machines, g.machines);
        assert_eq!(back.default_link, g.default_link);
        assert_eq!(back.policy, g.policy);
        assert!((back.token_overhead_s - 250e-6).abs() < 1e-12);
        assert!((back.hop_overhead_s - 80e-6).abs() < 1e-12);
        let b = back
            .evidence
            .iter()
            .find(|e| e.subject == "node b")
            .unwrap();
        assert!(
            matches!(
                b.source,
                crate::Source::Measured {
                    at_unix_s: 1700000000,
                    ..
                }
            ),
            "{b:?}"
        );
    }
}
