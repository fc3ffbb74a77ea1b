//! `tessera client submit`: a generation sealed end to end. The client tokenizes the prompt with
//! its own copy of the model's tokenizer, asks the coordinator for the workers' signed claims,
//! checks their signatures, seals the request once per candidate worker (attempt `k` to
//! candidate `k`, each with the job's fresh reply key) and submits them together. The
//! coordinator leases the job to one worker at a time and forwards one sealed answer, which only
//! this client can open and only the worker it was sealed to can have written.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use tessera_model::{GgufFile, Tokenizer};
use tessera_net::NodeIdentity;
use tessera_node::protocol::{
    frame, ClientToCoord, CoordToClient, SealedAnswer, SealedNews, SealedRequest, SealedSubmit,
};
use tessera_seal::{seal_job, JobEnvelope, JobHeader, JobId, SecretKey, SignedClaims, UnixMillis};

/// Most candidate workers one job is sealed to (the coordinator's cap).
const MAX_CANDIDATES: usize = 8;

#[derive(clap::Args, Debug)]
pub struct SubmitArgs {
    /// The coordinator's `TOKEN@HOST:PORT` line (a client or operator token).
    #[arg(long, value_name = "TOKEN@HOST:PORT")]
    coordinator: String,
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
    /// Accept a token that names no coordinator, trusting whichever key answers.
    #[arg(long)]
    trust_on_first_use: bool,
}

pub fn run(args: SubmitArgs) -> anyhow::Result<()> {
    let target = super::token::parse_target(&args.coordinator, args.trust_on_first_use)
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
        sampling: args.sampling.params(),
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
    let (endpoint, conn, mut s) = super::run::connect_client(identity, target).await?;
    s.writer
        .write_message(frame::MSG, &ClientToCoord::Holders { model: None })
        .await?;
    let holders = match s.reader.read_message::<CoordToClient>(frame::MSG).await? {
        CoordToClient::Holders { holders } => holders,
        CoordToClient::Error { message } => bail!("{message}"),
        other => bail!("unexpected answer {other:?}"),
    };
    let holders = checked_holders(holders)?;
    let body = serde_json::to_vec(request)?;
    let mut out = std::io::stdout().lock();
    for n in 0..args.jobs {
        let mut order = holders.clone();
        let first = n % order.len();
        order.rotate_left(first);
        order.truncate(args.workers as usize);
        let reply = SecretKey::generate();
        let envelopes = seal_to(&order, &body, request, &reply, args.ttl)?;
        let job = envelopes[0].header.job;
        let submit = ClientToCoord::SealedSubmit(SealedSubmit {
            envelopes: envelopes.clone(),
        });
        s.writer.write_message(frame::MSG, &submit).await?;
        let (attempt, verified, answer) = loop {
            let msg: CoordToClient = s.reader.read_message(frame::MSG).await?;
            let news = match msg {
                CoordToClient::Sealed { job: j, news } if j == job => news,
                CoordToClient::Error { message } => bail!("{message}"),
                _ => continue,
            };
            if args.json {
                writeln!(out, "{}", serde_json::json!({ "job": job, "news": news }))?;
                out.flush()?;
            }
            match news {
                SealedNews::Result { result, verified } => {
                    let worker = order
                        .iter()
                        .find(|c| c.claims.seal_key.key_id() == result.header.worker)
                        .context("an answer from a worker the job was not sealed to")?;
                    let (attempt, plain) = result.open(&reply, &worker.claims.seal_key, job)?;
                    let answer: SealedAnswer =
                        serde_json::from_slice(&plain).context("a malformed sealed answer")?;
                    break (attempt, verified, answer);
                }
                SealedNews::Failed { reason } => bail!("job {job} failed: {reason}"),
                _ => {}
            }
        };
        let text = tokenizer.decode(&answer.tokens);
        if args.json {
            let line = serde_json::json!({
                "type": "answer",
                "job": job,
                "attempt": attempt,
                "verified": verified,
                "tokens": answer.tokens,
                "finish_reason": answer.finish_reason,
                "text": text,
            });
            writeln!(out, "{line}")?;
        } else {
            writeln!(out, "{}{text}", args.prompt)?;
        }
        out.flush()?;
        if args.resubmit {
            s.writer.write_message(frame::MSG, &submit).await?;
            let reason = loop {
                match s.reader.read_message::<CoordToClient>(frame::MSG).await? {
                    CoordToClient::Sealed {
                        job: j,
                        news: SealedNews::Failed { reason },
                    } if j == job => break reason,
                    CoordToClient::Sealed {
                        job: j,
                        news: SealedNews::Result { .. },
                    } if j == job => bail!("the coordinator answered a resubmitted job"),
                    _ => {}
                }
            };
            let line = serde_json::json!({ "type": "resubmitted", "job": job, "reason": reason });
            writeln!(out, "{line}")?;
        }
    }
    let _ = s.writer.finish().await;
    conn.close("done");
    endpoint.close();
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    Ok(())
}

/// The claims whose signatures hold and that name a model, best first (the coordinator's
/// order); all must name the same model.
fn checked_holders(holders: Vec<SignedClaims>) -> anyhow::Result<Vec<SignedClaims>> {
    let valid: Vec<SignedClaims> = holders
        .into_iter()
        .filter(|c| c.verify().is_ok() && !c.claims.models.is_empty())
        .collect();
    let Some(first) = valid.first() else {
        bail!(
            "no worker holds a whole copy of the model now (sealed jobs run on single-node cells)"
        );
    };
    let model = first.claims.models[0].clone();
    let same: Vec<SignedClaims> = valid
        .into_iter()
        .filter(|c| c.claims.models.contains(&model))
        .collect();
    Ok(same)
}

/// One envelope per candidate: attempt `k` sealed to candidate `k`.
fn seal_to(
    order: &[SignedClaims],
    body: &[u8],
    request: &SealedRequest,
    reply: &SecretKey,
    ttl_s: u64,
) -> anyhow::Result<Vec<JobEnvelope>> {
    let job = JobId::random();
    let now = UnixMillis::now();
    order
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let header = JobHeader {
                job,
                attempt: i as u32 + 1,
                recipient: c.claims.seal_key.key_id(),
                model: c.claims.models[0].clone(),
                context_tokens: (request.prompt_tokens.len() + request.max_new_tokens) as u64,
                expires_at: now.plus(ttl_s.saturating_mul(1000)),
                reply_to: reply.public_key(),
            };
            Ok(seal_job(&header, body, &c.claims.seal_key)?)
        })
        .collect()
}
