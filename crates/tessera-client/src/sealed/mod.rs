//! Sealed jobs from the client's side: requests sealed to workers behind a coordinator that
//! cannot read them (the coordinator's desk is `tessera_coord::sealed`).

pub mod client;
mod gateway;

pub use client::{ClientPolicy, SealedClient, SealedOutcome};
pub use gateway::{SealedBackend, SealedBackendConfig};
