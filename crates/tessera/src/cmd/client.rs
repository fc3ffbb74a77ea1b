//! `tessera client`: seal a request so only the chosen worker can read it, and open the sealed
//! answer. The routing header (job id, attempt, recipient, model, context size, expiry, reply
//! key) stays readable for the coordinator and is authenticated: a coordinator that rewrites it
//! makes the job fail at the worker. The crypto lives in `tessera-seal`; this module reads files,
//! the clock and flags.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tessera_seal::{
    seal_job, seal_result, AnswerDigest, JobEnvelope, JobHeader, JobId, PublicKey, ResultEnvelope,
    SecretKey, UnixMillis,
};

/// Sealed requests to workers an untrusted coordinator routes but cannot read.
///
/// A typical exchange:
///
///   tessera client keygen --out reply.key          # the client's reply key (fresh per request)
///   tessera client seal --request req.json --to WORKER_PUBLIC_KEY --model qwen3-0.6b \
///       --reply-key reply.key --out job.sealed     # prints the job id and header
///   ... the coordinator routes job.sealed to the worker, which answers with result.sealed ...
///   tessera client open result.sealed --key reply.key --from WORKER_PUBLIC_KEY --job JOB_ID
///
/// Or all of it through a coordinator in one step (workers publish their keys in signed claims):
///
///   tessera client submit --coordinator TOKEN@HOST:PORT --data-dir client -m model.gguf -p "Hi"
///
/// A worker's key is made the same way (`keygen`) and published in its signed claims. `open`
/// also opens a job envelope with the worker's key, and `reply` seals an answer to a job, which is
/// what a worker does (useful for trying the exchange by hand).
#[derive(clap::Args, Debug)]
#[command(verbatim_doc_comment)]
pub struct ClientArgs {
    #[command(subcommand)]
    action: ClientAction,
}

#[derive(clap::Subcommand, Debug)]
enum ClientAction {
    /// Make an X25519 key pair: writes the secret to --out (owner-only), prints the public key.
    Keygen {
        /// Where to write the secret key.
        #[arg(long)]
        out: PathBuf,
        /// Replace an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Seal a request (JSON) to one worker's public key; writes the envelope, prints its header.
    Seal {
        /// The request body: a JSON document (an OpenAI chat or completion request).
        #[arg(long)]
        request: PathBuf,
        /// The worker's public key (64 hex digits, from its claims or its `keygen`).
        #[arg(long, value_name = "WORKER_PUBLIC_KEY")]
        to: PublicKey,
        /// The model the job runs on (in clear: the coordinator routes on it).
        #[arg(long)]
        model: String,
        /// KV positions the job needs, prompt plus most new tokens (in clear: the coordinator's
        /// memory filter).
        #[arg(long, default_value_t = 4096)]
        context_tokens: u64,
        /// Seconds until the worker refuses the envelope.
        #[arg(long, default_value_t = 60)]
        ttl: u64,
        /// Attempt number: 1, or the next one when the coordinator asks for a re-dispatch.
        #[arg(long, default_value_t = 1)]
        attempt: u32,
        /// Job id (32 hex digits) for a re-dispatch of an existing job; a fresh one otherwise.
        #[arg(long)]
        job: Option<JobId>,
        /// The client's key file (`keygen`): the answer is sealed to its public half.
        #[arg(long)]
        reply_key: PathBuf,
        /// Where to write the envelope.
        #[arg(long)]
        out: PathBuf,
    },
    /// Open an envelope: a result with the client's reply key (--from and --job required), or a
    /// job with the worker's key. Writes the plaintext to stdout or --out.
    Open {
        /// The envelope file.
        envelope: PathBuf,
        /// The secret key to open with.
        #[arg(long)]
        key: PathBuf,
        /// For a result: the public key of the worker the job was sealed to (only it can have
        /// written the answer).
        #[arg(long, value_name = "WORKER_PUBLIC_KEY")]
        from: Option<PublicKey>,
        /// For a result: the job id `seal` printed (an answer to another job is refused).
        #[arg(long)]
        job: Option<JobId>,
        /// Write the plaintext here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Run a generation sealed end to end through a coordinator that routes it without reading
    /// it (tokenized here, sealed to each candidate worker, the answer opened here).
    Submit(Box<super::submit::SubmitArgs>),
    /// Print an operator's public key (making the key in --dir on first use): nodes started
    /// with `--operator-dir DIR` are certified with it, and clients pin it with `--trust KEY`.
    OperatorKey {
        /// The operator's key directory (keep it off the coordinator's machine).
        #[arg(long)]
        dir: PathBuf,
    },
    /// As a worker: open a job envelope with the worker's key and seal `--answer` back to the
    /// job's reply key, bound to its job id and attempt.
    Reply {
        /// The job envelope.
        envelope: PathBuf,
        /// The worker's secret key.
        #[arg(long)]
        key: PathBuf,
        /// The answer's bytes.
        #[arg(long)]
        answer: PathBuf,
        /// Where to write the result envelope.
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(args: ClientArgs) -> anyhow::Result<()> {
    match args.action {
        ClientAction::Keygen { out, force } => keygen(&out, force),
        ClientAction::Submit(a) => super::submit::run(*a),
        ClientAction::OperatorKey { dir } => {
            let id = tessera_net::NodeIdentity::load_or_create(&dir)
                .with_context(|| format!("the operator key in {}", dir.display()))?;
            println!(
                "{}",
                tessera_seal::NodeKey::from_bytes(*id.public_key().as_bytes())
            );
            Ok(())
        }
        ClientAction::Seal {
            request,
            to,
            model,
            context_tokens,
            ttl,
            attempt,
            job,
            reply_key,
            out,
        } => {
            let body =
                fs::read(&request).with_context(|| format!("reading {}", request.display()))?;
            serde_json::from_slice::<serde_json::Value>(&body)
                .with_context(|| format!("{} is not a JSON document", request.display()))?;
            if attempt == 0 {
                bail!("--attempt counts from 1");
            }
            let reply = read_key(&reply_key)?;
            let header = JobHeader {
                job: job.unwrap_or_else(JobId::random),
                attempt,
                recipient: to.key_id(),
                model,
                context_tokens,
                expires_at: UnixMillis::now().plus(ttl.saturating_mul(1000)),
                reply_to: reply.public_key(),
            };
            let env = seal_job(&header, &body, &to)?;
            write(&out, &env.to_bytes())?;
            println!("{}", serde_json::to_string_pretty(&header)?);
            Ok(())
        }
        ClientAction::Open {
            envelope,
            key,
            from,
            job,
            out,
        } => {
            let bytes =
                fs::read(&envelope).with_context(|| format!("reading {}", envelope.display()))?;
            let key = read_key(&key)?;
            let plain = if let Ok(r) = ResultEnvelope::from_bytes(&bytes) {
                let (Some(from), Some(job)) = (from, job) else {
                    bail!(
                        "{} is a result: give --from WORKER_PUBLIC_KEY and --job JOB_ID",
                        envelope.display()
                    );
                };
                r.open(&key, &from, job)?.1
            } else {
                let env = JobEnvelope::from_bytes(&bytes).with_context(|| {
                    format!(
                        "{} is neither a result nor a job envelope",
                        envelope.display()
                    )
                })?;
                let body = env.open(&key)?;
                if env.header.expires_at <= UnixMillis::now() {
                    bail!(
                        "job {} expired at {} (a worker refuses it)",
                        env.header.job,
                        env.header.expires_at
                    );
                }
                body
            };
            match out {
                Some(p) => write(&p, &plain),
                None => Ok(std::io::stdout().write_all(&plain)?),
            }
        }
        ClientAction::Reply {
            envelope,
            key,
            answer,
            out,
        } => {
            let bytes =
                fs::read(&envelope).with_context(|| format!("reading {}", envelope.display()))?;
            let key = read_key(&key)?;
            let env = JobEnvelope::from_bytes(&bytes)?;
            let request = env.open(&key)?;
            let answer =
                fs::read(&answer).with_context(|| format!("reading {}", answer.display()))?;
            // No token ids here: the digest covers the answer's bytes.
            let digest = AnswerDigest::of_bytes(&request, &answer);
            let r = seal_result(&env.header, &key, digest, &answer)?;
            write(&out, &r.to_bytes())
        }
    }
}

fn keygen(out: &Path, force: bool) -> anyhow::Result<()> {
    if out.exists() && !force {
        bail!("{} exists (pass --force to replace it)", out.display());
    }
    let key = SecretKey::generate();
    write_secret(out, key.to_file_text().as_bytes())?;
    println!("public key: {}", key.public_key());
    println!("key id:     {}", key.key_id());
    Ok(())
}

fn read_key(path: &Path) -> anyhow::Result<SecretKey> {
    let text =
        fs::read_to_string(path).with_context(|| format!("reading key {}", path.display()))?;
    SecretKey::from_file_text(&text).with_context(|| format!("in {}", path.display()))
}

fn write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

fn write_secret(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let mut f = opts
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))
}
