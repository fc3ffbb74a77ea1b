//! `tessera bench`: prefill and decode speed, peak memory, and the memory-bandwidth bound on
//! decode measured in the same run — so the figures can be read as a fraction of what the
//! machine allows. With `--expert-budget`, the experts are streamed from disk and the decode is
//! also read against the disk-bound rate.

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
    /// Stream a mixture-of-experts model's experts from disk through a cache of this size
    /// (e.g. `100MiB`), as a node given `--expert-budget` does, and report the hit rate, the
    /// missed-expert bytes per token, the disk's read bandwidth and the disk-bound decode rate
    /// (their quotient). The decode then feeds pseudo-random tokens, so that a synthetic
    /// model's repeated greedy token does not route the same way every step.
    #[arg(long, value_name = "SIZE")]
    expert_budget: Option<String>,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let models = if args.model.is_empty() {
        vec![crate::default_model::path()?]
    } else {
        args.model
    };
    let threads = args.threads.unwrap_or_else(super::default_threads);
    let expert_budget = match args
        .expert_budget
        .as_deref()
        .map(tessera_node::MemoryBudget::parse)
    {
        None => None,
        Some(Ok(tessera_node::MemoryBudget::Bytes(b))) => Some(b),
        Some(Ok(_)) => anyhow::bail!("--expert-budget: give an absolute size, e.g. 100MiB"),
        Some(Err(e)) => return Err(anyhow::Error::new(e).context("--expert-budget")),
    };
    for path in models {
        let report = tessera_engine::bench::bench_with(
            &path,
            threads,
            args.n_prompt,
            args.n_gen,
            expert_budget,
        )?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!("{report}\n");
        }
    }
    Ok(())
}
