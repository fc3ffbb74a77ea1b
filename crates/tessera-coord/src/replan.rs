//! Re-planning onto the nodes that are left: a pure function from the live members to a ring of
//! contiguous layer ranges.
//!
//! This is the seam where the planner proper (`planning`: live inventory → `tessera-plan` →
//! assignment) plugs in. Until it does, [`even_split`] places the layers evenly over as many
//! connected nodes as the configured stage count allows (join order), and refuses a placement
//! that breaks a node's memory budget when the weight bytes are known. With an expert split,
//! [`replace_experts`] hands the experts of departed owners to the nodes still holding experts
//! or stages, where they have the most room.

use std::ops::Range;

use tessera_net::NodeId;

/// A node that may take a stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Survivor {
    pub node_id: NodeId,
    /// The node's memory budget, bytes, when it announced one.
    pub memory_budget_bytes: Option<u64>,
}

/// What the model weighs, to check budgets: bytes per layer, plus the embedding (first stage)
/// and the head (last stage).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelBytes {
    /// Whole layers, all their experts included.
    pub layers: Vec<u64>,
    pub embed: u64,
    pub head: u64,
    /// Bytes of one expert (gate, up and down) per layer; empty or 0 for dense layers.
    pub expert: Vec<u64>,
    /// Experts per MoE layer (0 for a dense model).
    pub n_expert: usize,
}

impl ModelBytes {
    /// Bytes a stage holding `layers` needs.
    pub fn stage(&self, layers: &Range<usize>, n_layer: usize) -> u64 {
        let mut b: u64 = self
            .layers
            .get(layers.clone())
            .map_or(0, |l| l.iter().sum());
        if layers.start == 0 {
            b += self.embed;
        }
        if layers.end == n_layer {
            b += self.head;
        }
        b
    }

    /// The same model without its experts: what a ring stage of an expert split must hold in
    /// memory (experts beyond its budget are streamed from disk).
    pub fn without_experts(&self) -> Self {
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(l, &b)| {
                b.saturating_sub(self.expert.get(l).copied().unwrap_or(0) * self.n_expert as u64)
            })
            .collect();
        Self {
            layers,
            expert: Vec::new(),
            n_expert: 0,
            ..self.clone()
        }
    }

    /// Bytes of one expert id held in every layer.
    pub fn expert_all_layers(&self) -> u64 {
        self.expert.iter().sum()
    }

    /// Bytes a node of an expert split needs: the stage `layers` without their experts (none
    /// for an expert-only node), plus `held` expert ids in every layer.
    pub fn expert_holder(&self, layers: &Range<usize>, n_layer: usize, held: usize) -> u64 {
        let dense = if layers.is_empty() {
            0
        } else {
            let experts: u64 = self
                .expert
                .get(layers.clone())
                .map_or(0, |e| e.iter().sum());
            self.stage(layers, n_layer)
                .saturating_sub(experts * self.n_expert as u64)
        };
        dense + held as u64 * self.expert_all_layers()
    }
}

/// A node that may take experts of a departed owner: a surviving owner or a ring stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertHolder {
    pub node_id: NodeId,
    /// Its ring layers (empty for an expert-only node).
    pub layers: Range<usize>,
    /// Expert ids it holds (in every layer).
    pub experts: Vec<usize>,
    /// What it may hold: its memory budget, else the RAM it had available; `None` if unknown.
    pub limit: Option<u64>,
}

impl ExpertHolder {
    /// Room left under its limit (negative: over it), bytes; `None` without a limit or sizes.
    fn headroom(&self, bytes: Option<&ModelBytes>, n_layer: usize) -> Option<i128> {
        let b = bytes?;
        let used = b.expert_holder(&self.layers, n_layer, self.experts.len());
        Some(i128::from(self.limit?) - i128::from(used))
    }
}

/// Hands each of `orphans` (expert ids whose owner departed) to one of `holders`: the one with
/// the most room left under its limit once it takes it (so the loss spreads by free memory),
/// else, when sizes or limits are unknown, the one holding the fewest experts. A holder pushed
/// over its limit still takes the expert: the node streams experts from disk when what it is
/// given exceeds its budget. Returns, per holder, the ids it was given.
pub fn replace_experts(
    orphans: &[usize],
    holders: &mut [ExpertHolder],
    bytes: Option<&ModelBytes>,
    n_layer: usize,
) -> Vec<Vec<usize>> {
    let mut given = vec![Vec::new(); holders.len()];
    if holders.is_empty() {
        return given;
    }
    for &e in orphans {
        let best = (0..holders.len())
            .max_by(|&a, &b| {
                let (ha, hb) = (
                    holders[a].headroom(bytes, n_layer),
                    holders[b].headroom(bytes, n_layer),
                );
                // A known limit beats an unknown one only when it has room; ties: fewer experts,
                // then the earlier holder.
                let room = |h: Option<i128>| h.map_or(0, |h| h.signum());
                room(ha)
                    .cmp(&room(hb))
                    .then(match (ha, hb) {
                        (Some(x), Some(y)) => x.cmp(&y),
                        _ => std::cmp::Ordering::Equal,
                    })
                    .then(holders[b].experts.len().cmp(&holders[a].experts.len()))
                    .then(b.cmp(&a))
            })
            .expect("holders is not empty");
        holders[best].experts.push(e);
        holders[best].experts.sort_unstable();
        given[best].push(e);
    }
    given
}

/// `n_layer` layers in `n` contiguous ranges as even as can be (the first ranges take the
/// remainder).
pub fn even_ranges(n_layer: usize, n: usize) -> Vec<Range<usize>> {
    let n = n.clamp(1, n_layer.max(1));
    let (base, extra) = (n_layer / n, n_layer % n);
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    for i in 0..n {
        let len = base + usize::from(i < extra);
        out.push(start..start + len);
        start += len;
    }
    out
}

/// Why no even split could be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoPlacement {
    #[error("no node is connected")]
    NoNode,
    #[error("the model has no layers")]
    NoLayers,
    /// Every stage count tried left some node a share beyond its budget; this is the last
    /// one that did not fit.
    #[error(
        "no placement on {nodes} node(s) fits: node {} cannot hold layers {}..{} ({needed} \
         bytes) within its budget of {budget} bytes",
        node.short(),
        layers.start,
        layers.end
    )]
    OverBudget {
        nodes: usize,
        node: NodeId,
        layers: Range<usize>,
        needed: u64,
        budget: u64,
    },
}

/// An even split of `n_layer` layers over at most `target` of `nodes` (in order), within their
/// budgets where `bytes` tells what a stage weighs. Tries `min(target, nodes)` stages first,
/// then more nodes (smaller shares) up to all of them, before giving up; the error says why.
pub fn even_split(
    n_layer: usize,
    nodes: &[Survivor],
    target: usize,
    bytes: Option<&ModelBytes>,
) -> Result<Vec<(NodeId, Range<usize>)>, NoPlacement> {
    if nodes.is_empty() {
        return Err(NoPlacement::NoNode);
    }
    if n_layer == 0 {
        return Err(NoPlacement::NoLayers);
    }
    let first = target.clamp(1, nodes.len()).min(n_layer);
    let mut last_err = None;
    for n in first..=nodes.len().min(n_layer) {
        let ranges = even_ranges(n_layer, n);
        let fits = ranges.iter().zip(nodes).try_for_each(|(r, node)| {
            match (bytes, node.memory_budget_bytes) {
                (Some(b), Some(budget)) if b.stage(r, n_layer) > budget => {
                    Err(NoPlacement::OverBudget {
                        nodes: nodes.len(),
                        node: node.node_id,
                        layers: r.clone(),
                        needed: b.stage(r, n_layer),
                        budget,
                    })
                }
                _ => Ok(()),
            }
        });
        match fits {
            Ok(()) => {
                return Ok(nodes
                    .iter()
                    .zip(ranges)
                    .map(|(n, r)| (n.node_id, r))
                    .collect())
            }
            Err(e) => last_err = Some(e),
        }
    }
    Err(last_err.expect("at least one stage count was tried"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_net::NodeIdentity;

    fn node(i: u8, budget: Option<u64>) -> Survivor {
        Survivor {
            node_id: NodeIdentity::from_seed([i; 32]).node_id(),
            memory_budget_bytes: budget,
        }
    }

    #[test]
    fn ranges_are_even_and_contiguous() {
        assert_eq!(even_ranges(5, 2), vec![0..3, 3..5]);
        assert_eq!(even_ranges(5, 3), vec![0..2, 2..4, 4..5]);
        assert_eq!(even_ranges(2, 4), vec![0..1, 1..2]);
        assert_eq!(even_ranges(7, 1), vec![0..7]);
    }

    #[test]
    fn split_takes_the_target_count_and_spreads_out_when_budgets_are_tight() {
        let nodes = [node(1, None), node(2, None), node(3, None)];
        let s = even_split(5, &nodes[..2], 3, None).unwrap();
        assert_eq!(
            s.iter().map(|x| x.1.clone()).collect::<Vec<_>>(),
            [0..3, 3..5]
        );
        let bytes = ModelBytes {
            layers: vec![10; 6],
            embed: 5,
            head: 5,
            ..ModelBytes::default()
        };
        let tight = [node(1, Some(25)), node(2, Some(25)), node(3, Some(25))];
        // Two stages need 35 bytes each; three need 25.
        let s = even_split(6, &tight, 2, Some(&bytes)).unwrap();
        assert_eq!(s.len(), 3);
        let err = even_split(6, &tight[..2], 2, Some(&bytes)).unwrap_err();
        assert!(
            matches!(err, NoPlacement::OverBudget { nodes: 2, .. }),
            "{err}"
        );
        assert!(even_split(6, &[], 2, None).is_err());
    }

    #[test]
    fn lost_experts_go_where_there_is_room_and_overflow_goes_to_the_least_full() {
        // Two layers of 8 experts of 10 bytes each, plus 20 bytes of attention per layer.
        let bytes = ModelBytes {
            layers: vec![100; 2],
            embed: 5,
            head: 5,
            expert: vec![10; 2],
            n_expert: 8,
        };
        assert_eq!(bytes.expert_holder(&(0..2), 2, 0), 50);
        assert_eq!(bytes.expert_holder(&(0..2), 2, 3), 110);
        assert_eq!(bytes.expert_holder(&(0..0), 2, 2), 40);
        let id = |i: u8| NodeIdentity::from_seed([i; 32]).node_id();
        let holder = |i: u8, layers, experts: Vec<usize>, limit| ExpertHolder {
            node_id: id(i),
            layers,
            experts,
            limit,
        };
        // Home (0..2, experts 0-1: 90 of 150 bytes) and owner x (experts 2-4: 60 of 100); the
        // owner of 5-7 is gone. Room: home 60, x 40 → home; then 40 each, equal counts → the
        // earlier, home; then x.
        let mut hs = vec![
            holder(1, 0..2, vec![0, 1], Some(150)),
            holder(2, 0..0, vec![2, 3, 4], Some(100)),
        ];
        let given = replace_experts(&[5, 6, 7], &mut hs, Some(&bytes), 2);
        assert_eq!(given, vec![vec![5, 6], vec![7]]);
        assert_eq!(hs[0].experts, vec![0, 1, 5, 6]);
        // Nobody has room: the least over its limit takes each (and will stream it).
        let mut hs = vec![
            holder(1, 0..0, vec![0, 1, 2, 3], Some(60)),
            holder(2, 0..0, vec![4, 5], Some(30)),
        ];
        let given = replace_experts(&[6, 7], &mut hs, Some(&bytes), 2);
        assert_eq!(given, vec![vec![7], vec![6]]);
        // No sizes: by count.
        let mut hs = vec![
            holder(1, 0..0, vec![0, 1, 2], None),
            holder(2, 0..0, vec![3], None),
        ];
        let given = replace_experts(&[4, 5, 6, 7], &mut hs, None, 2);
        assert_eq!(given, vec![vec![6], vec![4, 5, 7]]);
    }
}
