//! The cluster file: the TOML text an operator writes, its serde shape, and how it becomes a
//! [`ResourceGraph`] ([`ResourceGraph::from_toml`]). Kept apart from the graph's own types, which
//! the coordinator also builds from measured inventory without any file.

use super::{
    node_figures, ClusterError, LinkSpec, Node, Policy, ResourceGraph, SharedMachine, Source,
    StrategyKind, Tier,
};
use crate::profiles;
use crate::units::{self, Bytes, BytesPerSec, FlopsPerSec, UnitError};
use serde::Deserialize;

impl ResourceGraph {
    /// Parses a cluster file. See the crate README for the format.
    pub fn from_toml(text: &str) -> Result<Self, ClusterError> {
        let file: ClusterFile = toml::from_str(text)?;
        let mut g = Self::default();
        if let Some(us) = file.token_overhead_us {
            if !(us.is_finite() && us >= 0.0) {
                return Err(ClusterError::Invalid(
                    "token_overhead_us must be a finite number ≥ 0".into(),
                ));
            }
            g.token_overhead_s = us / 1e6;
        }
        if let Some(us) = file.hop_overhead_us {
            if !(us.is_finite() && us >= 0.0) {
                return Err(ClusterError::Invalid(
                    "hop_overhead_us must be a finite number ≥ 0".into(),
                ));
            }
            g.hop_overhead_s = us / 1e6;
        }
        if let Some(p) = file.policy {
            g.policy = p.into_policy()?;
        }
        let mut default_src = None;
        if let Some(d) = file.defaults.and_then(|d| d.link) {
            let (spec, _profile, src) = d.resolve("defaults.link")?;
            g.default_link = Some(spec);
            default_src = Some(src);
        }
        if file.node.is_empty() {
            return Err(ClusterError::Invalid("no [[node]] tables".into()));
        }
        for n in file.node {
            if g.node(&n.name).is_some() {
                return Err(ClusterError::Invalid(format!(
                    "node {:?} listed twice",
                    n.name
                )));
            }
            n.apply(&mut g)?;
        }
        for m in file.machine {
            m.apply(&mut g)?;
        }
        for l in file.link {
            let [a, b] = l.nodes.clone();
            for x in [&a, &b] {
                if g.node(x).is_none() {
                    return Err(ClusterError::UnknownNode(x.clone()));
                }
            }
            if a == b {
                return Err(ClusterError::Invalid(format!("link from {a:?} to itself")));
            }
            let (spec, profile, src) = l.spec().resolve(&format!("link {a}-{b}"))?;
            g.add_link(&a, &b, spec, profile, src);
        }
        if let (Some(spec), Some(src)) = (g.default_link, default_src) {
            g.set_evidence(
                "default link",
                "rtt",
                format!("{:.3} ms", spec.rtt_s * 1e3),
                src.clone(),
            );
            g.set_evidence("default link", "bandwidth", spec.bandwidth.to_string(), src);
        }
        Ok(g)
    }
}

// ---- the cluster file ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    /// The runtime's fixed cost per generated token, µs (what calibration measured; see
    /// [`ResourceGraph::token_overhead_s`]).
    token_overhead_us: Option<f64>,
    /// Software time per hop beyond the link, µs (see [`ResourceGraph::hop_overhead_s`]).
    hop_overhead_us: Option<f64>,
    defaults: Option<DefaultsFile>,
    policy: Option<PolicyFile>,
    #[serde(default)]
    node: Vec<NodeFile>,
    #[serde(default)]
    link: Vec<LinkFile>,
    #[serde(default)]
    machine: Vec<MachineFile>,
}

/// `[[machine]]`: nodes that share one machine's cores.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MachineFile {
    name: String,
    cores: f64,
    /// Cores each node computes with (its threads); 1 unless said.
    node_cores: Option<f64>,
    nodes: Vec<String>,
}

impl MachineFile {
    fn apply(self, g: &mut ResourceGraph) -> Result<(), ClusterError> {
        let invalid =
            |what: String| ClusterError::Invalid(format!("machine {:?}: {what}", self.name));
        let node_cores = self.node_cores.unwrap_or(1.0);
        if !(self.cores.is_finite() && self.cores > 0.0) {
            return Err(invalid("cores must be a number > 0".into()));
        }
        if !(node_cores.is_finite() && node_cores > 0.0) {
            return Err(invalid("node_cores must be a number > 0".into()));
        }
        for n in &self.nodes {
            if g.node(n).is_none() {
                return Err(ClusterError::UnknownNode(n.clone()));
            }
            if let Some(other) = g.machine_of(n) {
                return Err(invalid(format!(
                    "node {n:?} is already on machine {:?}",
                    other.name
                )));
            }
        }
        if g.machines.iter().any(|m| m.name == self.name) {
            return Err(invalid("listed twice".into()));
        }
        g.machines.push(SharedMachine {
            name: self.name,
            cores: self.cores,
            node_cores,
            nodes: self.nodes,
        });
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DefaultsFile {
    link: Option<LinkSpecFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    objective: Option<String>,
    strategies: Option<Vec<StrategyKind>>,
    min_tokens_per_s: Option<f64>,
    max_memory_share: Option<f64>,
    context: Option<u64>,
    prompt_tokens: Option<u64>,
    concurrency: Option<u32>,
    expert_reuse: Option<f64>,
}

impl PolicyFile {
    fn into_policy(self) -> Result<Policy, ClusterError> {
        let mut p = Policy::default();
        if let Some(o) = self.objective {
            p.objective = o.parse()?;
        }
        if let Some(s) = self.strategies {
            if s.is_empty() {
                return Err(ClusterError::Invalid("policy.strategies is empty".into()));
            }
            p.strategies = s;
        }
        p.min_tokens_per_s = self.min_tokens_per_s;
        if let Some(s) = self.max_memory_share {
            if !(s > 0.0 && s <= 1.0) {
                return Err(ClusterError::Invalid(
                    "policy.max_memory_share must be in (0, 1]".into(),
                ));
            }
            p.max_memory_share = s;
        }
        if let Some(c) = self.context {
            p.context_tokens = c.max(1);
        }
        if let Some(c) = self.prompt_tokens {
            p.prompt_tokens = c.max(1);
        }
        if let Some(c) = self.concurrency {
            p.concurrency = c.max(1);
        }
        if let Some(r) = self.expert_reuse {
            // Below 1 would price a cache as missing more than chance does.
            if !(1.0..=crate::cost::MAX_EXPERT_REUSE).contains(&r) {
                return Err(ClusterError::Invalid(format!(
                    "policy.expert_reuse must be in [1, {}]",
                    crate::cost::MAX_EXPERT_REUSE
                )));
            }
            p.expert_reuse = r;
        }
        Ok(p)
    }
}

/// A figure given as text with a unit ("16GiB") or as a bare number in base units.
#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum Figure {
    Number(f64),
    Text(String),
}

impl Figure {
    fn bytes(&self) -> Result<Bytes, UnitError> {
        match self {
            Self::Number(x) => Ok(Bytes::from_f64(*x)),
            Self::Text(s) => units::parse_bytes(s),
        }
    }
    fn bandwidth(&self) -> Result<BytesPerSec, UnitError> {
        match self {
            Self::Number(x) => Ok(BytesPerSec(*x)),
            Self::Text(s) => units::parse_bandwidth(s),
        }
    }
    fn flops(&self) -> Result<FlopsPerSec, UnitError> {
        match self {
            Self::Number(x) => Ok(FlopsPerSec(*x)),
            Self::Text(s) => units::parse_flops(s),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeFile {
    name: String,
    profile: Option<String>,
    ram: Option<Figure>,
    vram: Option<Figure>,
    memory_budget: Option<Figure>,
    mem_bandwidth: Option<Figure>,
    vram_bandwidth: Option<Figure>,
    disk: Option<Figure>,
    disk_bandwidth: Option<Figure>,
    /// The GPU's rate when the node has VRAM, else the RAM tier's compute unit.
    compute: Option<Figure>,
    cpu_compute: Option<Figure>,
    /// When set, the overrides are measurements taken at this time (unix seconds).
    measured_at: Option<u64>,
}

impl NodeFile {
    fn apply(self, g: &mut ResourceGraph) -> Result<(), ClusterError> {
        let name = self.name.clone();
        let missing = |field| ClusterError::MissingFigure {
            node: name.clone(),
            field,
        };
        let mut node = match &self.profile {
            Some(p) => Node::from_profile(&self.name, p)?,
            None => Node {
                name: self.name.clone(),
                profile: None,
                vram: None,
                gpu_compute: FlopsPerSec(0.0),
                ram: Tier {
                    capacity: self.ram.as_ref().ok_or_else(|| missing("ram"))?.bytes()?,
                    bandwidth: self
                        .mem_bandwidth
                        .as_ref()
                        .ok_or_else(|| missing("mem_bandwidth"))?
                        .bandwidth()?,
                },
                ram_compute: self
                    .compute
                    .as_ref()
                    .or(self.cpu_compute.as_ref())
                    .ok_or_else(|| missing("compute"))?
                    .flops()?,
                disk: None,
                memory_budget: None,
            },
        };
        let profile_src = Source::Estimate {
            source: self
                .profile
                .as_deref()
                .and_then(profiles::hardware)
                .map(|p| p.source.to_string())
                .unwrap_or_default(),
        };
        let over_src = match self.measured_at {
            Some(t) => Source::Measured {
                at_unix_s: t,
                method: "cluster file".into(),
            },
            None => Source::Declared,
        };
        let mut overridden: Vec<&'static str> = Vec::new();
        if let Some(f) = &self.ram {
            node.ram.capacity = f.bytes()?;
            overridden.push("ram");
        }
        if let Some(f) = &self.mem_bandwidth {
            node.ram.bandwidth = f.bandwidth()?;
            overridden.push("mem_bandwidth");
        }
        if let Some(f) = &self.vram {
            let cap = f.bytes()?;
            overridden.push("vram");
            if cap.0 == 0 {
                node.vram = None;
            } else {
                let bw = match (&self.vram_bandwidth, node.vram) {
                    (Some(b), _) => b.bandwidth()?,
                    (None, Some(t)) => t.bandwidth,
                    (None, None) => return Err(missing("vram_bandwidth")),
                };
                node.vram = Some(Tier {
                    capacity: cap,
                    bandwidth: bw,
                });
                if node.gpu_compute.0 <= 0.0 && self.compute.is_none() {
                    return Err(missing("compute (for the GPU)"));
                }
            }
        }
        if let Some(f) = &self.vram_bandwidth {
            overridden.push("vram_bandwidth");
            match node.vram.as_mut() {
                Some(t) => t.bandwidth = f.bandwidth()?,
                None => return Err(missing("vram")),
            }
        }
        if let Some(f) = &self.cpu_compute {
            node.ram_compute = f.flops()?;
            overridden.push("ram_compute");
        }
        if let Some(f) = &self.compute {
            if node.vram.is_some() {
                node.gpu_compute = f.flops()?;
                overridden.push("gpu_compute");
            } else if self.profile.is_some() || self.cpu_compute.is_none() {
                node.ram_compute = f.flops()?;
                overridden.push("ram_compute");
            }
        }
        if let Some(f) = &self.disk {
            let cap = f.bytes()?;
            overridden.push("disk");
            if cap.0 == 0 {
                node.disk = None;
            } else {
                let bw = match (&self.disk_bandwidth, node.disk) {
                    (Some(b), _) => b.bandwidth()?,
                    (None, Some(t)) => t.bandwidth,
                    (None, None) => return Err(missing("disk_bandwidth")),
                };
                node.disk = Some(Tier {
                    capacity: cap,
                    bandwidth: bw,
                });
            }
        }
        if let Some(f) = &self.disk_bandwidth {
            overridden.push("disk_bandwidth");
            match node.disk.as_mut() {
                Some(t) => t.bandwidth = f.bandwidth()?,
                None => return Err(missing("disk")),
            }
        }
        if let Some(f) = &self.memory_budget {
            node.memory_budget = Some(f.bytes()?);
            overridden.push("memory_budget");
        }
        let subject = format!("node {}", node.name);
        for (q, v) in node_figures(&node) {
            let src = if overridden.contains(&q) || self.profile.is_none() {
                over_src.clone()
            } else {
                profile_src.clone()
            };
            g.set_evidence(&subject, q, v, src);
        }
        g.nodes.push(node);
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkFile {
    nodes: [String; 2],
    profile: Option<String>,
    rtt_ms: Option<f64>,
    rtt: Option<String>,
    bandwidth: Option<Figure>,
    measured_at: Option<u64>,
}

impl LinkFile {
    fn spec(&self) -> LinkSpecFile {
        LinkSpecFile::Table {
            profile: self.profile.clone(),
            rtt_ms: self.rtt_ms,
            rtt: self.rtt.clone(),
            bandwidth: self.bandwidth.clone(),
            measured_at: self.measured_at,
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum LinkSpecFile {
    Profile(String),
    Table {
        profile: Option<String>,
        rtt_ms: Option<f64>,
        rtt: Option<String>,
        bandwidth: Option<Figure>,
        measured_at: Option<u64>,
    },
}

impl LinkSpecFile {
    fn resolve(&self, what: &str) -> Result<(LinkSpec, Option<String>, Source), ClusterError> {
        let (profile, rtt_ms, rtt, bandwidth, measured_at) = match self {
            Self::Profile(p) => (Some(p), None, None, None, None),
            Self::Table {
                profile,
                rtt_ms,
                rtt,
                bandwidth,
                measured_at,
            } => (
                profile.as_ref(),
                *rtt_ms,
                rtt.as_ref(),
                bandwidth.as_ref(),
                *measured_at,
            ),
        };
        let base = match profile {
            Some(p) => {
                let lp =
                    profiles::link(p).ok_or_else(|| ClusterError::UnknownProfile(p.clone()))?;
                Some((
                    LinkSpec {
                        rtt_s: lp.rtt_s,
                        bandwidth: lp.bandwidth,
                    },
                    lp,
                ))
            }
            None => None,
        };
        let rtt_s = match (rtt_ms, rtt) {
            (Some(ms), _) => Some(ms / 1e3),
            (None, Some(s)) => Some(units::parse_duration_s(s)?),
            _ => None,
        };
        let bw = bandwidth.map(Figure::bandwidth).transpose()?;
        let spec = LinkSpec {
            rtt_s: rtt_s.or(base.map(|b| b.0.rtt_s)).ok_or_else(|| {
                ClusterError::Invalid(format!("{what}: give a profile or rtt_ms and bandwidth"))
            })?,
            bandwidth: bw.or(base.map(|b| b.0.bandwidth)).ok_or_else(|| {
                ClusterError::Invalid(format!("{what}: give a profile or rtt_ms and bandwidth"))
            })?,
        };
        if !(spec.rtt_s >= 0.0 && spec.bandwidth.0 > 0.0) {
            return Err(ClusterError::Invalid(format!(
                "{what}: rtt must be >= 0 and bandwidth > 0"
            )));
        }
        let src = if rtt_s.is_some() || bw.is_some() {
            match measured_at {
                Some(t) => Source::Measured {
                    at_unix_s: t,
                    method: "cluster file".into(),
                },
                None => Source::Declared,
            }
        } else {
            Source::Estimate {
                source: base.map(|b| b.1.source.to_string()).unwrap_or_default(),
            }
        };
        Ok((spec, base.map(|b| b.1.name.to_string()), src))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::Objective;

    #[test]
    fn parses_a_cluster_file() {
        let g = ResourceGraph::from_toml(
            r#"
            [defaults]
            link = "1gbe"
            [policy]
            objective = "latency"
            strategies = ["single", "stage"]
            min_tokens_per_s = 2
            [[node]]
            name = "mac"
            profile = "apple-m2-16gb"
            memory_budget = "10GiB"
            [[node]]
            name = "box"
            ram = "64GiB"
            mem_bandwidth = "60GB/s"
            compute = "1TFLOPS"
            disk = "1TB"
            disk_bandwidth = "2GB/s"
            measured_at = 1764000000
            [[link]]
            nodes = ["mac", "box"]
            rtt_ms = 20
            bandwidth = "100Mbit/s"
            "#,
        )
        .unwrap();
        assert_eq!(g.nodes.len(), 2);
        assert_eq!(g.policy.objective, Objective::Latency);
        assert_eq!(
            g.policy.strategies,
            vec![StrategyKind::Single, StrategyKind::Stage]
        );
        assert_eq!(g.node("mac").unwrap().memory_budget, Some(Bytes::gib(10)));
        assert_eq!(g.node("box").unwrap().ram.capacity, Bytes::gib(64));
        let l = g.link("box", "mac").unwrap();
        assert!((l.rtt_s - 0.020).abs() < 1e-12);
        assert_eq!(l.bandwidth.0, 12.5e6);
        assert!(g.evidence.iter().any(|e| e.subject == "node box"
            && matches!(
                e.source,
                Source::Measured {
                    at_unix_s: 1764000000,
                    ..
                }
            )));
        assert!(g.evidence.iter().any(|e| e.subject == "node mac"
            && e.quantity == "mem_bandwidth"
            && matches!(e.source, Source::Estimate { .. })));
    }

    #[test]
    fn explains_bad_cluster_files() {
        let e = ResourceGraph::from_toml("[[node]]\nname = \"x\"\nram = \"8GiB\"\n").unwrap_err();
        assert!(e.to_string().contains("mem_bandwidth"), "{e}");
        let e =
            ResourceGraph::from_toml("[[node]]\nname = \"x\"\nprofile = \"cray-1\"\n").unwrap_err();
        assert!(e.to_string().contains("cray-1"), "{e}");
        let e = ResourceGraph::from_toml(
            "[[node]]\nname = \"x\"\nprofile = \"laptop-16gb\"\n[[link]]\nnodes = [\"x\", \"y\"]\nprofile = \"1gbe\"\n",
        )
        .unwrap_err();
        assert!(matches!(e, ClusterError::UnknownNode(_)), "{e}");
        let e = ResourceGraph::from_toml(
            "[[node]]\nname = \"x\"\nprofile = \"laptop-16gb\"\nram = \"16 parsecs\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("parsecs"), "{e}");
    }
}
