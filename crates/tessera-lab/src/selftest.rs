//! `tessera lab selftest`: does the switch impose what it is asked to? Two hosts, one link,
//! and for each figure a measurement with real sockets made inside the hosts:
//!
//! - **switch floor**: the switch's own round trip, measured when the lab starts and taken
//!   off every delay (see [`Lab::switch_floor`]); no round trip can be shorter;
//! - **round trip** at 0.5, 2, 20 and 80 ms (one-way delay half of it each way): the median
//!   of sequential UDP ping-pongs; within 10% + 100 µs of the requested;
//! - **bandwidth** at 10, 100 and 1000 Mbit/s: TCP goodput from one host to the other over
//!   the steady part of a few seconds' transfer (slow start left out); within 10%;
//! - **loss** at 1% and 5%: paced one-way UDP datagrams, the share that did not arrive; within
//!   20% of the requested rate;
//! - **partition**: UDP both ways through a 10 ms link; nothing may arrive from the moment the
//!   link is cut (packets already in flight included) until it is healed, and traffic resumes
//!   after.
//! - **disks** (see [`crate::disk`]): which disk holds the lab's data; what it reads uncapped;
//!   for each profile, a host capped at its rates, measured with `O_DIRECT` reads from inside
//!   the host's cgroup (1 MiB reads 4 at a time for bandwidth, 4 KiB reads 8 at a time for
//!   IOPS), within 10% of the requested; a rate this disk cannot reach uncapped is listed as
//!   not emulable (`n/a`), not failed. And whether a host's page cache is held to its memory
//!   cap: a file within the cap read twice comes from the cache the second time, one three
//!   times the cap comes from the disk again.
//!
//! It measures wall-clock behaviour, so it is a command and not a test. The probe threads ask
//! for real-time scheduling like the switch's own (when allowed), so that on a busy machine
//! the figures are the switch's and not the scheduler's.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_linkemu::Impairment;

use crate::error::{LabError, Result};
use crate::lab::{HostSpec, Lab, LabSpec};
use crate::switch::realtime;

/// One line of the table.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Check {
    /// `round trip`, `bandwidth`, `loss`, `partition`.
    pub what: String,
    pub requested: String,
    pub measured: String,
    pub tolerance: String,
    pub ok: bool,
    /// Not measurable on this machine (a disk faster than its own): neither ok nor out.
    #[serde(default)]
    pub na: bool,
}

/// What to measure (all of it by default).
#[derive(Debug, Clone)]
pub struct Options {
    pub rtts_ms: Vec<f64>,
    pub bandwidths_mbit: Vec<f64>,
    pub losses: Vec<f64>,
    pub partition: bool,
    /// Seconds of transfer per bandwidth.
    pub transfer_s: f64,
    /// Measure the disk profiles and the page cache, on the disk holding this directory.
    pub disk_dir: Option<std::path::PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            rtts_ms: vec![0.5, 2.0, 20.0, 80.0],
            bandwidths_mbit: vec![10.0, 100.0, 1000.0],
            losses: vec![0.01, 0.05],
            partition: true,
            transfer_s: 4.0,
            disk_dir: Some(std::env::temp_dir()),
        }
    }
}

impl Options {
    /// The disk checks alone (no switch).
    pub fn disk_only(self) -> Self {
        Self {
            rtts_ms: Vec::new(),
            bandwidths_mbit: Vec::new(),
            losses: Vec::new(),
            partition: false,
            ..self
        }
    }

    fn network(&self) -> bool {
        !self.rtts_ms.is_empty()
            || !self.bandwidths_mbit.is_empty()
            || !self.losses.is_empty()
            || self.partition
    }
}

fn io(what: &str) -> impl Fn(std::io::Error) -> LabError + '_ {
    move |e| LabError::io(what.to_string(), e)
}

/// Runs the checks on a fresh two-host lab; `each` is called with every line as it is measured.
pub fn run(opts: &Options, mut each: impl FnMut(&Check)) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    let mut push = |c: Check| {
        each(&c);
        out.push(c);
    };
    if opts.network() {
        network(opts, &mut push)?;
    }
    if let Some(dir) = &opts.disk_dir {
        crate::disk::selftest::run(dir, &mut push)?;
    }
    Ok(out)
}

fn network(opts: &Options, push: &mut impl FnMut(Check)) -> Result<()> {
    let lab = Lab::start(&LabSpec::new(vec![HostSpec::new("a"), HostSpec::new("b")]))?;
    // The switch's own cost: the round trip through it with no delay asked for, measured
    // when the lab started and taken off every delay since.
    let floor = lab.switch_floor().unwrap_or_default().as_secs_f64();
    let base = rtt(&lab, 400)?;
    push(Check {
        what: "switch floor".into(),
        requested: "0 ms".into(),
        measured: format!(
            "{:.3} ms at start; now {:.3} (p90 {:.3})",
            floor * 1e3,
            base.0 * 1e3,
            base.1 * 1e3
        ),
        tolerance: "the shortest round trip".into(),
        ok: true,
        na: false,
    });
    for &ms in &opts.rtts_ms {
        let one_way = Duration::from_secs_f64(ms / 2e3);
        lab.switch()
            .set_link(0, 1, Impairment::default().delay(one_way));
        let n = ((2000.0 / ms) as usize).clamp(25, 400);
        let (median, p90) = rtt(&lab, n)?;
        let tol = ms * 0.1 + 0.1;
        push(Check {
            what: "round trip".into(),
            requested: format!("{ms} ms"),
            measured: format!(
                "{:.3} ms (median of {n}; p90 {:.3})",
                median * 1e3,
                p90 * 1e3
            ),
            tolerance: format!("±{tol:.3} ms"),
            ok: (median * 1e3 - ms).abs() <= tol,
            na: false,
        });
    }
    for &mbit in &opts.bandwidths_mbit {
        let rate = (mbit * 1e6 / 8.0) as u64;
        // A queue of 50 ms at the rate (at least 256 KiB, a router's) and a 0.1 ms delay:
        // TCP keeps it from running dry.
        let imp = Impairment::default()
            .delay(Duration::from_micros(100))
            .bandwidth(rate)
            .queue_bytes(((rate / 20) as usize).max(256 << 10));
        lab.switch().set_link(0, 1, imp);
        let got = goodput(&lab, Duration::from_secs_f64(opts.transfer_s))? * 8.0 / 1e6;
        push(Check {
            what: "bandwidth".into(),
            requested: format!("{mbit} Mbit/s"),
            measured: format!("{got:.1} Mbit/s (TCP goodput)"),
            tolerance: "±10%".into(),
            ok: (got - mbit).abs() <= 0.1 * mbit,
            na: false,
        });
    }
    for &p in &opts.losses {
        lab.switch().set_link(0, 1, Impairment::default().loss(p));
        let n = ((200.0 / p) as usize).clamp(2000, 40_000);
        let lost = loss(&lab, n)?;
        push(Check {
            what: "loss".into(),
            requested: format!("{:.1}%", p * 100.0),
            measured: format!("{:.2}% of {n} datagrams", lost * 100.0),
            tolerance: "±20% of the rate".into(),
            ok: (lost - p).abs() <= 0.2 * p,
            na: false,
        });
    }
    if opts.partition {
        lab.switch()
            .set_link(0, 1, Impairment::default().delay(Duration::from_millis(10)));
        let p = partition(&lab)?;
        push(Check {
            what: "partition".into(),
            requested: "cut 500 ms, then heal".into(),
            measured: format!(
                "before {} received, while cut {}, after healing {}",
                p.before, p.during, p.after
            ),
            tolerance: "none while cut".into(),
            ok: p.before > 0 && p.during == 0 && p.after > 0,
            na: false,
        });
    }
    Ok(())
}

/// Median and 90th percentile of `n` sequential UDP round trips from host 0 to host 1, s.
fn rtt(lab: &Lab, n: usize) -> Result<(f64, f64)> {
    rtt_between(lab, 0, 1, n)
}

/// Median and 90th percentile of `n` sequential UDP round trips from host `from` to host
/// `to`, s.
pub(crate) fn rtt_between(lab: &Lab, from: usize, to: usize, n: usize) -> Result<(f64, f64)> {
    let server_addr = SocketAddr::new(lab.addr(to).into(), 7001);
    let server = lab.run_in(to, || UdpSocket::bind(server_addr))?;
    let client = lab.run_in(from, || {
        UdpSocket::bind(SocketAddr::new(lab.addr(from).into(), 0))
    })?;
    echo_rtt(server, client, n)
}

/// [`rtt_between`] two sockets of this machine's loopback.
pub(crate) fn loopback_rtt(n: usize) -> Result<(f64, f64)> {
    let server = UdpSocket::bind("127.0.0.1:0").map_err(io("binding a socket"))?;
    let client = UdpSocket::bind("127.0.0.1:0").map_err(io("binding a socket"))?;
    echo_rtt(server, client, n)
}

/// `n` round trips from `client` to an echo on `server`: median and 90th percentile, s.
fn echo_rtt(server: UdpSocket, client: UdpSocket, n: usize) -> Result<(f64, f64)> {
    let server_addr = server.local_addr().map_err(io("socket address"))?;
    server
        .set_read_timeout(Some(Duration::from_millis(100)))
        .map_err(io("socket timeout"))?;
    client
        .set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(io("socket timeout"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let echo = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            realtime();
            let mut buf = [0u8; 2048];
            while !stop.load(Ordering::Relaxed) {
                if let Ok((len, from)) = server.recv_from(&mut buf) {
                    let _ = server.send_to(&buf[..len], from);
                }
            }
        })
    };
    let rt = std::thread::scope(|s| s.spawn(|| ping(&client, server_addr, n)).join());
    stop.store(true, Ordering::Relaxed);
    let _ = echo.join();
    let mut samples = rt.map_err(|_| LabError::ThreadPanicked("ping"))??;
    samples.sort_by(f64::total_cmp);
    Ok((samples[samples.len() / 2], samples[samples.len() * 9 / 10]))
}

/// `n` sequential round trips (after 5 unmeasured ones), s.
fn ping(client: &UdpSocket, server_addr: SocketAddr, n: usize) -> Result<Vec<f64>> {
    realtime();
    let mut samples = Vec::with_capacity(n);
    let mut buf = [0u8; 2048];
    for i in 0..n + 5 {
        let msg = (i as u64).to_le_bytes();
        let t = Instant::now();
        client
            .send_to(&msg, server_addr)
            .map_err(io("sending a ping"))?;
        loop {
            let (len, _) = client
                .recv_from(&mut buf)
                .map_err(io("waiting for a pong"))?;
            if buf[..len] == msg {
                break;
            }
        }
        if i >= 5 {
            samples.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(samples)
}

/// TCP goodput from host 0 to host 1 over the steady part of a `span` transfer, bytes/s.
fn goodput(lab: &Lab, span: Duration) -> Result<f64> {
    let addr = SocketAddr::new(lab.addr(1).into(), 7002);
    let listener = lab.run_in(1, || TcpListener::bind(addr))?;
    let receiver = std::thread::spawn(move || -> std::io::Result<Vec<(Instant, u64)>> {
        realtime();
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        let mut marks = Vec::new();
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                return Ok(marks);
            }
            total += n as u64;
            marks.push((Instant::now(), total));
        }
    });
    let s: TcpStream = lab.connect(0, addr)?;
    std::thread::scope(|sc| {
        sc.spawn(move || {
            realtime();
            let mut s = s;
            let chunk = vec![0x5au8; 1 << 16];
            let end = Instant::now() + span;
            while Instant::now() < end {
                s.write_all(&chunk)?;
            }
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the sender panicked")))
    })
    .map_err(io("sending"))?;
    let marks = receiver
        .join()
        .map_err(|_| LabError::ThreadPanicked("receiver"))?
        .map_err(io("receiving"))?;
    let (Some(first), Some(last)) = (marks.first(), marks.last()) else {
        return Err(LabError::NothingMeasured("no datagram arrived".into()));
    };
    // Leave out the first quarter (slow start, the queue filling).
    let from_t = first.0 + (last.0 - first.0) / 4;
    let from = marks.iter().find(|m| m.0 >= from_t).unwrap_or(first);
    let secs = (last.0 - from.0).as_secs_f64();
    if secs <= 0.0 {
        return Err(LabError::NothingMeasured(
            "the transfer was too short to time".into(),
        ));
    }
    Ok((last.1 - from.1) as f64 / secs)
}

/// Share of `n` paced one-way datagrams from host 0 to host 1 that did not arrive.
fn loss(lab: &Lab, n: usize) -> Result<f64> {
    let addr = SocketAddr::new(lab.addr(1).into(), 7003);
    let rx = lab.run_in(1, || UdpSocket::bind(addr))?;
    rx.set_read_timeout(Some(Duration::from_millis(500)))
        .map_err(io("socket timeout"))?;
    let tx = lab.run_in(0, || {
        UdpSocket::bind(SocketAddr::new(lab.addr(0).into(), 0))
    })?;
    let counter = std::thread::spawn(move || {
        realtime();
        let mut seen = 0usize;
        let mut buf = [0u8; 64];
        while let Ok(len) = rx.recv(&mut buf) {
            if len == 8 {
                seen += 1;
            }
        }
        seen
    });
    for i in 0..n as u64 {
        tx.send_to(&i.to_le_bytes(), addr).map_err(io("sending"))?;
        // ~10k datagrams/s: far below anything the receiver could drop on its own.
        if i % 10 == 9 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let seen = counter
        .join()
        .map_err(|_| LabError::ThreadPanicked("receiver"))?;
    Ok(1.0 - seen as f64 / n as f64)
}

struct PartitionCounts {
    before: usize,
    during: usize,
    after: usize,
}

/// UDP both ways at ~1 datagram/ms; cut for 500 ms; what arrived before, during and after.
fn partition(lab: &Lab) -> Result<PartitionCounts> {
    let arrivals: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for (from, to) in [(0usize, 1usize), (1, 0)] {
        let dst = SocketAddr::new(lab.addr(to).into(), 7004);
        let rx = lab.run_in(to, || UdpSocket::bind(dst))?;
        rx.set_read_timeout(Some(Duration::from_millis(50)))
            .map_err(io("socket timeout"))?;
        let tx = lab.run_in(from, || {
            UdpSocket::bind(SocketAddr::new(lab.addr(from).into(), 0))
        })?;
        let (a, s) = (arrivals.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            // Stamped as soon as it arrives, or a datagram the switch wrote before the cut
            // counts as one that crossed it (seen once at load 18).
            realtime();
            let mut buf = [0u8; 64];
            while !s.load(Ordering::Relaxed) {
                if rx.recv(&mut buf).is_ok() {
                    a.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(Instant::now());
                }
            }
        }));
        let s = stop.clone();
        threads.push(std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let _ = tx.send_to(b"tick", dst);
                std::thread::sleep(Duration::from_millis(1));
            }
        }));
    }
    std::thread::sleep(Duration::from_millis(300));
    let cut = Instant::now();
    lab.switch().set_partitioned(0, 1, true);
    std::thread::sleep(Duration::from_millis(500));
    let heal = Instant::now();
    lab.switch().set_partitioned(0, 1, false);
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let a = arrivals.lock().unwrap_or_else(|p| p.into_inner());
    // A datagram the switch wrote just before the cut may be read a moment after it.
    let grace = Duration::from_millis(2);
    Ok(PartitionCounts {
        before: a.iter().filter(|&&t| t < cut).count(),
        during: a.iter().filter(|&&t| t > cut + grace && t < heal).count(),
        after: a.iter().filter(|&&t| t > heal).count(),
    })
}

/// The checks as a table.
pub fn table(checks: &[Check]) -> String {
    let mut s = format!(
        "{:<22} {:<22} {:<48} {:<20} {}\n",
        "check", "requested", "measured", "tolerance", "result"
    );
    // Wide cells (a disk's path) push the rest of their line along rather than cut it.
    for c in checks {
        s.push_str(&format!(
            "{:<22} {:<22} {:<48} {:<20} {}\n",
            c.what,
            c.requested,
            c.measured,
            c.tolerance,
            if c.na {
                "n/a"
            } else if c.ok {
                "ok"
            } else {
                "OUT"
            }
        ));
    }
    s
}
