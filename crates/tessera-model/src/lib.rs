//! Everything about a model that is not computing with it: the GGUF container, the model
//! profile, the tokenizer, the chat template, and the geometry and element type of its KV cache
//! ([`kv`]: what a cache costs, which the engine stores and the coordinator sizes memory with).
//!
//! ```no_run
//! use tessera_model::{GgufFile, ModelProfile};
//! let gguf = GgufFile::open("models/stories260K.gguf")?;   // header only; weights stay on disk
//! let profile = ModelProfile::from_gguf(&gguf)?;           // validates arch and tensor shapes
//! println!("{profile}");
//! # Ok::<(), tessera_model::ModelError>(())
//! ```

pub mod chat;
pub mod config;
pub mod dtype;
pub mod error;
pub mod gguf;
pub mod kv;
pub mod profile;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use config::{
    Architecture, AttnTemperature, ExpertGating, FfnActivation, Mla, ModelConfig, RopeScaling,
    RopeStyle,
};
pub use dtype::GgmlType;
pub use error::{ModelError, Result};
pub use gguf::{GgufFile, MetaArray, MetaValue, PartName, SplitOptions, TensorInfo};
pub use profile::{human_bytes, LayerBytes, ModelProfile};
pub use tokenizer::{
    PreTokenizer, StreamDecoder, TokenType, Tokenizer, TokenizerKind, TokenizerParts, Utf8Assembler,
};
