//! Manual use of the link emulator: relay UDP from `--listen` to `--upstream` through an
//! impaired link, printing counters every few seconds and on Ctrl-C.
//!
//! ```text
//! tessera-linkemu --listen 127.0.0.1:7001 --upstream 127.0.0.1:7000 \
//!     --delay-ms 20 --jitter-ms 2 --bandwidth 100Mbit/s --loss 0.01
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use tessera_linkemu::{parse_bandwidth, Impairment, LinkEmulator, LinkShape, DEFAULT_QUEUE_BYTES};

/// UDP link emulator: one-way delay, jitter, bandwidth limit and loss, the same both ways.
#[derive(Debug, Parser)]
#[command(name = "tessera-linkemu", version)]
struct Args {
    /// Address clients send to.
    #[arg(long)]
    listen: SocketAddr,
    /// Address datagrams are relayed to.
    #[arg(long)]
    upstream: SocketAddr,
    /// One-way delay in milliseconds (each direction).
    #[arg(long, default_value_t = 0.0)]
    delay_ms: f64,
    /// Uniform jitter in milliseconds (delay ± jitter).
    #[arg(long, default_value_t = 0.0)]
    jitter_ms: f64,
    /// Bandwidth limit per direction, e.g. 100Mbit/s, 10MB/s, 1gbit (bare number: bytes/s).
    #[arg(long, value_parser = parse_bandwidth)]
    bandwidth: Option<u64>,
    /// Bound of the bandwidth queue in bytes; datagrams beyond it are tail-dropped.
    #[arg(long, default_value_t = DEFAULT_QUEUE_BYTES)]
    queue_bytes: usize,
    /// Loss probability per datagram, 0 to 1.
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    /// Seed of the loss and jitter draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print counters this often, in seconds (0: only at exit).
    #[arg(long, default_value_t = 5)]
    stats_every: u64,
}

fn millis(ms: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(ms / 1000.0).map_err(|e| format!("{ms} ms: {e}"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    if !(0.0..=1.0).contains(&args.loss) {
        return Err(format!("--loss {} is not between 0 and 1", args.loss));
    }
    let mut each_way = Impairment::default()
        .delay(millis(args.delay_ms)?)
        .jitter(millis(args.jitter_ms)?)
        .queue_bytes(args.queue_bytes)
        .loss(args.loss);
    each_way.bandwidth = args.bandwidth;
    let shape = LinkShape::symmetric(each_way).seed(args.seed);
    let (emu, addr) = LinkEmulator::start(args.listen, args.upstream, shape)
        .await
        .map_err(|e| format!("binding {}: {e}", args.listen))?;
    eprintln!(
        "tessera-linkemu: {addr} -> {} with {shape:?}",
        args.upstream
    );
    let handle = emu.handle();
    let every = Duration::from_secs(args.stats_every.max(1));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = tokio::time::sleep(every), if args.stats_every > 0 => {
                eprintln!("{}", handle.stats());
            }
        }
    }
    eprintln!("{}", handle.stats());
    emu.shutdown().await;
    Ok(())
}
