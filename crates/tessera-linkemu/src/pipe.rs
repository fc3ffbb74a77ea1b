//! One direction of one association at run time: a [`Pipe`] shapes each datagram as it
//! arrives ([`Shaper`]) and queues it with its delivery time; a delivery task sleeps until then
//! and sends it to its [`Sink`], unless the link is partitioned by then. The bytes waiting in
//! one pipe are bounded by [`MAX_IN_FLIGHT_BYTES`], whatever the shape.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::handle::Shared;
use crate::shape::Direction;
use crate::shaper::{Shaper, Verdict};
use crate::stats::bump;
use crate::MAX_IN_FLIGHT_BYTES;

/// Where a pipe delivers.
pub(crate) enum Sink {
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

/// One direction of one association: shapes datagrams and hands them to a delivery task.
pub(crate) struct Pipe {
    dir: Direction,
    pub(crate) shared: Arc<Shared>,
    shaper: Shaper,
    queue: mpsc::UnboundedSender<(Instant, Vec<u8>)>,
    in_flight: Arc<AtomicUsize>,
}

impl Pipe {
    pub(crate) fn new(
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

    pub(crate) fn offer(&mut self, data: &[u8]) {
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
