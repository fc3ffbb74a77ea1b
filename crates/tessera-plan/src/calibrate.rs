//! Calibration: compare an executed plan's measured figures with the prediction and correct the
//! per-node rates and per-link figures from that evidence. Pure: the measurements (and when they were
//! taken) come in as data.

use crate::cost::{evaluate, Ctx};
use crate::model::ModelProfile;
use crate::plan::{Plan, Prediction};
use crate::resources::{link_subject, LinkSpec, ResourceGraph, Source};
use crate::strategies::replica::combined_throughput;
use crate::units::{BytesPerSec, FlopsPerSec};
use crate::PlanError;
use serde::{Deserialize, Serialize};

/// One measured network hop (the fabric's per-hop figures).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HopMeasurement {
    pub from: String,
    pub to: String,
    /// Mean one-way time of one crossing, seconds.
    pub latency_s: f64,
    /// Mean bytes on the wire per crossing.
    pub wire_bytes: f64,
}

/// Measured time a node spends per generated token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageMeasurement {
    pub node: String,
    pub seconds_per_token: f64,
}

/// What an executed plan measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    pub taken_at_unix_s: u64,
    /// Decode tokens/s at batch 1.
    pub decode_tokens_per_s: f64,
    #[serde(default)]
    pub hops: Vec<HopMeasurement>,
    #[serde(default)]
    pub stages: Vec<StageMeasurement>,
}

/// One figure the calibration changed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Correction {
    pub subject: String,
    pub quantity: String,
    /// New rate / old rate (for links: new round trip / old).
    pub factor: f64,
    pub reason: String,
}

/// The corrected graph and how the prediction moved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub graph: ResourceGraph,
    pub corrections: Vec<Correction>,
    pub measured_tokens_per_s: f64,
    pub predicted_before: f64,
    pub predicted_after: f64,
    /// (predicted − measured) / measured, before correction.
    pub relative_error_before: f64,
}

/// Carries a calibrated graph's rates onto a freshly measured one: for every node and link the
/// calibrated graph names, its rates (memory and disk bandwidth, compute; round trip and
/// bandwidth) replace the measured ones, while capacities and budgets stay as measured now; the
/// runtime's cost per token and per hop are taken too. Returns what it applied, one line each (nodes and
/// links the calibrated graph does not name keep their measured figures).
pub fn apply_calibrated(graph: &mut ResourceGraph, calibrated: &ResourceGraph) -> Vec<String> {
    let mut applied = Vec::new();
    let src = Source::Measured {
        at_unix_s: 0,
        method: "calibrated graph".into(),
    };
    for n in &mut graph.nodes {
        let Some(c) = calibrated.node(&n.name) else {
            continue;
        };
        n.ram.bandwidth = c.ram.bandwidth;
        n.ram_compute = c.ram_compute;
        if let (Some(t), Some(ct)) = (n.vram.as_mut(), c.vram) {
            t.bandwidth = ct.bandwidth;
            n.gpu_compute = c.gpu_compute;
        }
        if let (Some(t), Some(ct)) = (n.disk.as_mut(), c.disk) {
            t.bandwidth = ct.bandwidth;
        }
        applied.push(format!(
            "node {}: memory bandwidth {}, compute {}",
            n.name, n.ram.bandwidth, n.ram_compute
        ));
    }
    let names: Vec<String> = graph.nodes.iter().map(|n| n.name.clone()).collect();
    for (i, a) in names.iter().enumerate() {
        for b in &names[i + 1..] {
            let Some(spec) = calibrated
                .links
                .iter()
                .find(|l| (&l.a == a && &l.b == b) || (&l.a == b && &l.b == a))
                .map(|l| l.spec)
            else {
                continue;
            };
            match graph
                .links
                .iter_mut()
                .find(|l| (&l.a == a && &l.b == b) || (&l.a == b && &l.b == a))
            {
                Some(l) => {
                    l.spec = spec;
                    let subject = link_subject(a, b);
                    graph.set_evidence(
                        &subject,
                        "rtt",
                        format!("{:.3} ms", spec.rtt_s * 1e3),
                        src.clone(),
                    );
                }
                None => graph.add_link(a, b, spec, None, src.clone()),
            }
            applied.push(format!(
                "link {a}-{b}: {:.3} ms round trip, {}",
                spec.rtt_s * 1e3,
                spec.bandwidth
            ));
        }
    }
    if graph.hop_overhead_s != calibrated.hop_overhead_s {
        graph.hop_overhead_s = calibrated.hop_overhead_s;
        applied.push(format!(
            "runtime: {:.1} µs per hop",
            calibrated.hop_overhead_s * 1e6
        ));
    }
    if calibrated.token_overhead_s > 0.0 {
        graph.token_overhead_s = calibrated.token_overhead_s;
        applied.push(format!(
            "runtime: {:.1} µs per token",
            calibrated.token_overhead_s * 1e6
        ));
    }
    applied
}

/// The policy a plan is re-costed under: its own, but for how the workload's routing reuses
/// experts, which is what the graph (calibrated) knows of it.
pub(crate) fn recost_policy(plan: &Plan, graph: &ResourceGraph) -> crate::resources::Policy {
    let mut policy = plan.policy.clone();
    policy.expert_reuse = graph.policy.expert_reuse;
    policy
}

/// Re-costs a plan's cells on a (possibly corrected) graph.
pub fn predict(
    model: &ModelProfile,
    graph: &ResourceGraph,
    plan: &Plan,
) -> Result<Prediction, PlanError> {
    let policy = recost_policy(plan, graph);
    let ctx = Ctx {
        model,
        graph,
        policy: &policy,
    };
    let mut cells = Vec::new();
    for c in &plan.cells {
        let cell = evaluate(&ctx, c.kind, c.assignments.clone(), c.sequences)
            .map_err(PlanError::Recost)?;
        cells.push(cell);
    }
    if cells.len() == 1 {
        return Ok(cells.remove(0).predicted);
    }
    let best = (0..cells.len())
        .max_by(|&a, &b| {
            cells[a]
                .predicted
                .decode_tokens_per_s
                .total_cmp(&cells[b].predicted.decode_tokens_per_s)
        })
        .ok_or(PlanError::Recost("plan has no cells".into()))?;
    Ok(Prediction {
        throughput_tokens_per_s: combined_throughput(
            &cells,
            policy.concurrency.max(1),
            &graph.machines,
            graph.token_overhead_s,
        ),
        concurrency: policy.concurrency.max(1),
        ..cells[best].predicted.clone()
    })
}

/// Seconds per token `prediction` gives `node` across its stages (all its parts in the plan).
fn node_time(prediction: &Prediction, node: &str) -> f64 {
    prediction
        .stages
        .iter()
        .filter(|x| x.node == node)
        .map(|x| x.terms.total_s)
        .sum()
}

pub(crate) const MIN_FACTOR: f64 = 0.05;
pub(crate) const MAX_FACTOR: f64 = 20.0;

/// Past this share of a measured token time predicted to be the network, a run without stage
/// times does not calibrate the nodes' rates (an expert split over a WAN: 250 ms of 290).
const MOSTLY_NETWORK: f64 = 2.0 / 3.0;

/// What a node's correction scales: what a stage held in memory computes with.
const RATES: &str = "memory and compute rates";

fn scale_node(
    g: &mut ResourceGraph,
    name: &str,
    f: f64,
    at: u64,
    reason: &str,
    out: &mut Vec<Correction>,
) {
    let f = f.clamp(MIN_FACTOR, MAX_FACTOR);
    let Some(n) = g.nodes.iter_mut().find(|n| n.name == name) else {
        return;
    };
    n.ram.bandwidth = BytesPerSec(n.ram.bandwidth.0 * f);
    n.ram_compute = FlopsPerSec(n.ram_compute.0 * f);
    if let Some(t) = n.vram.as_mut() {
        t.bandwidth = BytesPerSec(t.bandwidth.0 * f);
    }
    n.gpu_compute = FlopsPerSec(n.gpu_compute.0 * f);
    // The disk keeps its rate: the runs that calibrate nodes held their weights in memory (a
    // plan that streams is no reference for a node's rates), so their times say nothing of it;
    // scaling it too had a ring's ×0.92 price a board streaming from its disk 21% slow.
    let figures = vec![
        ("mem_bandwidth", n.ram.bandwidth.to_string()),
        ("ram_compute", n.ram_compute.to_string()),
    ];
    let mut figures = figures;
    if let Some(t) = n.vram {
        figures.push(("vram_bandwidth", t.bandwidth.to_string()));
        figures.push(("gpu_compute", n.gpu_compute.to_string()));
    }
    let subject = format!("node {name}");
    for (q, v) in figures {
        g.set_evidence(
            &subject,
            q,
            v,
            Source::Measured {
                at_unix_s: at,
                method: "calibration".into(),
            },
        );
    }
    out.push(Correction {
        subject,
        quantity: RATES.into(),
        factor: f,
        reason: reason.to_string(),
    });
}

/// Corrects `graph` from what executing `plan` measured.
pub fn calibrate(
    model: &ModelProfile,
    graph: &ResourceGraph,
    plan: &Plan,
    m: &Measurement,
) -> Result<Calibration, PlanError> {
    if !(m.decode_tokens_per_s.is_finite() && m.decode_tokens_per_s > 0.0) {
        return Err(PlanError::Recost(
            "measured tokens/s must be positive".into(),
        ));
    }
    let before = predict(model, graph, plan)?;
    let mut g = graph.clone();
    let mut corrections = Vec::new();
    let at = m.taken_at_unix_s;
    for h in &m.hops {
        let old = g
            .link(&h.from, &h.to)
            .ok_or_else(|| PlanError::Recost(format!("no link between {} and {}", h.from, h.to)))?;
        // A crossing is half the round trip, the transfer and the software's cost of a hop.
        let wire = old.bandwidth.secs(h.wire_bytes);
        let rtt = (2.0 * (h.latency_s - wire - g.hop_overhead_s)).max(0.0);
        let spec = LinkSpec {
            rtt_s: rtt,
            bandwidth: old.bandwidth,
        };
        match g
            .links
            .iter_mut()
            .find(|l| (l.a == h.from && l.b == h.to) || (l.a == h.to && l.b == h.from))
        {
            Some(l) => l.spec = spec,
            None => g.links.push(crate::resources::Link {
                a: h.from.clone(),
                b: h.to.clone(),
                profile: None,
                spec,
            }),
        }
        let subject = link_subject(&h.from, &h.to);
        g.set_evidence(
            &subject,
            "rtt",
            format!("{:.3} ms", rtt * 1e3),
            Source::Measured {
                at_unix_s: at,
                method: "fabric per-hop latency".into(),
            },
        );
        corrections.push(Correction {
            subject,
            quantity: "rtt".into(),
            factor: if old.rtt_s > 0.0 {
                rtt / old.rtt_s
            } else {
                1.0
            },
            reason: format!(
                "measured {:.3} ms per crossing with {:.0} wire bytes",
                h.latency_s * 1e3,
                h.wire_bytes
            ),
        });
    }
    let mid = predict(model, &g, plan)?;
    if !m.stages.is_empty() {
        for s in &m.stages {
            let predicted = node_time(&mid, &s.node);
            if predicted > 0.0 && s.seconds_per_token > 0.0 {
                let f = predicted / s.seconds_per_token;
                let why = format!(
                    "stage measured {:.3} ms/token, predicted {:.3}",
                    s.seconds_per_token * 1e3,
                    predicted * 1e3
                );
                scale_node(&mut g, &s.node, f, at, &why, &mut corrections);
            }
        }
    } else {
        // Only the token rate: attribute what the network does not explain to the nodes' work.
        let measured = 1.0 / m.decode_tokens_per_s;
        let net = mid.decode.network_s();
        let work_pred = mid.decode.total_s - net;
        let work_meas = measured - net;
        let nodes = plan_nodes(plan);
        if net > MOSTLY_NETWORK * measured {
            // What is left after the network is too small a part to tell the nodes' rates:
            // a few percent off in the network's prediction would be read as a factor in them.
            for n in nodes {
                corrections.push(Correction {
                    subject: format!("node {n}"),
                    quantity: RATES.into(),
                    factor: 1.0,
                    reason: format!(
                        "kept: of the {:.3} ms a token measured, {:.3} ms are the predicted \
                         network; the rest is too small a part to tell the nodes' rates",
                        measured * 1e3,
                        net * 1e3
                    ),
                });
            }
        } else if work_pred > 0.0 && work_meas > 0.0 {
            let f = work_pred / work_meas;
            let why = format!(
                "token time measured {:.3} ms, predicted {:.3} ms ({:.3} ms of it network)",
                measured * 1e3,
                mid.decode.total_s * 1e3,
                net * 1e3
            );
            for n in nodes {
                scale_node(&mut g, n, f, at, &why, &mut corrections);
            }
        }
    }
    if !m.stages.is_empty() {
        // What the stages and hops do not explain is the runtime's fixed cost per token.
        let now = predict(model, &g, plan)?;
        let residual = 1.0 / m.decode_tokens_per_s - now.decode.total_s;
        let old = g.token_overhead_s;
        let new = (old + residual).max(0.0);
        if (new - old).abs() > 1e-9 {
            g.token_overhead_s = new;
            g.set_evidence(
                "runtime",
                "token_overhead",
                format!("{:.1} µs", new * 1e6),
                Source::Measured {
                    at_unix_s: at,
                    method: "calibration: token time the stages and hops do not explain".into(),
                },
            );
            corrections.push(Correction {
                subject: "runtime".into(),
                quantity: "token_overhead".into(),
                factor: if old > 0.0 { new / old } else { 1.0 },
                reason: format!(
                    "token time measured {:.3} ms, stages and hops predict {:.3} ms",
                    1e3 / m.decode_tokens_per_s,
                    (now.decode.total_s - old) * 1e3
                ),
            });
        }
    }
    let after = predict(model, &g, plan)?;
    Ok(Calibration {
        graph: g,
        corrections,
        measured_tokens_per_s: m.decode_tokens_per_s,
        predicted_before: before.decode_tokens_per_s,
        predicted_after: after.decode_tokens_per_s,
        relative_error_before: (before.decode_tokens_per_s - m.decode_tokens_per_s)
            / m.decode_tokens_per_s,
    })
}

/// Calibrates only the nodes `stages` names, each from its own stage's measured time per
/// token against what `graph` predicts for it in `plan`: the way to correct a node that no
/// single-node run covered from whichever executed plan did (a ring's or an expert split's
/// per-stage figures), leaving the links, the runtime's costs and every other node as they are.
/// Returns the corrected graph and what changed.
pub fn calibrate_nodes(
    model: &ModelProfile,
    graph: &ResourceGraph,
    plan: &Plan,
    stages: &[StageMeasurement],
    taken_at_unix_s: u64,
) -> Result<(ResourceGraph, Vec<Correction>), PlanError> {
    let now = predict(model, graph, plan)?;
    let mut g = graph.clone();
    let mut corrections = Vec::new();
    for s in stages {
        let predicted = node_time(&now, &s.node);
        if predicted > 0.0 && s.seconds_per_token > 0.0 {
            let why = format!(
                "its stage of {} measured {:.3} ms/token, predicted {:.3}",
                plan.nodes().join("→"),
                s.seconds_per_token * 1e3,
                predicted * 1e3
            );
            scale_node(
                &mut g,
                &s.node,
                predicted / s.seconds_per_token,
                taken_at_unix_s,
                &why,
                &mut corrections,
            );
        }
    }
    Ok((g, corrections))
}

/// Gives a single-node plan's node the token time its run took, beside the graph's runtime
/// cost per token (`token_overhead_s`, typically the median of several runs'): the runtime's
/// part is common to all nodes, so what one node's run took beyond it, or saved below it, is
/// that node's (a host under a CPU quota stalls between steps once its period's share is spent,
/// outside the compute its stage times). The node's rates are scaled until the plan predicts
/// the measured `tokens_per_s`. A run the graph already predicts (within one part in a
/// million) is left alone (returns no correction).
pub fn calibrate_node_to_token_time(
    model: &ModelProfile,
    graph: &ResourceGraph,
    plan: &Plan,
    tokens_per_s: f64,
    taken_at_unix_s: u64,
) -> Result<(ResourceGraph, Option<Correction>), PlanError> {
    let nodes = plan.nodes();
    let [node] = nodes.as_slice() else {
        return Err(PlanError::Recost(
            "a node's token time is calibrated on a plan of one node".into(),
        ));
    };
    if !(tokens_per_s.is_finite() && tokens_per_s > 0.0) {
        return Err(PlanError::Recost(
            "measured tokens/s must be positive".into(),
        ));
    }
    let now = predict(model, graph, plan)?;
    let stage = 1.0 / tokens_per_s - graph.token_overhead_s;
    let predicted = node_time(&now, node);
    if stage <= 0.0 || (stage - predicted).abs() <= 1e-6 * predicted {
        return Ok((graph.clone(), None));
    }
    let (g, mut c) = calibrate_nodes(
        model,
        graph,
        plan,
        &[StageMeasurement {
            node: node.to_string(),
            seconds_per_token: stage,
        }],
        taken_at_unix_s,
    )?;
    Ok((g, c.pop()))
}

/// A plan's nodes, each once.
pub(crate) fn plan_nodes(plan: &Plan) -> Vec<&str> {
    let mut nodes: Vec<&str> = plan.nodes();
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}

/// `graph` with the compute rates (CPU and GPU) of `nodes` scaled by `k`.
pub fn with_compute(graph: &ResourceGraph, nodes: &[&str], k: f64) -> ResourceGraph {
    let mut g = graph.clone();
    for n in g
        .nodes
        .iter_mut()
        .filter(|n| nodes.contains(&n.name.as_str()))
    {
        n.ram_compute = FlopsPerSec(n.ram_compute.0 * k);
        n.gpu_compute = FlopsPerSec(n.gpu_compute.0 * k);
    }
    g
}

/// The factor in `[lo, hi]` at which `at`, a prediction that grows with the factor, meets
/// `target` (bisected on a log scale); `lo` or `hi` where the target lies beyond them.
pub(crate) fn bisect_factor(
    at: impl Fn(f64) -> Result<f64, PlanError>,
    target: f64,
    mut lo: f64,
    mut hi: f64,
) -> Result<f64, PlanError> {
    if at(lo)? >= target {
        return Ok(lo);
    }
    if at(hi)? <= target {
        return Ok(hi);
    }
    for _ in 0..40 {
        let mid = (lo * hi).sqrt();
        if at(mid)? > target {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(hi)
}

/// Records the compute rates of `nodes` in `g` as measured by `method`.
pub(crate) fn compute_evidence(
    mut g: ResourceGraph,
    nodes: &[&str],
    taken_at_unix_s: u64,
    method: String,
) -> ResourceGraph {
    for name in nodes {
        let Some(n) = g.nodes.iter().find(|n| n.name == *name) else {
            continue;
        };
        let v = n.ram_compute.to_string();
        g.set_evidence(
            &format!("node {name}"),
            "ram_compute",
            v,
            Source::Measured {
                at_unix_s: taken_at_unix_s,
                method: method.clone(),
            },
        );
    }
    g
}

/// Corrects the compute rates of a one-cell plan's nodes from its aggregate tokens/s measured
/// at the plan's concurrency, on a graph already calibrated at batch 1 (by [`calibrate`]).
///
/// A step of a batch is bound by the larger of the bytes it reads and the work it does; batch-1
/// calibration scales both rates together and so cannot tell them apart. A batch of `c` does
/// `c` times the work and reads the weights once: where the prediction at `c` is faster than
/// measured, the compute rate is too high (a model that fits in the caches is bound by work,
/// not by memory bandwidth). It is lowered until the prediction at `c` meets the measurement;
/// the memory rates, and so batch 1 where memory binds, stay. A prediction already at or
/// below the measurement is left alone (returns no correction).
pub fn calibrate_batching(
    model: &ModelProfile,
    graph: &ResourceGraph,
    plan: &Plan,
    measured_tokens_per_s: f64,
    taken_at_unix_s: u64,
) -> Result<(ResourceGraph, Option<Correction>), PlanError> {
    let c = plan.policy.concurrency.max(1);
    if plan.cells.len() != 1 || c < 2 {
        return Err(PlanError::Recost(
            "batching is calibrated on one cell serving two requests or more".into(),
        ));
    }
    if !(measured_tokens_per_s.is_finite() && measured_tokens_per_s > 0.0) {
        return Err(PlanError::Recost(
            "measured tokens/s must be positive".into(),
        ));
    }
    let nodes = plan_nodes(plan);
    let at = |k: f64| -> Result<f64, PlanError> {
        Ok(predict(model, &with_compute(graph, &nodes, k), plan)?.throughput_tokens_per_s)
    };
    let before = at(1.0)?;
    if before <= measured_tokens_per_s {
        return Ok((graph.clone(), None));
    }
    let k = bisect_factor(at, measured_tokens_per_s, MIN_FACTOR, 1.0)?;
    let g = with_compute(graph, &nodes, k);
    let g = compute_evidence(
        g,
        &nodes,
        taken_at_unix_s,
        format!("calibration: {c} requests at once"),
    );
    let correction = Correction {
        subject: format!("node {}", nodes.join(", node ")),
        quantity: "compute".into(),
        factor: k,
        reason: format!(
            "{c} requests at once measured {measured_tokens_per_s:.1} tok/s together, predicted \
             {before:.1}: a batch's work binds, not the weights' bytes"
        ),
    };
    Ok((g, Some(correction)))
}

/// What a ring's run taught about the software cost of a hop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HopCalibration {
    /// The graph with [`ResourceGraph::hop_overhead_s`] set to what the run implies.
    pub graph: ResourceGraph,
    pub correction: Correction,
    /// The hop cost before and after, seconds per crossing.
    pub hop_overhead_before_s: f64,
    pub hop_overhead_after_s: f64,
    /// Crossings between distinct nodes on one token's critical path.
    pub crossings_per_token: f64,
    /// The plan's decode tokens/s predicted before and after.
    pub predicted_before: f64,
    pub predicted_after: f64,
    /// True when the run was faster than even a free hop predicts, so the cost stays at zero
    /// (the nodes' rates, not the hops, are then what is off).
    pub clamped: bool,
}

/// Learns the software cost of a hop from a plan with hops (a stage ring, an expert split)
/// whose decode rate was measured, on a graph whose nodes already carry their own calibrated
/// rates (from single-node runs: a ring's own stages cannot tell their time from the hops'):
/// the token time the nodes, the links and the runtime do not explain, over the crossings on one
/// token's critical path. The prediction is linear in the hop cost, so the crossings are its
/// slope.
pub fn calibrate_hop_overhead(
    model: &ModelProfile,
    graph: &ResourceGraph,
    plan: &Plan,
    measured_tokens_per_s: f64,
    taken_at_unix_s: u64,
) -> Result<HopCalibration, PlanError> {
    if !(measured_tokens_per_s.is_finite() && measured_tokens_per_s > 0.0) {
        return Err(PlanError::Recost(
            "measured tokens/s must be positive".into(),
        ));
    }
    let token_s = |overhead: f64| -> Result<f64, PlanError> {
        let mut g = graph.clone();
        g.hop_overhead_s = overhead;
        Ok(predict(model, &g, plan)?.decode.total_s)
    };
    let free = token_s(0.0)?;
    const PROBE_S: f64 = 1e-3;
    let crossings = (token_s(PROBE_S)? - free) / PROBE_S;
    if crossings < 0.5 {
        return Err(PlanError::Recost(
            "the plan has no hop between nodes to learn a hop's cost from".into(),
        ));
    }
    let before = graph.hop_overhead_s;
    let implied = (1.0 / measured_tokens_per_s - free) / crossings;
    let after = implied.max(0.0);
    let mut g = graph.clone();
    g.hop_overhead_s = after;
    g.set_evidence(
        "runtime",
        "hop_overhead",
        format!("{:.1} µs", after * 1e6),
        Source::Measured {
            at_unix_s: taken_at_unix_s,
            method: "calibration: a ring's token time its nodes and links do not explain".into(),
        },
    );
    let predicted_before = 1.0 / (free + crossings * before);
    let predicted_after = 1.0 / (free + crossings * after);
    Ok(HopCalibration {
        graph: g,
        correction: Correction {
            subject: "runtime".into(),
            quantity: "hop_overhead".into(),
            factor: if before > 0.0 { after / before } else { 1.0 },
            reason: format!(
                "token time measured {:.3} ms; nodes, links and runtime predict {:.3} ms with \
                 free hops; {:.0} crossings per token{}",
                1e3 / measured_tokens_per_s,
                free * 1e3,
                crossings,
                if implied < 0.0 {
                    " (faster than free hops: kept at zero)"
                } else {
                    ""
                }
            ),
        },
        hop_overhead_before_s: before,
        hop_overhead_after_s: after,
        crossings_per_token: crossings,
        predicted_before,
        predicted_after,
        clamped: implied < 0.0,
    })
}

#[cfg(test)]
mod apply_tests {
    use super::*;

    #[test]
    fn calibrated_rates_replace_measured_ones_for_the_nodes_and_links_they_name() {
        let measured = ResourceGraph::from_toml(
            r#"
[[node]]
name = "a"
ram = "8GiB"
mem_bandwidth = "10GB/s"
compute = "100GFLOPS"
memory_budget = "2GiB"
[[node]]
name = "b"
ram = "8GiB"
mem_bandwidth = "10GB/s"
compute = "100GFLOPS"
[[link]]
nodes = ["a", "b"]
rtt_ms = 1
bandwidth = "1Gbit/s"
"#,
        )
        .unwrap();
        let mut calibrated = measured.clone();
        calibrated.nodes[0].ram.bandwidth = BytesPerSec(5e9);
        calibrated.nodes[0].ram_compute = FlopsPerSec(50e9);
        calibrated.nodes[0].memory_budget = None;
        calibrated.links[0].spec.rtt_s = 0.002;
        calibrated.nodes.remove(1);
        calibrated.token_overhead_s = 1e-4;
        let mut g = measured.clone();
        let applied = apply_calibrated(&mut g, &calibrated);
        assert_eq!(g.nodes[0].ram.bandwidth, BytesPerSec(5e9));
        assert_eq!(g.nodes[0].ram_compute, FlopsPerSec(50e9));
        assert_eq!(
            g.nodes[0].memory_budget, measured.nodes[0].memory_budget,
            "kept"
        );
        assert_eq!(g.nodes[1], measured.nodes[1], "not named: as measured");
        assert_eq!(g.links.len(), 1);
        assert_eq!(g.link("a", "b").unwrap().rtt_s, 0.002);
        assert_eq!(g.token_overhead_s, 1e-4);
        assert_eq!(applied.len(), 3, "{applied:?}");
    }
}
