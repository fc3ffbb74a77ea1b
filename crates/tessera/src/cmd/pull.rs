//! `tessera pull ORG/NAME[:QUANT]`, and `--model hf:ORG/NAME[:QUANT]` wherever a model file is
//! taken: the model brought into the Hugging Face Hub cache (`tessera-hub`), with progress on
//! stderr, and the path of its file (a split model's first part) handed on.
//!
//! With `TESSERA_LOG_FORMAT=json` each progress line is instead one JSON event on stderr
//! (`pull_resolved`, `pull_reused`, `pull_downloading` with the byte it starts `from`,
//! `pull_retrying`, `pull_verified`; the line as its `message`), so scripts and tests read
//! fields instead of wording; stdout stays the path alone.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
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
            tell(
                "pull_resolved",
                json!({"model": name.to_string(), "commit": commit, "files": files.len(),
                       "bytes": total}),
                &format!(
                    "{name}: {} file{} ({}) at commit {}",
                    files.len(),
                    if files.len() == 1 { "" } else { "s" },
                    human_bytes(total),
                    &commit[..12]
                ),
            );
        }
        PullEvent::Reused { file, bytes } => {
            tell(
                "pull_reused",
                json!({"file": file, "bytes": bytes}),
                &format!("  {file}: already in the cache ({})", human_bytes(bytes)),
            );
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
            let fields = json!({"file": file, "from": from, "total": total});
            if from > 0 {
                // Said plainly: a bar is drawn only on a terminal.
                let line = format!("  {file}: resuming at {}", human_bytes(from));
                tell("pull_downloading", fields, &line);
            } else if crate::logging::json_format() {
                // A fresh start has no plain line (the bar is its line), but it is an event.
                tell(
                    "pull_downloading",
                    fields,
                    &format!("  {file}: downloading"),
                );
            }
            bar = Some(b);
        }
        PullEvent::Progress { done, .. } => {
            if let Some(b) = &bar {
                b.set_position(done);
            }
        }
        PullEvent::Retrying { file, error } => {
            tell(
                "pull_retrying",
                json!({"file": file, "error": error.to_string()}),
                &format!("  {file}: {error}; resuming"),
            );
        }
        PullEvent::Verified { file } => {
            if let Some(b) = bar.take() {
                b.finish_and_clear();
            }
            tell(
                "pull_verified",
                json!({"file": file}),
                &format!("  {file}: downloaded, SHA-256 verified"),
            );
        }
    });
    if let Some(b) = bar.take() {
        b.abandon();
    }
    let pulled = pulled.with_context(|| format!("pulling {name}"))?;
    Ok(pulled.files[0].clone())
}

/// A progress line on stderr: `line` as is, or, with `TESSERA_LOG_FORMAT=json`, one JSON object
/// with `event`, `fields` and `line` as its `message` (stdout is the path alone either way).
fn tell(event: &str, fields: Value, line: &str) {
    if crate::logging::json_format() {
        let mut o = serde_json::Map::new();
        o.insert("event".into(), event.into());
        if let Value::Object(f) = fields {
            o.extend(f);
        }
        o.insert("message".into(), line.into());
        eprintln!("{}", Value::Object(o));
    } else {
        eprintln!("{line}");
    }
}
