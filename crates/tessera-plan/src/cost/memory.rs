//! Memory placement: a node's share of the model as a load (weight chunks, KV cache, activations)
//! and where that load goes among the node's tiers. Kept apart from step costing, which only reads
//! the finished placement.

use super::{
    usable_memory, Ctx, LOGIT_ROWS, PREFILL_UBATCH, RUNTIME_OVERHEAD_RAM, RUNTIME_OVERHEAD_VRAM,
};
use crate::model::ModelProfile;
use crate::plan::{Assignment, MemoryUse};
use crate::resources::{Node, Policy};
use crate::units::{Bytes, BytesPerSec, FlopsPerSec};

#[derive(Debug, Clone, Copy)]
pub(super) struct Chunk {
    pub(super) resident: f64,
    /// Share of `resident` read per token at batch 1.
    density: f64,
    /// For experts: the chance a token selects one given expert.
    pub(super) expert_p: Option<f64>,
    pub(super) flops: f64,
    disk_ok: bool,
}

impl Chunk {
    /// Share of the chunk a step of `batch` tokens touches.
    pub(super) fn touched(&self, batch: f64) -> f64 {
        match self.expert_p {
            Some(p) => 1.0 - (1.0 - p).powf(batch),
            None => (self.density * batch).min(1.0),
        }
    }
}

/// What a node's attention layers cost per token of context: layers whose cache grows with the
/// context, and sliding-window layers, which hold and attend to at most their window.
#[derive(Debug, Clone, Default)]
pub(crate) struct ContextCost {
    /// KV bytes and attention FLOPs per context token of the full-attention layers.
    kv_per_ctx: f64,
    attn_per_ctx: f64,
    /// (window in tokens, KV bytes per token, attention FLOPs per context token) of each
    /// sliding-window layer.
    windowed: Vec<(f64, f64, f64)>,
}

impl ContextCost {
    fn add_layer(&mut self, l: &crate::model::LayerProfile) {
        match l.kv_window {
            Some(w) => self.windowed.push((
                w as f64,
                l.kv_per_token.as_f64(),
                l.attn_flops_per_ctx_token,
            )),
            None => {
                self.kv_per_ctx += l.kv_per_token.as_f64();
                self.attn_per_ctx += l.attn_flops_per_ctx_token;
            }
        }
    }

    /// KV bytes one sequence holds at `ctx` tokens of context (also what a decode step at that
    /// context reads).
    pub(super) fn kv_bytes(&self, ctx: f64) -> f64 {
        self.kv_per_ctx * ctx
            + self
                .windowed
                .iter()
                .map(|(w, b, _)| ctx.min(*w) * b)
                .sum::<f64>()
    }

    /// Attention-score FLOPs of one decode step at `ctx` tokens of context.
    pub(super) fn attn_flops(&self, ctx: f64) -> f64 {
        self.attn_per_ctx * ctx
            + self
                .windowed
                .iter()
                .map(|(w, _, f)| ctx.min(*w) * f)
                .sum::<f64>()
    }

    /// Attention-score FLOPs of a prefill of `p` tokens: each token attends to those before it
    /// (about `p²/2` pairs), a windowed layer to at most its window.
    pub(super) fn prefill_attn_flops(&self, p: f64) -> f64 {
        let pairs = |w: f64| {
            if p <= w {
                p * p / 2.0
            } else {
                w * w / 2.0 + (p - w) * w
            }
        };
        self.attn_per_ctx * p * p / 2.0
            + self
                .windowed
                .iter()
                .map(|(w, _, f)| pairs(*w) * f)
                .sum::<f64>()
    }
}

/// A node's share of the model.
#[derive(Debug, Clone, Default)]
pub(crate) struct Load {
    /// [dense, head, experts, embedding]
    chunks: Vec<Chunk>,
    context: ContextCost,
    activations: f64,
}

/// Builds the load an assignment puts on its node.
pub(crate) fn load_for(model: &ModelProfile, a: &Assignment) -> Load {
    let mut dense = Chunk {
        resident: 0.0,
        density: 1.0,
        expert_p: None,
        flops: 0.0,
        disk_ok: false,
    };
    let mut experts = Chunk {
        resident: 0.0,
        density: 0.0,
        expert_p: None,
        flops: 0.0,
        disk_ok: true,
    };
    let mut load = Load::default();
    for (i, l) in model.layers.iter().enumerate() {
        let ne_bytes = l.non_expert().as_f64();
        let ne_flops = l.flops_per_token - f64::from(l.n_expert_used) * l.expert_flops_per_token;
        let attn_share = if ne_bytes > 0.0 {
            (l.attention + l.router).as_f64() / ne_bytes
        } else {
            1.0
        };
        if a.layers.is_some_and(|r| r.contains(i)) {
            dense.resident += (l.attention + l.router).as_f64();
            dense.flops += ne_flops * attn_share;
            load.context.add_layer(l);
        }
        if a.ffn.is_some_and(|r| r.contains(i)) {
            dense.resident += l.dense_ffn.as_f64();
            dense.flops += ne_flops * (1.0 - attn_share);
        }
        if let Some(e) = a.experts.filter(|e| e.layers.contains(i) && l.is_moe()) {
            let k = e.experts.len() as f64;
            let p = f64::from(l.n_expert_used) / f64::from(l.n_expert);
            experts.resident += k * l.expert.as_f64();
            experts.flops += p * k * l.expert_flops_per_token;
            experts.expert_p = Some(p);
            experts.density = p;
        }
    }
    load.chunks.push(dense);
    let vocab = model.vocab_size.max(1) as f64;
    let shared = model.tied_embeddings && a.head && a.embedding;
    if shared {
        // Tied embeddings on one node: one matrix, read whole as the head every token.
        load.chunks.push(Chunk {
            resident: model.head.as_f64().max(model.embedding.as_f64()),
            density: 1.0,
            expert_p: None,
            flops: model.head_flops_per_token,
            disk_ok: false,
        });
    } else if a.head {
        load.chunks.push(Chunk {
            resident: model.head.as_f64(),
            density: 1.0,
            expert_p: None,
            flops: model.head_flops_per_token,
            disk_ok: false,
        });
    }
    if experts.resident > 0.0 {
        load.chunks.push(experts);
    }
    if a.embedding && !shared {
        // One row is read per token, so it may live on disk.
        load.chunks.push(Chunk {
            resident: model.embedding.as_f64(),
            density: 1.0 / vocab,
            expert_p: None,
            flops: 0.0,
            disk_ok: true,
        });
    }
    let hidden = model.hidden_size as f64;
    // Logits are made for the positions sampled (a decode batch's rows, a prompt's last), not
    // for every position of a prefill chunk.
    load.activations = PREFILL_UBATCH as f64 * hidden * 16.0
        + if a.head {
            LOGIT_ROWS as f64 * model.vocab_size as f64 * 4.0
        } else {
            0.0
        };
    load
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TierKind {
    Vram,
    Ram,
    Disk,
}

#[derive(Debug, Clone)]
pub(super) struct TierUse {
    pub(super) kind: TierKind,
    pub(super) bw: BytesPerSec,
    pub(super) rate: FlopsPerSec,
    /// (chunk, fraction of the chunk placed here)
    pub(super) parts: Vec<(Chunk, f64)>,
    pub(super) holds_kv: bool,
}

/// A load placed into a node's tiers.
#[derive(Debug, Clone)]
pub(crate) struct Placement {
    pub(super) tiers: Vec<TierUse>,
    pub memory: MemoryUse,
    pub(super) context: ContextCost,
    /// The policy's [`Policy::expert_reuse`]: how much less than chance the experts left on
    /// disk are read.
    pub(super) expert_reuse: f64,
}

/// Places `load` on `node` with KV for `seqs` sequences of the policy's context. Fails with a
/// human reason ("needs 5.1 GiB, budget 4.0 GiB").
pub(crate) fn place(
    node: &Node,
    load: &Load,
    policy: &Policy,
    seqs: u32,
) -> Result<Placement, String> {
    let share = policy.max_memory_share;
    // Two bytes of slack keep the rounded-up figures within the integer budget and tiers.
    let usable = usable_memory(node, policy).as_f64();
    let budget = usable - 2.0;
    // A GPU whose usable memory does not exceed the runtime's own overhead takes no part.
    let vram = node
        .vram
        .filter(|t| t.capacity.as_f64() * share > RUNTIME_OVERHEAD_VRAM.as_f64());
    let vram_cap = vram.map_or(0.0, |t| (t.capacity.as_f64() * share).floor() - 1.0);
    let ram_cap = (node.ram.capacity.as_f64() * share).floor() - 1.0;
    let kv = load.context.kv_bytes(policy.context_tokens as f64) * f64::from(seqs.max(1));
    let fixed_vram = if vram.is_some() {
        RUNTIME_OVERHEAD_VRAM.as_f64()
    } else {
        0.0
    };
    let fixed_ram = RUNTIME_OVERHEAD_RAM.as_f64();
    let kv_act = kv + load.activations;
    let (mut vram_used, mut ram_used) = (fixed_vram, fixed_ram);
    let kv_in_vram = vram.is_some() && vram_used + kv_act <= vram_cap;
    if kv_in_vram {
        vram_used += kv_act;
    } else {
        ram_used += kv_act;
    }
    let weights: f64 = load.chunks.iter().map(|c| c.resident).sum();
    let diskable: f64 = load
        .chunks
        .iter()
        .filter(|c| c.disk_ok)
        .map(|c| c.resident)
        .sum();
    let disk_cap = node.disk.map_or(0.0, |t| t.capacity.as_f64());
    let shortfall = || {
        let need =
            Bytes::from_f64(fixed_vram + fixed_ram + kv_act + weights - diskable.min(disk_cap));
        format!("needs {need}, budget {}", Bytes::from_f64(usable))
    };
    if ram_used > ram_cap || vram_used + ram_used > budget {
        return Err(shortfall());
    }

    let mut tiers = Vec::new();
    if let Some(t) = vram {
        tiers.push(TierUse {
            kind: TierKind::Vram,
            bw: t.bandwidth,
            rate: node.gpu_compute,
            parts: vec![],
            holds_kv: kv_in_vram,
        });
    }
    tiers.push(TierUse {
        kind: TierKind::Ram,
        bw: node.ram.bandwidth,
        rate: node.ram_compute,
        parts: vec![],
        holds_kv: !kv_in_vram,
    });
    if let Some(t) = node.disk {
        tiers.push(TierUse {
            kind: TierKind::Disk,
            bw: t.bandwidth,
            rate: node.ram_compute,
            parts: vec![],
            holds_kv: false,
        });
    }
    let mut order: Vec<Chunk> = load
        .chunks
        .iter()
        .copied()
        .filter(|c| c.resident > 0.0)
        .collect();
    // The most-read bytes go to the fastest tier (stable: ties keep the load's order).
    order.sort_by(|a, b| b.density.total_cmp(&a.density));
    let mut disk_used = 0.0;
    for c in order {
        let mut left = c.resident;
        for t in tiers.iter_mut() {
            if left <= 0.0 {
                break;
            }
            let room = match t.kind {
                TierKind::Vram => (vram_cap - vram_used).min(budget - vram_used - ram_used),
                TierKind::Ram => (ram_cap - ram_used).min(budget - vram_used - ram_used),
                TierKind::Disk if c.disk_ok => disk_cap - disk_used,
                TierKind::Disk => 0.0,
            };
            let put = left.min(room.max(0.0));
            if put <= 0.0 {
                continue;
            }
            match t.kind {
                TierKind::Vram => vram_used += put,
                TierKind::Ram => ram_used += put,
                TierKind::Disk => disk_used += put,
            }
            t.parts.push((c, put / c.resident));
            left -= put;
        }
        if left > c.resident * 1e-12 + 0.5 {
            return Err(shortfall());
        }
    }
    let experts_on_disk: f64 = tiers
        .iter()
        .filter(|t| t.kind == TierKind::Disk)
        .flat_map(|t| &t.parts)
        .filter(|(c, _)| c.expert_p.is_some())
        .map(|(c, f)| c.resident * f)
        .sum();
    let memory = MemoryUse {
        vram: Bytes::from_f64(vram_used),
        ram: Bytes::from_f64(ram_used),
        disk: Bytes::from_f64(disk_used),
        experts_on_disk: Bytes::from_f64(experts_on_disk),
        total: Bytes::from_f64(vram_used) + Bytes::from_f64(ram_used),
        weights: Bytes::from_f64(weights - disk_used),
        kv_cache: Bytes::from_f64(kv),
        activations: Bytes::from_f64(load.activations),
        runtime_overhead: Bytes::from_f64(fixed_vram + fixed_ram),
        budget: Bytes::from_f64(usable),
    };
    Ok(Placement {
        tiers,
        memory,
        context: load.context.clone(),
        expert_reuse: policy.expert_reuse,
    })
}

/// Places an assignment, naming the node in the failure.
pub(crate) fn place_assignment(ctx: &Ctx, a: &Assignment, seqs: u32) -> Result<Placement, String> {
    let node = ctx
        .node(&a.node)
        .ok_or_else(|| format!("node {} is not in the cluster", a.node))?;
    place(node, &load_for(ctx.model, a), ctx.policy, seqs)
        .map_err(|e| format!("node {} {e}", a.node))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::tests::{node, whole, MOE};
    use crate::model::Quant;
    use crate::plan::LayerRange;

    #[test]
    fn dense_weights_take_the_fast_tier_and_experts_spill_to_disk() {
        let m = ModelProfile::from_hf_config(MOE, Quant::Q8_0).unwrap();
        let policy = Policy {
            context_tokens: 512,
            ..Policy::default()
        };
        let load = load_for(&m, &whole(&m));
        // VRAM too small for everything: all dense weights must be in it before any expert.
        let p = place(&node(8192, 600, false), &load, &policy, 1).unwrap();
        let vram = &p.tiers[0];
        assert_eq!(vram.kind, TierKind::Vram);
        let dense_in = |t: &TierUse| {
            t.parts
                .iter()
                .filter(|(c, _)| c.expert_p.is_none())
                .map(|(_, f)| f)
                .sum::<f64>()
        };
        assert!(
            (dense_in(vram) - 2.0).abs() < 1e-9,
            "both dense chunks wholly in VRAM"
        );
        assert_eq!(dense_in(&p.tiers[1]), 0.0, "no dense weights in RAM");
        assert!(
            vram.parts.iter().any(|(c, _)| c.expert_p.is_some()),
            "experts fill the rest of VRAM"
        );
        // Too little memory: experts go to disk; without a disk the placement fails with a reason.
        let p = place(&node(700, 0, true), &load, &policy, 1).unwrap();
        assert!(p.memory.disk.0 > 0);
        assert!(p.step(1.0, 512.0).experts.disk_s > 0.0);
        // The experts on disk, what the node streams, are counted apart from an untied
        // embedding (a row a token, the least read: on disk before any expert).
        let embedding_on_disk = |m: &ModelProfile| {
            if m.tied_embeddings {
                0
            } else {
                m.embedding.0
            }
        };
        assert_eq!(
            p.memory.experts_on_disk.0 + embedding_on_disk(&m),
            p.memory.disk.0
        );
        let mut untied = m.clone();
        untied.tied_embeddings = false;
        let p = place(
            &node(700, 0, true),
            &load_for(&untied, &whole(&untied)),
            &policy,
            1,
        )
        .unwrap();
        assert!(untied.embedding.0 > 0);
        assert_eq!(
            p.memory.experts_on_disk.0 + embedding_on_disk(&untied),
            p.memory.disk.0
        );
        let e = place(&node(700, 0, false), &load, &policy, 1).unwrap_err();
        assert!(e.starts_with("needs ") && e.contains(", budget "), "{e}");
    }

    #[test]
    fn sliding_window_layers_cost_a_window_of_kv_memory_and_reads() {
        let m = ModelProfile::from_hf_config(
            include_str!("../../models/gpt-oss-120b.config.json"),
            Quant::Q4_K,
        )
        .unwrap();
        let mut unwindowed = m.clone();
        unwindowed
            .layers
            .iter_mut()
            .for_each(|l| l.kv_window = None);
        let policy = Policy {
            context_tokens: 65_536,
            ..Policy::default()
        };
        let big = node(512 * 1024, 0, false);
        let place_for =
            |m: &ModelProfile| place(&big, &load_for(m, &whole(m)), &policy, 2).unwrap();
        let (p, full) = (place_for(&m), place_for(&unwindowed));
        // Two sequences of 64K: 18 full layers hold every position, 18 sliding ones 128.
        assert_eq!(p.memory.kv_cache, Bytes(2 * m.kv_bytes_at(65_536).0));
        assert_eq!(
            p.memory.kv_cache,
            Bytes(2 * 2048 * (18 * 65_536 + 18 * 128))
        );
        assert_eq!(full.memory.kv_cache, Bytes(2 * 2048 * 36 * 65_536));
        // A decode step at long context reads and scores about half the positions; within the
        // window the two models are the same.
        let kv_read = |p: &Placement, ctx: f64| p.context.kv_bytes(ctx);
        assert_eq!(kv_read(&p, 100.0), kv_read(&full, 100.0));
        let ratio = kv_read(&p, 65_536.0) / kv_read(&full, 65_536.0);
        assert!((0.5..0.51).contains(&ratio), "{ratio}");
        assert!(p.step(1.0, 65_536.0).dense.total_s < full.step(1.0, 65_536.0).dense.total_s);
        // Prefill of 4,096 tokens: a windowed layer scores 128·64 + (4096-128)·128 pairs.
        let pairs = 128.0 * 128.0 / 2.0 + (4096.0 - 128.0) * 128.0;
        let f = m.layers[0].attn_flops_per_ctx_token;
        let expected = 18.0 * f * 4096.0 * 4096.0 / 2.0 + 18.0 * f * pairs;
        let got = p.context.prefill_attn_flops(4096.0);
        assert!((got - expected).abs() < 1e-6 * expected, "{got} {expected}");
    }

    #[test]
    fn a_last_stage_with_tied_embeddings_loads_the_matrix_and_pays_for_the_head() {
        let m = ModelProfile::from_hf_config(MOE, Quant::Q8_0).unwrap();
        assert!(m.tied_embeddings);
        let last = Assignment {
            head: true,
            ..Assignment::empty("n")
        };
        let first = Assignment {
            embedding: true,
            layers: Some(LayerRange::new(0, 1)),
            ..Assignment::empty("n")
        };
        let resident = |a: &Assignment| {
            load_for(&m, a)
                .chunks
                .iter()
                .map(|c| c.resident)
                .sum::<f64>()
        };
        assert!(resident(&last) >= m.embedding.as_f64());
        assert!(resident(&first) >= m.embedding.as_f64());
        // One node holding both keeps one copy, and still computes the head.
        let both = whole(&m);
        let all: f64 = resident(&both);
        assert!(
            (all - m.total_weights().as_f64()).abs()
                <= m.head.as_f64() - m.embedding.as_f64() + 1.0
        );
        let flops: f64 = load_for(&m, &both).chunks.iter().map(|c| c.flops).sum();
        assert!(flops >= m.head_flops_per_token);
    }
}
