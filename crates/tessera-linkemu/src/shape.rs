//! The link's parameters: how each direction treats datagrams ([`Impairment`]: delay, jitter,
//! bandwidth and its queue bound, loss), the whole link ([`LinkShape`]: one impairment per
//! [`Direction`], the partition switch, the seed), and [`parse_bandwidth`] for bandwidths given
//! as text, as on the binary's command line.

use std::time::Duration;

use crate::DEFAULT_QUEUE_BYTES;

/// How one direction of the link treats datagrams.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Impairment {
    /// One-way delay added to every datagram.
    pub delay: Duration,
    /// Uniform jitter: each datagram's delay is drawn from `delay ± jitter` (never below zero).
    pub jitter: Duration,
    /// Bandwidth limit in bytes per second; `None` is unlimited.
    pub bandwidth: Option<u64>,
    /// Most bytes waiting for bandwidth; a datagram that would exceed it is tail-dropped.
    pub queue_bytes: usize,
    /// Probability in `[0, 1]` that a datagram is dropped.
    pub loss: f64,
}

impl Default for Impairment {
    /// A perfect link: no delay, no limit, no loss.
    fn default() -> Self {
        Self {
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            bandwidth: None,
            queue_bytes: DEFAULT_QUEUE_BYTES,
            loss: 0.0,
        }
    }
}

impl Impairment {
    /// Sets the one-way delay.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Sets the jitter (uniform, `delay ± jitter`).
    pub fn jitter(mut self, jitter: Duration) -> Self {
        self.jitter = jitter;
        self
    }

    /// Limits the bandwidth to `bytes_per_s` (0 means unlimited).
    pub fn bandwidth(mut self, bytes_per_s: u64) -> Self {
        self.bandwidth = (bytes_per_s > 0).then_some(bytes_per_s);
        self
    }

    /// Sets the bandwidth queue bound in bytes.
    pub fn queue_bytes(mut self, bytes: usize) -> Self {
        self.queue_bytes = bytes;
        self
    }

    /// Sets the loss probability (clamped to `[0, 1]`; NaN is 0).
    pub fn loss(mut self, p: f64) -> Self {
        self.loss = if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) };
        self
    }
}

/// The whole link: one [`Impairment`] per direction, the partition switch and the loss seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkShape {
    /// Client → upstream.
    pub to_upstream: Impairment,
    /// Upstream → client.
    pub to_client: Impairment,
    /// Drop everything, both ways.
    pub partitioned: bool,
    /// Seed of the loss and jitter generators. Each association's two directions draw from
    /// generators derived from it when the association opens;
    /// [`LinkHandle::set`](crate::LinkHandle::set) does not reseed open associations.
    pub seed: u64,
}

impl Default for LinkShape {
    /// A perfect link.
    fn default() -> Self {
        Self::symmetric(Impairment::default())
    }
}

impl LinkShape {
    /// The same impairment both ways.
    pub fn symmetric(each_way: Impairment) -> Self {
        Self {
            to_upstream: each_way,
            to_client: each_way,
            partitioned: false,
            seed: 0,
        }
    }

    /// Different impairments each way.
    pub fn asymmetric(to_upstream: Impairment, to_client: Impairment) -> Self {
        Self {
            to_upstream,
            to_client,
            ..Self::default()
        }
    }

    /// Sets the seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets the partition switch.
    pub fn partitioned(mut self, partitioned: bool) -> Self {
        self.partitioned = partitioned;
        self
    }

    pub(crate) fn get(&self, dir: Direction) -> &Impairment {
        match dir {
            Direction::ToUpstream => &self.to_upstream,
            Direction::ToClient => &self.to_client,
        }
    }
}

/// A direction of the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Client → upstream.
    ToUpstream,
    /// Upstream → client.
    ToClient,
}

impl Direction {
    pub(crate) fn index(self) -> usize {
        match self {
            Self::ToUpstream => 0,
            Self::ToClient => 1,
        }
    }
}

/// Parses a bandwidth: a number with an optional unit, returned in bytes per second.
///
/// Units (case-insensitive, optional `/s`): `bit`, `kbit`, `mbit`, `gbit` (decimal bits; also
/// spelt `bps`, `kbps`, `mbps`, `gbps`), `b`/`byte`, `kb`, `mb`, `gb` (decimal bytes), `kib`,
/// `mib`, `gib` (binary bytes). A bare number is bytes per second. `100Mbit/s` is 12 500 000.
pub fn parse_bandwidth(s: &str) -> Result<u64, String> {
    let mut t = s.trim().to_ascii_lowercase();
    if let Some(rest) = t.strip_suffix("/s") {
        t = rest.to_string();
    }
    if let Some(rest) = t.strip_suffix("bps") {
        t = format!("{rest}bit");
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("bandwidth '{s}': expected a number, then a unit like Mbit/s"))?;
    let bytes_per_unit = match unit.trim() {
        "" | "b" | "byte" | "bytes" => 1.0,
        "bit" | "bits" => 1.0 / 8.0,
        "kbit" => 1e3 / 8.0,
        "mbit" => 1e6 / 8.0,
        "gbit" => 1e9 / 8.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("bandwidth '{s}': unknown unit '{other}'")),
    };
    let bytes = value * bytes_per_unit;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("bandwidth '{s}' is out of range"));
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_units() {
        assert_eq!(parse_bandwidth("100Mbit/s"), Ok(12_500_000));
        assert_eq!(parse_bandwidth("1gbit"), Ok(125_000_000));
        assert_eq!(parse_bandwidth("8kbit"), Ok(1000));
        assert_eq!(parse_bandwidth("2MB/s"), Ok(2_000_000));
        assert_eq!(parse_bandwidth("1MiB"), Ok(1 << 20));
        assert_eq!(parse_bandwidth("1.5mbps"), Ok(187_500));
        assert_eq!(parse_bandwidth("4096"), Ok(4096));
        assert!(parse_bandwidth("fast").is_err());
        assert!(parse_bandwidth("10 furlongs").is_err());
        assert!(parse_bandwidth("0").is_err());
    }

    #[test]
    fn loss_is_clamped() {
        assert_eq!(Impairment::default().loss(2.0).loss, 1.0);
        assert_eq!(Impairment::default().loss(-1.0).loss, 0.0);
        assert_eq!(Impairment::default().loss(f64::NAN).loss, 0.0);
    }
}
