//! Enrolment: how a node that is not yet known proves it holds a join token.
//!
//! The coordinator creates a [`JoinToken`] (a random secret, printed as `tsr1-…`, optionally
//! carrying the coordinator's node id so the joining node can pin it) and hands it to the node
//! out of band. The node dials with [`Endpoint::enroll`]. The coordinator's
//! [`PeerPolicy`](crate::PeerPolicy) returns [`Admission::Enrolment`](crate::Admission::Enrolment)
//! for unknown keys while it is willing to enrol; such a connection surfaces as [`Accepted::Enrolment`](crate::Accepted)
//! and can do nothing until [`EnrolmentRequest::complete`] has checked the proof.
//!
//! The proof is `blake3::keyed_hash(K, exporter ‖ node key ‖ coordinator key)` where `K` is
//! derived from the token secret and `exporter` is 32 bytes of TLS keying material of this very
//! session. The secret never crosses the wire, the proof cannot be replayed on another session,
//! and a man in the middle (possible only when the token names no coordinator) gets a proof
//! bound to its own key and session, useless at the real coordinator.
//!
//! The crate provides the mechanism; the coordinator decides: its callback maps the claim's
//! [`TokenId`] to a token it still honours (or refuses), the crate verifies the proof, and on
//! success the caller records the node's key.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use ring::rand::SecureRandom;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::base32;
use crate::endpoint::{stream_kind, Connection, Endpoint, FramedStream};
use crate::error::{NetError, Refusal};
use crate::frame::HEADER_LEN;
use crate::identity::{NodeId, PublicKey};
use crate::tls::ExpectedPeer;

const KIND_ENROL_CLAIM: u16 = 0xFF20;
const KIND_ENROL_OK: u16 = 0xFF21;
const KIND_ENROL_REFUSED: u16 = 0xFF22;
const TOKEN_PREFIX: &str = "tsr1-";
const EXPORTER_LABEL: &[u8] = b"EXPORTER-tessera-enrol-v1";
const PROOF_KEY_CONTEXT: &str = "tessera-net 2026 enrolment proof key v1";
const TOKEN_ID_CONTEXT: &str = "tessera-net 2026 join token id v1";
const CLAIM_LEN: usize = 8 + 32;
const MAX_ENROL_FRAME: usize = 1024;

/// A join token: a 160-bit random secret, and optionally the coordinator's node id.
///
/// Printed as `tsr1-<32 base32 chars>` or `tsr1-<secret>-<coordinator node id>`.
/// [`Debug`](fmt::Debug) shows only its public [`TokenId`]; `Display` and serde reveal the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    secret: [u8; 20],
    coordinator: Option<NodeId>,
}

impl JoinToken {
    /// A fresh random token; pass the coordinator's node id so joining nodes can pin it.
    pub fn generate(coordinator: Option<NodeId>) -> Result<Self, NetError> {
        let mut secret = [0u8; 20];
        ring::rand::SystemRandom::new()
            .fill(&mut secret)
            .map_err(|_| NetError::TlsSetup("system random number generator failed".into()))?;
        Ok(Self {
            secret,
            coordinator,
        })
    }

    /// The public identifier of this token, sent in claims so the coordinator can find it.
    pub fn id(&self) -> TokenId {
        let h = blake3::derive_key(TOKEN_ID_CONTEXT, &self.secret);
        let mut id = [0u8; 8];
        id.copy_from_slice(&h[..8]);
        TokenId(id)
    }

    /// The coordinator the token was issued for, if it names one.
    pub fn coordinator(&self) -> Option<NodeId> {
        self.coordinator
    }

    fn proof(&self, exporter: &[u8; 32], node: &PublicKey, server: &PublicKey) -> blake3::Hash {
        let key = blake3::derive_key(PROOF_KEY_CONTEXT, &self.secret);
        let mut h = blake3::Hasher::new_keyed(&key);
        h.update(exporter);
        h.update(node.as_bytes());
        h.update(server.as_bytes());
        h.finalize()
    }
}

impl fmt::Display for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{TOKEN_PREFIX}{}", base32::encode(&self.secret))?;
        if let Some(c) = &self.coordinator {
            write!(f, "-{c}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinToken")
            .field("id", &self.id())
            .field("coordinator", &self.coordinator)
            .finish_non_exhaustive()
    }
}

impl FromStr for JoinToken {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Self, NetError> {
        let err = |reason: String| NetError::Parse {
            what: "join token",
            reason,
        };
        let rest = s
            .trim()
            .strip_prefix(TOKEN_PREFIX)
            .ok_or_else(|| err(format!("must start with {TOKEN_PREFIX:?}")))?;
        let (secret, coordinator) = match rest.split_once('-') {
            Some((s, c)) => (s, Some(c.parse::<NodeId>()?)),
            None => (rest, None),
        };
        Ok(Self {
            secret: base32::decode(secret).map_err(err)?,
            coordinator,
        })
    }
}

impl Serialize for JoinToken {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for JoinToken {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The public, non-secret id of a [`JoinToken`] (16 hex characters).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TokenId(pub [u8; 8]);

impl fmt::Display for TokenId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for TokenId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenId({self})")
    }
}

/// What an enrolling node claims: its (TLS-authenticated) key and the token it says it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnrolmentClaim {
    /// The node's key, authenticated by the TLS handshake.
    pub peer: PublicKey,
    /// The id of the token it claims to hold (not yet verified).
    pub token_id: TokenId,
    /// Where it connected from.
    pub remote_addr: SocketAddr,
}

impl EnrolmentClaim {
    /// The node's id.
    pub fn node_id(&self) -> NodeId {
        self.peer.node_id()
    }
}

/// Longest enrolment claim frame accepted, payload bytes. A claim is 40 bytes; a frame that
/// announces more is refused from its header, before any of its payload is read.
pub const MAX_CLAIM_LEN: usize = CLAIM_LEN;

/// An inbound connection from an unknown key that may enrol.
#[derive(Debug)]
pub struct EnrolmentRequest {
    conn: Connection,
    /// How long the node has, from the end of the handshake, to open its enrolment stream and
    /// send its claim (its first message).
    first_message: Duration,
    /// Streams the peer may open once enrolled.
    max_streams: u32,
}

impl EnrolmentRequest {
    pub(crate) fn new(conn: Connection, first_message: Duration, max_streams: u32) -> Self {
        Self {
            conn,
            first_message,
            max_streams,
        }
    }

    /// The node's authenticated key.
    pub fn peer_key(&self) -> PublicKey {
        self.conn.peer_key()
    }

    /// The node's id.
    pub fn peer_id(&self) -> NodeId {
        self.conn.peer_id()
    }

    /// Where the node connected from.
    pub fn remote_addr(&self) -> SocketAddr {
        self.conn.remote_addr()
    }

    /// Reads the node's claim: the enrolment stream and its one claim frame, within the first
    /// message deadline ([`crate::EndpointConfig::enrol_first_message`]), the frame refused
    /// from its header when it announces more than [`MAX_CLAIM_LEN`] bytes. Nothing is
    /// verified yet: [`ClaimedEnrolment::proves`] checks the proof.
    pub async fn read_claim(self) -> Result<ClaimedEnrolment, NetError> {
        let conn = self.conn;
        let peer = conn.peer_id();
        let step = |what: &str| NetError::Timeout(format!("enrolment of {}: {what}", peer.short()));
        let deadline = tokio::time::Instant::now() + self.first_message;
        let mut stream = match tokio::time::timeout_at(deadline, conn.accept_any_stream()).await {
            Ok(Ok(Some(s))) => s,
            Ok(Ok(None)) => return Err(step("closed before enrolling")),
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                conn.close("no enrolment claim in time");
                return Err(step("no enrolment stream"));
            }
        };
        if stream.kind != stream_kind::ENROL {
            return Err(refuse(
                conn,
                stream,
                Refusal::Other("expected an enrolment stream".into()),
            )
            .await);
        }
        stream.reader.set_max_len(MAX_CLAIM_LEN);
        let payload = match tokio::time::timeout_at(
            deadline,
            stream
                .reader
                .recv_kind(KIND_ENROL_CLAIM, "an enrolment claim"),
        )
        .await
        {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                conn.close("malformed enrolment claim");
                return Err(e);
            }
            Err(_) => {
                conn.close("no enrolment claim in time");
                return Err(step("no claim"));
            }
        };
        let Some((id, proof)) = payload
            .get(..CLAIM_LEN)
            .filter(|_| payload.len() == CLAIM_LEN)
            .map(|p| p.split_at(8))
        else {
            return Err(refuse(conn, stream, Refusal::Other("malformed claim".into())).await);
        };
        let claim = EnrolmentClaim {
            peer: conn.peer_key(),
            token_id: TokenId(id.try_into().expect("8 bytes")),
            remote_addr: conn.remote_addr(),
        };
        Ok(ClaimedEnrolment {
            conn,
            stream,
            claim,
            proof: proof.try_into().expect("32 bytes"),
            max_streams: self.max_streams,
        })
    }

    /// Reads the node's claim, asks `token_for` which token it must prove (or whether to
    /// refuse), verifies the proof, and answers the node.
    ///
    /// On `Ok` the connection is a full peer connection and the caller should record
    /// `conn.peer_key()` as enrolled. On any failure the node is told why and the connection
    /// is closed. A caller that counts a token's uses should use [`Self::read_claim`] and
    /// take the use only once [`ClaimedEnrolment::proves`] holds.
    pub async fn complete<F>(self, token_for: F) -> Result<Connection, NetError>
    where
        F: FnOnce(&EnrolmentClaim) -> Result<JoinToken, Refusal>,
    {
        let claimed = self.read_claim().await?;
        let token = match token_for(claimed.claim()) {
            Ok(t) => t,
            Err(r) => return Err(claimed.refuse(r).await),
        };
        if !claimed.proves(&token)? {
            return Err(claimed.refuse(Refusal::BadToken).await);
        }
        claimed.accept().await
    }

    /// Refuses without reading a claim; the node sees the connection closed with the reason.
    pub fn refuse(self, refusal: Refusal) -> NetError {
        let peer = self.conn.peer_id();
        self.conn.close(&refusal.to_string());
        NetError::Refused { peer, refusal }
    }
}

/// An enrolment whose claim has been read but not yet judged: the caller looks the token up,
/// checks the proof ([`Self::proves`]), and then accepts or refuses.
#[derive(Debug)]
pub struct ClaimedEnrolment {
    conn: Connection,
    stream: FramedStream,
    claim: EnrolmentClaim,
    proof: [u8; 32],
    max_streams: u32,
}

impl ClaimedEnrolment {
    /// What the node claims (its token id is not yet verified).
    pub fn claim(&self) -> &EnrolmentClaim {
        &self.claim
    }

    /// Whether the claim proves `token` on this very session (constant-time comparison).
    pub fn proves(&self, token: &JoinToken) -> Result<bool, NetError> {
        let exporter = self.conn.export_keying_material(EXPORTER_LABEL, b"")?;
        // The server key is ours: the one the node saw in this handshake.
        let ours = self.conn.local_key();
        let expected = token.proof(&exporter, &self.conn.peer_key(), &ours);
        // blake3::Hash equality is constant-time.
        Ok(token.id() == self.claim.token_id && expected == blake3::Hash::from_bytes(self.proof))
    }

    /// Tells the node it is enrolled; the connection is a full peer connection from now on.
    pub async fn accept(mut self) -> Result<Connection, NetError> {
        self.stream.writer.write_frame(KIND_ENROL_OK, b"").await?;
        self.stream.writer.finish().await?;
        self.conn.admit(self.max_streams);
        Ok(self.conn)
    }

    /// Tells the node why it is refused and closes the connection.
    pub async fn refuse(self, refusal: Refusal) -> NetError {
        refuse(self.conn, self.stream, refusal).await
    }
}

async fn refuse(conn: Connection, mut stream: FramedStream, refusal: Refusal) -> NetError {
    let peer = conn.peer_id();
    let reason = refusal.to_string();
    let _ = stream
        .writer
        .write_frame(KIND_ENROL_REFUSED, reason.as_bytes())
        .await;
    let _ = stream.writer.finish().await;
    // Give the node a moment to read the reason and close; then close ourselves.
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.inner.closed()).await;
    conn.close(&reason);
    NetError::Refused { peer, refusal }
}

/// Answers an enrolment stream from a peer that is already a member: nothing to prove.
pub(crate) async fn acknowledge_member(mut stream: FramedStream) {
    if let Ok(Some(f)) = stream.reader.read_frame().await {
        if f.kind == KIND_ENROL_CLAIM {
            let _ = stream.writer.write_frame(KIND_ENROL_OK, b"").await;
            let _ = stream.writer.finish().await;
        }
    }
}

impl Endpoint {
    /// Enrols this node with the coordinator at `addr` using `token`, and returns the
    /// connection, now that of an enrolled peer.
    ///
    /// The coordinator is pinned by the node id in the token if it carries one; otherwise it is
    /// trusted on first use (see [`ExpectedPeer::Unpinned`]): record its key from the returned
    /// connection and pin it from then on.
    pub async fn enroll(
        &self,
        addr: SocketAddr,
        token: &JoinToken,
    ) -> Result<Connection, NetError> {
        let expected = token
            .coordinator()
            .map_or(ExpectedPeer::Unpinned, ExpectedPeer::Id);
        let conn = self.connect(addr, expected).await?;
        let mut stream = conn.open_stream(stream_kind::ENROL).await?;
        let exporter = conn.export_keying_material(EXPORTER_LABEL, b"")?;
        let proof = token.proof(&exporter, &self.public_key(), &conn.peer_key());
        let mut claim = Vec::with_capacity(CLAIM_LEN);
        claim.extend_from_slice(&token.id().0);
        claim.extend_from_slice(proof.as_bytes());
        stream.writer.write_frame(KIND_ENROL_CLAIM, &claim).await?;
        let reply = tokio::time::timeout(self.config().handshake_timeout, async {
            let mut r = stream.reader;
            r = r.with_max_len(MAX_ENROL_FRAME - HEADER_LEN);
            r.recv().await
        })
        .await
        .map_err(|_| NetError::Timeout(format!("enrolment reply from {addr}")))??;
        match reply.kind {
            KIND_ENROL_OK => Ok(conn),
            KIND_ENROL_REFUSED => {
                let reason = String::from_utf8_lossy(&reply.payload).into_owned();
                conn.close("enrolment refused");
                Err(NetError::EnrolmentRefused { addr, reason })
            }
            kind => Err(NetError::UnexpectedFrame {
                stream: crate::error::StreamLabel {
                    peer: Some(conn.peer_id()),
                    stream: "enrolment".into(),
                },
                kind,
                expected: "an enrolment reply",
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_print_parse() {
        let t = JoinToken::generate(None).unwrap();
        let s = t.to_string();
        assert!(s.starts_with("tsr1-") && s.len() == 5 + 32);
        assert_eq!(s.parse::<JoinToken>().unwrap(), t);
        let c = crate::NodeIdentity::generate().unwrap().node_id();
        let t = JoinToken::generate(Some(c)).unwrap();
        let back: JoinToken = t.to_string().parse().unwrap();
        assert_eq!(back.coordinator(), Some(c));
        assert_eq!(back.id(), t.id());
        assert!(!format!("{t:?}").contains(&t.to_string()[5..]));
        assert!("tsr2-abc".parse::<JoinToken>().is_err());
        assert!("tsr1-abc".parse::<JoinToken>().is_err());
    }
}
