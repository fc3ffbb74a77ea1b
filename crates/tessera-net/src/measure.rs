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
    /// Bulk throughput one way, bytes per second (includes one round trip of acknowledgement).
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

/// Measures round-trip time with `pings` pings, then throughput with `bulk_bytes` bytes.
pub async fn measure_link(
    conn: &Connection,
    pings: usize,
    bulk_bytes: u64,
) -> Result<LinkMeasurement, NetError> {
    let rtt = measure_rtt(conn, pings).await?;
    let bytes_per_s = measure_throughput(conn, bulk_bytes).await?;
    Ok(LinkMeasurement {
        rtt_min: rtt.min,
        rtt_median: rtt.median,
        bytes_per_s,
        measured_at_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    })
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
