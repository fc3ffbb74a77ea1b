//! `tessera client submit`: a generation sealed end to end. The client tokenizes the prompt with
//! its own copy of the model's tokenizer, asks the coordinator for the workers' signed claims,
//! checks their signatures, seals the request once per candidate worker (attempt `k` to
//! candidate `k`, each with the job's fresh reply key) and submits them together. The
//! coordinator leases the job to one worker at a time and forwards one sealed answer, which only
//! this client can open and only the worker it was sealed to can have written.
//!
//! With `--trust KEY` the client seals only to workers an operator it trusts has certified; it
//! checks every answer's tokens against the digest the worker reported, and an answer counts as
//! verified only on the second worker's own result. `--verified-only` releases nothing else;
//! otherwise an unverified answer is marked so.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use tessera_client::sealed::client::seal;
use tessera_client::sealed::{ClientPolicy, SealedClient};
use tessera_client::ClientError;
use tessera_coord::sealed::MAX_CANDIDATES;
use tessera_model::{GgufFile, Tokenizer};
use tessera_net::NodeIdentity;
use tessera_proto::{SealedNews, SealedRequest};
use tessera_seal::{JobId, NodeKey, SecretKey};

#[derive(clap::Args, Debug)]
pub struct SubmitArgs {
    // The coordinator's `TOKEN@HOST:PORT` line (a client or operator token).
    #[command(flatten)]
    coordinator: super::token::CoordinatorLine,
    /// Where this client keeps its identity key.
    #[arg(long)]
    data_dir: PathBuf,
    /// The model's GGUF file, for its tokenizer: the prompt is tokenized here, so no text
    /// reaches the coordinator (default: the built-in stories260K).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// The prompt.
    #[arg(short, long)]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 64)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: super::sampling::SamplingArgs,
    /// Generate exactly --max-tokens, past any end-of-generation token.
    #[arg(long)]
    ignore_eos: bool,
    /// Seal to at most this many workers (attempt order: the first holds the job unless it
    /// fails, refuses or goes silent; the others take over or check the answer).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=MAX_CANDIDATES as u64))]
    workers: u64,
    /// Seconds each envelope stays valid.
    #[arg(long, default_value_t = 120)]
    ttl: u64,
    /// Submit this many jobs of the same request one after another (each its own job id and
    /// reply key; the first candidate rotates), and print each answer.
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Print the coordinator's news of each job and each answer as JSON lines.
    #[arg(long)]
    json: bool,
    /// After the answer, submit the same envelopes again and report what the coordinator says
    /// (it refuses a job id it has seen).
    #[arg(long, hide = true)]
    resubmit: bool,
    /// Test only: with --resubmit, also write the job's envelopes to this file.
    #[arg(long, hide = true, requires = "resubmit")]
    save_envelopes: Option<PathBuf>,
    /// Test only: submit the envelopes saved in this file again (after a restart, say) and
    /// report what the coordinator says, instead of a new job.
    #[arg(long, hide = true)]
    submit_saved: Option<PathBuf>,
    /// Accept a token that names no coordinator, trusting whichever key answers.
    #[arg(long)]
    trust_on_first_use: bool,
    /// Seal only to workers certified by this operator key (64 hex digits, as `tessera client
    /// operator-key` prints it; repeat for several operators). A listed worker without such a
    /// certificate is refused by key, whoever the coordinator says it is.
    #[arg(long, value_name = "KEY")]
    trust: Vec<NodeKey>,
    /// Release only answers a second worker agreed with (the check is asked for on every job,
    /// and done here on the second worker's own sealed result); any other answer is refused.
    #[arg(long)]
    verified_only: bool,
}

pub fn run(args: SubmitArgs) -> anyhow::Result<()> {
    let sampling = args.sampling.params()?;
    let target = super::token::parse_target(&args.coordinator.line()?, args.trust_on_first_use)
        .context("--coordinator")?;
    let model = crate::default_model::resolve(args.model.clone())?;
    let g = GgufFile::open(&model).with_context(|| format!("reading {}", model.display()))?;
    let tokenizer = Tokenizer::from_gguf(&g)?;
    let prompt_tokens = tokenizer.encode(&args.prompt, true);
    let eog = if args.ignore_eos {
        Vec::new()
    } else {
        let mut eog: Vec<u32> = (0..tokenizer.vocab_size() as u32)
            .filter(|&t| tokenizer.is_end_of_generation(t))
            .collect();
        eog.extend(tokenizer.bos_id());
        eog
    };
    let request = SealedRequest {
        prompt_tokens,
        max_new_tokens: args.max_tokens,
        sampling,
        eog,
    };
    std::fs::create_dir_all(&args.data_dir)?;
    let identity = NodeIdentity::load_or_create(&args.data_dir)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(drive(&identity, &target, &request, &tokenizer, &args))
}

async fn drive(
    identity: &NodeIdentity,
    target: &tessera_node::agent::JoinTarget,
    request: &SealedRequest,
    tokenizer: &Tokenizer,
    args: &SubmitArgs,
) -> anyhow::Result<()> {
    let client = SealedClient::connect(identity, target.addr, &target.token).await?;
    if let Some(path) = &args.submit_saved {
        let envelopes: Vec<tessera_seal::JobEnvelope> = serde_json::from_slice(
            &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
        )?;
        let job = envelopes.first().map(|e| e.header.job);
        let mut news = client.submit(envelopes, false).await?;
        while let Some(n) = news.recv().await {
            println!("{}", serde_json::json!({ "job": job, "news": n }));
            match n {
                SealedNews::Failed { reason } => {
                    let line = serde_json::json!({ "type": "resubmitted", "job": job,
                        "reason": reason.to_string(), "failure": reason });
                    println!("{line}");
                    client.close().await;
                    return Ok(());
                }
                SealedNews::Result { .. } => bail!("a resubmitted job was answered again"),
                _ => {}
            }
        }
        bail!("the session ended before the resubmitted job was settled");
    }
    let policy = ClientPolicy {
        trust: args.trust.clone(),
        verified_only: args.verified_only,
    };
    let mut out = std::io::stdout().lock();
    let holders = match client.trusted_holders(&policy.trust).await {
        Ok((holders, refused)) => {
            for why in refused {
                say_uncertified(&mut out, args.json, &why)?;
            }
            holders
        }
        Err(e) => {
            if args.json {
                let line = serde_json::json!({ "type": "refused", "reason": e.to_string() });
                writeln!(out, "{line}")?;
            }
            return Err(e.into());
        }
    };
    let mut refused_answers = 0usize;
    for n in 0..args.jobs {
        let mut order = holders.clone();
        let first = n % order.len();
        order.rotate_left(first);
        order.truncate(args.workers as usize);
        let ttl_ms = args.ttl.saturating_mul(1000);
        let mut print_news = |job: JobId, news: &SealedNews| {
            if args.json {
                let _ = writeln!(out, "{}", serde_json::json!({ "job": job, "news": news }));
                let _ = out.flush();
            }
        };
        // With --resubmit, the envelopes are kept to be sent again.
        let outcome = if args.resubmit {
            let reply = SecretKey::generate();
            let envelopes = seal(request, &order, &reply, ttl_ms)?;
            if let Some(path) = &args.save_envelopes {
                std::fs::write(path, serde_json::to_vec(&envelopes)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            let o = client
                .answer(
                    request,
                    envelopes.clone(),
                    &order,
                    &reply,
                    &policy,
                    &mut print_news,
                )
                .await?;
            let mut again = client.submit(envelopes, false).await?;
            let reason = match again.recv().await {
                Some(SealedNews::Failed { reason }) => reason,
                other => bail!("the coordinator took a resubmitted job: {other:?}"),
            };
            let line = serde_json::json!({ "type": "resubmitted", "job": o.job,
                "reason": reason.to_string(), "failure": reason });
            writeln!(out, "{line}")?;
            o
        } else {
            match client
                .run(request, &order, ttl_ms, &policy, &mut print_news)
                .await
            {
                Ok(o) => o,
                // An answer this client would not release: said, and the next job goes on.
                Err(ClientError::Refused(reason)) => {
                    refused_answers += 1;
                    if args.json {
                        let line =
                            serde_json::json!({ "type": "refused_answer", "reason": reason });
                        writeln!(out, "{line}")?;
                    } else {
                        eprintln!("refused an answer: {reason}");
                    }
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let text = tokenizer.decode(&outcome.answer.tokens);
        if args.json {
            let line = serde_json::json!({
                "type": "answer",
                "job": outcome.job,
                "attempt": outcome.attempt,
                "verified": outcome.verified,
                "tokens": outcome.answer.tokens,
                "finish_reason": outcome.answer.finish_reason,
                "text": text,
            });
            writeln!(out, "{line}")?;
        } else {
            writeln!(out, "{}{text}", args.prompt)?;
            if !outcome.verified {
                eprintln!(
                    "unverified: no second worker checked this answer (--verified-only \
                     releases verified answers only)"
                );
            }
        }
        out.flush()?;
    }
    client.close().await;
    if refused_answers > 0 {
        bail!("{refused_answers} of {} answers were refused", args.jobs);
    }
    Ok(())
}

/// Says that a listed worker was not sealed to, and why (naming its keys).
fn say_uncertified(
    out: &mut impl Write,
    json: bool,
    why: &tessera_seal::Uncertified,
) -> anyhow::Result<()> {
    if json {
        let line = serde_json::json!({ "type": "uncertified", "reason": why.to_string() });
        writeln!(out, "{line}")?;
    } else {
        eprintln!("not sealing to an uncertified worker: {why}");
    }
    Ok(())
}
