//! Whole-request replicas: independent cells, each holding the whole model (a single node, or a
//! stage ring built from the nodes that cannot hold it alone), behind one endpoint. Requests go to
//! the fastest free cell, so one request decodes at the best cell's speed and concurrent requests
//! spread over the cells.

use super::stage::{ring_cell, solve, Metric, MAX_DP_NODES};
use super::{stage_assignment, Generated};
use crate::cost::{evaluate, Ctx};
use crate::plan::{Candidate, Cell, CellKind, Prediction};
use crate::resources::{SharedMachine, StrategyKind};

/// Spreads `c` requests over the cells, each step to the cell that adds the most tokens/s.
/// Cells whose nodes share a machine's cores ([`SharedMachine`]) slow each other down while
/// they are busy together, so a request's gain counts what it takes from its neighbours.
///
/// `token_overhead_s` is the runtime's fixed time per step (waiting on hand-offs, not computing):
/// cells that share a machine's cores stretch only their work by the share, not that.
pub(crate) fn combined_throughput(
    cells: &[Cell],
    c: u32,
    machines: &[SharedMachine],
    token_overhead_s: f64,
) -> f64 {
    let mut alloc = vec![0usize; cells.len()];
    for _ in 0..c {
        let now = total(cells, &alloc, machines, token_overhead_s);
        let mut best: Option<(usize, f64)> = None;
        for i in 0..cells.len() {
            if alloc[i] >= cells[i].throughput_curve.len() {
                continue;
            }
            alloc[i] += 1;
            let gain = total(cells, &alloc, machines, token_overhead_s) - now;
            alloc[i] -= 1;
            // Ties go to the earlier cell.
            if best.is_none_or(|(_, g)| gain > g) {
                best = Some((i, gain));
            }
        }
        match best {
            Some((i, _)) => alloc[i] += 1,
            None => break,
        }
    }
    total(cells, &alloc, machines, token_overhead_s)
}

/// The cells' tokens/s with `alloc[i]` requests on cell `i`: each busy cell's curve, its work
/// per step stretched by the share of its slowest shared machine (the runtime's fixed
/// `token_overhead_s` a step is not).
fn total(
    cells: &[Cell],
    alloc: &[usize],
    machines: &[SharedMachine],
    token_overhead_s: f64,
) -> f64 {
    // Nodes computing at once on each machine: a busy cell's nodes there, at most one per
    // request it serves (a ring's stages take turns on one request).
    let busy_on = |m: &SharedMachine| -> usize {
        cells
            .iter()
            .zip(alloc)
            .filter(|(_, &k)| k > 0)
            .map(|(cell, &k)| {
                let here = cell
                    .nodes()
                    .iter()
                    .filter(|n| m.nodes.iter().any(|x| x == *n))
                    .count();
                here.min(k)
            })
            .sum()
    };
    let shares: Vec<f64> = machines.iter().map(|m| m.share(busy_on(m))).collect();
    cells
        .iter()
        .zip(alloc)
        .filter(|(_, &k)| k > 0)
        .map(|(cell, &k)| {
            let share = machines
                .iter()
                .zip(&shares)
                .filter(|(m, _)| cell.nodes().iter().any(|n| m.nodes.iter().any(|x| x == n)))
                .map(|(_, &s)| s)
                .fold(1.0, f64::min);
            shared_rate(cell.throughput_curve[k - 1], k, share, token_overhead_s)
        })
        .sum()
}

/// Tokens/s of a cell running `k` requests at `rate` alone, given `share` of its machine's
/// cores: a step's work takes `1 / share` as long, its fixed overhead the same.
fn shared_rate(rate: f64, k: usize, share: f64, overhead_s: f64) -> f64 {
    if rate.is_nan() || rate <= 0.0 || share >= 1.0 {
        return rate * share.min(1.0);
    }
    let step = k as f64 / rate;
    let fixed = overhead_s.clamp(0.0, step);
    k as f64 / ((step - fixed) / share.max(1e-9) + fixed)
}

pub(crate) fn generate(ctx: &Ctx, out: &mut Generated) {
    if ctx.graph.nodes.len() < 2 {
        return;
    }
    let l = ctx.model.n_layers();
    // Nodes that hold the model alone form single cells.
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut rest = Vec::new();
    for (i, n) in ctx.graph.nodes.iter().enumerate() {
        if evaluate(
            ctx,
            CellKind::Single,
            vec![stage_assignment(ctx, &n.name, 0, l)],
            1,
        )
        .is_ok()
        {
            groups.push(vec![i]);
        } else {
            rest.push(i);
        }
    }
    // The others form stage rings, best ring first, while any ring is legal.
    let mut rings = Vec::new();
    while rest.len() >= 2 {
        let pool: Vec<usize> = rest.iter().copied().take(MAX_DP_NODES).collect();
        let solved = solve(ctx, &pool, 1, Metric::Latency);
        let Some((_, ring)) = solved.best_split() else {
            break;
        };
        rest.retain(|i| !ring.order.contains(i));
        rings.push(ring.clone());
        groups.push(ring.order.clone());
    }
    let all: Vec<&str> = ctx.graph.nodes.iter().map(|n| n.name.as_str()).collect();
    if groups.len() < 2 {
        out.reject(
            StrategyKind::Replica,
            &all,
            format!(
                "whole-request replicas need two cells that each hold the whole model; the nodes form {}",
                groups.len()
            ),
        );
        return;
    }
    let seqs = ctx.policy.concurrency.div_ceil(groups.len() as u32).max(1);
    let mut cells = Vec::new();
    let mut ring_iter = rings.iter();
    for g in &groups {
        let cell = if g.len() == 1 {
            let n = &ctx.graph.nodes[g[0]].name;
            evaluate(
                ctx,
                CellKind::Single,
                vec![stage_assignment(ctx, n, 0, l)],
                seqs,
            )
        } else {
            ring_cell(ctx, ring_iter.next().expect("a ring per group"), seqs)
        };
        match cell {
            Ok(c) => cells.push(c),
            Err(e) => out.notes.push(format!("replica cell dropped: {e}")),
        }
    }
    if cells.len() < 2 {
        out.reject(
            StrategyKind::Replica,
            &all,
            "fewer than two replica cells fit with their share of requests".into(),
        );
        return;
    }
    let best = cells
        .iter()
        .enumerate()
        .max_by(|a, b| {
            a.1.predicted
                .decode_tokens_per_s
                .total_cmp(&b.1.predicted.decode_tokens_per_s)
                .then(b.0.cmp(&a.0))
        })
        .map(|(i, _)| i)
        .expect("cells");
    let c = ctx.policy.concurrency.max(1);
    let predicted = Prediction {
        throughput_tokens_per_s: combined_throughput(
            &cells,
            c,
            &ctx.graph.machines,
            ctx.graph.token_overhead_s,
        ),
        concurrency: c,
        ..cells[best].predicted.clone()
    };
    let desc: Vec<String> = cells.iter().map(|c| c.nodes().join("+")).collect();
    out.candidates.push(Candidate {
        strategy: StrategyKind::Replica,
        description: format!(
            "{} whole-request replicas: {}",
            cells.len(),
            desc.join(" | ")
        ),
        cells,
        predicted,
    });
}

#[cfg(test)]
mod tests {
    use super::shared_rate;

    #[test]
    fn sharing_cores_stretches_a_steps_work_but_not_its_fixed_overhead() {
        // 1,000 tok/s alone: 1 ms a token, 0.4 ms of it the runtime's fixed overhead.
        let half = shared_rate(1000.0, 1, 0.5, 0.4e-3);
        // Work 0.6 ms → 1.2 ms at half the cores, plus 0.4: 1.6 ms a token.
        assert!((half - 1.0 / 1.6e-3).abs() < 1e-6, "{half}");
        // Without a fixed overhead the whole step stretches; with the whole machine nothing does.
        assert!((shared_rate(1000.0, 1, 0.5, 0.0) - 500.0).abs() < 1e-9);
        assert_eq!(shared_rate(1000.0, 4, 1.0, 0.4e-3), 1000.0);
    }
}
