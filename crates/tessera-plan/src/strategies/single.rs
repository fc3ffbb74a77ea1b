//! The whole model on one node (MoE experts may stream from its disk).

use super::{stage_assignment, Generated};
use crate::cost::{evaluate, Ctx};
use crate::plan::CellKind;
use crate::resources::StrategyKind;

pub(crate) fn generate(ctx: &Ctx, out: &mut Generated) {
    let l = ctx.model.n_layers();
    for n in &ctx.graph.nodes {
        let a = stage_assignment(ctx, &n.name, 0, l);
        match evaluate(ctx, CellKind::Single, vec![a], ctx.policy.concurrency) {
            Ok(cell) => {
                let disk = cell.assignments[0].memory.disk;
                let desc = if disk.0 > 0 {
                    format!(
                        "single node {} ({disk} of experts streamed from disk)",
                        n.name
                    )
                } else {
                    format!("single node {}", n.name)
                };
                out.push_cell(StrategyKind::Single, desc, cell);
            }
            Err(reason) => out.reject(
                StrategyKind::Single,
                &[&n.name],
                format!("single node {}: {reason}", n.name),
            ),
        }
    }
}
