//! Re-planning onto the nodes that are left: a pure function from the live members to a ring of
//! contiguous layer ranges.
//!
//! This is the seam where the planner proper (`planning`: live inventory → `tessera-plan` →
//! assignment) plugs in. Until it does, [`even_split`] places the layers evenly over as many
//! connected nodes as the configured stage count allows (join order), and refuses a placement
//! that breaks a node's memory budget when the weight bytes are known.

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
    pub layers: Vec<u64>,
    pub embed: u64,
    pub head: u64,
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

/// An even split of `n_layer` layers over at most `target` of `nodes` (in order), within their
/// budgets where `bytes` tells what a stage weighs. Tries `min(target, nodes)` stages first,
/// then more nodes (smaller shares) up to all of them, before giving up; the error says why.
pub fn even_split(
    n_layer: usize,
    nodes: &[Survivor],
    target: usize,
    bytes: Option<&ModelBytes>,
) -> Result<Vec<(NodeId, Range<usize>)>, String> {
    if nodes.is_empty() {
        return Err("no node is connected".into());
    }
    if n_layer == 0 {
        return Err("the model has no layers".into());
    }
    let first = target.clamp(1, nodes.len()).min(n_layer);
    let mut last_err = String::new();
    for n in first..=nodes.len().min(n_layer) {
        let ranges = even_ranges(n_layer, n);
        let fits = ranges.iter().zip(nodes).try_for_each(|(r, node)| {
            match (bytes, node.memory_budget_bytes) {
                (Some(b), Some(budget)) if b.stage(r, n_layer) > budget => Err(format!(
                    "node {} cannot hold layers {}..{} ({} bytes) within its budget of {budget} bytes",
                    node.node_id.short(),
                    r.start,
                    r.end,
                    b.stage(r, n_layer)
                )),
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
            Err(e) => last_err = e,
        }
    }
    Err(format!(
        "no placement on {} node(s) fits: {last_err}",
        nodes.len()
    ))
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
        };
        let tight = [node(1, Some(25)), node(2, Some(25)), node(3, Some(25))];
        // Two stages need 35 bytes each; three need 25.
        let s = even_split(6, &tight, 2, Some(&bytes)).unwrap();
        assert_eq!(s.len(), 3);
        let err = even_split(6, &tight[..2], 2, Some(&bytes)).unwrap_err();
        assert!(err.contains("budget"), "{err}");
        assert!(even_split(6, &[], 2, None).is_err());
    }
}
