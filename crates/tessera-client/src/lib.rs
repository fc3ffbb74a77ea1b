//! The client side of a cluster, kept out of the coordinator crate (which holds the server
//! side): it connects to a coordinator as an enrolled client and speaks `tessera_proto`'s client
//! messages.
//!
//! - [`session`]: a control session with a coordinator ([`session::ClusterSession`]), as
//!   `tessera run --coordinator` and `tessera token` open it;
//! - [`sealed::client`]: the sealing client, [`sealed::SealedClient`], over such a session;
//! - [`sealed::SealedBackend`]: a gateway `Backend` that runs every request as a sealed job.

#![forbid(unsafe_code)]

pub mod error;
pub mod sealed;
pub mod session;

pub use error::ClientError;
