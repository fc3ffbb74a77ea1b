//! The crate's error type.

use std::fmt;
use std::net::SocketAddr;

use crate::identity::NodeId;

/// Where a stream-level error happened: which peer, which stream.
///
/// Cheap to clone; shown in every frame error so a log line says which link misbehaved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamLabel {
    /// The authenticated peer, when the stream belongs to a connection.
    pub peer: Option<NodeId>,
    /// The QUIC stream id, or another short name for in-memory streams.
    pub stream: String,
}

impl StreamLabel {
    /// A label for a stream that is not (yet) tied to a peer, e.g. an in-memory duplex in tests.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            peer: None,
            stream: name.into(),
        }
    }
}

impl fmt::Display for StreamLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.peer {
            Some(p) => write!(f, "peer {} stream {}", p.short(), self.stream),
            None if self.stream.is_empty() => f.write_str("unlabelled stream"),
            None => write!(f, "stream {}", self.stream),
        }
    }
}

/// Why a peer was refused by a [`PeerPolicy`](crate::PeerPolicy) or an enrolment decision.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The key is not enrolled and enrolment is not open.
    #[error("unknown node key {0}")]
    Unknown(NodeId),
    /// A known node id presented a key other than the one recorded for it.
    #[error("node {id} presented a key that differs from its enrolled key")]
    KeyMismatch {
        /// The node id that was claimed.
        id: NodeId,
    },
    /// The node was removed or banned.
    #[error("node {0} is revoked")]
    Revoked(NodeId),
    /// The join token named by an enrolment claim is unknown, expired or already used.
    #[error("join token not accepted")]
    BadToken,
    /// Any other reason the caller wants to give.
    #[error("{0}")]
    Other(String),
}

/// Errors from every part of the transport.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// Filesystem or socket I/O outside a stream (key files, binding).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A key file exists but is malformed.
    #[error("key file {path}: {reason}")]
    BadKeyFile {
        /// The offending file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A key file is readable by group or others.
    #[error("key file {path} has mode {mode:o}; it must be 0600 (readable by its owner only)")]
    InsecureKeyFile {
        /// The offending file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// A printable key, id or token failed to parse.
    #[error("cannot parse {what}: {reason}")]
    Parse {
        /// What was being parsed.
        what: &'static str,
        /// Why it failed.
        reason: String,
    },
    /// Building a certificate or TLS configuration failed.
    #[error("tls setup: {0}")]
    TlsSetup(String),
    /// The QUIC/TLS handshake with a peer failed (refused, wrong key, unreachable, timed out).
    #[error("handshake with {addr} failed: {reason}")]
    Handshake {
        /// The peer's address.
        addr: SocketAddr,
        /// What went wrong, as reported by the TLS/QUIC stack.
        reason: String,
    },
    /// An established connection was lost or closed.
    #[error("connection to {peer} lost: {source}")]
    Connection {
        /// The peer.
        peer: NodeId,
        /// The QUIC-level reason.
        #[source]
        source: quinn::ConnectionError,
    },
    /// The endpoint is closed and accepts or dials nothing more.
    #[error("endpoint closed")]
    EndpointClosed,
    /// I/O on one stream failed (reset, connection lost mid-frame).
    #[error("{stream}: {source}")]
    StreamIo {
        /// Which stream.
        stream: StreamLabel,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The stream ended in the middle of a frame.
    #[error("{stream}: stream ended inside a frame ({got} of {need} bytes)")]
    Truncated {
        /// Which stream.
        stream: StreamLabel,
        /// Bytes received of the current part.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The frame header does not start with the Tessera magic byte: not our protocol.
    #[error("{stream}: bad frame magic {found:#06x}")]
    BadMagic {
        /// Which stream.
        stream: StreamLabel,
        /// The first header field as received.
        found: u16,
    },
    /// The peer speaks another version of the wire protocol.
    #[error("{stream}: wire protocol version mismatch: ours {ours}, theirs {theirs}")]
    VersionMismatch {
        /// Our wire version.
        ours: u8,
        /// The version in the peer's frame.
        theirs: u8,
        /// Which stream.
        stream: StreamLabel,
    },
    /// A frame longer than the configured limit; refused before any allocation.
    #[error("{stream}: frame of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge {
        /// Which stream.
        stream: StreamLabel,
        /// The declared (or attempted) payload length.
        len: u64,
        /// The configured limit.
        max: usize,
    },
    /// A frame arrived that the protocol did not expect at this point.
    #[error("{stream}: unexpected frame kind {kind:#06x} (expected {expected})")]
    UnexpectedFrame {
        /// Which stream.
        stream: StreamLabel,
        /// The kind received.
        kind: u16,
        /// What was expected.
        expected: &'static str,
    },
    /// A frame's payload could not be decoded.
    #[error("{stream}: cannot decode payload of frame kind {kind:#06x}: {reason}")]
    Decode {
        /// Which stream.
        stream: StreamLabel,
        /// The frame kind.
        kind: u16,
        /// Why.
        reason: String,
    },
    /// A message could not be encoded.
    #[error("cannot encode message: {0}")]
    Encode(String),
    /// The peer refused our enrolment claim.
    #[error("enrolment refused by {addr}: {reason}")]
    EnrolmentRefused {
        /// The coordinator's address.
        addr: SocketAddr,
        /// The reason it sent.
        reason: String,
    },
    /// We refused a peer (policy or enrolment decision).
    #[error("refused peer {peer}: {refusal}")]
    Refused {
        /// The peer that was refused.
        peer: NodeId,
        /// Why.
        refusal: Refusal,
    },
    /// A protocol step did not finish in time.
    #[error("timed out: {0}")]
    Timeout(String),
}

impl NetError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}
