//! A UDP link emulator for tests: delay, jitter, bandwidth, loss and partitions between two
//! endpoints on one machine.
//!
//! # Why a proxy and not netem
//!
//! Tessera's transport is QUIC, i.e. UDP. The usual way to impair a link is the kernel's `netem`
//! qdisc, but the sch_netem module is not available on our development and CI machines, and the
//! alternatives that are (`tbf`/`htb` inside network namespaces) need root and namespaces, a
//! setup no test should depend on. A user-space UDP proxy works anywhere, unprivileged, in
//! process, and can be reshaped from the test itself at any moment (`partition()` in the middle
//! of a request, `heal()` a second later). The price: it shapes only traffic that is sent *to the
//! proxy*, and its timing is as good as the tokio timer (about a millisecond) on a loaded host.
//!
//! # How it works
//!
//! [`LinkEmulator::start`] binds a UDP socket (`listen`). A client sends its datagrams there
//! instead of to the real server (`upstream`). For each client source address the emulator opens
//! one association: its own UDP socket towards `upstream`, so the server sees one distinct peer
//! per client, and replies from `upstream` travel back to that client from the `listen` address.
//! Each direction (client → upstream, upstream → client) is shaped independently by an
//! [`Impairment`]:
//!
//! 1. **partition**: while the link is partitioned, every datagram is dropped, including those
//!    already in flight when the partition began;
//! 2. **loss**: each datagram is dropped with probability `loss`, drawn from a seeded generator,
//!    so a run with the same seed and the same packet sequence drops the same packets;
//! 3. **bandwidth**: a rate-limited FIFO (a token bucket whose burst is one datagram): a datagram
//!    leaves the queue `len / rate` after the previous one, and one that would make the queue
//!    hold more than `queue_bytes` is tail-dropped;
//! 4. **delay**: after leaving the queue, a datagram is delivered `delay ± jitter` later
//!    (uniform jitter). Datagrams are never reordered: jitter only bunches them.
//!
//! [`LinkHandle`] changes the shape at run time ([`LinkHandle::set`], [`LinkHandle::partition`],
//! [`LinkHandle::heal`]) and reads per-direction counters ([`LinkHandle::stats`]).
//!
//! # In tests
//!
//! ```no_run
//! use std::time::Duration;
//! use tessera_linkemu::{Impairment, LinkEmulator, LinkShape};
//!
//! # async fn demo(server: std::net::SocketAddr) -> std::io::Result<()> {
//! // 20 ms each way, 100 Mbit/s, 1% loss, seeded.
//! let shape = LinkShape::symmetric(
//!     Impairment::default()
//!         .delay(Duration::from_millis(20))
//!         .bandwidth(100_000_000 / 8)
//!         .loss(0.01),
//! )
//! .seed(7);
//! let (emu, addr) = LinkEmulator::start("127.0.0.1:0".parse().unwrap(), server, shape).await?;
//! // ... connect the client to `addr` instead of `server` ...
//! emu.handle().partition(); // the server "departs"
//! emu.handle().heal();      // and comes back
//! println!("{:?}", emu.handle().stats());
//! # Ok(())
//! # }
//! ```
//!
//! The `tessera-linkemu` binary runs the same proxy from the command line for manual use.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_535;
/// Most bytes held in one direction's delay line (bounds memory whatever the shape: 32 MiB is
/// 2.7 s of a saturated 100 Mbit/s link).
pub const MAX_IN_FLIGHT_BYTES: usize = 32 << 20;
/// Most concurrent client associations; datagrams from further sources are dropped.
pub const MAX_ASSOCIATIONS: usize = 1024;
/// An association with no traffic either way for this long is closed.
pub const ASSOCIATION_IDLE: Duration = Duration::from_secs(120);
/// Default bound on the bandwidth queue of one direction.
pub const DEFAULT_QUEUE_BYTES: usize = 256 * 1024;

/// How one direction of the link treats datagrams.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Impairment {
    /// One-way delay added to every datagram.
    pub delay: Duration,
    /// Uniform jitter: each datagram's delay is drawn from `delay ± jitter` (never below zero).
    pub jitter: Duration,
    /// Bandwidth limit in bytes per second; `None` is unlimited.
    pub bandwidth: Option<u64>,
    /// Most bytes waiting for bandwidth; a datagram that would exceed it is tail-dropped.
    pub queue_bytes: usize,
    /// Probability in `[0, 1]` that a datagram is dropped.
    pub loss: f64,
}

impl Default for Impairment {
    /// A perfect link: no delay, no limit, no loss.
    fn default() -> Self {
        Self {
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            bandwidth: None,
            queue_bytes: DEFAULT_QUEUE_BYTES,
            loss: 0.0,
        }
    }
}

impl Impairment {
    /// Sets the one-way delay.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Sets the jitter (uniform, `delay ± jitter`).
    pub fn jitter(mut self, jitter: Duration) -> Self {
        self.jitter = jitter;
        self
    }

    /// Limits the bandwidth to `bytes_per_s` (0 means unlimited).
    pub fn bandwidth(mut self, bytes_per_s: u64) -> Self {
        self.bandwidth = (bytes_per_s > 0).then_some(bytes_per_s);
        self
    }

    /// Sets the bandwidth queue bound in bytes.
    pub fn queue_bytes(mut self, bytes: usize) -> Self {
        self.queue_bytes = bytes;
        self
    }

    /// Sets the loss probability (clamped to `[0, 1]`; NaN is 0).
    pub fn loss(mut self, p: f64) -> Self {
        self.loss = if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) };
        self
    }
}

/// The whole link: one [`Impairment`] per direction, the partition switch and the loss seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkShape {
    /// Client → upstream.
    pub to_upstream: Impairment,
    /// Upstream → client.
    pub to_client: Impairment,
    /// Drop everything, both ways.
    pub partitioned: bool,
    /// Seed of the loss and jitter generators. Each association's two directions draw from
    /// generators derived from it when the association opens; [`LinkHandle::set`] does not
    /// reseed open associations.
    pub seed: u64,
}

impl Default for LinkShape {
    /// A perfect link.
    fn default() -> Self {
        Self::symmetric(Impairment::default())
    }
}

impl LinkShape {
    /// The same impairment both ways.
    pub fn symmetric(each_way: Impairment) -> Self {
        Self {
            to_upstream: each_way,
            to_client: each_way,
            partitioned: false,
            seed: 0,
        }
    }

    /// Different impairments each way.
    pub fn asymmetric(to_upstream: Impairment, to_client: Impairment) -> Self {
        Self {
            to_upstream,
            to_client,
            ..Self::default()
        }
    }

    /// Sets the seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets the partition switch.
    pub fn partitioned(mut self, partitioned: bool) -> Self {
        self.partitioned = partitioned;
        self
    }

    fn get(&self, dir: Direction) -> &Impairment {
        match dir {
            Direction::ToUpstream => &self.to_upstream,
            Direction::ToClient => &self.to_client,
        }
    }
}

/// A direction of the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Client → upstream.
    ToUpstream,
    /// Upstream → client.
    ToClient,
}

impl Direction {
    fn index(self) -> usize {
        match self {
            Self::ToUpstream => 0,
            Self::ToClient => 1,
        }
    }
}

/// Counters of one direction (monotonic since start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectionStats {
    /// Datagrams that entered the emulator in this direction.
    pub packets_in: u64,
    /// Their bytes.
    pub bytes_in: u64,
    /// Datagrams sent on towards their destination.
    pub packets_out: u64,
    /// Their bytes.
    pub bytes_out: u64,
    /// Dropped by random loss.
    pub dropped_loss: u64,
    /// Dropped because the bandwidth queue (or the delay line, [`MAX_IN_FLIGHT_BYTES`]) was full.
    pub dropped_queue: u64,
    /// Dropped by a partition.
    pub dropped_partition: u64,
    /// Dropped because sending failed (destination gone, too many associations).
    pub dropped_other: u64,
}

impl DirectionStats {
    /// All drops.
    pub fn dropped(&self) -> u64 {
        self.dropped_loss + self.dropped_queue + self.dropped_partition + self.dropped_other
    }
}

/// Counters of both directions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Client → upstream.
    pub to_upstream: DirectionStats,
    /// Upstream → client.
    pub to_client: DirectionStats,
    /// Associations opened since start (one per client source address, reopened after idling).
    pub associations: u64,
}

impl fmt::Display for LinkStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, d) in [
            ("to upstream", &self.to_upstream),
            ("to client", &self.to_client),
        ] {
            writeln!(
                f,
                "{name}: {} pkts / {} B in, {} pkts / {} B out, dropped {} (loss {}, queue {}, \
                 partition {}, other {})",
                d.packets_in,
                d.bytes_in,
                d.packets_out,
                d.bytes_out,
                d.dropped(),
                d.dropped_loss,
                d.dropped_queue,
                d.dropped_partition,
                d.dropped_other
            )?;
        }
        write!(f, "associations: {}", self.associations)
    }
}

#[derive(Default)]
struct Counters {
    packets_in: AtomicU64,
    bytes_in: AtomicU64,
    packets_out: AtomicU64,
    bytes_out: AtomicU64,
    dropped_loss: AtomicU64,
    dropped_queue: AtomicU64,
    dropped_partition: AtomicU64,
    dropped_other: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> DirectionStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DirectionStats {
            packets_in: g(&self.packets_in),
            bytes_in: g(&self.bytes_in),
            packets_out: g(&self.packets_out),
            bytes_out: g(&self.bytes_out),
            dropped_loss: g(&self.dropped_loss),
            dropped_queue: g(&self.dropped_queue),
            dropped_partition: g(&self.dropped_partition),
            dropped_other: g(&self.dropped_other),
        }
    }
}

fn bump(a: &AtomicU64, n: usize) {
    a.fetch_add(n as u64, Ordering::Relaxed);
}

struct Shared {
    shape: RwLock<LinkShape>,
    counters: [Counters; 2],
    associations: AtomicU64,
}

impl Shared {
    fn shape(&self) -> LinkShape {
        *self.shape.read().unwrap_or_else(|e| e.into_inner())
    }

    fn counters(&self, dir: Direction) -> &Counters {
        &self.counters[dir.index()]
    }
}

/// Changes the link's shape while it runs and reads its counters. Cheap to clone.
#[derive(Clone)]
pub struct LinkHandle {
    shared: Arc<Shared>,
}

impl fmt::Debug for LinkHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkHandle")
            .field("shape", &self.shape())
            .finish()
    }
}

impl LinkHandle {
    /// Replaces the shape; datagrams that enter from now on see it (a partition also drops those
    /// already in flight).
    pub fn set(&self, shape: LinkShape) {
        *self.shared.shape.write().unwrap_or_else(|e| e.into_inner()) = shape;
    }

    /// Edits the shape in place.
    pub fn update(&self, f: impl FnOnce(&mut LinkShape)) {
        f(&mut self.shared.shape.write().unwrap_or_else(|e| e.into_inner()));
    }

    /// The current shape.
    pub fn shape(&self) -> LinkShape {
        self.shared.shape()
    }

    /// Drops everything both ways, including datagrams already in flight, until [`Self::heal`].
    pub fn partition(&self) {
        self.update(|s| s.partitioned = true);
    }

    /// Ends a partition.
    pub fn heal(&self) {
        self.update(|s| s.partitioned = false);
    }

    /// Whether the link is partitioned.
    pub fn is_partitioned(&self) -> bool {
        self.shape().partitioned
    }

    /// Counters since start.
    pub fn stats(&self) -> LinkStats {
        LinkStats {
            to_upstream: self.shared.counters(Direction::ToUpstream).snapshot(),
            to_client: self.shared.counters(Direction::ToClient).snapshot(),
            associations: self.shared.associations.load(Ordering::Relaxed),
        }
    }
}

/// A running emulator. Dropping it stops every task and closes its sockets.
pub struct LinkEmulator {
    handle: LinkHandle,
    local_addr: SocketAddr,
    upstream: SocketAddr,
    shutdown: watch::Sender<()>,
    task: JoinHandle<()>,
}

impl fmt::Debug for LinkEmulator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkEmulator")
            .field("local_addr", &self.local_addr)
            .field("upstream", &self.upstream)
            .field("shape", &self.handle.shape())
            .finish()
    }
}

impl LinkEmulator {
    /// Binds `listen` (port 0 picks one) and starts relaying between the clients that send to it
    /// and `upstream`. Returns the emulator and the address clients should send to.
    ///
    /// Must be called within a tokio runtime.
    pub async fn start(
        listen: SocketAddr,
        upstream: SocketAddr,
        shape: LinkShape,
    ) -> io::Result<(Self, SocketAddr)> {
        let socket = Arc::new(UdpSocket::bind(listen).await?);
        let local_addr = socket.local_addr()?;
        let shared = Arc::new(Shared {
            shape: RwLock::new(shape),
            counters: Default::default(),
            associations: AtomicU64::new(0),
        });
        let (shutdown, shutdown_rx) = watch::channel(());
        let task = tokio::spawn(run_listener(socket, upstream, shared.clone(), shutdown_rx));
        let emu = Self {
            handle: LinkHandle { shared },
            local_addr,
            upstream,
            shutdown,
            task,
        };
        Ok((emu, local_addr))
    }

    /// A handle to reshape the link and read its counters; it outlives the emulator harmlessly.
    pub fn handle(&self) -> LinkHandle {
        self.handle.clone()
    }

    /// The address clients send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The address datagrams are relayed to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Stops relaying and waits until the listening task has ended.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(());
        let _ = (&mut self.task).await;
    }
}

impl Drop for LinkEmulator {
    fn drop(&mut self) {
        // The signal ends every task; aborting the listener also frees the port at once.
        let _ = self.shutdown.send(());
        self.task.abort();
    }
}

/// One client's association: its socket towards upstream and the client-to-upstream pipe.
/// Dropping it ends the association's relay and delivery tasks.
struct Association {
    to_upstream: Pipe,
    last_seen: Arc<AtomicU64>,
    _closed: oneshot::Sender<()>,
}

async fn run_listener(
    socket: Arc<UdpSocket>,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<()>,
) {
    let epoch = Instant::now();
    let mut assocs: HashMap<SocketAddr, Association> = HashMap::new();
    let (expired_tx, mut expired_rx) = mpsc::unbounded_channel::<SocketAddr>();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        tokio::select! {
            r = socket.recv_from(&mut buf) => {
                let Ok((n, client)) = r else {
                    // Unconnected UDP sockets rarely fail; an error is about one datagram.
                    continue;
                };
                let counters = shared.counters(Direction::ToUpstream);
                bump(&counters.packets_in, 1);
                bump(&counters.bytes_in, n);
                if !assocs.contains_key(&client) {
                    if assocs.len() >= MAX_ASSOCIATIONS {
                        bump(&counters.dropped_other, 1);
                        continue;
                    }
                    match open_association(
                        &socket, client, upstream, &shared, &shutdown, &expired_tx, epoch,
                    )
                    .await
                    {
                        Ok(a) => {
                            shared.associations.fetch_add(1, Ordering::Relaxed);
                            assocs.insert(client, a);
                        }
                        Err(_) => {
                            bump(&counters.dropped_other, 1);
                            continue;
                        }
                    }
                }
                let a = assocs.get_mut(&client).expect("inserted above");
                a.last_seen.store(millis_since(epoch), Ordering::Relaxed);
                a.to_upstream.offer(&buf[..n]);
            }
            Some(client) = expired_rx.recv() => {
                if let Some(a) = assocs.get(&client) {
                    let idle = millis_since(epoch)
                        .saturating_sub(a.last_seen.load(Ordering::Relaxed));
                    if idle >= ASSOCIATION_IDLE.as_millis() as u64 {
                        assocs.remove(&client);
                    }
                }
            }
            _ = shutdown.changed() => break,
        }
    }
}

fn millis_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64
}

/// The local address to relay from: loopback for a loopback upstream (tests never open a port
/// on other interfaces), else the unspecified address of the upstream's family.
fn relay_bind_addr(upstream: SocketAddr) -> SocketAddr {
    let ip = match (upstream.ip(), upstream.ip().is_loopback()) {
        (IpAddr::V4(_), true) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        (IpAddr::V6(_), true) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        (IpAddr::V4(_), false) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        (IpAddr::V6(_), false) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    SocketAddr::new(ip, 0)
}

async fn open_association(
    listen: &Arc<UdpSocket>,
    client: SocketAddr,
    upstream: SocketAddr,
    shared: &Arc<Shared>,
    shutdown: &watch::Receiver<()>,
    expired: &mpsc::UnboundedSender<SocketAddr>,
    epoch: Instant,
) -> io::Result<Association> {
    let relay = Arc::new(UdpSocket::bind(relay_bind_addr(upstream)).await?);
    relay.connect(upstream).await?;
    let n = shared.associations.load(Ordering::Relaxed);
    let seed = shared.shape().seed;
    let to_upstream = Pipe::new(
        Direction::ToUpstream,
        shared.clone(),
        Sink::Connected(relay.clone()),
        derive_seed(seed, n, Direction::ToUpstream),
        shutdown.clone(),
    );
    let to_client = Pipe::new(
        Direction::ToClient,
        shared.clone(),
        Sink::To(listen.clone(), client),
        derive_seed(seed, n, Direction::ToClient),
        shutdown.clone(),
    );
    let last_seen = Arc::new(AtomicU64::new(millis_since(epoch)));
    let (closed_tx, closed_rx) = oneshot::channel();
    tokio::spawn(run_relay(
        Relay {
            socket: relay,
            to_client,
            client,
            last_seen: last_seen.clone(),
            expired: expired.clone(),
            epoch,
        },
        closed_rx,
        shutdown.clone(),
    ));
    Ok(Association {
        to_upstream,
        last_seen,
        _closed: closed_tx,
    })
}

/// Reads replies from upstream for one association and feeds them to the client-bound pipe.
struct Relay {
    socket: Arc<UdpSocket>,
    to_client: Pipe,
    client: SocketAddr,
    last_seen: Arc<AtomicU64>,
    expired: mpsc::UnboundedSender<SocketAddr>,
    epoch: Instant,
}

async fn run_relay(
    relay: Relay,
    mut closed: oneshot::Receiver<()>,
    mut shutdown: watch::Receiver<()>,
) {
    let Relay {
        socket,
        mut to_client,
        client,
        last_seen,
        expired,
        epoch,
    } = relay;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let shared = to_client.shared.clone();
    loop {
        tokio::select! {
            r = socket.recv(&mut buf) => {
                // A connected UDP socket reports ICMP port-unreachable from an earlier send as
                // an error here: the upstream is not listening (yet). Keep going.
                let Ok(n) = r else { continue };
                let counters = shared.counters(Direction::ToClient);
                bump(&counters.packets_in, 1);
                bump(&counters.bytes_in, n);
                last_seen.store(millis_since(epoch), Ordering::Relaxed);
                to_client.offer(&buf[..n]);
            }
            _ = tokio::time::sleep(ASSOCIATION_IDLE) => {
                let idle = millis_since(epoch).saturating_sub(last_seen.load(Ordering::Relaxed));
                if idle >= ASSOCIATION_IDLE.as_millis() as u64 {
                    // The listener removes the association, which closes `closed`, unless the
                    // client spoke meanwhile.
                    let _ = expired.send(client);
                }
            }
            _ = &mut closed => return,
            _ = shutdown.changed() => return,
        }
    }
}

fn derive_seed(seed: u64, association: u64, dir: Direction) -> u64 {
    let mut r = SplitMix64(seed ^ association.wrapping_mul(0xA076_1D64_78BD_642F));
    r.next_u64() ^ (dir.index() as u64 + 1).wrapping_mul(0xE703_7ED1_A0B4_28DB)
}

/// SplitMix64: small, fast, seedable; statistically fine for drop decisions.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Where a pipe delivers.
enum Sink {
    /// The association's socket, connected to upstream.
    Connected(Arc<UdpSocket>),
    /// The listening socket, to one client.
    To(Arc<UdpSocket>, SocketAddr),
}

impl Sink {
    async fn send(&self, data: &[u8]) -> io::Result<usize> {
        match self {
            Self::Connected(s) => s.send(data).await,
            Self::To(s, addr) => s.send_to(data, addr).await,
        }
    }
}

/// What the shaping decided for one datagram.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Verdict {
    Partition,
    Loss,
    QueueFull,
    Deliver(Instant),
}

/// The deterministic part of one direction: loss draws, the bandwidth queue, delay and jitter.
#[derive(Debug)]
struct Shaper {
    rng: SplitMix64,
    /// When the bandwidth queue will have sent everything accepted so far.
    busy_until: Instant,
    /// Delivery time of the previous datagram (no reordering).
    last_delivery: Instant,
}

impl Shaper {
    fn new(seed: u64, now: Instant) -> Self {
        Self {
            rng: SplitMix64(seed),
            busy_until: now,
            last_delivery: now,
        }
    }

    fn decide(&mut self, shape: &LinkShape, imp: &Impairment, len: usize, now: Instant) -> Verdict {
        if shape.partitioned {
            return Verdict::Partition;
        }
        if imp.loss > 0.0 && self.rng.next_f64() < imp.loss {
            return Verdict::Loss;
        }
        let leave = match imp.bandwidth {
            None => now,
            Some(rate) => {
                let start = self.busy_until.max(now);
                let backlog = (start - now).as_secs_f64() * rate as f64;
                if backlog + len as f64 > imp.queue_bytes.max(len) as f64 {
                    return Verdict::QueueFull;
                }
                self.busy_until = start + Duration::from_secs_f64(len as f64 / rate as f64);
                self.busy_until
            }
        };
        let mut delay = imp.delay;
        if !imp.jitter.is_zero() {
            // Uniform in [delay - jitter, delay + jitter], floored at zero.
            let j = imp.jitter.as_secs_f64() * (2.0 * self.rng.next_f64() - 1.0);
            delay = Duration::from_secs_f64((delay.as_secs_f64() + j).max(0.0));
        }
        let at = (leave + delay).max(self.last_delivery);
        self.last_delivery = at;
        Verdict::Deliver(at)
    }
}

/// One direction of one association: shapes datagrams and hands them to a delivery task.
struct Pipe {
    dir: Direction,
    shared: Arc<Shared>,
    shaper: Shaper,
    queue: mpsc::UnboundedSender<(Instant, Vec<u8>)>,
    in_flight: Arc<AtomicUsize>,
}

impl Pipe {
    fn new(
        dir: Direction,
        shared: Arc<Shared>,
        sink: Sink,
        seed: u64,
        shutdown: watch::Receiver<()>,
    ) -> Self {
        let (queue, rx) = mpsc::unbounded_channel();
        let in_flight = Arc::new(AtomicUsize::new(0));
        tokio::spawn(deliver(
            dir,
            shared.clone(),
            sink,
            rx,
            in_flight.clone(),
            shutdown,
        ));
        Self {
            dir,
            shared,
            shaper: Shaper::new(seed, Instant::now()),
            queue,
            in_flight,
        }
    }

    fn offer(&mut self, data: &[u8]) {
        let shape = self.shared.shape();
        let counters = self.shared.counters(self.dir);
        let verdict = if self.in_flight.load(Ordering::Relaxed) + data.len() > MAX_IN_FLIGHT_BYTES {
            Verdict::QueueFull
        } else {
            self.shaper
                .decide(&shape, shape.get(self.dir), data.len(), Instant::now())
        };
        match verdict {
            Verdict::Partition => bump(&counters.dropped_partition, 1),
            Verdict::Loss => bump(&counters.dropped_loss, 1),
            Verdict::QueueFull => bump(&counters.dropped_queue, 1),
            Verdict::Deliver(at) => {
                self.in_flight.fetch_add(data.len(), Ordering::Relaxed);
                if self.queue.send((at, data.to_vec())).is_err() {
                    self.in_flight.fetch_sub(data.len(), Ordering::Relaxed);
                    bump(&counters.dropped_other, 1);
                }
            }
        }
    }
}

/// Sends each datagram at its delivery time, unless the link is partitioned by then.
async fn deliver(
    dir: Direction,
    shared: Arc<Shared>,
    sink: Sink,
    mut rx: mpsc::UnboundedReceiver<(Instant, Vec<u8>)>,
    in_flight: Arc<AtomicUsize>,
    mut shutdown: watch::Receiver<()>,
) {
    loop {
        let (at, data) = tokio::select! {
            m = rx.recv() => match m {
                Some(m) => m,
                None => return,
            },
            _ = shutdown.changed() => return,
        };
        tokio::select! {
            _ = tokio::time::sleep_until(at) => {}
            _ = shutdown.changed() => return,
        }
        in_flight.fetch_sub(data.len(), Ordering::Relaxed);
        let counters = shared.counters(dir);
        if shared.shape().partitioned {
            bump(&counters.dropped_partition, 1);
            continue;
        }
        match sink.send(&data).await {
            Ok(_) => {
                bump(&counters.packets_out, 1);
                bump(&counters.bytes_out, data.len());
            }
            Err(_) => bump(&counters.dropped_other, 1),
        }
    }
}

/// Parses a bandwidth: a number with an optional unit, returned in bytes per second.
///
/// Units (case-insensitive, optional `/s`): `bit`, `kbit`, `mbit`, `gbit` (decimal bits; also
/// spelt `bps`, `kbps`, `mbps`, `gbps`), `b`/`byte`, `kb`, `mb`, `gb` (decimal bytes), `kib`,
/// `mib`, `gib` (binary bytes). A bare number is bytes per second. `100Mbit/s` is 12 500 000.
pub fn parse_bandwidth(s: &str) -> Result<u64, String> {
    let mut t = s.trim().to_ascii_lowercase();
    if let Some(rest) = t.strip_suffix("/s") {
        t = rest.to_string();
    }
    if let Some(rest) = t.strip_suffix("bps") {
        t = format!("{rest}bit");
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("bandwidth '{s}': expected a number, then a unit like Mbit/s"))?;
    let bytes_per_unit = match unit.trim() {
        "" | "b" | "byte" | "bytes" => 1.0,
        "bit" | "bits" => 1.0 / 8.0,
        "kbit" => 1e3 / 8.0,
        "mbit" => 1e6 / 8.0,
        "gbit" => 1e9 / 8.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("bandwidth '{s}': unknown unit '{other}'")),
    };
    let bytes = value * bytes_per_unit;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("bandwidth '{s}' is out of range"));
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which of `n` datagrams are lost.
    fn losses(seed: u64, imp: &Impairment, n: usize) -> Vec<bool> {
        let now = Instant::now();
        let shape = LinkShape::symmetric(*imp);
        let mut s = Shaper::new(seed, now);
        (0..n)
            .map(|_| s.decide(&shape, imp, 100, now) == Verdict::Loss)
            .collect()
    }

    #[test]
    fn loss_is_seeded_and_close_to_the_fraction() {
        let imp = Impairment::default().loss(0.2);
        let a = losses(42, &imp, 10_000);
        let b = losses(42, &imp, 10_000);
        let c = losses(43, &imp, 10_000);
        assert!(a == b, "same seed, same drops");
        assert!(a != c, "another seed, other drops");
        let lost = a.iter().filter(|&&l| l).count() as f64 / 10_000.0;
        assert!((lost - 0.2).abs() < 0.02, "lost fraction {lost}");
    }

    #[test]
    fn bandwidth_queue_serialises_and_tail_drops() {
        // 1000 B/s, queue of 300 B, 100 B datagrams all at once: 3 fit (the first leaves at
        // 0.1 s, the third at 0.3 s), the rest are dropped.
        let imp = Impairment::default().bandwidth(1000).queue_bytes(300);
        let now = Instant::now();
        let shape = LinkShape::symmetric(imp);
        let mut s = Shaper::new(1, now);
        let v: Vec<_> = (0..5).map(|_| s.decide(&shape, &imp, 100, now)).collect();
        let ms = |d: Verdict| match d {
            Verdict::Deliver(at) => (at - now).as_millis(),
            other => panic!("{other:?}"),
        };
        assert_eq!(ms(v[0]), 100);
        assert_eq!(ms(v[1]), 200);
        assert_eq!(ms(v[2]), 300);
        assert_eq!(v[3], Verdict::QueueFull);
        assert_eq!(v[4], Verdict::QueueFull);
        // Later, the queue has drained.
        let later = now + Duration::from_secs(1);
        assert_eq!(
            s.decide(&shape, &imp, 100, later),
            Verdict::Deliver(later + Duration::from_millis(100))
        );
    }

    #[test]
    fn delay_and_jitter_never_reorder() {
        let imp = Impairment::default()
            .delay(Duration::from_millis(50))
            .jitter(Duration::from_millis(40));
        let now = Instant::now();
        let shape = LinkShape::symmetric(imp);
        let mut s = Shaper::new(9, now);
        let mut last = now;
        for i in 0..1000u64 {
            let t = now + Duration::from_micros(i * 100);
            let Verdict::Deliver(at) = s.decide(&shape, &imp, 10, t) else {
                panic!("no loss configured");
            };
            assert!(at >= last);
            assert!(at >= t + Duration::from_millis(10) && at <= t + Duration::from_millis(90));
            last = at;
        }
    }

    #[test]
    fn partition_wins_over_everything() {
        let imp = Impairment::default();
        let shape = LinkShape::symmetric(imp).partitioned(true);
        let now = Instant::now();
        let mut s = Shaper::new(0, now);
        assert_eq!(s.decide(&shape, &imp, 1, now), Verdict::Partition);
    }

    #[test]
    fn bandwidth_units() {
        assert_eq!(parse_bandwidth("100Mbit/s"), Ok(12_500_000));
        assert_eq!(parse_bandwidth("1gbit"), Ok(125_000_000));
        assert_eq!(parse_bandwidth("8kbit"), Ok(1000));
        assert_eq!(parse_bandwidth("2MB/s"), Ok(2_000_000));
        assert_eq!(parse_bandwidth("1MiB"), Ok(1 << 20));
        assert_eq!(parse_bandwidth("1.5mbps"), Ok(187_500));
        assert_eq!(parse_bandwidth("4096"), Ok(4096));
        assert!(parse_bandwidth("fast").is_err());
        assert!(parse_bandwidth("10 furlongs").is_err());
        assert!(parse_bandwidth("0").is_err());
    }

    #[test]
    fn loss_is_clamped() {
        assert_eq!(Impairment::default().loss(2.0).loss, 1.0);
        assert_eq!(Impairment::default().loss(-1.0).loss, 0.0);
        assert_eq!(Impairment::default().loss(f64::NAN).loss, 0.0);
    }
}
