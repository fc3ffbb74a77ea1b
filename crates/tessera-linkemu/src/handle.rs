//! The control API: [`LinkHandle`] changes the shape of a running link ([`LinkHandle::set`],
//! [`LinkHandle::partition`], [`LinkHandle::heal`]) and reads its counters
//! ([`LinkHandle::stats`]). The shape and the counters live in one `Shared` value that the relay
//! tasks read for every datagram, so a new shape applies to the datagrams that enter from then
//! on, and a partition also drops those already in flight.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::shape::{Direction, LinkShape};
use crate::stats::{Counters, LinkStats};

pub(crate) struct Shared {
    pub(crate) shape: RwLock<LinkShape>,
    pub(crate) counters: [Counters; 2],
    pub(crate) associations: AtomicU64,
}

impl Shared {
    pub(crate) fn shape(&self) -> LinkShape {
        *self.shape.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn counters(&self, dir: Direction) -> &Counters {
        &self.counters[dir.index()]
    }
}

/// Changes the link's shape while it runs and reads its counters. Cheap to clone.
#[derive(Clone)]
pub struct LinkHandle {
    pub(crate) shared: Arc<Shared>,
}

impl fmt::Debug for LinkHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkHandle")
            .field("shape", &self.shape())
            .finish()
    }
}

impl LinkHandle {
    /// Replaces the shape; datagrams that enter from now on see it (a partition also drops those
    /// already in flight).
    pub fn set(&self, shape: LinkShape) {
        *self.shared.shape.write().unwrap_or_else(|e| e.into_inner()) = shape;
    }

    /// Edits the shape in place.
    pub fn update(&self, f: impl FnOnce(&mut LinkShape)) {
        f(&mut self.shared.shape.write().unwrap_or_else(|e| e.into_inner()));
    }

    /// The current shape.
    pub fn shape(&self) -> LinkShape {
        self.shared.shape()
    }

    /// Drops everything both ways, including datagrams already in flight, until [`Self::heal`].
    pub fn partition(&self) {
        self.update(|s| s.partitioned = true);
    }

    /// Ends a partition.
    pub fn heal(&self) {
        self.update(|s| s.partitioned = false);
    }

    /// Whether the link is partitioned.
    pub fn is_partitioned(&self) -> bool {
        self.shape().partitioned
    }

    /// Counters since start.
    pub fn stats(&self) -> LinkStats {
        LinkStats {
            to_upstream: self.shared.counters(Direction::ToUpstream).snapshot(),
            to_client: self.shared.counters(Direction::ToClient).snapshot(),
            associations: self.shared.associations.load(Ordering::Relaxed),
        }
    }
}
