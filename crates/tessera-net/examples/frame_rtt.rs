//! What a frame's round trip costs over QUIC on loopback, by payload size, with and without the
//! thread hand-offs a stage ring adds: two endpoints on runtimes of their own (as two node
//! processes have), one echoing every frame.
//!
//! - `task`: the frame is written and read by a task on the client's runtime.
//! - `thread`: as a node's stage thread does it, a plain thread queues the frame for a writer
//!   task (a bounded channel) and is handed the echo by a reader task (an unbounded one), so a
//!   round trip adds two wakes of a thread and two of a task.
//!
//! `cargo run --release -p tessera-net --example frame_rtt -- [--gap-ms MS]`: `--gap-ms` waits
//! between round trips (a ring's stage waits for the others' compute), so the runtimes' threads
//! park, as they do in a ring; without it they stay warm.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_net::{Accepted, AllowList, Connection, Endpoint, NodeIdentity};
use tokio::sync::mpsc;

const SIZES: [usize; 4] = [8, 1024, 4096, 16384];
const ROUNDS: usize = 300;
const WARM_UP: usize = 20;
const KIND: u16 = 5;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// An echo server on its own runtime; its address and key.
fn echo_server(rt: &tokio::runtime::Runtime, allow: Arc<AllowList>) -> (Endpoint, NodeIdentity) {
    let id = NodeIdentity::generate().expect("an identity");
    let ep = rt.block_on(async {
        Endpoint::bind("127.0.0.1:0".parse().unwrap(), &id, allow).expect("a socket")
    });
    let server = ep.clone();
    rt.spawn(async move {
        while let Some(incoming) = server.accept().await {
            tokio::spawn(async move {
                let Ok(Accepted::Peer(conn)) = incoming.handshake().await else {
                    return;
                };
                while let Ok(Some(mut s)) = conn.accept_stream().await {
                    tokio::spawn(async move {
                        while let Ok(Some(f)) = s.reader.read_frame().await {
                            if s.writer.send(&f).await.is_err() {
                                break;
                            }
                        }
                    });
                }
            });
        }
    });
    (ep, id)
}

/// Round trips written and read on the runtime.
async fn by_task(conn: &Connection, size: usize, gap: Duration) -> Vec<Duration> {
    let mut s = conn.open_stream(1).await.expect("a stream");
    let payload = vec![7u8; size];
    let mut out = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS + WARM_UP {
        let t = Instant::now();
        s.writer.write_frame(KIND, &payload).await.expect("written");
        let f = s.reader.recv().await.expect("echoed");
        out.push(t.elapsed());
        assert_eq!(f.payload.len(), size);
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
    }
    out.split_off(WARM_UP)
}

/// Round trips from a plain thread through a writer task and a reader task.
fn by_thread(
    rt: &tokio::runtime::Runtime,
    conn: &Connection,
    size: usize,
    gap: Duration,
) -> Vec<Duration> {
    let s = rt.block_on(conn.open_stream(1)).expect("a stream");
    let (mut reader, mut writer) = (s.reader, s.writer);
    let (to_writer, mut queued) = mpsc::channel::<Vec<u8>>(4);
    let (to_thread, mut echoed) = mpsc::unbounded_channel::<usize>();
    rt.spawn(async move {
        while let Some(p) = queued.recv().await {
            if writer.write_frame(KIND, &p).await.is_err() {
                break;
            }
        }
    });
    rt.spawn(async move {
        while let Ok(Some(f)) = reader.read_frame().await {
            if to_thread.send(f.payload.len()).is_err() {
                break;
            }
        }
    });
    std::thread::spawn(move || {
        let mut out = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS + WARM_UP {
            let t = Instant::now();
            to_writer.blocking_send(vec![7u8; size]).expect("queued");
            let n = echoed.blocking_recv().expect("echoed");
            out.push(t.elapsed());
            assert_eq!(n, size);
            if !gap.is_zero() {
                std::thread::sleep(gap);
            }
        }
        out.split_off(WARM_UP)
    })
    .join()
    .expect("the thread")
}

fn report(how: &str, size: usize, mut v: Vec<Duration>) {
    v.sort_unstable();
    let at = |q: usize| v[(v.len() * q / 100).min(v.len() - 1)].as_micros();
    println!(
        "{how:<7} {size:>6} B   p10 {:>5} µs   median {:>5} µs   p90 {:>5} µs",
        at(10),
        at(50),
        at(90)
    );
}

fn main() {
    let gap_ms: f64 = match std::env::args().skip(1).collect::<Vec<_>>().as_slice() {
        [] => 0.0,
        [flag, ms] if flag == "--gap-ms" => ms.parse().expect("--gap-ms takes milliseconds"),
        _ => {
            eprintln!("usage: frame_rtt [--gap-ms MS]");
            std::process::exit(2);
        }
    };
    let gap = Duration::from_secs_f64(gap_ms / 1e3);
    let server_rt = runtime();
    let allow = Arc::new(AllowList::new());
    let (server, server_id) = echo_server(&server_rt, allow.clone());
    let addr = server.local_addr().expect("an address");

    let rt = runtime();
    let id = NodeIdentity::generate().expect("an identity");
    allow.insert(id.public_key());
    let conn = rt.block_on(async {
        let ep = Endpoint::bind("127.0.0.1:0".parse().unwrap(), &id, AllowList::new())
            .expect("a socket");
        ep.connect(addr, server_id.public_key()).await
    });
    let conn = conn.expect("connected");
    println!("frame round trips on loopback, {ROUNDS} each, {gap_ms} ms between");
    for size in SIZES {
        report("task", size, rt.block_on(by_task(&conn, size, gap)));
        report("thread", size, by_thread(&rt, &conn, size, gap));
    }
}
