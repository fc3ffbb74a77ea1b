//! The Tessera node agent: the program a contributor runs on each machine that takes part in a
//! cluster.
//!
//! It measures the machine and holds the tensors its assignment needs (both from
//! [`tessera_host`], re-exported here as [`inventory`] and [`store`]), enrols with the
//! coordinator over [`tessera_net`], and runs its part of the model with the engine:
//!
//! - [`agent`]: the control session with the coordinator (enrol, load an assignment, open and
//!   close sequences, report);
//! - [`stage`]: a contiguous range of layers, fed hidden states by the previous stage (the
//!   ring) and sampling when it holds the head;
//! - [`expert`]: MoE experts computed for another stage (expert split);
//! - [`fetch_net`]: the shard store's chunk source over the coordinator's model stream.

#![forbid(unsafe_code)]

pub use tessera_host::{inventory, store};

pub mod agent;
pub mod compute_probe;
pub mod error;
pub mod expert;
pub mod fetch_net;
pub mod stage;

pub use inventory::{
    measure, BudgetError, BudgetRefusal, ComputeRate, Inventory, MemoryBudget, ProbeOptions,
};
pub use store::{
    fetch, ChunkRef, ChunkSource, ContentHash, FetchError, FetchProgress, FetchReport, FileSource,
    Manifest, Part, Section, ShardStore, StoreError, VerifyReport,
};
