//! Throughput: the aggregate tokens/s of a cell serving several sequences at once, a pipelined
//! ring keeping several micro-batches in flight. Kept apart because it is a use of step costing
//! under concurrency, not part of a single step.

use super::memory::Placement;
use super::step::{pass, Mode};
use super::Ctx;
use crate::plan::{Assignment, CellKind};

/// Aggregate tokens/s of a cell serving `c` concurrent sequences.
pub(super) fn throughput(
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
