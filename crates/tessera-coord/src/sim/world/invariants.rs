//! The invariants checked after every event and at the end of a schedule.

use super::*;

impl World {
    pub(super) fn check(&self) -> Result<(), Violation> {
        for (i, r) in self.runs.iter().enumerate() {
            if r.streamed.len() > r.reference.len() {
                return Err(self.violation(
                    Invariant::SameTextAsFaultFree,
                    format!("request {i} streamed too many tokens"),
                ));
            }
        }
        Ok(())
    }

    /// A sequence opened on epoch `epoch`: its cell is ready, every node given the epoch
    /// having reported it linked (a request is never started on a cell still loading).
    pub(super) fn check_routed(&self, epoch: u64) -> Result<(), Violation> {
        let unlinked: Vec<&str> = self
            .given
            .iter()
            .filter(|(n, e)| *e == epoch && !self.linked.contains(&(*n, epoch)))
            .filter_map(|(n, _)| self.index(*n).map(|i| self.nodes[i].name.as_str()))
            .collect();
        if unlinked.is_empty() {
            return Ok(());
        }
        Err(self.violation(
            Invariant::RouteOnlyToReadyCells,
            format!("a sequence was opened on epoch {epoch} before {unlinked:?} linked it"),
        ))
    }

    /// After the world settled: nothing open, nobody lost, nothing held.
    pub(super) fn finish(&mut self) -> Result<(), Violation> {
        // Let sessions settle for a few leases with no faults.
        let until = self.now + self.cfg.lease * 4;
        while let Some((&(t, _), _)) = self.queue.first_key_value() {
            if t > until {
                break;
            }
            let ((t, _), ev) = self.queue.pop_first().expect("peeked");
            self.now = t;
            self.step(ev)?;
        }
        if let Some(i) = self.runs.iter().position(|r| r.ended.is_none()) {
            return Err(self.violation(
                Invariant::EveryRequestEnds,
                format!("request {i} never ended"),
            ));
        }
        for n in self.nodes.iter().filter(|n| n.alive && n.enrolled) {
            let member = self.cluster.membership().member(&n.id);
            if !member.is_some_and(|m| m.connected) {
                return Err(self.violation(
                    Invariant::SettledMembers,
                    format!("{} is up and enrolled but not a connected member", n.name),
                ));
            }
            if !n.seqs.is_empty() {
                return Err(self.violation(
                    Invariant::SettledMembers,
                    format!(
                        "{} still holds sequences {:?} after every request ended",
                        n.name,
                        n.seqs.keys().collect::<Vec<_>>()
                    ),
                ));
            }
        }
        Ok(())
    }
}
