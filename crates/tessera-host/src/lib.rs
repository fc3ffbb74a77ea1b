//! What a host has and holds, with nothing from the network.
//!
//! Every machine in a Tessera cluster — a node agent, and the coordinator that serves the model
//! file — needs the same two pieces of local ground truth:
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
//! The network plugs into the store as a [`ChunkSource`] (the node agent's `fetch_net`), and
//! the engine's own quantized matmul plugs into the inventory as
//! [`ProbeOptions::compute_probe`]. [`sys`] holds the few system calls behind both (direct,
//! uncached reads and page-cache advice), shared with the engine's expert streaming.
//!
//! ```no_run
//! use tessera_host::{fetch, measure, FileSource, Manifest, MemoryBudget, ProbeOptions, ShardStore};
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

pub mod direct_read;
pub mod inventory;
pub mod store;
pub mod sys;

pub use inventory::{
    measure, BudgetError, BudgetRefusal, ComputeRate, Inventory, MemoryBudget, ProbeOptions,
};
pub use store::{
    fetch, ChunkRef, ChunkSource, ContentHash, FetchError, FetchProgress, FetchReport, FileSource,
    Manifest, Part, Section, ShardStore, StoreError, VerifyReport,
};
