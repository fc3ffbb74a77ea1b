//! The cost model. A node's share of the model is a load (weight chunks, KV cache, activations); the
//! load is placed into the node's tiers (VRAM, then RAM, then disk for weights that tolerate it, the
//! most-read bytes in the fastest tier); a step's time on the node is, per tier, the larger of the
//! time to read the bytes it touches and the time to compute on them. Cells add network hops.
//!
//! Every constant here is an estimate and is named.

use crate::model::ModelProfile;
use crate::plan::{Assignment, Cell, CellKind, HopTerms, MemoryUse, Prediction, StageTerms, Terms};
use crate::resources::{LinkSpec, Node, Policy, ResourceGraph};
use crate::units::{Bytes, BytesPerSec, FlopsPerSec};

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

#[derive(Debug, Clone, Copy)]
struct Chunk {
    resident: f64,
    /// Share of `resident` read per token at batch 1.
    density: f64,
    /// For experts: the chance a token selects one given expert.
    expert_p: Option<f64>,
    flops: f64,
    disk_ok: bool,
}

impl Chunk {
    /// Share of the chunk a step of `batch` tokens touches.
    fn touched(&self, batch: f64) -> f64 {
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
    fn kv_bytes(&self, ctx: f64) -> f64 {
        self.kv_per_ctx * ctx
            + self
                .windowed
                .iter()
                .map(|(w, b, _)| ctx.min(*w) * b)
                .sum::<f64>()
    }

    /// Attention-score FLOPs of one decode step at `ctx` tokens of context.
    fn attn_flops(&self, ctx: f64) -> f64 {
        self.attn_per_ctx * ctx
            + self
                .windowed
                .iter()
                .map(|(w, _, f)| ctx.min(*w) * f)
                .sum::<f64>()
    }

    /// Attention-score FLOPs of a prefill of `p` tokens: each token attends to those before it
    /// (about `p²/2` pairs), a windowed layer to at most its window.
    fn prefill_attn_flops(&self, p: f64) -> f64 {
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
enum TierKind {
    Vram,
    Ram,
    Disk,
}

#[derive(Debug, Clone)]
struct TierUse {
    kind: TierKind,
    bw: BytesPerSec,
    rate: FlopsPerSec,
    /// (chunk, fraction of the chunk placed here)
    parts: Vec<(Chunk, f64)>,
    holds_kv: bool,
}

/// A load placed into a node's tiers.
#[derive(Debug, Clone)]
pub(crate) struct Placement {
    tiers: Vec<TierUse>,
    pub memory: MemoryUse,
    context: ContextCost,
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
    let memory = MemoryUse {
        vram: Bytes::from_f64(vram_used),
        ram: Bytes::from_f64(ram_used),
        disk: Bytes::from_f64(disk_used),
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
    })
}

/// Time split into the non-expert part and the expert part of a node's work.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Split {
    pub dense: Terms,
    pub experts: Terms,
}

impl Split {
    pub fn total(&self) -> Terms {
        let mut t = self.dense;
        t.add(&self.experts);
        t
    }
}

fn tier_terms(t: &TierUse, bytes: f64, flops: f64) -> Terms {
    let mem = t.bw.secs(bytes);
    let comp = t.rate.secs(flops);
    let mut terms = Terms {
        compute_s: comp,
        total_s: mem.max(comp),
        ..Terms::default()
    };
    if t.kind == TierKind::Disk {
        terms.disk_s = mem;
    } else {
        terms.memory_s = mem;
    }
    terms
}

impl Placement {
    /// One decode step of `batch` sequences, each at context position `ctx`.
    pub fn step(&self, batch: f64, ctx: f64) -> Split {
        let mut s = Split::default();
        for t in &self.tiers {
            let (mut db, mut df, mut eb, mut ef) = (0.0, 0.0, 0.0, 0.0);
            for (c, f) in &t.parts {
                let bytes = c.resident * f * c.touched(batch);
                let flops = c.flops * f * batch;
                if c.expert_p.is_some() {
                    eb += bytes;
                    ef += flops;
                } else {
                    db += bytes;
                    df += flops;
                }
            }
            if t.holds_kv {
                db += batch * self.context.kv_bytes(ctx);
                df += batch * self.context.attn_flops(ctx);
            }
            s.dense.add(&tier_terms(t, db, df));
            s.experts.add(&tier_terms(t, eb, ef));
        }
        s
    }

    /// Prefill of one prompt of `p` tokens.
    pub fn prefill(&self, p: f64) -> Split {
        let mut s = Split::default();
        for t in &self.tiers {
            let (mut db, mut df, mut eb, mut ef) = (0.0, 0.0, 0.0, 0.0);
            for (c, f) in &t.parts {
                let bytes = c.resident * f * c.touched(p);
                let flops = c.flops * f * p;
                if c.expert_p.is_some() {
                    eb += bytes;
                    ef += flops;
                } else {
                    db += bytes;
                    df += flops;
                }
            }
            if t.holds_kv {
                db += self.context.kv_bytes(p);
                df += self.context.prefill_attn_flops(p);
            }
            s.dense.add(&tier_terms(t, db, df));
            s.experts.add(&tier_terms(t, eb, ef));
        }
        s
    }
}

/// Places an assignment, naming the node in the failure.
pub(crate) fn place_assignment(ctx: &Ctx, a: &Assignment, seqs: u32) -> Result<Placement, String> {
    let node = ctx
        .node(&a.node)
        .ok_or_else(|| format!("node {} is not in the cluster", a.node))?;
    place(node, &load_for(ctx.model, a), ctx.policy, seqs)
        .map_err(|e| format!("node {} {e}", a.node))
}

/// A hop's time: per crossing, half the link's round trip, the software's cost of a hop
/// (`overhead`, see [`ResourceGraph::hop_overhead_s`]) and the transfer of `bytes`.
fn hop_terms(link: LinkSpec, overhead: f64, bytes: f64, crossings: f64) -> Terms {
    let latency = (link.rtt_s / 2.0 + overhead) * crossings;
    let transfer = link.bandwidth.secs(bytes) * crossings;
    Terms {
        latency_s: latency,
        transfer_s: transfer,
        total_s: latency + transfer,
        ..Terms::default()
    }
}

/// The chance that a step of `tokens` tokens, each routed to `used` of `n` experts (uniformly,
/// without repeats), needs at least one of `owned` experts: the chance the home must contact
/// their owner in a MoE layer (the fabric sends an owner nothing when no token needs it).
pub(crate) fn contact_probability(n: u32, used: u32, owned: usize, tokens: f64) -> f64 {
    let (n, used, owned) = (f64::from(n), f64::from(used), owned as f64);
    if owned <= 0.0 || n <= 0.0 {
        return 0.0;
    }
    // None of the token's `used` picks falls on an owned expert.
    let mut miss = 1.0;
    for j in 0..used as u32 {
        let j = f64::from(j);
        miss *= ((n - owned - j) / (n - j)).max(0.0);
    }
    1.0 - miss.powf(tokens.max(1.0))
}

/// The expected share of a step's token rows an owner of `owned` experts receives.
fn routed_share(n: u32, used: u32, owned: usize) -> f64 {
    contact_probability(n, used, owned, 1.0)
}

fn scaled(t: &Terms, k: f64) -> Terms {
    Terms {
        compute_s: t.compute_s * k,
        memory_s: t.memory_s * k,
        disk_s: t.disk_s * k,
        latency_s: t.latency_s * k,
        transfer_s: t.transfer_s * k,
        total_s: t.total_s * k,
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Decode { batch: f64, ctx: f64 },
    Prefill { tokens: f64 },
}

impl Mode {
    fn tokens(self) -> f64 {
        match self {
            Self::Decode { batch, .. } => batch,
            Self::Prefill { tokens } => tokens,
        }
    }
    fn run(self, p: &Placement) -> Split {
        match self {
            Self::Decode { batch, ctx } => p.step(batch, ctx),
            Self::Prefill { tokens } => p.prefill(tokens),
        }
    }
}

/// One pass of a cell: total terms, per-stage terms, hops, and (for rings) each stage's own time.
struct Pass {
    total: Terms,
    stages: Vec<StageTerms>,
    hops: Vec<HopTerms>,
    stage_times: Vec<f64>,
}

fn pass(
    ctx: &Ctx,
    kind: CellKind,
    a: &[Assignment],
    pl: &[Placement],
    mode: Mode,
) -> Result<Pass, String> {
    let hidden = ctx.model.hidden_wire_bytes();
    let n = mode.tokens();
    let link = |x: &str, y: &str| {
        ctx.link(x, y)
            .ok_or_else(|| format!("no link between {x} and {y}"))
    };
    let overhead = |x: &str, y: &str| ctx.hop_overhead(x, y);
    let mut out = Pass {
        total: Terms::default(),
        stages: vec![],
        hops: vec![],
        stage_times: vec![],
    };
    let stage = |out: &mut Pass, node: &str, part: &str, t: Terms| {
        out.total.add(&t);
        out.stage_times.push(t.total_s);
        out.stages.push(StageTerms {
            node: node.to_string(),
            part: part.to_string(),
            terms: t,
        });
    };
    match kind {
        CellKind::Single => stage(&mut out, &a[0].node, "layers", mode.run(&pl[0]).total()),
        CellKind::Stage => {
            for (i, p) in pl.iter().enumerate() {
                stage(&mut out, &a[i].node, "layers", mode.run(p).total());
            }
            let s = a.len();
            for i in 0..s {
                let j = (i + 1) % s;
                let last = j == 0;
                if s < 2 || (last && matches!(mode, Mode::Prefill { .. })) {
                    continue;
                }
                let l = link(&a[i].node, &a[j].node)?;
                let bytes = if last {
                    TOKEN_WIRE_BYTES * n
                } else {
                    hidden * n
                };
                let t = hop_terms(l, overhead(&a[i].node, &a[j].node), bytes, 1.0);
                out.total.add(&t);
                out.hops.push(HopTerms {
                    from: a[i].node.clone(),
                    to: a[j].node.clone(),
                    per_token: 1,
                    rtt_s: l.rtt_s,
                    wire_bytes_per_token: bytes / n,
                    terms: t,
                });
            }
        }
        CellKind::Expert => {
            let n_moe = ctx.model.moe_layers().max(1) as f64;
            let home = mode.run(&pl[0]);
            stage(&mut out, &a[0].node, "home", home.dense);
            // Per MoE layer the home waits for the slowest owner (its own experts need no hop).
            let mut worst = scaled(&home.experts, 1.0 / n_moe);
            let mut per_owner = vec![(scaled(&home.experts, 1.0 / n_moe), Terms::default(), 0.0)];
            let (n_exp, used) = (ctx.model.n_expert, ctx.model.n_expert_used);
            for (i, p) in pl.iter().enumerate().skip(1) {
                let l = link(&a[0].node, &a[i].node)?;
                let e = scaled(&mode.run(p).experts, 1.0 / n_moe);
                // An owner is contacted only in the layers where some token needs one of its
                // experts, and is sent only those tokens' rows.
                let owned = a[i].experts.map_or(0, |x| x.experts.len());
                let rows = n * routed_share(n_exp, used, owned);
                let mut h = hop_terms(l, overhead(&a[0].node, &a[i].node), hidden * rows, 2.0);
                let q = contact_probability(n_exp, used, owned, n);
                h.total_s -= h.latency_s * (1.0 - q);
                h.latency_s *= q;
                let mut t = e;
                t.add(&h);
                if t.total_s > worst.total_s {
                    worst = t;
                }
                per_owner.push((e, h, l.rtt_s));
            }
            out.total.add(&scaled(&worst, n_moe));
            for (i, (e, h, rtt)) in per_owner.into_iter().enumerate() {
                let share = routed_share(
                    ctx.model.n_expert,
                    ctx.model.n_expert_used,
                    a[i].experts.map_or(0, |x| x.experts.len()),
                );
                out.stages.push(StageTerms {
                    node: a[i].node.clone(),
                    part: "experts".into(),
                    terms: scaled(&e, n_moe),
                });
                if i > 0 {
                    out.hops.push(HopTerms {
                        from: a[0].node.clone(),
                        to: a[i].node.clone(),
                        per_token: (2.0 * n_moe) as u32,
                        rtt_s: rtt,
                        wire_bytes_per_token: 2.0 * hidden * n_moe * share,
                        terms: scaled(&h, n_moe),
                    });
                }
            }
            // The home's own stage entry above counted only its dense part; keep stage_times simple.
            out.stage_times = vec![out.total.total_s];
        }
        CellKind::Bank => {
            let k = a[1].ffn.map_or(0, |r| r.len()) as f64;
            stage(&mut out, &a[0].node, "layers", mode.run(&pl[0]).total());
            stage(&mut out, &a[1].node, "bank", mode.run(&pl[1]).total());
            let l = link(&a[0].node, &a[1].node)?;
            let h = hop_terms(l, overhead(&a[0].node, &a[1].node), hidden * n, 2.0 * k);
            out.total.add(&h);
            out.hops.push(HopTerms {
                from: a[0].node.clone(),
                to: a[1].node.clone(),
                per_token: (2.0 * k) as u32,
                rtt_s: l.rtt_s,
                wire_bytes_per_token: 2.0 * k * hidden,
                terms: h,
            });
            out.stage_times = vec![out.total.total_s];
        }
    }
    if let Mode::Decode { .. } = mode {
        let o = ctx.graph.token_overhead_s;
        if o > 0.0 {
            out.total.add(&Terms {
                latency_s: o,
                total_s: o,
                ..Terms::default()
            });
        }
    }
    Ok(out)
}

/// Aggregate tokens/s of a cell serving `c` concurrent sequences.
fn throughput(
    ctx: &Ctx,
    kind: CellKind,
    a: &[Assignment],
    pl: &[Placement],
    c: u32,
) -> Result<f64, String> {
    let c = f64::from(c.max(1));
    let at = ctx.policy.prompt_tokens as f64;
    if kind == CellKind::Stage && a.len() > 1 {
        // Pipelined ring: min(c, stages) micro-batches circulate.
        let m = c.min(a.len() as f64);
        let p = pass(
            ctx,
            kind,
            a,
            pl,
            Mode::Decode {
                batch: c / m,
                ctx: at,
            },
        )?;
        let busiest = p.stage_times.iter().copied().fold(0.0, f64::max) * m;
        let busiest_link = p
            .hops
            .iter()
            .map(|h| h.terms.transfer_s)
            .fold(0.0, f64::max)
            * m;
        let round = p.total.total_s.max(busiest).max(busiest_link);
        return Ok(c / round);
    }
    let p = pass(ctx, kind, a, pl, Mode::Decode { batch: c, ctx: at })?;
    Ok(c / p.total.total_s)
}

/// Places and costs a cell; fails with the first reason it is illegal.
pub(crate) fn evaluate(
    ctx: &Ctx,
    kind: CellKind,
    mut a: Vec<Assignment>,
    seqs: u32,
) -> Result<Cell, String> {
    let mut pl = Vec::with_capacity(a.len());
    for x in a.iter_mut() {
        let p = place_assignment(ctx, x, seqs)?;
        x.memory = p.memory;
        pl.push(p);
    }
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
    use super::*;
    use crate::model::Quant;
    use crate::plan::LayerRange;

    const MOE: &str = r#"{"model_type":"qwen3_moe","hidden_size":1024,"num_hidden_layers":12,
        "num_attention_heads":16,"num_key_value_heads":4,"head_dim":128,"intermediate_size":3072,
        "moe_intermediate_size":512,"num_experts":64,"num_experts_per_tok":8,"vocab_size":32000,
        "tie_word_embeddings":true}"#;

    fn whole(m: &ModelProfile) -> Assignment {
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

    fn node(ram_mib: u64, vram_mib: u64, disk: bool) -> Node {
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
        let e = place(&node(700, 0, false), &load, &policy, 1).unwrap_err();
        assert!(e.starts_with("needs ") && e.contains(", budget "), "{e}");
    }

    #[test]
    fn sliding_window_layers_cost_a_window_of_kv_memory_and_reads() {
        let m = ModelProfile::from_hf_config(
            include_str!("../models/gpt-oss-120b.config.json"),
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

    #[test]
    fn an_owner_is_contacted_only_when_a_token_needs_one_of_its_experts() {
        // 2 of 8 experts per token, 3 owned: C(5,2)/C(8,2) = 10/28 of tokens miss them.
        let p = contact_probability(8, 2, 3, 1.0);
        assert!((p - 18.0 / 28.0).abs() < 1e-12, "{p}");
        // Four tokens: contacted unless all four miss.
        let p4 = contact_probability(8, 2, 3, 4.0);
        assert!((p4 - (1.0 - (10.0f64 / 28.0).powi(4))).abs() < 1e-12);
        // Every expert, or more picks than the others can take: always; none: never.
        assert_eq!(contact_probability(8, 2, 8, 1.0), 1.0);
        assert_eq!(contact_probability(8, 2, 7, 1.0), 1.0);
        assert_eq!(contact_probability(8, 2, 0, 1.0), 0.0);
    }

    #[test]
    fn batching_touches_more_experts_and_stays_memory_bound_longer() {
        let m = ModelProfile::from_hf_config(MOE, Quant::Q8_0).unwrap();
        let policy = Policy {
            context_tokens: 512,
            ..Policy::default()
        };
        let p = place(&node(8192, 0, false), &load_for(&m, &whole(&m)), &policy, 8).unwrap();
        let one = p.step(1.0, 256.0).total().total_s;
        let eight = p.step(8.0, 256.0).total().total_s;
        assert!(eight > one && eight < 8.0 * one, "{one} {eight}");
    }
}
