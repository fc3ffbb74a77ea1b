//! `tessera bench`: prefill and decode speed, peak memory, and the memory-bandwidth bound on
//! decode measured in the same run — so the figures can be read as a fraction of what the
//! machine allows.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// GGUF model files (default: the built-in stories260K). Several are measured in turn.
    #[arg(short, long)]
    model: Vec<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(short, long)]
    threads: Option<usize>,
    /// Prompt tokens for the prefill test.
    #[arg(short = 'p', long, default_value_t = 64)]
    n_prompt: usize,
    /// Tokens for the decode test.
    #[arg(short = 'n', long, default_value_t = 64)]
    n_gen: usize,
    /// Print the reports as JSON lines.
    #[arg(long)]
    json: bool,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let models = if args.model.is_empty() {
        vec![crate::default_model::path()?]
    } else {
        args.model
    };
    let threads = args.threads.unwrap_or_else(super::default_threads);
    for path in models {
        let report = tessera_engine::bench::bench(&path, threads, args.n_prompt, args.n_gen)?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!("{report}\n");
        }
    }
    Ok(())
}
