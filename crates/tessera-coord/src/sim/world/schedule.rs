//! Drawing a seed's fault schedule: which requests, kills, freezes, partitions, slow links,
//! late joins, coordinator restarts and forged messages happen, and when.

use super::*;

impl World {
    pub(super) fn draw_schedule(&mut self) {
        let n = self.nodes.len();
        // Most nodes start at once; some join late.
        for i in 0..n {
            let t = if i > 0 && self.rng.chance(20) {
                self.ms(500, 15_000)
            } else {
                self.ms(0, 50)
            };
            self.at(t, Ev::Fault(FaultKind::Join(i)));
        }
        self.schedule_wake();
        let requests = self.rng.range(1, 6) as usize;
        for r in 0..requests {
            let prompt: Vec<u32> = (0..self.rng.range(1, 8))
                .map(|_| self.rng.range(1, u64::from(VOCAB)) as u32)
                .collect();
            let max_new = self.rng.range(1, 24) as usize;
            let sampling = tessera_sampling::SamplingParams {
                seed: self.rng.next_u64(),
                ..Default::default()
            };
            let eog = if self.rng.chance(50) {
                vec![EOG]
            } else {
                vec![]
            };
            let spec = RunSpec::new(prompt, VOCAB as usize, sampling, max_new, eog)
                .expect("drawn requests are valid");
            let reference = reference(&spec);
            self.runs.push(SimRun {
                spec,
                submitted: false,
                reference,
                streamed: Vec::new(),
                ended: None,
            });
            let t = self.ms(100, 12_000);
            self.at(t, Ev::Submit { run: r });
        }
        self.summary.requests = requests;
        let faults = self.rng.range(0, 5);
        for _ in 0..faults {
            let t = self.ms(200, self.cfg.fault_horizon.as_millis() as u64);
            let node = self.rng.range(0, n as u64) as usize;
            let lease_ms = self.cfg.lease.as_millis() as u64;
            let kind = match self.rng.range(0, 7) {
                0 => FaultKind::Kill(node),
                1 => FaultKind::Freeze(node, self.ms(lease_ms / 4, lease_ms * 3)),
                2 => FaultKind::Partition(node, self.ms(lease_ms / 4, lease_ms * 4)),
                3 => FaultKind::SlowLinks(self.ms(5, 80)),
                4 => FaultKind::CoordinatorRestart,
                5 => FaultKind::Forge(node),
                _ => FaultKind::Freeze(node, self.ms(10, lease_ms / 2)),
            };
            self.at(t, Ev::Fault(kind));
            if let FaultKind::Kill(node) = kind {
                let back = t + self.ms(100, 8_000);
                self.at(back, Ev::Fault(FaultKind::Restart(node)));
            }
        }
        self.summary.faults = faults as usize;
    }

    // ---- the loop ------------------------------------------------------------------------
}
