//! Fair admission: each client (an API key, or an address where no key is set) holds at most
//! its share of the sequences the backend can take, so one client's flood cannot starve the
//! others into 429s.
//!
//! The share is max-min fair and needs no weights: a client alone may hold all but a reserve
//! of a quarter (so a newcomer finds room on any server of 4 places or more); once others hold
//! sequences too, each may hold `capacity / clients`. Sequences already admitted are never
//! preempted; a client over its share just gets 429 until its own sequences finish. A choice
//! of an `n`-choice request is one sequence, so `n: 16` costs sixteen.
//!
//! [`FairShare`] is the pure rule; [`Admission`] puts it behind a lock and hands out
//! [`Permit`]s that give their sequence back when dropped (with the response stream).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tessera_api::{ClientId, OverShare};

/// The rule, with no clock and no locks.
#[derive(Debug)]
pub struct FairShare {
    capacity: usize,
    held: HashMap<ClientId, usize>,
    total: usize,
}

impl FairShare {
    /// `capacity`: sequences the backend can hold, running and waiting (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            held: HashMap::new(),
            total: 0,
        }
    }

    /// What `client` may hold now: all but a reserve when it is alone, else an equal share.
    pub fn share(&self, client: &ClientId) -> usize {
        let others = self.held.keys().filter(|c| *c != client).count();
        if others == 0 {
            // A quarter, rounded down, stays free for whoever comes next (a server of fewer
            // than 4 places is too small to keep one back).
            let reserve = self.capacity / 4;
            self.capacity - reserve
        } else {
            (self.capacity / (others + 1)).max(1)
        }
    }

    /// Takes one sequence for `client`, or says why not.
    pub fn admit(&mut self, client: &ClientId) -> Result<(), OverShare> {
        let held = self.held.get(client).copied().unwrap_or(0);
        let share = self.share(client);
        if held >= share || self.total >= self.capacity {
            return Err(OverShare {
                client: client.clone(),
                held,
                share,
                capacity: self.capacity,
            });
        }
        *self.held.entry(client.clone()).or_insert(0) += 1;
        self.total += 1;
        Ok(())
    }

    /// Gives one sequence back (a client with none left is forgotten).
    pub fn release(&mut self, client: &ClientId) {
        if let Some(n) = self.held.get_mut(client) {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.held.remove(client);
            }
        }
    }

    /// Sequences `client` holds.
    pub fn held(&self, client: &ClientId) -> usize {
        self.held.get(client).copied().unwrap_or(0)
    }
}

/// [`FairShare`] shared by the request handlers.
#[derive(Debug)]
pub struct Admission {
    rule: Mutex<FairShare>,
}

/// One admitted sequence; dropping it gives the sequence back.
#[derive(Debug)]
pub struct Permit {
    admission: Arc<Admission>,
    client: ClientId,
}

impl Admission {
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            rule: Mutex::new(FairShare::new(capacity)),
        })
    }

    pub fn admit(self: &Arc<Self>, client: &ClientId) -> Result<Permit, OverShare> {
        self.lock().admit(client)?;
        Ok(Permit {
            admission: self.clone(),
            client: client.clone(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FairShare> {
        // The rule's state stays consistent across a panic elsewhere: each change is one step.
        self.rule.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.admission.lock().release(&self.client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> ClientId {
        ClientId::Key(name.into())
    }

    #[test]
    fn a_client_alone_leaves_a_reserve_for_the_next() {
        let mut f = FairShare::new(8);
        let a = key("a");
        let admitted = (0..300).filter(|_| f.admit(&a).is_ok()).count();
        assert_eq!(admitted, 6);
        let e = f.admit(&a).unwrap_err();
        assert_eq!((e.held, e.share), (6, 6));
        assert!(f.admit(&key("b")).is_ok(), "the reserve admits a newcomer");
    }

    #[test]
    fn a_flooding_client_is_held_to_an_equal_share_once_others_arrive() {
        let mut f = FairShare::new(8);
        let (a, b) = (key("a"), key("b"));
        for _ in 0..6 {
            f.admit(&a).unwrap();
        }
        // b may take the free places, up to its half.
        assert!(f.admit(&b).is_ok() && f.admit(&b).is_ok());
        assert!(f.admit(&b).is_err(), "the server is full");
        // a finishes two; it is over its half, so the places go to b.
        f.release(&a);
        f.release(&a);
        assert!(f.admit(&a).is_err(), "a holds 4 of a share of 4");
        assert!(f.admit(&b).is_ok() && f.admit(&b).is_ok());
        assert_eq!((f.held(&a), f.held(&b)), (4, 4));
    }

    #[test]
    fn a_client_with_nothing_left_is_forgotten_and_shares_grow_back() {
        let mut f = FairShare::new(9);
        let (a, b, c) = (key("a"), key("b"), key("c"));
        f.admit(&a).unwrap();
        f.admit(&b).unwrap();
        assert_eq!(f.share(&c), 3);
        f.release(&b);
        assert_eq!(f.share(&c), 4);
        assert_eq!(f.share(&a), 7, "alone again: all but the reserve");
    }

    #[test]
    fn permits_give_their_sequence_back_when_dropped() {
        let adm = Admission::new(1);
        let a = ClientId::Address("127.0.0.1".parse().unwrap());
        let p = adm.admit(&a).unwrap();
        assert!(adm.admit(&a).is_err(), "one place, taken");
        drop(p);
        assert!(adm.admit(&a).is_ok());
    }
}
