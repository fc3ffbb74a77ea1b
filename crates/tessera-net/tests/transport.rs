//! End-to-end transport tests over real UDP sockets on 127.0.0.1.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_net::frame::{FrameHeader, HEADER_LEN};
use tessera_net::{
    measure_link, measure_rtt, measure_throughput, Accepted, AllowList, Connection, Endpoint,
    EndpointConfig, JoinToken, NetError, NodeIdentity, PublicKey, Refusal,
};
use tokio::sync::mpsc;

const ECHO: u16 = 1;
const OTHER: u16 = 2;

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// What the server saw, reported to the test.
#[derive(Debug)]
enum Event {
    Handshake(Result<tessera_net::NodeId, NetError>),
    Enrolled(Result<PublicKey, NetError>),
    StreamError(u16, NetError),
}

struct Server {
    addr: SocketAddr,
    key: PublicKey,
    allow: Arc<AllowList>,
    events: mpsc::UnboundedReceiver<Event>,
    _endpoint: Arc<Endpoint>,
}

impl Server {
    async fn next_event(&mut self) -> Event {
        tokio::time::timeout(Duration::from_secs(10), self.events.recv())
            .await
            .expect("server event in time")
            .expect("server alive")
    }
}

/// An echo server: admits per its allow list, enrols with `tokens`, echoes every frame.
fn spawn_server(config: EndpointConfig, tokens: Vec<JoinToken>) -> Server {
    let id = NodeIdentity::generate().unwrap();
    let allow = Arc::new(AllowList::new());
    let endpoint =
        Arc::new(Endpoint::bind_with_config(any_port(), &id, allow.clone(), config).unwrap());
    let (tx, events) = mpsc::unbounded_channel();
    let server = Server {
        addr: endpoint.local_addr().unwrap(),
        key: id.public_key(),
        allow: allow.clone(),
        events,
        _endpoint: endpoint.clone(),
    };
    let tokens = Arc::new(Mutex::new(tokens));
    tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let (tx, allow, tokens) = (tx.clone(), allow.clone(), tokens.clone());
            tokio::spawn(async move {
                let conn = match incoming.handshake().await {
                    Ok(Accepted::Peer(c)) => {
                        let _ = tx.send(Event::Handshake(Ok(c.peer_id())));
                        c
                    }
                    Ok(Accepted::Enrolment(req)) => {
                        let _ = tx.send(Event::Handshake(Ok(req.peer_id())));
                        let r = req
                            .complete(|claim| {
                                let mut t = tokens.lock().unwrap();
                                let i = t
                                    .iter()
                                    .position(|t| t.id() == claim.token_id)
                                    .ok_or(Refusal::BadToken)?;
                                Ok(t.remove(i)) // single use
                            })
                            .await;
                        match r {
                            Ok(c) => {
                                allow.insert(c.peer_key());
                                let _ = tx.send(Event::Enrolled(Ok(c.peer_key())));
                                c
                            }
                            Err(e) => {
                                let _ = tx.send(Event::Enrolled(Err(e)));
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Event::Handshake(Err(e)));
                        return;
                    }
                };
                serve(conn, tx).await;
            });
        }
    });
    server
}

async fn serve(conn: Connection, tx: mpsc::UnboundedSender<Event>) {
    while let Ok(Some(mut s)) = conn.accept_stream().await {
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                match s.reader.read_frame().await {
                    Ok(Some(f)) => {
                        if s.writer.send(&f).await.is_err() {
                            break;
                        }
                    }
                    Ok(None) => {
                        let _ = s.writer.finish().await;
                        break;
                    }
                    Err(e) => {
                        let _ = tx.send(Event::StreamError(s.kind, e));
                        break;
                    }
                }
            }
        });
    }
}

fn client() -> (NodeIdentity, Endpoint) {
    let id = NodeIdentity::generate().unwrap();
    let ep = Endpoint::bind(any_port(), &id, AllowList::new()).unwrap();
    (id, ep)
}

#[tokio::test]
async fn enrolled_peer_connects_and_exchanges_frames() {
    let mut server = spawn_server(EndpointConfig::default(), vec![]);
    let (id, ep) = client();
    server.allow.insert(id.public_key());

    let conn = ep.connect(server.addr, server.key).await.unwrap();
    assert_eq!(conn.peer_key(), server.key);
    assert_eq!(conn.peer_id(), server.key.node_id());
    match server.next_event().await {
        Event::Handshake(Ok(peer)) => assert_eq!(peer, id.node_id()),
        e => panic!("unexpected {e:?}"),
    }

    let mut a = conn.open_stream(ECHO).await.unwrap();
    let mut b = conn.open_stream(OTHER).await.unwrap();
    a.writer.write_frame(7, b"hello").await.unwrap();
    b.writer.write_message(8, &("json", 42u32)).await.unwrap();
    let floats: Vec<f32> = (0..4096).map(|i| i as f32 / 7.0).collect();
    a.writer.write_f32s(9, &floats).await.unwrap();

    let f = a.reader.recv().await.unwrap();
    assert_eq!((f.kind, &f.payload[..]), (7, &b"hello"[..]));
    assert_eq!(a.reader.read_f32s(9).await.unwrap(), floats);
    let m: (String, u32) = b.reader.read_message(8).await.unwrap();
    assert_eq!(m, ("json".to_string(), 42));

    let stats = conn.stats();
    let a_bytes = (HEADER_LEN + 2) + (HEADER_LEN + 5) + (HEADER_LEN + 4096 * 4);
    assert_eq!(stats.by_stream_kind[&ECHO].bytes_sent, a_bytes as u64);
    assert_eq!(
        stats.by_stream_kind[&ECHO].bytes_received,
        (a_bytes - HEADER_LEN - 2) as u64
    );
    assert_eq!(stats.by_stream_kind[&OTHER].frames_sent, 2);
    assert!(stats.frames.bytes_sent >= a_bytes as u64);
    assert!(stats.udp_bytes_sent > stats.frames.bytes_sent);
}

#[tokio::test]
async fn unenrolled_key_is_refused() {
    let mut server = spawn_server(EndpointConfig::default(), vec![]);
    let (id, ep) = client();
    match ep.connect(server.addr, server.key).await {
        Err(NetError::Handshake { reason, .. }) => {
            assert!(reason.contains("handshake failed"), "{reason}")
        }
        r => panic!("expected a handshake failure, got {r:?}"),
    }
    match server.next_event().await {
        Event::Handshake(Err(NetError::Handshake { reason, .. })) => {
            assert!(
                reason.contains(&format!("unknown node key {}", id.node_id())),
                "{reason}"
            )
        }
        e => panic!("unexpected {e:?}"),
    }
}

#[tokio::test]
async fn revoked_key_is_refused_and_recorded_key_is_compared_in_full() {
    let mut server = spawn_server(EndpointConfig::default(), vec![]);
    let (id, ep) = client();
    server.allow.insert(id.public_key());
    ep.connect(server.addr, server.key).await.unwrap();
    assert!(matches!(server.next_event().await, Event::Handshake(Ok(_))));
    server.allow.remove(&id.node_id());
    assert!(matches!(
        ep.connect(server.addr, server.key).await,
        Err(NetError::Handshake { .. })
    ));
    assert!(matches!(
        server.next_event().await,
        Event::Handshake(Err(_))
    ));
}

#[tokio::test]
async fn client_refuses_server_with_other_key_than_pinned() {
    let server = spawn_server(EndpointConfig::default(), vec![]);
    let (id, ep) = client();
    server.allow.insert(id.public_key());
    let imposter_expected = NodeIdentity::generate().unwrap().public_key();
    match ep.connect(server.addr, imposter_expected).await {
        Err(NetError::Handshake { reason, .. }) => {
            assert!(reason.contains("is not the pinned key"), "{reason}")
        }
        r => panic!("expected a handshake failure, got {r:?}"),
    }
    // Pinning by node id works the same way.
    match ep.connect(server.addr, imposter_expected.node_id()).await {
        Err(NetError::Handshake { reason, .. }) => {
            assert!(reason.contains("is not the expected node"), "{reason}")
        }
        r => panic!("expected a handshake failure, got {r:?}"),
    }
    ep.connect(server.addr, server.key.node_id()).await.unwrap();
}

#[tokio::test]
async fn enrolment_with_token_then_member() {
    let coordinator = NodeIdentity::generate().unwrap();
    let allow = Arc::new(AllowList::new());
    allow.set_enrolment_open(true);
    let ep = Arc::new(Endpoint::bind(any_port(), &coordinator, allow.clone()).unwrap());
    let addr = ep.local_addr().unwrap();
    let token = JoinToken::generate(Some(coordinator.node_id())).unwrap();
    let wrong = JoinToken::generate(None).unwrap();
    let printed = token.to_string();
    {
        let (ep, allow, token) = (ep.clone(), allow.clone(), token.clone());
        tokio::spawn(async move {
            while let Some(inc) = ep.accept().await {
                let (allow, token) = (allow.clone(), token.clone());
                tokio::spawn(async move {
                    match inc.handshake().await {
                        Ok(Accepted::Enrolment(req)) => {
                            let r = req
                                .complete(|claim| {
                                    if claim.token_id == token.id() {
                                        Ok(token.clone())
                                    } else {
                                        Err(Refusal::BadToken)
                                    }
                                })
                                .await;
                            if let Ok(c) = r {
                                allow.insert(c.peer_key());
                                serve(c, mpsc::unbounded_channel().0).await;
                            }
                        }
                        Ok(Accepted::Peer(c)) => serve(c, mpsc::unbounded_channel().0).await,
                        Err(_) => {}
                    }
                });
            }
        });
    }

    // A node with a wrong token is told why.
    let (_, bad_node) = client();
    match bad_node.enroll(addr, &wrong).await {
        Err(NetError::EnrolmentRefused { reason, .. }) => {
            assert!(reason.contains("join token not accepted"), "{reason}")
        }
        r => panic!("expected refusal, got {r:?}"),
    }

    // The right token (parsed from its printed form) enrols; the coordinator is pinned by it.
    let (node_id, node) = client();
    let parsed: JoinToken = printed.parse().unwrap();
    let conn = node.enroll(addr, &parsed).await.unwrap();
    assert_eq!(conn.peer_key(), coordinator.public_key());
    let mut s = conn.open_stream(ECHO).await.unwrap();
    s.writer.write_frame(1, b"after enrolment").await.unwrap();
    assert_eq!(
        &s.reader.recv().await.unwrap().payload[..],
        b"after enrolment"
    );
    assert!(allow.contains(&node_id.public_key()));

    // Now a member: plain connect works, and enrolling again is acknowledged.
    node.connect(addr, coordinator.public_key()).await.unwrap();
    node.enroll(addr, &parsed).await.unwrap();

    // A token naming another coordinator makes the node refuse this server.
    let (_, third) = client();
    let elsewhere = JoinToken::generate(Some(NodeIdentity::generate().unwrap().node_id())).unwrap();
    assert!(matches!(
        third.enroll(addr, &elsewhere).await,
        Err(NetError::Handshake { .. })
    ));
}

#[tokio::test]
async fn enrolment_token_is_single_use_in_callback() {
    let coordinator_cfg = EndpointConfig::default();
    let token = JoinToken::generate(None).unwrap();
    let mut server = spawn_server(coordinator_cfg, vec![token.clone()]);
    server.allow.set_enrolment_open(true);
    let (a_id, a) = client();
    let conn = a.enroll(server.addr, &token).await.unwrap();
    assert_eq!(conn.peer_key(), server.key); // trust on first use: token names no coordinator
    assert!(matches!(server.next_event().await, Event::Handshake(Ok(_))));
    match server.next_event().await {
        Event::Enrolled(Ok(k)) => assert_eq!(k, a_id.public_key()),
        e => panic!("unexpected {e:?}"),
    }
    let (_, b) = client();
    assert!(matches!(
        b.enroll(server.addr, &token).await,
        Err(NetError::EnrolmentRefused { .. })
    ));
}

#[tokio::test]
async fn oversized_and_malformed_frames_fail_only_their_stream() {
    let config = EndpointConfig {
        max_frame_len: 1024,
        ..EndpointConfig::default()
    };
    let mut server = spawn_server(config, vec![]);
    let id = NodeIdentity::generate().unwrap();
    server.allow.insert(id.public_key());
    let ep = Endpoint::bind_with_config(
        any_port(),
        &id,
        AllowList::new(),
        EndpointConfig {
            max_frame_len: 1 << 20,
            ..EndpointConfig::default()
        },
    )
    .unwrap();
    let conn = ep.connect(server.addr, server.key).await.unwrap();
    assert!(matches!(server.next_event().await, Event::Handshake(Ok(_))));

    let mut good = conn.open_stream(ECHO).await.unwrap();
    good.writer.write_frame(1, b"before").await.unwrap();
    assert_eq!(&good.reader.recv().await.unwrap().payload[..], b"before");

    // Oversized: declared 4 GiB - 1; the server refuses on the header alone.
    let (mut send, _recv) = conn.quinn().open_bi().await.unwrap();
    let mut raw = FrameHeader {
        kind: 0xFF00,
        len: 2,
    }
    .encode()
    .to_vec();
    raw.extend_from_slice(&OTHER.to_be_bytes());
    raw.extend_from_slice(
        &FrameHeader {
            kind: 5,
            len: u32::MAX,
        }
        .encode(),
    );
    send.write_all(&raw).await.unwrap();
    match server.next_event().await {
        Event::StreamError(OTHER, NetError::FrameTooLarge { len, max, stream }) => {
            assert_eq!((len, max), (u64::from(u32::MAX), 1024));
            assert_eq!(stream.peer, Some(id.node_id()));
        }
        e => panic!("unexpected {e:?}"),
    }

    // Oversized through the framed API: 2 KiB > the server's 1 KiB limit.
    let mut big = conn.open_stream(OTHER).await.unwrap();
    big.writer.write_frame(5, &[0u8; 2048]).await.unwrap();
    assert!(matches!(
        server.next_event().await,
        Event::StreamError(OTHER, NetError::FrameTooLarge { len: 2048, .. })
    ));

    // Wrong version: a typed mismatch error on that stream only.
    let (mut send, _recv2) = conn.quinn().open_bi().await.unwrap();
    let mut raw = FrameHeader {
        kind: 0xFF00,
        len: 2,
    }
    .encode()
    .to_vec();
    raw.extend_from_slice(&OTHER.to_be_bytes());
    let mut bad = FrameHeader { kind: 5, len: 0 }.encode();
    bad[1] = 9;
    raw.extend_from_slice(&bad);
    send.write_all(&raw).await.unwrap();
    assert!(matches!(
        server.next_event().await,
        Event::StreamError(
            OTHER,
            NetError::VersionMismatch {
                ours: 1,
                theirs: 9,
                ..
            }
        )
    ));

    // Bad magic.
    let (mut send, _recv3) = conn.quinn().open_bi().await.unwrap();
    let mut raw = FrameHeader {
        kind: 0xFF00,
        len: 2,
    }
    .encode()
    .to_vec();
    raw.extend_from_slice(&OTHER.to_be_bytes());
    raw.extend_from_slice(b"GET / HTTP/1.1\r\n");
    send.write_all(&raw).await.unwrap();
    assert!(matches!(
        server.next_event().await,
        Event::StreamError(OTHER, NetError::BadMagic { found: 0x4745, .. })
    ));

    // Garbage instead of a stream preamble: the stream is reset and skipped.
    let (mut send, _recv4) = conn.quinn().open_bi().await.unwrap();
    send.write_all(b"\x00\x01garbage").await.unwrap();

    // Our side refuses to send oversize frames too.
    let mut s = conn.open_stream(OTHER).await.unwrap();
    assert!(matches!(
        s.writer.write_frame(1, &vec![0u8; (1 << 20) + 1]).await,
        Err(NetError::FrameTooLarge { .. })
    ));

    // The first stream, and new streams, keep working on the same connection.
    good.writer.write_frame(1, b"after").await.unwrap();
    assert_eq!(&good.reader.recv().await.unwrap().payload[..], b"after");
    let mut fresh = conn.open_stream(ECHO).await.unwrap();
    fresh.writer.write_frame(1, b"fresh").await.unwrap();
    assert_eq!(&fresh.reader.recv().await.unwrap().payload[..], b"fresh");
}

/// The link figures are measured from the work asked for (pings counted, bytes sent); how fast
/// loopback is on a busy machine is no test's business.
#[tokio::test]
async fn link_measurement_is_sane() {
    let server = spawn_server(EndpointConfig::default(), vec![]);
    let (id, ep) = client();
    server.allow.insert(id.public_key());
    let conn = ep.connect(server.addr, server.key).await.unwrap();

    let rtt = measure_rtt(&conn, 20).await.unwrap();
    assert_eq!(rtt.samples, 20);
    assert!(rtt.min > Duration::ZERO && rtt.min <= rtt.median);
    let sent =
        |c: &Connection| c.stats().by_stream_kind[&tessera_net::stream_kind::MEASURE].bytes_sent;
    let before = sent(&conn);
    let bps = measure_throughput(&conn, 8 << 20).await.unwrap();
    assert!(bps.is_finite() && bps > 0.0, "{bps}");
    assert!(sent(&conn) - before >= 8 << 20, "the 8 MiB were sent");

    let link = measure_link(&conn, 5, 1 << 20).await.unwrap();
    assert!(link.rtt_min > Duration::ZERO && link.rtt_min <= link.rtt_median);
    assert!(link.bytes_per_s.is_finite() && link.bytes_per_s > 0.0);
    assert!(link.measured_at_unix_ms > 1_600_000_000_000);
    let json = serde_json::to_string(&link).unwrap();
    let back: tessera_net::LinkMeasurement = serde_json::from_str(&json).unwrap();
    assert_eq!(back, link);
    eprintln!(
        "loopback: rtt min {:?} median {:?}, {:.1} MB/s",
        link.rtt_min,
        link.rtt_median,
        link.bytes_per_s / 1e6
    );

    let stats = conn.stats();
    assert!(stats.by_stream_kind[&tessera_net::stream_kind::MEASURE].bytes_sent > 9 << 20);
}
