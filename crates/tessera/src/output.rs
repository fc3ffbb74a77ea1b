//! Log output that never stops the process.
//!
//! A long-running command's log lines are written by one thread per stream (stdout, stderr),
//! fed through a bounded queue. When nobody reads the stream (a supervisor that piped stdout
//! and never drains it), the writer thread waits on the full pipe, the queue fills, and further
//! lines are dropped and counted instead of blocking the thread that logged: without this a
//! full pipe stalled every thread that logged, the signal handler's task among them, and
//! `tessera up` ignored SIGTERM. A notice says how many lines were lost once the stream moves
//! again. [`drain`] waits (bounded) for queued lines before the process exits.

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Lines that may wait for a stream before new ones are dropped.
pub const QUEUE_LINES: usize = 4096;

/// Which standard stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// One stream's queue and its counts.
struct Queue {
    tx: SyncSender<Vec<u8>>,
    /// Queued and not yet written.
    pending: AtomicUsize,
    /// Dropped since the last notice.
    dropped: AtomicU64,
}

static STDOUT: OnceLock<Queue> = OnceLock::new();
static STDERR: OnceLock<Queue> = OnceLock::new();

fn queue(stream: Stream) -> &'static Queue {
    let cell = match stream {
        Stream::Stdout => &STDOUT,
        Stream::Stderr => &STDERR,
    };
    cell.get_or_init(|| {
        let (tx, rx) = sync_channel::<Vec<u8>>(QUEUE_LINES);
        // Without a thread the receiver is gone and every line is dropped, never written
        // from the thread that logged.
        let _ = std::thread::Builder::new()
            .name(format!("{stream:?} writer").to_lowercase())
            .spawn(move || {
                for bytes in rx {
                    let q = queue(stream);
                    let lost = q.dropped.swap(0, Ordering::Relaxed);
                    if lost > 0 {
                        let notice = format!(
                            "({lost} log lines were dropped: this output was not being read)\n"
                        );
                        write_raw(stream, notice.as_bytes());
                    }
                    write_raw(stream, &bytes);
                    q.pending.fetch_sub(1, Ordering::Release);
                }
            });
        Queue {
            tx,
            pending: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
        }
    })
}

fn write_raw(stream: Stream, bytes: &[u8]) {
    // Errors (a closed pipe) lose the line; nothing else can be done with it.
    let _ = match stream {
        Stream::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(bytes).and_then(|()| out.flush())
        }
        Stream::Stderr => std::io::stderr().lock().write_all(bytes),
    };
}

/// Queues `bytes` (whole lines) for `stream`, or drops them if the queue is full.
pub fn send(stream: Stream, bytes: Vec<u8>) {
    if bytes.is_empty() {
        return;
    }
    let q = queue(stream);
    q.pending.fetch_add(1, Ordering::Acquire);
    match q.tx.try_send(bytes) {
        Ok(()) => {}
        Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
            q.pending.fetch_sub(1, Ordering::Release);
            q.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Queues one line (a newline is added) for `stream`.
pub fn line(stream: Stream, text: &str) {
    send(stream, format!("{text}\n").into_bytes());
}

/// Waits until every queued line is written, or `timeout` has passed.
pub fn drain(timeout: Duration) {
    let deadline = Instant::now() + timeout;
    for cell in [&STDOUT, &STDERR] {
        let Some(q) = cell.get() else { continue };
        while q.pending.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// An [`std::io::Write`] that collects one log event and queues it when dropped (tracing's
/// formatter makes one per event).
pub struct QueuedWriter {
    stream: Stream,
    buf: Vec<u8>,
}

impl QueuedWriter {
    pub fn stdout() -> Self {
        Self {
            stream: Stream::Stdout,
            buf: Vec::new(),
        }
    }

    pub fn stderr() -> Self {
        Self {
            stream: Stream::Stderr,
            buf: Vec::new(),
        }
    }
}

impl Write for QueuedWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        send(self.stream, std::mem::take(&mut self.buf));
        Ok(())
    }
}

impl Drop for QueuedWriter {
    fn drop(&mut self) {
        send(self.stream, std::mem::take(&mut self.buf));
    }
}

/// `println!` through the stdout queue: for what long-running commands print.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::output::line($crate::output::Stream::Stdout, &format!($($arg)*))
    };
}

/// `eprintln!` through the stderr queue.
macro_rules! say_err {
    ($($arg:tt)*) => {
        $crate::output::line($crate::output::Stream::Stderr, &format!($($arg)*))
    };
}
