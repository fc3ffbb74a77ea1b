//! The emulator over real UDP sockets on 127.0.0.1. Every loop is bounded in count and time.
//! Wall-clock assertions are only lower bounds (the emulator adds at least the delay it is
//! told; a bandwidth cap delivers at most rate x elapsed, counted from before the first send
//! to after the last delivery): a busy machine can only make them truer. No test asserts
//! that something was fast; the exact timings of the shaping are tested on virtual time in
//! `src/shaper.rs`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tessera_linkemu::{Impairment, LinkEmulator, LinkShape};
use tokio::net::UdpSocket;
use tokio::time::{timeout, Instant};

const LOCAL: &str = "127.0.0.1:0";

fn local() -> SocketAddr {
    LOCAL.parse().unwrap()
}

/// A UDP echo server; stops with the runtime.
async fn echo_server() -> SocketAddr {
    let sock = UdpSocket::bind(local()).await.unwrap();
    let addr = sock.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_535];
        while let Ok((n, from)) = sock.recv_from(&mut buf).await {
            let _ = sock.send_to(&buf[..n], from).await;
        }
    });
    addr
}

/// A UDP sink that counts datagrams and bytes and keeps the ids of 4-byte ones.
#[derive(Default)]
struct SinkStats {
    packets: AtomicU64,
    bytes: AtomicU64,
    /// The sequence numbers of the 4-byte datagrams received, in arrival order.
    ids: std::sync::Mutex<Vec<u32>>,
}

async fn sink_server() -> (SocketAddr, Arc<SinkStats>) {
    let sock = UdpSocket::bind(local()).await.unwrap();
    let addr = sock.local_addr().unwrap();
    let stats = Arc::new(SinkStats::default());
    let s = stats.clone();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_535];
        while let Ok(n) = sock.recv(&mut buf).await {
            if n == 4 {
                let id = u32::from_be_bytes(buf[..4].try_into().unwrap());
                s.ids.lock().unwrap().push(id);
            }
            s.bytes.fetch_add(n as u64, Ordering::SeqCst);
            s.packets.fetch_add(1, Ordering::SeqCst);
        }
    });
    (addr, stats)
}

/// Sends one ping through `to` and waits up to `wait` for its echo; the round-trip time.
async fn ping(sock: &UdpSocket, to: SocketAddr, seq: u32, wait: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    sock.send_to(&seq.to_be_bytes(), to).await.unwrap();
    let mut buf = [0u8; 64];
    let deadline = t0 + wait;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        match timeout(left, sock.recv_from(&mut buf)).await {
            Ok(Ok((4, _))) if buf[..4] == seq.to_be_bytes() => return Some(t0.elapsed()),
            Ok(_) => continue, // a late echo of an earlier ping
            Err(_) => return None,
        }
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_adds_one_way_latency_to_the_round_trip() {
    let echo = echo_server().await;
    let shape = LinkShape::symmetric(Impairment::default().delay(ms(40)));
    let (emu, addr) = LinkEmulator::start(local(), echo, shape).await.unwrap();
    let client = UdpSocket::bind(local()).await.unwrap();

    let mut rtts = Vec::new();
    for seq in 0..5 {
        rtts.push(
            ping(&client, addr, seq, Duration::from_secs(5))
                .await
                .expect("echo"),
        );
    }
    let min = *rtts.iter().min().unwrap();
    assert!(min >= ms(80), "RTT {min:?} below the configured 2 x 40 ms");

    // Reshape at run time: 60 ms towards upstream only.
    emu.handle().set(LinkShape::asymmetric(
        Impairment::default().delay(ms(60)),
        Impairment::default(),
    ));
    let mut rtts = Vec::new();
    for seq in 100..105 {
        rtts.push(
            ping(&client, addr, seq, Duration::from_secs(5))
                .await
                .expect("echo"),
        );
    }
    let min = *rtts.iter().min().unwrap();
    assert!(
        min >= ms(60),
        "RTT {min:?} below the configured 60 ms one way"
    );

    let stats = emu.handle().stats();
    assert_eq!(stats.associations, 1);
    assert_eq!(stats.to_upstream.packets_out, 10);
    assert_eq!(stats.to_client.packets_out, 10);
    assert_eq!(stats.to_upstream.dropped(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bandwidth_limit_caps_throughput() {
    const LIMIT: u64 = 400_000; // bytes/s
    const QUEUE: usize = 48_000;
    const SIZE: usize = 1200;
    const SENT: u64 = 150 * 8;
    let (sink, got) = sink_server().await;
    let shape = LinkShape::symmetric(Impairment::default().bandwidth(LIMIT).queue_bytes(QUEUE));
    let (emu, addr) = LinkEmulator::start(local(), sink, shape).await.unwrap();
    let client = UdpSocket::bind(local()).await.unwrap();

    // Offer about twice the limit: 8 datagrams (9600 B) every 10 ms, 150 times.
    let payload = vec![0xA5u8; SIZE];
    let mut tick = tokio::time::interval(ms(10));
    let start = Instant::now();
    for _ in 0..150 {
        tick.tick().await;
        for _ in 0..8 {
            client.send_to(&payload, addr).await.unwrap();
        }
    }
    // Wait until every datagram the emulator took in is accounted for (sent on or dropped),
    // the sink has all that was sent on, and nothing more came in since the last look;
    // bounded by the per-test timeout.
    let mut last_in = u64::MAX;
    let stats = loop {
        tokio::time::sleep(ms(50)).await;
        let s = emu.handle().stats();
        let up = &s.to_upstream;
        if up.packets_in == last_in
            && up.packets_in == up.packets_out + up.dropped()
            && got.packets.load(Ordering::SeqCst) == up.packets_out
        {
            break s;
        }
        last_in = up.packets_in;
    };
    // Delivered bytes first, then the clock: the cap below is then taken at a later time
    // than the count it bounds.
    let delivered = got.bytes.load(Ordering::SeqCst);
    let elapsed = start.elapsed();
    let up = &stats.to_upstream;
    assert!(up.packets_in <= SENT && up.packets_in > SENT / 2, "{stats}");
    eprintln!("{delivered} B delivered in {elapsed:?}, limit {LIMIT} B/s; {stats}");
    // What a token bucket of LIMIT B/s with a QUEUE-byte queue can have delivered by now, at
    // most: the queue's content plus LIMIT x elapsed, plus one datagram of burst. A slow
    // machine only raises `elapsed`, so this cannot fail for want of speed.
    let cap = LIMIT as f64 * elapsed.as_secs_f64() + (QUEUE + SIZE) as f64;
    assert!(
        (delivered as f64) <= cap,
        "{delivered} B delivered in {elapsed:?}: more than the {LIMIT} B/s cap allows ({cap:.0})"
    );
    assert!(delivered > 0, "nothing crossed the link");
    assert_eq!(
        up.bytes_out, delivered,
        "the sink got what the emulator sent on"
    );
    assert!(
        up.dropped_queue > 0,
        "offered 2x the limit, yet no tail drop: {stats}"
    );
    assert_eq!(up.dropped_loss, 0);
    assert_eq!(up.dropped_partition, 0);
}

/// Sends datagrams `0..n` through a fresh emulator with `loss` and `seed`, 20 at a time, each
/// batch only once the emulator has read the previous one (so the kernel drops none on the
/// way in: every run offers the emulator the same sequence). Returns the emulator's counters
/// and the ids that reached the sink, once delivery has settled.
async fn lossy_run(loss: f64, seed: u64, n: u32) -> (tessera_linkemu::LinkStats, Vec<u32>) {
    let (sink, got) = sink_server().await;
    let shape = LinkShape::symmetric(Impairment::default().loss(loss)).seed(seed);
    let (emu, addr) = LinkEmulator::start(local(), sink, shape).await.unwrap();
    let client = UdpSocket::bind(local()).await.unwrap();
    let taken_in = |upto: u32| emu.handle().stats().to_upstream.packets_in == u64::from(upto);
    for i in 0..n {
        client.send_to(&i.to_be_bytes(), addr).await.unwrap();
        if i % 20 == 19 || i + 1 == n {
            // Bounded by the per-test timeout.
            while !taken_in(i + 1) {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
    }
    loop {
        let s = emu.handle().stats();
        let up = &s.to_upstream;
        let received = got.ids.lock().unwrap().clone();
        if up.packets_out + up.dropped() == u64::from(n) && received.len() as u64 == up.packets_out
        {
            return (s, received);
        }
        tokio::time::sleep(ms(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loss_drops_about_the_configured_fraction_deterministically() {
    const N: u32 = 2000;
    let (a, received) = lossy_run(0.25, 1234, N).await;
    let up = a.to_upstream;
    assert_eq!(up.packets_in, u64::from(N), "{a}");
    assert_eq!(
        up.dropped_other + up.dropped_queue + up.dropped_partition,
        0,
        "{a}"
    );
    assert_eq!(up.packets_in, up.dropped_loss + up.packets_out);
    let fraction = up.dropped_loss as f64 / up.packets_in as f64;
    // Binomial sd at p = 0.25, n = 2000 is about 0.01: five of them.
    assert!(
        (fraction - 0.25).abs() < 0.05,
        "dropped {fraction:.3}, configured 0.25"
    );
    // Never reordered, and what arrived is exactly what the emulator sent on.
    assert!(received.windows(2).all(|w| w[0] < w[1]), "reordered");
    assert_eq!(received.len() as u64, up.packets_out);

    // Same seed, same datagram sequence: the very same datagrams dropped.
    let (b, received_b) = lossy_run(0.25, 1234, N).await;
    assert_eq!(b.to_upstream.packets_in, u64::from(N), "{b}");
    assert_eq!(received_b, received, "same seed, other drops");
    // Another seed, other drops.
    let (_, received_c) = lossy_run(0.25, 4321, N).await;
    assert_ne!(received_c, received, "another seed, the same drops");
    // No loss configured: nothing dropped by the emulator, everything arrives.
    let (c, received) = lossy_run(0.0, 1234, 500).await;
    assert_eq!(c.to_upstream.dropped(), 0);
    assert_eq!(received, (0..500).collect::<Vec<u32>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_drops_everything_and_heal_restores() {
    let echo = echo_server().await;
    let shape = LinkShape::symmetric(Impairment::default().delay(ms(100)));
    let (emu, addr) = LinkEmulator::start(local(), echo, shape).await.unwrap();
    let link = emu.handle();
    let client = UdpSocket::bind(local()).await.unwrap();

    assert!(ping(&client, addr, 1, Duration::from_secs(5))
        .await
        .is_some());

    // A datagram already in flight when the partition begins is lost too.
    client.send_to(&2u32.to_be_bytes(), addr).await.unwrap();
    link.partition();
    assert!(link.is_partitioned());
    for seq in 3..13 {
        assert_eq!(
            ping(&client, addr, seq, ms(250)).await,
            None,
            "ping {seq} crossed a partition"
        );
    }
    let s = link.stats();
    assert!(
        s.to_upstream.dropped_partition + s.to_client.dropped_partition >= 11,
        "{s}"
    );

    link.heal();
    let back = ping(&client, addr, 100, Duration::from_secs(5)).await;
    assert!(back.is_some(), "healed link still drops");
    assert!(back.unwrap() >= ms(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_clients_get_separate_associations() {
    let echo = echo_server().await;
    let (emu, addr) = LinkEmulator::start(local(), echo, LinkShape::default())
        .await
        .unwrap();
    let a = UdpSocket::bind(local()).await.unwrap();
    let b = UdpSocket::bind(local()).await.unwrap();
    for seq in 0..3 {
        assert!(ping(&a, addr, seq, Duration::from_secs(5)).await.is_some());
        assert!(ping(&b, addr, seq + 10, Duration::from_secs(5))
            .await
            .is_some());
    }
    assert_eq!(emu.handle().stats().associations, 2);
    emu.shutdown().await;
    // After shutdown nothing answers.
    assert_eq!(ping(&a, addr, 99, ms(300)).await, None);
}

mod quic {
    use super::*;
    use tessera_net::{Accepted, AllowList, Endpoint, EndpointConfig, ExpectedPeer, NodeIdentity};

    const KIND: u16 = 7;

    fn config(idle: Duration) -> EndpointConfig {
        EndpointConfig {
            idle_timeout: idle,
            keep_alive: idle / 4,
            handshake_timeout: Duration::from_secs(10),
            ..EndpointConfig::default()
        }
    }

    /// A tessera-net server that echoes every frame, admitting `client`.
    fn echo_endpoint(
        id: &NodeIdentity,
        client: &NodeIdentity,
        idle: Duration,
    ) -> (SocketAddr, Endpoint) {
        let allowed = Arc::new(AllowList::new());
        allowed.insert(client.public_key());
        let server = Endpoint::bind_with_config(local(), id, allowed, config(idle)).unwrap();
        let addr = server.local_addr().unwrap();
        let accept = server.clone();
        tokio::spawn(async move {
            while let Some(incoming) = accept.accept().await {
                tokio::spawn(async move {
                    let Ok(Accepted::Peer(conn)) = incoming.handshake().await else {
                        return;
                    };
                    while let Ok(Some(mut stream)) = conn.accept_stream().await {
                        tokio::spawn(async move {
                            while let Ok(Some(frame)) = stream.reader.read_frame().await {
                                if stream.writer.send(&frame).await.is_err() {
                                    break;
                                }
                            }
                        });
                    }
                });
            }
        });
        (addr, server)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quic_through_the_emulator_and_dead_within_idle_timeout_when_partitioned() {
        let idle = Duration::from_secs(2);
        let server_id = NodeIdentity::generate().unwrap();
        let client_id = NodeIdentity::generate().unwrap();
        let (server_addr, _server) = echo_endpoint(&server_id, &client_id, idle);
        let shape = LinkShape::symmetric(Impairment::default().delay(ms(15)));
        let (emu, addr) = LinkEmulator::start(local(), server_addr, shape)
            .await
            .unwrap();
        let link = emu.handle();

        let client =
            Endpoint::bind_with_config(local(), &client_id, AllowList::new(), config(idle))
                .unwrap();
        let conn = timeout(
            Duration::from_secs(20),
            client.connect(addr, ExpectedPeer::Key(server_id.public_key())),
        )
        .await
        .expect("handshake within 20 s")
        .expect("handshake through the emulator");
        assert_eq!(conn.peer_key(), server_id.public_key());

        let mut stream = conn.open_stream(KIND).await.unwrap();
        for i in 0..5u8 {
            let t0 = Instant::now();
            stream.writer.write_frame(KIND, &[i; 100]).await.unwrap();
            let echo = timeout(Duration::from_secs(10), stream.reader.recv())
                .await
                .expect("echo within 10 s")
                .unwrap();
            assert_eq!(&echo.payload[..], &[i; 100]);
            assert!(
                t0.elapsed() >= ms(30),
                "frame RTT {:?} below 2 x 15 ms",
                t0.elapsed()
            );
        }
        let before = link.stats();
        assert!(before.to_upstream.packets_out > 0 && before.to_client.packets_out > 0);

        // The server "departs": the client must notice within its idle timeout.
        link.partition();
        let t0 = Instant::now();
        let err = timeout(idle * 3 + Duration::from_secs(5), conn.closed())
            .await
            .expect("a partitioned connection is declared dead");
        let dead_after = t0.elapsed();
        eprintln!("connection declared dead after {dead_after:?} ({err})");
        // QUIC restarts the idle timer on the first ack-eliciting packet sent after a receipt
        // (RFC 9000 10.1), e.g. a keep-alive: death comes idle to idle + keep-alive after the
        // partition. It is never declared before idle - keep-alive; that it is declared at all
        // is the timeout above (a hang guard, not a speed claim).
        assert!(
            dead_after >= idle - idle / 4 - ms(50),
            "declared dead after {dead_after:?}, before the idle timeout {idle:?}"
        );
        let s = link.stats();
        assert!(s.to_upstream.dropped_partition + s.to_client.dropped_partition > 0);

        // Healed: a fresh connection works again.
        link.heal();
        let again = timeout(
            Duration::from_secs(20),
            client.connect(addr, ExpectedPeer::Key(server_id.public_key())),
        )
        .await
        .expect("handshake within 20 s")
        .expect("reconnect after heal");
        let mut stream = again.open_stream(KIND).await.unwrap();
        stream.writer.write_frame(KIND, b"back").await.unwrap();
        let echo = timeout(Duration::from_secs(10), stream.reader.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&echo.payload[..], b"back");
    }
}
