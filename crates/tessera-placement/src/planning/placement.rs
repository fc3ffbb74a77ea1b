//! Plan → what the fabric runs: a single-node or stage-ring plan becomes a [`PlanFile`] of
//! stages pinned by node name ([`to_assignment`]); an expert-split plan becomes its home ring and
//! its `--experts` placement ([`to_expert_placement`]); [`to_placement`] picks between them and
//! says why a plan cannot run.

use tessera_plan::{CellKind, ModelProfile, Plan, StrategyKind};
use tessera_proto::StageSpec;

use crate::assignment::PlanFile;

/// What the fabric runs for a plan: the ring stages, pinned by node name, and for an expert
/// split where each expert id lives (in every layer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub ring: PlanFile,
    pub experts: Option<crate::assignment::ExpertSplit>,
}

/// The placement of an executable plan: a single-node or stage-ring plan becomes its stages
/// ([`to_assignment`]); an expert split becomes its home ring and expert split
/// ([`to_expert_placement`]).
///
/// A node streams experts from its disk when given more than its budget holds: a single node
/// that leaves experts on disk runs as an expert split homed on it that owns every expert
/// ([`to_streaming_placement`]); a ring stage of an MoE model streams the experts of its own
/// layers. A stage that would leave anything else on disk (a dense model's layers) is not
/// executable: its node would refuse the load.
pub fn to_placement(
    plan: &Plan,
    n_layer: usize,
    n_expert: usize,
) -> Result<Placement, NotExpertPlacement> {
    match plan.cells.as_slice() {
        [cell] if cell.kind == CellKind::Expert => {
            // The ring holds attention and the dense FFN of whole layers, every layer once.
            let ring_ok = cell
                .assignments
                .iter()
                .all(|a| a.layers.is_none() || a.layers == a.ffn);
            if !ring_ok {
                return Err(NotExecutable::Strategy(plan.strategy).into());
            }
            let (ring, experts) = to_expert_placement(&cell.assignments, n_layer, n_expert)?;
            let covered = ring.stages.last().map_or(0, |s| s.layers.end);
            if covered != n_layer {
                return Err(NotExpertPlacement::RingCoverage { covered, n_layer });
            }
            Ok(Placement {
                ring,
                experts: Some(experts),
            })
        }
        _ => {
            if let Some(p) = to_streaming_placement(plan, n_layer, n_expert) {
                return Ok(p);
            }
            let ring = to_assignment(plan)?;
            // A stage of an MoE model holds every expert of its layers.
            if let Some(a) = plan.assignments().find(|a| {
                a.experts
                    .is_some_and(|x| x.experts.end as usize != n_expert)
            }) {
                return Err(NotExpertPlacement::StageExperts(a.node.clone()));
            }
            Ok(Placement {
                ring,
                experts: None,
            })
        }
    }
}

/// The nodes of `plan` that leave experts on disk, each with the bytes of experts the plan keeps
/// in its memory (every expert it holds less the experts it leaves on disk; an embedding the
/// plan leaves on disk stays in the file's mapping on the node too): the expert budget each
/// streams under (`--expert-budget`, or the coordinator's assignment).
pub fn expert_budgets(model: &ModelProfile, plan: &Plan) -> Vec<(String, u64)> {
    plan.assignments()
        .filter(|a| a.memory.experts_on_disk.0 > 0)
        .filter_map(|a| {
            let x = a.experts?;
            let held: u64 = model
                .layers
                .iter()
                .enumerate()
                .filter(|(i, _)| x.layers.contains(*i))
                .map(|(_, l)| l.expert.0 * x.experts.len() as u64)
                .sum();
            Some((
                a.node.clone(),
                held.saturating_sub(a.memory.experts_on_disk.0),
            ))
        })
        .collect()
}

/// The placement of a single-node plan of an MoE model that leaves experts on disk: an expert
/// split whose home is that node and owns every expert, so that the node, given experts, streams
/// those its budget cannot hold from its own disk (the fabric streams only an expert split's
/// experts). `None` for any other plan.
///
/// The one-host baseline of a cluster: what the best single machine does with a model larger
/// than its memory.
pub fn to_streaming_placement(plan: &Plan, n_layer: usize, n_expert: usize) -> Option<Placement> {
    let [cell] = plan.cells.as_slice() else {
        return None;
    };
    let [a] = cell.assignments.as_slice() else {
        return None;
    };
    let whole = a.layers.is_some_and(|l| l.iter() == (0..n_layer)) && a.layers == a.ffn;
    let every_expert = a.experts.is_some_and(|x| {
        x.layers == a.layers.expect("checked") && x.experts.iter() == (0..n_expert)
    });
    if cell.kind != CellKind::Single || !whole || !every_expert || a.memory.experts_on_disk.0 == 0 {
        return None;
    }
    Some(Placement {
        ring: PlanFile {
            stages: vec![StageSpec {
                node: Some(a.node.clone()),
                layers: 0..n_layer,
            }],
        },
        experts: Some(crate::assignment::ExpertSplit {
            groups: vec![crate::assignment::ExpertGroup {
                experts: (0..n_expert).collect(),
                node: a.node.clone(),
            }],
        }),
    })
}

/// Why a plan cannot become a stage assignment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotExecutable {
    #[error("the fabric cannot execute a {0} plan yet")]
    Strategy(StrategyKind),
    #[error(
        "stage {stage} ({node}) starts at layer {start}, but the previous one ends at {expected}"
    )]
    NotContiguous {
        stage: usize,
        node: String,
        start: usize,
        expected: usize,
    },
}

/// Why an expert-split plan cannot become a ring plus an `--experts` placement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotExpertPlacement {
    #[error(transparent)]
    Stages(#[from] NotExecutable),
    #[error(
        "{node} holds experts of layers {layers} only: the fabric places experts for every layer"
    )]
    PartialLayers { node: String, layers: String },
    #[error("experts {0:?} are held by more than one node")]
    Duplicates(Vec<usize>),
    #[error("experts {0:?} are held by no node")]
    Missing(Vec<usize>),
    #[error("{0} holds some experts of its layers only: a ring stage holds all of them")]
    StageExperts(String),
    #[error("the ring covers layers 0..{covered} but the model has {n_layer}")]
    RingCoverage { covered: usize, n_layer: usize },
}

/// The ring stages and the `--experts` placement of an expert-split plan's assignments: the
/// nodes holding attention become the ring stages (the experts' home nodes), in order; every
/// node holding experts owns those expert ids in every layer (the fabric's placement is the
/// same for all layers, so an expert slice must cover all `n_layer` layers).
pub fn to_expert_placement(
    assignments: &[tessera_plan::Assignment],
    n_layer: usize,
    n_expert: usize,
) -> Result<(PlanFile, crate::assignment::ExpertSplit), NotExpertPlacement> {
    use crate::assignment::{ExpertGroup, ExpertSplit};
    let mut stages = Vec::new();
    let mut expected = 0;
    for a in assignments {
        let Some(l) = a.layers else { continue };
        if l.start as usize != expected {
            return Err(NotExecutable::NotContiguous {
                stage: stages.len(),
                node: a.node.clone(),
                start: l.start as usize,
                expected,
            }
            .into());
        }
        expected = l.end as usize;
        stages.push(StageSpec {
            node: Some(a.node.clone()),
            layers: l.iter(),
        });
    }
    let mut groups: Vec<ExpertGroup> = Vec::new();
    for a in assignments {
        let Some(x) = a.experts else { continue };
        if x.layers.iter() != (0..n_layer) {
            return Err(NotExpertPlacement::PartialLayers {
                node: a.node.clone(),
                layers: x.layers.to_string(),
            });
        }
        match groups.iter_mut().find(|g| g.node == a.node) {
            Some(g) => g.experts.extend(x.experts.iter()),
            None => groups.push(ExpertGroup {
                experts: x.experts.iter().collect(),
                node: a.node.clone(),
            }),
        }
    }
    let split = ExpertSplit { groups };
    let dup = split.duplicates();
    if !dup.is_empty() {
        return Err(NotExpertPlacement::Duplicates(dup));
    }
    let missing: Vec<usize> = (0..n_expert)
        .filter(|e| !split.groups.iter().any(|g| g.experts.contains(e)))
        .collect();
    if !missing.is_empty() {
        return Err(NotExpertPlacement::Missing(missing));
    }
    Ok((PlanFile { stages }, split))
}

/// The stages of a single-node or stage-ring plan, pinned to their nodes by name, in ring order.
pub fn to_assignment(plan: &Plan) -> Result<PlanFile, NotExecutable> {
    // Cells that are each a single node or a ring of whole layers (of an MoE model, with their
    // experts): one, or several whole copies (replicas), each starting again at layer 0.
    let ring = !plan.cells.is_empty()
        && plan
            .cells
            .iter()
            .all(|c| matches!(c.kind, CellKind::Single | CellKind::Stage))
        && plan.assignments().all(|a| {
            a.layers.is_some()
                && a.layers == a.ffn
                && a.experts
                    .is_none_or(|x| Some(x.layers) == a.layers && x.experts.start == 0)
        });
    if !ring {
        return Err(NotExecutable::Strategy(plan.strategy));
    }
    let mut stages = Vec::new();
    let mut expected = 0;
    let starts: Vec<usize> = plan
        .cells
        .iter()
        .scan(0, |n, c| {
            let start = *n;
            *n += c.assignments.len();
            Some(start)
        })
        .collect();
    for (i, a) in plan.assignments().enumerate() {
        let l = a.layers.expect("executable plans hold whole layers");
        if starts.contains(&i) {
            // Another cell: a whole copy of the model, from layer 0 again.
            expected = 0;
        }
        if l.start as usize != expected {
            return Err(NotExecutable::NotContiguous {
                stage: i,
                node: a.node.clone(),
                start: l.start as usize,
                expected,
            });
        }
        expected = l.end as usize;
        stages.push(StageSpec {
            node: Some(a.node.clone()),
            layers: l.start as usize..l.end as usize,
        });
    }
    Ok(PlanFile { stages })
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_expert_plan_maps_to_ring_stages_and_an_experts_placement() {
        use tessera_plan::{Assignment, ExpertSlice, LayerRange, MemoryUse};
        let a = |node: &str, layers: Option<(usize, usize)>, experts: Option<(usize, usize)>| {
            Assignment {
                node: node.into(),
                layers: layers.map(|(s, e)| LayerRange::new(s, e)),
                ffn: layers.map(|(s, e)| LayerRange::new(s, e)),
                experts: experts.map(|(s, e)| ExpertSlice {
                    layers: LayerRange::new(0, 4),
                    experts: LayerRange::new(s, e),
                }),
                embedding: false,
                head: false,
                memory: MemoryUse::default(),
            }
        };
        let plan = [
            a("home", Some((0, 4)), Some((0, 3))),
            a("x", None, Some((3, 6))),
            a("y", None, Some((6, 8))),
        ];
        let (ring, split) = super::to_expert_placement(&plan, 4, 8).unwrap();
        assert_eq!(ring.stages.len(), 1);
        assert_eq!(ring.stages[0].node.as_deref(), Some("home"));
        assert_eq!(ring.stages[0].layers, 0..4);
        let want = crate::assignment::parse_experts("0-2@home,3-5@x,6-7@y").unwrap();
        assert_eq!(split, want);

        // Experts missing, held twice, or of some layers only do not map.
        assert!(matches!(
            super::to_expert_placement(&plan[..2], 4, 8),
            Err(super::NotExpertPlacement::Missing(m)) if m == vec![6, 7]
        ));
        let twice = [plan[0].clone(), a("x", None, Some((2, 8)))];
        assert!(matches!(
            super::to_expert_placement(&twice, 4, 8),
            Err(super::NotExpertPlacement::Duplicates(d)) if d == vec![2]
        ));
        let mut partial = plan.clone();
        partial[1].experts.as_mut().unwrap().layers = LayerRange::new(0, 2);
        assert!(matches!(
            super::to_expert_placement(&partial, 4, 8),
            Err(super::NotExpertPlacement::PartialLayers { .. })
        ));
    }
}
