//! What the gate holds that changes while the coordinator runs: the enrolments in progress
//! ([`crate::enrolling`]'s table), each client's runs in flight, and each key's open
//! connections. The core task owns the [`Door`] as it owns the cluster and the enrolment records
//! ([`crate::shared::Core`]), so that a revocation, the closing of the key's connections and the
//! admissions after it are steps in one order. The places it hands out ([`RunPermit`],
//! [`EnrolmentSlot`]) give themselves back when dropped, by a [`DoorNote`] to the core task's
//! inbox ([`Notes`]), wherever they are dropped.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use tessera_net::{Connection, NodeId};
use tokio::sync::oneshot;

use crate::authz::{MAX_CLIENT_RUNS, MAX_RUNS_PER_CLIENT};
use crate::enrolling::{EnrolmentSlots, Opened, SlotId};

/// Where a place sends its [`DoorNote`]: the core task's inbox.
pub(crate) type Notes = Arc<dyn Fn(DoorNote) + Send + Sync>;

/// A place given back, or an enrolment's claim arrived: news for the [`Door`] from the tasks
/// that hold its places.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DoorNote {
    RunEnded { client: NodeId },
    EnrolmentClaimed(SlotId),
    EnrolmentClosed(SlotId),
}

/// The gate's changing state (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct Door {
    enrolling: EnrolmentSlots,
    /// For each silent enrolment, how to tell its task it was evicted (dropping the sender).
    evictions: HashMap<SlotId, oneshot::Sender<()>>,
    /// Runs in flight per client, and in all.
    runs: HashMap<NodeId, usize>,
    runs_in_all: usize,
    /// Every open connection of each key (a key may hold several: a node's and a client's
    /// sessions, a client run twice), so that a revocation ends them all.
    conns: HashMap<NodeId, Vec<Connection>>,
}

impl Door {
    /// Applies a note from a place's holder.
    pub fn note(&mut self, note: DoorNote) {
        match note {
            DoorNote::RunEnded { client } => {
                if let Some(n) = self.runs.get_mut(&client) {
                    *n -= 1;
                    self.runs_in_all -= 1;
                    if *n == 0 {
                        self.runs.remove(&client);
                    }
                }
            }
            DoorNote::EnrolmentClaimed(id) => {
                self.enrolling.claimed(id);
                self.evictions.remove(&id);
            }
            DoorNote::EnrolmentClosed(id) => {
                self.enrolling.close(id);
                self.evictions.remove(&id);
            }
        }
    }

    /// A place for one client run, or `None` when `client` has [`MAX_RUNS_PER_CLIENT`] in
    /// flight or all clients [`MAX_CLIENT_RUNS`].
    pub fn admit_run(&mut self, client: NodeId, notes: &Notes) -> Option<RunPermit> {
        let n = self.runs.get(&client).copied().unwrap_or(0);
        if n >= MAX_RUNS_PER_CLIENT || self.runs_in_all >= MAX_CLIENT_RUNS {
            return None;
        }
        *self.runs.entry(client).or_insert(0) += 1;
        self.runs_in_all += 1;
        Some(RunPermit {
            client,
            notes: notes.clone(),
        })
    }

    /// A place for one enrolment in progress (an unknown key proving a token) from `ip`, or
    /// `None` when every place it could take is being judged ([`crate::enrolling`]: silent
    /// enrolments give way to newcomers, whose tasks are told now).
    pub fn open_enrolment(&mut self, ip: IpAddr, notes: &Notes) -> Option<EnrolmentSlot> {
        match self.enrolling.open(ip) {
            Opened::Refused => None,
            Opened::Admitted { id, evicted } => {
                for e in evicted {
                    // Dropping the sender wakes the evicted task.
                    self.evictions.remove(&e);
                }
                let (tx, rx) = oneshot::channel();
                self.evictions.insert(id, tx);
                Some(EnrolmentSlot {
                    id,
                    notes: notes.clone(),
                    evicted: rx,
                })
            }
        }
    }

    /// Enrolments in progress.
    #[cfg(test)]
    pub fn enrolling(&self) -> usize {
        self.enrolling.len()
    }

    /// Remembers `conn` among its key's open connections (the closed ones are forgotten).
    pub fn track(&mut self, conn: &Connection) {
        self.conns.retain(|_, v| {
            v.retain(|c| c.quinn().close_reason().is_none());
            !v.is_empty()
        });
        self.conns
            .entry(conn.peer_id())
            .or_default()
            .push(conn.clone());
    }

    /// Ends every open connection of a revoked key; how many there were.
    pub fn disconnect(&mut self, node: &NodeId, reason: &str) -> usize {
        let conns = self.conns.remove(node).unwrap_or_default();
        for c in &conns {
            c.close(reason);
        }
        conns.len()
    }
}

/// A client run's place ([`Door::admit_run`]); given back when dropped.
pub struct RunPermit {
    client: NodeId,
    notes: Notes,
}

impl std::fmt::Debug for RunPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunPermit")
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

impl Drop for RunPermit {
    fn drop(&mut self) {
        (self.notes)(DoorNote::RunEnded {
            client: self.client,
        });
    }
}

/// One enrolment's place ([`Door::open_enrolment`]); given back when dropped.
pub struct EnrolmentSlot {
    id: SlotId,
    notes: Notes,
    evicted: oneshot::Receiver<()>,
}

impl EnrolmentSlot {
    /// Resolves when a newcomer took this place (the enrolment should give up).
    pub async fn evicted(&mut self) {
        let _ = (&mut self.evicted).await;
    }

    /// The claim arrived: the place is no longer evicted.
    pub fn claimed(&self) {
        (self.notes)(DoorNote::EnrolmentClaimed(self.id));
    }
}

impl std::fmt::Debug for EnrolmentSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnrolmentSlot")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Drop for EnrolmentSlot {
    fn drop(&mut self) {
        (self.notes)(DoorNote::EnrolmentClosed(self.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enrolling::MAX_ENROLLING_PER_ADDRESS;
    use tessera_net::NodeIdentity;
    use tokio::sync::mpsc;

    /// Notes that wait in a channel, as they do in the core's inbox.
    fn notes() -> (Notes, mpsc::UnboundedReceiver<DoorNote>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Arc::new(move |n| tx.send(n).unwrap()), rx)
    }

    /// Carries the notes sent so far to the door, as the core task does.
    fn deliver(door: &mut Door, rx: &mut mpsc::UnboundedReceiver<DoorNote>) -> usize {
        let mut n = 0;
        while let Ok(note) = rx.try_recv() {
            door.note(note);
            n += 1;
        }
        n
    }

    fn id() -> NodeId {
        NodeIdentity::generate().unwrap().node_id()
    }

    #[test]
    fn a_client_holds_at_most_its_share_of_run_places_and_dropped_places_come_back() {
        let (inbox, mut rx) = notes();
        let mut door = Door::default();
        let greedy = id();
        let held: Vec<_> = (0..100)
            .filter_map(|_| door.admit_run(greedy, &inbox))
            .collect();
        assert_eq!(held.len(), MAX_RUNS_PER_CLIENT);
        // Others still get theirs, up to the total.
        let others: Vec<_> = (0..100)
            .filter_map(|_| door.admit_run(id(), &inbox))
            .collect();
        assert_eq!(others.len(), MAX_CLIENT_RUNS - MAX_RUNS_PER_CLIENT);
        assert!(door.admit_run(id(), &inbox).is_none(), "all places held");
        drop(held);
        // Not back until the core hears of it.
        assert!(door.admit_run(greedy, &inbox).is_none());
        assert_eq!(deliver(&mut door, &mut rx), MAX_RUNS_PER_CLIENT);
        assert!(
            door.admit_run(greedy, &inbox).is_some(),
            "places are given back"
        );
        drop(others);
        deliver(&mut door, &mut rx);
        assert_eq!(door.runs_in_all, 0);
        assert!(
            door.runs.is_empty(),
            "no client is remembered with nothing in flight"
        );
    }

    #[tokio::test]
    async fn an_evicted_enrolment_is_told_and_a_dropped_one_gives_its_place_back() {
        let (inbox, mut rx) = notes();
        let mut door = Door::default();
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let mut first = door.open_enrolment(ip, &inbox).unwrap();
        let others: Vec<_> = (0..MAX_ENROLLING_PER_ADDRESS)
            .map(|_| door.open_enrolment(ip, &inbox).unwrap())
            .collect();
        tokio::time::timeout(std::time::Duration::from_secs(5), first.evicted())
            .await
            .expect("told");
        drop(first);
        deliver(&mut door, &mut rx);
        assert_eq!(door.enrolling(), MAX_ENROLLING_PER_ADDRESS);
        // A claimed place is not evicted by newcomers.
        others[0].claimed();
        deliver(&mut door, &mut rx);
        let later: Vec<_> = (0..MAX_ENROLLING_PER_ADDRESS * 3)
            .filter_map(|_| door.open_enrolment(ip, &inbox))
            .collect();
        assert!(door.evictions.contains_key(&later.last().unwrap().id));
        assert!(!door.evictions.contains_key(&others[0].id));
        drop((others, later));
        deliver(&mut door, &mut rx);
        assert_eq!(door.enrolling(), 0);
        assert!(door.evictions.is_empty());
    }
}
