//! Finding the coordinator on the LAN by mDNS / DNS-SD, so a node needs only the join token.
//!
//! The coordinator advertises `_tessera._udp.local.` with its node id in a TXT record (`id=`);
//! a node browses for that service and takes the instance whose id is the one its join token
//! names. Discovery is only a hint: the QUIC handshake then pins that id, so an impostor that
//! answers mDNS gets nothing but a failed handshake.
//!
//! mDNS is multicast on the local network; it runs only when asked (`tessera coordinator
//! --mdns`, `tessera node --join TOKEN` without an address) and never in tests.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use mdns_sd::{ServiceDaemon, ServiceEvent, ServiceInfo};
use tessera_net::NodeId;

/// The DNS-SD service type of Tessera coordinators.
pub const SERVICE_TYPE: &str = "_tessera._udp.local.";
/// TXT key carrying the coordinator's node id.
pub const ID_KEY: &str = "id";

/// Why discovery failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("mDNS: {0}")]
    Mdns(#[from] mdns_sd::Error),
    #[error("no coordinator {0} answered on the local network within {1:?}")]
    NotFound(NodeId, Duration),
}

/// A running advertisement; dropped, it stops.
pub struct Advertisement {
    daemon: ServiceDaemon,
}

impl std::fmt::Debug for Advertisement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Advertisement")
    }
}

impl Drop for Advertisement {
    fn drop(&mut self) {
        let _ = self.daemon.shutdown();
    }
}

/// Advertises the coordinator `id` listening on UDP `port` on every interface.
pub fn advertise(id: NodeId, port: u16) -> Result<Advertisement, DiscoveryError> {
    let daemon = ServiceDaemon::new()?;
    let instance = format!("tessera-{}", id.short());
    let host = format!("{instance}.local.");
    let info = ServiceInfo::new(
        SERVICE_TYPE,
        &instance,
        &host,
        "",
        port,
        &[(ID_KEY, id.to_string().as_str())][..],
    )?
    .enable_addr_auto();
    daemon.register(info)?;
    Ok(Advertisement { daemon })
}

/// Whether an advertised TXT id names the coordinator we want.
pub fn is_wanted(advertised_id: Option<&str>, wanted: &NodeId) -> bool {
    advertised_id.is_some_and(|s| s.parse::<NodeId>().ok().as_ref() == Some(wanted))
}

/// Browses for the coordinator `id` for at most `timeout`; its address.
pub fn find(id: NodeId, timeout: Duration) -> Result<SocketAddr, DiscoveryError> {
    let daemon = ServiceDaemon::new()?;
    let events = daemon.browse(SERVICE_TYPE)?;
    let deadline = Instant::now() + timeout;
    let found = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match events.recv_timeout(left) {
            Ok(ServiceEvent::ServiceResolved(s)) => {
                if !is_wanted(s.get_property_val_str(ID_KEY), &id) {
                    continue;
                }
                let mut ips: Vec<IpAddr> =
                    s.get_addresses_v4().into_iter().map(IpAddr::V4).collect();
                ips.sort();
                if let Some(ip) = ips.first() {
                    break Some(SocketAddr::new(*ip, s.get_port()));
                }
            }
            Ok(_) => {}
            Err(_) => break None,
        }
    };
    let _ = daemon.shutdown();
    found.ok_or(DiscoveryError::NotFound(id, timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_named_coordinator_is_taken() {
        let a = tessera_net::NodeIdentity::from_seed([1; 32]).node_id();
        let b = tessera_net::NodeIdentity::from_seed([2; 32]).node_id();
        assert!(is_wanted(Some(&a.to_string()), &a));
        assert!(!is_wanted(Some(&b.to_string()), &a));
        assert!(!is_wanted(Some("garbage"), &a));
        assert!(!is_wanted(None, &a));
    }
}
