//! The Tessera node agent's local ground truth.
//!
//! A *node agent* is the program a contributor runs on each machine that takes part in a Tessera
//! cluster. It measures the machine, states a memory budget it will not exceed, receives the parts
//! of a model its assignment needs, and serves them to the engine. This crate holds the two parts
//! of that agent that need nothing from the network:
//!
//! - [`inventory`]: the node measures itself — RAM, CPU model and features, memory bandwidth,
//!   compute rate, disk read bandwidth and free space — and says how each figure was obtained.
//!   A figure that could not be measured is `None` (uncertainty), never a guessed default.
//!   [`MemoryBudget`] and [`Inventory::accepts`] make "the node refuses work beyond its budget"
//!   a checked rule.
//! - [`store`]: the shard store. From a [`Manifest`] (content hash of the model, per-tensor
//!   chunk hashes, the GGUF header), a node pulls only the tensors its assignment names, verifies
//!   every chunk before writing it, and lays them out in a sparse file with the original layout,
//!   so the engine opens it with the ordinary GGUF reader. Transfers resume after interruption;
//!   a node that already holds the whole file adopts it and downloads nothing.
//!
//! Enrolment, identity keys, the authenticated transport and the coordinator protocol are built
//! on top of these by other crates: a network stream plugs into the store as a [`ChunkSource`],
//! and the engine's own quantized matmul plugs into the inventory as
//! [`ProbeOptions::compute_probe`].
//!
//! ```no_run
//! use tessera_node::{fetch, measure, FileSource, Manifest, MemoryBudget, ProbeOptions, ShardStore};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The node measures itself (disk figures for its model cache) and states its budget.
//! let opts = ProbeOptions { disk_dir: Some("/var/lib/tessera".into()), ..Default::default() };
//! let inventory = measure(&opts).with_budget(&"6GiB".parse::<MemoryBudget>()?)?;
//!
//! // The coordinator describes the model by content; this node is assigned layers 0..2.
//! let manifest = Manifest::from_gguf("model.gguf")?;
//! let mut names = manifest.layer_tensor_names(0..2);
//! names.push("token_embd.weight".into());
//! inventory.accepts(manifest.bytes_for(&names)?)?; // refuses work beyond the budget
//!
//! // Receive only those tensors, verified; the engine then opens a normal GGUF path.
//! let store = ShardStore::open("/var/lib/tessera")?;
//! let source = FileSource::open("model.gguf")?; // a network stream in the real agent
//! let report = fetch(&store, &manifest, &names, &source, &mut |_| {})?;
//! println!("received {} bytes into {}", report.bytes_transferred, store.path_for(&manifest).display());
//! # Ok(()) }
//! ```

pub mod inventory;
pub mod store;
mod sys;

// The fabric: the node agent, its stage, and the wire contract shared with the coordinator.
pub mod agent;
pub mod compute_probe;
pub mod error;
pub mod expert;
pub mod fetch_net;
pub mod protocol;
pub mod stage;

pub use inventory::{
    measure, BudgetError, BudgetRefusal, ComputeRate, Inventory, MemoryBudget, ProbeOptions,
};
pub use store::{
    fetch, ChunkRef, ChunkSource, ContentHash, FetchError, FetchProgress, FetchReport, FileSource,
    Manifest, Part, Section, ShardStore, StoreError, VerifyReport,
};
