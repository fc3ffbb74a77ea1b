//! Who may receive which model bytes: a MODEL stream serves a key only the chunks of the
//! tensors an epoch assigns it.
//!
//! Enrolment proves a key holds some credential; the model's weights are the operator's, and a
//! client credential, or a node with no assignment, has no business downloading them. So the
//! coordinator serves chunks only to a **node** credential, and only the chunks of the tensors
//! one of its live assignments needs (an epoch being loaded, serving, draining, or being made
//! beside one): its layers' tensors, the embedding for the first stage, the norm and head for
//! the last, and in an expert split the packed expert tensors of the layers where it holds
//! experts. The GGUF header (metadata, no weights) goes with any assignment. The manifest (names
//! and hashes, no weights) goes to any node credential.
//!
//! The tensor names mirror what the node asks for (`tessera-node`'s `agent::load`): both must
//! change together, and the cluster tests, where every node fetches its part over the network,
//! fail when they do not.
//!
//! Pure: the manifest, the membership machine's epochs and a key's grant in, a verdict out.

use std::collections::BTreeSet;
use std::ops::Range;

use tessera_host::Manifest;
use tessera_net::NodeId;

use crate::authz::{Grant, ModelRefusal};
use crate::membership::{Epoch, Membership, Phase};

/// The tensors a stage needs: its layers' `blk.N.*` (and the RoPE frequency factors, where the
/// model has them), the embedding (first stage, or the last with tied embeddings), the output
/// norm and head (last stage).
pub fn stage_tensor_names(
    manifest: &Manifest,
    layers: &Range<usize>,
    embed: bool,
    head: bool,
) -> Vec<String> {
    let mut names = manifest.layer_tensor_names(layers.start as u32..layers.end as u32);
    let has = |n: &str| manifest.tensor(n).is_some();
    if !layers.is_empty() && has("rope_freqs.weight") {
        names.push("rope_freqs.weight".into());
    }
    let tied = !has("output.weight");
    if embed || (head && tied) {
        names.push("token_embd.weight".into());
    }
    if head {
        names.push("output_norm.weight".into());
        if !tied {
            names.push("output.weight".into());
        }
    }
    names
}

/// The packed expert tensors (and expert biases) of the layers where `held` names experts.
pub fn expert_tensor_names(manifest: &Manifest, held: &[Vec<usize>]) -> Vec<String> {
    let mut names = Vec::new();
    for (l, ids) in held.iter().enumerate() {
        if ids.is_empty() {
            continue;
        }
        for part in ["gate", "up", "down"] {
            for kind in ["weight", "bias"] {
                let n = format!("blk.{l}.ffn_{part}_exps.{kind}");
                if manifest.tensor(&n).is_some() {
                    names.push(n);
                }
            }
        }
    }
    names
}

/// Every tensor `node`'s live assignments need (none: it holds no assignment).
pub fn assigned_tensors(membership: &Membership, n_layer: usize, node: &NodeId) -> AssignedParts {
    let live = |e: &&Epoch| matches!(e.phase, Phase::Loading | Phase::Linking | Phase::Ready);
    let mut parts = AssignedParts::default();
    for e in membership
        .cells()
        .iter()
        .chain(membership.draining())
        .chain(membership.successors())
        .filter(live)
    {
        for (i, s) in e.stages.iter().enumerate() {
            if s.node_id != *node {
                continue;
            }
            parts.stages.push((
                s.layers.clone(),
                i == 0 && !s.layers.is_empty(),
                !s.layers.is_empty() && s.layers.end == n_layer,
            ));
            if let Some(h) = &s.held_experts {
                parts.experts.push(h.clone());
            }
        }
    }
    parts
}

/// What a node's assignments hold: each stage's (layers, embed, head), and each expert
/// placement's held experts by layer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AssignedParts {
    pub stages: Vec<(Range<usize>, bool, bool)>,
    pub experts: Vec<Vec<Vec<usize>>>,
}

impl AssignedParts {
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty() && self.experts.is_empty()
    }

    /// The chunk ids these parts may receive: the header and their tensors' chunks.
    pub fn chunks(&self, manifest: &Manifest) -> BTreeSet<u32> {
        if self.is_empty() {
            return BTreeSet::new();
        }
        let mut names: Vec<String> = Vec::new();
        for (layers, embed, head) in &self.stages {
            names.extend(stage_tensor_names(manifest, layers, *embed, *head));
        }
        for held in &self.experts {
            names.extend(expert_tensor_names(manifest, held));
        }
        names.sort();
        names.dedup();
        manifest
            .chunks_for(&names)
            .map(|v| v.into_iter().map(|c| c.id).collect())
            .unwrap_or_default()
    }
}

/// May a key with `grant` whose assignments allow `allowed` receive `ids`?
pub fn check_chunks(
    grant: Grant,
    allowed: &BTreeSet<u32>,
    ids: &[u32],
) -> Result<(), ModelRefusal> {
    if grant != Grant::Node {
        return Err(ModelRefusal::NotANode(grant));
    }
    match ids.iter().find(|id| !allowed.contains(id)) {
        Some(&chunk) => Err(ModelRefusal::NotAssigned { chunk }),
        None => Ok(()),
    }
}

/// May a key with `grant` read the manifest (names and hashes, no weights)?
pub fn check_manifest(grant: Grant) -> Result<(), ModelRefusal> {
    match grant {
        Grant::Node => Ok(()),
        g => Err(ModelRefusal::NotANode(g)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_node_gets_chunks_and_only_those_it_holds() {
        let allowed: BTreeSet<u32> = [0, 1, 2].into();
        assert_eq!(check_chunks(Grant::Node, &allowed, &[0, 2]), Ok(()));
        assert_eq!(
            check_chunks(Grant::Node, &allowed, &[2, 7]),
            Err(ModelRefusal::NotAssigned { chunk: 7 })
        );
        for g in [Grant::Client, Grant::Operator] {
            assert_eq!(
                check_chunks(g, &allowed, &[0]),
                Err(ModelRefusal::NotANode(g))
            );
            assert_eq!(check_manifest(g), Err(ModelRefusal::NotANode(g)));
        }
        assert_eq!(check_manifest(Grant::Node), Ok(()));
        // No assignment: nothing, not even the header.
        assert!(AssignedParts::default().is_empty());
    }
}
