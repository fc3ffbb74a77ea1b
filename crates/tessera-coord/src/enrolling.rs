//! Enrolments in progress: bounded in all and per source address, so that strangers cannot jam
//! the door a real token holder comes in by.
//!
//! An unknown key that finished its QUIC handshake holds a place here until its claim has been
//! judged ([`crate::enrol::EnrolmentBook::judge_now`]). A real node sends its claim at once (one round
//! trip after the handshake); a connection that stays silent is a stranger holding a place.
//! So the places are bounded ([`MAX_ENROLLING`] in all, [`MAX_ENROLLING_PER_ADDRESS`] per source
//! address) and, when a newcomer finds its address's share or the whole table full, the
//! **oldest place still waiting for its claim** gives way to it (from the same address first).
//! Idle connections, however many are re-opened, only ever evict each other; a newcomer that
//! sends its claim at once is judged before enough others arrive to evict it. A place whose
//! claim has arrived is never evicted (judging it takes no I/O). A silent place also ends by
//! itself at the first-message deadline ([`tessera_net::EndpointConfig::enrol_first_message`]).
//!
//! [`EnrolmentSlots`] is the pure table (no clock, no I/O: places are ordered by arrival); the
//! core task keeps it ([`crate::door::Door`]), and tells an evicted enrolment's task to give up.

use std::net::IpAddr;

/// Most enrolments (unknown keys proving a token) in progress at once.
pub const MAX_ENROLLING: usize = 32;
/// Most enrolments in progress from one source address (an IPv6 /64 counts as one).
pub const MAX_ENROLLING_PER_ADDRESS: usize = 8;

/// A place's number, in order of arrival.
pub type SlotId = u64;

/// What [`EnrolmentSlots::open`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Opened {
    /// The newcomer has place `id`; the places in `evicted` (silent ones) gave way to it.
    Admitted { id: SlotId, evicted: Vec<SlotId> },
    /// Every place it could take is held by an enrolment whose claim has arrived.
    Refused,
}

#[derive(Clone, Debug)]
struct Slot {
    id: SlotId,
    source: IpAddr,
    claimed: bool,
}

/// The table of enrolments in progress (pure).
#[derive(Debug)]
pub struct EnrolmentSlots {
    total: usize,
    per_source: usize,
    next: SlotId,
    /// In arrival order.
    open: Vec<Slot>,
}

impl Default for EnrolmentSlots {
    fn default() -> Self {
        Self::new(MAX_ENROLLING, MAX_ENROLLING_PER_ADDRESS)
    }
}

/// The address whose share a connection from `ip` counts against: the IPv4 address, or the
/// IPv6 /64 (one host usually holds a whole /64).
pub fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut o = v6.octets();
                o[8..].fill(0);
                IpAddr::V6(o.into())
            }
        },
    }
}

impl EnrolmentSlots {
    pub fn new(total: usize, per_source: usize) -> Self {
        Self {
            total: total.max(1),
            per_source: per_source.max(1),
            next: 1,
            open: Vec::new(),
        }
    }

    /// A newcomer from `ip`: a place, evicting the oldest silent places in its way.
    pub fn open(&mut self, ip: IpAddr) -> Opened {
        let source = source_of(ip);
        let mut evicted = Vec::new();
        if self.open.iter().filter(|s| s.source == source).count() >= self.per_source {
            match self.oldest_silent(|s| s.source == source) {
                Some(id) => evicted.push(self.remove(id)),
                None => return Opened::Refused,
            }
        }
        // (After an eviction above there is room: the table never holds more than `total`.)
        if self.open.len() >= self.total {
            match self.oldest_silent(|_| true) {
                Some(id) => evicted.push(self.remove(id)),
                None => return Opened::Refused,
            }
        }
        let id = self.next;
        self.next += 1;
        self.open.push(Slot {
            id,
            source,
            claimed: false,
        });
        Opened::Admitted { id, evicted }
    }

    /// Place `id`'s claim arrived: it is judged now and is no longer evicted.
    pub fn claimed(&mut self, id: SlotId) {
        if let Some(s) = self.open.iter_mut().find(|s| s.id == id) {
            s.claimed = true;
        }
    }

    /// Place `id` is given back (judged, failed, or evicted).
    pub fn close(&mut self, id: SlotId) {
        self.open.retain(|s| s.id != id);
    }

    /// Places held.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    fn oldest_silent(&self, pick: impl Fn(&Slot) -> bool) -> Option<SlotId> {
        self.open
            .iter()
            .find(|s| !s.claimed && pick(s))
            .map(|s| s.id)
    }

    fn remove(&mut self, id: SlotId) -> SlotId {
        self.close(id);
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn admitted(o: Opened) -> (SlotId, Vec<SlotId>) {
        match o {
            Opened::Admitted { id, evicted } => (id, evicted),
            Opened::Refused => panic!("refused"),
        }
    }

    #[test]
    fn silent_places_from_one_address_give_way_to_a_newcomer_from_it() {
        let mut t = EnrolmentSlots::new(32, 8);
        let idle: Vec<SlotId> = (0..40)
            .map(|_| admitted(t.open(ip("127.0.0.1"))).0)
            .collect();
        // Forty idle connections from one address hold its share, no more.
        assert_eq!(t.len(), 8);
        let (real, evicted) = admitted(t.open(ip("127.0.0.1")));
        assert_eq!(evicted, vec![idle[32]], "the oldest silent one gave way");
        t.claimed(real);
        // However many idle ones follow, the claimed place stays.
        for _ in 0..100 {
            let (_, evicted) = admitted(t.open(ip("127.0.0.1")));
            assert!(!evicted.contains(&real));
        }
        assert!(t.open.iter().any(|s| s.id == real));
    }

    #[test]
    fn the_whole_table_evicts_the_oldest_silent_place_and_refuses_only_when_all_are_judged() {
        let mut t = EnrolmentSlots::new(4, 2);
        let a = admitted(t.open(ip("10.0.0.1"))).0;
        let b = admitted(t.open(ip("10.0.0.2"))).0;
        let c = admitted(t.open(ip("10.0.0.3"))).0;
        let d = admitted(t.open(ip("10.0.0.4"))).0;
        t.claimed(a);
        let (_, evicted) = admitted(t.open(ip("10.0.0.5")));
        assert_eq!(evicted, vec![b], "the oldest silent, not the claimed one");
        for id in [c, d] {
            t.claimed(id);
        }
        let e = t.open.iter().find(|s| !s.claimed).unwrap().id;
        t.claimed(e);
        assert_eq!(t.open(ip("10.0.0.6")), Opened::Refused);
        t.close(a);
        assert!(matches!(t.open(ip("10.0.0.6")), Opened::Admitted { .. }));
    }

    #[test]
    fn an_ipv6_64_is_one_source() {
        assert_eq!(
            source_of(ip("2001:db8::1")),
            source_of(ip("2001:db8::ffff:1"))
        );
        assert_ne!(source_of(ip("2001:db8::1")), source_of(ip("2001:db9::1")));
        assert_eq!(source_of(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
    }
}
