//! `tessera up`: a whole cluster on this machine, one command.
//!
//! Starts a coordinator and the OpenAI gateway in this process and `--nodes` node agents as
//! child processes (this same binary, `tessera node --join ...`, each with its own data
//! directory under the run directory), applies an even layer split (or `--split`), waits until
//! every stage has received its shards, loaded and linked, then serves the API and dashboard
//! and prints a sample completion. Ctrl-C (or SIGTERM) stops the gateway, closes every sequence
//! on every stage, and terminates the node processes, waiting for each.
//!
//! Nodes run in their own process group, so a Ctrl-C at the terminal reaches only this process,
//! which then stops them in order.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tessera_api::{Backend, Event, GenerationRequest};
use tessera_coord::backend::ClusterBackendConfig;
use tessera_sampling::SamplingParams;

use super::serve::{
    bind_and_print, model_name, resolve_api_keys, runtime, serve_cluster_until_signal, Cluster,
    ClusterOptions,
};
use crate::default_model;
use crate::output::Stream;

#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// GGUF model to serve (default: the built-in stories260K).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Node processes to start.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Layer split in ring order, e.g. `0..2,2..4,4..5` (default: even over --nodes). Starting
    /// again at layer 0 adds a cell (a whole copy of the model taking whole requests):
    /// `0..5,0..5,0..5` is three single-node cells.
    #[arg(long)]
    split: Option<String>,
    /// `auto`: plan from the nodes' measured inventory and links (the planner may use fewer
    /// nodes than it is given, and says why) instead of an even split.
    #[arg(long, value_parser = ["auto"], conflicts_with = "split")]
    plan: Option<String>,
    /// Address of the API and dashboard (port 0: any free port). Beyond loopback needs a key.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// API key clients must send as `Authorization: Bearer KEY` on /v1.
    #[arg(long, env = "TESSERA_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// File of API keys, one per line as `KEY` or `NAME KEY` (`#` starts a comment). Each key
    /// gets a fair share of the cluster: one key's flood leaves room for the others.
    #[arg(long, conflicts_with = "api_key")]
    api_key_file: Option<PathBuf>,
    /// A web page origin (`https://app.example.com`, or `*`) allowed to call the API from a
    /// browser, besides pages on loopback origins; repeatable.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    /// Compute threads per node (default: the cores shared out among the nodes).
    #[arg(short, long)]
    threads: Option<usize>,
    /// Where the coordinator and nodes keep their keys, caches and logs (default: a fresh
    /// directory under the system temp dir, removed on exit).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Context positions per sequence (default: the model's).
    #[arg(long)]
    ctx: Option<usize>,
    /// KV cache element type: f16 (default), q8_0 (half the bytes again; heads of whole
    /// 32-blocks) or f32 (llama.cpp's non-flash numerics).
    #[arg(long, default_value = "f16")]
    kv_type: tessera_engine::KvType,
    /// Sequences in flight at once.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Requests that may wait for a slot before new ones get 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Speculation on the ring: the sampling stage drafts up to K tokens by prompt lookup
    /// (what followed the last few tokens earlier in the text) with each token it sends back,
    /// and the ring checks them in one turn. The text is the same; a text that repeats itself
    /// needs fewer turns. 0 (the default): off. At most 16.
    #[arg(long, value_name = "K", default_value_t = 0,
          value_parser = clap::value_parser!(u16).range(0..=16))]
    speculate: u16,
    /// Skip the sample completion.
    #[arg(long)]
    no_sample: bool,
    /// How long the nodes may take to join, fetch their shards and load.
    #[arg(long, default_value_t = 600)]
    startup_timeout_s: u64,
}

/// The node processes; killed if still running when dropped.
struct Nodes {
    children: Vec<(String, Child)>,
}

impl Nodes {
    /// A node that has already exited, with its status.
    fn exited(&mut self) -> Option<String> {
        self.children.iter_mut().find_map(|(name, c)| {
            c.try_wait()
                .ok()
                .flatten()
                .map(|s| format!("{name} exited ({s})"))
        })
    }

    /// SIGTERM to each, then waits (killing any that outlast `grace`).
    fn terminate(&mut self, grace: Duration) {
        for (_, c) in &self.children {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .stderr(Stdio::null())
                .status();
        }
        let deadline = Instant::now() + grace;
        for (_, c) in &mut self.children {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= deadline => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn spawn_nodes(run_dir: &Path, join: &str, n: usize, threads: usize) -> anyhow::Result<Nodes> {
    let exe = std::env::current_exe().context("finding this executable")?;
    // The token goes to the nodes in a file only they and we can read, never on their
    // command lines (visible to every user in `ps`).
    let join_file = run_dir.join("join");
    write_secret(&join_file, join)?;
    let mut nodes = Nodes {
        children: Vec::new(),
    };
    for i in 1..=n {
        let name = format!("node-{i}");
        let dir = run_dir.join(&name);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let log = std::fs::File::create(run_dir.join(format!("{name}.log")))
            .context("creating a node log")?;
        let mut cmd = Command::new(&exe);
        cmd.arg("node")
            .arg("--data-dir")
            .arg(&dir)
            .args(["--listen", "127.0.0.1:0", "--name", &name, "--quick-probe"])
            .args(["--threads", &threads.to_string(), "--join-file"])
            .arg(&join_file)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt as _;
            cmd.process_group(0);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({})", exe.display()))?;
        nodes.children.push((name, child));
    }
    Ok(nodes)
}

/// Writes a secret to a file readable by this user only. It is written beside `path` and
/// renamed over it, so a reader (a node waiting on `--join-file`) sees the old line or the
/// whole new one, never a partial write.
pub(crate) fn write_secret(path: &Path, secret: &str) -> anyhow::Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        o.mode(0o600);
    }
    let mut f = o
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    std::io::Write::write_all(&mut f, secret.as_bytes())
        .with_context(|| format!("writing {}", tmp.display()))?;
    drop(f);
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))
}

/// A fresh run directory under the temp dir.
fn fresh_run_dir() -> anyhow::Result<PathBuf> {
    let base = std::env::temp_dir();
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let dir = base.join(format!("tessera-up-{}-{stamp}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    let api_keys = resolve_api_keys(args.api_key.as_deref(), args.api_key_file.as_deref())?;
    tessera_gateway::check_exposure(args.listen, &api_keys)?;
    if args.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    let model = default_model::resolve(args.model.clone())?;
    anyhow::ensure!(model.is_file(), "--model {}: no such file", model.display());
    let name = model_name(args.model.as_deref());
    let (run_dir, temporary) = match &args.run_dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            (d.clone(), false)
        }
        None => (fresh_run_dir()?, true),
    };
    let threads = args
        .threads
        .unwrap_or_else(|| (super::default_threads() / args.nodes).max(1));
    let rt = runtime()?;
    let capacity = args.max_batch.max(1) + args.max_queue;
    let http = super::serve::http_config(api_keys, &args.cors_origins, capacity);
    let result = rt.block_on(up(args, http, model, name, run_dir.clone(), threads));
    drop(rt);
    if temporary {
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    result
}

async fn up(
    args: UpArgs,
    http: tessera_gateway::GatewayConfig,
    model: PathBuf,
    name: String,
    run_dir: PathBuf,
    threads: usize,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let cluster = Cluster::start(ClusterOptions {
        model: model.clone(),
        name: name.clone(),
        coordinator_listen: "127.0.0.1:0".parse().expect("an address"),
        advertise: None,
        data_dir: run_dir.join("coordinator"),
        split: args.split.clone(),
        nodes: args.nodes,
        max_context: args.ctx,
        kv_type: args.kv_type,
        backend: ClusterBackendConfig {
            max_active: args.max_batch.max(1),
            max_queue: args.max_queue,
            prefill_chunk: 64,
            speculate: usize::from(args.speculate),
            explanation: if args.plan.is_some() {
                "Planned from the nodes' measured inventory and links (--plan auto); the \
                 planner's reasoning is in the run directory, coordinator/plan-auto.json."
                    .into()
            } else if args.split.is_some() {
                "The split was given with --split.".into()
            } else {
                format!(
                    "`tessera up` split the layers evenly over {} local node processes.",
                    args.nodes
                )
            },
        },
        progress: false,
        auto_plan: args.plan.is_some(),
        calibrated: None,
    })
    .await?;
    let n_stages = match args.plan {
        Some(_) => 0,
        None => tessera_placement::assignment::parse_split(&cluster.split)?.len(),
    };
    if n_stages > args.nodes {
        bail!(
            "--split has {n_stages} stages but only {} nodes were asked for",
            args.nodes
        );
    }
    let mut nodes = spawn_nodes(&run_dir, &cluster.join, args.nodes, threads)?;
    say!(
        "tessera up: {name} over {} local nodes (layers {})",
        args.nodes,
        cluster.split
    );
    let pids = nodes
        .children
        .iter()
        .map(|(_, c)| c.id().to_string())
        .collect::<Vec<_>>()
        .join(" ");
    crate::logging::announce(
        "nodes_started",
        &[("pids", &pids)],
        &format!("  node pids  {pids}"),
    );
    say!("  run dir    {}", run_dir.display());
    crate::logging::announce(
        "join_token",
        &[("token", &cluster.join)],
        // The token is a secret and unreadable: the line says where it is (the JSON event
        // carries it).
        &format!(
            "  join       tessera node --join-file {}  (the token for more nodes)",
            run_dir.join("join").display()
        ),
    );

    // Wait for every stage to join, fetch, load and link; give up if a node dies or on Ctrl-C.
    let ready = async {
        let deadline = Instant::now() + Duration::from_secs(args.startup_timeout_s);
        let mut last = String::new();
        loop {
            match cluster.backend.not_serving() {
                None => return Ok(()),
                Some(r @ tessera_coord::backend::NotServing::Failed { .. }) => bail!("{r}"),
                Some(r) => {
                    let r = r.to_string();
                    if r != last {
                        say_err!("  {r}");
                        last = r;
                    }
                }
            }
            if let Some(e) = nodes.exited() {
                bail!("{e}; see {}", run_dir.display());
            }
            if Instant::now() > deadline {
                bail!(
                    "the cluster was not ready after {}s: {last}",
                    args.startup_timeout_s
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let outcome = tokio::select! {
        r = ready => r,
        () = super::node::shutdown_signal() => Err(anyhow::anyhow!("interrupted while starting")),
    };
    if let Err(e) = outcome {
        cluster.stop().await;
        nodes.terminate(Duration::from_secs(10));
        return Err(e);
    }
    say!(
        "  ready in   {:.1}s: every node holds its layers and the ring is linked",
        started.elapsed().as_secs_f64()
    );

    let backend: Arc<dyn Backend> = Arc::new(cluster.backend.clone());
    let listener = match bind_and_print(args.listen, &backend, !http.api_keys.is_empty()).await {
        Ok(l) => l,
        Err(e) => {
            cluster.stop().await;
            nodes.terminate(Duration::from_secs(10));
            return Err(e);
        }
    };
    if !args.no_sample {
        match sample(&*backend, "Once upon a time", 48).await {
            Ok(text) => crate::logging::announce(
                "sample",
                &[("text", &text)],
                &format!("  sample     {}", text.replace('\n', " ")),
            ),
            Err(e) => say_err!("  sample failed: {e}"),
        }
    }
    say!("Ctrl-C stops the cluster.");
    let served = serve_cluster_until_signal(&cluster.backend, listener, http).await;
    // Queued, never written here: stdout may be a pipe nobody reads (crate::output).
    crate::output::line(
        Stream::Stdout,
        &format!(
            "stopping: gateway closed; closing sequences and stopping {} nodes",
            args.nodes
        ),
    );
    cluster.stop().await;
    let grace = Duration::from_secs(10);
    tokio::task::block_in_place(|| nodes.terminate(grace));
    crate::output::line(Stream::Stdout, "stopped");
    served
}

/// One greedy completion of `prompt` through the backend, as text (the prompt included).
async fn sample(backend: &dyn Backend, prompt: &str, max_tokens: usize) -> anyhow::Result<String> {
    let model = backend.model();
    let tokens = model.tokenizer.encode(prompt, true);
    let mut handle = backend
        .submit(GenerationRequest::new(
            0,
            tokens,
            SamplingParams::greedy(),
            max_tokens,
        ))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut decoder = tessera_model::StreamDecoder::new(&model.tokenizer);
    let mut text = prompt.to_string();
    let deadline = Duration::from_secs(60);
    loop {
        match tokio::time::timeout(deadline, handle.next_event()).await {
            Ok(Some(Event::Token(t))) => text.push_str(&decoder.push(t)),
            Ok(Some(Event::TokenLogprobs(lp))) => text.push_str(&decoder.push(lp.token)),
            Ok(Some(Event::PromptCached(_) | Event::Checked(_))) => {}
            Ok(Some(Event::Finished { .. })) | Ok(None) => break,
            Ok(Some(Event::Failed { message })) => bail!("{message}"),
            Err(_) => bail!("no token for {deadline:?}"),
        }
    }
    text.push_str(&decoder.finish());
    Ok(text.trim_end().to_string())
}
