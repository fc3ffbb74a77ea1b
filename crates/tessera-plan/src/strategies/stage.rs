//! Stage split: contiguous layer ranges on a ring of nodes, chosen by an exact dynamic programme over
//! (set of nodes used, last node, layers placed), for every choice of first node. Nodes may be left
//! out. Two metrics are optimised: the sum of stage and hop times (one request's token time) and the
//! busiest stage at the policy's concurrency (pipelined throughput); the cost model then scores both.
//! Interchangeable nodes (same figures, same links) are only used in index order, which keeps eight
//! identical laptops cheap without losing optimality.

use super::{ms, stage_assignment, Generated};
use crate::cost::{evaluate, stage_time, Ctx, TOKEN_WIRE_BYTES};
use crate::plan::{Cell, CellKind};
use crate::resources::StrategyKind;

/// At most this many nodes enter the DP (2^n subsets).
pub(crate) const MAX_DP_NODES: usize = 8;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Metric {
    /// Sum of stage times and hops at batch 1.
    Latency,
    /// Busiest stage (or link) at the policy's concurrency.
    Bottleneck,
}

/// A ring: `order[i]` (an index into the graph's nodes) holds layers `[cuts[i], cuts[i + 1])`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Ring {
    pub value: f64,
    /// The other metric, which broke ties.
    pub tie: f64,
    pub order: Vec<usize>,
    pub cuts: Vec<usize>,
}

/// The best ring for every subset (bit i = `nodes[i]`) of the nodes given to [`solve`].
pub(crate) struct Solved {
    pub per_mask: Vec<Option<Ring>>,
    pub class: Vec<usize>,
}

impl Solved {
    /// The best ring of two or more nodes.
    pub fn best_split(&self) -> Option<(usize, &Ring)> {
        self.per_mask
            .iter()
            .enumerate()
            .filter(|(m, _)| m.count_ones() >= 2)
            .filter_map(|(m, r)| r.as_ref().map(|r| (m, r)))
            .min_by(|a, b| {
                let eps = 1e-13 * a.1.value.abs().max(b.1.value.abs());
                if (a.1.value - b.1.value).abs() <= eps {
                    a.1.tie.total_cmp(&b.1.tie).then(a.0.cmp(&b.0))
                } else {
                    a.1.value.total_cmp(&b.1.value)
                }
            })
    }
}

fn equivalent(ctx: &Ctx, i: usize, j: usize) -> bool {
    let (a, b) = (&ctx.graph.nodes[i], &ctx.graph.nodes[j]);
    let same = a.vram == b.vram
        && a.gpu_compute == b.gpu_compute
        && a.ram == b.ram
        && a.ram_compute == b.ram_compute
        && a.disk == b.disk
        && a.memory_budget == b.memory_budget;
    same && ctx
        .graph
        .nodes
        .iter()
        .enumerate()
        .all(|(k, c)| k == i || k == j || ctx.link(&a.name, &c.name) == ctx.link(&b.name, &c.name))
}

/// Solves the ring DP over `nodes` (indices into the graph; at most [`MAX_DP_NODES`]).
pub(crate) fn solve(ctx: &Ctx, nodes: &[usize], seqs: u32, metric: Metric) -> Solved {
    let n = nodes.len().min(MAX_DP_NODES);
    let nodes = &nodes[..n];
    let l = ctx.model.n_layers();
    let batch = match metric {
        Metric::Latency => 1.0,
        Metric::Bottleneck => f64::from(ctx.policy.concurrency.max(1)),
    };
    let inf = f64::INFINITY;
    // cost[(u * (l + 1) + a) * (l + 1) + b]: node u holding layers [a, b).
    let idx = |u: usize, a: usize, b: usize| (u * (l + 1) + a) * (l + 1) + b;
    let mut cost = vec![inf; n * (l + 1) * (l + 1)];
    for (u, &gi) in nodes.iter().enumerate() {
        let node = &ctx.graph.nodes[gi];
        for a in 0..l {
            for b in a + 1..=l {
                match stage_time(
                    ctx,
                    node,
                    &stage_assignment(ctx, &node.name, a, b),
                    seqs,
                    batch,
                ) {
                    Some(t) => cost[idx(u, a, b)] = t,
                    None => break,
                }
            }
        }
    }
    let hidden = ctx.model.hidden_wire_bytes() * batch;
    let mut hop = vec![inf; n * n];
    let mut close = vec![inf; n * n];
    for (u, &gu) in nodes.iter().enumerate() {
        for (v, &gv) in nodes.iter().enumerate() {
            if u == v {
                continue;
            }
            if let Some(lk) = ctx.link(&ctx.graph.nodes[gu].name, &ctx.graph.nodes[gv].name) {
                match metric {
                    Metric::Latency => {
                        let o = ctx.graph.hop_overhead_s;
                        hop[u * n + v] = lk.one_way_s(hidden) + o;
                        close[u * n + v] = lk.one_way_s(TOKEN_WIRE_BYTES * batch) + o;
                    }
                    Metric::Bottleneck => {
                        hop[u * n + v] = lk.bandwidth.secs(hidden);
                        close[u * n + v] = 0.0;
                    }
                }
            }
        }
    }
    let class: Vec<usize> = (0..n)
        .map(|i| {
            (0..i)
                .find(|&j| equivalent(ctx, nodes[j], nodes[i]))
                .unwrap_or(i)
        })
        .collect();
    // Node u may join `mask` only after every interchangeable node before it.
    let may_add =
        |mask: usize, u: usize| (0..u).all(|v| class[v] != class[u] || mask & (1 << v) != 0);
    // Values are (primary, secondary): the metric, then the other one to break ties, so equal
    // token times prefer the ring with the lighter busiest stage (and vice versa).
    let combine = |acc: (f64, f64), h: f64, c: f64| match metric {
        Metric::Latency => (acc.0 + h + c, acc.1.max(c)),
        Metric::Bottleneck => (acc.0.max(h).max(c), acc.1 + h + c),
    };
    let better = |a: (f64, f64), b: (f64, f64)| {
        let eps = 1e-13 * b.0.abs();
        a.0 < b.0 - eps || (a.0 <= b.0 + eps && a.1 < b.1)
    };

    let states = (1usize << n) * n * (l + 1);
    let sidx = |mask: usize, last: usize, at: usize| (mask * n + last) * (l + 1) + at;
    let mut per_mask: Vec<Option<Ring>> = vec![None; 1 << n];
    let mut val = vec![(inf, inf); states];
    let mut parent = vec![(u8::MAX, 0u16); states];
    for first in 0..n {
        if class[first] != first {
            continue;
        }
        val.fill((inf, inf));
        for b in 1..=l {
            let c = cost[idx(first, 0, b)];
            if c.is_infinite() {
                break;
            }
            val[sidx(1 << first, first, b)] = (c, c);
            parent[sidx(1 << first, first, b)] = (u8::MAX, 0);
        }
        for mask in 1usize..(1 << n) {
            if mask & (1 << first) == 0 {
                continue;
            }
            for last in 0..n {
                if mask & (1 << last) == 0 {
                    continue;
                }
                for at in 1..l {
                    let v = val[sidx(mask, last, at)];
                    if v.0.is_infinite() {
                        continue;
                    }
                    for u in 0..n {
                        if mask & (1 << u) != 0 || !may_add(mask, u) {
                            continue;
                        }
                        let h = hop[last * n + u];
                        if h.is_infinite() {
                            continue;
                        }
                        let nm = mask | (1 << u);
                        for b in at + 1..=l {
                            let c = cost[idx(u, at, b)];
                            if c.is_infinite() {
                                break;
                            }
                            let nv = combine(v, h, c);
                            let s = sidx(nm, u, b);
                            if better(nv, val[s]) {
                                val[s] = nv;
                                parent[s] = (last as u8, at as u16);
                            }
                        }
                    }
                }
            }
            // Complete rings for this mask.
            for last in 0..n {
                let v = val[sidx(mask, last, l)];
                if v.0.is_infinite() {
                    continue;
                }
                let total = if mask.count_ones() == 1 {
                    v
                } else {
                    let c = close[last * n + first];
                    if c.is_infinite() {
                        continue;
                    }
                    combine(v, c, 0.0)
                };
                if per_mask[mask]
                    .as_ref()
                    .is_none_or(|r| better(total, (r.value, r.tie)))
                {
                    let (mut order, mut cuts) = (vec![], vec![l]);
                    let (mut m, mut u, mut at) = (mask, last, l);
                    loop {
                        order.push(nodes[u]);
                        let (pu, pat) = parent[sidx(m, u, at)];
                        if pu == u8::MAX {
                            cuts.push(0);
                            break;
                        }
                        cuts.push(pat as usize);
                        m &= !(1 << u);
                        u = pu as usize;
                        at = pat as usize;
                    }
                    order.reverse();
                    cuts.reverse();
                    per_mask[mask] = Some(Ring {
                        value: total.0,
                        tie: total.1,
                        order,
                        cuts,
                    });
                }
            }
        }
    }
    Solved { per_mask, class }
}

/// Builds and costs the cell for a ring.
pub(crate) fn ring_cell(ctx: &Ctx, ring: &Ring, seqs: u32) -> Result<Cell, String> {
    let a = ring
        .order
        .iter()
        .enumerate()
        .map(|(i, &g)| {
            stage_assignment(
                ctx,
                &ctx.graph.nodes[g].name,
                ring.cuts[i],
                ring.cuts[i + 1],
            )
        })
        .collect();
    evaluate(ctx, CellKind::Stage, a, seqs)
}

pub(crate) fn describe(ctx: &Ctx, cell: &Cell) -> String {
    let parts: Vec<String> = cell
        .assignments
        .iter()
        .map(|a| {
            let r = a.layers.expect("stage holds layers");
            format!("{} {}", a.node, r)
        })
        .collect();
    let _ = ctx;
    format!("stage ring {}", parts.join(" -> "))
}

/// Nodes for the DP: all of them, or the [`MAX_DP_NODES`] with the most usable memory bandwidth.
pub(crate) fn dp_nodes(ctx: &Ctx, out: &mut Generated) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..ctx.graph.nodes.len()).collect();
    if idx.len() > MAX_DP_NODES {
        let score = |i: usize| {
            let n = &ctx.graph.nodes[i];
            crate::cost::usable_memory(n, ctx.policy).as_f64()
                * n.vram
                    .map_or(n.ram.bandwidth.0, |t| t.bandwidth.0.max(n.ram.bandwidth.0))
        };
        idx.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
        let dropped: Vec<&str> = idx[MAX_DP_NODES..]
            .iter()
            .map(|&i| ctx.graph.nodes[i].name.as_str())
            .collect();
        out.notes.push(format!(
            "the stage DP considered the {MAX_DP_NODES} nodes with the most memory x bandwidth; left out: {}",
            dropped.join(", ")
        ));
        idx.truncate(MAX_DP_NODES);
        idx.sort_unstable();
    }
    idx
}

pub(crate) fn generate(ctx: &Ctx, out: &mut Generated) {
    if ctx.graph.nodes.len() < 2 {
        return;
    }
    let nodes = dp_nodes(ctx, out);
    let seqs = ctx.policy.concurrency;
    let lat = solve(ctx, &nodes, seqs, Metric::Latency);
    let Some((best_mask, best)) = lat.best_split() else {
        let names: Vec<&str> = nodes
            .iter()
            .map(|&i| ctx.graph.nodes[i].name.as_str())
            .collect();
        out.reject(
            StrategyKind::Stage,
            &names,
            "no ring of two or more nodes holds every layer within the nodes' budgets and links"
                .into(),
        );
        return;
    };
    let mut rings = vec![best.clone()];
    let thr = solve(ctx, &nodes, seqs, Metric::Bottleneck);
    if let Some((_, r)) = thr.best_split() {
        if r.order != best.order || r.cuts != best.cuts {
            rings.push(r.clone());
        }
    }
    let mut best_cell = None;
    for (i, r) in rings.iter().enumerate() {
        match ring_cell(ctx, r, seqs) {
            Ok(cell) => {
                if i == 0 {
                    best_cell = Some(cell.clone());
                }
                let d = describe(ctx, &cell);
                out.push_cell(StrategyKind::Stage, d, cell);
            }
            Err(e) => out.reject(StrategyKind::Stage, &[], format!("stage ring: {e}")),
        }
    }
    // Say why each node the best ring leaves out stays out.
    let Some(best_cell) = best_cell else { return };
    let used: Vec<&str> = best_cell.nodes();
    for (bit, &gi) in nodes.iter().enumerate() {
        if best_mask & (1 << bit) != 0 {
            continue;
        }
        // Interchangeable nodes are reported once, by the first unused one, which stands in for all.
        let stand_in =
            (0..nodes.len()).find(|&j| lat.class[j] == lat.class[bit] && best_mask & (1 << j) == 0);
        let Some(j) = stand_in.filter(|&j| j == bit) else {
            continue;
        };
        let name = ctx.graph.nodes[gi].name.as_str();
        let twins: Vec<&str> = (j + 1..nodes.len())
            .filter(|&t| lat.class[t] == lat.class[bit] && best_mask & (1 << t) == 0)
            .map(|t| ctx.graph.nodes[nodes[t]].name.as_str())
            .collect();
        let also = if twins.is_empty() {
            String::new()
        } else {
            format!(" (or the identical {})", twins.join(", "))
        };
        let mut names = used.clone();
        names.push(name);
        let ring = lat.per_mask[best_mask | (1 << j)].as_ref();
        let reason = match ring.map(|r| ring_cell(ctx, r, seqs)) {
            Some(Ok(with)) => {
                let hops = |c: &Cell| c.predicted.decode.network_s();
                let work = |c: &Cell| c.predicted.decode.total_s - c.predicted.decode.network_s();
                let extra_hops = hops(&with) - hops(&best_cell);
                let saved = work(&best_cell) - work(&with);
                let rtt = with
                    .predicted
                    .hops
                    .iter()
                    .filter(|h| h.from == name || h.to == name)
                    .map(|h| h.rtt_s)
                    .fold(0.0, f64::max);
                let effect = if saved >= 0.0 {
                    format!("saves {} of compute", ms(saved))
                } else {
                    format!("adds {} of compute", ms(-saved))
                };
                format!(
                    "adding node {name}{also} to the ring costs {}/token in hops over a {} link and {effect} \
                     ({:.1} vs {:.1} tok/s)",
                    ms(extra_hops),
                    ms(rtt),
                    with.predicted.decode_tokens_per_s,
                    best_cell.predicted.decode_tokens_per_s
                )
            }
            Some(Err(e)) => format!("adding node {name}{also} to the ring: {e}"),
            None => format!("adding node {name}{also}: no ring that includes it holds the layers within the budgets"),
        };
        out.reject(StrategyKind::Stage, &names, reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ModelProfile, Quant};
    use crate::resources::{LinkSpec, Node, Policy, ResourceGraph, Source, Tier};
    use crate::units::{Bytes, BytesPerSec, FlopsPerSec};
    use proptest::prelude::*;

    fn graph(nodes: &[(u64, f64, f64)], rtts: &[f64]) -> ResourceGraph {
        let mut g = ResourceGraph::default();
        for (i, &(ram_mib, bw, tf)) in nodes.iter().enumerate() {
            let node = Node {
                name: format!("n{i}"),
                profile: None,
                vram: None,
                gpu_compute: FlopsPerSec(0.0),
                ram: Tier {
                    capacity: Bytes::mib(ram_mib),
                    bandwidth: BytesPerSec::gb_s(bw),
                },
                ram_compute: FlopsPerSec::tflops(tf),
                disk: None,
                memory_budget: None,
            };
            g.add_node(node, Source::Declared);
        }
        let mut k = 0;
        for i in 0..nodes.len() {
            for j in i + 1..nodes.len() {
                let spec = LinkSpec {
                    rtt_s: rtts[k % rtts.len()] / 1e3,
                    bandwidth: BytesPerSec::mb_s(100.0),
                };
                g.add_link(
                    &format!("n{i}"),
                    &format!("n{j}"),
                    spec,
                    None,
                    Source::Declared,
                );
                k += 1;
            }
        }
        g.policy = Policy {
            context_tokens: 256,
            prompt_tokens: 128,
            ..Policy::default()
        };
        g
    }

    /// Every ordered choice of distinct nodes and every cut of the layers into them.
    fn brute_force(ctx: &Ctx) -> f64 {
        fn rec(ctx: &Ctx, order: &mut Vec<usize>, at: usize, acc: f64, best: &mut f64) {
            let (n, l) = (ctx.graph.nodes.len(), ctx.model.n_layers());
            let name = |i: usize| ctx.graph.nodes[i].name.as_str();
            if at == l {
                let total = match (order.first(), order.last()) {
                    (Some(&f), Some(&z)) if order.len() > 1 => {
                        acc + ctx
                            .link(name(z), name(f))
                            .unwrap()
                            .one_way_s(TOKEN_WIRE_BYTES)
                            + ctx.graph.hop_overhead_s
                    }
                    _ => acc,
                };
                *best = best.min(total);
                return;
            }
            for u in 0..n {
                if order.contains(&u) {
                    continue;
                }
                let hidden = ctx.model.hidden_wire_bytes();
                let hop = order.last().map_or(0.0, |&v| {
                    ctx.link(name(v), name(u)).unwrap().one_way_s(hidden) + ctx.graph.hop_overhead_s
                });
                for b in at + 1..=l {
                    let node = &ctx.graph.nodes[u];
                    let a = stage_assignment(ctx, &node.name, at, b);
                    let Some(t) = stage_time(ctx, node, &a, 1, 1.0) else {
                        break;
                    };
                    order.push(u);
                    rec(ctx, order, b, acc + hop + t, best);
                    order.pop();
                }
            }
        }
        let mut best = f64::INFINITY;
        rec(ctx, &mut Vec::new(), 0, 0.0, &mut best);
        best
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
        #[test]
        fn the_ring_dp_matches_brute_force(
            nodes in prop::collection::vec((260u64..360, 1.0f64..100.0, 0.05f64..2.0), 1..4),
            rtts in prop::collection::vec(0.01f64..30.0, 1..4),
            layers in 1u64..6,
        ) {
            let cfg = format!(
                r#"{{"model_type":"llama","hidden_size":512,"num_hidden_layers":{layers},"num_attention_heads":8,
                "num_key_value_heads":4,"intermediate_size":1536,"vocab_size":2000}}"#
            );
            let model = ModelProfile::from_hf_config(&cfg, Quant::F32).unwrap();
            let g = graph(&nodes, &rtts);
            let ctx = Ctx { model: &model, graph: &g, policy: &g.policy };
            let all: Vec<usize> = (0..nodes.len()).collect();
            let solved = solve(&ctx, &all, 1, Metric::Latency);
            let dp = solved.per_mask.iter().flatten().map(|r| r.value).fold(f64::INFINITY, f64::min);
            let bf = brute_force(&ctx);
            prop_assert!(
                (dp.is_infinite() && bf.is_infinite()) || (dp - bf).abs() <= 1e-10 * bf.max(1e-9),
                "dp {} vs brute force {}", dp, bf
            );
        }
    }
}
