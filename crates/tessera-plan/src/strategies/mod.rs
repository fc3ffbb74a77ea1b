//! Strategies: each generates legal, costed candidates and says why the illegal ones are illegal.

pub(crate) mod bank;
pub(crate) mod expert;
pub(crate) mod replica;
pub(crate) mod single;
pub(crate) mod stage;

use crate::cost::Ctx;
use crate::plan::{Assignment, Candidate, Cell, ExpertSlice, LayerRange, Rejection};
use crate::resources::StrategyKind;

/// What the strategies produced.
#[derive(Default)]
pub(crate) struct Generated {
    pub candidates: Vec<Candidate>,
    pub rejected: Vec<Rejection>,
    pub notes: Vec<String>,
}

impl Generated {
    pub fn reject(&mut self, strategy: StrategyKind, nodes: &[&str], reason: String) {
        self.rejected.push(Rejection {
            strategy,
            nodes: nodes.iter().map(|s| s.to_string()).collect(),
            reason,
            decode_tokens_per_s: None,
        });
    }
    pub fn push_cell(&mut self, strategy: StrategyKind, description: String, cell: Cell) {
        let predicted = cell.predicted.clone();
        self.candidates.push(Candidate {
            strategy,
            description,
            cells: vec![cell],
            predicted,
        });
    }
}

/// Runs every strategy the policy allows.
pub(crate) fn generate(ctx: &Ctx) -> Generated {
    let mut g = Generated::default();
    let p = ctx.policy;
    for s in crate::resources::StrategyKind::ALL {
        if !p.allows(s) {
            g.notes.push(format!(
                "strategy {s} not considered: the policy does not allow it"
            ));
            continue;
        }
        match s {
            StrategyKind::Single => single::generate(ctx, &mut g),
            StrategyKind::Stage => stage::generate(ctx, &mut g),
            StrategyKind::Expert => expert::generate(ctx, &mut g),
            StrategyKind::Bank => bank::generate(ctx, &mut g),
            StrategyKind::Replica => replica::generate(ctx, &mut g),
        }
    }
    g
}

/// All experts of the MoE layers in `[start, end)`, if the model has any.
pub(crate) fn all_experts(ctx: &Ctx, start: usize, end: usize) -> Option<ExpertSlice> {
    ctx.model.is_moe().then(|| ExpertSlice {
        layers: LayerRange::new(start, end),
        experts: LayerRange::new(0, ctx.model.n_expert as usize),
    })
}

/// A stage holding layers `[start, end)` with their experts; the first holds the embedding, the
/// last the head.
pub(crate) fn stage_assignment(ctx: &Ctx, node: &str, start: usize, end: usize) -> Assignment {
    let l = ctx.model.n_layers();
    Assignment {
        layers: Some(LayerRange::new(start, end)),
        ffn: Some(LayerRange::new(start, end)),
        experts: all_experts(ctx, start, end),
        embedding: start == 0,
        head: end == l,
        ..Assignment::empty(node)
    }
}

pub(crate) fn ms(s: f64) -> String {
    if s >= 0.1 {
        format!("{:.0} ms", s * 1e3)
    } else {
        format!("{:.2} ms", s * 1e3)
    }
}
