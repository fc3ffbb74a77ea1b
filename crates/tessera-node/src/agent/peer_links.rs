//! Measuring the links to other nodes when the coordinator asks ([`CoordToNode::MeasurePeers`]):
//! the planner needs the path between two nodes, which the coordinator's own links to each do
//! not show (a coordinator on one LAN, nodes a WAN apart).
//!
//! [`CoordToNode::MeasurePeers`]: tessera_proto::CoordToNode::MeasurePeers

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use tessera_net::{measure_link, Endpoint, NetError, NodeId};
use tessera_proto::{PeerInfo, PeerLink};

/// Pings per measurement (after one warm-up) and the bulk transfer's size: the same as a
/// ring's link measurement, so the two figures compare.
const PINGS: usize = 8;
const BULK_BYTES: u64 = 1 << 20;

/// A peer admits this node's key when its own copy of the request arrives, which may be a
/// moment after this node's: a refused dial is tried again this many times, this far apart.
const ATTEMPTS: u32 = 5;
const RETRY_AFTER: Duration = Duration::from_millis(300);

/// How long one dial, or one measurement, may take (a cut link must not hold the task).
const TIMEOUT: Duration = Duration::from_secs(10);

/// The peers this control session has measured (or is measuring), at the address measured:
/// a peer that comes back at another address is measured again.
#[derive(Default)]
pub(super) struct Measured(HashSet<(NodeId, SocketAddr)>);

impl Measured {
    /// The peers of `named` not measured yet in this session, now counted as measured.
    pub(super) fn take_new(&mut self, named: &[PeerInfo]) -> Vec<PeerInfo> {
        named
            .iter()
            .filter(|p| self.0.insert((p.node_id, p.addr)))
            .cloned()
            .collect()
    }
}

/// Measures the link to each of `peers`, one after another (concurrent bulk transfers would
/// share this node's uplink and each read low).
pub(super) async fn measure_peers(endpoint: &Endpoint, peers: &[PeerInfo]) -> Vec<PeerLink> {
    let mut links = Vec::with_capacity(peers.len());
    for p in peers {
        let measured = measure_one(endpoint, p).await.map_err(|e| e.to_string());
        match &measured {
            Ok(l) => tracing::info!(
                "link to {} at {}: {:.2} ms round trip, {:.0} Mbit/s",
                p.node_id.short(),
                p.addr,
                l.rtt_median.as_secs_f64() * 1e3,
                l.bytes_per_s * 8e-6
            ),
            Err(e) => tracing::warn!("cannot measure the link to {}: {e}", p.node_id.short()),
        }
        links.push(PeerLink {
            peer: p.node_id,
            measured,
        });
    }
    links
}

async fn measure_one(
    endpoint: &Endpoint,
    p: &PeerInfo,
) -> Result<tessera_net::LinkMeasurement, NetError> {
    let mut attempt = 1;
    let conn = loop {
        match timed(endpoint.connect(p.addr, p.key)).await {
            Ok(c) => break c,
            Err(e) if attempt < ATTEMPTS && !matches!(e, NetError::Timeout(_)) => {
                attempt += 1;
                tokio::time::sleep(RETRY_AFTER).await;
            }
            Err(e) => return Err(e),
        }
    };
    let link = timed(measure_link(&conn, PINGS, BULK_BYTES)).await;
    conn.close("link measured");
    link
}

async fn timed<T>(
    f: impl std::future::Future<Output = Result<T, NetError>>,
) -> Result<T, NetError> {
    tokio::time::timeout(TIMEOUT, f)
        .await
        .unwrap_or_else(|_| Err(NetError::Timeout(format!("no answer within {TIMEOUT:?}"))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_net::PublicKey;

    fn peer(n: u8, port: u16) -> PeerInfo {
        let key = PublicKey::from_bytes([n; 32]);
        PeerInfo {
            node_id: key.node_id(),
            key,
            addr: ([127, 0, 0, 1], port).into(),
        }
    }

    #[test]
    fn a_peer_is_measured_once_per_address() {
        let mut m = Measured::default();
        assert_eq!(m.take_new(&[peer(1, 7001), peer(2, 7002)]).len(), 2);
        assert_eq!(m.take_new(&[peer(1, 7001), peer(2, 7002)]), vec![]);
        // Node 2 came back on another port; node 3 joined.
        let new = m.take_new(&[peer(1, 7001), peer(2, 7102), peer(3, 7003)]);
        assert_eq!(new, vec![peer(2, 7102), peer(3, 7003)]);
    }
}
