//! The hit rate a node's memory budget allows its expert cache: what decides a node streaming
//! experts from its disk. A node holding all but a share `d` of its experts in memory reads the
//! others from disk when a token routes to them. Under uniform routing (every expert as likely
//! as any other, every token) it misses `d` of its expert reads. Real routing repeats experts
//! (a few are hot, consecutive tokens pick alike), and a cache keeping the recently and often
//! used ones misses less: `d^reuse`, with `reuse` ≥ 1 the workload's ([`Policy::expert_reuse`],
//! fitted to what streaming nodes' caches measured: `crate::fit_expert_reuse`).
//!
//! [`Policy::expert_reuse`]: crate::resources::Policy::expert_reuse

/// The largest reuse a policy may state (and calibration may find): at 64 a cache missing a
/// share of 0.9 by chance misses 0.1%.
pub const MAX_EXPERT_REUSE: f64 = 64.0;

/// The share of expert reads that miss a cache holding all but `on_disk` of the experts, under
/// routing of `reuse` (1 = uniform: exactly `on_disk`).
pub fn expert_miss_share(on_disk: f64, reuse: f64) -> f64 {
    on_disk
        .clamp(0.0, 1.0)
        .powf(reuse.clamp(1.0, MAX_EXPERT_REUSE))
}

/// What the bytes a step reads from the disk share `on_disk` of an expert chunk become under
/// `reuse`: its misses over uniform routing's (1 when uniform, less as routing repeats).
pub(super) fn disk_read_factor(on_disk: f64, reuse: f64) -> f64 {
    if on_disk <= 0.0 {
        return 1.0;
    }
    expert_miss_share(on_disk, reuse) / on_disk.min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_routing_misses_the_share_left_on_disk() {
        for d in [0.0, 0.22, 0.78, 1.0] {
            assert!((expert_miss_share(d, 1.0) - d).abs() < 1e-12);
            if d > 0.0 {
                assert!((disk_read_factor(d, 1.0) - 1.0).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn routing_that_repeats_experts_misses_less_the_more_is_cached() {
        // The scenario's board: 300 MiB of budget for a 724 MiB model, 506 of its 648 MiB of
        // experts on disk (78%).
        let d = 506.0 / 648.0;
        let uniform = expert_miss_share(d, 1.0);
        let hot = expert_miss_share(d, 8.0);
        assert!(hot < uniform / 5.0, "{hot} vs {uniform}");
        // More cached (less on disk): fewer misses, at any reuse.
        assert!(expert_miss_share(0.5, 8.0) < hot);
        // Nothing on disk misses nothing; everything on disk misses everything.
        assert_eq!(expert_miss_share(0.0, 8.0), 0.0);
        assert_eq!(expert_miss_share(1.0, 8.0), 1.0);
        // Out-of-range reuse is held to [1, MAX]: never more misses than chance.
        assert_eq!(expert_miss_share(d, 0.5), uniform);
    }
}
