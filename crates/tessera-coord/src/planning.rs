//! Planning from measured inventory: the nodes' [`Inventory`] (sent in their hello) and the
//! measured links become a [`ResourceGraph`] whose every figure says when and how it was
//! measured; the planner chooses; the chosen plan becomes the coordinator's stage assignment
//! (and, for an expert split, its expert placement).
//!
//! Pure: the inventories, link measurements and policy come in as data.
//!
//! - [`planner_model`]: the planner's view of a GGUF model (the one conversion the CLI's
//!   `tessera plan` and the coordinator's `--plan auto` both use).
//! - [`resource_graph`]: inventory and links → resource graph.
//! - [`plan_for`]: plan, falling back to the best single-node, stage-ring or expert-split plan
//!   when the best plan is one the fabric cannot execute yet (weight bank, replicas, or a ring
//!   that would stream experts from disk: only an expert split's nodes do).
//! - [`to_placement`]: an executable plan → a [`PlanFile`] of pinned stages, plus the expert
//!   split of an expert plan ([`to_assignment`], [`to_expert_placement`]).
//!
//! # How inventory figures map to the graph
//!
//! - RAM: the node's usable total (total RAM, lowered by a cgroup limit), divided among the
//!   nodes that share its host (same host name, CPU model and total RAM), since they share it.
//! - Memory bandwidth: the all-threads read test, run with the node's own thread count, times
//!   [`DECODE_STREAM_EFFICIENCY`] (the share of it batch-1 decode reaches; see there).
//! - Compute: the engine's Q8_0 matmul probe. The probe runs on every core of the host; a node
//!   limited to fewer threads (`--threads`) gets the single-thread rate times its threads, capped
//!   by the all-core rate.
//! - Co-hosted nodes (same host name, CPU model and total RAM) are one machine: each gets the
//!   median of their measured bandwidths and compute rates.
//! - Disk: the read rate and free space of the model cache, when measured.
//! - Budget: the fabric's budget covers weights and KV cache (a node refuses an assignment beyond
//!   it); the planner's also counts the process itself, so the graph's budget is the node's budget
//!   (or, without one, the RAM available at start) plus [`RUNTIME_OVERHEAD_RAM`].
//! - Co-hosted nodes (e.g. a loopback test cluster) each get the host's full bandwidth and
//!   compute: at batch 1 a ring runs one stage at a time, so they do not contend while decoding.
//!   Their probes must not overlap (start them one after another); overlapping probes are noted
//!   in the evidence, as is the sharing itself.

use std::collections::BTreeMap;

use tessera_net::LinkMeasurement;
use tessera_node::protocol::StageSpec;
use tessera_node::Inventory;
use tessera_plan::{
    plan, Bytes, BytesPerSec, CellKind, FlopsPerSec, LayerProfile, LinkSpec, ModelError,
    ModelProfile, Node, Plan, PlanError, PlanOutcome, Policy, ResourceGraph, Source, StrategyKind,
    Tier, RUNTIME_OVERHEAD_RAM,
};

use crate::assignment::PlanFile;

/// The share of the memory read test's bandwidth the engine's batch-1 decode streams weights at.
///
/// The read test is a tight summing loop over a large buffer; a decode step streams every weight
/// once through the quantized matvec, interleaving dequantisation with the loads, and reaches
/// less. On the loopback test host (2 vCPUs, `bench-qwen3-dense-q8_0`, 480 MiB) decode streamed
/// 0.51 to 0.69 of the read test's figure over five runs; planning with the raw figure predicted
/// up to twice the measured tokens/s. The node's compute probe (an 8-token Q8_0 matmul) is not
/// the binding term at batch 1 for models larger than the caches, so it is used as measured.
/// Calibration replaces both with what the executed plan measured.
pub const DECODE_STREAM_EFFICIENCY: f64 = 0.6;

/// A measured link between two nodes of the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredLink {
    pub a: String,
    pub b: String,
    pub link: LinkMeasurement,
    /// How it was obtained, for the evidence table.
    pub method: String,
}

/// Node-to-node links composed from the coordinator's measured links to each node, when the
/// nodes have not measured each other yet: the round trip is the larger of the two, the
/// bandwidth the smaller (the evidence says so).
pub fn links_via_coordinator(links: &[(&str, LinkMeasurement)]) -> Vec<MeasuredLink> {
    let mut out = Vec::new();
    for (i, (a, la)) in links.iter().enumerate() {
        for (b, lb) in &links[i + 1..] {
            out.push(MeasuredLink {
                a: (*a).to_string(),
                b: (*b).to_string(),
                link: LinkMeasurement {
                    rtt_min: la.rtt_min.max(lb.rtt_min),
                    rtt_median: la.rtt_median.max(lb.rtt_median),
                    bytes_per_s: la.bytes_per_s.min(lb.bytes_per_s),
                    measured_at_unix_ms: la.measured_at_unix_ms.min(lb.measured_at_unix_ms),
                },
                method: format!(
                    "composed from the coordinator's links to {a} and {b} (larger median round \
                     trip, smaller bulk rate)"
                ),
            });
        }
    }
    out
}

fn host_key(inv: &Inventory) -> Option<(String, String, u64)> {
    Some((
        inv.host.hostname.clone()?,
        inv.cpu.model_name.clone().unwrap_or_default(),
        inv.memory.total_bytes?,
    ))
}

fn measured(at_ms: u64, method: impl Into<String>) -> Source {
    Source::Measured {
        at_unix_s: at_ms / 1000,
        method: method.into(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The node's memory read bandwidth and compute rate, as measured by its own probes.
fn node_rates(inv: &Inventory) -> Option<(f64, f64)> {
    let bw = inv.memory_bandwidth.as_ref()?;
    let comp = inv.compute.as_ref()?;
    let threads = node_threads(inv).unwrap_or(comp.threads).max(1);
    let rate = match comp.single_thread_ops_per_s {
        Some(single) if threads < comp.threads => (single * threads as f64).min(comp.ops_per_s),
        _ => comp.ops_per_s,
    };
    Some((bw.read_all_threads, rate))
}

/// The node's compute threads: those its memory test ran with (the agent's `--threads`).
fn node_threads(inv: &Inventory) -> Option<usize> {
    inv.memory_bandwidth
        .as_ref()
        .map(|b| b.threads)
        .or(inv.cpu.usable_cores)
}

/// Builds the resource graph from the nodes' inventories and the measured links. A node whose
/// RAM, memory bandwidth or compute was not measured is left out (with an `excluded` evidence
/// row saying why): unknown is not a default. Pairs with no measured link are unreachable.
pub fn resource_graph(
    nodes: &[(&str, &Inventory)],
    links: &[MeasuredLink],
    policy: &Policy,
) -> ResourceGraph {
    let mut g = ResourceGraph {
        policy: policy.clone(),
        ..ResourceGraph::default()
    };
    let mut hosts: BTreeMap<(String, String, u64), Vec<&str>> = BTreeMap::new();
    for (name, inv) in nodes {
        if let Some(k) = host_key(inv) {
            hosts.entry(k).or_default().push(name);
        }
    }
    for (name, inv) in nodes {
        let subject = format!("node {name}");
        let at = inv.measured_at_unix_ms;
        let (Some(total), Some(bw), Some(comp)) = (
            inv.memory.usable_total_bytes(),
            inv.memory_bandwidth.as_ref(),
            inv.compute.as_ref(),
        ) else {
            g.set_evidence(
                &subject,
                "excluded",
                "RAM, memory bandwidth or compute was not measured".into(),
                measured(at, "inventory"),
            );
            continue;
        };
        let peers: Vec<&str> = host_key(inv)
            .and_then(|k| hosts.get(&k))
            .map(|v| v.iter().copied().filter(|n| n != name).collect())
            .unwrap_or_default();
        let share = peers.len() as u64 + 1;
        let threads = node_threads(inv).unwrap_or(comp.threads).max(1);
        let (own_bw, own_rate) = node_rates(inv).unwrap_or((bw.read_all_threads, comp.ops_per_s));
        // Processes on one host run on the same memory and cores: one machine, whose figures are
        // the median of what its processes measured (each probe alone is noisy).
        let (host_bw, rate) = if share > 1 {
            let group: Vec<(f64, f64)> = nodes
                .iter()
                .filter(|(n, _)| n == name || peers.contains(n))
                .filter_map(|(_, i)| node_rates(i))
                .collect();
            (
                median(group.iter().map(|g| g.0).collect()),
                median(group.iter().map(|g| g.1).collect()),
            )
        } else {
            (own_bw, own_rate)
        };
        let limit = inv
            .memory_budget
            .as_ref()
            .map(|b| b.bytes)
            .or(inv.memory.available_bytes);
        let disk = inv.disk.as_ref().and_then(|d| {
            let r = d.read.as_ref()?;
            Some((d, r, d.free_bytes?))
        });
        let node = Node {
            name: (*name).to_string(),
            profile: None,
            vram: None,
            gpu_compute: FlopsPerSec(0.0),
            ram: Tier {
                capacity: Bytes(total / share),
                bandwidth: BytesPerSec(host_bw * DECODE_STREAM_EFFICIENCY),
            },
            ram_compute: FlopsPerSec(rate),
            disk: disk.map(|(_, r, free)| Tier {
                capacity: Bytes(free / share),
                bandwidth: BytesPerSec(r.bytes_per_s),
            }),
            memory_budget: limit.map(|l| Bytes(l) + RUNTIME_OVERHEAD_RAM),
        };
        g.add_node(node.clone(), measured(at, "inventory"));
        let host = inv.host.hostname.clone().unwrap_or_default();
        let shared_note = if share > 1 {
            format!(", shared by the {share} nodes on host {host}")
        } else {
            String::new()
        };
        g.set_evidence(
            &subject,
            "ram",
            node.ram.capacity.to_string(),
            measured(at, format!("{}{shared_note}", inv.memory.method)),
        );
        g.set_evidence(
            &subject,
            "mem_bandwidth",
            node.ram.bandwidth.to_string(),
            measured(
                at,
                format!(
                    "{} (read, {} threads, {} buffer: {}{}) x {DECODE_STREAM_EFFICIENCY} for \
                     batch-1 decode streaming",
                    bw.method,
                    bw.threads,
                    Bytes(bw.buffer_bytes),
                    BytesPerSec(own_bw),
                    if share > 1 {
                        format!("; host median {}", BytesPerSec(host_bw))
                    } else {
                        String::new()
                    }
                ),
            ),
        );
        let mut scaled = if threads < comp.threads && comp.single_thread_ops_per_s.is_some() {
            format!(
                "; {} threads of the probe's {}: single-thread rate x {threads}",
                threads, comp.threads
            )
        } else {
            String::new()
        };
        if share > 1 {
            scaled.push_str(&format!(
                "; this node {}, host median",
                FlopsPerSec(own_rate)
            ));
        }
        g.set_evidence(
            &subject,
            "ram_compute",
            node.ram_compute.to_string(),
            measured(
                at,
                format!(
                    "{} ({}, {} threads{scaled})",
                    comp.source, comp.detail, comp.threads
                ),
            ),
        );
        if let (Some((d, r, _)), Some(t)) = (disk, node.disk) {
            let cached = if r.possibly_cached {
                ", possibly from the page cache"
            } else {
                ""
            };
            g.set_evidence(
                &subject,
                "disk",
                t.capacity.to_string(),
                measured(at, format!("{} of {}", d.space_method, d.dir.display())),
            );
            g.set_evidence(
                &subject,
                "disk_bandwidth",
                t.bandwidth.to_string(),
                measured(at, format!("{}{cached}", r.method)),
            );
        }
        if let Some(b) = node.memory_budget {
            let what = match &inv.memory_budget {
                Some(rb) => format!("budget \"{}\"", rb.spec),
                None => "available RAM at start (no budget set)".into(),
            };
            g.set_evidence(
                &subject,
                "memory_budget",
                b.to_string(),
                measured(
                    at,
                    format!(
                        "the node's {what} for weights and KV cache, plus {RUNTIME_OVERHEAD_RAM} \
                         for the process"
                    ),
                ),
            );
        }
        if share > 1 {
            let start = inv.measured_at_unix_ms as f64;
            let end = start + inv.probe_duration_ms;
            let overlapping: Vec<&str> = nodes
                .iter()
                .filter(|(n, other)| {
                    peers.contains(n) && {
                        let s = other.measured_at_unix_ms as f64;
                        s < end && start < s + other.probe_duration_ms
                    }
                })
                .map(|(n, _)| *n)
                .collect();
            let mut note = format!(
                "with {} on host {host}: RAM divided among them; bandwidth and compute the \
                 host's (median of their probes), each node's in full (a ring at batch 1 runs \
                 one stage at a time; pipelined throughput would contend)",
                peers.join(", ")
            );
            if !overlapping.is_empty() {
                note.push_str(&format!(
                    "; its probes overlapped those of {}, so its rates may be low",
                    overlapping.join(", ")
                ));
            }
            g.set_evidence(&subject, "shared_host", note, measured(at, "inventory"));
        }
    }
    for l in links {
        if g.node(&l.a).is_none() || g.node(&l.b).is_none() || l.a == l.b {
            continue;
        }
        g.add_link(
            &l.a,
            &l.b,
            LinkSpec {
                rtt_s: l.link.rtt_median.as_secs_f64(),
                bandwidth: BytesPerSec(l.link.bytes_per_s),
            },
            None,
            measured(l.link.measured_at_unix_ms, l.method.clone()),
        );
    }
    g
}

/// The strategies the fabric executes today.
pub const EXECUTABLE: [StrategyKind; 3] = [
    StrategyKind::Single,
    StrategyKind::Stage,
    StrategyKind::Expert,
];

/// Whether the fabric can run `plan` of a model with `n_layer` layers of `n_expert` experts:
/// one cell, a single node or a ring of whole layers held in memory, or an expert split whose
/// ring holds whole layers and whose every expert is held once ([`to_placement`]).
pub fn executable(plan: &Plan, n_layer: usize, n_expert: usize) -> bool {
    to_placement(plan, n_layer, n_expert).is_ok()
}

/// What the fabric runs for a plan: the ring stages, pinned by node name, and for an expert
/// split where each expert id lives (in every layer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub ring: PlanFile,
    pub experts: Option<crate::assignment::ExpertSplit>,
}

/// The placement of an executable plan: a single-node or stage-ring plan becomes its stages
/// ([`to_assignment`]); an expert split becomes its home ring and expert split
/// ([`to_expert_placement`]).
///
/// Only the nodes of an expert split stream experts from disk (a node given more experts than
/// its budget holds does), so a single-node or ring plan that leaves weights on disk is not
/// executable: its nodes would refuse the load.
pub fn to_placement(
    plan: &Plan,
    n_layer: usize,
    n_expert: usize,
) -> Result<Placement, NotExpertPlacement> {
    match plan.cells.as_slice() {
        [cell] if cell.kind == CellKind::Expert => {
            // The ring holds attention and the dense FFN of whole layers, every layer once.
            let ring_ok = cell
                .assignments
                .iter()
                .all(|a| a.layers.is_none() || a.layers == a.ffn);
            if !ring_ok {
                return Err(NotExecutable::Strategy(plan.strategy).into());
            }
            let (ring, experts) = to_expert_placement(&cell.assignments, n_layer, n_expert)?;
            let covered = ring.stages.last().map_or(0, |s| s.layers.end);
            if covered != n_layer {
                return Err(NotExpertPlacement::RingCoverage { covered, n_layer });
            }
            Ok(Placement {
                ring,
                experts: Some(experts),
            })
        }
        _ => {
            let ring = to_assignment(plan)?;
            // A stage of an MoE model holds every expert of its layers.
            if let Some(a) = plan.assignments().find(|a| {
                a.experts
                    .is_some_and(|x| x.experts.end as usize != n_expert)
            }) {
                return Err(NotExpertPlacement::StageExperts(a.node.clone()));
            }
            if let Some(a) = plan.assignments().find(|a| a.memory.disk.0 > 0) {
                return Err(NotExecutable::OnDisk(a.node.clone()).into());
            }
            Ok(Placement {
                ring,
                experts: None,
            })
        }
    }
}

/// Plans `model` on `graph`. When the best plan is one the fabric cannot execute yet (weight
/// bank, replicas, a ring leaving weights on disk), plans again with expert splits, and with
/// single nodes and rings holding everything in memory, takes the better, and says so in the
/// explanation's notes (with the better plan's predicted figure).
pub fn plan_for(
    model: &tessera_model::ModelProfile,
    graph: &ResourceGraph,
    epoch: u64,
) -> Result<PlanOutcome, PlanError> {
    plan_executable(&planner_model(model, "model")?, graph, epoch)
}

/// [`plan_for`] with the planner's model profile.
pub fn plan_executable(
    m: &ModelProfile,
    graph: &ResourceGraph,
    epoch: u64,
) -> Result<PlanOutcome, PlanError> {
    let best = plan(m, graph, epoch)?;
    let (n_layer, n_expert) = (m.n_layers(), m.n_expert as usize);
    if executable(&best.plan, n_layer, n_expert) {
        return Ok(best);
    }
    // What the fabric runs: expert splits as planned (their nodes stream experts from disk when
    // given more than their budget), and single nodes and rings holding every weight in memory.
    let mut found: Option<PlanOutcome> = None;
    let mut last_err = None;
    for (allowed, in_memory) in [
        (&[StrategyKind::Expert][..], false),
        (&[StrategyKind::Single, StrategyKind::Stage][..], true),
    ] {
        let mut g = graph.clone();
        g.policy.strategies.retain(|s| allowed.contains(s));
        if g.policy.strategies.is_empty() {
            continue;
        }
        if in_memory {
            for n in &mut g.nodes {
                n.disk = None;
            }
        }
        match plan(m, &g, epoch) {
            Ok(o) if executable(&o.plan, n_layer, n_expert) => {
                let score = |o: &PlanOutcome| o.plan.predicted.score(g.policy.objective);
                if found.as_ref().is_none_or(|f| score(&o) > score(f)) {
                    found = Some(o);
                }
            }
            Ok(_) => {}
            Err(e) => last_err = Some(e),
        }
    }
    let Some(mut fallback) = found else {
        // Nothing executable: why the executable strategies found no plan, or (a policy that
        // allows none of them) the best plan, whose placement says why it cannot run.
        return match last_err {
            Some(e) => Err(e),
            None => Ok(best),
        };
    };
    fallback.explanation.notes.insert(
        0,
        format!(
            "the best plan, {} ({:.2} tok/s: {}), is not executable by the fabric yet ({}); \
             using the best {} plan instead",
            best.plan.strategy,
            best.plan.predicted.decode_tokens_per_s,
            best.explanation.chosen.description,
            to_placement(&best.plan, n_layer, n_expert)
                .err()
                .map_or_else(String::new, |e| e.to_string()),
            fallback.plan.strategy
        ),
    );
    Ok(fallback)
}

/// Why a plan cannot become a stage assignment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotExecutable {
    #[error("the fabric cannot execute a {0} plan yet")]
    Strategy(StrategyKind),
    #[error("{0} would stream experts from disk, which only the nodes of an expert split do")]
    OnDisk(String),
    #[error(
        "stage {stage} ({node}) starts at layer {start}, but the previous one ends at {expected}"
    )]
    NotContiguous {
        stage: usize,
        node: String,
        start: usize,
        expected: usize,
    },
}

/// Why an expert-split plan cannot become a ring plus an `--experts` placement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotExpertPlacement {
    #[error(transparent)]
    Stages(#[from] NotExecutable),
    #[error(
        "{node} holds experts of layers {layers} only: the fabric places experts for every layer"
    )]
    PartialLayers { node: String, layers: String },
    #[error("experts {0:?} are held by more than one node")]
    Duplicates(Vec<usize>),
    #[error("experts {0:?} are held by no node")]
    Missing(Vec<usize>),
    #[error("{0} holds some experts of its layers only: a ring stage holds all of them")]
    StageExperts(String),
    #[error("the ring covers layers 0..{covered} but the model has {n_layer}")]
    RingCoverage { covered: usize, n_layer: usize },
}

/// The ring stages and the `--experts` placement of an expert-split plan's assignments: the
/// nodes holding attention become the ring stages (the experts' home nodes), in order; every
/// node holding experts owns those expert ids in every layer (the fabric's placement is the
/// same for all layers, so an expert slice must cover all `n_layer` layers).
pub fn to_expert_placement(
    assignments: &[tessera_plan::Assignment],
    n_layer: usize,
    n_expert: usize,
) -> Result<(PlanFile, crate::assignment::ExpertSplit), NotExpertPlacement> {
    use crate::assignment::{ExpertGroup, ExpertSplit};
    let mut stages = Vec::new();
    let mut expected = 0;
    for a in assignments {
        let Some(l) = a.layers else { continue };
        if l.start as usize != expected {
            return Err(NotExecutable::NotContiguous {
                stage: stages.len(),
                node: a.node.clone(),
                start: l.start as usize,
                expected,
            }
            .into());
        }
        expected = l.end as usize;
        stages.push(StageSpec {
            node: Some(a.node.clone()),
            layers: l.iter(),
        });
    }
    let mut groups: Vec<ExpertGroup> = Vec::new();
    for a in assignments {
        let Some(x) = a.experts else { continue };
        if x.layers.iter() != (0..n_layer) {
            return Err(NotExpertPlacement::PartialLayers {
                node: a.node.clone(),
                layers: x.layers.to_string(),
            });
        }
        match groups.iter_mut().find(|g| g.node == a.node) {
            Some(g) => g.experts.extend(x.experts.iter()),
            None => groups.push(ExpertGroup {
                experts: x.experts.iter().collect(),
                node: a.node.clone(),
            }),
        }
    }
    let split = ExpertSplit { groups };
    let dup = split.duplicates();
    if !dup.is_empty() {
        return Err(NotExpertPlacement::Duplicates(dup));
    }
    let missing: Vec<usize> = (0..n_expert)
        .filter(|e| !split.groups.iter().any(|g| g.experts.contains(e)))
        .collect();
    if !missing.is_empty() {
        return Err(NotExpertPlacement::Missing(missing));
    }
    Ok((PlanFile { stages }, split))
}

/// The stages of a single-node or stage-ring plan, pinned to their nodes by name, in ring order.
pub fn to_assignment(plan: &Plan) -> Result<PlanFile, NotExecutable> {
    // One cell, a single node or a ring of whole layers (of an MoE model, with their experts).
    let ring = plan.cells.len() == 1
        && matches!(plan.cells[0].kind, CellKind::Single | CellKind::Stage)
        && plan.assignments().all(|a| {
            a.layers.is_some()
                && a.layers == a.ffn
                && a.experts
                    .is_none_or(|x| Some(x.layers) == a.layers && x.experts.start == 0)
        });
    if !ring {
        return Err(NotExecutable::Strategy(plan.strategy));
    }
    let mut stages = Vec::new();
    let mut expected = 0;
    for (i, a) in plan.assignments().enumerate() {
        let l = a.layers.expect("executable plans hold whole layers");
        if l.start as usize != expected {
            return Err(NotExecutable::NotContiguous {
                stage: i,
                node: a.node.clone(),
                start: l.start as usize,
                expected,
            });
        }
        expected = l.end as usize;
        stages.push(StageSpec {
            node: Some(a.node.clone()),
            layers: l.start as usize..l.end as usize,
        });
    }
    Ok(PlanFile { stages })
}

/// The planner's view of a GGUF model, from the header profile `tessera inspect` prints: real
/// per-tensor bytes (the file's quantisation mix), KV bytes and FLOPs per token. `fallback_name`
/// names the model when its header does not.
pub fn planner_model(
    p: &tessera_model::ModelProfile,
    fallback_name: &str,
) -> Result<ModelProfile, ModelError> {
    let c = &p.config;
    let (h, q, kv) = (
        c.n_embd as u64,
        (c.n_head * c.head_dim) as u64,
        (c.n_head_kv * c.head_dim) as u64,
    );
    let n_layer = p.layers.len().max(1) as u64;
    let attn_params = h * q + 2 * h * kv + q * h;
    let layers = p
        .layers
        .iter()
        .map(|l| {
            let moe = !l.experts.is_empty();
            let expert_params = 3 * h * c.n_ff_expert as u64;
            let dense_params = if moe { 0 } else { 3 * h * c.n_ff as u64 };
            let router_params = if moe { h * c.n_expert as u64 } else { 0 };
            let used = if moe { c.n_expert_used as u64 } else { 0 };
            LayerProfile {
                attention: Bytes(l.attention),
                dense_ffn: Bytes(l.dense_ffn),
                router: Bytes(l.router),
                expert: Bytes(l.experts.first().copied().unwrap_or(0)),
                n_expert: if moe { l.experts.len() as u32 } else { 0 },
                n_expert_used: used as u32,
                kv_per_token: Bytes(p.kv_bytes_per_token / n_layer),
                flops_per_token: 2.0
                    * (attn_params + dense_params + router_params + used * expert_params) as f64,
                attn_flops_per_ctx_token: 4.0 * q as f64,
                expert_flops_per_token: if moe { 2.0 * expert_params as f64 } else { 0.0 },
            }
        })
        .collect();
    let head = if p.head_bytes == 0 {
        p.embedding_bytes
    } else {
        p.head_bytes
    };
    let profile = ModelProfile {
        name: p.name.clone().unwrap_or_else(|| fallback_name.to_string()),
        arch: c.arch.gguf_name().to_string(),
        quant: p.weight_type.parse().ok(),
        hidden_size: h,
        vocab_size: c.vocab_size as u64,
        embedding: Bytes(p.embedding_bytes),
        head: Bytes(head + p.output_norm_bytes),
        tied_embeddings: p.head_bytes == 0,
        head_flops_per_token: 2.0 * (c.vocab_size as u64 * h) as f64,
        n_expert: if c.is_moe() { c.n_expert as u32 } else { 0 },
        n_expert_used: if c.is_moe() {
            c.n_expert_used as u32
        } else {
            0
        },
        layers,
    };
    profile.validate()?;
    Ok(profile)
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_expert_plan_maps_to_ring_stages_and_an_experts_placement() {
        use tessera_plan::{Assignment, ExpertSlice, LayerRange, MemoryUse};
        let a = |node: &str, layers: Option<(usize, usize)>, experts: Option<(usize, usize)>| {
            Assignment {
                node: node.into(),
                layers: layers.map(|(s, e)| LayerRange::new(s, e)),
                ffn: layers.map(|(s, e)| LayerRange::new(s, e)),
                experts: experts.map(|(s, e)| ExpertSlice {
                    layers: LayerRange::new(0, 4),
                    experts: LayerRange::new(s, e),
                }),
                embedding: false,
                head: false,
                memory: MemoryUse::default(),
            }
        };
        let plan = [
            a("home", Some((0, 4)), Some((0, 3))),
            a("x", None, Some((3, 6))),
            a("y", None, Some((6, 8))),
        ];
        let (ring, split) = super::to_expert_placement(&plan, 4, 8).unwrap();
        assert_eq!(ring.stages.len(), 1);
        assert_eq!(ring.stages[0].node.as_deref(), Some("home"));
        assert_eq!(ring.stages[0].layers, 0..4);
        let want = crate::assignment::parse_experts("0-2@home,3-5@x,6-7@y").unwrap();
        assert_eq!(split, want);

        // Experts missing, held twice, or of some layers only do not map.
        assert!(matches!(
            super::to_expert_placement(&plan[..2], 4, 8),
            Err(super::NotExpertPlacement::Missing(m)) if m == vec![6, 7]
        ));
        let twice = [plan[0].clone(), a("x", None, Some((2, 8)))];
        assert!(matches!(
            super::to_expert_placement(&twice, 4, 8),
            Err(super::NotExpertPlacement::Duplicates(d)) if d == vec![2]
        ));
        let mut partial = plan.clone();
        partial[1].experts.as_mut().unwrap().layers = LayerRange::new(0, 2);
        assert!(matches!(
            super::to_expert_placement(&partial, 4, 8),
            Err(super::NotExpertPlacement::PartialLayers { .. })
        ));
    }

    use super::*;
    use std::time::Duration;
    use tessera_node::inventory::{
        ComputeRate, CpuInfo, HostInfo, MemoryBandwidth, MemoryInfo, ResolvedBudget,
    };
    use tessera_plan::{Objective, Quant};

    const GIB: u64 = 1 << 30;

    fn inv(host: &str, at_ms: u64, threads: usize, budget: Option<u64>) -> Inventory {
        Inventory {
            schema: 1,
            measured_at_unix_ms: at_ms,
            probe_duration_ms: 1000.0,
            host: HostInfo {
                hostname: Some(host.into()),
                os: "linux".into(),
                arch: "x86_64".into(),
                virtualized: None,
            },
            memory: MemoryInfo {
                total_bytes: Some(16 * GIB),
                available_bytes: Some(12 * GIB),
                cgroup_limit_bytes: None,
                method: "/proc/meminfo".into(),
            },
            cpu: CpuInfo {
                model_name: Some("cpu".into()),
                logical_cores: Some(4),
                usable_cores: Some(4),
                features: vec![],
                features_checked: vec![],
                method: "cpuinfo".into(),
            },
            memory_bandwidth: Some(MemoryBandwidth {
                copy_single_thread: 10e9,
                read_single_thread: 8e9,
                copy_all_threads: 20e9,
                read_all_threads: 16e9,
                threads,
                buffer_bytes: 256 << 20,
                passes: 3,
                method: "memcpy and sum".into(),
                duration_ms: 300.0,
            }),
            compute: Some(ComputeRate {
                ops_per_s: 40e9,
                single_thread_ops_per_s: Some(12e9),
                threads: 4,
                source: "engine q8_0 matmul".into(),
                detail: "1024x1024".into(),
            }),
            disk: None,
            gpus: vec![],
            gpu_backends: vec![],
            memory_budget: budget.map(|b| ResolvedBudget {
                bytes: b,
                spec: format!("{b}"),
            }),
            probes: vec![],
        }
    }

    fn link(ms: u64, mb_s: f64, at_ms: u64) -> LinkMeasurement {
        LinkMeasurement {
            rtt_min: Duration::from_millis(ms),
            rtt_median: Duration::from_millis(ms),
            bytes_per_s: mb_s * 1e6,
            measured_at_unix_ms: at_ms,
        }
    }

    fn source(g: &ResourceGraph, subject: &str, q: &str) -> Source {
        g.evidence
            .iter()
            .find(|e| e.subject == subject && e.quantity == q)
            .unwrap_or_else(|| panic!("no evidence for {subject} {q}: {:?}", g.evidence))
            .source
            .clone()
    }

    #[test]
    fn inventory_figures_become_measured_graph_figures() {
        let a = inv("alpha", 1_700_000_000_000, 4, Some(2 * GIB));
        let b = inv("beta", 1_700_000_001_500, 2, None);
        let links = links_via_coordinator(&[
            ("a", link(2, 100.0, 1_700_000_002_000)),
            ("b", link(3, 50.0, 1_700_000_003_000)),
        ]);
        assert_eq!(links.len(), 1);
        let g = resource_graph(&[("a", &a), ("b", &b)], &links, &Policy::default());
        let na = g.node("a").unwrap();
        assert_eq!(na.ram.capacity, Bytes(16 * GIB));
        assert_eq!(
            na.ram.bandwidth,
            BytesPerSec(16e9 * DECODE_STREAM_EFFICIENCY)
        );
        assert_eq!(na.ram_compute, FlopsPerSec(40e9));
        assert_eq!(
            na.memory_budget,
            Some(Bytes(2 * GIB) + RUNTIME_OVERHEAD_RAM)
        );
        assert!(na.vram.is_none() && na.disk.is_none());
        // Two of the probe's four threads: the single-thread rate twice.
        let nb = g.node("b").unwrap();
        assert_eq!(nb.ram_compute, FlopsPerSec(24e9));
        // No budget: the RAM available at start, plus the process.
        assert_eq!(
            nb.memory_budget,
            Some(Bytes(12 * GIB) + RUNTIME_OVERHEAD_RAM)
        );
        // The composed link: the larger round trip, the smaller rate.
        let l = g.link("a", "b").unwrap();
        assert!((l.rtt_s - 0.003).abs() < 1e-12);
        assert_eq!(l.bandwidth, BytesPerSec(50e6));
        for q in ["ram", "mem_bandwidth", "ram_compute", "memory_budget"] {
            match source(&g, "node a", q) {
                Source::Measured { at_unix_s, method } => {
                    assert_eq!(at_unix_s, 1_700_000_000);
                    assert!(!method.is_empty());
                }
                s => panic!("{q}: {s:?}"),
            }
        }
        match source(&g, "node b", "ram_compute") {
            Source::Measured { method, .. } => {
                assert!(method.contains("single-thread"), "{method}")
            }
            s => panic!("{s:?}"),
        }
        match source(&g, "link a-b", "rtt") {
            Source::Measured { at_unix_s, method } => {
                assert_eq!(at_unix_s, 1_700_000_002);
                assert!(method.contains("coordinator"), "{method}");
            }
            s => panic!("{s:?}"),
        }
        assert!(g.evidence.iter().all(|e| e.quantity != "shared_host"));
    }

    #[test]
    fn co_hosted_nodes_share_ram_and_overlapping_probes_are_noted() {
        let mut a = inv("box", 1_000_000, 2, Some(GIB));
        let mut b = inv("box", 1_000_500, 2, Some(GIB)); // probes overlap a's
        let c = inv("box", 1_005_000, 2, Some(GIB)); // after both
        a.memory_bandwidth.as_mut().unwrap().read_all_threads = 30e9;
        b.memory_bandwidth.as_mut().unwrap().read_all_threads = 10e9;
        let g = resource_graph(&[("a", &a), ("b", &b), ("c", &c)], &[], &Policy::default());
        for n in ["a", "b", "c"] {
            let node = g.node(n).unwrap();
            assert_eq!(node.ram.capacity, Bytes(16 * GIB / 3));
            // One machine: the median of its processes' probes, in full to each (batch-1 rings
            // run one stage at a time).
            assert_eq!(
                node.ram.bandwidth,
                BytesPerSec(16e9 * DECODE_STREAM_EFFICIENCY)
            );
            assert_eq!(node.ram_compute, FlopsPerSec(24e9));
        }
        let note = |n: &str| {
            g.evidence
                .iter()
                .find(|e| e.subject == format!("node {n}") && e.quantity == "shared_host")
                .unwrap()
                .value
                .clone()
        };
        assert!(note("a").contains("overlapped those of b"), "{}", note("a"));
        assert!(!note("c").contains("overlapped"), "{}", note("c"));
        // Without links, co-hosted nodes are still unreachable from each other.
        assert!(g.link("a", "b").is_none());
    }

    #[test]
    fn a_node_without_measured_figures_is_left_out() {
        let mut a = inv("alpha", 1_000_000, 4, None);
        a.compute = None;
        let b = inv("beta", 1_000_000, 4, None);
        let g = resource_graph(&[("a", &a), ("b", &b)], &[], &Policy::default());
        assert!(g.node("a").is_none());
        assert!(g.node("b").is_some());
        assert!(g
            .evidence
            .iter()
            .any(|e| e.subject == "node a" && e.quantity == "excluded"));
    }

    fn model() -> ModelProfile {
        let config = r#"{"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 3072, "vocab_size": 32000, "tie_word_embeddings": true}"#;
        ModelProfile::from_hf_config(config, Quant::Q8_0).unwrap()
    }

    fn cluster(budgets: &[u64]) -> (Vec<(String, Inventory)>, ResourceGraph) {
        let invs: Vec<(String, Inventory)> = budgets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                (
                    format!("n{i}"),
                    inv(&format!("host{i}"), 1_000_000, 4, Some(*b)),
                )
            })
            .collect();
        let refs: Vec<(&str, &Inventory)> = invs.iter().map(|(n, i)| (n.as_str(), i)).collect();
        let coord: Vec<(&str, LinkMeasurement)> = invs
            .iter()
            .map(|(n, _)| (n.as_str(), link(1, 100.0, 1_000_000)))
            .collect();
        let policy = Policy {
            objective: Objective::Latency,
            context_tokens: 512,
            prompt_tokens: 64,
            ..Policy::default()
        };
        let g = resource_graph(&refs, &links_via_coordinator(&coord), &policy);
        (invs, g)
    }

    #[test]
    fn a_stage_plan_becomes_pinned_contiguous_stages_within_budgets() {
        let m = model();
        // ~0.6 GiB of weights: neither node can hold it alone.
        let (_, g) = cluster(&[300 << 20, 500 << 20]);
        let out = plan_executable(&m, &g, 7).unwrap();
        assert_eq!(out.plan.strategy, StrategyKind::Stage);
        let file = to_assignment(&out.plan).unwrap();
        assert_eq!(file.stages.len(), 2);
        assert_eq!(file.stages[0].layers.start, 0);
        assert_eq!(file.stages[0].layers.end, file.stages[1].layers.start);
        assert_eq!(file.stages[1].layers.end, 28);
        for (s, a) in file.stages.iter().zip(out.plan.assignments()) {
            assert_eq!(s.node.as_deref(), Some(a.node.as_str()));
            assert!(a.memory.total <= a.memory.budget, "{a:?}");
        }
        // It resolves against the coordinator's connected nodes by name.
        let ns: Vec<crate::assignment::Candidate> = (0..2)
            .map(|i| crate::assignment::Candidate {
                node_id: tessera_net::NodeIdentity::from_seed([i as u8 + 1; 32]).node_id(),
                name: format!("n{i}"),
            })
            .collect();
        let placed = crate::assignment::resolve(&file.stages, 28, &ns).unwrap();
        assert_eq!(placed.len(), 2);
    }

    #[test]
    fn a_single_node_plan_is_one_stage_of_every_layer() {
        let m = model();
        let (_, g) = cluster(&[300 << 20, 4 * GIB]);
        let out = plan_executable(&m, &g, 1).unwrap();
        assert_eq!(out.plan.strategy, StrategyKind::Single);
        let file = to_assignment(&out.plan).unwrap();
        assert_eq!(file.stages.len(), 1);
        assert_eq!(file.stages[0].node.as_deref(), Some("n1"));
        assert_eq!(file.stages[0].layers, 0..28);
    }

    #[test]
    fn a_plan_the_fabric_cannot_run_falls_back_to_the_best_stage_plan() {
        let m = model();
        let (_, mut g) = cluster(&[4 * GIB, 4 * GIB]);
        g.policy.objective = Objective::Throughput;
        g.policy.concurrency = 8;
        let best = tessera_plan::plan(&m, &g, 1).unwrap();
        assert_eq!(best.plan.strategy, StrategyKind::Replica);
        assert!(!executable(&best.plan, 28, 0));
        assert!(matches!(
            to_assignment(&best.plan),
            Err(NotExecutable::Strategy(StrategyKind::Replica))
        ));
        let out = plan_executable(&m, &g, 1).unwrap();
        assert!(executable(&out.plan, 28, 0));
        assert!(EXECUTABLE.contains(&out.plan.strategy));
        assert!(
            out.explanation.notes[0].contains("replica"),
            "{:?}",
            out.explanation.notes
        );
        assert!(to_assignment(&out.plan).is_ok());
    }

    fn moe_model() -> ModelProfile {
        let config = r#"{"model_type": "qwen3_moe", "hidden_size": 1024, "num_hidden_layers": 4,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 3072, "moe_intermediate_size": 768, "num_experts": 16,
            "num_experts_per_tok": 2, "vocab_size": 32000, "tie_word_embeddings": true}"#;
        ModelProfile::from_hf_config(config, Quant::Q8_0).unwrap()
    }

    #[test]
    fn an_expert_split_plan_is_executed_as_a_home_ring_and_an_expert_split() {
        let m = moe_model();
        // 16 experts of ~2.4 MiB in each of 4 layers: the home holds the rest and some experts,
        // the others a few experts each but no whole layer.
        let (_, g) = cluster(&[200 << 20, 60 << 20, 60 << 20]);
        let out = plan_executable(&m, &g, 3).unwrap();
        assert_eq!(
            out.plan.strategy,
            StrategyKind::Expert,
            "{:?}",
            out.explanation
        );
        assert!(out
            .explanation
            .notes
            .iter()
            .all(|n| !n.contains("not executable")));
        let p = to_placement(&out.plan, 4, 16).unwrap();
        assert_eq!(p.ring.stages.len(), 1);
        assert_eq!(p.ring.stages[0].node.as_deref(), Some("n0"));
        assert_eq!(p.ring.stages[0].layers, 0..4);
        let split = p.experts.unwrap();
        assert!(split.duplicates().is_empty());
        let mut all: Vec<usize> = split
            .groups
            .iter()
            .flat_map(|g| g.experts.clone())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..16).collect::<Vec<_>>());
        assert!(split.groups.len() >= 2, "{split}");
    }

    fn with_disks(g: &mut ResourceGraph) {
        for n in &mut g.nodes {
            n.disk = Some(Tier {
                capacity: Bytes(100 * GIB),
                bandwidth: BytesPerSec(2e9),
            });
        }
    }

    #[test]
    fn a_ring_that_streams_experts_from_disk_falls_back_to_an_expert_split() {
        let m = moe_model();
        let (_, mut g) = cluster(&[200 << 20, 60 << 20, 60 << 20]);
        with_disks(&mut g);
        // With disks, rings hold layers whose experts partly stay on disk...
        let best = tessera_plan::plan(&m, &g, 1).unwrap();
        assert!(matches!(
            best.plan.strategy,
            StrategyKind::Stage | StrategyKind::Single
        ));
        assert!(best.plan.assignments().any(|a| a.memory.disk.0 > 0));
        // ... which no ring stage does: the expert split runs instead.
        let out = plan_executable(&m, &g, 1).unwrap();
        assert_eq!(out.plan.strategy, StrategyKind::Expert);
        assert!(
            out.explanation.notes[0].contains("stream experts from disk"),
            "{:?}",
            out.explanation.notes
        );
        assert!(to_placement(&out.plan, 4, 16).unwrap().experts.is_some());
    }

    #[test]
    fn a_single_node_plan_with_experts_on_disk_is_not_executable() {
        let m = moe_model();
        // One node, too small for every expert in memory, with a disk: the planner streams the
        // rest from disk, which only an expert split's nodes do.
        let (_, mut g) = cluster(&[200 << 20]);
        with_disks(&mut g);
        let best = tessera_plan::plan(&m, &g, 1).unwrap();
        assert_eq!(best.plan.strategy, StrategyKind::Single);
        assert!(best.plan.assignments().any(|a| a.memory.disk.0 > 0));
        assert!(matches!(
            to_placement(&best.plan, 4, 16),
            Err(NotExpertPlacement::Stages(NotExecutable::OnDisk(n))) if n == "n0"
        ));
        // Alone, it has no executable plan: planning says why rather than applying it.
        assert!(plan_executable(&m, &g, 1).is_err());
    }
}
