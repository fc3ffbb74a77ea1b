//! The cost model. A node's share of the model is a load (weight chunks, KV cache, activations); the
//! load is placed into the node's tiers (VRAM, then RAM, then disk for weights that tolerate it, the
//! most-read bytes in the fastest tier); a step's time on the node is, per tier, the larger of the
//! time to read the bytes it touches and the time to compute on them. Cells add network hops.
//!
//! Every constant here is an estimate and is named.
//!
//! The parts live in submodules: `memory` places a node's load into its tiers, `step` costs a
//! node's step and a cell's pass over its nodes and hops, and `throughput` costs a cell under
//! concurrency; this module holds the constants, [`Ctx`] and the entry points the strategies call.

mod hit_rate;
mod memory;
mod slowest_owner;
mod step;
mod throughput;

pub use hit_rate::{expert_miss_share, MAX_EXPERT_REUSE};
pub(crate) use memory::place_assignment;
pub(crate) use step::contact_probability;

use crate::model::ModelProfile;
use crate::plan::{Assignment, Cell, CellKind, Prediction};
use crate::resources::{LinkSpec, Node, Policy, ResourceGraph};
use crate::units::{Bytes, BytesPerSec};
use memory::{load_for, place};
use step::{pass, Mode};
use throughput::throughput;

/// Host memory a runtime takes beside its weights, KV cache and activation buffers (process,
/// threads' stacks, network buffers, tokenizer, page tables). Measured: `tessera serve` of a
/// 254 MiB model held 22 MiB more than its weights when idle (2026-12-02);
/// the rest is margin for the allocator's slack.
pub const RUNTIME_OVERHEAD_RAM: Bytes = Bytes::mib(64);
/// GPU memory a runtime takes before any weights (estimate: CUDA/Metal context and scratch).
pub const RUNTIME_OVERHEAD_VRAM: Bytes = Bytes::mib(300);
/// Tokens per prefill micro-batch, which sizes the activation buffers (as llama.cpp's ubatch).
pub const PREFILL_UBATCH: u64 = 512;
/// Rows of logits the head stage's buffers hold: a decode batch (the gateway's default
/// `--max-batch`).
pub const LOGIT_ROWS: u64 = 16;
/// Bytes of a sampled token id handed from the last stage back to the first.
pub const TOKEN_WIRE_BYTES: f64 = 4.0;

/// What the cost model needs to see.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub model: &'a ModelProfile,
    pub graph: &'a ResourceGraph,
    pub policy: &'a Policy,
}

impl Ctx<'_> {
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.graph.node(name)
    }
    pub fn link(&self, a: &str, b: &str) -> Option<LinkSpec> {
        if a == b {
            Some(LinkSpec {
                rtt_s: 0.0,
                bandwidth: BytesPerSec(f64::INFINITY),
            })
        } else {
            self.graph.link(a, b)
        }
    }
    /// The software cost of one crossing from `a` to `b` (none within a node).
    pub fn hop_overhead(&self, a: &str, b: &str) -> f64 {
        if a == b {
            0.0
        } else {
            self.graph.hop_overhead_s
        }
    }
}

/// The memory a node may give the plan: its budget, capped by the policy's share of its tiers.
pub fn usable_memory(node: &Node, policy: &Policy) -> Bytes {
    let share = policy.max_memory_share;
    let tiers =
        node.ram.capacity.as_f64() * share + node.vram.map_or(0.0, |t| t.capacity.as_f64() * share);
    let tiers = Bytes(tiers.floor() as u64);
    node.memory_budget.map_or(tiers, |b| b.min(tiers))
}

/// Places each assignment of a cell (recording the memory it takes); fails with the first
/// reason one cannot be placed.
fn placed(ctx: &Ctx, a: &mut [Assignment], seqs: u32) -> Result<Vec<memory::Placement>, String> {
    let mut pl = Vec::with_capacity(a.len());
    for x in a.iter_mut() {
        let p = place_assignment(ctx, x, seqs)?;
        x.memory = p.memory;
        pl.push(p);
    }
    Ok(pl)
}

/// Places and costs a cell; fails with the first reason it is illegal.
pub(crate) fn evaluate(
    ctx: &Ctx,
    kind: CellKind,
    mut a: Vec<Assignment>,
    seqs: u32,
) -> Result<Cell, String> {
    let pl = placed(ctx, &mut a, seqs)?;
    let at = ctx.policy.prompt_tokens as f64;
    let decode = pass(
        ctx,
        kind,
        &a,
        &pl,
        Mode::Decode {
            batch: 1.0,
            ctx: at,
        },
    )?;
    let prefill = pass(ctx, kind, &a, &pl, Mode::Prefill { tokens: at })?;
    if !(decode.total.total_s.is_finite() && decode.total.total_s > 0.0) {
        return Err("predicted time is not finite".into());
    }
    let thr = throughput(ctx, kind, &a, &pl, seqs)?;
    let curve = (1..=seqs.max(1))
        .map(|c| throughput(ctx, kind, &a, &pl, c))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Cell {
        kind,
        assignments: a,
        sequences: seqs.max(1),
        predicted: Prediction {
            decode_tokens_per_s: 1.0 / decode.total.total_s,
            ttft_s: prefill.total.total_s,
            throughput_tokens_per_s: thr,
            concurrency: seqs.max(1),
            prompt_tokens: ctx.policy.prompt_tokens,
            decode: decode.total,
            prefill: prefill.total,
            stages: decode.stages,
            hops: decode.hops,
        },
        throughput_curve: curve,
    })
}

/// Time of one decode turn of one request whose step carries `rows` rows (the last accepted
/// token and its drafts, when it speculates) through a cell: every stage computes the rows at
/// once and every hop carries them, with the runtime's cost per token once.
pub(crate) fn turn_s(
    ctx: &Ctx,
    kind: CellKind,
    mut a: Vec<Assignment>,
    seqs: u32,
    rows: f64,
) -> Result<f64, String> {
    let pl = placed(ctx, &mut a, seqs)?;
    let mode = Mode::Decode {
        batch: rows.max(1.0),
        ctx: ctx.policy.prompt_tokens as f64,
    };
    Ok(pass(ctx, kind, &a, &pl, mode)?.total.total_s)
}

/// Time of one decode token at batch 1 on one node holding `a` (used by the stage DP); `None` when
/// the node cannot hold it.
pub(crate) fn stage_time(
    ctx: &Ctx,
    node: &Node,
    a: &Assignment,
    seqs: u32,
    batch: f64,
) -> Option<f64> {
    let p = place(node, &load_for(ctx.model, a), ctx.policy, seqs).ok()?;
    Some(
        p.step(batch, ctx.policy.prompt_tokens as f64)
            .total()
            .total_s,
    )
}

/// Per-layer expert time on a node holding `k` experts of every MoE layer next to `base` (the home's
/// own share), or `None` when it cannot hold them.
pub(crate) fn expert_layer_time(
    ctx: &Ctx,
    node: &Node,
    base: &Assignment,
    seqs: u32,
) -> Option<f64> {
    let p = place(node, &load_for(ctx.model, base), ctx.policy, seqs).ok()?;
    let n_moe = ctx.model.moe_layers().max(1) as f64;
    Some(p.step(1.0, ctx.policy.prompt_tokens as f64).experts.total_s / n_moe)
}

#[cfg(test)]
mod tests {
    //! Fixtures the memory and step tests share: a small MoE model, an assignment of all of it,
    //! and a node with chosen tiers.

    use crate::model::ModelProfile;
    use crate::plan::{Assignment, LayerRange};
    use crate::resources::Node;
    use crate::units::{Bytes, BytesPerSec, FlopsPerSec};

    pub(super) const MOE: &str = r#"{"model_type":"qwen3_moe","hidden_size":1024,"num_hidden_layers":12,
        "num_attention_heads":16,"num_key_value_heads":4,"head_dim":128,"intermediate_size":3072,
        "moe_intermediate_size":512,"num_experts":64,"num_experts_per_tok":8,"vocab_size":32000,
        "tie_word_embeddings":true}"#;

    pub(super) fn whole(m: &ModelProfile) -> Assignment {
        let l = m.n_layers();
        Assignment {
            layers: Some(LayerRange::new(0, l)),
            ffn: Some(LayerRange::new(0, l)),
            experts: Some(crate::plan::ExpertSlice {
                layers: LayerRange::new(0, l),
                experts: LayerRange::new(0, m.n_expert as usize),
            }),
            embedding: true,
            head: true,
            ..Assignment::empty("n")
        }
    }

    pub(super) fn node(ram_mib: u64, vram_mib: u64, disk: bool) -> Node {
        Node {
            name: "n".into(),
            profile: None,
            vram: (vram_mib > 0).then_some(crate::resources::Tier {
                capacity: Bytes::mib(vram_mib),
                bandwidth: BytesPerSec::gb_s(300.0),
            }),
            gpu_compute: FlopsPerSec::tflops(10.0),
            ram: crate::resources::Tier {
                capacity: Bytes::mib(ram_mib),
                bandwidth: BytesPerSec::gb_s(30.0),
            },
            ram_compute: FlopsPerSec::tflops(0.5),
            disk: disk.then_some(crate::resources::Tier {
                capacity: Bytes::gib(100),
                bandwidth: BytesPerSec::gb_s(2.0),
            }),
            memory_budget: None,
        }
    }
}
