//! Link measurement: round-trip time by ping/pong frames, throughput by a bulk transfer.
//!
//! Both run on their own stream of kind [`stream_kind::MEASURE`]; the peer answers in
//! [`respond`], which [`Connection::accept_stream`] starts by itself for such streams.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::endpoint::{stream_kind, Connection, FramedStream};
use crate::error::NetError;

const KIND_PING: u16 = 0xFF10;
const KIND_PONG: u16 = 0xFF11;
const KIND_BULK_START: u16 = 0xFF12;
const KIND_BULK: u16 = 0xFF13;
const KIND_BULK_DONE: u16 = 0xFF14;
/// Bulk frames stay small enough for peers with a low frame limit.
const BULK_CHUNK: usize = 32 << 10;

/// Round-trip statistics over a number of pings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RttStats {
    /// Fastest round trip.
    pub min: Duration,
    /// Median round trip.
    pub median: Duration,
    /// Pings counted (a first warm-up ping is not).
    pub samples: usize,
}

/// One measurement of a link, for inventories and planners.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkMeasurement {
    /// Fastest ping round trip (frame level, over QUIC and TLS).
    pub rtt_min: Duration,
    /// Median ping round trip.
    pub rtt_median: Duration,
    /// Bulk throughput one way, bytes per second, of a transfer long enough to be bound by the
    /// link ([`next_probe`]).
    pub bytes_per_s: f64,
    /// When the measurement finished, milliseconds since the Unix epoch.
    pub measured_at_unix_ms: u64,
}

/// Sends `n` pings (after one warm-up) one after another and times each round trip.
pub async fn measure_rtt(conn: &Connection, n: usize) -> Result<RttStats, NetError> {
    let n = n.max(1);
    let mut s = conn.open_stream(stream_kind::MEASURE).await?;
    let mut samples = Vec::with_capacity(n);
    for seq in 0..=n as u64 {
        let t = Instant::now();
        s.writer.write_frame(KIND_PING, &seq.to_be_bytes()).await?;
        let pong = s.reader.recv_kind(KIND_PONG, "a pong").await?;
        let rtt = t.elapsed();
        if pong.as_ref() != seq.to_be_bytes() {
            return Err(NetError::Decode {
                stream: s.reader.label().clone(),
                kind: KIND_PONG,
                reason: format!("pong for another ping (expected sequence {seq})"),
            });
        }
        if seq > 0 {
            samples.push(rtt);
        }
    }
    s.writer.finish().await?;
    samples.sort_unstable();
    Ok(RttStats {
        min: samples[0],
        median: samples[samples.len() / 2],
        samples: samples.len(),
    })
}

/// Sends `bytes` (at least one chunk) to the peer on a fresh stream and returns bytes per
/// second, timed from the first byte sent to the peer's acknowledgement of the last.
pub async fn measure_throughput(conn: &Connection, bytes: u64) -> Result<f64, NetError> {
    let bytes = bytes.max(1);
    let mut s = conn.open_stream(stream_kind::MEASURE).await?;
    let chunk = vec![0u8; BULK_CHUNK.min(conn.max_frame_len())];
    let t = Instant::now();
    s.writer
        .write_frame(KIND_BULK_START, &bytes.to_be_bytes())
        .await?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        s.writer.write_frame(KIND_BULK, &chunk[..n]).await?;
        left -= n as u64;
    }
    let done = s
        .reader
        .recv_kind(KIND_BULK_DONE, "a bulk acknowledgement")
        .await?;
    let elapsed = t.elapsed().as_secs_f64().max(1e-9);
    s.writer.finish().await?;
    if done.as_ref() != bytes.to_be_bytes() {
        return Err(NetError::Decode {
            stream: s.reader.label().clone(),
            kind: KIND_BULK_DONE,
            reason: "peer acknowledged another byte count".into(),
        });
    }
    Ok(bytes as f64 / elapsed)
}

/// Measures round-trip time with `pings` pings, then throughput: `bulk_bytes` first, then
/// more until a transfer is bound by the link rather than by its start ([`next_probe`]).
pub async fn measure_link(
    conn: &Connection,
    pings: usize,
    bulk_bytes: u64,
) -> Result<LinkMeasurement, NetError> {
    let rtt = measure_rtt(conn, pings).await?;
    let bytes_per_s = measure_steady_throughput(conn, bulk_bytes, rtt.min).await?;
    Ok(LinkMeasurement {
        rtt_min: rtt.min,
        rtt_median: rtt.median,
        bytes_per_s,
        measured_at_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    })
}

/// A transfer lasting fewer round trips than this is taken to be bound by its start (the
/// congestion window's ramp and the acknowledgement's round trip), not by the link.
const STEADY_RTTS: u32 = 16;
/// The most bytes one throughput measurement sends in all.
const MAX_PROBE_BYTES: u64 = 8 << 20;

/// What the throughput probe does after a transfer of `bytes` that took `elapsed`, with
/// `sent` bytes sent so far in all, on a link whose fastest round trip is `rtt`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Probe {
    /// Send this many bytes next: the last transfer was too short to show the link's rate.
    Again(u64),
    /// The link's rate, bytes per second: the last transfer's, its acknowledgement's round
    /// trip taken out.
    Done(f64),
}

/// The probe's rule. On a fresh connection over a long fat link the first transfer is bound by
/// the congestion window's ramp: 1 MiB over an emulated 20 ms, 100 Mbit/s link measured 23–42
/// Mbit/s. So while a transfer lasts fewer than [`STEADY_RTTS`] round trips, the next sends
/// twice as much (the window stays open between them), until [`MAX_PROBE_BYTES`] would be
/// passed. On loopback or a LAN the first transfer already lasts long enough.
pub fn next_probe(bytes: u64, elapsed: Duration, sent: u64, rtt: Duration) -> Probe {
    let long_enough = elapsed >= rtt * STEADY_RTTS;
    if !long_enough && sent + 2 * bytes <= MAX_PROBE_BYTES {
        return Probe::Again(2 * bytes);
    }
    // At least half the time stays: a round trip measured slower than this transfer's own
    // acknowledgement must not make the rate absurd.
    let transfer = elapsed.saturating_sub(rtt).max(elapsed / 2);
    Probe::Done(bytes as f64 / transfer.as_secs_f64().max(1e-9))
}

/// Throughput by bulk transfers of `first` bytes and more ([`next_probe`]).
pub async fn measure_steady_throughput(
    conn: &Connection,
    first: u64,
    rtt: Duration,
) -> Result<f64, NetError> {
    let mut bytes = first.max(1);
    let mut sent = 0;
    loop {
        let t = Instant::now();
        measure_throughput(conn, bytes).await?;
        sent += bytes;
        match next_probe(bytes, t.elapsed(), sent, rtt) {
            Probe::Again(more) => bytes = more,
            Probe::Done(rate) => return Ok(rate),
        }
    }
}

/// Answers a measurement stream until the peer finishes it: pongs for pings, an
/// acknowledgement after each bulk transfer.
pub async fn respond(mut s: FramedStream) -> Result<(), NetError> {
    while let Some(f) = s.reader.read_frame().await? {
        match f.kind {
            KIND_PING => s.writer.write_frame(KIND_PONG, &f.payload).await?,
            KIND_BULK_START => {
                let total = f
                    .payload
                    .as_ref()
                    .try_into()
                    .map(u64::from_be_bytes)
                    .map_err(|_| NetError::Decode {
                        stream: s.reader.label().clone(),
                        kind: f.kind,
                        reason: "bulk start needs a u64 byte count".into(),
                    })?;
                let mut got = 0u64;
                while got < total {
                    got += s.reader.recv_kind(KIND_BULK, "bulk data").await?.len() as u64;
                }
                s.writer
                    .write_frame(KIND_BULK_DONE, &got.to_be_bytes())
                    .await?;
            }
            kind => {
                return Err(NetError::UnexpectedFrame {
                    stream: s.reader.label().clone(),
                    kind,
                    expected: "a ping or bulk start",
                })
            }
        }
    }
    s.writer.finish().await
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_transfer_short_for_the_round_trip_is_followed_by_a_larger_one() {
        // 1 MiB in 250 ms over a 20 ms link: 12.5 round trips, the window still opening.
        assert_eq!(
            next_probe(1 << 20, 250 * MS, 1 << 20, 20 * MS),
            Probe::Again(2 << 20)
        );
        assert_eq!(
            next_probe(2 << 20, 190 * MS, 3 << 20, 20 * MS),
            Probe::Again(4 << 20)
        );
    }

    #[test]
    fn a_long_enough_transfer_gives_its_rate_without_the_acknowledgement() {
        // 4 MiB in 355 ms over a 20 ms link: 335 ms of transfer, 100 Mbit/s.
        let Probe::Done(rate) = next_probe(4 << 20, 355 * MS, 7 << 20, 20 * MS) else {
            panic!("done")
        };
        assert!((rate - (4 << 20) as f64 / 0.335).abs() < 1.0, "{rate}");
        // On loopback the first megabyte is long enough: one transfer.
        assert!(matches!(
            next_probe(1 << 20, 5 * MS, 1 << 20, Duration::from_micros(150)),
            Probe::Done(_)
        ));
    }

    #[test]
    fn the_probe_stops_before_its_byte_budget_and_never_takes_out_more_than_half() {
        // Still short, but another doubling would pass 8 MiB.
        let Probe::Done(rate) = next_probe(4 << 20, 100 * MS, 7 << 20, 20 * MS) else {
            panic!("done at the budget")
        };
        assert!((rate - (4 << 20) as f64 / 0.080).abs() < 1.0, "{rate}");
        // A round trip near the transfer's own time leaves half of it.
        let Probe::Done(rate) = next_probe(1 << 20, 40 * MS, 7 << 20, 30 * MS) else {
            panic!("done")
        };
        assert!((rate - (1 << 20) as f64 / 0.020).abs() < 1.0, "{rate}");
    }
}
