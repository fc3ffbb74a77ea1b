//! `tessera coordinator --plan auto`: wait for the expected nodes, plan from their measured
//! inventory and links ([`tessera_coord::planning`]), print the explanation and apply the chosen
//! placement: a stage split, or an expert split (home ring plus expert owners).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use tessera_coord::planning::{links_via_coordinator, plan_for, resource_graph, to_placement};
use tessera_coord::Coordinator;
use tessera_plan::{render_text, Objective, Policy};

/// How long to wait for the coordinator's link measurements once the nodes are in.
const LINK_WAIT: Duration = Duration::from_secs(5);

/// The policy the coordinator plans with: one request's decode speed, KV cache for the
/// coordinator's context length, decode predicted a short prompt in.
pub fn policy(max_context: usize) -> Policy {
    let context = max_context.max(1) as u64;
    Policy {
        objective: Objective::Latency,
        context_tokens: context,
        prompt_tokens: context.min(128),
        concurrency: 1,
        ..Policy::default()
    }
}

/// Waits for `expected` connected nodes with inventories (and, for a few seconds, their links),
/// plans, prints the explanation, writes `DATA_DIR/plan-auto.json` (graph and outcome) and
/// applies the stages (and the expert split of an expert plan).
pub async fn run(
    c: &Coordinator,
    model: &tessera_model::ModelProfile,
    expected: usize,
    policy: &Policy,
    data_dir: &Path,
) -> anyhow::Result<()> {
    let expected = expected.max(1);
    let mut enough_since: Option<Instant> = None;
    let members = loop {
        let m = c.connected_members();
        if m.len() >= expected && m.iter().all(|m| m.inventory.is_some()) {
            let since = *enough_since.get_or_insert_with(Instant::now);
            if m.iter().all(|m| m.link.is_some()) || since.elapsed() > LINK_WAIT {
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
    let graph = resource_graph(&nodes, &links_via_coordinator(&coord_links), policy);
    let outcome = plan_for(model, &graph, 1).context("planning")?;
    print!("{}", render_text(&outcome));
    let doc = serde_json::json!({ "graph": graph, "outcome": outcome });
    let path = data_dir.join("plan-auto.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)
        .with_context(|| format!("writing {}", path.display()))?;
    let cfg = &model.config;
    let placement = to_placement(&outcome.plan, cfg.n_layer, cfg.n_expert)?;
    // The split first: the epoch the stages start places it.
    c.set_expert_split(placement.experts.clone());
    c.apply_stages(&placement.ring.stages)
        .context("applying the plan")?;
    if let Some(x) = &placement.experts {
        println!("plan auto experts: {x}");
    }
    println!(
        "plan auto: {}",
        placement
            .ring
            .stages
            .iter()
            .map(|s| format!(
                "{}={}..{}",
                s.node.as_deref().unwrap_or("?"),
                s.layers.start,
                s.layers.end
            ))
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(())
}
