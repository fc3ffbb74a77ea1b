//! `tessera lab hop`: the time a hop of a stage ring adds beyond the link's round trip, on a
//! link through the lab's switch and on this machine's loopback.
//!
//! Two nodes serve the same model alone (`a[0..n)`) and as a two-stage ring
//! (`a[0..k) -> b[k..n)`); both do the same layers' work, so the ring's extra time per token is
//! its two hops: two one-way link crossings (one round trip) plus what the software adds per hop
//! (thread wake-ups, copies, framing, the QUIC stack). That is
//! `((ring − single) − round trip) / 2`, with the round trip measured by UDP echo between the
//! same two hosts just before. Requests alternate between the two placements for `rounds`
//! rounds; medians are taken.

use std::path::Path;

use serde::Serialize;
use serde_json::Value;

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
    /// What one hop adds beyond its share of the round trip, µs.
    pub added_per_hop_us: f64,
    /// The fabric's own estimate of one hop's time per token (its report), µs.
    pub reported_hop_us: Option<f64>,
    /// The issue's goal for `added_per_hop_us`, µs.
    pub goal_us: f64,
}

/// The goal: a hop adds at most this beyond the link's round trip.
pub const GOAL_US: f64 = 50.0;

/// The two-node scenario the figure is measured on.
fn scenario(o: &Options, rtt_ms: f64) -> Result<Scenario> {
    let text = format!(
        r#"
[defaults]
link = {{ rtt_ms = {rtt_ms}, bandwidth = "10Gbit/s" }}
[policy]
strategies = ["single", "stage"]
context = 512
[[node]]
name = "a"
profile = "laptop-16gb"
[[node]]
name = "b"
profile = "laptop-16gb"
[model]
gguf = {model:?}
[workload]
tokens = {tokens}
[lab]
threads = {threads}
"#,
        model = o.model.display().to_string(),
        tokens = o.tokens,
        threads = o.threads,
    );
    Scenario::parse(Path::new("hop.toml"), &text)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Single node and ring, alternating, on `hosts`: medians of ms per token, and the ring's
/// reported hop time.
fn single_and_ring(
    hosts: &impl Hosts,
    tessera: &Path,
    s: &Scenario,
    dir: &Path,
    n_layer: usize,
    rounds: usize,
) -> Result<(f64, f64, Option<f64>)> {
    let session = Session::start(hosts, tessera, s, dir, &Mode::ByClient)?;
    let k = n_layer.div_ceil(2);
    let single = dir.join("single.json");
    let ring = dir.join("ring.json");
    let write = |path: &Path, v: Value| {
        std::fs::write(path, v.to_string())
            .map_err(|e| LabError::io(format!("writing {}", path.display()), e))
    };
    write(
        &single,
        serde_json::json!({ "stages": [ { "node": "a", "layers": format!("0..{n_layer}") } ] }),
    )?;
    write(
        &ring,
        serde_json::json!({ "stages": [
            { "node": "a", "layers": format!("0..{k}") },
            { "node": "b", "layers": format!("{k}..{n_layer}") },
        ] }),
    )?;
    let prompt = &s.workload.prompt;
    let one = |plan: &Path, n: usize| -> Result<Value> {
        Ok(session.clients(hosts, plan, prompt, n, 1)?.remove(0))
    };
    one(&single, 4)?;
    one(&ring, 4)?;
    let (mut a, mut b, mut hop) = (Vec::new(), Vec::new(), Vec::new());
    let ms = |r: &Value| 1e3 / r["decode_tokens_per_s"].as_f64().unwrap_or(f64::NAN);
    for _ in 0..rounds.max(1) {
        a.push(ms(&one(&single, s.workload.tokens)?));
        let r = one(&ring, s.workload.tokens)?;
        b.push(ms(&r));
        hop.extend(r["hop_latency_us"].as_f64());
    }
    let reported = (!hop.is_empty()).then(|| median(hop));
    Ok((median(a), median(b), reported))
}

/// Measures the hop figure on a `rtt_ms` link through the switch and on loopback.
pub fn run(
    o: &Options,
    tessera: &Path,
    dir: &Path,
    mut progress: impl FnMut(&str),
) -> Result<Vec<HopFigure>> {
    let gguf = tessera_model::GgufFile::open(&o.model)
        .map_err(|e| LabError::Run(format!("{}: {e}", o.model.display())))?;
    let n_layer = tessera_model::ModelConfig::from_gguf(&gguf)
        .map_err(|e| LabError::Run(format!("model config: {e}")))?
        .n_layer;
    drop(gguf);
    if n_layer < 2 {
        return Err(LabError::Run(
            "a ring needs a model of two layers or more".into(),
        ));
    }
    let mut out = Vec::new();

    let switched = scenario(o, o.rtt_ms)?;
    let lab = Lab::start(&switched.lab_spec()?)?;
    progress(&format!("lab {} up: a {} ms link", lab.id(), o.rtt_ms));
    let rtt = crate::selftest::rtt_between(&lab, 1, 2, 200)?.0;
    let sub = dir.join("switched");
    std::fs::create_dir_all(&sub)
        .map_err(|e| LabError::io(format!("creating {}", sub.display()), e))?;
    let (single, ring, reported) =
        single_and_ring(&lab, tessera, &switched, &sub, n_layer, o.rounds)?;
    drop(lab);
    out.push(figure(
        format!("{} ms link through the switch", o.rtt_ms),
        Some(o.rtt_ms),
        rtt,
        single,
        ring,
        reported,
    ));

    progress("loopback");
    let local = scenario(o, 0.0)?;
    let rtt = crate::selftest::loopback_rtt(200)?.0;
    let sub = dir.join("loopback");
    std::fs::create_dir_all(&sub)
        .map_err(|e| LabError::io(format!("creating {}", sub.display()), e))?;
    let (single, ring, reported) =
        single_and_ring(&Loopback, tessera, &local, &sub, n_layer, o.rounds)?;
    out.push(figure(
        "loopback (127.0.0.1)".into(),
        None,
        rtt,
        single,
        ring,
        reported,
    ));
    Ok(out)
}

fn figure(
    link: String,
    requested_rtt_ms: Option<f64>,
    rtt_s: f64,
    single_ms: f64,
    ring_ms: f64,
    reported_hop_us: Option<f64>,
) -> HopFigure {
    HopFigure {
        link,
        requested_rtt_ms,
        measured_rtt_ms: rtt_s * 1e3,
        single_ms_per_token: single_ms,
        ring_ms_per_token: ring_ms,
        added_per_hop_us: added_per_hop_us(single_ms, ring_ms, rtt_s * 1e3),
        reported_hop_us,
        goal_us: GOAL_US,
    }
}

/// What each of a two-stage ring's two hops adds beyond its share of the round trip, µs.
pub fn added_per_hop_us(single_ms: f64, ring_ms: f64, rtt_ms: f64) -> f64 {
    ((ring_ms - single_ms) - rtt_ms) / 2.0 * 1e3
}

/// The figures as a table.
pub fn table(figures: &[HopFigure]) -> String {
    let mut s = format!(
        "{:<32} {:>9} {:>9} {:>10} {:>9} {:>12} {:>11} {:>6}\n",
        "link",
        "rtt asked",
        "rtt meas",
        "single ms",
        "ring ms",
        "hop adds µs",
        "reported µs",
        "goal"
    );
    for f in figures {
        s.push_str(&format!(
            "{:<32} {:>9} {:>9.3} {:>10.3} {:>9.3} {:>12.0} {:>11} {:>6}\n",
            f.link,
            f.requested_rtt_ms.map_or("-".into(), |r| format!("{r:.3}")),
            f.measured_rtt_ms,
            f.single_ms_per_token,
            f.ring_ms_per_token,
            f.added_per_hop_us,
            f.reported_hop_us.map_or("-".into(), |r| format!("{r:.0}")),
            format!("≤{:.0}", f.goal_us),
        ));
    }
    s.push_str(
        "hop adds: ((ring − single) − measured round trip) / 2 hops, per decode token (medians); \
         reported: the fabric's own per-hop estimate (RunReport.hop_latency_us)\n",
    );
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

    #[test]
    fn a_hop_is_what_the_ring_adds_beyond_the_round_trip_over_its_two_hops() {
        // Ring 1.2 ms/token, alone 0.6: 0.6 ms for two hops over a 0.5 ms round trip.
        assert!((added_per_hop_us(0.6, 1.2, 0.5) - 50.0).abs() < 1e-9);
        let t = table(&[figure("x".into(), Some(0.5), 0.0005, 0.6, 1.2, Some(300.0))]);
        assert!(t.contains("≤50"), "{t}");
    }
}
