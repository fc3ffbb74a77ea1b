//! Errors for everything read from a model file. Each names the file, tensor or key at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: GGUF version {version} is not supported (2 and 3 are)")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{path}: truncated or corrupt header at byte {offset}: {what}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        what: String,
    },
    #[error("{path}: tensor '{tensor}': {what}")]
    BadTensor {
        path: PathBuf,
        tensor: String,
        what: String,
    },
    #[error("{path}: tensor '{tensor}' has type {type_name}, which Tessera cannot run (supported: F32, F16, BF16, Q8_0, Q5_0, Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S)")]
    UnsupportedType {
        path: PathBuf,
        tensor: String,
        type_name: String,
    },
    #[error(
        "{path}: architecture '{arch}' is not supported (supported: llama, qwen2, qwen3, qwen3moe, gpt-oss, deepseek2, glm4moe)"
    )]
    UnsupportedArchitecture { path: PathBuf, arch: String },
    #[error("{path}: metadata key '{key}' {what}")]
    BadMetadata {
        path: PathBuf,
        key: String,
        what: String,
    },
    #[error("{path}: required tensor '{tensor}' is missing")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor '{tensor}' has shape {found:?}, but the hyperparameters require {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    /// A read of a partial copy outside the ranges it holds (see
    /// `GgufFile::with_present_ranges`): those bytes were never received.
    #[error(
        "{path}: bytes {start}..{end} of tensor '{tensor}' were never received (this copy holds \
         only what its assignment fetched)"
    )]
    NotFetched {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
    },
    /// Parts of a gguf-split model that cannot be read as one: a part missing, opened other
    /// than from the first, or parts that do not belong together.
    #[error("{path}: {what}")]
    Split { path: PathBuf, what: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
