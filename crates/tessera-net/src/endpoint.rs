//! A QUIC endpoint over quinn with pinned node keys, and its connections and framed streams.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::CertificateDer;
use rustls::sign::CertifiedKey;

use crate::enroll::EnrolmentRequest;
use crate::error::{NetError, StreamLabel};
use crate::frame::{FrameReader, FrameWriter, DEFAULT_MAX_FRAME_LEN};
use crate::identity::{NodeId, NodeIdentity, PublicKey};
use crate::stats::{ByteCounters, ConnectionStats};
use crate::tls::{self, Admission, ExpectedPeer, PeerPolicy};

/// Stream kinds reserved by this crate. Applications choose their own kinds below
/// [`crate::frame::RESERVED_KIND_START`].
pub mod stream_kind {
    /// Enrolment handshake stream.
    pub const ENROL: u16 = 0xFF01;
    /// Link measurement stream (ping/pong and bulk throughput).
    pub const MEASURE: u16 = 0xFF02;
}

/// Frame kind of the preamble that opens every stream; its payload is the stream kind (u16 BE).
pub(crate) const KIND_STREAM_OPEN: u16 = 0xFF00;
/// QUIC application close code for a refused peer.
const CLOSE_REFUSED: u32 = 1;
/// QUIC application close code for a normal close.
const CLOSE_NORMAL: u32 = 0;
/// QUIC stream error code for a stream reset after a framing error.
const STREAM_BAD_FRAMING: u32 = 2;
/// Bytes a peer may have in flight to us before it is admitted (the connection-level flow
/// control window): an unknown key that never finishes enrolment cannot make us buffer more.
/// Raised to [`MEMBER_RECEIVE_WINDOW`] once the peer is a member (or, dialing, once the
/// server is authenticated).
const UNADMITTED_RECEIVE_WINDOW: u32 = 256 << 10;
/// The connection-level window of an admitted peer: no limit beyond the per-stream windows.
const MEMBER_RECEIVE_WINDOW: quinn::VarInt = quinn::VarInt::MAX;
/// Connection attempts queued before the application accepts them, and the bytes they may
/// buffer (each, and all together).
const MAX_INCOMING: usize = 256;
const INCOMING_BUFFER: u64 = 64 << 10;
const INCOMING_BUFFER_TOTAL: u64 = 4 << 20;

/// Endpoint tuning.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// Largest frame payload accepted or sent on streams of this endpoint's connections.
    pub max_frame_len: usize,
    /// A connection with no traffic for this long is closed.
    pub idle_timeout: Duration,
    /// Keep-alive interval; must be below `idle_timeout`.
    pub keep_alive: Duration,
    /// Limit on the QUIC + TLS handshake, and on each enrolment step.
    pub handshake_timeout: Duration,
    /// How many bidirectional streams a peer may have open at once.
    pub max_concurrent_streams: u32,
    /// How long an unknown key has, once its handshake is done, to send its enrolment claim
    /// (a real node sends it at once; a connection that stays silent is closed).
    pub enrol_first_message: Duration,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        Self {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
            max_concurrent_streams: 256,
            enrol_first_message: Duration::from_secs(3),
        }
    }
}

/// How a connection notices that its peer stopped answering: QUIC closes it once nothing at
/// all (not even an acknowledgement) has arrived for `idle_timeout`, and sends a keep-alive
/// every `keep_alive` so that a quiet but live link is never idle that long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    pub idle_timeout: Duration,
    /// Must be below `idle_timeout`.
    pub keep_alive: Duration,
}

fn transport_config(config: &EndpointConfig) -> Result<quinn::TransportConfig, NetError> {
    let mut transport = quinn::TransportConfig::default();
    transport
        .max_idle_timeout(Some(
            quinn::IdleTimeout::try_from(config.idle_timeout)
                .map_err(|e| NetError::TlsSetup(format!("idle timeout: {e}")))?,
        ))
        .keep_alive_interval(Some(config.keep_alive))
        .receive_window(UNADMITTED_RECEIVE_WINDOW.into())
        .max_concurrent_bidi_streams(config.max_concurrent_streams.into())
        .max_concurrent_uni_streams(0u32.into());
    Ok(transport)
}

/// A bound UDP socket that dials and accepts authenticated, encrypted QUIC connections.
///
/// Every connection is mutually authenticated with TLS 1.3: this endpoint presents its node
/// certificate, checks the peer's against the expected key (dialing) or its [`PeerPolicy`]
/// (accepting). There is no plaintext or unauthenticated mode. Clones share the socket.
#[derive(Debug, Clone)]
pub struct Endpoint {
    inner: quinn::Endpoint,
    certified: Arc<CertifiedKey>,
    public: PublicKey,
    policy: Arc<dyn PeerPolicy>,
    config: EndpointConfig,
    transport: Arc<quinn::TransportConfig>,
}

impl Endpoint {
    /// Binds `addr` (port 0 for any) with default settings. Must run inside a tokio runtime.
    ///
    /// `policy` decides which client keys inbound handshakes admit; pass an `Arc` of your
    /// policy to keep updating it (e.g. `Arc<AllowList>`).
    pub fn bind(
        addr: SocketAddr,
        identity: &NodeIdentity,
        policy: impl PeerPolicy,
    ) -> Result<Self, NetError> {
        Self::bind_with_config(addr, identity, policy, EndpointConfig::default())
    }

    /// Like [`Endpoint::bind`] with explicit settings.
    pub fn bind_with_config(
        addr: SocketAddr,
        identity: &NodeIdentity,
        policy: impl PeerPolicy,
        config: EndpointConfig,
    ) -> Result<Self, NetError> {
        let (cert, key) = tls::node_certificate(identity)?;
        let certified = tls::certified_key(cert, key)?;
        Self::bind_with_cert(
            addr,
            identity.public_key(),
            certified,
            Arc::new(policy),
            config,
        )
    }

    /// Binds with a given certificate and signer (tests forge certificates through this).
    pub(crate) fn bind_with_cert(
        addr: SocketAddr,
        public: PublicKey,
        certified: Arc<CertifiedKey>,
        policy: Arc<dyn PeerPolicy>,
        config: EndpointConfig,
    ) -> Result<Self, NetError> {
        let transport = Arc::new(transport_config(&config)?);

        let tls = tls::server_config(&certified, policy.clone())?;
        let quic =
            QuicServerConfig::try_from(tls).map_err(|e| NetError::TlsSetup(e.to_string()))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(quic));
        server
            .transport_config(transport.clone())
            .max_incoming(MAX_INCOMING)
            .incoming_buffer_size(INCOMING_BUFFER)
            .incoming_buffer_size_total(INCOMING_BUFFER_TOTAL);
        let inner = quinn::Endpoint::server(server, addr)
            .map_err(|e| NetError::io(format!("binding UDP {addr}"), e))?;
        Ok(Self {
            inner,
            certified,
            public,
            policy,
            config,
            transport,
        })
    }

    /// A fresh copy of this endpoint's transport settings.
    fn transport_config(&self) -> Result<quinn::TransportConfig, NetError> {
        transport_config(&self.config)
    }

    /// The bound address (with the real port when bound to port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, NetError> {
        self.inner
            .local_addr()
            .map_err(|e| NetError::io("reading local address", e))
    }

    /// This endpoint's node key.
    pub fn public_key(&self) -> PublicKey {
        self.public
    }

    /// This endpoint's node id.
    pub fn node_id(&self) -> NodeId {
        self.public.node_id()
    }

    /// The endpoint's settings.
    pub fn config(&self) -> &EndpointConfig {
        &self.config
    }

    /// Dials `addr` and authenticates the server against `expected` (normally its pinned
    /// [`PublicKey`]; a [`NodeId`] also converts). Fails with [`NetError::Handshake`] if the
    /// server presents any other key, or if it refuses our key.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        expected: impl Into<ExpectedPeer>,
    ) -> Result<Connection, NetError> {
        self.dial(addr, expected.into(), self.transport.clone())
            .await
    }

    /// [`Endpoint::connect`] with this connection's own [`Liveness`]: the idle timeout it
    /// advertises (QUIC uses the smaller of both sides', so it binds the accepting side too)
    /// and how often it sends keep-alives. The endpoint's other connections keep theirs.
    pub async fn connect_with_liveness(
        &self,
        addr: SocketAddr,
        expected: impl Into<ExpectedPeer>,
        liveness: Liveness,
    ) -> Result<Connection, NetError> {
        if liveness.keep_alive >= liveness.idle_timeout {
            return Err(NetError::TlsSetup(format!(
                "keep-alive every {:?} cannot keep a {:?} idle timeout from expiring",
                liveness.keep_alive, liveness.idle_timeout
            )));
        }
        let mut transport = self.transport_config()?;
        transport
            .max_idle_timeout(Some(
                quinn::IdleTimeout::try_from(liveness.idle_timeout)
                    .map_err(|e| NetError::TlsSetup(format!("idle timeout: {e}")))?,
            ))
            .keep_alive_interval(Some(liveness.keep_alive));
        self.dial(addr, expected.into(), Arc::new(transport)).await
    }

    async fn dial(
        &self,
        addr: SocketAddr,
        expected: ExpectedPeer,
        transport: Arc<quinn::TransportConfig>,
    ) -> Result<Connection, NetError> {
        let tls = tls::client_config(&self.certified, expected)?;
        let quic =
            QuicClientConfig::try_from(tls).map_err(|e| NetError::TlsSetup(e.to_string()))?;
        let mut client = quinn::ClientConfig::new(Arc::new(quic));
        client.transport_config(transport);
        let server_name = match expected {
            ExpectedPeer::Key(k) => tls::node_dns_name(&k.node_id()),
            ExpectedPeer::Id(id) => tls::node_dns_name(&id),
            ExpectedPeer::Unpinned => tls::NAME_SUFFIX.to_string(),
        };
        let handshake = |reason: String| NetError::Handshake { addr, reason };
        let connecting = self
            .inner
            .connect_with(client, addr, &server_name)
            .map_err(|e| handshake(e.to_string()))?;
        let deadline = tokio::time::Instant::now() + self.config.handshake_timeout;
        let conn = tokio::time::timeout_at(deadline, connecting)
            .await
            .map_err(|_| handshake("timed out".into()))?
            .map_err(|e| handshake(e.to_string()))?;
        // In TLS 1.3 the client is done before the server has judged the client certificate;
        // wait for the server's HANDSHAKE_DONE so a refusal surfaces here, not on first use.
        loop {
            if let Some(e) = conn.close_reason() {
                return Err(handshake(e.to_string()));
            }
            if conn.stats().frame_rx.handshake_done > 0 {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(handshake(
                    "timed out waiting for handshake confirmation".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The server is the one we expected: no limit beyond the streams'.
        conn.set_receive_window(MEMBER_RECEIVE_WINDOW);
        Connection::from_quinn(conn, self.config.max_frame_len, self.public)
    }

    /// Waits for the next inbound connection attempt; `None` once the endpoint is closed.
    ///
    /// An attempt from an address not yet validated is answered with a stateless QUIC Retry
    /// first (the client repeats it with the token, one round trip later): packets with a
    /// spoofed source address never reach the application, cost no handshake and no state.
    ///
    /// Run [`Incoming::handshake`] in its own task so a slow peer does not hold up others.
    pub async fn accept(&self) -> Option<Incoming> {
        loop {
            let inner = self.inner.accept().await?;
            if !inner.remote_address_validated() && inner.may_retry() {
                let _ = inner.retry();
                continue;
            }
            return Some(Incoming {
                inner,
                local: self.public,
                policy: self.policy.clone(),
                config: self.config.clone(),
            });
        }
    }

    /// Closes every connection and stops accepting.
    pub fn close(&self) {
        self.inner.close(CLOSE_NORMAL.into(), b"endpoint closed");
    }

    /// Waits until every connection is cleanly shut down.
    pub async fn wait_idle(&self) {
        self.inner.wait_idle().await;
    }
}

/// An inbound connection attempt, before its handshake.
#[derive(Debug)]
pub struct Incoming {
    inner: quinn::Incoming,
    local: PublicKey,
    policy: Arc<dyn PeerPolicy>,
    config: EndpointConfig,
}

/// An inbound connection after a successful handshake.
#[derive(Debug)]
pub enum Accepted {
    /// An enrolled peer (policy said [`Admission::Member`]).
    Peer(Connection),
    /// An unknown key admitted for enrolment only; call
    /// [`EnrolmentRequest::complete`] to check its join token.
    Enrolment(EnrolmentRequest),
}

impl Incoming {
    /// The address the attempt came from (not yet authenticated).
    pub fn remote_addr(&self) -> SocketAddr {
        self.inner.remote_address()
    }

    /// Runs the handshake; the client's certificate is checked against the policy during it.
    pub async fn handshake(self) -> Result<Accepted, NetError> {
        let addr = self.inner.remote_address();
        let handshake = |reason: String| NetError::Handshake { addr, reason };
        let connecting = self.inner.accept().map_err(|e| handshake(e.to_string()))?;
        let conn = tokio::time::timeout(self.config.handshake_timeout, connecting)
            .await
            .map_err(|_| handshake("timed out".into()))?
            .map_err(|e| handshake(e.to_string()))?;
        let conn = Connection::from_quinn(conn, self.config.max_frame_len, self.local)?;
        // Ask again: the verifier's verdict cannot be carried out of rustls, and the policy may
        // have changed since; a refusal now closes the connection.
        match self.policy.allow(&conn.peer_key()) {
            Ok(Admission::Member) => {
                conn.admit(self.config.max_concurrent_streams);
                Ok(Accepted::Peer(conn))
            }
            Ok(Admission::Enrolment) => {
                // Until it has proved a token: one stream (the enrolment's), and the small
                // window it already has.
                conn.inner.set_max_concurrent_bi_streams(1u32.into());
                Ok(Accepted::Enrolment(EnrolmentRequest::new(
                    conn,
                    self.config.enrol_first_message,
                    self.config.max_concurrent_streams,
                )))
            }
            Err(refusal) => {
                conn.inner
                    .close(CLOSE_REFUSED.into(), refusal.to_string().as_bytes());
                Err(NetError::Refused {
                    peer: conn.peer_id(),
                    refusal,
                })
            }
        }
    }

    /// Refuses the attempt without a handshake.
    pub fn refuse(self) {
        self.inner.refuse();
    }
}

/// An authenticated, encrypted connection to a peer whose key is known.
///
/// Cheap to clone; all clones share the connection and its counters.
#[derive(Debug, Clone)]
pub struct Connection {
    pub(crate) inner: quinn::Connection,
    peer: PublicKey,
    local: PublicKey,
    counters: ByteCounters,
    max_frame_len: usize,
}

impl Connection {
    /// Lifts the limits of an unadmitted peer: it is a member now.
    pub(crate) fn admit(&self, max_streams: u32) {
        self.inner.set_max_concurrent_bi_streams(max_streams.into());
        self.inner.set_receive_window(MEMBER_RECEIVE_WINDOW);
    }

    fn from_quinn(
        inner: quinn::Connection,
        max_frame_len: usize,
        local: PublicKey,
    ) -> Result<Self, NetError> {
        let addr = inner.remote_address();
        let certs = inner
            .peer_identity()
            .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
            .ok_or_else(|| NetError::Handshake {
                addr,
                reason: "peer presented no certificate".into(),
            })?;
        let cert = certs.first().ok_or_else(|| NetError::Handshake {
            addr,
            reason: "peer presented no certificate".into(),
        })?;
        let peer = tls::certificate_key(cert).map_err(|e| NetError::Handshake {
            addr,
            reason: e.to_string(),
        })?;
        Ok(Self {
            inner,
            peer,
            local,
            counters: ByteCounters::default(),
            max_frame_len,
        })
    }

    /// The peer's authenticated key.
    pub fn peer_key(&self) -> PublicKey {
        self.peer
    }

    /// The peer's node id.
    pub fn peer_id(&self) -> NodeId {
        self.peer.node_id()
    }

    /// Our own node key on this connection.
    pub fn local_key(&self) -> PublicKey {
        self.local
    }

    /// The peer's current address.
    pub fn remote_addr(&self) -> SocketAddr {
        self.inner.remote_address()
    }

    /// The frame size limit of this connection's streams.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    fn wrap(&self, kind: u16, send: quinn::SendStream, recv: quinn::RecvStream) -> FramedStream {
        let label = StreamLabel {
            peer: Some(self.peer_id()),
            stream: format!("{} (kind {kind:#06x})", send.id()),
        };
        let counters = self.counters.stream(kind);
        FramedStream {
            kind,
            writer: FrameWriter::new(send)
                .with_max_len(self.max_frame_len)
                .with_label(label.clone())
                .with_counters(counters.clone()),
            reader: FrameReader::new(recv)
                .with_max_len(self.max_frame_len)
                .with_label(label)
                .with_counters(counters),
        }
    }

    fn conn_err(&self, source: quinn::ConnectionError) -> NetError {
        NetError::Connection {
            peer: self.peer_id(),
            source,
        }
    }

    /// Opens a bidirectional stream of `kind`; the peer's [`Connection::accept_stream`] sees
    /// the kind. Kinds from [`crate::frame::RESERVED_KIND_START`] up are the crate's own.
    pub async fn open_stream(&self, kind: u16) -> Result<FramedStream, NetError> {
        let (send, recv) = self.inner.open_bi().await.map_err(|e| self.conn_err(e))?;
        let mut s = self.wrap(kind, send, recv);
        s.writer
            .write_frame(KIND_STREAM_OPEN, &kind.to_be_bytes())
            .await?;
        Ok(s)
    }

    /// Accepts the peer's next stream, including crate-reserved kinds.
    ///
    /// A stream whose preamble is malformed is reset and skipped; only connection loss ends
    /// this. `Ok(None)` means the connection was closed normally.
    pub(crate) async fn accept_any_stream(&self) -> Result<Option<FramedStream>, NetError> {
        loop {
            let (send, recv) = match self.inner.accept_bi().await {
                Ok(s) => s,
                Err(
                    quinn::ConnectionError::ApplicationClosed(_)
                    | quinn::ConnectionError::LocallyClosed,
                ) => return Ok(None),
                Err(e) => return Err(self.conn_err(e)),
            };
            // The reader buffers nothing beyond the frame, so the stream can be re-wrapped.
            let mut pre = FrameReader::new(recv).with_max_len(2);
            let preamble = tokio::time::timeout(Duration::from_secs(5), pre.read_frame()).await;
            let mut recv = pre.into_inner();
            let kind = match preamble {
                Ok(Ok(Some(f))) if f.kind == KIND_STREAM_OPEN && f.payload.len() == 2 => {
                    u16::from_be_bytes([f.payload[0], f.payload[1]])
                }
                _ => {
                    let mut send = send;
                    let _ = send.reset(STREAM_BAD_FRAMING.into());
                    let _ = recv.stop(STREAM_BAD_FRAMING.into());
                    continue;
                }
            };
            let s = self.wrap(kind, send, recv);
            // Count the preamble under the stream's kind.
            if let Some(c) = s.reader.counters() {
                c.received(crate::frame::HEADER_LEN + 2);
            }
            return Ok(Some(s));
        }
    }

    /// Accepts the peer's next application stream.
    ///
    /// Streams of crate-reserved kinds are answered here in background tasks: measurement
    /// streams get the [`crate::measure::respond`] responder, and an enrolment stream from an
    /// already-enrolled peer is acknowledged. Streams with a malformed preamble are reset and
    /// skipped. `Ok(None)` means the connection was closed normally.
    pub async fn accept_stream(&self) -> Result<Option<FramedStream>, NetError> {
        loop {
            let Some(s) = self.accept_any_stream().await? else {
                return Ok(None);
            };
            match s.kind {
                stream_kind::MEASURE => {
                    tokio::spawn(crate::measure::respond(s));
                }
                stream_kind::ENROL => {
                    tokio::spawn(crate::enroll::acknowledge_member(s));
                }
                _ => return Ok(Some(s)),
            }
        }
    }

    /// Frame and UDP byte counts of this connection.
    pub fn stats(&self) -> ConnectionStats {
        let (frames, by_stream_kind) = self.counters.snapshot();
        let q = self.inner.stats();
        ConnectionStats {
            frames,
            by_stream_kind,
            udp_bytes_sent: q.udp_tx.bytes,
            udp_bytes_received: q.udp_rx.bytes,
            lost_packets: q.path.lost_packets,
            path_rtt_us: q.path.rtt.as_micros() as u64,
        }
    }

    /// Closes the connection with a short reason the peer can read.
    pub fn close(&self, reason: &str) {
        self.inner.close(CLOSE_NORMAL.into(), reason.as_bytes());
    }

    /// Waits until the connection is closed, by either side, and says why.
    pub async fn closed(&self) -> NetError {
        let e = self.inner.closed().await;
        self.conn_err(e)
    }

    /// TLS keying material exporter (RFC 5705), for binding proofs to this session.
    pub(crate) fn export_keying_material(
        &self,
        label: &[u8],
        context: &[u8],
    ) -> Result<[u8; 32], NetError> {
        let mut out = [0u8; 32];
        self.inner
            .export_keying_material(&mut out, label, context)
            .map_err(|_| NetError::TlsSetup("keying material export failed".into()))?;
        Ok(out)
    }

    /// The underlying quinn connection, for what this wrapper does not cover (datagrams,
    /// raw streams). Raw streams bypass framing and byte accounting.
    pub fn quinn(&self) -> &quinn::Connection {
        &self.inner
    }
}

/// A framed bidirectional stream of a given kind.
#[derive(Debug)]
pub struct FramedStream {
    /// The stream kind given by the opener.
    pub kind: u16,
    /// Sending half.
    pub writer: FrameWriter<quinn::SendStream>,
    /// Receiving half.
    pub reader: FrameReader<quinn::RecvStream>,
}
