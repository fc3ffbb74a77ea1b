//! The resource graph: nodes (memory tiers, compute units, the contributor's budget), links, operator
//! policy, and the evidence behind every figure. Parsed from a cluster file (TOML text) or built by
//! the coordinator from measured inventory.
//!
//! The graph's types and queries live here; reading a cluster file into a graph lives in
//! `cluster_file`.

mod cluster_file;

use crate::profiles;
use crate::units::{Bytes, BytesPerSec, FlopsPerSec, UnitError};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One memory tier of a node.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tier {
    pub capacity: Bytes,
    pub bandwidth: BytesPerSec,
}

/// A machine offering work.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    pub profile: Option<String>,
    /// GPU memory, computed on by `gpu_compute`.
    pub vram: Option<Tier>,
    pub gpu_compute: FlopsPerSec,
    /// Host memory, computed on by `ram_compute` (the CPU, or the GPU on unified memory).
    pub ram: Tier,
    pub ram_compute: FlopsPerSec,
    /// Local storage experts may be streamed from (weights there are read through the page cache).
    pub disk: Option<Tier>,
    /// The most RAM + VRAM the contributor lets Tessera use.
    pub memory_budget: Option<Bytes>,
}

impl Node {
    /// A node with the figures of a library profile.
    pub fn from_profile(name: &str, profile: &str) -> Result<Self, ClusterError> {
        let p = profiles::hardware(profile)
            .ok_or_else(|| ClusterError::UnknownProfile(profile.to_string()))?;
        Ok(Self {
            name: name.to_string(),
            profile: Some(p.name.to_string()),
            vram: (p.vram.0 > 0).then_some(Tier {
                capacity: p.vram,
                bandwidth: p.vram_bandwidth,
            }),
            gpu_compute: p.gpu_compute,
            ram: Tier {
                capacity: p.ram,
                bandwidth: p.mem_bandwidth,
            },
            ram_compute: p.ram_compute,
            disk: (p.disk.0 > 0).then_some(Tier {
                capacity: p.disk,
                bandwidth: p.disk_bandwidth,
            }),
            memory_budget: p.memory_budget,
        })
    }
}

/// The figures of a link.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    pub rtt_s: f64,
    pub bandwidth: BytesPerSec,
}

impl LinkSpec {
    /// One-way time to move `bytes`: half the round trip plus the transfer.
    pub fn one_way_s(&self, bytes: f64) -> f64 {
        self.rtt_s / 2.0 + self.bandwidth.secs(bytes)
    }
}

/// A measured or declared link between two nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub a: String,
    pub b: String,
    pub profile: Option<String>,
    pub spec: LinkSpec,
}

/// What the operator wants optimised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Decode tokens/s of each request while the policy's concurrency is served (at concurrency
    /// 1: one request alone).
    Latency,
    /// Aggregate tokens/s at the policy's concurrency: what the endpoint serves in all.
    Throughput,
    /// Geometric mean of the two.
    #[default]
    Balanced,
}

impl std::str::FromStr for Objective {
    type Err = ClusterError;
    fn from_str(s: &str) -> Result<Self, ClusterError> {
        match s.to_ascii_lowercase().as_str() {
            "latency" => Ok(Self::Latency),
            "throughput" => Ok(Self::Throughput),
            "balanced" => Ok(Self::Balanced),
            _ => Err(ClusterError::Invalid(format!(
                "objective {s:?} (use latency, throughput or balanced)"
            ))),
        }
    }
}

/// The ways of placing a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StrategyKind {
    /// The whole model on one node.
    Single,
    /// Contiguous layer ranges on a ring of nodes.
    Stage,
    /// Each MoE layer's experts spread over owner nodes; attention on a home node.
    Expert,
    /// One node runs the model; a bounded bank of FFN weights is served by a remote node.
    Bank,
    /// Independent whole-request cells behind one endpoint.
    Replica,
}

impl StrategyKind {
    pub const ALL: [Self; 5] = [
        Self::Single,
        Self::Stage,
        Self::Expert,
        Self::Bank,
        Self::Replica,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Self::Single => "single",
            Self::Stage => "stage",
            Self::Expert => "expert",
            Self::Bank => "bank",
            Self::Replica => "replica",
        }
    }
}

impl fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Operator policy and the workload to plan for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    pub objective: Objective,
    /// Strategies the planner may use.
    pub strategies: Vec<StrategyKind>,
    /// Plans predicted to decode slower than this (batch 1) are rejected.
    pub min_tokens_per_s: Option<f64>,
    /// The largest share of any memory tier the plan may use, in (0, 1].
    pub max_memory_share: f64,
    /// Context length each sequence's KV cache is sized for.
    pub context_tokens: u64,
    /// Prompt length for time to first token; decode is predicted at this position.
    pub prompt_tokens: u64,
    /// Concurrent requests the endpoint serves.
    pub concurrency: u32,
    /// How much the workload's routing repeats experts beyond chance: an expert cache holding
    /// all but a share `d` of a node's experts misses `d^expert_reuse` of the reads
    /// ([`crate::cost::expert_miss_share`]). 1: uniform routing (every expert equally likely
    /// each token, the hit rate is the share cached); calibrated from a streaming run.
    #[serde(default = "uniform_reuse", skip_serializing_if = "is_uniform_reuse")]
    pub expert_reuse: f64,
}

fn uniform_reuse() -> f64 {
    1.0
}

fn is_uniform_reuse(r: &f64) -> bool {
    *r == 1.0
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            objective: Objective::Balanced,
            strategies: StrategyKind::ALL.to_vec(),
            min_tokens_per_s: None,
            max_memory_share: 0.9,
            context_tokens: 4096,
            prompt_tokens: 512,
            concurrency: 1,
            expert_reuse: 1.0,
        }
    }
}

impl Policy {
    pub fn allows(&self, s: StrategyKind) -> bool {
        self.strategies.contains(&s)
    }
}

/// Where a figure came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Source {
    /// A library profile or a guess: labelled an estimate, with its source.
    Estimate { source: String },
    /// Stated by the operator in the cluster file.
    Declared,
    /// Measured; `at_unix_s` is when, as supplied by the caller (the planner has no clock).
    Measured { at_unix_s: u64, method: String },
}

/// One figure the planner used, and its provenance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    /// "node a" or "link a-b".
    pub subject: String,
    pub quantity: String,
    pub value: String,
    pub source: Source,
}

/// Software time one hop between two nodes adds to a crossing beyond the link's one-way latency
/// and transfer, seconds: serialising the activation, the QUIC stack on both ends, handing the
/// message to the stage's compute thread and waking it. The default is what `tessera lab hop`
/// measured on loopback on the project's 2-core VM (dev build with optimisations, shared with
/// other jobs): 120 µs a hop (173 µs on a 0.5 ms switched link, where the switch's own
/// forwarding adds to it). Calibration learns a cluster's own figure from a ring's run.
pub const DEFAULT_HOP_OVERHEAD_S: f64 = 120e-6;

fn default_hop_overhead() -> f64 {
    DEFAULT_HOP_OVERHEAD_S
}

/// Nodes, links, policy and the evidence for every figure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResourceGraph {
    pub nodes: Vec<Node>,
    pub links: Vec<Link>,
    /// For pairs with no listed link.
    pub default_link: Option<LinkSpec>,
    pub policy: Policy,
    pub evidence: Vec<Evidence>,
    /// Fixed time the runtime adds to every generated token, on top of the nodes' work and the
    /// hops (dispatch, hand-offs between threads, control messages), seconds. Zero unless
    /// calibration measured it (or the caller knows it).
    #[serde(default)]
    pub token_overhead_s: f64,
    /// What each hop between distinct nodes adds beyond the link (see [`DEFAULT_HOP_OVERHEAD_S`]),
    /// seconds per crossing.
    #[serde(default = "default_hop_overhead")]
    pub hop_overhead_s: f64,
    /// Nodes that share one machine's cores (emulated hosts, several nodes started on one
    /// computer): when several of them compute at once they divide its cores.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub machines: Vec<SharedMachine>,
}

/// Nodes that compute on one machine's cores. Each node's figures are what it computes alone,
/// on `node_cores` cores (the threads it computes with); when nodes of the machine compute at
/// once and want more than its `cores`, each gets its share: every rate of theirs scales by
/// `cores / cores wanted`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedMachine {
    pub name: String,
    /// What the machine's cores compute at once, in units of one core computing alone: its
    /// core count where they add up, less where they share caches, memory or physical cores
    /// (the lab measures it: see `tessera_lab::run::machine`).
    pub cores: f64,
    /// Cores one node's figures were measured on.
    pub node_cores: f64,
    pub nodes: Vec<String>,
}

impl SharedMachine {
    /// The share of its own speed each of `busy` nodes computing at once on this machine gets
    /// (1: no contention).
    pub fn share(&self, busy: usize) -> f64 {
        let wanted = busy as f64 * self.node_cores;
        if wanted <= self.cores || wanted <= 0.0 {
            1.0
        } else {
            self.cores / wanted
        }
    }
}

impl Default for ResourceGraph {
    fn default() -> Self {
        Self {
            nodes: Vec::new(),
            links: Vec::new(),
            default_link: None,
            policy: Policy::default(),
            evidence: Vec::new(),
            token_overhead_s: 0.0,
            hop_overhead_s: DEFAULT_HOP_OVERHEAD_S,
            machines: Vec::new(),
        }
    }
}

/// Errors reading a cluster file.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster file is not valid TOML: {0}")]
    Toml(#[from] toml::de::Error),
    #[error(transparent)]
    Unit(#[from] UnitError),
    #[error("unknown profile {0:?} (see `tessera plan --list-profiles`)")]
    UnknownProfile(String),
    #[error("node {node:?} has no profile and does not state {field}")]
    MissingFigure { node: String, field: &'static str },
    #[error("link names unknown node {0:?}")]
    UnknownNode(String),
    #[error("invalid cluster file: {0}")]
    Invalid(String),
}

impl ResourceGraph {
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The link between two distinct nodes: the listed one, else the default.
    pub fn link(&self, a: &str, b: &str) -> Option<LinkSpec> {
        self.links
            .iter()
            .find(|l| (l.a == a && l.b == b) || (l.a == b && l.b == a))
            .map(|l| l.spec)
            .or(self.default_link)
    }

    /// The machine whose cores `node` shares with other nodes, if any.
    pub fn machine_of(&self, node: &str) -> Option<&SharedMachine> {
        self.machines
            .iter()
            .find(|m| m.nodes.iter().any(|n| n == node))
    }

    /// Adds a node with evidence for each of its figures.
    pub fn add_node(&mut self, node: Node, source: Source) {
        for (q, v) in node_figures(&node) {
            self.set_evidence(&format!("node {}", node.name), q, v, source.clone());
        }
        self.nodes.push(node);
    }

    /// Adds a link with evidence for its figures.
    pub fn add_link(
        &mut self,
        a: &str,
        b: &str,
        spec: LinkSpec,
        profile: Option<String>,
        source: Source,
    ) {
        let subject = link_subject(a, b);
        self.set_evidence(
            &subject,
            "rtt",
            format!("{:.3} ms", spec.rtt_s * 1e3),
            source.clone(),
        );
        self.set_evidence(&subject, "bandwidth", spec.bandwidth.to_string(), source);
        self.links.push(Link {
            a: a.to_string(),
            b: b.to_string(),
            profile,
            spec,
        });
    }

    /// The evidence for one figure of the link between `a` and `b` (either order).
    pub fn link_evidence(&self, a: &str, b: &str, quantity: &str) -> Option<&Evidence> {
        let subject = link_subject(a, b);
        self.evidence
            .iter()
            .find(|e| e.subject == subject && e.quantity == quantity)
    }

    /// Records (or replaces) the evidence for one figure.
    pub fn set_evidence(&mut self, subject: &str, quantity: &str, value: String, source: Source) {
        if let Some(e) = self
            .evidence
            .iter_mut()
            .find(|e| e.subject == subject && e.quantity == quantity)
        {
            e.value = value;
            e.source = source;
        } else {
            self.evidence.push(Evidence {
                subject: subject.to_string(),
                quantity: quantity.to_string(),
                value,
                source,
            });
        }
    }
}

pub(crate) fn link_subject(a: &str, b: &str) -> String {
    if a <= b {
        format!("link {a}-{b}")
    } else {
        format!("link {b}-{a}")
    }
}

fn node_figures(n: &Node) -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("ram", n.ram.capacity.to_string()),
        ("mem_bandwidth", n.ram.bandwidth.to_string()),
        ("ram_compute", n.ram_compute.to_string()),
    ];
    if let Some(t) = n.vram {
        v.push(("vram", t.capacity.to_string()));
        v.push(("vram_bandwidth", t.bandwidth.to_string()));
        v.push(("gpu_compute", n.gpu_compute.to_string()));
    }
    if let Some(t) = n.disk {
        v.push(("disk", t.capacity.to_string()));
        v.push(("disk_bandwidth", t.bandwidth.to_string()));
    }
    if let Some(b) = n.memory_budget {
        v.push(("memory_budget", b.to_string()));
    }
    v
}
