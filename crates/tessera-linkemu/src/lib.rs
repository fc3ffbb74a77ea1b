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

#![forbid(unsafe_code)]

use std::time::Duration;

mod emulator;
mod handle;
mod pipe;
mod shape;
mod shaper;
mod stats;

pub use emulator::LinkEmulator;
pub use handle::LinkHandle;
pub use shape::{parse_bandwidth, Direction, Impairment, LinkShape};
/// The pure shaping core, for other transports (the lab's switch shapes IP packets with it).
pub use shaper::{Shaper, Verdict};
pub use stats::{DirectionStats, LinkStats};

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
