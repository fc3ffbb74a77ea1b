//! Tessera's transport: node identity, mutually authenticated encrypted QUIC with pinned keys,
//! versioned length-prefixed frames, byte accounting and link measurement.
//!
//! It knows nothing about models. There is no CA and no plaintext mode: every node has an
//! ed25519 key ([`NodeIdentity`]); its TLS certificate is self-signed and bound to that key;
//! a dialer accepts the server only if it presents the pinned key, and a server admits a client
//! only if its [`PeerPolicy`] says so. Unknown nodes join by proving a [`JoinToken`]
//! ([`enroll`] module).
//!
//! # Walk-through
//!
//! Make identities, bind, connect with the server's key pinned, exchange a frame:
//!
//! ```no_run
//! use std::sync::Arc;
//! use tessera_net::{AllowList, Endpoint, NodeIdentity};
//!
//! # async fn demo() -> Result<(), tessera_net::NetError> {
//! // Identities: persisted (0600 key file) or in memory.
//! let server_id = NodeIdentity::load_or_create("/var/lib/tessera")?;
//! let client_id = NodeIdentity::generate()?;
//!
//! // The server admits enrolled keys only.
//! let allowed = Arc::new(AllowList::new());
//! allowed.insert(client_id.public_key());
//! let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), &server_id, allowed.clone())?;
//! let server_addr = server.local_addr()?;
//! let server_key = server_id.public_key();
//!
//! tokio::spawn(async move {
//!     while let Some(incoming) = server.accept().await {
//!         tokio::spawn(async move {
//!             let Ok(tessera_net::Accepted::Peer(conn)) = incoming.handshake().await else {
//!                 return;
//!             };
//!             println!("peer {} connected", conn.peer_id());
//!             while let Ok(Some(mut stream)) = conn.accept_stream().await {
//!                 // Echo every frame back.
//!                 while let Ok(Some(frame)) = stream.reader.read_frame().await {
//!                     let _ = stream.writer.send(&frame).await;
//!                 }
//!             }
//!         });
//!     }
//! });
//!
//! // The client pins the server's key; it refuses to talk to anyone else.
//! let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), &client_id, AllowList::new())?;
//! let conn = client.connect(server_addr, server_key).await?;
//! assert_eq!(conn.peer_key(), server_key);
//!
//! const HELLO: u16 = 1;
//! let mut stream = conn.open_stream(HELLO).await?;
//! stream.writer.write_frame(HELLO, b"hello").await?;
//! let echo = stream.reader.recv().await?;
//! assert_eq!(&echo.payload[..], b"hello");
//!
//! // Tensors travel as raw little-endian f32 frames.
//! stream.writer.write_f32s(2, &[1.0, 2.0, 3.0]).await?;
//! assert_eq!(stream.reader.read_f32s(2).await?, vec![1.0, 2.0, 3.0]);
//!
//! // Measure the link and read the byte counters.
//! let link = tessera_net::measure::measure_link(&conn, 10, 1 << 20).await?;
//! println!("rtt {:?}, {:.0} B/s, {:?}", link.rtt_median, link.bytes_per_s, conn.stats());
//! # Ok(())
//! # }
//! ```
//!
//! # Modules
//! - [`identity`]: keys, node ids, the key file.
//! - [`tls`]: node certificates, the pinning and policy verifiers.
//! - [`enroll`]: join tokens and the enrolment handshake.
//! - [`endpoint`]: the QUIC endpoint, connections, framed streams.
//! - [`frame`]: the wire format, readers and writers over any async byte stream.
//! - [`measure`]: RTT and throughput.
//! - [`stats`]: byte accounting.

#![forbid(unsafe_code)]

#[cfg(test)]
mod adversarial_tests;
mod base32;
pub mod endpoint;
pub mod enroll;
mod error;
pub mod frame;
pub mod identity;
pub mod measure;
pub mod stats;
pub mod tls;

pub use endpoint::{
    stream_kind, Accepted, Connection, Endpoint, EndpointConfig, FramedStream, Incoming, Liveness,
};
pub use enroll::{
    ClaimedEnrolment, EnrolmentClaim, EnrolmentRequest, JoinToken, TokenId, MAX_CLAIM_LEN,
};
pub use error::{NetError, Refusal, StreamLabel};
pub use frame::{
    decode_frame, decode_frame_header, Frame, FrameHeader, FrameReader, FrameWriter, HeaderError,
};
pub use identity::{NodeId, NodeIdentity, PublicKey};
pub use measure::{measure_link, measure_rtt, measure_throughput, LinkMeasurement, RttStats};
pub use stats::{ConnectionStats, Traffic};
pub use tls::{Admission, AllowList, ExpectedPeer, PeerPolicy};
/// The QUIC and TLS crates this one is built on, for [`Connection::quinn`] and certificate types.
pub use {quinn, rustls};
