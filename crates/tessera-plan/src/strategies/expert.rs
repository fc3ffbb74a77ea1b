//! Expert split: a home node holds attention, router, dense FFN, embedding, head and KV; each MoE
//! layer's experts are spread over owner nodes (the home included) in counts chosen so the slowest
//! owner per layer (its expert read time from VRAM, RAM or disk, plus its round trip) is as fast as
//! possible. Experts are identical and each owner's time grows with its count, so handing out experts
//! one at a time to the owner that would finish soonest is optimal for that min-max.

use super::{ms, Generated};
use crate::cost::{contact_probability, evaluate, expert_layer_time, place_assignment, Ctx};
use crate::plan::{Assignment, Cell, CellKind, ExpertSlice, LayerRange};
use crate::resources::StrategyKind;

fn home_assignment(ctx: &Ctx, node: &str) -> Assignment {
    let l = ctx.model.n_layers();
    Assignment {
        layers: Some(LayerRange::new(0, l)),
        ffn: Some(LayerRange::new(0, l)),
        embedding: true,
        head: true,
        ..Assignment::empty(node)
    }
}

fn with_experts(mut a: Assignment, ctx: &Ctx, start: usize, k: usize) -> Assignment {
    a.experts = (k > 0).then(|| ExpertSlice {
        layers: LayerRange::new(0, ctx.model.n_layers()),
        experts: LayerRange::new(start, start + k),
    });
    a
}

pub(crate) fn generate(ctx: &Ctx, out: &mut Generated) {
    if !ctx.model.is_moe() {
        out.notes
            .push("expert split not considered: the model has no MoE layers".into());
        return;
    }
    if ctx.graph.nodes.len() < 2 {
        return;
    }
    let n_exp = ctx.model.n_expert as usize;
    let seqs = ctx.policy.concurrency;
    let hidden = ctx.model.hidden_wire_bytes();
    for home in &ctx.graph.nodes {
        let base = home_assignment(ctx, &home.name);
        if let Err(e) = place_assignment(ctx, &base, seqs) {
            out.reject(
                StrategyKind::Expert,
                &[&home.name],
                format!("expert split with home {}: {e}", home.name),
            );
            continue;
        }
        // Owners: the home first, then every node linked to it.
        let owners: Vec<(usize, f64)> = ctx
            .graph
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                if n.name == home.name {
                    Some((i, 0.0))
                } else {
                    ctx.link(&home.name, &n.name).map(|l| {
                        let o = 2.0 * ctx.graph.hop_overhead_s;
                        (i, l.rtt_s + o + 2.0 * l.bandwidth.secs(hidden))
                    })
                }
            })
            .collect();
        let mut owners = owners;
        owners.sort_by_key(|&(i, _)| ctx.graph.nodes[i].name != home.name);
        let names: Vec<&str> = owners
            .iter()
            .map(|&(i, _)| ctx.graph.nodes[i].name.as_str())
            .collect();
        let a = match deal_experts(ctx, &base, &owners) {
            Dealt::Split(a) => a,
            Dealt::Stuck(placed) => {
                out.reject(
                    StrategyKind::Expert,
                    &names,
                    format!(
                        "expert split with home {}: the owners' memory and disk hold only {placed} of the {n_exp} \
                         experts of every MoE layer",
                        home.name
                    ),
                );
                continue;
            }
            // Every expert stayed home: that is the single-node plan.
            Dealt::AllHome => continue,
        };
        match without_costly_owners(ctx, &base, &owners, a) {
            Ok(cell) => {
                let shares: Vec<String> = cell
                    .assignments
                    .iter()
                    .map(|x| {
                        let k = x.experts.map_or(0, |e| e.experts.len());
                        if x.memory.disk.0 > 0 {
                            format!("{} {k} ({} on disk)", x.node, x.memory.disk)
                        } else {
                            format!("{} {k}", x.node)
                        }
                    })
                    .collect();
                // Owners are visited in parallel: the slowest owner's round trips are the cost.
                let hop = cell
                    .predicted
                    .hops
                    .iter()
                    .map(|h| h.terms.total_s)
                    .fold(0.0, f64::max);
                let d = format!(
                    "expert split, home {}; experts per layer: {}; up to {} of round trips per token",
                    home.name,
                    shares.join(", "),
                    ms(hop)
                );
                out.push_cell(StrategyKind::Expert, d, cell);
            }
            Err(e) => out.reject(
                StrategyKind::Expert,
                &names,
                format!("expert split with home {}: {e}", home.name),
            ),
        }
    }
}

/// How [`deal_experts`] split a layer's experts.
enum Dealt {
    Split(Vec<Assignment>),
    /// The owners' memory and disk held only this many of a layer's experts.
    Stuck(usize),
    AllHome,
}

/// Hands a layer's experts out one at a time to the owner (`owners[0]` the home, each with its
/// round trip) that would finish soonest with one more, counting an owner's round trip only in
/// the layers where a token needs one of its experts.
fn deal_experts(ctx: &Ctx, base: &Assignment, owners: &[(usize, f64)]) -> Dealt {
    let n_exp = ctx.model.n_expert as usize;
    let seqs = ctx.policy.concurrency;
    let time = |o: usize, k: usize| -> f64 {
        let (gi, hop) = owners[o];
        let node = &ctx.graph.nodes[gi];
        let a = if o == 0 {
            base.clone()
        } else {
            Assignment::empty(&node.name)
        };
        let a = with_experts(a, ctx, 0, k);
        let q = contact_probability(ctx.model.n_expert, ctx.model.n_expert_used, k, 1.0);
        expert_layer_time(ctx, node, &a, seqs).map_or(f64::INFINITY, |t| t + hop * q)
    };
    let mut k = vec![0usize; owners.len()];
    let mut next: Vec<f64> = (0..owners.len()).map(|o| time(o, 1)).collect();
    for placed in 0..n_exp {
        let best = (0..owners.len())
            .filter(|&o| next[o].is_finite())
            .min_by(|&a, &b| next[a].total_cmp(&next[b]).then(a.cmp(&b)));
        let Some(o) = best else {
            return Dealt::Stuck(placed);
        };
        k[o] += 1;
        next[o] = time(o, k[o] + 1);
    }
    if k.iter().filter(|&&x| x > 0).count() < 2 {
        return Dealt::AllHome;
    }
    let mut a = Vec::new();
    let mut start = 0;
    for (o, &(gi, _)) in owners.iter().enumerate() {
        if k[o] == 0 && o != 0 {
            continue;
        }
        let node = &ctx.graph.nodes[gi];
        let base_a = if o == 0 {
            base.clone()
        } else {
            Assignment::empty(&node.name)
        };
        a.push(with_experts(base_a, ctx, start, k[o]));
        start += k[o];
    }
    debug_assert_eq!(start, n_exp);
    Dealt::Split(a)
}

/// A split as evaluated, or why it cannot be.
type Evaluated = Result<Cell, String>;

/// `split` without the owners whose part costs the home more than it saves, dropped one at a
/// time while the decode gets faster, as evaluated (or why `split` could not be). Dealing
/// experts weighs each owner's *mean* time, but a layer waits for whichever owner its token
/// reaches: an owner behind a slow link, contacted in a few layers, adds its whole round trip
/// to each of them (`cost::slowest_owner`).
fn without_costly_owners(
    ctx: &Ctx,
    base: &Assignment,
    owners: &[(usize, f64)],
    split: Vec<Assignment>,
) -> Result<Cell, String> {
    let seqs = ctx.policy.concurrency;
    let decode =
        |c: &Result<Cell, String>| c.as_ref().map_or(0.0, |c| c.predicted.decode_tokens_per_s);
    let mut kept: Vec<(usize, f64)> = owners.to_vec();
    let mut best = evaluate(ctx, CellKind::Expert, split, seqs);
    loop {
        // The best split found without one more owner, and the owners it keeps.
        let mut improved: Option<(Evaluated, Vec<(usize, f64)>)> = None;
        for drop in 1..kept.len() {
            let fewer: Vec<(usize, f64)> = kept
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != drop)
                .map(|(_, &o)| o)
                .collect();
            if let Dealt::Split(a) = deal_experts(ctx, base, &fewer) {
                let cell = evaluate(ctx, CellKind::Expert, a, seqs);
                let bar = improved.as_ref().map_or(decode(&best), |(c, _)| decode(c));
                if decode(&cell) > bar {
                    improved = Some((cell, fewer));
                }
            }
        }
        match improved {
            Some((cell, fewer)) => {
                best = cell;
                kept = fewer;
            }
            None => return best,
        }
    }
}
