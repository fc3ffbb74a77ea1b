//! Where an IP packet read from a host's TUN device goes: pure, no I/O.
//!
//! The lab's hosts share one /24 (`10.213.0.0/24` by default): host `i` is `.i+1`. A unicast
//! packet goes to the host that owns its destination; multicast (224.0.0.0/4, mDNS among it),
//! the limited broadcast and the subnet's broadcast go to every other host, each copy over its
//! own link. Anything else (IPv6, other networks, a packet to the sender itself) is not the
//! lab's and is dropped.

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

/// Routes a packet sent by host `from` in a lab of `hosts` hosts.
pub fn route(packet: &[u8], from: usize, hosts: usize, net: Subnet) -> Route {
    if packet.len() < 20 || packet[0] >> 4 != 4 {
        return Route::Drop;
    }
    let dst = [packet[16], packet[17], packet[18], packet[19]];
    if (224..=239).contains(&dst[0]) || dst == [255; 4] {
        return Route::AllButSender;
    }
    if dst[..3] != net.0 {
        return Route::Drop;
    }
    match dst[3] {
        255 => Route::AllButSender,
        0 => Route::Drop,
        h => {
            let to = h as usize - 1;
            if to < hosts && to != from {
                Route::One(to)
            } else {
                Route::Drop
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ipv4_to(dst: [u8; 4]) -> Vec<u8> {
        let mut p = vec![0u8; 28];
        p[0] = 0x45;
        p[16..20].copy_from_slice(&dst);
        p
    }

    #[test]
    fn unicast_goes_to_the_owner_of_the_address() {
        let net = Subnet::default();
        assert_eq!(route(&ipv4_to([10, 213, 0, 3]), 0, 4, net), Route::One(2));
        assert_eq!(net.host(2), Ipv4Addr::new(10, 213, 0, 3));
    }

    #[test]
    fn multicast_and_broadcast_go_to_everyone_else() {
        let net = Subnet::default();
        for dst in [
            [224, 0, 0, 251],
            [239, 1, 2, 3],
            [255; 4],
            [10, 213, 0, 255],
        ] {
            assert_eq!(
                route(&ipv4_to(dst), 1, 4, net),
                Route::AllButSender,
                "{dst:?}"
            );
        }
    }

    #[test]
    fn what_is_not_the_labs_is_dropped() {
        let net = Subnet::default();
        // Another network, a host that does not exist, the sender itself, IPv6, a runt.
        assert_eq!(route(&ipv4_to([8, 8, 8, 8]), 0, 4, net), Route::Drop);
        assert_eq!(route(&ipv4_to([10, 213, 0, 9]), 0, 4, net), Route::Drop);
        assert_eq!(route(&ipv4_to([10, 213, 0, 1]), 0, 4, net), Route::Drop);
        let mut v6 = ipv4_to([10, 213, 0, 2]);
        v6[0] = 0x60;
        assert_eq!(route(&v6, 0, 4, net), Route::Drop);
        assert_eq!(route(&[0x45; 10], 0, 4, net), Route::Drop);
    }
}
