//! `tessera serve`: the OpenAI-compatible API and the dashboard for a model run in this process.
//!
//! Flags are checked before any work: a listen address beyond loopback needs an API key, the
//! key file must be readable. The model loads, the gateway binds, and the bound address is
//! printed on stdout as `listening on http://ADDR` (with `TESSERA_LOG_FORMAT=json`, a `listening`
//! event whose `addr` scripts and tests read back after binding port 0). Ctrl-C stops
//! accepting, lets streams finish, and shuts the engine down.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use std::time::Duration;

use anyhow::{bail, Context};
use tessera_api::Backend;
use tessera_coord::backend::{ClusterBackend, ClusterBackendConfig};
use tessera_coord::{Coordinator, CoordinatorConfig};
use tessera_engine::Model;
use tessera_gateway::models::{ModelPool, ModelSpec};
use tessera_gateway::{check_exposure, ApiKeys, Gateway, GatewayConfig, SchedulerConfig};
use tessera_local::{LocalBackend, LocalConfig};
use tessera_model::GgufFile;
use tessera_placement::assignment::parse_split;

use crate::default_model;
use crate::output::Stream;

#[derive(clap::Args, Debug)]
#[command(group = clap::ArgGroup::new("sealed").args(["sealed_via", "sealed_via_file"]))]
pub struct ServeArgs {
    /// GGUF model to serve (default: the built-in stories260K). Repeat it to serve several:
    /// each request runs on the model its `model` field names (the file name without
    /// `.gguf`), loaded when first asked for, within --models-memory.
    #[arg(short, long)]
    pub model: Vec<PathBuf>,
    /// Name clients use in `model` (default: the file name without `.gguf`); one model only.
    #[arg(long)]
    pub model_name: Option<String>,
    /// Several models: the memory their weights may hold at once (`8GiB`, `512MiB`). A model
    /// that does not fit beside the loaded ones unloads the least recently used idle ones
    /// first; while busy models hold the room, its requests get 503. Default: room for all.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub models_memory: Option<u64>,
    /// Address to listen on. Anything but loopback requires an API key.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// API key clients must send as `Authorization: Bearer KEY` on /v1.
    #[arg(long, env = "TESSERA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// File of API keys, one per line as `KEY` or `NAME KEY` (`#` starts a comment). Each key
    /// gets a fair share of the server: one key's flood leaves room for the others.
    #[arg(long, conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// A web page origin (`https://app.example.com`, or `*`) allowed to call the API from a
    /// browser, besides pages on loopback origins; repeatable.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origins: Vec<String>,
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
    /// Finished requests' KV caches kept for requests that begin with the same tokens (a chat's
    /// next turn re-sends its history: only the new tail is prefilled, and `usage` reports
    /// the reused tokens as `cached_tokens`). Each cache holds --ctx positions of memory; 0
    /// turns reuse off. Single-process serving only (cluster nodes take `tessera node
    /// --prefix-cache`). [default: 2]
    #[arg(long)]
    pub prefix_cache: Option<usize>,
    /// KV cache element type: f16 (default), q8_0 (half the bytes again; heads of whole
    /// 32-blocks) or f32 (llama.cpp's non-flash numerics).
    #[arg(long, default_value = "f16")]
    pub kv_type: tessera_engine::KvType,
    /// Speculative decoding (single-process serving only).
    #[command(flatten)]
    pub speculate: super::speculate::SpeculateArgs,
    /// Distributed mode: run a coordinator in this process and serve the model over this many
    /// nodes, once they have joined (`tessera node --join TOKEN@HOST:PORT`, as printed) and
    /// loaded their layers.
    #[arg(long)]
    pub nodes_expected: Option<usize>,
    /// Distributed mode: the layer split in ring order, e.g. `0..3,3..5` (stages take nodes in
    /// the order they join). Starting again at layer 0 adds a cell, a whole copy of the model
    /// taking whole requests: `0..5,0..5` is two single-node cells. Default: an even split over
    /// --nodes-expected.
    #[arg(long)]
    pub split: Option<String>,
    /// Distributed mode: `auto` plans from the joined nodes' measured inventory and links
    /// (`tessera coordinator --plan auto`) instead of a fixed split.
    #[arg(long, value_parser = ["auto"], conflicts_with = "split")]
    pub plan: Option<String>,
    /// Distributed mode, with --plan auto: plan with this calibrated graph's rates (a cluster
    /// file or scenario, e.g. `tessera lab run --save-calibrated`) in place of the measured
    /// ones, for the nodes and links it names (`tessera coordinator --calibrated`).
    #[arg(long, value_name = "FILE", requires = "plan")]
    pub calibrated: Option<PathBuf>,
    /// Distributed mode: the coordinator's UDP address (nodes join here).
    #[arg(long, default_value = "0.0.0.0:7070")]
    pub coordinator_listen: SocketAddr,
    /// Distributed mode: the address nodes dial, written in the join line in place of
    /// --coordinator-listen's (`tessera coordinator --advertise`): e.g. a compose service name.
    #[arg(long, value_name = "HOST:PORT", value_parser = super::join_line::parse_advertise)]
    pub coordinator_advertise: Option<String>,
    /// Distributed mode: also write the node join line to this file (owner-only, replaced
    /// whole), e.g. on a volume the nodes mount for `tessera node --join-file`.
    #[arg(long, value_name = "PATH")]
    pub join_copy: Option<PathBuf>,
    /// Distributed mode: where the coordinator keeps its key, join token and enrolled nodes
    /// (default: `tessera-coordinator` under the cache directory).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Sealed mode: serve this API from workers behind a coordinator you do not trust (its
    /// `TOKEN@HOST:PORT` line, a client or operator token). This gateway tokenizes with
    /// --model's tokenizer and seals every request to the workers' published keys; the
    /// coordinator routes it without reading it. Answers come back whole (a stream gets its
    /// tokens at the end). The client key lives in --data-dir. The line is a secret, visible
    /// to every user in the process list here: prefer --sealed-via-file.
    #[arg(long, value_name = "TOKEN@HOST:PORT", conflicts_with_all = ["nodes_expected", "split", "plan"])]
    pub sealed_via: Option<String>,
    /// Sealed mode, with the `TOKEN@HOST:PORT` line read from this file.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["nodes_expected", "split", "plan"])]
    pub sealed_via_file: Option<PathBuf>,
    /// Sealed mode: seal each request to at most this many workers (the first runs it; the
    /// others take over if it fails, or check its answer).
    #[arg(long, default_value_t = 3, requires = "sealed",
          value_parser = clap::value_parser!(u64).range(1..=tessera_coord::sealed::MAX_CANDIDATES as u64))]
    pub sealed_workers: u64,
    /// Sealed mode: seal only to workers certified by this operator key (repeat for several).
    #[arg(long, value_name = "KEY", requires = "sealed")]
    pub trust: Vec<tessera_seal::NodeKey>,
    /// Sealed mode: answer only with answers a second worker agreed with; an unverified one
    /// is an error response. Without it, unverified answers are released, marked
    /// `"verified": false` on the answer (the choice, message or final stream event) and with
    /// the header `x-tessera-verified: false`.
    #[arg(long, requires = "sealed")]
    pub verified_only: bool,
}

/// Validated settings.
struct Config {
    model: PathBuf,
    name: String,
    listen: SocketAddr,
    http: GatewayConfig,
    threads: usize,
    kv_type: tessera_engine::KvType,
    local: LocalConfig,
}

/// The gateway's settings: the keys, the `--cors-origin` list, and the sequences the backend
/// holds (running and waiting), which each client shares fairly.
pub fn http_config(api_keys: ApiKeys, cors_origins: &[String], capacity: usize) -> GatewayConfig {
    GatewayConfig {
        api_keys,
        fair_share_of: Some(capacity),
        cors_origins: cors_origins.to_vec(),
        ..GatewayConfig::default()
    }
}

/// The API keys from `--api-key` or `--api-key-file` (shared with `tessera up`); none when
/// neither is given.
pub fn resolve_api_keys(
    key: Option<&str>,
    file: Option<&std::path::Path>,
) -> anyhow::Result<ApiKeys> {
    Ok(match (key, file) {
        (Some(k), _) => ApiKeys::single(k),
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("reading the API key file {}", f.display()))?;
            ApiKeys::parse(&text).with_context(|| format!("the API key file {}", f.display()))?
        }
        (None, None) => ApiKeys::default(),
    })
}

fn validate(a: ServeArgs) -> anyhow::Result<Config> {
    let api_keys = resolve_api_keys(a.api_key.as_deref(), a.api_key_file.as_deref())?;
    check_exposure(a.listen, &api_keys)?;
    if a.max_batch == 0 || a.max_batch_tokens == 0 {
        bail!("--max-batch and --max-batch-tokens must be at least 1");
    }
    let model = default_model::resolve(a.model.first().cloned())?;
    let name = match &a.model_name {
        Some(n) => n.clone(),
        None => model_name(a.model.first().map(PathBuf::as_path)),
    };
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    Ok(Config {
        model,
        name,
        listen: a.listen,
        http: http_config(api_keys, &a.cors_origins, a.max_batch + a.max_queue),
        threads: threads.max(1),
        kv_type: a.kv_type,
        local: LocalConfig {
            scheduler: SchedulerConfig {
                max_active: a.max_batch,
                max_batch_tokens: a.max_batch_tokens,
                prefill_chunk: a.max_batch_tokens.min(128),
            },
            max_queue: a.max_queue,
            context_length: a.ctx.unwrap_or(usize::MAX),
            prefix_cache: a
                .prefix_cache
                .unwrap_or(tessera_local::DEFAULT_PREFIX_CACHE),
        },
    })
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let distributed = args.nodes_expected.is_some() || args.split.is_some() || args.plan.is_some();
    let sealed = args.sealed_via.is_some() || args.sealed_via_file.is_some();
    if sealed && args.speculate.given() {
        bail!(
            "--speculate, --draft-model and --draft-max are for single-process and \
             distributed serving; sealed jobs do not speculate yet"
        );
    }
    // Flags first: a wrong combination is refused before any model loads.
    let (mode, k) = args.speculate.mode()?;
    if distributed && mode == super::speculate::SpeculateMode::Draft {
        bail!(
            "a distributed ring speculates by prompt lookup (--speculate lookup); a draft \
             model is for single-process serving"
        );
    }
    if distributed
        && mode == super::speculate::SpeculateMode::Lookup
        && k > tessera_proto::OpenSeq::MAX_SPECULATE
    {
        bail!(
            "--draft-max on a distributed ring is at most {} (a turn carries the drafts to \
             every stage)",
            tessera_proto::OpenSeq::MAX_SPECULATE
        );
    }
    if args.model.len() > 1 {
        if distributed || sealed || args.speculate.given() || args.model_name.is_some() {
            bail!(
                "several --model files are served by one process only, each under its file \
                 name: not with distributed or sealed modes, --speculate or --model-name"
            );
        }
        return run_models(args);
    }
    if args.models_memory.is_some() {
        bail!("--models-memory is for serving several models (repeat --model)");
    }
    if !distributed && (args.coordinator_advertise.is_some() || args.join_copy.is_some()) {
        bail!(
            "--coordinator-advertise and --join-copy are for distributed mode \
             (--nodes-expected, --split or --plan)"
        );
    }
    if distributed {
        return run_distributed(args);
    }
    if sealed {
        return run_sealed(args);
    }
    let speculate = args.speculate.clone();
    let cfg = validate(args)?;
    let gguf =
        GgufFile::open(&cfg.model).with_context(|| format!("opening {}", cfg.model.display()))?;
    let speculation = speculate.load(&gguf, cfg.threads, cfg.kv_type)?;
    let model = Model::load_full(&gguf, cfg.threads)
        .with_context(|| format!("loading {}", cfg.model.display()))?
        .with_kv_type(cfg.kv_type)
        .context("--kv-type")?;
    let backend = LocalBackend::start_speculative(&cfg.name, &gguf, model, cfg.local, speculation)
        .context("reading the tokenizer and chat template")?;
    serve_backend(Arc::new(backend), cfg.listen, cfg.http, |_| {})
}

fn parse_size(s: &str) -> Result<u64, String> {
    tessera_plan::units::parse_bytes(s)
        .map(|b| b.0)
        .map_err(|e| e.to_string())
}

/// Several models in one process, each loaded on first use within `--models-memory`.
fn run_models(args: ServeArgs) -> anyhow::Result<()> {
    let paths = args.model.clone();
    let budget = args.models_memory;
    let cfg = validate(args)?;
    let mut specs = Vec::with_capacity(paths.len());
    for p in &paths {
        let path = default_model::resolve(Some(p.clone()))?;
        let name = model_name(Some(p));
        if specs.iter().any(|s: &ModelSpec| s.name == name) {
            bail!("two --model files are both named {name}");
        }
        let gguf = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let bytes = gguf.file_len();
        let (threads, kv_type, local, id) = (cfg.threads, cfg.kv_type, cfg.local, name.clone());
        let load: tessera_gateway::models::Loader = Arc::new(move || {
            let gguf = GgufFile::open(&path).map_err(|e| e.to_string())?;
            let model = Model::load_full(&gguf, threads)
                .map_err(|e| e.to_string())?
                .with_kv_type(kv_type)
                .map_err(|e| format!("--kv-type: {e}"))?;
            let backend =
                LocalBackend::start(&id, &gguf, model, local).map_err(|e| e.to_string())?;
            Ok(Arc::new(backend) as Arc<dyn Backend>)
        });
        specs.push(ModelSpec { name, bytes, load });
    }
    let budget = budget.unwrap_or_else(|| specs.iter().map(|s| s.bytes).sum());
    if let Some(s) = specs.iter().find(|s| s.bytes > budget) {
        bail!(
            "--models-memory {budget} is smaller than {} alone ({} bytes of weights)",
            s.name,
            s.bytes
        );
    }
    check_exposure(cfg.listen, &cfg.http.api_keys)?;
    let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    let pool = ModelPool::new(specs, budget, cfg.http);
    let rt = runtime()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .with_context(|| format!("binding {}", cfg.listen))?;
        let addr = listener.local_addr()?;
        let shown = shown_addr(addr);
        crate::logging::announce(
            "listening",
            &[("addr", &addr.to_string())],
            &format!("listening on http://{addr}"),
        );
        say!(
            "  models     {} (each loaded when first asked for)",
            names.join(", ")
        );
        say!("  API        http://{shown}/v1  (OpenAI-compatible)");
        let stop = pool.clone();
        tessera_gateway::serve_app(
            listener,
            tessera_gateway::models::pool_router(pool),
            async {
                super::node::shutdown_signal().await;
                crate::output::line(Stream::Stderr, "shutting down");
            },
            move || stop.begin_shutdown(),
        )
        .await
        .context("serving")
    })
}

/// Sealed mode: the gateway as the sealing client of an untrusted coordinator's workers.
fn run_sealed(args: ServeArgs) -> anyhow::Result<()> {
    let via = super::token::secret_line(
        args.sealed_via.as_deref(),
        args.sealed_via_file.as_deref(),
        "--sealed-via",
        "--sealed-via-file",
    )?
    .filter(|l| !l.is_empty())
    .context("--sealed-via-file is empty")?;
    let target = super::token::parse_target(&via, false).context("--sealed-via")?;
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(|| state_root().join("tessera-sealed-client"));
    let workers = args.sealed_workers as usize;
    let policy = tessera_client::sealed::ClientPolicy {
        trust: args.trust.clone(),
        verified_only: args.verified_only,
    };
    let cfg = validate(args)?;
    let gguf =
        GgufFile::open(&cfg.model).with_context(|| format!("opening {}", cfg.model.display()))?;
    let model = tessera_api::ServedModel::from_gguf(&cfg.name, &gguf, cfg.local.context_length)
        .context("reading the tokenizer and chat template")?;
    std::fs::create_dir_all(&data_dir)?;
    let identity = tessera_net::NodeIdentity::load_or_create(&data_dir)?;
    let rt = runtime()?;
    rt.block_on(async move {
        let client =
            tessera_client::sealed::SealedClient::connect(&identity, target.addr, &target.token)
                .await
                .context("connecting to the coordinator")?;
        let backend: Arc<dyn Backend> = Arc::new(tessera_client::sealed::SealedBackend::new(
            model,
            client,
            tessera_client::sealed::SealedBackendConfig {
                workers,
                ttl_ms: 10 * 60_000,
                policy,
            },
        ));
        let listener = bind_and_print(cfg.listen, &backend, !cfg.http.api_keys.is_empty()).await?;
        serve_until(backend, listener, cfg.http, async {
            super::node::shutdown_signal().await;
            crate::output::line(Stream::Stderr, "shutting down");
        })
        .await
    })
}

/// What a coordinator-backed gateway needs.
pub struct ClusterOptions {
    pub model: PathBuf,
    pub name: String,
    /// The coordinator's UDP address.
    pub coordinator_listen: SocketAddr,
    /// The address nodes dial, for the join line (`--coordinator-advertise`); `None`: the
    /// bound one.
    pub advertise: Option<String>,
    pub data_dir: PathBuf,
    /// `--split` syntax; `None`: an even split over `nodes`.
    pub split: Option<String>,
    pub nodes: usize,
    pub max_context: Option<usize>,
    /// KV cache type of every stage.
    pub kv_type: tessera_engine::KvType,
    pub backend: ClusterBackendConfig,
    /// Progress bars while serving shards.
    pub progress: bool,
    /// Plan from the nodes' measured inventory once `nodes` have joined, instead of `split`.
    pub auto_plan: bool,
    /// With `auto_plan`: the rates of this calibrated graph in place of the measured ones.
    pub calibrated: Option<tessera_plan::ResourceGraph>,
}

/// A running coordinator and the backend in front of it.
pub struct Cluster {
    pub coordinator: Arc<Coordinator>,
    pub backend: ClusterBackend,
    /// `TOKEN@HOST:PORT`, for `tessera node --join`.
    pub join: String,
    /// The split applied, in `--split` syntax.
    pub split: String,
    accept: tokio::task::JoinHandle<()>,
}

impl Cluster {
    /// Starts the coordinator (it applies the split once enough nodes have joined) and the
    /// backend. Must run inside the runtime that will serve.
    pub async fn start(o: ClusterOptions) -> anyhow::Result<Self> {
        let n_layer = tessera_coord::backend::model_layers(&o.model)
            .with_context(|| format!("reading {}", o.model.display()))?;
        let split = match (o.auto_plan, o.split) {
            (true, _) => "auto".to_string(),
            (false, Some(s)) => s,
            (false, None) => tessera_coord::backend::even_split(n_layer, o.nodes),
        };
        let stages = if o.auto_plan {
            None
        } else {
            Some(parse_split(&split).context("--split")?)
        };
        let (ctx, profile) = {
            let g = GgufFile::open(&o.model)?;
            let profile = if o.auto_plan {
                Some(
                    tessera_model::ModelProfile::from_gguf(&g)
                        .context("reading the model profile")?,
                )
            } else {
                None
            };
            (
                tessera_model::ModelConfig::from_gguf(&g)?.context_length,
                profile,
            )
        };
        let max_context = o.max_context.unwrap_or(ctx).min(ctx);
        let fixed = o.max_context.is_some();
        let data_dir = o.data_dir.clone();
        let coordinator = Coordinator::bind(CoordinatorConfig {
            data_dir: o.data_dir,
            listen: o.coordinator_listen,
            model: o.model.clone(),
            split: stages,
            max_context,
            progress: o.progress,
            chunk_size: tessera_node::store::DEFAULT_CHUNK_SIZE,
        })
        .await
        .context("starting the coordinator")?;
        coordinator.set_kv_type(o.kv_type).await;
        let coordinator = Arc::new(coordinator);
        let addr = coordinator.local_addr()?;
        let join = super::join_line::line(coordinator.token(), addr, o.advertise.as_deref());
        // Plans are priced at the concurrency the gateway serves: its batch.
        let concurrency = o.backend.max_active;
        let backend = ClusterBackend::new(&coordinator, &o.name, o.backend)?;
        let accept = {
            let c = coordinator.clone();
            tokio::spawn(async move {
                if let Err(e) = c.run().await {
                    say_err!("coordinator: {e}");
                }
            })
        };
        if let Some(profile) = profile {
            // The other engineer's planner: waits for the nodes, plans, applies the stages.
            let (c, nodes, calibrated) = (coordinator.clone(), o.nodes, o.calibrated);
            tokio::spawn(async move {
                let context = super::auto_plan::ContextChoice {
                    max: max_context,
                    fixed,
                };
                let planned = super::auto_plan::run(
                    &c,
                    &profile,
                    nodes,
                    context,
                    concurrency,
                    &data_dir,
                    calibrated.as_ref(),
                );
                if let Err(e) = planned.await {
                    say_err!("plan auto: {e:#}");
                }
            });
        }
        Ok(Self {
            coordinator,
            backend,
            join,
            split,
            accept,
        })
    }

    /// Cancels what is in flight (closing each sequence on every stage), then closes the
    /// coordinator's connections.
    pub async fn stop(self) {
        self.backend.drain(Duration::from_secs(5)).await;
        self.coordinator.close();
        self.coordinator.wait_idle().await;
        self.accept.abort();
    }
}

/// Serves the gateway in front of a cluster until Ctrl-C or SIGTERM. On the signal the server
/// stops accepting and lets streams finish for a few seconds; whatever is still running then is
/// cancelled (closed on every stage), so shutdown never waits on a long generation.
pub async fn serve_cluster_until_signal(
    backend: &ClusterBackend,
    listener: tokio::net::TcpListener,
    http: GatewayConfig,
) -> anyhow::Result<()> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let b = backend.clone();
    let drainer = tokio::spawn(async move {
        if rx.await.is_ok() {
            tokio::time::sleep(Duration::from_secs(3)).await;
            b.drain(Duration::from_secs(10)).await;
        }
    });
    let served = serve_until(Arc::new(backend.clone()), listener, http, async move {
        super::node::shutdown_signal().await;
        let _ = tx.send(());
    })
    .await;
    drainer.abort();
    served
}

/// `tessera serve --nodes-expected N`: coordinator and gateway in this process.
fn run_distributed(a: ServeArgs) -> anyhow::Result<()> {
    if a.prefix_cache.is_some() {
        bail!(
            "--prefix-cache applies to single-process serving; in a cluster each node keeps \
             its stage's caches within its memory budget: `tessera node --prefix-cache N`"
        );
    }
    let api_keys = resolve_api_keys(a.api_key.as_deref(), a.api_key_file.as_deref())?;
    check_exposure(a.listen, &api_keys)?;
    let http = http_config(api_keys, &a.cors_origins, a.max_batch.max(1) + a.max_queue);
    let auto_plan = a.plan.is_some();
    let calibrated = a
        .calibrated
        .as_deref()
        .map(super::auto_plan::read_calibrated)
        .transpose()?;
    // Checked in `run`: lookup with at most MAX_SPECULATE drafts, or off.
    let ring_speculate = match a.speculate.mode()? {
        (super::speculate::SpeculateMode::Lookup, k) => k,
        _ => 0,
    };
    let nodes = match (&a.split, a.nodes_expected) {
        (Some(s), _) => parse_split(s).context("--split")?.len(),
        (None, Some(n)) if n >= 1 => n,
        _ => bail!("--nodes-expected must be at least 1"),
    };
    let model = default_model::resolve(a.model.first().cloned())?;
    let name = a
        .model_name
        .clone()
        .unwrap_or_else(|| model_name(a.model.first().map(PathBuf::as_path)));
    let data_dir = match a.data_dir {
        Some(d) => d,
        None => state_root().join("coordinator"),
    };
    let rt = runtime()?;
    rt.block_on(async move {
        let token_dir = data_dir.clone();
        let cluster = Cluster::start(ClusterOptions {
            model,
            name,
            coordinator_listen: a.coordinator_listen,
            advertise: a.coordinator_advertise.clone(),
            data_dir,
            split: a.split,
            nodes,
            max_context: a.ctx,
            kv_type: a.kv_type,
            backend: ClusterBackendConfig {
                max_active: a.max_batch.max(1),
                max_queue: a.max_queue,
                prefill_chunk: a.max_batch_tokens.clamp(1, 128),
                speculate: ring_speculate,
                explanation: if auto_plan {
                    "Planned from the nodes' measured inventory and links (--plan auto); the \
                     planner's reasoning is in DATA_DIR/plan-auto.json."
                        .into()
                } else {
                    String::new()
                },
            },
            progress: true,
            auto_plan,
            calibrated,
        })
        .await?;
        say!("coordinator {}", cluster.coordinator.node_id());
        crate::logging::announce(
            "join_token",
            &[("token", &cluster.join)],
            &format!("join token: {}", cluster.join),
        );
        let operator = super::join_line::line(
            cluster.coordinator.operator_token(),
            cluster.coordinator.local_addr()?,
            a.coordinator_advertise.as_deref(),
        );
        crate::logging::announce(
            "operator_token",
            &[("token", &operator)],
            &format!("operator token: {operator}"),
        );
        // The same lines in owner-only files (a token on a command line is visible to every
        // user in the process list).
        let join_file = token_dir.join(super::coordinator::JOIN_TOKEN_FILE);
        super::up::write_secret(&join_file, &format!("{}\n", cluster.join))?;
        super::up::write_secret(
            &token_dir.join(super::coordinator::OPERATOR_TOKEN_FILE),
            &format!("{operator}\n"),
        )?;
        if let Some(copy) = &a.join_copy {
            super::join_line::write_copy(copy, &cluster.join)?;
        }
        say!(
            "waiting for {nodes} node(s) (split {}): tessera node --data-dir DIR --join-file {}",
            cluster.split,
            join_file.display()
        );
        let backend = cluster.backend.clone();
        tokio::spawn(async move {
            match backend
                .wait_ready(Duration::from_secs(24 * 3600), |r| say_err!("  {r}"))
                .await
            {
                Ok(()) => say!("serving: every stage is loaded and linked"),
                Err(e) => say_err!("not serving: {e}"),
            }
        });
        let backend: Arc<dyn Backend> = Arc::new(cluster.backend.clone());
        let listener = bind_and_print(a.listen, &backend, !http.api_keys.is_empty()).await?;
        serve_cluster_until_signal(&cluster.backend, listener, http).await?;
        say_err!("shutting down");
        cluster.stop().await;
        anyhow::Ok(())
    })
}

/// Where serving modes keep state by default: `TESSERA_CACHE_DIR`, else the user's cache
/// directory, under `tessera`.
pub fn state_root() -> PathBuf {
    if let Some(d) = std::env::var_os("TESSERA_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("tessera");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache").join("tessera");
    }
    std::env::temp_dir().join("tessera")
}

/// The name clients use for a model file: its stem (a split model's without the part
/// numbers), or `ORG/NAME[:QUANT]` for a model given by name.
pub fn model_name(model: Option<&std::path::Path>) -> String {
    let Some(p) = model else {
        return default_model::NAME.to_string();
    };
    if let Some(Ok(name)) = p.to_str().and_then(tessera_hub::ModelName::from_model_arg) {
        return name.to_string();
    }
    let p = tessera_model::PartName::parse(p).map_or(p.to_owned(), |n| n.prefix);
    p.file_name()
        .map(|s| {
            let s = s.to_string_lossy();
            s.strip_suffix(".gguf").unwrap_or(&s).to_string()
        })
        .unwrap_or_else(|| "model".into())
}

/// The runtime every serving mode runs on.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Binds `listen` and prints the URLs; the first line is `listening on http://ADDR`.
pub async fn bind_and_print(
    listen: SocketAddr,
    backend: &Arc<dyn Backend>,
    key_required: bool,
) -> anyhow::Result<tokio::net::TcpListener> {
    let name = backend.model().id.clone();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let addr = listener.local_addr()?;
    let shown = shown_addr(addr);
    crate::logging::announce(
        "listening",
        &[("addr", &addr.to_string())],
        &format!("listening on http://{addr}"),
    );
    say!("  model      {name}");
    say!("  API        http://{shown}/v1  (OpenAI-compatible)");
    say!("  dashboard  http://{shown}/");
    say!("  metrics    http://{shown}/metrics");
    if key_required {
        say!("  API key    required on /v1 (Authorization: Bearer ...)");
    }
    Ok(listener)
}

/// The address to show for a bound one (loopback for an unspecified IP).
pub fn shown_addr(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new([127, 0, 0, 1].into(), addr.port())
    } else {
        addr
    }
}

/// Serves the gateway in front of `backend` on `listener` until `shutdown` completes; streams
/// in progress are let finish.
pub async fn serve_until(
    backend: Arc<dyn Backend>,
    listener: tokio::net::TcpListener,
    http: GatewayConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let gateway = Gateway::new(backend, http);
    tessera_gateway::serve(listener, gateway, shutdown)
        .await
        .context("serving")
}

/// Binds `listen`, prints the URLs (the first line is `listening on http://ADDR`), and serves
/// the gateway in front of `backend` until Ctrl-C. `on_ready` runs once the socket is bound
/// (`tessera up` prints a sample completion from there). Shared by every mode that serves:
/// the local engine here, the coordinator's cluster backend in `tessera up`.
pub fn serve_backend(
    backend: Arc<dyn Backend>,
    listen: SocketAddr,
    http: GatewayConfig,
    on_ready: impl FnOnce(SocketAddr) + Send + 'static,
) -> anyhow::Result<()> {
    check_exposure(listen, &http.api_keys)?;
    let rt = runtime()?;
    rt.block_on(async move {
        let listener = bind_and_print(listen, &backend, !http.api_keys.is_empty()).await?;
        on_ready(shown_addr(listener.local_addr()?));
        serve_until(backend, listener, http, async {
            super::node::shutdown_signal().await;
            crate::output::line(Stream::Stderr, "shutting down");
        })
        .await
    })
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
    fn the_key_file_gives_every_key_it_lists() {
        let f = std::env::temp_dir().join(format!("tessera-key-{}", std::process::id()));
        std::fs::write(&f, "  k3y \nbob other\n").unwrap();
        let keys = resolve_api_keys(None, Some(&f)).unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(&*keys.find(b"other").unwrap().name, "bob");
        std::fs::write(&f, "\n").unwrap();
        let e = resolve_api_keys(None, Some(&f)).unwrap_err();
        assert!(format!("{e:#}").contains("holds no key"), "{e:#}");
        let _ = std::fs::remove_file(&f);
        assert!(resolve_api_keys(None, None).unwrap().is_empty());
    }
}
