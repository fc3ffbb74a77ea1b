//! `tessera coordinator --plan auto`: wait for the expected nodes, plan from their measured
//! inventory and links ([`tessera_placement::planning`]), print the explanation and apply the chosen
//! placement: a stage split, or an expert split (home ring plus expert owners).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use tessera_coord::Coordinator;
use tessera_placement::planning::{
    expert_budgets, node_links, plan_executable, planner_model, resource_graph, to_placement,
    PeerMeasurement,
};
use tessera_plan::{render_text, AutoPlanRecord, Objective, Policy};

/// How long to wait for the link measurements (the coordinator's to each node, and the nodes'
/// to each other: a ping series and a 1 MiB transfer per pair, one peer at a time) once the
/// nodes are in. Links still missing then are composed from the coordinator's, and the
/// evidence says so.
const LINK_WAIT: Duration = Duration::from_secs(15);

/// Whether the coordinator has measured its link to every member, and every pair of members
/// has measured the link between them (in either direction).
fn all_links_measured(members: &[tessera_coord::membership::Member]) -> bool {
    members.iter().all(|m| m.link.is_some())
        && members.iter().enumerate().all(|(i, a)| {
            members[i + 1..].iter().all(|b| {
                a.peer_links.contains_key(&b.node_id) || b.peer_links.contains_key(&a.node_id)
            })
        })
}

/// The policy the coordinator plans with: the decode speed each request gets while
/// `concurrency` are served (the gateway's batch; 1 for a coordinator serving `tessera run`),
/// KV cache for the coordinator's context length, decode predicted a short prompt in. At a
/// concurrency above 1, whole-request replicas (cells) compete with one batching ring.
pub fn policy(max_context: usize, concurrency: usize) -> Policy {
    let context = max_context.max(1) as u64;
    Policy {
        objective: Objective::Latency,
        context_tokens: context,
        prompt_tokens: context.min(128),
        concurrency: concurrency.clamp(1, u32::MAX as usize) as u32,
        ..Policy::default()
    }
}

/// Contexts the search for one that fits tries are multiples of this.
const CONTEXT_STEP: usize = 256;

/// The context a plan is made for.
#[derive(Clone, Copy, Debug)]
pub struct ContextChoice {
    /// The most positions per sequence: `--ctx`, else the model's context length.
    pub max: usize,
    /// `--ctx` was given: plan for exactly `max`, do not search for a smaller one that fits.
    pub fixed: bool,
}

/// The largest context up to `choice.max` (a multiple of [`CONTEXT_STEP`] below it) for which
/// `try_plan` finds a plan, with that plan; `try_plan`'s error for the smallest context when
/// none fits. Planning is pure and takes microseconds, so this simply bisects.
pub fn fit_context<T, E>(
    choice: ContextChoice,
    mut try_plan: impl FnMut(usize) -> Result<T, E>,
) -> Result<(usize, T), E> {
    let first = try_plan(choice.max);
    if choice.fixed || first.is_ok() || choice.max <= CONTEXT_STEP {
        return first.map(|t| (choice.max, t));
    }
    // Invariant: lo fits (once checked), hi does not; both in steps.
    let mut lo = 1;
    let mut best = try_plan(lo * CONTEXT_STEP)?;
    let mut hi = choice.max.div_ceil(CONTEXT_STEP);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        match try_plan(mid * CONTEXT_STEP) {
            Ok(t) => {
                lo = mid;
                best = t;
            }
            Err(_) => hi = mid,
        }
    }
    Ok((lo * CONTEXT_STEP, best))
}

/// Reads a calibrated graph (a cluster file or a scenario, e.g. `tessera lab run
/// --save-calibrated`) for [`run`].
pub fn read_calibrated(path: &Path) -> anyhow::Result<tessera_plan::ResourceGraph> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let text = tessera_lab::scenario::planner_part(&text).map_err(anyhow::Error::msg)?;
    tessera_plan::ResourceGraph::from_toml(&text)
        .with_context(|| format!("in calibrated graph {}", path.display()))
}

/// Waits for `expected` connected nodes with inventories (and, for a few seconds, their links),
/// plans at `concurrency` ([`policy`]) for the largest context that fits (or `--ctx`'s), prints the explanation and the
/// context chosen, writes `DATA_DIR/plan-auto.json` (graph and outcome) and applies the stages
/// (and the expert split of an expert plan). With `calibrated` (`tessera lab run --save-calibrated`), the rates of that graph in place of
/// the measured ones for the nodes and links it names.
pub async fn run(
    c: &Coordinator,
    model: &tessera_model::ModelProfile,
    expected: usize,
    context: ContextChoice,
    concurrency: usize,
    data_dir: &Path,
    calibrated: Option<&tessera_plan::ResourceGraph>,
) -> anyhow::Result<()> {
    // The KV cache as the stages will hold it: the coordinator's KV type, not the profile's F32.
    let kv_type = c.kv_type();
    let planner = planner_model(model, kv_type, "model").context("the planner's model")?;
    // One sequence's cache at a context, as the planner sizes it.
    let kv_bytes = |ctx: usize| planner.kv_bytes_at(ctx as u64).0;
    let expected = expected.max(1);
    let mut enough_since: Option<Instant> = None;
    let members = loop {
        let m = c.connected_members();
        if m.len() >= expected && m.iter().all(|m| m.inventory.is_some()) {
            let since = *enough_since.get_or_insert_with(Instant::now);
            if all_links_measured(&m) || since.elapsed() > LINK_WAIT {
                break m;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let nodes: Vec<(&str, &tessera_node::Inventory)> = members
        .iter()
        .filter_map(|m| Some((m.name.as_str(), m.inventory.as_ref()?)))
        .collect();
    let coord_links: Vec<(&str, tessera_net::LinkMeasurement)> = members
        .iter()
        .filter_map(|m| Some((m.name.as_str(), m.link?)))
        .collect();
    let peer_links: Vec<PeerMeasurement<'_>> = members
        .iter()
        .flat_map(|m| {
            m.peer_links.iter().filter_map(|(id, l)| {
                let to = members.iter().find(|p| p.node_id == *id)?;
                Some((m.name.as_str(), to.name.as_str(), *l))
            })
        })
        .collect();
    let links = node_links(&coord_links, &peer_links);
    if let Some(cal) = calibrated {
        let mut g = resource_graph(&nodes, &links, &policy(context.max, concurrency));
        for line in tessera_plan::apply_calibrated(&mut g, cal) {
            println!("calibrated: {line}");
        }
    }
    let plan_at = |ctx: usize, disks: bool| {
        let mut graph = resource_graph(&nodes, &links, &policy(ctx, concurrency));
        if let Some(cal) = calibrated {
            tessera_plan::apply_calibrated(&mut graph, cal);
        }
        if !disks {
            for n in &mut graph.nodes {
                n.disk = None;
            }
        }
        plan_executable(&planner, &graph, 1).map(|o| (graph, o))
    };
    // The context is the largest the nodes' memory holds with every weight in it, where one
    // does: streaming experts from disk (which MoE stages do) would make room for any context,
    // at a cost to every token no one asked for. The plan for that context may still stream
    // where the planner predicts it faster. Only a model no memory holds plans its context
    // with the disks.
    let fitted = match (
        context.fixed,
        fit_context(context, |ctx| plan_at(ctx, false)),
    ) {
        (false, Ok((ctx, _))) => plan_at(ctx, true).map(|p| (ctx, p)),
        _ => fit_context(context, |ctx| plan_at(ctx, true)),
    };
    let (chosen, (graph, outcome)) = fitted.with_context(|| {
        format!(
            "planning (no plan fits even {} positions of context)",
            context.max.min(CONTEXT_STEP)
        )
    })?;
    print!("{}", render_text(&outcome));
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let why = if context.fixed {
        "as --ctx asked".to_string()
    } else if chosen == context.max {
        "the model's full context fits".to_string()
    } else {
        format!(
            "the largest that fits the nodes' memory budgets: {} positions would need {:.0} MiB \
             of {kv_type} KV cache per sequence ({:.1} KiB a position); --ctx overrides",
            context.max,
            mib(kv_bytes(context.max)),
            kv_bytes(context.max) as f64 / context.max.max(1) as f64 / 1024.0
        )
    };
    println!(
        "context: {chosen} positions ({why}); KV cache {kv_type}, {:.0} MiB per sequence",
        mib(kv_bytes(chosen))
    );
    c.set_max_context(chosen);
    // The lab reads this file back as the same type.
    let record = AutoPlanRecord { graph, outcome };
    let path = data_dir.join("plan-auto.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&record)?)
        .with_context(|| format!("writing {}", path.display()))?;
    let cfg = &model.config;
    let placement = to_placement(&record.outcome.plan, cfg.n_layer, cfg.n_expert)?;
    // The split and the nodes' expert budgets first: the epoch the stages start places them.
    c.set_expert_split(placement.experts.clone()).await;
    c.set_expert_budgets(
        expert_budgets(&planner, &record.outcome.plan)
            .into_iter()
            .collect(),
    )
    .await;
    c.apply_stages(&placement.ring.stages)
        .context("applying the plan")?;
    // The decision as the coordinator's events (a plain line each, or JSON with
    // TESSERA_LOG_FORMAT=json): what scripts and tests wait on.
    if let Some(x) = &placement.experts {
        tracing::info!(
            target: "tessera_coord::plan_auto",
            event = "plan_auto_experts",
            experts = %x,
            "plan auto experts: {x}"
        );
    }
    let ring = placement
        .ring
        .stages
        .iter()
        .map(|s| {
            format!(
                "{}={}..{}",
                s.node.as_deref().unwrap_or("?"),
                s.layers.start,
                s.layers.end
            )
        })
        .collect::<Vec<_>>()
        .join(" ");
    tracing::info!(
        target: "tessera_coord::plan_auto",
        event = "plan_auto",
        ring = %ring,
        context = chosen,
        "plan auto: {ring} (context {chosen})"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A planner that fits contexts up to `limit`, and counts its calls.
    fn fits_up_to(
        limit: usize,
        calls: &mut usize,
    ) -> impl FnMut(usize) -> Result<usize, String> + '_ {
        move |ctx| {
            *calls += 1;
            if ctx <= limit {
                Ok(ctx)
            } else {
                Err(format!("{ctx} does not fit"))
            }
        }
    }

    #[test]
    fn the_full_context_is_kept_when_it_fits() {
        let mut calls = 0;
        let choice = ContextChoice {
            max: 40960,
            fixed: false,
        };
        assert_eq!(
            fit_context(choice, fits_up_to(50_000, &mut calls)),
            Ok((40960, 40960))
        );
        assert_eq!(calls, 1);
    }

    #[test]
    fn the_largest_step_that_fits_is_chosen() {
        let mut calls = 0;
        let choice = ContextChoice {
            max: 40960,
            fixed: false,
        };
        let (ctx, _) = fit_context(choice, fits_up_to(9000, &mut calls)).unwrap();
        assert_eq!(ctx, 8960, "the largest multiple of 256 not above 9000");
        assert!(calls < 12, "bisected, not scanned: {calls} plans");
    }

    #[test]
    fn a_given_context_is_not_shrunk_and_nothing_fitting_is_an_error() {
        let mut calls = 0;
        let fixed = ContextChoice {
            max: 4096,
            fixed: true,
        };
        assert_eq!(
            fit_context(fixed, fits_up_to(1000, &mut calls)),
            Err("4096 does not fit".to_string())
        );
        let free = ContextChoice {
            max: 4096,
            fixed: false,
        };
        assert_eq!(
            fit_context(free, fits_up_to(100, &mut calls)),
            Err("256 does not fit".to_string())
        );
    }
}
