//! The resource graph: nodes (memory tiers, compute units, the contributor's budget), links, operator
//! policy, and the evidence behind every figure. Parsed from a cluster file (TOML text) or built by
//! the coordinator from measured inventory.

use crate::profiles;
use crate::units::{self, Bytes, BytesPerSec, FlopsPerSec, UnitError};
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
