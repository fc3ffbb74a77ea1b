//! `tessera lab hop`: the time a hop of a stage ring adds beyond the link's round trip, on a
//! link through the lab's switch and on this machine's loopback.
//!
//! The same model alone on one node (`s0[0..n)`) and as a ring of `stages` equal stages
//! (`s0[0..k) -> s1[k..2k) -> …`, two by default); both do the same layers' work, so the ring's
//! extra time per token is its hops: one one-way link crossing per stage (a token goes round the
//! ring once) plus what the software adds per hop (thread wake-ups, copies, framing, the QUIC
//! stack). That is `((ring − single) − hops × round trip / 2) / hops`, with the round trip
//! measured by UDP echo between two of the hosts just before. Requests alternate between the
//! two placements for `rounds` rounds; medians are taken. The figure also gives the issue's
//! ring goals: the ring's speed against one process, and its cost per token against the link
//! crossings alone.

use std::path::Path;

use serde::Serialize;
use tessera_proto::RunReport;

use super::ring::{median, placements, EqualHosts};
use super::session::{Hosts, Loopback, Mode, Session};
use crate::error::{LabError, Result};
use crate::lab::Lab;
use crate::scenario::Scenario;

/// What `tessera lab hop` measures.
#[derive(Debug, Clone)]
pub struct Options {
    pub model: std::path::PathBuf,
    /// Round trip of the switched link, ms.
    pub rtt_ms: f64,
    /// Stages of the ring (and nodes): 2 or more.
    pub stages: usize,
    pub tokens: usize,
    pub rounds: usize,
    pub threads: usize,
}

/// One link's figure.
#[derive(Debug, Clone, Serialize)]
pub struct HopFigure {
    pub link: String,
    /// The round trip asked of the switch (none on loopback), ms.
    pub requested_rtt_ms: Option<f64>,
    /// Median UDP echo round trip between the two nodes' hosts, ms.
    pub measured_rtt_ms: f64,
    /// Median decode time per token, alone and as a ring, ms.
    pub single_ms_per_token: f64,
    pub ring_ms_per_token: f64,
    /// Stages of the ring, so hops per token.
    pub stages: usize,
    /// The ring's decode speed against one process's: `single / ring` time per token.
    pub ring_vs_single: f64,
    /// The ring's cost per token (`ring − single`) against its link crossings alone
    /// (`hops × round trip / 2`): 1.0 when the software adds nothing.
    pub cost_vs_crossings: f64,
    /// What one hop adds beyond its share of the round trip, µs.
    pub added_per_hop_us: f64,
    /// The fabric's own estimate of one hop's time per token (its report), µs.
    pub reported_hop_us: Option<f64>,
    /// The goal for `added_per_hop_us`, µs.
    pub goal_us: f64,
    /// Where a hop's time goes, from the nodes' own stamps (medians over the ring's runs).
    pub breakdown: Option<HopBreakdown>,
    /// The stages' own decode compute per token, summed over the stages (medians), ms: alone
    /// and in the ring. Their difference is the part of the ring's extra time that is not hops.
    pub compute: Option<(f64, f64)>,
}

/// Decode compute per token summed over a run's stages (each stage's compute over its steps),
/// ms; `None` without stage figures.
fn compute_ms_per_token(report: &RunReport) -> Option<f64> {
    let stats = &report.stage_stats;
    let mut sum = 0.0;
    for s in stats {
        if s.decode.steps == 0 {
            return None;
        }
        sum += s.decode.compute_ns as f64 / s.decode.steps as f64;
    }
    (!stats.is_empty()).then_some(sum / 1e6)
}

/// Where one hop of a ring spends its time, from the stages' [`HopTimes`] of a run: µs per
/// decode frame, averaged over the ring's hops.
///
/// [`HopTimes`]: tessera_proto::HopTimes
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct HopBreakdown {
    /// Encoding the frame (header and hidden state into one payload) on the sender's stage
    /// thread.
    pub serialise_us: f64,
    /// The stage thread's write (until it returns; part of `transit_us`, which starts with it).
    pub send_us: f64,
    /// From the write's start to the frame being read at the next stage: the write, both QUIC
    /// stacks, the kernel, the link and the wake-ups of the sender's QUIC driver and the
    /// receiver's reader (same-host wall clock).
    pub transit_us: f64,
    /// Decoding the payload on the reader task.
    pub decode_us: f64,
    /// From the reader task to the stage thread taking the frame: the queue and the stage
    /// thread's wake-up.
    pub handoff_us: f64,
}

impl HopBreakdown {
    pub fn total_us(&self) -> f64 {
        self.serialise_us + self.transit_us + self.decode_us + self.handoff_us
    }

    /// The breakdown of a ring's run report (`stage_stats[i].hop` of every ring stage); `None`
    /// when a hop's sent and received frames do not pair up (a stage without the stamps).
    pub fn of_report(report: &RunReport) -> Option<Self> {
        let stats = &report.stage_stats;
        let n = report.boundaries.len();
        if n < 2 || stats.len() < n {
            return None;
        }
        let mut sum = Self::default();
        for i in 0..n {
            let (sent, got) = (&stats[i].hop, &stats[(i + 1) % n].hop);
            let frames = sent.frames_out;
            if frames == 0 || got.frames_in != frames {
                return None;
            }
            let f = frames as f64 * 1e3;
            let transit = got.arrived_wall_ns.wrapping_sub(sent.sent_wall_ns) as i64;
            sum.serialise_us += sent.encode_ns as f64 / f;
            sum.send_us += sent.send_ns as f64 / f;
            sum.transit_us += transit as f64 / f;
            sum.decode_us += got.decode_ns as f64 / f;
            sum.handoff_us += got.handoff_ns as f64 / f;
        }
        let k = n as f64;
        Some(Self {
            serialise_us: sum.serialise_us / k,
            send_us: sum.send_us / k,
            transit_us: sum.transit_us / k,
            decode_us: sum.decode_us / k,
            handoff_us: sum.handoff_us / k,
        })
    }

    /// Component-wise medians.
    fn median_of(v: &[Self]) -> Option<Self> {
        if v.is_empty() {
            return None;
        }
        let m = |f: fn(&Self) -> f64| median(v.iter().map(f).collect());
        Some(Self {
            serialise_us: m(|b| b.serialise_us),
            send_us: m(|b| b.send_us),
            transit_us: m(|b| b.transit_us),
            decode_us: m(|b| b.decode_us),
            handoff_us: m(|b| b.handoff_us),
        })
    }
}

/// The goal: a hop adds at most this beyond the link's round trip.
pub const GOAL_US: f64 = 50.0;

/// The scenario the figure is measured on: `o.stages` equal hosts on `rtt_ms` links.
fn scenario(o: &Options, rtt_ms: f64) -> Result<Scenario> {
    EqualHosts {
        file: "hop.toml",
        model: &o.model,
        nodes: o.stages.max(2),
        rtt_ms,
        context: 512,
        tokens: o.tokens,
        threads: o.threads,
        cpu_quota: None,
    }
    .scenario()
}

/// Single node and ring, alternating, on `hosts`: medians of ms per token, the ring's reported
/// hop time and where a hop's time goes.
fn single_and_ring(
    hosts: &impl Hosts,
    tessera: &Path,
    s: &Scenario,
    dir: &Path,
    n_layer: usize,
    stages: usize,
    rounds: usize,
) -> Result<RingRuns> {
    let session = Session::start(hosts, tessera, s, dir, &Mode::ByClient)?;
    let (single, ring) = placements(dir, n_layer, stages)?;
    let prompt = &s.workload.prompt;
    let one = |plan: &Path, n: usize| -> Result<RunReport> {
        Ok(session.clients(hosts, plan, prompt, n, 1)?.remove(0))
    };
    one(&single, 4)?;
    one(&ring, 4)?;
    let (mut a, mut b, mut hop, mut parts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut ca, mut cb) = (Vec::new(), Vec::new());
    let ms = |r: &RunReport| 1e3 / r.decode_tokens_per_s;
    for _ in 0..rounds.max(1) {
        let r = one(&single, s.workload.tokens)?;
        a.push(ms(&r));
        ca.extend(compute_ms_per_token(&r));
        let r = one(&ring, s.workload.tokens)?;
        b.push(ms(&r));
        cb.extend(compute_ms_per_token(&r));
        hop.extend(r.hop_latency_us);
        parts.extend(HopBreakdown::of_report(&r));
    }
    Ok(RingRuns {
        single_ms: median(a),
        ring_ms: median(b),
        reported_hop_us: (!hop.is_empty()).then(|| median(hop)),
        breakdown: HopBreakdown::median_of(&parts),
        compute: (!ca.is_empty() && !cb.is_empty()).then(|| (median(ca), median(cb))),
    })
}

/// The medians of one placement pair's runs.
struct RingRuns {
    single_ms: f64,
    ring_ms: f64,
    reported_hop_us: Option<f64>,
    breakdown: Option<HopBreakdown>,
    compute: Option<(f64, f64)>,
}

/// Measures the hop figure on a `rtt_ms` link through the switch and on loopback.
pub fn run(
    o: &Options,
    tessera: &Path,
    dir: &Path,
    mut progress: impl FnMut(&str),
) -> Result<Vec<HopFigure>> {
    let _copies = super::session::NodeModelCopies::removed_at_end(dir);
    let gguf = tessera_model::GgufFile::open(&o.model).map_err(|e| LabError::model(&o.model, e))?;
    let n_layer = tessera_model::ModelConfig::from_gguf(&gguf)
        .map_err(|e| LabError::model(&o.model, format!("its configuration: {e}")))?
        .n_layer;
    drop(gguf);
    if o.stages < 2 || n_layer < o.stages {
        return Err(LabError::Unrunnable(format!(
            "a ring of {} stages needs at least 2 stages and a model of as many layers (this one \
             has {n_layer})",
            o.stages
        )));
    }
    let mut out = Vec::new();

    let switched = scenario(o, o.rtt_ms)?;
    let lab = Lab::start(&switched.lab_spec()?)?;
    progress(&format!("lab {} up: a {} ms link", lab.id(), o.rtt_ms));
    let rtt = crate::selftest::rtt_between(&lab, 1, 2, 200)?.0;
    let sub = dir.join("switched");
    std::fs::create_dir_all(&sub)
        .map_err(|e| LabError::io(format!("creating {}", sub.display()), e))?;
    let r = single_and_ring(&lab, tessera, &switched, &sub, n_layer, o.stages, o.rounds)?;
    drop(lab);
    out.push(HopFigure {
        breakdown: r.breakdown,
        compute: r.compute,
        ..figure(
            format!("{} ms link through the switch", o.rtt_ms),
            Some(o.rtt_ms),
            rtt,
            (r.single_ms, r.ring_ms, o.stages),
            r.reported_hop_us,
        )
    });

    progress("loopback");
    let local = scenario(o, 0.0)?;
    let rtt = crate::selftest::loopback_rtt(200)?.0;
    let sub = dir.join("loopback");
    std::fs::create_dir_all(&sub)
        .map_err(|e| LabError::io(format!("creating {}", sub.display()), e))?;
    let r = single_and_ring(
        &Loopback, tessera, &local, &sub, n_layer, o.stages, o.rounds,
    )?;
    out.push(HopFigure {
        breakdown: r.breakdown,
        compute: r.compute,
        ..figure(
            "loopback (127.0.0.1)".into(),
            None,
            rtt,
            (r.single_ms, r.ring_ms, o.stages),
            r.reported_hop_us,
        )
    });
    Ok(out)
}

/// The figure of one link from its medians: ms per token alone and as a ring of `stages`.
fn figure(
    link: String,
    requested_rtt_ms: Option<f64>,
    rtt_s: f64,
    (single_ms, ring_ms, stages): (f64, f64, usize),
    reported_hop_us: Option<f64>,
) -> HopFigure {
    let rtt_ms = rtt_s * 1e3;
    HopFigure {
        link,
        requested_rtt_ms,
        measured_rtt_ms: rtt_ms,
        single_ms_per_token: single_ms,
        ring_ms_per_token: ring_ms,
        stages,
        ring_vs_single: single_ms / ring_ms,
        cost_vs_crossings: (ring_ms - single_ms) / (stages as f64 * rtt_ms / 2.0),
        added_per_hop_us: added_per_hop_us(single_ms, ring_ms, rtt_ms, stages),
        reported_hop_us,
        goal_us: GOAL_US,
        breakdown: None,
        compute: None,
    }
}

/// What each hop of a ring of `stages` adds beyond its one-way share of the round trip, µs.
pub fn added_per_hop_us(single_ms: f64, ring_ms: f64, rtt_ms: f64, stages: usize) -> f64 {
    let hops = stages.max(1) as f64;
    ((ring_ms - single_ms) - hops * rtt_ms / 2.0) / hops * 1e3
}

/// The figures as a table.
pub fn table(figures: &[HopFigure]) -> String {
    let mut s = format!(
        "{:<32} {:>9} {:>9} {:>10} {:>9} {:>8} {:>10} {:>12} {:>11} {:>6}\n",
        "link",
        "rtt asked",
        "rtt meas",
        "single ms",
        "ring ms",
        "ring/one",
        "cost/link",
        "hop adds µs",
        "reported µs",
        "goal"
    );
    for f in figures {
        s.push_str(&format!(
            "{:<32} {:>9} {:>9.3} {:>10.3} {:>9.3} {:>7.3}× {:>9.2}× {:>12.0} {:>11} {:>6}\n",
            f.link,
            f.requested_rtt_ms.map_or("-".into(), |r| format!("{r:.3}")),
            f.measured_rtt_ms,
            f.single_ms_per_token,
            f.ring_ms_per_token,
            f.ring_vs_single,
            f.cost_vs_crossings,
            f.added_per_hop_us,
            f.reported_hop_us.map_or("-".into(), |r| format!("{r:.0}")),
            format!("≤{:.0}", f.goal_us),
        ));
    }
    s.push_str(
        "ring/one: the ring's decode speed against one process (goal ≥ 0.95× on loopback); \
         cost/link: (ring − single) against the link crossings, hops × round trip / 2 (goal \
         within 10% on a 1 ms link); hop adds: ((ring − single) − hops × round trip / 2) / \
         hops, per decode token (medians; a ring of N stages makes N hops a token); reported: \
         the fabric's own per-hop estimate (RunReport.hop_latency_us)\n",
    );
    for f in figures {
        let Some(b) = f.breakdown else { continue };
        s.push_str(&format!(
            "{}: a hop's {:.0} µs from the sender's layers to the receiver's = serialise {:.0} \
             + transit {:.0} (the link's {:.0} one way; the stage thread's write {:.0}; QUIC, \
             kernel and wake-ups {:.0}) + decode {:.0} + hand-off to the stage thread {:.0} µs\n",
            f.link,
            b.total_us(),
            b.serialise_us,
            b.transit_us,
            f.measured_rtt_ms * 1e3 / 2.0,
            b.send_us,
            b.transit_us - f.measured_rtt_ms * 1e3 / 2.0,
            b.decode_us,
            b.handoff_us,
        ));
    }
    for f in figures {
        let Some((alone, ring)) = f.compute else {
            continue;
        };
        let extra = f.ring_ms_per_token - f.single_ms_per_token;
        s.push_str(&format!(
            "{}: the stages' decode compute is {ring:.3} ms a token in the ring against {alone:.3} \
             alone, so {:.3} of the ring's {extra:.3} ms extra is compute and {:.3} the {} hops\n",
            f.link,
            ring - alone,
            extra - (ring - alone),
            f.stages,
        ));
    }
    for f in figures {
        s.push_str(&format!(
            "as a cluster file's figure for {}: hop_overhead_us = {:.0}\n",
            f.link,
            f.added_per_hop_us.max(0.0)
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::test_reports::{decode, report};
    use tessera_proto::{HopTimes, StageSeqStats};

    #[test]
    fn what_cannot_be_run_or_read_is_refused_with_its_own_variant_before_any_host_starts() {
        let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models");
        let o = |model: &str, stages| Options {
            model: models.join(model),
            rtt_ms: 1.0,
            stages,
            tokens: 4,
            rounds: 1,
            threads: 1,
        };
        let nowhere = std::path::Path::new("/nonexistent");
        let run = |o: Options| run(&o, nowhere, nowhere, |_| {}).unwrap_err();
        // stories260K has 5 layers: a ring of 1, or of 6, cannot be made.
        assert!(matches!(
            run(o("stories260K.gguf", 1)),
            LabError::Unrunnable(_)
        ));
        assert!(matches!(
            run(o("stories260K.gguf", 6)),
            LabError::Unrunnable(_)
        ));
        match run(o("no-such-model.gguf", 2)) {
            LabError::Model { path, .. } => assert!(path.ends_with("no-such-model.gguf"), "{path}"),
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn a_runs_compute_per_token_sums_each_stages_compute_over_its_steps() {
        let two = report(vec![decode(0, 4_000_000, 2), decode(1, 3_000_000, 3)], 2);
        assert!((compute_ms_per_token(&two).unwrap() - 3.0).abs() < 1e-12);
        let none = report(vec![decode(0, 1, 0)], 1);
        assert_eq!(compute_ms_per_token(&none), None);
        assert_eq!(compute_ms_per_token(&report(Vec::new(), 0)), None);
    }

    #[test]
    fn a_hop_is_what_the_ring_adds_beyond_the_round_trip_over_its_two_hops() {
        // Ring 1.2 ms/token, alone 0.6: 0.6 ms for two hops over a 0.5 ms round trip.
        assert!((added_per_hop_us(0.6, 1.2, 0.5, 2) - 50.0).abs() < 1e-9);
        // Three stages, three crossings of a 1 ms round trip's one way: 1.5 ms, plus 3 × 100 µs.
        assert!((added_per_hop_us(10.0, 11.8, 1.0, 3) - 100.0).abs() < 1e-9);
        let f = figure("x".into(), Some(1.0), 0.001, (10.0, 11.8, 3), Some(300.0));
        assert!((f.cost_vs_crossings - 1.2).abs() < 1e-9);
        assert!((f.ring_vs_single - 10.0 / 11.8).abs() < 1e-12);
        let t = table(&[f]);
        assert!(t.contains("≤50") && t.contains("1.20×"), "{t}");
    }

    #[test]
    fn a_hops_breakdown_pairs_each_stages_sends_with_the_next_stages_arrivals() {
        // Two stages, 10 decode frames each way; stage 0's frames reach stage 1 300 µs after
        // their writes return, stage 1's tokens reach stage 0 100 µs after theirs.
        let hop = |sent: u64, arrived: u64, enc: u64, dec: u64| StageSeqStats {
            hop: Box::new(HopTimes {
                frames_out: 10,
                encode_ns: enc,
                send_ns: 10 * 20_000,
                sent_wall_ns: sent,
                frames_in: 10,
                decode_ns: dec,
                handoff_ns: 10 * 40_000,
                arrived_wall_ns: arrived,
            }),
            ..StageSeqStats::default()
        };
        let base = u64::MAX - 1_000; // the sums wrap
        let report = report(
            vec![
                hop(
                    base,
                    base.wrapping_add(10 * 100_000),
                    10 * 5_000,
                    10 * 1_000,
                ),
                hop(
                    base.wrapping_add(7),
                    base.wrapping_add(7 + 10 * 300_000),
                    10 * 1_000,
                    10 * 6_000,
                ),
            ],
            2,
        );
        let b = HopBreakdown::of_report(&report).unwrap();
        assert!((b.transit_us - 200.0).abs() < 1e-9, "{b:?}");
        assert!((b.serialise_us - 3.0).abs() < 1e-9, "{b:?}");
        assert!((b.decode_us - 3.5).abs() < 1e-9, "{b:?}");
        assert!((b.send_us - 20.0).abs() < 1e-9 && (b.handoff_us - 40.0).abs() < 1e-9);
        assert!((b.total_us() - 246.5).abs() < 1e-9);
        // A stage without stamps: no breakdown rather than a wrong one.
        let mut partial = report.clone();
        partial.stage_stats[1].hop.frames_in = 0;
        assert_eq!(HopBreakdown::of_report(&partial), None);
    }
}
