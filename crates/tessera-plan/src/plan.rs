//! The planner's output: an immutable plan (epoch, content hash, evidence, cells of assignments,
//! predicted figures with their terms) and the explanation of why it was chosen.

use crate::resources::{Evidence, Objective, Policy, ResourceGraph, StrategyKind};
use crate::units::Bytes;
use serde::{Deserialize, Serialize};

/// A half-open layer range `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerRange {
    pub start: u32,
    pub end: u32,
}

impl LayerRange {
    pub fn new(start: usize, end: usize) -> Self {
        Self {
            start: start as u32,
            end: end as u32,
        }
    }
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start) as usize
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn contains(&self, i: usize) -> bool {
        (self.start as usize..self.end as usize).contains(&i)
    }
    pub fn iter(&self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }
}

impl std::fmt::Display for LayerRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {})", self.start, self.end)
    }
}

/// Experts `experts` of every MoE layer in `layers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExpertSlice {
    pub layers: LayerRange,
    pub experts: LayerRange,
}

/// A node's predicted memory use for its assignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemoryUse {
    pub vram: Bytes,
    pub ram: Bytes,
    /// Weights streamed from local storage (not counted against the memory budget).
    pub disk: Bytes,
    /// The experts among them (the rest is the embedding, read a row a token): what a node
    /// streams from its expert store.
    #[serde(default)]
    pub experts_on_disk: Bytes,
    /// VRAM + RAM: what counts against the budget.
    pub total: Bytes,
    pub weights: Bytes,
    pub kv_cache: Bytes,
    pub activations: Bytes,
    pub runtime_overhead: Bytes,
    /// The node's usable memory under its budget and the policy's memory share.
    pub budget: Bytes,
}

/// What one node holds in one cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub node: String,
    /// Attention (with norms), router and KV cache of these layers.
    pub layers: Option<LayerRange>,
    /// Dense FFN weights of these layers.
    pub ffn: Option<LayerRange>,
    /// Experts of the MoE layers in a range.
    pub experts: Option<ExpertSlice>,
    /// Holds the token embedding (the first stage).
    pub embedding: bool,
    /// Holds the output norm and head (the last stage; with tied embeddings, the embedding matrix).
    pub head: bool,
    /// Predicted memory, filled in by the cost model.
    pub memory: MemoryUse,
}

impl Assignment {
    pub fn empty(node: &str) -> Self {
        Self {
            node: node.to_string(),
            layers: None,
            ffn: None,
            experts: None,
            embedding: false,
            head: false,
            memory: MemoryUse::default(),
        }
    }

    /// A compact human description: "layers [0, 24) + experts 0..64 + embedding".
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        match (self.layers, self.ffn) {
            (Some(l), Some(f)) if l == f => parts.push(format!("layers {l}")),
            (l, f) => {
                if let Some(l) = l {
                    parts.push(format!("attention {l}"));
                }
                if let Some(f) = f {
                    parts.push(format!("ffn {f}"));
                }
            }
        }
        if let Some(e) = self.experts {
            parts.push(format!(
                "experts {}..{} of {}",
                e.experts.start, e.experts.end, e.layers
            ));
        }
        if self.embedding {
            parts.push("embedding".into());
        }
        if self.head {
            parts.push("head".into());
        }
        parts.join(" + ")
    }
}

/// How a cell executes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CellKind {
    /// One node runs everything.
    Single,
    /// A ring of stages in assignment order; the last samples and hands the token to the first.
    Stage,
    /// The first assignment is the home (attention, router, dense FFN, embedding, head); the others
    /// own experts and are visited once per MoE layer.
    Expert,
    /// The first assignment is the main node; the second serves the FFN of a bounded set of layers.
    Bank,
}

/// A set of terms making up a predicted time; `total_s` is what the prediction uses. Per memory
/// tier the binding term is the larger of compute and memory time, so terms may sum to more than the
/// total.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Terms {
    pub compute_s: f64,
    /// Time reading VRAM and RAM.
    pub memory_s: f64,
    /// Time reading weights from local storage.
    pub disk_s: f64,
    /// Network latency (half a round trip per one-way hop).
    pub latency_s: f64,
    /// Time putting bytes on the wire.
    pub transfer_s: f64,
    pub total_s: f64,
}

impl Terms {
    pub fn add(&mut self, o: &Self) {
        self.compute_s += o.compute_s;
        self.memory_s += o.memory_s;
        self.disk_s += o.disk_s;
        self.latency_s += o.latency_s;
        self.transfer_s += o.transfer_s;
        self.total_s += o.total_s;
    }
    pub fn network_s(&self) -> f64 {
        self.latency_s + self.transfer_s
    }
    /// The largest term: what binds.
    pub fn binding(&self) -> &'static str {
        let t = [
            (self.compute_s, "compute"),
            (self.memory_s, "memory bandwidth"),
            (self.disk_s, "disk reads"),
            (self.latency_s, "network latency"),
            (self.transfer_s, "network transfer"),
        ];
        t.iter()
            .fold((f64::MIN, "nothing"), |a, b| if b.0 > a.0 { *b } else { a })
            .1
    }
}

/// Predicted time on one node for one token at batch 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageTerms {
    pub node: String,
    /// "layers", "home" (an expert split's attention side), "experts" or "bank".
    pub part: String,
    pub terms: Terms,
}

/// One network hop the plan makes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HopTerms {
    pub from: String,
    pub to: String,
    /// Times the hop is made per generated token.
    pub per_token: u32,
    pub rtt_s: f64,
    /// Bytes on the wire per token, all crossings together.
    pub wire_bytes_per_token: f64,
    /// Time per token, all crossings together.
    pub terms: Terms,
}

/// Predicted figures, with the terms behind them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Decode tokens/s for one request (batch 1) at the prompt position.
    pub decode_tokens_per_s: f64,
    /// Time to first token for `prompt_tokens`.
    pub ttft_s: f64,
    /// Aggregate tokens/s at `concurrency` requests.
    pub throughput_tokens_per_s: f64,
    pub concurrency: u32,
    pub prompt_tokens: u64,
    /// Terms of one decode step at batch 1.
    pub decode: Terms,
    /// Terms of the prefill.
    pub prefill: Terms,
    pub stages: Vec<StageTerms>,
    pub hops: Vec<HopTerms>,
}

impl Prediction {
    /// Decode tokens/s each request sees while the endpoint serves `concurrency` at once: the
    /// aggregate shared among them. At concurrency 1 this is [`Self::decode_tokens_per_s`]; above
    /// it, one node batching every request slows each of them, while replicas split the load.
    pub fn per_request_tokens_per_s(&self) -> f64 {
        self.throughput_tokens_per_s / f64::from(self.concurrency.max(1))
    }

    /// The objective's score (higher is better), priced at the policy's concurrency: latency is
    /// the speed each of the concurrent requests sees, throughput their aggregate.
    pub fn score(&self, objective: Objective) -> f64 {
        match objective {
            Objective::Latency => self.per_request_tokens_per_s(),
            Objective::Throughput => self.throughput_tokens_per_s,
            Objective::Balanced => {
                (self.per_request_tokens_per_s() * self.throughput_tokens_per_s).sqrt()
            }
        }
    }
}

/// A unit of execution: a single node, a stage ring, an expert group or a banked node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    pub kind: CellKind,
    pub assignments: Vec<Assignment>,
    /// Concurrent sequences this cell's memory is sized for.
    pub sequences: u32,
    pub predicted: Prediction,
    /// Aggregate tokens/s at 1..=sequences concurrent requests (not serialised).
    #[serde(skip)]
    pub(crate) throughput_curve: Vec<f64>,
}

impl Cell {
    pub fn nodes(&self) -> Vec<&str> {
        self.assignments.iter().map(|a| a.node.as_str()).collect()
    }
}

/// A legal, costed way of placing the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub strategy: StrategyKind,
    pub description: String,
    pub cells: Vec<Cell>,
    pub predicted: Prediction,
}

impl Candidate {
    pub fn nodes(&self) -> Vec<&str> {
        self.cells.iter().flat_map(Cell::nodes).collect()
    }
}

/// A candidate the planner did not choose, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rejection {
    pub strategy: StrategyKind,
    pub nodes: Vec<String>,
    pub reason: String,
    /// The prediction, when the candidate was legal but lost on network physics or policy.
    pub decode_tokens_per_s: Option<f64>,
}

/// A row of the explanation's tables.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub strategy: StrategyKind,
    pub nodes: Vec<String>,
    pub description: String,
    pub decode_tokens_per_s: f64,
    pub ttft_s: f64,
    pub throughput_tokens_per_s: f64,
    pub score: f64,
    pub binding: String,
    /// Network time (latency and transfer) per decoded token on the critical path, seconds.
    pub network_s_per_token: f64,
    /// Why it ranks where it does.
    pub reason: String,
}

impl Summary {
    pub fn of(c: &Candidate, objective: Objective) -> Self {
        Self {
            strategy: c.strategy,
            nodes: c.nodes().into_iter().map(str::to_string).collect(),
            description: c.description.clone(),
            decode_tokens_per_s: c.predicted.decode_tokens_per_s,
            ttft_s: c.predicted.ttft_s,
            throughput_tokens_per_s: c.predicted.throughput_tokens_per_s,
            score: c.predicted.score(objective),
            binding: c.predicted.decode.binding().to_string(),
            network_s_per_token: c.predicted.decode.network_s(),
            reason: String::new(),
        }
    }
}

/// Why the plan is what it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Explanation {
    pub objective: Objective,
    pub chosen: Summary,
    /// Feasible runners-up, best first.
    pub alternatives: Vec<Summary>,
    /// Every candidate that was illegal, below policy, or slower than using fewer nodes.
    pub rejected: Vec<Rejection>,
    pub notes: Vec<String>,
}

/// An immutable placement of a model on a cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Supplied by the caller; a new plan is a new epoch.
    pub epoch: u64,
    /// blake3 (hex) of the canonical JSON of everything below except the epoch.
    pub hash: String,
    pub model: String,
    pub strategy: StrategyKind,
    pub cells: Vec<Cell>,
    pub predicted: Prediction,
    pub policy: Policy,
    /// The figures of the nodes and links the plan uses, with where each came from.
    pub evidence: Vec<Evidence>,
}

#[derive(Serialize)]
struct HashedContent<'a> {
    model: &'a str,
    strategy: StrategyKind,
    cells: &'a [Cell],
    predicted: &'a Prediction,
    policy: &'a Policy,
    evidence: &'a [Evidence],
}

impl Plan {
    pub(crate) fn new(
        epoch: u64,
        model: String,
        chosen: Candidate,
        policy: Policy,
        evidence: Vec<Evidence>,
    ) -> Self {
        let mut p = Self {
            epoch,
            hash: String::new(),
            model,
            strategy: chosen.strategy,
            cells: chosen.cells,
            predicted: chosen.predicted,
            policy,
            evidence,
        };
        p.hash = p.content_hash();
        p
    }

    /// Recomputes the content hash (equal to `hash` unless the plan was altered).
    pub fn content_hash(&self) -> String {
        let body = HashedContent {
            model: &self.model,
            strategy: self.strategy,
            cells: &self.cells,
            predicted: &self.predicted,
            policy: &self.policy,
            evidence: &self.evidence,
        };
        let bytes = serde_json::to_vec(&body).expect("plan content serialises");
        blake3::hash(&bytes).to_hex().to_string()
    }

    /// Every assignment of every cell.
    pub fn assignments(&self) -> impl Iterator<Item = &Assignment> {
        self.cells.iter().flat_map(|c| c.assignments.iter())
    }

    /// The nodes the plan uses, in order.
    pub fn nodes(&self) -> Vec<&str> {
        self.assignments().map(|a| a.node.as_str()).collect()
    }
}

/// A plan and its explanation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanOutcome {
    pub plan: Plan,
    pub explanation: Explanation,
}

/// What `tessera coordinator --plan auto` writes to `DATA_DIR/plan-auto.json`: the resource
/// graph it planned on (the nodes' measured figures) and the planner's outcome on it. One type
/// for the coordinator that writes the file and for the lab that reads it back, so the file's
/// shape is written down once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutoPlanRecord {
    pub graph: ResourceGraph,
    pub outcome: PlanOutcome,
}

impl PlanOutcome {
    /// The `--json` document: the plan's fields, a flat `assignments` list (each with its `cell`),
    /// and the explanation's `chosen`, `alternatives`, `rejected` and `notes`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut doc = serde_json::to_value(&self.plan).expect("plan serialises");
        let assignments: Vec<serde_json::Value> = self
            .plan
            .cells
            .iter()
            .enumerate()
            .flat_map(|(i, c)| {
                c.assignments.iter().map(move |a| {
                    let mut v = serde_json::to_value(a).expect("assignment serialises");
                    v["cell"] = i.into();
                    v["holds"] = a.describe().into();
                    v
                })
            })
            .collect();
        let e = serde_json::to_value(&self.explanation).expect("explanation serialises");
        doc["assignments"] = assignments.into();
        for k in ["objective", "chosen", "alternatives", "rejected", "notes"] {
            doc[k] = e[k].clone();
        }
        doc
    }
}
