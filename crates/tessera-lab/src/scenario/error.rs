//! What can be wrong with a scenario file, as data: callers and tests tell the cases apart by
//! variant, and the text shown is what the person who wrote the file reads to fix it.
//!
//! No variant names a `#[source]`: each one's text already says its cause, and an error chain
//! printed in full (`{:#}`) would say it twice.

use super::COORDINATOR_HOST;
use crate::disk::DiskProfile;

/// Why a scenario file was refused ([`crate::LabError::Scenario`] names the file).
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file is not TOML.
    #[error("{0}")]
    Toml(toml::de::Error),
    /// Every scenario runs a model.
    #[error("no [model] section")]
    NoModel,
    /// One of the lab's sections (`[model]`, `[workload]`, `[lab]`) is not what it should be:
    /// an unknown key, a value of the wrong type.
    #[error("[{section}]: {error}")]
    Section {
        section: &'static str,
        error: toml::de::Error,
    },
    /// `predict = true` drafts from the prediction only when requests speculate.
    #[error("[workload] predict = true sends a prediction to draft from: it needs speculate")]
    PredictWithoutSpeculate,
    /// More drafts than a ring turn carries.
    #[error("[workload] speculate = {asked}: a ring turn carries at most {max} drafts")]
    TooManyDrafts { asked: usize, max: usize },
    /// The planner's part, without the lab's sections, could not be written back as TOML.
    #[error("{0}")]
    PlannerPart(toml::ser::Error),
    /// The planner refused the planner's part as a cluster file.
    #[error("{0}")]
    Cluster(tessera_plan::ClusterError),
    /// A `[[lab.link]]` names a node the planner's part does not declare.
    #[error("[[lab.link]] names unknown node {node:?}")]
    UnknownLinkNode { node: String },
    /// A `[[lab.link]]` impairment out of range.
    #[error("[[lab.link]]: loss in [0, 1], jitter_ms ≥ 0")]
    LinkImpairment {
        nodes: [String; 2],
        loss: f64,
        jitter_ms: f64,
    },
    /// A `[[lab.node]]` names a node the planner's part does not declare.
    #[error("[[lab.node]] names unknown node {node:?}")]
    UnknownLabNode { node: String },
    /// A `[[lab.node]]` asks for a disk no profile describes.
    #[error(
        "[[lab.node]] {node}: no disk profile {disk:?} (one of {})",
        DiskProfile::names()
    )]
    NoDiskProfile { node: String, disk: String },
    /// A node takes the name of the host the lab adds for the coordinator.
    #[error("{COORDINATOR_HOST:?} is the lab's own host name")]
    ReservedHostName,
}
