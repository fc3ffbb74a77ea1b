//! CPU inference for GGUF models, built for running a model in parts.
//!
//! A [`Model`] holds whatever part of a model a [`LoadSpec`] names — a range of layers, the
//! embedding, the head, a subset of each MoE layer's experts — and nothing else. The forward
//! pass is three calls, so a pipeline stage runs just its own:
//!
//! ```no_run
//! use tessera_engine::{LoadSpec, LocalExperts, Model, SeqStep};
//! use tessera_model::{GgufFile, ModelConfig};
//!
//! let gguf = GgufFile::open("models/stories260K.gguf")?;
//! let config = ModelConfig::from_gguf(&gguf)?;
//! // The whole model; a stage would pass LoadSpec::stage(&config, 0..3) instead.
//! let model = Model::load(&gguf, LoadSpec::full(&config), 2, &mut |done, total| {
//!     eprintln!("loaded {done}/{total} bytes");
//! })?;
//! let mut kv = model.new_kv(config.context_length);
//!
//! let prompt = [1u32, 403, 407, 261, 378];
//! let mut hidden = model.embed(&prompt)?;                    // n_tokens × n_embd
//! model.run_layers(
//!     0..config.n_layer,
//!     &mut hidden,
//!     &[SeqStep { n_tokens: prompt.len(), start_pos: 0 }],   // one sequence, from position 0
//!     &mut [&mut kv],
//!     &mut LocalExperts(&model),                              // MoE experts computed here
//! )?;
//! let logits = model.head(&hidden)?;                         // n_tokens × vocab
//! let next = tessera_engine::ops::argmax(logits.last());
//! println!("next token: {next}");
//! # Ok::<(), tessera_engine::EngineError>(())
//! ```
//!
//! Split execution is bit-identical to unsplit execution: kernels are batch-invariant, each
//! sequence's attention is computed independently of the rest of a batch, and MoE expert
//! outputs are reduced in a fixed slot order ([`reduce_expert_outputs`]) whichever part computed
//! them. Numerics follow llama.cpp's CPU backend closely (see [`ops`]).
//!
//! Modules, in the order a reader meets them: [`weights`] (loading), [`model`] (the API),
//! `layer` (one transformer layer), [`ops`], [`kv`], [`moe`], [`batch`], sampling (in [`tessera_sampling`]),
//! [`generate`], [`speculate`] (verifying drafts, a draft model), [`embedding`] (a sequence's
//! final hidden states pooled into one vector), [`bench`](mod@bench); [`kernels`] holds the quantized matmuls and the thread pool;
//! [`expert_store`] streams experts from the file when they exceed a memory budget
//! ([`Model::load_streaming`]), reading with `tessera_host::direct_read`.

mod attention;
pub mod batch;
pub mod bench;
pub mod embedding;
pub mod error;
pub mod exec;
pub mod expert_store;
pub mod generate;
pub mod kernels;
pub mod kv;
mod layer;
mod mla;
pub mod model;
pub mod moe;
pub mod ops;
pub mod prefix_cache;
mod run_ahead;
pub mod speculate;
pub mod timeline;
pub mod weights;

pub use embedding::{Pooler, Pooling};
pub use error::{EngineError, Result};
pub use expert_store::{ExpertStats, ExpertStore, ExpertStreaming};
pub use generate::{GenerationStats, Generator, SpeculationStats, StopReason};
pub use kv::{KvCache, KvShape, KvType};
pub use model::{Hidden, Logits, Model, SeqStep};
pub use moe::{
    reduce_expert_outputs, ExpertExecutor, ExpertOutputs, LocalExperts, PartExperts, Routing,
};
pub use timeline::TimelineRecord;
pub use weights::{ExpertSelection, LoadSpec, ModelWeights};
