//! The user-space switch: reads every host's TAP device, shapes each frame on the link from
//! its sender to its receiver, and writes it into the receiver's device when it is due.
//!
//! Each ordered pair of hosts is one direction of a link with its own [`Impairment`] (delay,
//! jitter, bandwidth with a queue bound, loss) and [`Shaper`] state — the same shaping core as
//! `tessera-linkemu`, applied to Ethernet frames instead of UDP datagrams, so QUIC, TCP (the HTTP
//! API) and multicast (mDNS) all cross it unchanged. A partition drops everything between two
//! hosts, including what is already in flight, until healed.
//!
//! Threads: one reader per host (blocking `poll` on its device and a stop pipe) and one
//! delivery thread holding a heap of packets ordered by delivery time. Timing is what decides
//! the switch's fidelity, so the switch's threads ask for real-time scheduling ([`realtime`]:
//! on a busy machine a woken thread otherwise waits for the running one's time slice, which
//! is milliseconds), the delivery thread sleeps with a 1 ns timer slack, and it finishes the
//! last stretch of each wait by yielding instead of sleeping (`SPIN`): the kernel's timer
//! otherwise wakes it tens of microseconds late, which on a 0.5 ms round trip is 10%.
//!
//! Even so a frame takes time to cross the switch (two device reads and writes, two thread
//! wake-ups): ~0.1–0.2 ms a round trip on the 2-core VM. The lab measures it when it starts
//! and sets it as the switch's [`compensation`](Switch::set_compensation), which every
//! delay is shortened by, so that a link asked for 0.5 ms measures 0.5 ms and not 0.5 ms plus
//! the switch. What the switch costs on its own is the floor: no round trip can be shorter.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_linkemu::{DirectionStats, Impairment, LinkShape, Shaper, Verdict};

use crate::error::{LabError, Result};
use crate::packet::{route, Route};

/// Most bytes waiting in the switch, all links together (bounds memory whatever the shapes).
pub const MAX_QUEUED_BYTES: usize = 64 << 20;
/// The last stretch of a wait spent yielding rather than sleeping.
const SPIN: Duration = Duration::from_micros(60);

/// One direction of one link.
struct Direction {
    imp: Impairment,
    partitioned: bool,
    shaper: Shaper,
    stats: DirectionStats,
}

/// A packet waiting for its delivery time.
struct Pending {
    at: Instant,
    seq: u64,
    from: usize,
    to: usize,
    data: Vec<u8>,
}

impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

struct Queue {
    heap: BinaryHeap<Reverse<Pending>>,
    bytes: usize,
    seq: u64,
}

struct Inner {
    hosts: usize,
    ports: Vec<File>,
    /// `from * hosts + to`.
    links: Mutex<Vec<Direction>>,
    queue: Mutex<Queue>,
    wake: Condvar,
    stop: AtomicBool,
    /// Nanoseconds taken off every one-way delay (the switch's own share of it).
    compensation_ns: AtomicU64,
}

/// A running switch; stopped (threads joined) when dropped.
pub struct Switch {
    inner: Arc<Inner>,
    stop_w: File,
    threads: Vec<JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Switch {
    /// Starts switching between `ports` (host `i`'s device is `ports[i]`, its MAC address
    /// [`mac`](crate::packet::mac)`(i)`), every link shaped by `each_way` until changed; loss
    /// and jitter draws are seeded from `seed`.
    pub fn start(ports: Vec<File>, each_way: Impairment, seed: u64) -> Result<Self> {
        let hosts = ports.len();
        let now = tokio::time::Instant::now();
        let links = (0..hosts * hosts)
            .map(|i| Direction {
                imp: each_way,
                partitioned: false,
                shaper: Shaper::new(
                    seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    now,
                ),
                stats: DirectionStats::default(),
            })
            .collect();
        let inner = Arc::new(Inner {
            hosts,
            ports,
            links: Mutex::new(links),
            queue: Mutex::new(Queue {
                heap: BinaryHeap::new(),
                bytes: 0,
                seq: 0,
            }),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            compensation_ns: AtomicU64::new(0),
        });
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two fds into the array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(LabError::io(
                "making the switch's stop pipe",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: both fds were just returned by pipe2 and are owned here.
        let (stop_r, stop_w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        let stop_r = Arc::new(stop_r);
        let mut threads = Vec::new();
        for port in 0..hosts {
            let (inner, stop_r) = (inner.clone(), stop_r.clone());
            threads.push(spawn(format!("tlab-rx{port}"), move || {
                read_port(&inner, port, &stop_r)
            })?);
        }
        let d = inner.clone();
        threads.push(spawn("tlab-tx".into(), move || deliver(&d))?);
        Ok(Self {
            inner,
            stop_w,
            threads,
        })
    }

    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.inner.hosts
    }

    fn with_direction<T>(&self, from: usize, to: usize, f: impl FnOnce(&mut Direction) -> T) -> T {
        let n = self.inner.hosts;
        assert!(from < n && to < n, "host index out of range");
        f(&mut lock(&self.inner.links)[from * n + to])
    }

    /// Shapes the direction `from → to` with `imp` (its partition switch is kept).
    pub fn set_one_way(&self, from: usize, to: usize, imp: Impairment) {
        self.with_direction(from, to, |d| d.imp = imp);
    }

    /// Shapes both directions between `a` and `b` with `imp`.
    pub fn set_link(&self, a: usize, b: usize, imp: Impairment) {
        self.set_one_way(a, b, imp);
        self.set_one_way(b, a, imp);
    }

    /// The impairment of `from → to`.
    pub fn one_way(&self, from: usize, to: usize) -> Impairment {
        self.with_direction(from, to, |d| d.imp)
    }

    /// Cuts (or, with `false`, heals) both directions between `a` and `b`; packets in flight
    /// between them are dropped when due.
    pub fn set_partitioned(&self, a: usize, b: usize, partitioned: bool) {
        self.with_direction(a, b, |d| d.partitioned = partitioned);
        self.with_direction(b, a, |d| d.partitioned = partitioned);
    }

    /// Cuts (or heals) every link of `host`.
    pub fn set_isolated(&self, host: usize, isolated: bool) {
        for other in (0..self.inner.hosts).filter(|&o| o != host) {
            self.set_partitioned(host, other, isolated);
        }
    }

    /// Shortens every link's one-way delay by `one_way` (never below zero), the switch's own
    /// share of a crossing, so that the delay measured end to end is the one asked for.
    pub fn set_compensation(&self, one_way: Duration) {
        let ns = u64::try_from(one_way.as_nanos()).unwrap_or(u64::MAX);
        self.inner.compensation_ns.store(ns, Ordering::Relaxed);
    }

    /// What [`set_compensation`](Self::set_compensation) set.
    pub fn compensation(&self) -> Duration {
        Duration::from_nanos(self.inner.compensation_ns.load(Ordering::Relaxed))
    }

    /// Counters of `from → to` since start.
    pub fn stats(&self, from: usize, to: usize) -> DirectionStats {
        self.with_direction(from, to, |d| d.stats)
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        let _ = self.stop_w.write_all(&[1]);
        {
            let _q = lock(&self.inner.queue);
            self.inner.wake.notify_all();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .map_err(|e| LabError::io("starting a switch thread", e))
}

/// Asks for real-time (FIFO) scheduling for the calling thread, so that it runs as soon as it
/// wakes however busy the machine is; whether it was granted (it needs root or
/// `CAP_SYS_NICE`). The kernel's real-time throttling still keeps 5% of each second for
/// everything else.
pub fn realtime() -> bool {
    // Zeroed, then the priority set: musl's `sched_param` has sporadic-server fields
    // glibc's lacks, and zero is their "unused" value.
    // SAFETY: `sched_param` is plain integers, for which all-zero bytes are valid.
    let mut param: libc::sched_param = unsafe { std::mem::zeroed() };
    param.sched_priority = 10;
    // SAFETY: changes only the calling thread's scheduling policy.
    unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_FIFO, &param) == 0 }
}

/// Reads host `port`'s packets until stopped, shaping and queueing each copy.
fn read_port(inner: &Inner, port: usize, stop: &OwnedFd) {
    realtime();
    let mut buf = vec![0u8; 65_536];
    let mut tun = &inner.ports[port];
    loop {
        let mut fds = [
            libc::pollfd {
                fd: tun.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: fds is a valid array of two pollfd.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if inner.stop.load(Ordering::SeqCst) || fds[1].revents != 0 {
            return;
        }
        if r < 0 || fds[0].revents & libc::POLLIN == 0 {
            if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                return;
            }
            continue;
        }
        let len = match tun.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        let packet = &buf[..len];
        match route(packet, port, inner.hosts) {
            Route::Drop => {}
            Route::One(to) => offer(inner, port, to, packet),
            Route::AllButSender => {
                for to in (0..inner.hosts).filter(|&t| t != port) {
                    offer(inner, port, to, packet);
                }
            }
        }
    }
}

/// Shapes one copy of `packet` on `from → to` and queues it for delivery.
fn offer(inner: &Inner, from: usize, to: usize, packet: &[u8]) {
    let now = Instant::now();
    let verdict = {
        let mut links = lock(&inner.links);
        let d = &mut links[from * inner.hosts + to];
        d.stats.packets_in += 1;
        d.stats.bytes_in += packet.len() as u64;
        let imp = compensated(
            d.imp,
            Duration::from_nanos(inner.compensation_ns.load(Ordering::Relaxed)),
        );
        let shape = LinkShape::symmetric(imp).partitioned(d.partitioned);
        let v = d.shaper.decide(
            &shape,
            &imp,
            packet.len(),
            tokio::time::Instant::from_std(now),
        );
        match v {
            Verdict::Partition => d.stats.dropped_partition += 1,
            Verdict::Loss => d.stats.dropped_loss += 1,
            Verdict::QueueFull => d.stats.dropped_queue += 1,
            Verdict::Deliver(_) => {}
        }
        v
    };
    let Verdict::Deliver(at) = verdict else {
        return;
    };
    let at = at.into_std();
    let mut q = lock(&inner.queue);
    if q.bytes + packet.len() > MAX_QUEUED_BYTES {
        drop(q);
        lock(&inner.links)[from * inner.hosts + to]
            .stats
            .dropped_queue += 1;
        return;
    }
    let earliest = q.heap.peek().is_none_or(|Reverse(p)| at < p.at);
    q.seq += 1;
    let seq = q.seq;
    q.bytes += packet.len();
    q.heap.push(Reverse(Pending {
        at,
        seq,
        from,
        to,
        data: packet.to_vec(),
    }));
    drop(q);
    if earliest {
        inner.wake.notify_one();
    }
}

/// `imp` with its delay shortened by the switch's own one-way cost `by` (jitter is kept: it is
/// drawn around the shortened delay, and never below zero).
fn compensated(imp: Impairment, by: Duration) -> Impairment {
    imp.delay(imp.delay.saturating_sub(by))
}

/// Writes each queued packet into its receiver's device when it is due, unless its link
/// has been partitioned since.
fn deliver(inner: &Inner) {
    realtime();
    // SAFETY: prctl(PR_SET_TIMERSLACK) changes only this thread's timer slack (1 ns: timed
    // waits end when asked, not up to 50 µs later).
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
    let mut due = Vec::new();
    loop {
        {
            let mut q = lock(&inner.queue);
            loop {
                if inner.stop.load(Ordering::SeqCst) {
                    return;
                }
                let now = Instant::now();
                match q.heap.peek() {
                    None => q = inner.wake.wait(q).unwrap_or_else(|p| p.into_inner()),
                    Some(Reverse(p)) if p.at <= now => break,
                    Some(Reverse(p)) => {
                        let left = p.at - now;
                        if left > SPIN {
                            q = inner
                                .wake
                                .wait_timeout(q, left - SPIN)
                                .unwrap_or_else(|p| p.into_inner())
                                .0;
                        } else {
                            drop(q);
                            std::thread::yield_now();
                            q = lock(&inner.queue);
                        }
                    }
                }
            }
            let now = Instant::now();
            while q.heap.peek().is_some_and(|Reverse(p)| p.at <= now) {
                let Reverse(p) = q.heap.pop().expect("peeked");
                q.bytes -= p.data.len();
                due.push(p);
            }
        }
        for p in due.drain(..) {
            let partitioned = lock(&inner.links)[p.from * inner.hosts + p.to].partitioned;
            let ok = !partitioned && (&inner.ports[p.to]).write(&p.data).is_ok();
            let mut links = lock(&inner.links);
            let s = &mut links[p.from * inner.hosts + p.to].stats;
            if partitioned {
                s.dropped_partition += 1;
            } else if ok {
                s.packets_out += 1;
                s.bytes_out += p.data.len() as u64;
            } else {
                s.dropped_other += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compensation_shortens_the_delay_but_never_below_zero() {
        let imp = Impairment::default()
            .delay(Duration::from_micros(250))
            .jitter(Duration::from_micros(50));
        let c = compensated(imp, Duration::from_micros(80));
        assert_eq!(c.delay, Duration::from_micros(170));
        assert_eq!(c.jitter, imp.jitter);
        assert_eq!(
            compensated(imp, Duration::from_millis(1)).delay,
            Duration::ZERO
        );
        assert_eq!(compensated(imp, Duration::ZERO), imp);
    }
}
