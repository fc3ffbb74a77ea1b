//! Weight-bank offload: one main node runs the model and coordinates; the FFN (dense or experts) of
//! the last `k` layers is a bounded bank held and computed by a remote node, visited once per banked
//! layer. For each (main, bank) pair the bank size with the best predicted token time is kept.

use super::{ms, Generated};
use crate::cost::{evaluate, stage_time, Ctx};
use crate::plan::{Assignment, CellKind, ExpertSlice, LayerRange};
use crate::resources::StrategyKind;

fn split(ctx: &Ctx, main: &str, bank: &str, k: usize) -> (Assignment, Assignment) {
    let l = ctx.model.n_layers();
    let cut = l - k;
    let experts = |a: usize, b: usize| {
        (ctx.model.is_moe() && b > a).then(|| ExpertSlice {
            layers: LayerRange::new(a, b),
            experts: LayerRange::new(0, ctx.model.n_expert as usize),
        })
    };
    let m = Assignment {
        layers: Some(LayerRange::new(0, l)),
        ffn: (cut > 0).then(|| LayerRange::new(0, cut)),
        experts: experts(0, cut),
        embedding: true,
        head: true,
        ..Assignment::empty(main)
    };
    let b = Assignment {
        ffn: Some(LayerRange::new(cut, l)),
        experts: experts(cut, l),
        ..Assignment::empty(bank)
    };
    (m, b)
}

pub(crate) fn generate(ctx: &Ctx, out: &mut Generated) {
    if ctx.graph.nodes.len() < 2 {
        return;
    }
    let l = ctx.model.n_layers();
    let seqs = ctx.policy.concurrency;
    let hidden = ctx.model.hidden_wire_bytes();
    for main in &ctx.graph.nodes {
        let mut best: Option<(f64, &str, usize)> = None;
        for bank in &ctx.graph.nodes {
            if bank.name == main.name {
                continue;
            }
            let Some(link) = ctx.link(&main.name, &bank.name) else {
                continue;
            };
            let visit =
                link.rtt_s + 2.0 * ctx.graph.hop_overhead_s + 2.0 * link.bandwidth.secs(hidden);
            for k in 1..=l {
                let (m, b) = split(ctx, &main.name, &bank.name, k);
                let Some(tb) = stage_time(ctx, bank, &b, seqs, 1.0) else {
                    break;
                };
                let Some(tm) = stage_time(ctx, main, &m, seqs, 1.0) else {
                    continue;
                };
                let t = tm + tb + k as f64 * visit;
                if best.is_none_or(|(bt, _, _)| t < bt) {
                    best = Some((t, &bank.name, k));
                }
            }
        }
        let Some((_, bank, k)) = best else {
            out.reject(
                StrategyKind::Bank,
                &[&main.name],
                format!(
                    "weight bank with main {}: no linked node can hold a bank that makes it fit",
                    main.name
                ),
            );
            continue;
        };
        let (m, b) = split(ctx, &main.name, bank, k);
        match evaluate(ctx, CellKind::Bank, vec![m, b], seqs) {
            Ok(cell) => {
                let d = format!(
                    "weight bank: {} runs the model, {bank} serves the FFN of layers [{}, {l}) ({} of round trips per token)",
                    main.name,
                    l - k,
                    ms(cell.predicted.decode.network_s())
                );
                out.push_cell(StrategyKind::Bank, d, cell);
            }
            Err(e) => out.reject(
                StrategyKind::Bank,
                &[&main.name, bank],
                format!("weight bank: {e}"),
            ),
        }
    }
}
