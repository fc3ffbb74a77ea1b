//! `tessera run`: one generation across an enrolled cluster, before the HTTP API exists.
//!
//! The client is authenticated like a node: it has its own key (in `--data-dir`) and enrols
//! with the join token on first use. It asks the coordinator to place the model (`--split` or
//! `--plan`, or the current assignment), then prints the text as it streams in — the same
//! output `tessera generate` prints in one process. `--json` prints every message instead, and
//! `--bench` a report: decode tokens/s, bytes per token on each boundary, hop latency.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use tessera_client::session::ClusterSession;
use tessera_net::NodeIdentity;
use tessera_node::agent::JoinTarget;
use tessera_placement::assignment::{parse_split, PlanFile};
use tessera_proto::{ClientToCoord, CoordToClient, RunReport, RunRequest};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    // The coordinator's `TOKEN@HOST:PORT` line.
    #[command(flatten)]
    coordinator: super::token::CoordinatorLine,
    /// Where this client keeps its identity key.
    #[arg(long)]
    data_dir: PathBuf,
    /// The prompt.
    #[arg(short, long)]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 128)]
    max_tokens: usize,
    /// Stages in ring order, e.g. `0..3,3..5` (nodes in the order they joined).
    #[arg(long, conflicts_with = "plan")]
    split: Option<String>,
    /// A plan file naming the node of each stage.
    #[arg(long)]
    plan: Option<PathBuf>,
    #[command(flatten)]
    sampling: super::sampling::SamplingArgs,
    /// Prompt tokens per prefill step (pipelined across stages).
    #[arg(long, default_value_t = 64)]
    prefill_chunk: usize,
    /// Ask every stage for a blake3 hash of each hidden state it outputs.
    #[arg(long)]
    trace: bool,
    /// Generate exactly -n tokens, past any end-of-generation token.
    #[arg(long)]
    ignore_eos: bool,
    /// Speculation on the ring: the sampling stage drafts up to K tokens by prompt lookup
    /// (copying what followed the last few tokens earlier in the text) with each token it
    /// sends back, and the ring checks them in one turn. The text is the same; a text that
    /// repeats itself needs fewer turns. 0 (the default): off. At most 16.
    #[arg(long, value_name = "K", default_value_t = 0,
          value_parser = clap::value_parser!(u16).range(0..=16))]
    speculate: u16,
    /// What the answer is expected to be close to (the file being edited, the paragraph being
    /// rewritten), read from FILE: the drafts come from it where the answer follows it, so an
    /// answer that mostly repeats it takes few ring turns. The text is the same as without.
    /// Needs --speculate.
    #[arg(long, value_name = "FILE", requires = "speculate")]
    prediction_file: Option<std::path::PathBuf>,
    /// The predicted answer as token ids, a JSON array read from FILE (as `--json` prints
    /// them): an earlier answer replayed exactly, where its text would tokenize otherwise.
    /// Needs --speculate.
    #[arg(
        long,
        value_name = "FILE",
        requires = "speculate",
        conflicts_with = "prediction_file"
    )]
    prediction_tokens: Option<std::path::PathBuf>,
    /// Print every message from the coordinator as a JSON line.
    #[arg(long)]
    json: bool,
    /// Print the run's report (tokens/s, bytes per boundary, hop latency) to stderr.
    #[arg(long)]
    bench: bool,
    /// Constrain the output to this JSON schema (inline JSON), as the API's `response_format`
    /// does: the sampling stage masks every draw with it.
    #[arg(long, value_name = "JSON")]
    json_schema: Option<String>,
    /// Report each token's log-probability and this many alternatives (0–20; in `--json`).
    #[arg(long, value_name = "N")]
    top_logprobs: Option<usize>,
    /// Accept a token that names no coordinator, trusting whichever key answers.
    #[arg(long)]
    trust_on_first_use: bool,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let sampling = args.sampling.params()?;
    let target = super::token::parse_target(&args.coordinator.line()?, args.trust_on_first_use)
        .context("--coordinator")?;
    let stages = match (&args.split, &args.plan) {
        (Some(s), _) => Some(parse_split(s).context("--split")?),
        (None, Some(p)) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Some(serde_json::from_str::<PlanFile>(&text)?.stages)
        }
        (None, None) => None,
    };
    let request = RunRequest {
        prompt: Some(args.prompt.clone()),
        prompt_tokens: None,
        max_new_tokens: args.max_tokens,
        sampling,
        stages,
        prefill_chunk: args.prefill_chunk,
        trace: args.trace,
        stop_at_eog: !args.ignore_eos,
        grammar: args
            .json_schema
            .as_deref()
            .map(serde_json::from_str)
            .transpose()
            .context("--json-schema is not JSON")?
            .map(tessera_gateway::grammar::GrammarSpec::JsonSchema),
        logprobs: args.top_logprobs,
        speculate: usize::from(args.speculate),
        prediction: prediction(&args)?,
    };
    std::fs::create_dir_all(&args.data_dir)?;
    let identity = NodeIdentity::load_or_create(&args.data_dir)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(drive(&identity, &target, request, &args))?;
    if args.bench {
        print_report(&report);
    }
    Ok(())
}

/// The predicted answer `--prediction-file` or `--prediction-tokens` names.
fn prediction(args: &RunArgs) -> anyhow::Result<Option<tessera_proto::Prediction>> {
    use tessera_proto::Prediction;
    let read = |p: &std::path::Path, flag: &str| {
        std::fs::read_to_string(p).with_context(|| format!("reading {flag} {}", p.display()))
    };
    if let Some(p) = &args.prediction_file {
        return Ok(Some(Prediction::Text(read(p, "--prediction-file")?)));
    }
    if let Some(p) = &args.prediction_tokens {
        let ids: Vec<u32> =
            serde_json::from_str(&read(p, "--prediction-tokens")?).with_context(|| {
                format!(
                    "--prediction-tokens {}: not a JSON array of token ids",
                    p.display()
                )
            })?;
        return Ok(Some(Prediction::Tokens(ids)));
    }
    Ok(None)
}

/// Enrols (or reconnects) as a client and opens a control session past the coordinator's
/// welcome.
pub(crate) async fn connect_client(
    identity: &NodeIdentity,
    target: &JoinTarget,
) -> anyhow::Result<ClusterSession> {
    ClusterSession::connect(identity, target.addr, &target.token)
        .await
        .context("connecting to the coordinator")
}

async fn drive(
    identity: &NodeIdentity,
    target: &JoinTarget,
    request: RunRequest,
    args: &RunArgs,
) -> anyhow::Result<RunReport> {
    let mut session = connect_client(identity, target).await?;
    session.send(&ClientToCoord::Run(Box::new(request))).await?;
    let mut out = std::io::stdout().lock();
    loop {
        let msg = session.next().await?;
        if args.json {
            writeln!(out, "{}", serde_json::to_string(&msg)?)?;
            out.flush()?;
        }
        match msg {
            CoordToClient::Started { .. } if !args.json => {
                write!(out, "{}", args.prompt)?;
                out.flush()?;
            }
            CoordToClient::Token { text, .. } if !args.json => {
                write!(out, "{text}")?;
                out.flush()?;
            }
            // A lost stage is absorbed by the coordinator: the run pauses and resumes with the
            // same tokens. Said on stderr, so that stdout stays the generated text.
            CoordToClient::Paused { reason, .. } if !args.json => {
                eprintln!("[paused: {reason}; the cluster is re-planning]");
            }
            CoordToClient::Resumed {
                epoch, generated, ..
            } if !args.json => {
                eprintln!("[resumed on epoch {epoch} after {generated} tokens]");
            }
            CoordToClient::Done(report) => {
                if !args.json {
                    writeln!(out)?;
                }
                session.close().await;
                if let Some(e) = &report.error {
                    bail!("the run failed: {e}");
                }
                return Ok(*report);
            }
            CoordToClient::Error { message } => bail!("{message}"),
            CoordToClient::Refused { reason } => bail!("refused: {reason}"),
            _ => {}
        }
    }
}

fn print_report(r: &RunReport) {
    eprintln!(
        "stages: {}",
        r.stages
            .iter()
            .map(|s| format!("{}={}..{}", s.name, s.layers.start, s.layers.end))
            .collect::<Vec<_>>()
            .join(" ")
    );
    eprintln!(
        "prompt {} tokens, generated {} ({}); first token after {:.1} ms; decode {:.2} tokens/s",
        r.prompt_tokens, r.generated, r.reason, r.time_to_first_token_ms, r.decode_tokens_per_s
    );
    for b in &r.boundaries {
        eprintln!(
            "boundary {}->{}: {:.1} bytes per decode token (payload {} B), {} bytes in prefill",
            b.from, b.to, b.decode_bytes_per_token, b.hidden_payload_bytes, b.prefill_bytes
        );
    }
    for s in &r.stage_stats {
        let per = |ns: u64, n: u64| ns as f64 / n.max(1) as f64 / 1e3;
        eprintln!(
            "stage {}: decode compute {:.1} µs/token, prefill compute {:.1} ms",
            s.stage,
            per(s.decode.compute_ns, s.decode.steps),
            s.prefill.compute_ns as f64 / 1e6
        );
        if s.decode.expert_round_trips + s.prefill.expert_round_trips > 0 {
            eprintln!(
                "stage {}: expert split: {:.2} expert round trips per decode step ({:.0} bytes), {} in prefill",
                s.stage,
                s.decode.expert_round_trips as f64 / s.decode.steps.max(1) as f64,
                s.decode.expert_bytes as f64 / s.decode.steps.max(1) as f64,
                s.prefill.expert_round_trips
            );
        }
        let d = &s.decode;
        let o = &d.owners;
        if d.expert_round_trips > 0 {
            let per_step = |x: u64| x as f64 / d.steps.max(1) as f64;
            let streamed = if o.lookups > 0 {
                format!(
                    "hit rate {:.1}%, {:.2} MiB read from disk and {:.1} ms waiting for reads",
                    100.0 * (1.0 - o.misses as f64 / o.lookups as f64),
                    per_step(o.disk_bytes) / (1 << 20) as f64,
                    per_step(o.read_wait_ns) / 1e6,
                )
            } else {
                "every expert in memory".into()
            };
            eprintln!(
                "stage {}: expert owners per decode step: {streamed}; the slowest owner computes {:.1} ms, the home waits {:.1} ms for replies",
                s.stage,
                per_step(o.slowest_serve_ns) / 1e6,
                per_step(o.reply_wait_ns) / 1e6,
            );
        }
        if d.expert_lookups > 0 {
            eprintln!(
                "stage {}: streamed experts: hit rate {:.1}%, {:.2} MiB read from disk and {:.1} ms waiting for reads per decode step",
                s.stage,
                100.0 * (1.0 - d.expert_misses as f64 / d.expert_lookups as f64),
                d.expert_disk_bytes as f64 / d.steps.max(1) as f64 / (1 << 20) as f64,
                d.expert_read_wait_ns as f64 / d.steps.max(1) as f64 / 1e6,
            );
        }
    }
    if let Some(h) = r.hop_latency_us {
        eprintln!(
            "hop latency: {h:.1} µs per hop per token (ring time minus stage compute, over hops)"
        );
    }
    for s in &r.stages {
        if let Some(l) = &s.link_to_next {
            eprintln!(
                "link stage {} -> next: rtt {:?}, {:.1} MB/s",
                s.stage,
                l.rtt_median,
                l.bytes_per_s / 1e6
            );
        }
    }
}
