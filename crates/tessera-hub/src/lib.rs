//! Models by name. `tessera pull ORG/NAME[:QUANT]`, and `--model hf:ORG/NAME[:QUANT]` wherever a
//! model file is taken, resolve a Hugging Face Hub repository's GGUF files and bring them into
//! the Hub's own cache, so files other tools fetched are reused and files Tessera fetched serve
//! them too.
//!
//! One pull, end to end:
//! 1. [`ModelName::parse`] reads the name (pure, bounded).
//! 2. The listing (`/api/models/{repo}/revision/main?blobs=true`) is parsed into a
//!    [`RepoListing`], and [`RepoListing::choose`] picks the quantization's file, or every part of
//!    a gguf-split model in order (pure).
//! 3. [`pull()`] brings each file into the [`HubCache`]: reused if its blob is there, else
//!    downloaded resumably, verified against the Hub's SHA-256 and linked into the snapshot.
//!    `HF_ENDPOINT`, `HF_TOKEN` and `HF_HUB_OFFLINE` are honoured ([`HubConfig::from_env`]).
//!
//! ```no_run
//! use tessera_hub::{pull, HubConfig, ModelName};
//! let name = ModelName::parse("hf:unsloth/Qwen3-8B-GGUF:Q4_K_M")?;
//! let pulled = pull(&HubConfig::from_env()?, &name, &mut |_| {})?;
//! let model = &pulled.files[0]; // open this: a split model's first part opens all its parts
//! # Ok::<(), tessera_hub::HubError>(())
//! ```
//!
//! [`stand_in`] is a local server with the Hub's routes, for tests and offline demonstrations.

pub mod cache;
pub mod error;
pub mod listing;
pub mod name;
pub mod pull;
pub mod stand_in;

pub use cache::HubCache;
pub use error::{HubError, Result};
pub use listing::{RepoFile, RepoListing};
pub use name::ModelName;
pub use pull::{pull, HubConfig, PullEvent, Pulled};
