//! `tessera inspect`: the model profile, read from the GGUF header without loading weights.

use std::path::PathBuf;

use anyhow::Context;
use tessera_model::{GgufFile, ModelProfile};

#[derive(clap::Args)]
pub struct InspectArgs {
    /// GGUF model file, the first part of a split one, or hf:ORG/NAME[:QUANT] (default: the
    /// built-in stories260K).
    model: Option<PathBuf>,
    /// Print the profile as JSON (every tensor included).
    #[arg(long)]
    json: bool,
    /// Also list every tensor with its type, shape, offset and size.
    #[arg(long)]
    tensors: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let path = crate::default_model::resolve(args.model)?;
    let gguf = GgufFile::open(&path)?;
    let profile = ModelProfile::from_gguf(&gguf).context("reading the model profile")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&profile)?);
        return Ok(());
    }
    print!("{profile}");
    // Which kernel path each weight type would take in this process (a scalar one is slow).
    let paths = tessera_engine::kernels::type_paths(gguf.tensors());
    let paths: Vec<String> = paths.iter().map(|p| p.to_string()).collect();
    println!("kernels: {}", paths.join(", "));
    if gguf.is_split() {
        let parts = gguf.part_paths();
        println!("read from {} gguf-split parts:", parts.len());
        for p in parts {
            println!("  {}", p.display());
        }
    }
    if args.tensors {
        println!();
        println!(
            "{:<32} {:>6} {:>20} {:>12} {:>12}",
            "tensor", "type", "shape", "offset", "bytes"
        );
        for t in &profile.tensors {
            println!(
                "{:<32} {:>6} {:>20} {:>12} {:>12}",
                t.name,
                t.dtype,
                format!("{:?}", t.shape),
                t.offset,
                t.bytes
            );
        }
    }
    Ok(())
}
