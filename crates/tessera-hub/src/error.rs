//! What can go wrong resolving or fetching a model by name. Each error names the repository,
//! file or URL at fault; [`HubError::is_retryable`] tells a dropped transfer from a refusal.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("'{given}' is not a model name: {what} (expected ORG/NAME or ORG/NAME:QUANT)")]
    BadName { given: String, what: String },
    #[error("{url}: HTTP {status}{hint}")]
    Http {
        url: String,
        status: u16,
        /// A sentence on what the status usually means here (empty if nothing to add).
        hint: String,
    },
    #[error("{url}: {what}")]
    Network { url: String, what: String },
    #[error("{repo}: the Hub's answer could not be read: {what}")]
    BadListing { repo: String, what: String },
    #[error("{repo}: {what}")]
    NoMatch { repo: String, what: String },
    #[error(
        "{repo}/{file}: SHA-256 {found} does not match the Hub's {expected}: the download is \
         corrupt and was deleted"
    )]
    Corrupt {
        repo: String,
        file: String,
        expected: String,
        found: String,
    },
    #[error("{repo}: offline (HF_HUB_OFFLINE) and {what}")]
    Offline { repo: String, what: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl HubError {
    /// A transfer that failed part-way (a dropped connection, a server error): trying again
    /// resumes it. Refusals (a bad name, no such file, a corrupt download) are not retryable.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Network { .. } => true,
            Self::Http { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
    }
}

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> HubError {
    let path = path.into();
    move |source| HubError::Io { path, source }
}

pub type Result<T, E = HubError> = std::result::Result<T, E>;
