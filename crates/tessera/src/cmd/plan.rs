//! `tessera plan`: choose the best split of a model over a cluster and explain why.
//!
//! The model is a GGUF file (its header is read, no weights), a Hugging Face `config.json` (or a
//! directory holding one) plus `--quant`, or a planner model profile saved as JSON. The cluster is a
//! TOML file (format in `crates/tessera-plan/README.md`) whose nodes may name library profiles, so
//! "what if" questions need no running node.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tessera_model::kv::KvType;
use tessera_plan::{
    plan, profiles, render_text, ModelProfile, Objective, PlanError, Quant, ResourceGraph,
};

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// GGUF file, Hugging Face config.json (or its directory), or a saved planner profile (.json).
    #[arg(long, required_unless_present = "list_profiles")]
    pub model: Option<PathBuf>,
    /// Quantisation assumed for a config.json: Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, F16, BF16, F32.
    #[arg(long, default_value = "Q4_K")]
    pub quant: String,
    /// Cluster file (TOML): [[node]], [[link]], [defaults], [policy].
    #[arg(long, required_unless_present = "list_profiles")]
    pub nodes: Option<PathBuf>,
    /// What to optimise (overrides the cluster file's policy): latency (tokens/s each request
    /// sees while --concurrency requests are served), throughput (their aggregate) or balanced.
    #[arg(long)]
    pub objective: Option<String>,
    /// Context length each request's KV cache is sized for (overrides the policy).
    #[arg(long)]
    pub context: Option<u64>,
    /// Prompt length for time to first token (overrides the policy).
    #[arg(long)]
    pub prompt_tokens: Option<u64>,
    /// Concurrent requests the endpoint serves, as its gateway batches them (`--max-batch`):
    /// memory is sized and every objective priced at this many, so whole-request replicas win
    /// where one node would batch them all (overrides the policy; default 1).
    #[arg(long)]
    pub concurrency: Option<u32>,
    /// Element type of the KV cache the nodes keep (`tessera node --kv-type`): f16 (the
    /// default), q8_0 or f32. The memory each node needs for the context is sized in it.
    #[arg(long)]
    pub kv_type: Option<KvType>,
    /// Plan epoch to stamp on the plan.
    #[arg(long, default_value_t = 1)]
    pub epoch: u64,
    /// Print the plan and explanation as one JSON document.
    #[arg(long)]
    pub json: bool,
    /// List the hardware and link profiles usable in a cluster file, then exit.
    #[arg(long)]
    pub list_profiles: bool,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    if args.list_profiles {
        return list_profiles(args.json);
    }
    let (Some(model_path), Some(nodes_path)) = (&args.model, &args.nodes) else {
        bail!("--model and --nodes are required");
    };
    let model = load_model(model_path, &args.quant, args.kv_type)?;
    let text = std::fs::read_to_string(nodes_path)
        .with_context(|| format!("reading cluster file {}", nodes_path.display()))?;
    // A lab scenario is a cluster file plus the lab's own sections.
    let text = tessera_lab::scenario::planner_part(&text).map_err(anyhow::Error::msg)?;
    let mut graph = ResourceGraph::from_toml(&text)
        .with_context(|| format!("in cluster file {}", nodes_path.display()))?;
    if let Some(o) = &args.objective {
        graph.policy.objective = o.parse::<Objective>()?;
    }
    if let Some(c) = args.context {
        graph.policy.context_tokens = c.max(1);
    }
    if let Some(p) = args.prompt_tokens {
        graph.policy.prompt_tokens = p.max(1);
    }
    if let Some(c) = args.concurrency {
        graph.policy.concurrency = c.max(1);
    }
    match plan(&model, &graph, args.epoch) {
        Ok(outcome) => {
            if args.json {
                println!("{}", serde_json::to_string_pretty(&outcome.to_json())?);
            } else {
                print!("{}", render_text(&outcome));
            }
            Ok(())
        }
        Err(PlanError::NoFeasiblePlan { rejected }) => {
            if args.json {
                let doc = serde_json::json!({
                    "strategy": null,
                    "error": "no feasible plan",
                    "rejected": rejected,
                });
                println!("{}", serde_json::to_string_pretty(&doc)?);
            }
            let reasons: Vec<String> = rejected
                .iter()
                .map(|r| format!("  - [{}] {}", r.strategy, r.reason))
                .collect();
            bail!(
                "no feasible plan for {} on this cluster:\n{}",
                model.name,
                reasons.join("\n")
            )
        }
        Err(e) => Err(e.into()),
    }
}

/// The planner's model: a GGUF file's cache sized in `kv_type` exactly; a Hugging Face config's
/// (which the planner library counts in F16) scaled to it; a saved profile as it was saved.
fn load_model(path: &Path, quant: &str, kv_type: Option<KvType>) -> anyhow::Result<ModelProfile> {
    let path = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    let is_gguf = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if is_gguf {
        return from_gguf(&path, kv_type.unwrap_or_default());
    }
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    if value.get("layers").is_some_and(serde_json::Value::is_array) {
        if let Some(t) = kv_type {
            bail!(
                "--kv-type {t}: {} is a saved planner profile, whose KV bytes per position are \
                 fixed in it; save it again from the GGUF file with the KV type wanted",
                path.display()
            );
        }
        let profile: ModelProfile = serde_json::from_value(value)
            .with_context(|| format!("{} is not a planner model profile", path.display()))?;
        profile.validate()?;
        return Ok(profile);
    }
    let q: Quant = quant.parse()?;
    let mut profile = ModelProfile::from_hf_config(&text, q)
        .with_context(|| format!("reading {}", path.display()))?;
    // Per 32 elements: F16 64 bytes, Q8_0 34, F32 128 (every head width is whole blocks).
    let per_block = kv_type.unwrap_or_default().bytes_for(32) as u64;
    for l in &mut profile.layers {
        l.kv_per_token = tessera_plan::Bytes(l.kv_per_token.0 * per_block / 64);
    }
    Ok(profile)
}

/// The planner's view of a GGUF model: the conversion `--plan auto` on the coordinator uses too.
fn from_gguf(path: &Path, kv_type: KvType) -> anyhow::Result<ModelProfile> {
    let gguf = tessera_model::GgufFile::open(path)?;
    let p = tessera_model::ModelProfile::from_gguf(&gguf).context("reading the model profile")?;
    Ok(tessera_placement::planning::planner_model(
        &p,
        kv_type,
        &path.display().to_string(),
    )?)
}

fn list_profiles(json: bool) -> anyhow::Result<()> {
    if json {
        let doc = serde_json::json!({
            "hardware": profiles::hardware_profiles(),
            "links": profiles::link_profiles(),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!(
        "Hardware profiles (every figure an estimate; see `--list-profiles --json` for sources)"
    );
    for p in profiles::hardware_profiles() {
        let gpu = if p.vram.0 > 0 {
            format!(
                ", VRAM {} at {}, GPU {}",
                p.vram, p.vram_bandwidth, p.gpu_compute
            )
        } else {
            String::new()
        };
        println!(
            "  {:<22} RAM {} at {}, {}{gpu}, disk {} at {} — {}",
            p.name, p.ram, p.mem_bandwidth, p.ram_compute, p.disk, p.disk_bandwidth, p.description
        );
    }
    println!("Link profiles");
    for l in profiles::link_profiles() {
        println!(
            "  {:<14} rtt {:.2} ms, {} — {}",
            l.name,
            l.rtt_s * 1e3,
            l.bandwidth,
            l.description
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo(path: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(path)
    }

    fn kv_per_position(m: &ModelProfile) -> u64 {
        m.layers[0].kv_per_token.0
    }

    #[test]
    fn the_kv_type_sizes_the_cache_of_a_gguf_file_and_a_config_and_a_saved_profile_refuses_it() {
        let gguf = repo("models/test/tiny-qwen3-Q8_0.gguf");
        let f16 = kv_per_position(&load_model(&gguf, "Q4_K", None).unwrap());
        let f32 = kv_per_position(&load_model(&gguf, "Q4_K", Some(KvType::F32)).unwrap());
        assert_eq!(2 * f16, f32, "F16 is the default");

        let config = repo("crates/tessera-plan/models/qwen3-30b-a3b.config.json");
        let hf = |t| kv_per_position(&load_model(&config, "Q4_K", t).unwrap());
        assert_eq!(hf(Some(KvType::F32)), 2 * hf(None));
        assert_eq!(hf(Some(KvType::Q8_0)) * 32, hf(None) * 17);

        let dir = tempfile::tempdir().unwrap();
        let saved = dir.path().join("profile.json");
        let profile = load_model(&gguf, "Q4_K", None).unwrap();
        std::fs::write(&saved, serde_json::to_vec(&profile).unwrap()).unwrap();
        assert_eq!(
            kv_per_position(&load_model(&saved, "Q4_K", None).unwrap()),
            f16
        );
        let refused = load_model(&saved, "Q4_K", Some(KvType::Q8_0)).unwrap_err();
        assert!(
            refused.to_string().contains("saved planner profile"),
            "{refused}"
        );
    }
}
