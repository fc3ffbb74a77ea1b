//! Loading an assignment: the tensors a stage needs (and, in an expert split, the held experts'
//! byte ranges), received into the shard store, checked against the memory budget (experts over
//! it are streamed from disk), loaded with the engine and installed on the stage thread, unless
//! a newer assignment or a release came first.

use std::sync::Arc;
use std::time::Instant;

use tessera_engine::{ExpertSelection, ExpertStreaming, LoadSpec, Model};
use tessera_host::BudgetRefusal;
use tessera_model::Tokenizer;
use tessera_net::Connection;

use crate::error::FabricError;
use crate::fetch_net::{assignment_needs, fetch_manifest, fetch_needs};
use crate::inventory::Inventory;
use crate::stage::Stage;
use crate::store::{Manifest, ShardStore};
use tessera_proto::{ExpertAssignment, LoadReport, NodeToCoord, StageAssignment};

use super::epochs::Ticket;
use super::stage_thread::WorkerMsg;
use super::{EpochAction, EpochEvent, Shared};

pub(super) struct LoadCtx {
    pub(super) conn: Connection,
    pub(super) store: Arc<ShardStore>,
    pub(super) inventory: Inventory,
    pub(super) threads: usize,
    pub(super) progress: bool,
    pub(super) expert_budget: Option<u64>,
    pub(super) prefix_cache: usize,
    /// Test only: load cached bytes without re-hashing them (a node whose weights were altered).
    pub(super) fault_unchecked_weights: bool,
}

/// The tensors a stage needs: its layers' `blk.N.*` (and the RoPE frequency factors every
/// layer rotates with, where the model has them), plus the embedding (first stage, or the last
/// with tied embeddings) and the output norm and head (last stage).
pub fn stage_tensor_names(manifest: &Manifest, a: &StageAssignment) -> Vec<String> {
    let mut names = manifest.layer_tensor_names(a.layers.start as u32..a.layers.end as u32);
    let has = |n: &str| manifest.tensor(n).is_some();
    if !a.layers.is_empty() && has("rope_freqs.weight") {
        names.push("rope_freqs.weight".into());
    }
    let tied = !has("output.weight");
    if a.embed || (a.head && tied) {
        names.push("token_embd.weight".into());
    }
    if a.head {
        names.push("output_norm.weight".into());
        if !tied {
            names.push("output.weight".into());
        }
    }
    names
}

/// The packed expert tensors (and expert biases) of the layers where `held` names experts,
/// outside `skip` (of the matrices [`assignment_needs`] keeps only the held experts' byte
/// ranges).
fn expert_tensor_names(
    manifest: &Manifest,
    held: &[Vec<usize>],
    skip: &std::ops::Range<usize>,
) -> Vec<String> {
    let mut names = Vec::new();
    for (l, ids) in held.iter().enumerate() {
        if ids.is_empty() || skip.contains(&l) {
            continue;
        }
        for part in ["gate", "up", "down"] {
            // The matrices (held experts' ranges only) and, where the model has them
            // (gpt-oss), the experts' biases (small: fetched whole).
            for kind in ["weight", "bias"] {
                let n = format!("blk.{l}.ffn_{part}_exps.{kind}");
                if manifest.tensor(&n).is_some() {
                    names.push(n);
                }
            }
        }
    }
    names
}

/// How many bytes of its experts a load keeps in memory, streaming the rest from disk (`None`:
/// all of them, nothing streamed), given the node's `--expert-budget`, whether the load has
/// experts at all (an expert split's, or a ring stage's of an MoE model), whether the node only
/// serves experts, and whether every weight fits the memory limit (`fits`).
///
/// A node given `--expert-budget` keeps that much. Otherwise experts over the limit are
/// streamed: a stage keeps half the limit, leaving the rest to its dense weights and KV
/// caches; a node that only serves experts holds nothing else, so its whole limit keeps
/// experts, as the planner places them (half of it had an owner of an expert split read a
/// third of its lookups from disk where the plan priced a few percent). A load without experts
/// that does not fit is refused.
fn expert_memory(
    expert_budget: Option<u64>,
    has_experts: bool,
    expert_only: bool,
    fits: Result<(), BudgetRefusal>,
) -> Result<Option<u64>, BudgetRefusal> {
    match (has_experts, expert_budget, fits) {
        (false, _, fits) => fits.map(|()| None),
        (true, Some(b), _) => Ok(Some(b)),
        (true, None, Ok(())) => Ok(None),
        (true, None, Err(e)) => {
            let Some(limit) = e.limit else {
                return Err(e);
            };
            Ok(Some(if expert_only { limit } else { limit / 2 }))
        }
    }
}

/// Loads `a` (load `ticket` of the epoch machine, with its expert placement) and hands the
/// result to the machine, which installs it or drops it; an error is the caller's to report.
pub(super) async fn load_assignment(
    ticket: Ticket,
    a: StageAssignment,
    experts: Option<ExpertAssignment>,
    ctx: &LoadCtx,
    shared: &Shared,
) -> Result<(), FabricError> {
    let t0 = Instant::now();
    let manifest = Arc::new(fetch_manifest(&ctx.conn, a.model).await?);
    let expert_only = experts.as_ref().is_some_and(|x| x.expert_only);
    let mut names = if expert_only {
        Vec::new()
    } else {
        stage_tensor_names(&manifest, &a)
    };
    if let Some(x) = &experts {
        let skip = if expert_only { 0..0 } else { a.layers.clone() };
        names.extend(expert_tensor_names(&manifest, &x.held, &skip));
    }
    // A ring stage of an MoE model holds every expert of its layers: it streams them too.
    let has_experts = experts.is_some() || names.iter().any(|n| n.contains("_exps."));
    // Expert split: only the held experts' byte ranges of the packed expert tensors.
    let held_experts = experts.as_ref().map(|x| x.held.as_slice());
    let (needs, header) =
        assignment_needs(&ctx.conn, &ctx.store, &manifest, names, held_experts).await?;
    let weight_bytes = manifest.bytes_for_needs(&needs)?;
    // The node's own `--expert-budget` first, else the one the coordinator's plan placed.
    let streaming = expert_memory(
        ctx.expert_budget.or(a.expert_budget),
        has_experts,
        expert_only,
        ctx.inventory.accepts(weight_bytes),
    )?;

    // What the cache holds is re-hashed against the manifest before it is loaded: bytes
    // altered since they were received are refused by tensor, and received again.
    if !ctx.fault_unchecked_weights {
        let (store, m, n) = (ctx.store.clone(), manifest.clone(), needs.clone());
        let checked = tokio::task::spawn_blocking(move || store.check_needs(&m, &n))
            .await
            .map_err(|e| FabricError::Stopped(format!("checking the cache: {e}")))?;
        match checked {
            Ok(_) => {}
            Err(e @ crate::store::StoreError::HashMismatch { .. }) => tracing::warn!(
                event = "cache_refused",
                epoch = a.epoch,
                error = %e,
                "the model cache was altered and is refused: {e}; receiving it again"
            ),
            Err(e) => return Err(e.into()),
        }
    }

    let bar = progress_bar(ctx.progress, "receiving");
    let b = bar.clone();
    let fetched = fetch_needs(
        &ctx.conn,
        ctx.store.clone(),
        manifest.clone(),
        needs,
        move |done, total| {
            b.set_length(total);
            b.set_position(done);
        },
    )
    .await?
    .after(&header);
    bar.finish_and_clear();
    let fetch_ms = t0.elapsed().as_secs_f64() * 1e3;

    let t1 = Instant::now();
    let store = ctx.store.clone();
    let threads = ctx.threads;
    let spec = LoadSpec {
        layers: if expert_only { 0..0 } else { a.layers.clone() },
        embed: a.embed && !expert_only,
        head: a.head && !expert_only,
        experts: match &experts {
            Some(x) => ExpertSelection::PerLayer(x.held.clone()),
            None => ExpertSelection::All,
        },
        dense: true,
    };
    // The experts this node computes for other homes: those of layers outside its stage.
    let serve_spec = experts.as_ref().and_then(|x| {
        let stage_layers = if expert_only { 0..0 } else { a.layers.clone() };
        let held: Vec<Vec<usize>> = x
            .held
            .iter()
            .enumerate()
            .map(|(l, ids)| {
                if stage_layers.contains(&l) {
                    Vec::new()
                } else {
                    ids.clone()
                }
            })
            .collect();
        held.iter()
            .any(|ids| !ids.is_empty())
            .then(|| LoadSpec::experts_only(0..held.len(), ExpertSelection::PerLayer(held)))
    });
    let kv_type = a.kv_type;
    let samples = a.head;
    let (model, serve_model, tokenizer) = tokio::task::spawn_blocking(
        move || -> Result<(Model, Option<Model>, Option<Tokenizer>), FabricError> {
            // What the store never received is refused by name, not read as zeros.
            let g = store.open_model(&manifest)?;
            // The sampling stage compiles request grammars over the vocabulary. A model whose
            // tokenizer cannot be read still serves; a grammar request is refused at open.
            let tokenizer = samples.then(|| Tokenizer::from_gguf(&g)).and_then(|t| {
                t.map_err(|e| tracing::warn!("no tokenizer for grammars: {e}"))
                    .ok()
            });
            // An expert-only node's own model has no layers: nothing of it to stream.
            let load = |spec: LoadSpec, stream: bool| match streaming.filter(|_| stream) {
                Some(b) => Model::load_streaming(
                    &g,
                    spec,
                    ExpertStreaming::with_budget(b),
                    threads,
                    &mut |_, _| {},
                ),
                None => Model::load(&g, spec, threads, &mut |_, _| {}),
            };
            let m = load(spec, !expert_only)?.with_kv_type(kv_type)?;
            let s = match serve_spec {
                Some(spec) => Some(load(spec, true)?),
                None => None,
            };
            // Loaded means holding what the plan gave it: streamed experts fill their budget
            // (both stores fill at once).
            m.wait_experts_filled();
            if let Some(s) = &s {
                s.wait_experts_filled();
            }
            Ok((m, s, tokenizer))
        },
    )
    .await
    .map_err(|e| FabricError::Stopped(format!("loading: {e}")))??;
    let resident = model.resident_bytes() as u64
        + serve_model.as_ref().map_or(0, |m| m.resident_bytes()) as u64;
    // Streamed experts are read from disk as needed: only what the engine keeps counts.
    let held = if streaming.is_some() {
        resident
    } else {
        resident.max(weight_bytes)
    };
    let report = LoadReport {
        bytes_needed: fetched.bytes_needed,
        bytes_transferred: fetched.bytes_transferred,
        bytes_already_present: fetched.bytes_already_present,
        resident_bytes: resident,
        fetch_ms,
        load_ms: t1.elapsed().as_secs_f64() * 1e3,
    };
    let n_embd = model.config().n_embd;
    let stage_experts = model.expert_stats_source();
    let mut loaded = Some((model, serve_model, tokenizer, stage_experts));
    let event = EpochEvent::Loaded {
        ticket,
        held,
        n_embd,
    };
    // Whether it fits beside an epoch still installed, and whether it is still wanted, is the
    // machine's call; the stage is built and handed over under its lock, so that a release
    // cannot come between.
    shared.handle_epochs(event, |g, action| match action {
        EpochAction::Install {
            epoch, kv_budget, ..
        } => {
            let Some((model, serve_model, tokenizer, stage_experts)) = loaded.take() else {
                return;
            };
            let mut stage = Stage::new(a.clone(), model, kv_budget);
            stage.set_prefix_cache(ctx.prefix_cache);
            if let Some(t) = tokenizer {
                stage.set_tokenizer(t);
            }
            if let Some(m) = serve_model {
                g.serving.insert(epoch, Arc::new(m));
            }
            *shared
                .stage_experts
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = stage_experts;
            let _ = shared.worker.send(WorkerMsg::Install(Box::new(stage)));
            tracing::info!(
                event = "loaded",
                epoch,
                "loaded epoch {epoch}: needed {} bytes, received {} bytes, {} bytes already present",
                report.bytes_needed,
                report.bytes_transferred,
                report.bytes_already_present
            );
            let _ = shared.ctrl.send(NodeToCoord::Loaded {
                epoch,
                report: report.clone(),
            });
        }
        EpochAction::Discard { why, .. } => tracing::info!("dropping a load: {why}"),
        _ => {}
    });
    // A load not installed drops its weights here.
    drop(loaded);
    Ok(())
}

fn progress_bar(show: bool, what: &str) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    fn over(limit: Option<u64>) -> Result<(), BudgetRefusal> {
        Err(BudgetRefusal {
            requested: 1000,
            limit,
            limit_source: "memory budget \"600B\"".into(),
            total_ram: None,
            available_ram: None,
        })
    }

    #[test]
    fn experts_are_streamed_under_a_given_budget_or_over_the_limit() {
        // `--expert-budget` holds for an expert split's node and for a ring stage alike,
        // whether or not everything would fit.
        assert_eq!(
            expert_memory(Some(200), true, false, Ok(())).unwrap(),
            Some(200)
        );
        assert_eq!(
            expert_memory(Some(200), true, true, over(Some(600))).unwrap(),
            Some(200)
        );
        // Fitting, nothing is streamed; over the limit a stage keeps half of it, a node that
        // only serves experts all of it.
        assert_eq!(expert_memory(None, true, false, Ok(())).unwrap(), None);
        assert_eq!(
            expert_memory(None, true, false, over(Some(600))).unwrap(),
            Some(300)
        );
        assert_eq!(
            expert_memory(None, true, true, over(Some(600))).unwrap(),
            Some(600)
        );
        // No limit to stream under: refused.
        assert!(expert_memory(None, true, false, over(None)).is_err());
    }

    #[test]
    fn a_load_without_experts_streams_nothing_and_must_fit() {
        assert_eq!(
            expert_memory(Some(200), false, false, Ok(())).unwrap(),
            None
        );
        let e = expert_memory(Some(200), false, false, over(Some(600))).unwrap_err();
        assert_eq!(e.requested, 1000);
    }
}
