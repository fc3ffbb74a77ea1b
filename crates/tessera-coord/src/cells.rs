//! Routing whole requests to cells: pure.
//!
//! A cell is one complete copy of the model (a single node, a stage ring, or an expert split),
//! an epoch of its own in the [`crate::membership`]. Each request is sent whole to one ready
//! cell, which batches it with the others it serves; a request never starts a download (only
//! ready cells are candidates) and never moves while it runs, unless its cell is lost (then it
//! resumes on another, with identical text).
//!
//! The choice, for a request that needs `positions` of KV cache:
//! 1. **Hard filter: free memory.** Every node of the cell must have room for the request's KV
//!    on the layers it holds: its budget, less the weights it keeps resident, less the KV
//!    reserved by the requests already seated on the cell (each at its full length, prompt plus
//!    the most tokens it may generate, so a seated request never runs out). A node with no
//!    known budget is not limited.
//! 2. **Score: expected wait.** `(seated + 1) / speed + latency`, where speed is the cell's
//!    measured decode tokens/s (a moving average over its finished requests), or the mean of
//!    the measured cells for a cell not measured yet (1 when none is), and latency is the
//!    coordinator's measured round trip to the cell's farthest node (what every token of the
//!    request pays to reach the client). Ties go to the fewer seated, then to the older cell.
//!
//! [`CellBook`] keeps the seats and speeds; [`choose`] decides from a snapshot of both.

use std::collections::BTreeMap;

use tessera_net::NodeId;

use crate::fault::Fault;
use crate::membership::{Member, Membership, Phase};

/// Weight of a new measurement in a cell's speed average, for a request of at least
/// [`FULL_SAMPLE_TOKENS`] decoded tokens.
const SPEED_WEIGHT: f64 = 0.3;

/// Decoded tokens a request needs for its speed to count fully; a shorter one counts in
/// proportion. A few tokens' rate is mostly the first step's and the scheduler's noise (on a
/// host with a CPU quota, whether the request met a throttled period), and equal cells whose
/// short warm-up requests measured 7 and 12 tok/s would be sent requests 1 : 3 for it.
///
/// The same weights make a cell's *confidence*: the sum of its requests' weights, up to 1. The
/// score uses a cell's speed only in proportion to its confidence and the mean of the measured
/// cells for the rest, so a cell known from one short request is taken as an average cell.
const FULL_SAMPLE_TOKENS: f64 = 32.0;

/// A cell's measured decode speed and how much evidence it rests on.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Speed {
    tokens_per_s: f64,
    /// Sum of the measurements' weights (a request of [`FULL_SAMPLE_TOKENS`] or more weighs
    /// 1), at most 1.
    confidence: f64,
}

/// One node of a candidate cell, as the filter sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct CellNode {
    pub node_id: NodeId,
    /// Layers of the model it holds (KV grows on these).
    pub layers: usize,
    /// Bytes it may use (`None`: unknown, not limited).
    pub budget_bytes: Option<u64>,
    /// Weights it keeps resident.
    pub resident_bytes: u64,
}

/// A ready cell, with the load on it.
#[derive(Clone, Debug, PartialEq)]
pub struct CellLoad {
    pub epoch: u64,
    pub nodes: Vec<CellNode>,
    /// Requests seated on it now.
    pub seated: usize,
    /// KV positions those requests reserved.
    pub reserved_positions: u64,
    /// Measured decode tokens/s, drawn towards the measured cells' mean while it rests on
    /// little evidence (`None`: no request has finished on it yet).
    pub speed: Option<f64>,
    /// Seconds of the coordinator's round trip to its farthest node (0: not measured).
    pub latency_s: f64,
}

impl CellLoad {
    /// Whether every node has room for `positions` more of KV at `kv_bytes` per position per
    /// layer.
    pub fn fits(&self, positions: u64, kv_bytes: u64) -> bool {
        self.nodes.iter().all(|n| match n.budget_bytes {
            None | Some(0) => true,
            Some(budget) => {
                let per_position = n.layers as u64 * kv_bytes;
                let used = n.resident_bytes + self.reserved_positions * per_position;
                used + positions * per_position <= budget
            }
        })
    }
}

/// Why no cell was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoCell {
    /// No cell is ready (or the only ready ones were excluded).
    NoneReady,
    /// Cells are ready, but none has room for the request's KV now: it waits for one to free.
    NoneFits { positions: u64 },
    /// No ready cell would have room for the request's KV even with nothing else seated on it.
    TooBig { positions: u64 },
}

impl std::fmt::Display for NoCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoneReady => f.write_str("no cell is ready"),
            Self::NoneFits { positions } => write!(
                f,
                "no cell has room for {positions} positions of KV cache until a request ends"
            ),
            Self::TooBig { positions } => write!(
                f,
                "the request needs {positions} positions of KV cache (its prompt and max \
                 tokens), more than any cell's memory budget leaves room for; ask for fewer \
                 tokens"
            ),
        }
    }
}

/// The cell to send a request needing `positions` of KV to, among `cells` (see the module
/// docs), never `exclude` (the cell a resumed request was lost on).
pub fn choose(
    cells: &[CellLoad],
    positions: u64,
    kv_bytes: u64,
    exclude: Option<u64>,
) -> Result<u64, NoCell> {
    let candidates: Vec<&CellLoad> = cells.iter().filter(|c| Some(c.epoch) != exclude).collect();
    if candidates.is_empty() {
        return Err(NoCell::NoneReady);
    }
    let measured: Vec<f64> = candidates.iter().filter_map(|c| c.speed).collect();
    let default_speed = if measured.is_empty() {
        1.0
    } else {
        measured.iter().sum::<f64>() / measured.len() as f64
    };
    let wait = |c: &CellLoad| {
        (c.seated + 1) as f64 / c.speed.unwrap_or(default_speed).max(1e-9) + c.latency_s
    };
    let idle_fit = |c: &CellLoad| {
        CellLoad {
            reserved_positions: 0,
            ..c.clone()
        }
        .fits(positions, kv_bytes)
    };
    if !candidates.iter().any(|c| idle_fit(c)) {
        return Err(NoCell::TooBig { positions });
    }
    candidates
        .into_iter()
        .filter(|c| c.fits(positions, kv_bytes))
        .min_by(|a, b| {
            wait(a)
                .total_cmp(&wait(b))
                .then(a.seated.cmp(&b.seated))
                .then(a.epoch.cmp(&b.epoch))
        })
        .map(|c| c.epoch)
        .ok_or(NoCell::NoneFits { positions })
}

/// A request seated on a cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seat {
    epoch: u64,
    positions: u64,
}

/// The requests seated on each cell and each cell's measured speed.
#[derive(Clone, Debug, Default)]
pub struct CellBook {
    seats: BTreeMap<u64, Seat>,
    speed: BTreeMap<u64, Speed>,
    /// A test-only fault ([`Fault::RouteToUnreadyCells`]).
    fault: Option<Fault>,
}

impl CellBook {
    /// Plants a deliberate bug, so the simulator can show it catches it.
    #[cfg(test)]
    pub fn inject_fault(&mut self, fault: Option<Fault>) {
        self.fault = fault;
    }

    /// Seats request `seq` on cell `epoch`, reserving `positions` of KV (moving it if it was
    /// seated elsewhere).
    pub fn seat(&mut self, seq: u64, epoch: u64, positions: u64) {
        self.seats.insert(seq, Seat { epoch, positions });
    }

    /// Request `seq` left its cell (it ended, or its cell was lost).
    pub fn unseat(&mut self, seq: u64) -> bool {
        self.seats.remove(&seq).is_some()
    }

    /// Requests seated on cell `epoch`.
    pub fn seated(&self, epoch: u64) -> usize {
        self.seats.values().filter(|s| s.epoch == epoch).count()
    }

    /// KV positions reserved on cell `epoch`.
    pub fn reserved_positions(&self, epoch: u64) -> u64 {
        self.seats
            .values()
            .filter(|s| s.epoch == epoch)
            .map(|s| s.positions)
            .sum()
    }

    /// A request on cell `epoch` decoded `tokens` in `secs`.
    pub fn measured(&mut self, epoch: u64, tokens: usize, secs: f64) {
        let tokens_per_s = tokens as f64 / secs;
        if !(tokens_per_s.is_finite() && tokens_per_s > 0.0) {
            return;
        }
        let sample = (tokens as f64 / FULL_SAMPLE_TOKENS).min(1.0);
        let s = self.speed.entry(epoch).or_insert(Speed {
            tokens_per_s,
            confidence: 0.0,
        });
        s.tokens_per_s += SPEED_WEIGHT * sample * (tokens_per_s - s.tokens_per_s);
        s.confidence = (s.confidence + sample).min(1.0);
    }

    /// Cell `epoch`'s measured decode tokens/s.
    pub fn speed(&self, epoch: u64) -> Option<f64> {
        self.speed.get(&epoch).map(|s| s.tokens_per_s)
    }

    /// The speeds the score uses: each measured cell's own in proportion to its confidence,
    /// the mean of the measured cells' for the rest.
    fn scored_speeds(&self) -> BTreeMap<u64, f64> {
        if self.speed.is_empty() {
            return BTreeMap::new();
        }
        let mean =
            self.speed.values().map(|s| s.tokens_per_s).sum::<f64>() / self.speed.len() as f64;
        self.speed
            .iter()
            .map(|(&e, s)| {
                (
                    e,
                    s.confidence * s.tokens_per_s + (1.0 - s.confidence) * mean,
                )
            })
            .collect()
    }

    /// Forgets the speeds of cells that are no longer in `live` (their epochs ended).
    pub fn retain_cells(&mut self, live: &[u64]) {
        self.speed.retain(|e, _| live.contains(e));
    }

    /// The ready cells of `m` with their loads (one pass over the seats: this runs for every
    /// request).
    pub fn loads(&self, m: &Membership) -> Vec<CellLoad> {
        let mut seats: BTreeMap<u64, (usize, u64)> = BTreeMap::new();
        for s in self.seats.values() {
            let e = seats.entry(s.epoch).or_default();
            e.0 += 1;
            e.1 += s.positions;
        }
        let speeds = self.scored_speeds();
        // Only ready cells are candidates (the planted bug takes cells still being made too).
        let unready = self.fault == Some(Fault::RouteToUnreadyCells);
        m.cells()
            .iter()
            .filter(|e| {
                e.phase == Phase::Ready
                    || (unready && matches!(e.phase, Phase::Loading | Phase::Linking))
            })
            .map(|e| CellLoad {
                epoch: e.id,
                nodes: e
                    .stages
                    .iter()
                    .map(|s| CellNode {
                        node_id: s.node_id,
                        layers: s.layers.len(),
                        budget_bytes: m.member(&s.node_id).and_then(budget_of),
                        resident_bytes: s.loaded.as_ref().map_or(0, |l| l.resident_bytes),
                    })
                    .collect(),
                seated: seats.get(&e.id).map_or(0, |s| s.0),
                reserved_positions: seats.get(&e.id).map_or(0, |s| s.1),
                speed: speeds.get(&e.id).copied(),
                latency_s: e
                    .stages
                    .iter()
                    .filter_map(|s| m.member(&s.node_id)?.link)
                    .map(|l| l.rtt_median.as_secs_f64())
                    .fold(0.0, f64::max),
            })
            .collect()
    }
}

/// A node's budget: the one it set, else what it measured as available when it started.
pub fn budget_of(m: &Member) -> Option<u64> {
    m.memory_budget_bytes
        .or_else(|| m.inventory.as_ref().and_then(|i| i.memory.available_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(i: u8, layers: usize, budget: Option<u64>, resident: u64) -> CellNode {
        CellNode {
            node_id: tessera_net::NodeIdentity::from_seed([i; 32]).node_id(),
            layers,
            budget_bytes: budget,
            resident_bytes: resident,
        }
    }

    fn cell(epoch: u64, seated: usize, speed: Option<f64>) -> CellLoad {
        CellLoad {
            epoch,
            nodes: vec![node(epoch as u8, 4, None, 0)],
            seated,
            reserved_positions: 0,
            speed,
            latency_s: 0.0,
        }
    }

    #[test]
    fn requests_spread_over_equal_cells_by_what_is_seated() {
        let mut book = CellBook::default();
        let cells = |book: &CellBook| -> Vec<CellLoad> {
            [1, 2, 3]
                .iter()
                .map(|&e| cell(e, book.seated(e), None))
                .collect()
        };
        let mut chosen = Vec::new();
        for seq in 0..6 {
            let e = choose(&cells(&book), 10, 1, None).unwrap();
            book.seat(seq, e, 10);
            chosen.push(e);
        }
        assert_eq!(chosen, vec![1, 2, 3, 1, 2, 3]);
        assert!(book.unseat(1));
        assert!(!book.unseat(1), "a request leaves once");
        assert_eq!(choose(&cells(&book), 10, 1, None), Ok(2));
    }

    #[test]
    fn a_faster_cell_takes_more_requests() {
        // Cell 2 decodes three times as fast: it is worth seating up to three there per one
        // on cell 1.
        let cells = [cell(1, 1, Some(10.0)), cell(2, 2, Some(30.0))];
        assert_eq!(choose(&cells, 1, 1, None), Ok(2));
        let cells = [cell(1, 1, Some(10.0)), cell(2, 6, Some(30.0))];
        assert_eq!(choose(&cells, 1, 1, None), Ok(1));
        // A cell not measured yet is taken to be as fast as the mean of the others.
        let cells = [cell(1, 1, Some(10.0)), cell(2, 0, None)];
        assert_eq!(choose(&cells, 1, 1, None), Ok(2));
    }

    #[test]
    fn a_far_cell_is_worth_fewer_requests_than_a_near_one() {
        // Equal speeds (10 tok/s); cell 2 is 200 ms away: one more request seated on cell 1
        // costs 100 ms of expected wait, so cell 1 takes the next two before cell 2 takes one.
        let far = |seated| CellLoad {
            latency_s: 0.2,
            ..cell(2, seated, Some(10.0))
        };
        assert_eq!(choose(&[cell(1, 0, Some(10.0)), far(0)], 1, 1, None), Ok(1));
        assert_eq!(choose(&[cell(1, 1, Some(10.0)), far(0)], 1, 1, None), Ok(1));
        assert_eq!(choose(&[cell(1, 3, Some(10.0)), far(0)], 1, 1, None), Ok(2));
    }

    #[test]
    fn free_kv_is_a_hard_filter_whatever_the_score() {
        // Node budgets of 1,000 bytes, 100 resident, 4 layers at 10 bytes a position-layer:
        // 40 bytes a position, room for 22 positions.
        let small = |epoch: u64, reserved: u64| CellLoad {
            epoch,
            nodes: vec![node(epoch as u8, 4, Some(1000), 100)],
            seated: 0,
            reserved_positions: reserved,
            speed: Some(100.0),
            latency_s: 0.0,
        };
        assert!(small(1, 0).fits(22, 10));
        assert!(!small(1, 0).fits(23, 10));
        assert!(!small(1, 10).fits(13, 10));
        // The idle fast cell has no room left: the busy slow one is chosen.
        let cells = [small(1, 20), cell(2, 5, Some(1.0))];
        assert_eq!(choose(&cells, 5, 10, None), Ok(2));
        // No cell with room: the request waits.
        assert_eq!(
            choose(&[small(1, 20)], 5, 10, None),
            Err(NoCell::NoneFits { positions: 5 })
        );
        // Room for no request that long even on an idle cell: it is refused, not kept waiting.
        let refused = choose(&[small(1, 20)], 23, 10, None);
        assert_eq!(refused, Err(NoCell::TooBig { positions: 23 }));
    }

    #[test]
    fn a_resumed_request_never_goes_back_to_the_cell_it_lost() {
        let cells = [cell(1, 0, None), cell(2, 9, None)];
        assert_eq!(choose(&cells, 1, 1, Some(1)), Ok(2));
        assert_eq!(choose(&cells[..1], 1, 1, Some(1)), Err(NoCell::NoneReady));
        assert_eq!(choose(&[], 1, 1, None), Err(NoCell::NoneReady));
    }

    #[test]
    fn a_cell_known_from_short_requests_is_scored_near_the_mean_of_the_cells() {
        let mut book = CellBook::default();
        // Equal cells whose 4-token warm-ups measured 7 and 12 tok/s.
        book.measured(1, 4, 4.0 / 7.0);
        book.measured(2, 4, 4.0 / 12.0);
        let s = book.scored_speeds();
        // An eighth of each own figure, the rest the mean (9.5).
        assert!((s[&1] - (7.0 / 8.0 + 9.5 * 7.0 / 8.0)).abs() < 1e-9);
        assert!((s[&2] - (12.0 / 8.0 + 9.5 * 7.0 / 8.0)).abs() < 1e-9);
        // Full requests make a cell's own figure count fully.
        for _ in 0..8 {
            book.measured(1, 64, 64.0 / 7.0);
        }
        let s = book.scored_speeds();
        assert!((s[&1] - book.speed(1).unwrap()).abs() < 1e-9);
        assert!(s[&1] < s[&2]);
    }

    #[test]
    fn speeds_are_a_moving_average_of_sane_measurements() {
        let mut book = CellBook::default();
        book.measured(7, 40, 4.0);
        assert_eq!(book.speed(7), Some(10.0));
        book.measured(7, 40, 2.0);
        assert!((book.speed(7).unwrap() - 13.0).abs() < 1e-9);
        book.measured(7, 0, 0.0);
        book.measured(7, 0, 1.0);
        assert!((book.speed(7).unwrap() - 13.0).abs() < 1e-9);
        // Four tokens count an eighth of a full sample.
        book.measured(7, 4, 4.0 / 53.0);
        assert!((book.speed(7).unwrap() - (13.0 + 0.3 / 8.0 * 40.0)).abs() < 1e-9);
        book.retain_cells(&[8]);
        assert_eq!(book.speed(7), None);
    }
}
