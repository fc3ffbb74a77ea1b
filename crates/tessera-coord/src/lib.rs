//! The Tessera coordinator: the control plane of a cluster.
//!
//! It holds no weights unless a plan assigns it some (none in this version): it reads the
//! model's metadata and tokenizer, describes the file by content and serves the chunks nodes
//! ask for, and drives generations over the nodes that hold the layers.
//!
//! # Walk-through
//!
//! ```no_run
//! use tessera_coord::{Coordinator, CoordinatorConfig};
//! # async fn demo() -> Result<(), tessera_coord::CoordError> {
//! let coordinator = Coordinator::bind(CoordinatorConfig {
//!     data_dir: "/var/lib/tessera-coord".into(),
//!     listen: "127.0.0.1:0".parse().unwrap(),
//!     model: "model.gguf".into(),
//!     split: None,
//!     max_context: 4096,
//!     progress: true,
//!     chunk_size: tessera_host::store::DEFAULT_CHUNK_SIZE,
//! })
//! .await?;
//! // Nodes join with `tessera node --join TOKEN@ADDR`.
//! println!("join token: {}@{}", coordinator.token(), coordinator.local_addr()?);
//! coordinator.run().await?; // serves until the endpoint closes
//! # Ok(()) }
//! ```
//!
//! 1. **Enrolment** ([`enrol`], [`state`]): a node proves the join token over an authenticated
//!    QUIC session; its key is recorded (`state.redb`, with revocations and every plan epoch)
//!    and pinned from then on. Unknown keys get
//!    no further than the enrolment handshake; a name cannot be moved to another key.
//! 2. **Membership and epochs** ([`membership`], pure): nodes join and leave; a plan
//!    ([`assignment`]: `--split 0..3,3..5` or a plan file) becomes an epoch; every stage node
//!    loads its layer range (receiving tensors it lacks from [`distribute`]), then links to the
//!    next stage of the ring; the epoch is ready.
//! 3. **Generations** ([`run`], pure, composed in [`cluster`]; [`driver`], its shell): a client (`tessera run`,
//!    enrolled like a node) or the HTTP gateway asks for a run; a [`run::RunMachine`] decides
//!    its whole lifecycle from inputs (a ready or lost epoch, a node's message, a timer, a
//!    cancellation) and the driver carries out its outputs. The sequence is opened on every
//!    stage, the first stage prefills in chunks, the ring turns one token per lap, the last stage reports each token, and at the end every stage
//!    frees the sequence's KV cache and reports its traffic and time, which become the run's
//!    report and a line of `metrics.jsonl` (bytes per boundary per token, hop latency).
//! 4. **Failures** ([`membership`], [`replan`], [`run`]): every node holds a lease
//!    (`--lease-ms`, renewed by heartbeats on its control stream); a node silent for a lease
//!    (killed, frozen, cut off) is declared gone — liveness is two membership events,
//!    `Heard` and `Tick`, so no clock lives in the machine. If it held a stage, the epoch fails and a new
//!    one is planned on the survivors at once; runs in flight pause, and resume on the new epoch
//!    by re-prefilling their prompt and the tokens generated so far, which yields exactly the
//!    tokens they would have had. A node that joins and restores the configured stage count is
//!    folded in the same way. In an expert split, a node holding experts (an expert-only node
//!    too) that leaves fails the epoch the same way; the new one hands its experts to the
//!    survivors by free memory (a node given more than its budget streams them from disk), and
//!    the configured split returns with the node. With no feasible placement, requests are
//!    refused with the reason until capacity returns. Epoch numbers continue across coordinator
//!    restarts.
//!
//! Only a run's own stages are heard about it, and only its sampling stage may send its tokens
//! or finish it. A deterministic simulator (`src/sim`, run by `cargo test`) drives the
//! [`cluster::Cluster`] itself through thousands of seeded fault schedules — kills, freezes,
//! partitions, slow links, late joins, coordinator restarts — checking after every event that
//! each request streams exactly its fault-free text or ends with an explicit error, that epochs
//! never go backwards, and that nothing is left held at the end.
//!
//! The wire contract is [`tessera_proto`].
//!
//! # The composition, and the runtime around it
//!
//! - [`cluster`]: the pure machines composed into one synchronous [`cluster::Cluster`] —
//!   membership, cells, node sessions, one run machine per request, a timer table — with
//!   `handle(now, input) -> outputs` and `poll_timeout()`. The runtime and the simulator
//!   (`src/sim`) drive this same type.
//! - [`shared`]: the settings, the cluster with the I/O handles its outputs go to (each node's
//!   outbox, each run's owner), the cluster's clock, and the [`authz::Gate`].
//! - [`driver`]: a run's shell (a request checked and built into a `RunSpec` once, its events
//!   to its owner, its report), and the CLI client's session.
//! - `session`: a control session's hello, then a node's session (its messages become the
//!   cluster's inputs) or a client's (in [`driver`]).
//! - [`server`]: the QUIC endpoint's accept loop and each connection's streams.
//! - [`backend`]: the [`tessera_api::Backend`] the HTTP API serves through; it returns data
//!   and the gateway words it.
//!
//! Each depends only on those listed before it (and the pure modules), never back.

#![forbid(unsafe_code)]

// Stage assignments are data the coordinator seats; they live in `tessera-placement` with the
// planning adapter, so the lab and the CLI plan without a coordinator.
use tessera_placement::assignment;

mod admin;
pub mod authz;
pub mod backend;
pub mod cells;
pub mod cluster;
#[cfg(feature = "mdns")]
pub mod discovery;
pub mod distribute;
pub(crate) mod door;
pub mod driver;
pub mod enrol;
pub mod enrolling;
pub mod error;
pub mod fault;
pub(crate) mod ledger;
pub mod membership;
pub mod model_access;
pub mod replan;
pub mod run;
pub mod sealed;
pub mod server;
mod session;
pub mod shared;
#[cfg(test)]
mod sim;
pub mod state;
pub mod tokens;

pub use error::CoordError;
pub use server::Coordinator;
pub use shared::{CoordinatorConfig, ModelInfo};
