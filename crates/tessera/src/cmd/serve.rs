//! `tessera serve`: the OpenAI-compatible API and the dashboard for a model run in this process.
//!
//! Flags are checked before any work: a listen address beyond loopback needs an API key, the
//! key file must be readable. The model loads, the gateway binds, and the bound address is
//! printed on stdout as `listening on http://ADDR` (tests bind port 0 and read it back). Ctrl-C
//! stops accepting, lets streams finish, and shuts the engine down.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use tessera_engine::Model;
use tessera_gateway::{
    check_exposure, Backend, Gateway, GatewayConfig, LocalBackend, LocalConfig, SchedulerConfig,
};
use tessera_model::GgufFile;

use crate::default_model;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// GGUF model to serve (default: the built-in stories260K).
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Name clients use in `model` (default: the file name without `.gguf`).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Address to listen on. Anything but loopback requires an API key.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// API key clients must send as `Authorization: Bearer KEY` on /v1.
    #[arg(long, env = "TESSERA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// File holding the API key (first line).
    #[arg(long, conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Requests that may wait for a batch slot before new ones get 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Sequences advanced together in one forward pass.
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Token rows per forward pass (decode tokens plus prompt chunks).
    #[arg(long, default_value_t = 256)]
    pub max_batch_tokens: usize,
    /// Context positions per sequence (default: the model's).
    #[arg(long)]
    pub ctx: Option<usize>,
}

/// Validated settings.
struct Config {
    model: PathBuf,
    name: String,
    listen: SocketAddr,
    api_key: Option<String>,
    threads: usize,
    local: LocalConfig,
}

/// The API key from `--api-key` or the first line of `--api-key-file` (shared with `tessera
/// up`); `None` when neither is given.
pub fn resolve_api_key(
    key: Option<&str>,
    file: Option<&std::path::Path>,
) -> anyhow::Result<Option<String>> {
    let key = match (key, file) {
        (Some(k), _) => Some(k.trim().to_string()),
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("reading the API key file {}", f.display()))?;
            let key = text.lines().next().unwrap_or_default().trim().to_string();
            if key.is_empty() {
                bail!("the API key file {} is empty", f.display());
            }
            Some(key)
        }
        (None, None) => None,
    };
    Ok(key.filter(|k| !k.is_empty()))
}

fn validate(a: ServeArgs) -> anyhow::Result<Config> {
    let api_key = resolve_api_key(a.api_key.as_deref(), a.api_key_file.as_deref())?;
    check_exposure(a.listen, api_key.as_deref())?;
    if a.max_batch == 0 || a.max_batch_tokens == 0 {
        bail!("--max-batch and --max-batch-tokens must be at least 1");
    }
    let model = default_model::resolve(a.model.clone())?;
    let name = match (&a.model_name, &a.model) {
        (Some(n), _) => n.clone(),
        (None, Some(p)) => p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into()),
        (None, None) => default_model::NAME.to_string(),
    };
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    Ok(Config {
        model,
        name,
        listen: a.listen,
        api_key,
        threads: threads.max(1),
        local: LocalConfig {
            scheduler: SchedulerConfig {
                max_active: a.max_batch,
                max_batch_tokens: a.max_batch_tokens,
                prefill_chunk: a.max_batch_tokens.min(128),
            },
            max_queue: a.max_queue,
            context_length: a.ctx.unwrap_or(usize::MAX),
        },
    })
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let cfg = validate(args)?;
    init_tracing();
    let gguf =
        GgufFile::open(&cfg.model).with_context(|| format!("opening {}", cfg.model.display()))?;
    let model = Model::load_full(&gguf, cfg.threads)
        .with_context(|| format!("loading {}", cfg.model.display()))?;
    let backend = LocalBackend::start(&cfg.name, &gguf, model, cfg.local)
        .context("reading the tokenizer and chat template")?;
    serve_backend(Arc::new(backend), cfg.listen, cfg.api_key, |_| {})
}

/// Binds `listen`, prints the URLs (the first line is `listening on http://ADDR`), and serves
/// the gateway in front of `backend` until Ctrl-C. `on_ready` runs once the socket is bound
/// (`tessera up` prints a sample completion from there). Shared by every mode that serves:
/// the local engine here, the coordinator's cluster backend in `tessera up`.
pub fn serve_backend(
    backend: Arc<dyn Backend>,
    listen: SocketAddr,
    api_key: Option<String>,
    on_ready: impl FnOnce(SocketAddr) + Send + 'static,
) -> anyhow::Result<()> {
    check_exposure(listen, api_key.as_deref())?;
    let name = backend.model().id.clone();
    let gateway = Gateway::new(
        backend,
        GatewayConfig {
            api_key: api_key.clone(),
            ..GatewayConfig::default()
        },
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding {listen}"))?;
        let addr = listener.local_addr()?;
        let shown = if addr.ip().is_unspecified() {
            SocketAddr::new([127, 0, 0, 1].into(), addr.port())
        } else {
            addr
        };
        println!("listening on http://{addr}");
        println!("  model      {name}");
        println!("  API        http://{shown}/v1  (OpenAI-compatible)");
        println!("  dashboard  http://{shown}/");
        println!("  metrics    http://{shown}/metrics");
        if api_key.is_some() {
            println!("  API key    required on /v1 (Authorization: Bearer ...)");
        }
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        on_ready(shown);
        tessera_gateway::serve(listener, gateway, async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("shutting down");
        })
        .await
        .context("serving")
    })
}

/// Logs to stderr, filtered by `TESSERA_LOG` (default `info`); request ids are in each line's
/// span.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TESSERA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> ServeArgs {
        Cli::parse_from(std::iter::once("serve").chain(args.iter().copied())).serve
    }

    #[test]
    fn binding_beyond_loopback_requires_a_key() {
        let e = validate(parse(&["--listen", "0.0.0.0:8080"]))
            .err()
            .unwrap();
        assert!(e.to_string().contains("API key"), "{e}");
        assert!(validate(parse(&["--listen", "0.0.0.0:0", "--api-key", "k"])).is_ok());
        assert!(validate(parse(&["--listen", "127.0.0.1:0"])).is_ok());
    }

    #[test]
    fn the_key_file_gives_its_first_line() {
        let f = std::env::temp_dir().join(format!("tessera-key-{}", std::process::id()));
        std::fs::write(&f, "  k3y \nrest\n").unwrap();
        assert_eq!(
            resolve_api_key(None, Some(&f)).unwrap().as_deref(),
            Some("k3y")
        );
        std::fs::write(&f, "\n").unwrap();
        assert!(resolve_api_key(None, Some(&f)).is_err());
        let _ = std::fs::remove_file(&f);
        assert_eq!(resolve_api_key(None, None).unwrap(), None);
    }
}
