//! # tessera-plan: choose the best split for this model on these machines
//!
//! A pure crate (no I/O, no clock): a model profile, a resource graph and a policy come in as data;
//! an immutable, hashed plan and an explanation come out.
//!
//! The flow:
//!
//! 1. **Model profile** ([`ModelProfile`]): weight bytes per layer (attention, dense FFN, router, each
//!    expert), KV bytes and FLOPs per token, embedding and head — from a Hugging Face `config.json`
//!    plus a [`Quant`] ([`ModelProfile::from_hf_config`]), or converted by the caller from a GGUF
//!    header.
//! 2. **Resource graph** ([`ResourceGraph`]): nodes with memory tiers (VRAM, RAM, disk), compute
//!    rates and budgets; links with round trip and bandwidth; the operator's [`Policy`]; and the
//!    [`Evidence`] behind every figure. Parsed from a cluster file ([`ResourceGraph::from_toml`]) whose
//!    nodes may name a library [profile](profiles) or state measured figures.
//! 3. **Strategies** generate legal candidates: single node, stage ring (exact DP), expert split,
//!    weight bank, whole-request replicas (cells of single nodes or rings).
//! 4. **Cost model**: decode tokens/s at batch 1, time to first token, throughput at the policy's
//!    concurrency, memory per node — each with its terms (compute, memory, disk, latency, transfer).
//! 5. **Choice** ([`plan()`]): the best candidate under the objective; a candidate no better than one
//!    on fewer of its nodes is refused with the network cost and the compute it would save.
//! 6. **Calibration** ([`calibrate()`]): measured figures correct per-node rates and link round trips.
//!
//! ```
//! use tessera_plan::{plan, render_text, ModelProfile, Quant, ResourceGraph, StrategyKind};
//!
//! // A small Qwen3-style dense model, planned before downloading it.
//! let config = r#"{"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
//!     "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
//!     "intermediate_size": 3072, "vocab_size": 32000, "tie_word_embeddings": true}"#;
//! let model = ModelProfile::from_hf_config(config, Quant::Q8_0)?;
//!
//! // Two machines from the profile library on gigabit Ethernet; the board has only 1 GiB to give.
//! let cluster = ResourceGraph::from_toml(r#"
//!     [defaults]
//!     link = "1gbe"
//!     [policy]
//!     objective = "latency"
//!     [[node]]
//!     name = "desk"
//!     profile = "rtx3060-12gb"
//!     [[node]]
//!     name = "board"
//!     profile = "rk3588-8gb-nvme"
//!     memory_budget = "1GiB"
//! "#)?;
//!
//! let outcome = plan(&model, &cluster, 1)?;
//! // The model fits on the GPU, so no split: the network would only add hops.
//! assert_eq!(outcome.plan.strategy, StrategyKind::Single);
//! assert_eq!(outcome.plan.nodes(), ["desk"]);
//! assert!(outcome.plan.predicted.decode_tokens_per_s > 100.0);
//! // The same input gives the same plan hash.
//! assert_eq!(plan(&model, &cluster, 1)?.plan.hash, outcome.plan.hash);
//! // Every refused candidate carries its reason.
//! assert!(outcome.explanation.rejected.iter().any(|r| r.reason.contains("board")));
//! let json = outcome.to_json();
//! assert_eq!(json["strategy"], "single");
//! assert!(json["assignments"][0]["memory"]["total"].as_u64().unwrap() > 0);
//! println!("{}", render_text(&outcome));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]

pub mod calibrate;
mod cluster_write;
mod cost;
mod expert_reuse;
pub mod explain;
pub mod model;
pub mod plan;
mod planner;
pub mod profiles;
pub mod resources;
pub mod speculation;
mod strategies;
pub mod units;

pub use calibrate::{
    apply_calibrated, calibrate, calibrate_batching, calibrate_hop_overhead,
    calibrate_node_to_token_time, calibrate_nodes, predict, Calibration, HopCalibration,
    HopMeasurement, Measurement, StageMeasurement,
};
pub use cost::{
    expert_miss_share, usable_memory, MAX_EXPERT_REUSE, PREFILL_UBATCH, RUNTIME_OVERHEAD_RAM,
    RUNTIME_OVERHEAD_VRAM,
};
pub use expert_reuse::{fit_expert_reuse, CacheMeasurement};
pub use explain::render_text;
pub use model::{LayerProfile, ModelError, ModelProfile, Quant};
pub use plan::{
    Assignment, AutoPlanRecord, Candidate, Cell, CellKind, ExpertSlice, Explanation, HopTerms,
    LayerRange, MemoryUse, Plan, PlanOutcome, Prediction, Rejection, StageTerms, Summary, Terms,
};
pub use planner::plan;
pub use resources::{
    ClusterError, Evidence, Link, LinkSpec, Node, Objective, Policy, ResourceGraph, SharedMachine,
    Source, StrategyKind, Tier, DEFAULT_HOP_OVERHEAD_S,
};
pub use units::{Bytes, BytesPerSec, FlopsPerSec, UnitError};

/// Why planning failed.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("the cluster has no nodes")]
    NoNodes,
    #[error("node {0:?} is listed twice")]
    DuplicateNode(String),
    #[error("no feasible plan:\n{}", .rejected.iter().map(|r| format!("  - [{}] {}", r.strategy, r.reason)).collect::<Vec<_>>().join("\n"))]
    NoFeasiblePlan { rejected: Vec<Rejection> },
    #[error("cannot re-cost the plan: {0}")]
    Recost(String),
}
