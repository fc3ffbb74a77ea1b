//! Where a frame read from a host's device goes: pure, no I/O.
//!
//! Every host's device is an Ethernet (TAP) device whose address the lab sets: host `i` has
//! [`mac`]`(i)`, and its IPv4 address is `10.213.0.i+1` ([`Subnet`]). The switch forwards by
//! destination MAC like a hardware switch that already knows every port: a unicast frame goes
//! to the host that owns its destination address; broadcast and multicast frames (ARP
//! requests, mDNS's 224.0.0.251) go to every other host, each copy over its own link. Anything
//! else (a frame to an address no host has, or to the sender itself, a runt) is dropped.
//!
//! Why Ethernet and not bare IP (TUN): mDNS implementations skip point-to-point interfaces,
//! and a TUN device is one, so multicast discovery would never leave the host.

use std::net::Ipv4Addr;

/// Where a packet goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// To this host.
    One(usize),
    /// To every host but the sender.
    AllButSender,
    /// Nowhere: not for the lab.
    Drop,
}

/// The lab's subnet: the first three octets; host `i` has `.i+1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subnet(pub [u8; 3]);

impl Default for Subnet {
    fn default() -> Self {
        Self([10, 213, 0])
    }
}

impl Subnet {
    /// Host `i`'s address.
    pub fn host(&self, i: usize) -> Ipv4Addr {
        assert!(i < MAX_HOSTS, "a lab has at most {MAX_HOSTS} hosts");
        let [a, b, c] = self.0;
        Ipv4Addr::new(a, b, c, i as u8 + 1)
    }

    /// The prefix length of every host's address.
    pub const PREFIX: u8 = 24;
}

/// Most hosts in one lab (the /24 less network, broadcast).
pub const MAX_HOSTS: usize = 253;

/// The first five octets of every host's MAC address: locally administered, "tlab".
const MAC_PREFIX: [u8; 5] = [0x02, b't', b'l', b'a', b'b'];

/// Host `i`'s MAC address.
pub fn mac(i: usize) -> [u8; 6] {
    assert!(i < MAX_HOSTS, "a lab has at most {MAX_HOSTS} hosts");
    let [a, b, c, d, e] = MAC_PREFIX;
    [a, b, c, d, e, i as u8]
}

/// Routes an Ethernet frame sent by host `from` in a lab of `hosts` hosts.
pub fn route(frame: &[u8], from: usize, hosts: usize) -> Route {
    if frame.len() < 14 {
        return Route::Drop;
    }
    // The group bit: broadcast (ff:ff:ff:ff:ff:ff) and every multicast address.
    if frame[0] & 1 == 1 {
        return Route::AllButSender;
    }
    if frame[..5] != MAC_PREFIX {
        return Route::Drop;
    }
    let to = frame[5] as usize;
    if to < hosts && to != from {
        Route::One(to)
    } else {
        Route::Drop
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame_to(dst: [u8; 6]) -> Vec<u8> {
        let mut f = vec![0u8; 60];
        f[..6].copy_from_slice(&dst);
        f
    }

    #[test]
    fn unicast_goes_to_the_owner_of_the_address() {
        assert_eq!(route(&frame_to(mac(2)), 0, 4), Route::One(2));
        assert_eq!(Subnet::default().host(2), Ipv4Addr::new(10, 213, 0, 3));
    }

    #[test]
    fn multicast_and_broadcast_go_to_everyone_else() {
        // Broadcast (ARP), IPv4 multicast (mDNS 224.0.0.251), IPv6 multicast.
        for dst in [
            [0xff; 6],
            [0x01, 0x00, 0x5e, 0, 0, 0xfb],
            [0x33, 0x33, 0, 0, 0, 0xfb],
        ] {
            assert_eq!(route(&frame_to(dst), 1, 4), Route::AllButSender, "{dst:?}");
        }
    }

    #[test]
    fn what_is_not_the_labs_is_dropped() {
        // Another vendor's address, a host that does not exist, the sender itself, a runt.
        assert_eq!(
            route(&frame_to([0x52, 0x54, 0, 1, 2, 3]), 0, 4),
            Route::Drop
        );
        assert_eq!(route(&frame_to(mac(9)), 0, 4), Route::Drop);
        assert_eq!(route(&frame_to(mac(0)), 0, 4), Route::Drop);
        assert_eq!(route(&[0x02; 10], 0, 4), Route::Drop);
    }
}
