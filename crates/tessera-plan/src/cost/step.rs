//! Step costing: the time of one decode step or prefill on a placed node (per tier, the larger of
//! reading and computing), and of one pass of a cell over its nodes and network hops. Kept apart
//! from memory placement, which decides where the bytes are, not how long they take.

use super::memory::{Placement, TierKind, TierUse};
use super::slowest_owner::{expected_slowest, OwnerLayer};
use super::{Ctx, TOKEN_WIRE_BYTES};
use crate::plan::{Assignment, CellKind, HopTerms, StageTerms, Terms};
use crate::resources::LinkSpec;

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
        self.split(
            batch,
            batch * self.context.kv_bytes(ctx),
            batch * self.context.attn_flops(ctx),
        )
    }

    /// Prefill of one prompt of `p` tokens.
    pub fn prefill(&self, p: f64) -> Split {
        self.split(
            p,
            self.context.kv_bytes(p),
            self.context.prefill_attn_flops(p),
        )
    }

    /// The time of `tokens` tokens' work on every tier, dense and expert apart: each chunk's
    /// bytes touched and flops, plus `kv_bytes` and `attn_flops` of attention on the tier that
    /// holds the KV cache.
    fn split(&self, tokens: f64, kv_bytes: f64, attn_flops: f64) -> Split {
        let mut s = Split::default();
        for t in &self.tiers {
            let (mut db, mut df, mut eb, mut ef) = (0.0, 0.0, 0.0, 0.0);
            for (c, f) in &t.parts {
                let mut bytes = c.resident * f * c.touched(tokens);
                if t.kind == TierKind::Disk && c.expert_p.is_some() {
                    // The experts left on disk are read as often as the cache misses them.
                    bytes *= super::hit_rate::disk_read_factor(*f, self.expert_reuse);
                }
                let flops = c.flops * f * tokens;
                if c.expert_p.is_some() {
                    eb += bytes;
                    ef += flops;
                } else {
                    db += bytes;
                    df += flops;
                }
            }
            if t.holds_kv {
                db += kv_bytes;
                df += attn_flops;
            }
            s.dense.add(&tier_terms(t, db, df));
            s.experts.add(&tier_terms(t, eb, ef));
        }
        s
    }

    /// The share of this node's routed experts read from disk first: its experts' share left
    /// on disk, as its cache misses it.
    pub(super) fn expert_miss_share(&self) -> f64 {
        let (mut all, mut disk) = (0.0, 0.0);
        for t in &self.tiers {
            for (c, f) in &t.parts {
                if c.expert_p.is_some() {
                    all += c.resident * f;
                    if t.kind == TierKind::Disk {
                        disk += c.resident * f;
                    }
                }
            }
        }
        if all <= 0.0 {
            return 0.0;
        }
        super::hit_rate::expert_miss_share(disk / all, self.expert_reuse)
    }
}

/// A hop's time: per crossing, half the link's round trip, the software's cost of a hop
/// (`overhead`, see [`ResourceGraph::hop_overhead_s`]) and the transfer of `bytes`.
///
/// [`ResourceGraph::hop_overhead_s`]: crate::resources::ResourceGraph::hop_overhead_s
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

/// How much slower `node` computes its experts while every owner of the expert split `a`
/// computes theirs: 1 / its machine's share for the owners on that machine (1 when it shares
/// none, or the machine has cores for all of them).
///
/// [`SharedMachine`]: crate::resources::SharedMachine
fn owners_slowdown(ctx: &Ctx, a: &[Assignment], node: &str) -> f64 {
    let Some(m) = ctx
        .graph
        .machines
        .iter()
        .find(|m| m.nodes.iter().any(|n| n == node))
    else {
        return 1.0;
    };
    let busy = a
        .iter()
        .filter(|x| x.experts.is_some() && m.nodes.contains(&x.node))
        .count();
    1.0 / m.share(busy.max(1))
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

/// One owner's part of a MoE layer for one token, from its experts' mean terms per layer `e`
/// (whose disk term is its reads of the experts its cache misses) and `contact`, the time a
/// request to it adds (0 for the home).
fn owner_layer(
    p: &Placement,
    e: Terms,
    n: u32,
    used: u32,
    owned: usize,
    contact: f64,
) -> OwnerLayer {
    // The experts a token routes to the owner on average, and those it reads from disk.
    let routed = f64::from(used) * owned as f64 / f64::from(n.max(1));
    let miss_share = p.expert_miss_share();
    let missed = routed * miss_share;
    OwnerLayer {
        owned: owned as u32,
        per_expert_s: if routed > 0.0 {
            (e.total_s - e.disk_s).max(0.0) / routed
        } else {
            0.0
        },
        per_miss_s: if missed > 0.0 { e.disk_s / missed } else { 0.0 },
        miss_share,
        contact_s: contact,
    }
}

/// `t` with its compute and memory reads `k` times slower (cores shared with other owners) and
/// its disk reads as they were: another process on the same cores does not slow a disk.
fn cpu_slowed(t: &Terms, k: f64) -> Terms {
    Terms {
        compute_s: t.compute_s * k,
        memory_s: t.memory_s * k,
        total_s: t.disk_s + (t.total_s - t.disk_s).max(0.0) * k,
        ..*t
    }
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
pub(super) enum Mode {
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
pub(super) struct Pass {
    pub(super) total: Terms,
    pub(super) stages: Vec<StageTerms>,
    pub(super) hops: Vec<HopTerms>,
    pub(super) stage_times: Vec<f64>,
}

pub(super) fn pass(
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
            // The owners compute a layer's experts at once: those sharing a machine's cores
            // ([`SharedMachine`]) each get their share of it.
            let slowdown = |node: &str| owners_slowdown(ctx, a, node);
            // Per MoE layer the home waits for the slowest owner (its own experts need no hop).
            let home_experts = scaled(
                &cpu_slowed(&home.experts, slowdown(&a[0].node)),
                1.0 / n_moe,
            );
            let mut worst = home_experts;
            let mut per_owner = vec![(home_experts, Terms::default(), 0.0)];
            // The home's own share of each contacted owner's hops (sending its request,
            // taking its reply), per layer: paid one owner after another on the home's thread,
            // where the owners' compute and the links run at once.
            let mut home_side: Vec<f64> = Vec::new();
            let (n_exp, used) = (ctx.model.n_expert, ctx.model.n_expert_used);
            let owned = |i: usize| a[i].experts.map_or(0, |x| x.experts.len());
            let mut layer_owners = vec![owner_layer(
                &pl[0],
                home_experts,
                n_exp,
                used,
                owned(0),
                0.0,
            )];
            for (i, p) in pl.iter().enumerate().skip(1) {
                let l = link(&a[0].node, &a[i].node)?;
                let e = scaled(
                    &cpu_slowed(&mode.run(p).experts, slowdown(&a[i].node)),
                    1.0 / n_moe,
                );
                // An owner is contacted only in the layers where some token needs one of its
                // experts, and is sent only those tokens' rows.
                let rows = n * routed_share(n_exp, used, owned(i));
                let overhead = overhead(&a[0].node, &a[i].node);
                let mut h = hop_terms(l, overhead, hidden * rows, 2.0);
                let q = contact_probability(n_exp, used, owned(i), n);
                home_side.push(q * overhead);
                h.total_s -= h.latency_s * (1.0 - q);
                h.latency_s *= q;
                let mut t = e;
                t.add(&h);
                if t.total_s > worst.total_s {
                    worst = t;
                }
                per_owner.push((e, h, l.rtt_s));
                let contact = hop_terms(l, overhead, hidden, 2.0).total_s;
                layer_owners.push(owner_layer(p, e, n_exp, used, owned(i), contact));
            }
            let mut layer = worst;
            if matches!(mode, Mode::Decode { batch, .. } if batch <= 1.0) && worst.total_s > 0.0 {
                // One token: the layer waits for whichever owner its routing makes slowest,
                // more on average than the slowest owner's mean (see `slowest_owner`), the
                // home's own reads included: it reads ahead only the next layer's experts, and
                // a read (3 ms of an eMMC's for one of the lab's experts) outlasts a layer's
                // round trips, so each layer still waits for its own misses (the lab's homes
                // read at their disks' rate for 90-96% of the token). A batch's rows average
                // the routing out, and keep the mean.
                let slowest = expected_slowest(n_exp, used, &layer_owners);
                layer = scaled(&worst, slowest / worst.total_s);
            }
            out.total.add(&scaled(&layer, n_moe));
            // The layer's wait above holds one owner's hops whole; the home handles every other
            // contacted owner's request and reply in turn. (The lab's 4-board split, owners
            // holding every expert: the home waited 9.9 ms a token for replies beyond its own
            // part, predicted 15.6 ms a token against 21.1 measured without this.)
            let serial =
                home_side.iter().sum::<f64>() - home_side.iter().copied().fold(0.0, f64::max);
            if serial > 0.0 {
                out.total.add(&Terms {
                    latency_s: serial * n_moe,
                    total_s: serial * n_moe,
                    ..Terms::default()
                });
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::memory::{load_for, place};
    use crate::cost::tests::{node, whole, MOE};
    use crate::model::{ModelProfile, Quant};
    use crate::resources::Policy;

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

    /// Three laptops on 1 GbE with `budget_mib` each for the experts of [`MOE`], which none
    /// holds alone (none streams): the planner splits them.
    fn three_laptops(budget_mib: u64) -> (ModelProfile, crate::resources::ResourceGraph) {
        let m = ModelProfile::from_hf_config(MOE, Quant::Q8_0).unwrap();
        let mut g = crate::resources::ResourceGraph::from_toml(
            r#"
            [defaults]
            link = "1gbe"
            [policy]
            objective = "latency"
            strategies = ["expert"]
            context = 512
            [[node]]
            name = "a"
            profile = "laptop-16gb"
            [[node]]
            name = "b"
            profile = "laptop-16gb"
            [[node]]
            name = "c"
            profile = "laptop-16gb"
            "#,
        )
        .unwrap();
        for n in &mut g.nodes {
            n.disk = None;
            n.memory_budget = Some(crate::units::Bytes::mib(budget_mib));
        }
        (m, g)
    }

    #[test]
    fn owners_sharing_a_machine_s_cores_compute_their_experts_in_turn() {
        use crate::resources::SharedMachine;
        let (m, mut g) = three_laptops(1024);
        let plan = crate::plan(&m, &g, 1).unwrap().plan;
        let apart = crate::predict(&m, &g, &plan).unwrap().decode_tokens_per_s;
        // One core for three single-threaded nodes: the owners take turns.
        g.machines.push(SharedMachine {
            name: "one".into(),
            cores: 1.0,
            node_cores: 1.0,
            nodes: vec!["a".into(), "b".into(), "c".into()],
        });
        let shared = crate::predict(&m, &g, &plan).unwrap().decode_tokens_per_s;
        assert!(shared < apart, "shared {shared}, apart {apart}");
        // Cores for all of them: no slower.
        g.machines[0].cores = 3.0;
        let roomy = crate::predict(&m, &g, &plan).unwrap().decode_tokens_per_s;
        assert!((roomy - apart).abs() < 1e-9 * apart, "{roomy} {apart}");
    }

    #[test]
    fn the_home_handles_every_contacted_owner_s_messages_in_turn() {
        // Budgets that need all three.
        let (m, mut g) = three_laptops(640);
        let plan = crate::plan(&m, &g, 1).unwrap().plan;
        assert_eq!(plan.strategy, crate::StrategyKind::Expert);
        let a = &plan.cells[0].assignments;
        assert_eq!(a.len(), 3, "a home and two owners");
        let q = |i: usize| {
            let owned = a[i].experts.as_ref().map_or(0, |x| x.experts.len());
            contact_probability(m.n_expert, m.n_expert_used, owned, 1.0)
        };
        let (q1, q2) = (q(1), q(2));
        let step = |g: &crate::resources::ResourceGraph| {
            crate::predict(&m, g, &plan).unwrap().decode.total_s
        };
        g.hop_overhead_s = 0.0;
        let bare = step(&g);
        let d = 1e-3;
        g.hop_overhead_s = d;
        let grown = step(&g) - bare;
        // Per MoE layer at least the slowest owner's two crossings, and the home's side of the
        // other owner's request and reply, one after the other.
        let n_moe = m.moe_layers() as f64;
        let slowest = 2.0 * q1.max(q2) * d * n_moe;
        let in_turn = q1.min(q2) * d * n_moe;
        assert!(
            grown >= (slowest + in_turn) * (1.0 - 1e-9),
            "{grown} s a token for {slowest} + {in_turn}"
        );
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
