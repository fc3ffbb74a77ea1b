//! The socket relay: [`LinkEmulator`] binds the listening socket and runs the listener task.
//! For each client source address it opens one association: its own UDP socket connected to
//! upstream (bound to loopback for a loopback upstream), so the server sees one distinct peer
//! per client, and a relay task that sends replies back to that client from the listening
//! address. At most [`MAX_ASSOCIATIONS`] are open at once; one idle for [`ASSOCIATION_IDLE`] is
//! closed.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use tokio::net::UdpSocket;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::handle::{LinkHandle, Shared};
use crate::pipe::{Pipe, Sink};
use crate::shape::{Direction, LinkShape};
use crate::shaper::derive_seed;
use crate::stats::bump;
use crate::{ASSOCIATION_IDLE, MAX_ASSOCIATIONS, MAX_DATAGRAM};

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
