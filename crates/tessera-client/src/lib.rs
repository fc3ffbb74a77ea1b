//! The client side of a cluster, kept out of the coordinator crate (which holds the server
//! side): it connects to a coordinator as an enrolled client and speaks `tessera_proto`'s client
//! messages.
//!
//! - [`sealed::client`]: a control session ([`sealed::client::connect_client`], also the
//!   session `tessera run --coordinator` and `tessera token` open) and the sealing client,
//!   [`sealed::SealedClient`];
//! - [`sealed::SealedBackend`]: a gateway `Backend` that runs every request as a sealed job.

#![forbid(unsafe_code)]

pub mod error;
pub mod sealed;

pub use error::ClientError;
