//! Stage assignments: which node runs which contiguous layer range.
//!
//! The planner (a later issue) will choose these; for now an operator gives them, either as a
//! split (`--split 0..3,3..5`: stages in ring order, taking connected nodes in the order they
//! joined) or as a plan file naming the node of each stage:
//!
//! ```json
//! { "stages": [ { "node": "alpha", "layers": "0..3" }, { "node": "beta", "layers": "3..5" } ] }
//! ```
//!
//! **Cells.** Several whole copies of the model are given as one list in which each copy
//! starts again at layer 0: `--split 0..5,0..5` is two single-node cells, `0..3,3..5,0..3,3..5`
//! two rings of two. Every cell covers every layer once; no node is in two cells.
//!
//! A node is named by its `--name`, its full node id, or a unique prefix of the id.
//! [`resolve`] checks that the ranges are contiguous, cover every layer once, and land on
//! distinct connected nodes.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use tessera_net::NodeId;
use tessera_proto::{range_serde, StageSpec};

/// A plan file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanFile {
    pub stages: Vec<StageSpec>,
}

/// Why an assignment cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignmentError {
    #[error("bad split: {0}")]
    Parse(String),
    #[error("no stages")]
    Empty,
    #[error("stage {stage} starts at layer {start}, but the previous one ends at {expected}")]
    NotContiguous {
        stage: usize,
        start: usize,
        expected: usize,
    },
    #[error("the stages cover layers 0..{covered} but the model has {n_layer}")]
    Coverage { covered: usize, n_layer: usize },
    #[error("{needed} stages but only {connected} nodes are connected")]
    NotEnoughNodes { needed: usize, connected: usize },
    #[error("no connected node is called {0:?}")]
    UnknownNode(String),
    #[error("{0:?} matches more than one node")]
    AmbiguousNode(String),
    #[error("node {0} is given two stages")]
    DuplicateNode(NodeId),
}

/// The cells of a stage list, as index ranges into it: a stage (with layers) that starts at
/// layer 0 after the first begins another cell.
pub fn cells_of<T>(stages: &[(T, Range<usize>)]) -> Vec<Range<usize>> {
    let mut cells: Vec<Range<usize>> = Vec::new();
    for (i, (_, layers)) in stages.iter().enumerate() {
        match cells.last_mut() {
            Some(c) if layers.start != 0 || layers.is_empty() => c.end = i + 1,
            _ => cells.push(i..i + 1),
        }
    }
    cells
}

/// Parses `0..3,3..5` into unpinned stages.
pub fn parse_split(s: &str) -> Result<Vec<StageSpec>, AssignmentError> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            range_serde::parse(p)
                .map(|layers| StageSpec { node: None, layers })
                .map_err(AssignmentError::Parse)
        })
        .collect()
}

/// One group of an expert split: these experts (of every MoE layer) live on `node`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertGroup {
    pub experts: Vec<usize>,
    /// A node name, full node id or unique id prefix.
    pub node: String,
}

/// An expert split: `--experts 0-3@a,4-7@b` (ids and inclusive ranges joined by `+`, e.g.
/// `0-1+6@a`). A named node that is not a ring stage becomes an expert-only node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertSplit {
    pub groups: Vec<ExpertGroup>,
}

impl ExpertSplit {
    /// Expert ids owned by more than one group (must be none).
    pub fn duplicates(&self) -> Vec<usize> {
        let mut all: Vec<usize> = self.groups.iter().flat_map(|g| g.experts.clone()).collect();
        all.sort_unstable();
        let mut d: Vec<usize> = all
            .windows(2)
            .filter(|w| w[0] == w[1])
            .map(|w| w[0])
            .collect();
        d.dedup();
        d
    }
}

/// Expert ids in the `--experts` syntax: runs as inclusive ranges, joined by `+` (`0-2+5`).
pub fn ids_spec(ids: &[usize]) -> String {
    let mut v = ids.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    parts.join("+")
}

/// The `--experts` syntax: `0-3@a,4-7@b`.
impl std::fmt::Display for ExpertSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let groups: Vec<String> = self
            .groups
            .iter()
            .map(|g| format!("{}@{}", ids_spec(&g.experts), g.node))
            .collect();
        f.write_str(&groups.join(","))
    }
}

/// Parses `0-3@a,4-7@b`.
pub fn parse_experts(s: &str) -> Result<ExpertSplit, AssignmentError> {
    let bad = |what: &str| AssignmentError::Parse(format!("expert split {s:?}: {what}"));
    let mut groups = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (ids, node) = part
            .rsplit_once('@')
            .ok_or_else(|| bad("expected EXPERTS@NODE"))?;
        if node.trim().is_empty() {
            return Err(bad("empty node name"));
        }
        let mut experts = Vec::new();
        for r in ids.split('+').map(str::trim) {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            let a: usize = a.trim().parse().map_err(|_| bad("bad expert id"))?;
            let b: usize = b.trim().parse().map_err(|_| bad("bad expert id"))?;
            if b < a {
                return Err(bad("empty expert range"));
            }
            experts.extend(a..=b);
        }
        experts.sort_unstable();
        experts.dedup();
        groups.push(ExpertGroup {
            experts,
            node: node.trim().to_string(),
        });
    }
    if groups.is_empty() {
        return Err(bad("no groups"));
    }
    let split = ExpertSplit { groups };
    if let Some(e) = split.duplicates().first() {
        return Err(bad(&format!("expert {e} is given to two groups")));
    }
    Ok(split)
}

/// Finds one connected node by name, full id or unique id prefix (as stages are pinned).
pub fn find_node(want: &str, nodes: &[Candidate]) -> Result<NodeId, AssignmentError> {
    let matches: Vec<&Candidate> = nodes
        .iter()
        .filter(|c| {
            c.name == want
                || c.node_id.to_string() == want
                || (want.len() >= 4 && c.node_id.to_string().starts_with(want))
        })
        .collect();
    match matches.as_slice() {
        [] => Err(AssignmentError::UnknownNode(want.to_string())),
        [one] => Ok(one.node_id),
        _ => Err(AssignmentError::AmbiguousNode(want.to_string())),
    }
}

/// A connected node, as [`resolve`] sees it.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub node_id: NodeId,
    pub name: String,
}

/// Checks `stages` against the model and places them on `nodes` (connected nodes in join
/// order). Returns `(node, layers)` per stage in ring order.
pub fn resolve(
    stages: &[StageSpec],
    n_layer: usize,
    nodes: &[Candidate],
) -> Result<Vec<(NodeId, Range<usize>)>, AssignmentError> {
    if stages.is_empty() {
        return Err(AssignmentError::Empty);
    }
    let mut expected = 0;
    for (i, s) in stages.iter().enumerate() {
        // A stage starting at layer 0 after a complete ring begins another cell.
        if i > 0 && s.layers.start == 0 && expected == n_layer {
            expected = 0;
        }
        if s.layers.start != expected {
            return Err(AssignmentError::NotContiguous {
                stage: i,
                start: s.layers.start,
                expected,
            });
        }
        expected = s.layers.end;
    }
    if expected != n_layer {
        return Err(AssignmentError::Coverage {
            covered: expected,
            n_layer,
        });
    }
    if stages.len() > nodes.len() {
        return Err(AssignmentError::NotEnoughNodes {
            needed: stages.len(),
            connected: nodes.len(),
        });
    }
    // Pinned stages first, then unpinned ones take the remaining nodes in join order.
    let mut chosen: Vec<Option<NodeId>> = vec![None; stages.len()];
    for (i, s) in stages.iter().enumerate() {
        if let Some(want) = &s.node {
            let matches: Vec<&Candidate> = nodes
                .iter()
                .filter(|c| {
                    c.name == *want
                        || c.node_id.to_string() == *want
                        || (want.len() >= 4 && c.node_id.to_string().starts_with(want.as_str()))
                })
                .collect();
            let id = match matches.as_slice() {
                [] => return Err(AssignmentError::UnknownNode(want.clone())),
                [one] => one.node_id,
                _ => return Err(AssignmentError::AmbiguousNode(want.clone())),
            };
            if chosen.contains(&Some(id)) {
                return Err(AssignmentError::DuplicateNode(id));
            }
            chosen[i] = Some(id);
        }
    }
    let free: Vec<NodeId> = nodes
        .iter()
        .map(|c| c.node_id)
        .filter(|id| !chosen.contains(&Some(*id)))
        .collect();
    let mut free = free.into_iter();
    let mut out = Vec::with_capacity(stages.len());
    for (s, c) in stages.iter().zip(chosen) {
        let id = match c {
            Some(id) => id,
            None => free.next().ok_or(AssignmentError::NotEnoughNodes {
                needed: stages.len(),
                connected: nodes.len(),
            })?,
        };
        out.push((id, s.layers.clone()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate {
                node_id: tessera_net::NodeIdentity::from_seed([i as u8 + 1; 32]).node_id(),
                name: format!("n{i}"),
            })
            .collect()
    }

    #[test]
    fn expert_splits_parse() {
        let x = parse_experts("0-3@a,4+6-7@b").unwrap();
        assert_eq!(x.groups[0].experts, vec![0, 1, 2, 3]);
        assert_eq!(x.groups[1].experts, vec![4, 6, 7]);
        assert_eq!(x.groups[1].node, "b");
        assert!(parse_experts("0-3@a,3@b").is_err());
        assert!(parse_experts("0-3").is_err());
        assert!(parse_experts("3-1@a").is_err());
        assert_eq!(x.to_string(), "0-3@a,4+6-7@b");
        assert_eq!(parse_experts(&x.to_string()).unwrap(), x);
        let ns = nodes(2);
        assert_eq!(find_node("n1", &ns).unwrap(), ns[1].node_id);
        assert!(find_node("zz", &ns).is_err());
    }

    #[test]
    fn split_parses_and_places_in_join_order() {
        let s = parse_split("0..3,3..5").unwrap();
        assert_eq!(s.len(), 2);
        let ns = nodes(3);
        let r = resolve(&s, 5, &ns).unwrap();
        assert_eq!(r, vec![(ns[0].node_id, 0..3), (ns[1].node_id, 3..5)]);
        assert!(parse_split("0..3,x").is_err());
        assert!(parse_split("3..3").is_err());
    }

    #[test]
    fn a_split_that_starts_again_at_layer_zero_is_several_cells() {
        let ns = nodes(4);
        let r = resolve(&parse_split("0..5,0..2,2..5").unwrap(), 5, &ns).unwrap();
        assert_eq!(
            r,
            vec![
                (ns[0].node_id, 0..5),
                (ns[1].node_id, 0..2),
                (ns[2].node_id, 2..5)
            ]
        );
        assert_eq!(cells_of(&r), vec![0..1, 1..3]);
        // Every cell covers every layer: a ring cut short is not another cell.
        let short = resolve(&parse_split("0..3,0..5").unwrap(), 5, &ns);
        assert!(matches!(
            short,
            Err(AssignmentError::NotContiguous {
                stage: 1,
                start: 0,
                expected: 3
            })
        ));
        let open = resolve(&parse_split("0..5,0..3").unwrap(), 5, &ns);
        assert!(matches!(
            open,
            Err(AssignmentError::Coverage { covered: 3, .. })
        ));
        // Two cells on one node are refused like two stages on one node.
        let pinned = [
            StageSpec {
                node: Some("n0".into()),
                layers: 0..5,
            },
            StageSpec {
                node: Some("n0".into()),
                layers: 0..5,
            },
        ];
        assert!(matches!(
            resolve(&pinned, 5, &ns),
            Err(AssignmentError::DuplicateNode(_))
        ));
        // Expert-only stages (no layers) follow their ring's cell.
        assert_eq!(
            cells_of(&[((), 0..5), ((), 0..0), ((), 0..5)]),
            vec![0..2, 2..3]
        );
    }

    #[test]
    fn bad_splits_are_refused_with_reasons() {
        let ns = nodes(2);
        let r = |s: &str, n| resolve(&parse_split(s).unwrap(), n, &ns);
        assert!(matches!(
            r("0..2,3..5", 5),
            Err(AssignmentError::NotContiguous { .. })
        ));
        assert!(matches!(
            r("0..2,2..4", 5),
            Err(AssignmentError::Coverage { .. })
        ));
        assert!(matches!(
            r("0..1,1..2,2..5", 5),
            Err(AssignmentError::NotEnoughNodes { .. })
        ));
        assert!(matches!(resolve(&[], 5, &ns), Err(AssignmentError::Empty)));
    }

    #[test]
    fn plan_file_pins_nodes_by_name_or_id_prefix() {
        let ns = nodes(3);
        let prefix = ns[2].node_id.to_string()[..8].to_string();
        let plan: PlanFile = serde_json::from_str(&format!(
            r#"{{"stages":[{{"node":"{prefix}","layers":"0..2"}},{{"layers":"2..4"}},{{"node":"n0","layers":"4..5"}}]}}"#
        ))
        .unwrap();
        let r = resolve(&plan.stages, 5, &ns).unwrap();
        assert_eq!(
            r,
            vec![
                (ns[2].node_id, 0..2),
                (ns[1].node_id, 2..4),
                (ns[0].node_id, 4..5)
            ]
        );
        let dup = PlanFile {
            stages: vec![
                StageSpec {
                    node: Some("n0".into()),
                    layers: 0..2,
                },
                StageSpec {
                    node: Some("n0".into()),
                    layers: 2..5,
                },
            ],
        };
        assert!(matches!(
            resolve(&dup.stages, 5, &ns),
            Err(AssignmentError::DuplicateNode(_))
        ));
        let unknown = vec![StageSpec {
            node: Some("zz".into()),
            layers: 0..5,
        }];
        assert!(matches!(
            resolve(&unknown, 5, &ns),
            Err(AssignmentError::UnknownNode(_))
        ));
    }
}
