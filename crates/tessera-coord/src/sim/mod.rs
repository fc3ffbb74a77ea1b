//! A deterministic cluster simulator: the coordinator's own composition, the very
//! [`crate::cluster::Cluster`] the runtime drives (membership with its leases, cells, sessions,
//! one run machine per request, its timer table), driven over an in-memory network of simulated
//! nodes, in virtual time, from a seed.
//!
//! Each seed draws a schedule — nodes, a stage count, in about a fifth of them an expert split
//! (every node owns a share of each MoE layer's experts; nodes outside the ring hold experts
//! only), in about three in ten sealed jobs beside the runs (most nodes are also sealed
//! workers, and a client submits jobs to the same cluster while the runs stream; see
//! `world/jobs.rs`), requests arriving over time, and faults:
//! kills and restarts, freezes longer or shorter than a lease, partitions of one node, slow
//! links, late joins, coordinator restarts, and enrolled members that forge tokens, finishes and
//! load failures for runs and epochs that are not theirs — and the world runs it event by event. After every
//! event the invariants are checked:
//!
//! - every token a request streams is the next token of a fault-free run of it, at the right
//!   position; every request ends with exactly that text, or an explicit error;
//! - epoch numbers never go backwards (coordinator restarts included);
//! - every epoch of an expert split links with each expert of every layer held by exactly one
//!   of its nodes, however many owners left before it was planned;
//! - the coordinator never opens a sequence on a node for an epoch it did not give that node;
//! - a request is routed only to a ready cell: no sequence is opened on an epoch before every
//!   node given it reported it linked;
//! - at the end, once every fault has healed: every request has ended, no node that enrolled is
//!   missing from the membership, and no node holds a sequence (KV accounting back to zero);
//! - with sealed jobs, the sealed invariants as well (`sealed.rs` lists them), on every output
//!   of the desk; a job whose holder's node died or froze moves on once the coordinator's lease
//!   of that node runs out.
//!
//! Schedules of sealed jobs alone, with more workers and fates of their own, are `sealed.rs`'s;
//! both kinds share the workers, the client and the checks of `jobs.rs`.
//!
//! What is simulated and what is real: the coordinator's decisions and their wiring are the real
//! code (the world only carries the cluster's outputs over its network and fires its timeouts
//! at [`crate::cluster::Cluster::poll_timeout`]); the nodes
//! are a model of the node agent's control protocol (assign, load, link, open, start, close,
//! release, heartbeats; a node whose session ends drops its assignment and sequences, as the
//! agent does), and the ring computes tokens with a deterministic stand-in for a model whose
//! next token depends only on the sequence so far and the seed, as the engine's do. A sealed
//! worker is a model of its node too: it opens the envelopes sealed to its key and seals its
//! answers back (the sealing is real), and it runs, freezes and dies with its node. Control
//! streams are reliable and ordered, as QUIC's are: a partition delays messages; a closed
//! session drops them.
//!
//! A failing seed replays exactly: `TESSERA_SIM_SEED=N cargo test -p tessera-coord sim::`.

mod jobs;
mod node;
mod sealed;
#[cfg(test)]
mod tests;
mod violation;
mod world;

pub use jobs::SealedSummary;
pub use sealed::{simulate_sealed, SealedSimConfig};
pub use violation::{Invariant, Violation};
pub use world::{simulate, Config, Summary};

/// splitmix64: a small, seedable generator (the simulator must not depend on the OS).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` (`lo` when the range is empty).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.next_u64() % (hi - lo)
        }
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.range(0, 100) < percent
    }
}

/// The stand-in model: the next token of a sequence depends only on the seed and the tokens so
/// far, as a real model's greedy or seeded draw does.
pub fn next_token(seed: u64, history: &[u32], vocab: u32) -> u32 {
    let mut h = seed ^ 0xA076_1D64_78BD_642F;
    for &t in history {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01B3);
        h ^= h >> 29;
    }
    (Rng(h).next_u64() % u64::from(vocab)) as u32
}
