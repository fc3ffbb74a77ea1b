//! `tessera bench`: prefill and decode speed, peak memory, and the memory-bandwidth bound on
//! decode measured in the same run — so the figures can be read as a fraction of what the
//! machine allows. With `--expert-budget`, the experts are streamed from disk and the decode is
//! also read against the disk-bound rate. With `--draft`, speculative decoding is measured
//! against plain decoding in the same run instead (`bench_draft`).

use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// GGUF model files (default: the built-in stories260K). Several are measured in turn.
    #[arg(short, long)]
    model: Vec<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(short, long)]
    threads: Option<usize>,
    /// Prompt tokens for the prefill test; several (`-p 512,2048,8192`) run one prefill test
    /// each and then one decode test, as llama-bench does.
    #[arg(short = 'p', long, value_delimiter = ',', default_value = "64")]
    n_prompt: Vec<usize>,
    /// Tokens for the decode test (0: none).
    #[arg(short = 'n', long, default_value_t = 64)]
    n_gen: usize,
    /// Tokens of context already cached before each test (llama-bench's `-d`): decode at depth
    /// D reads D positions of KV cache per token.
    #[arg(short = 'd', long, default_value_t = 0)]
    depth: usize,
    /// Tokens per forward pass while prefilling (llama-bench's `-ub`).
    #[arg(long, default_value_t = 512)]
    ubatch: usize,
    /// Timed runs per test; their mean is reported, as llama-bench reports a mean.
    #[arg(short = 'r', long, default_value_t = tessera_engine::bench::REPEATS)]
    repetitions: usize,
    /// KV cache element type: f16 (default), q8_0 or f32.
    #[arg(long, default_value = "f16")]
    kv_type: tessera_engine::KvType,
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
    /// With --expert-budget: write a timeline of the last decode run to FILE, in Chrome's trace
    /// format (open it in https://ui.perfetto.dev): each step, each wait for a read and the
    /// layers run ahead meanwhile on the computing thread, and each read and build on its
    /// reader's, so the time the disk idles shows where it falls.
    #[arg(long, value_name = "FILE", requires = "expert_budget")]
    timeline: Option<PathBuf>,
    /// Measure speculative decoding against plain decoding, in the same run, on a text prompt
    /// (--draft-task): `lookup` (prompt lookup), `self` (the model as its own draft: every
    /// draft agrees, so this measures the mechanism's ceiling; k is fixed at --draft-max), or
    /// a GGUF draft model with the same vocabulary. Reports the acceptance rate, tokens per
    /// verification, the draft's cost and the speedup; -n tokens are generated greedily.
    #[arg(long, value_name = "lookup|self|FILE",
          conflicts_with_all = ["expert_budget", "depth", "n_prompt", "ubatch"])]
    draft: Option<String>,
    /// Most drafts per verification with --draft (1..=64). [default: 8]
    #[arg(long, value_name = "K", requires = "draft")]
    draft_max: Option<usize>,
    /// Always draft --draft-max tokens instead of adapting k to the measured acceptance.
    #[arg(long, requires = "draft")]
    draft_fixed: bool,
    /// The prompt for --draft: `copy` (a paragraph to write out again: prompt lookup's case)
    /// or `story` (a story opening to continue).
    #[arg(long, value_enum, default_value = "copy", requires = "draft")]
    draft_task: super::bench_draft::DraftTask,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let models = if args.model.is_empty() {
        vec![crate::default_model::path()?]
    } else {
        args.model
    };
    let threads = args.threads.unwrap_or_else(super::default_threads);
    if let Some(draft) = &args.draft {
        let opts = super::bench_draft::Options {
            draft: draft.clone(),
            max_k: args.draft_max,
            fixed: args.draft_fixed,
            task: args.draft_task,
            n_gen: args.n_gen,
            repetitions: args.repetitions,
            threads,
            kv_type: args.kv_type,
            json: args.json,
        };
        for path in &models {
            super::bench_draft::run(path, &opts)?;
        }
        return Ok(());
    }
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
    if args.timeline.is_some() && (models.len() > 1 || args.n_gen == 0) {
        anyhow::bail!("--timeline records one model's decode: give one -m and -n above 0");
    }
    // Created now, so that a path it cannot be written to fails before the benchmark runs.
    let mut timeline_file = match &args.timeline {
        Some(p) => {
            Some(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?)
        }
        None => None,
    };
    // One test with both figures for one prompt length; llama-bench's separate pp and tg
    // tests for several.
    let tests: Vec<(usize, usize)> = match args.n_prompt[..] {
        [p] => vec![(p, args.n_gen)],
        ref ps => ps
            .iter()
            .map(|&p| (p, 0))
            .chain((args.n_gen > 0).then_some((0, args.n_gen)))
            .collect(),
    };
    for path in models {
        for &(n_prompt, n_gen) in &tests {
            let config = tessera_engine::bench::BenchConfig {
                depth: args.depth,
                ubatch: args.ubatch,
                repetitions: args.repetitions,
                kv_type: args.kv_type,
                expert_budget,
                timeline: args.timeline.is_some() && n_gen > 0,
                ..tessera_engine::bench::BenchConfig::new(threads, n_prompt, n_gen)
            };
            let report = tessera_engine::bench::bench_config(&path, &config)?;
            if let (Some(file), Some(path), Some(rec)) =
                (&mut timeline_file, &args.timeline, &report.timeline)
            {
                write_timeline(file, path, rec)?;
            }
            if args.json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!("{report}\n");
            }
        }
    }
    Ok(())
}

/// Writes `rec` to `file` (created at `path`) as Chrome trace events (one track for the
/// computing thread, one a reader), and says so on stderr (stdout may carry `--json`).
fn write_timeline(
    file: &mut std::fs::File,
    path: &std::path::Path,
    rec: &tessera_engine::TimelineRecord,
) -> anyhow::Result<()> {
    use std::io::Write;
    use tessera_engine::timeline::{Lane, SpanKind};
    let matrix = |m: usize| ["gate", "up", "down"].get(m).copied().unwrap_or("?");
    let tid = |l: Lane| match l {
        Lane::Compute => 0,
        Lane::Reader(n) => n + 1,
    };
    let mut events = Vec::with_capacity(rec.spans.len() + 8);
    let mut lanes: Vec<usize> = rec.spans.iter().map(|s| tid(s.lane)).collect();
    lanes.push(0);
    lanes.sort_unstable();
    lanes.dedup();
    for t in lanes {
        let name = match t {
            0 => "computing thread".to_string(),
            n => format!("reader {}", n - 1),
        };
        events.push(serde_json::json!({
            "ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": name},
        }));
    }
    for s in &rec.spans {
        let (name, cat) = match s.kind {
            SpanKind::Step { rows } => (format!("step ({rows} rows)"), "step"),
            SpanKind::Wait { layer, expert } => (format!("wait L{layer} e{expert}"), "wait"),
            SpanKind::RunAhead { layer, to } => {
                (format!("run ahead L{layer}: to L{to}"), "run_ahead")
            }
            SpanKind::Read {
                layer,
                expert,
                matrix: m,
                ..
            } => (format!("read L{layer} e{expert} {}", matrix(m)), "read"),
            SpanKind::Build {
                layer,
                expert,
                matrix: m,
            } => (format!("build L{layer} e{expert} {}", matrix(m)), "build"),
        };
        events.push(serde_json::json!({
            "ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid(s.lane),
            "ts": s.start_us, "dur": s.dur_us, "args": s.kind,
        }));
    }
    let trace = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
    // Written as it is serialized: a long decode's trace runs to many MiB.
    let mut out = std::io::BufWriter::new(file);
    serde_json::to_writer(&mut out, &trace)
        .map_err(std::io::Error::from)
        .and_then(|()| out.flush())
        .with_context(|| format!("writing {}", path.display()))?;
    let dropped = match rec.dropped {
        0 => String::new(),
        n => format!(" ({n} more not kept)"),
    };
    eprintln!(
        "timeline: {} spans{dropped} written to {} (open it in https://ui.perfetto.dev)",
        rec.spans.len(),
        path.display()
    );
    Ok(())
}
