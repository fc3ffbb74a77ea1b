//! `tessera pull ORG/NAME[:QUANT]`, and `--model hf:ORG/NAME[:QUANT]` wherever a model file is
//! taken: the model brought into the Hugging Face Hub cache (`tessera-hub`), with progress on
//! stderr, and the path of its file (a split model's first part) handed on.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tessera_hub::{HubConfig, ModelName, PullEvent};
use tessera_model::human_bytes;

#[derive(Args)]
pub struct PullArgs {
    /// A Hugging Face Hub repository and, optionally, the quantization: ORG/NAME[:QUANT], e.g.
    /// `unsloth/Qwen3-8B-GGUF:Q4_K_M` (without a quantization: the repository's only GGUF model,
    /// else its Q4_K_M). Split models (`-00001-of-0000N.gguf`) are pulled whole. Honours
    /// HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE and HF_HOME / HF_HUB_CACHE.
    pub name: String,
}

pub fn run(args: PullArgs) -> anyhow::Result<()> {
    let name = ModelName::parse(&args.name)?;
    let path = pull(&name)?;
    // The path alone on stdout, for scripts: `tessera generate -m "$(tessera pull …)"`.
    println!("{}", path.display());
    Ok(())
}

/// Pulls `name` (or finds it in the cache) and returns the file to open.
pub fn pull(name: &ModelName) -> anyhow::Result<PathBuf> {
    let config = HubConfig::from_env()?;
    let mut bar: Option<ProgressBar> = None;
    let pulled = tessera_hub::pull(&config, name, &mut |e| match e {
        PullEvent::Resolved { commit, files } => {
            let total: u64 = files.iter().filter_map(|f| f.size).sum();
            eprintln!(
                "{name}: {} file{} ({}) at commit {}",
                files.len(),
                if files.len() == 1 { "" } else { "s" },
                human_bytes(total),
                &commit[..12]
            );
        }
        PullEvent::Reused { file, bytes } => {
            eprintln!("  {file}: already in the cache ({})", human_bytes(bytes));
        }
        PullEvent::Downloading { file, from, total } => {
            let b = ProgressBar::with_draw_target(total, indicatif::ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template(
                    "  {msg} {bar:30} {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
                )
                .expect("static template"),
            );
            b.set_message(file.to_string());
            b.set_position(from);
            if from > 0 {
                // Said plainly: a bar is drawn only on a terminal.
                eprintln!("  {file}: resuming at {}", human_bytes(from));
            }
            bar = Some(b);
        }
        PullEvent::Progress { done, .. } => {
            if let Some(b) = &bar {
                b.set_position(done);
            }
        }
        PullEvent::Retrying { file, error } => {
            eprintln!("  {file}: {error}; resuming");
        }
        PullEvent::Verified { file } => {
            if let Some(b) = bar.take() {
                b.finish_and_clear();
            }
            eprintln!("  {file}: downloaded, SHA-256 verified");
        }
    });
    if let Some(b) = bar.take() {
        b.abandon();
    }
    let pulled = pulled.with_context(|| format!("pulling {name}"))?;
    Ok(pulled.files[0].clone())
}
