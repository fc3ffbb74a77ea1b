//! `tessera node`: the node agent. Measures the machine, enrols with (or reconnects to) the
//! coordinator, receives and loads the layers it is assigned, and runs its stage of the ring.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use tessera_node::agent::{AgentConfig, JoinTarget, ProbeLevel};
use tessera_node::MemoryBudget;

#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct NodeArgs {
    #[command(subcommand)]
    action: Option<NodeAction>,
    /// Where the node keeps its identity key, its coordinator record and its model cache.
    #[arg(long, required = true)]
    data_dir: Option<PathBuf>,
    /// Enrol with a coordinator: the `TOKEN@HOST:PORT` line it printed, or the token alone to
    /// find the coordinator the token names on the local network by mDNS. Later starts
    /// reconnect to the recorded coordinator without it. Visible to every user in the process
    /// list: prefer --join-file or the TESSERA_TOKEN environment variable.
    #[arg(long, value_name = "TOKEN[@HOST:PORT]", conflicts_with = "join_file")]
    join: Option<String>,
    /// Read the `--join` line from a file (keeps the token out of the process list).
    #[arg(long, value_name = "PATH")]
    join_file: Option<PathBuf>,
    /// Wait up to this many seconds for --join-file to appear, for a head started at the same
    /// time that writes it (`serve --join-copy` on a shared volume). Without it a missing file
    /// is an error at once.
    #[arg(long, value_name = "SECONDS", requires = "join_file",
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    join_wait: Option<u64>,
    /// Accept a join token that names no coordinator, trusting whichever key answers.
    #[arg(long)]
    trust_on_first_use: bool,
    /// UDP address to listen on for other nodes (port 0: any).
    #[arg(long, default_value = "0.0.0.0:0")]
    listen: SocketAddr,
    /// The address other nodes should dial for this node's ring and expert links, when it is
    /// not `--listen`'s port at the address the coordinator sees: a port forwarded to this
    /// node, a relay, or a link emulator placed in front of it (`tessera-linkemu`). The
    /// coordinator hands it to peers as given; the coordinator link is not affected.
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_advertise)]
    advertise: Option<SocketAddr>,
    /// Name shown in plans and logs (default: the host name). Bound to this node's key.
    #[arg(long)]
    name: Option<String>,
    /// Most memory this node commits to work, e.g. `6GiB` or `80%` (default: available RAM).
    #[arg(long)]
    memory_budget: Option<String>,
    /// Stream the assigned experts (MoE: an expert split's or a ring stage's) from disk, keeping
    /// at most this much of them in memory, e.g. `200MiB` (default: what the coordinator's plan
    /// placed, else only when they exceed the memory budget, keeping half of it).
    #[arg(long)]
    expert_budget: Option<String>,
    /// Finished sequences' KV caches each stage keeps for requests that begin with the same
    /// tokens (a chat's next turn re-sends its history: only the new tail is prefilled). They
    /// live within the memory budget and give way to new sequences; 0 turns reuse off.
    #[arg(long, default_value_t = tessera_engine::prefix_cache::DEFAULT_KEPT)]
    prefix_cache: usize,
    /// A local copy of the model: read from here (after checking its hash), never downloaded.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(short, long)]
    threads: Option<usize>,
    /// Short start-up probes (small buffers; less accurate figures).
    #[arg(long)]
    quick_probe: bool,
    /// Measure the node, print its inventory as JSON, and exit.
    #[arg(long)]
    inventory: bool,
    /// What kind of machine this is, for sealed jobs: phone, laptop, workstation or server.
    /// Less dependable tiers get shorter leases and more of their answers checked.
    #[arg(long, default_value = "workstation")]
    device_tier: tessera_seal::DeviceTier,
    /// Cap the instruction set the kernels use (scalar, avx2, avx512 on x86-64; scalar, neon,
    /// dotprod on aarch64; default: the machine's best). Logits are bit-identical on every
    /// path, so one machine can play each of them (the path is published in the node's
    /// claims). Overrides `TESSERA_MAX_ISA`.
    #[arg(long, value_name = "ISA")]
    max_isa: Option<tessera_engine::kernels::Isa>,
    /// The operator's key directory (its `node.key`, made on first use; `tessera client
    /// operator-key` prints the public half): this node's sealing key, device tier and measured
    /// inventory are certified with it, so clients that trust the operator
    /// (`tessera client submit --trust KEY`) seal jobs to this node.
    #[arg(long, value_name = "DIR")]
    operator_dir: Option<PathBuf>,
    /// Test only: alter the tokens of every sealed answer (a lying worker), so verification
    /// has something to catch.
    #[arg(long, hide = true)]
    fault_alter_tokens: bool,
    /// Test only: report the honest tokens' digest of a sealed answer but ship altered tokens.
    #[arg(long, hide = true)]
    fault_ship_altered_tokens: bool,
    /// Test only: load cached model bytes without re-hashing them (altered weights load).
    #[arg(long, hide = true)]
    fault_unchecked_weights: bool,
}

/// What else `tessera node` does.
#[derive(clap::Subcommand, Debug)]
enum NodeAction {
    /// Revoke an enrolled key (a node's or a client's) by name, node id or id prefix: its
    /// sessions end and it cannot enrol again, with any token.
    Revoke {
        #[command(flatten)]
        op: super::token::OperatorArgs,
        name: String,
    },
}

pub fn run(args: NodeArgs) -> anyhow::Result<()> {
    if let Some(NodeAction::Revoke { op, name }) = &args.action {
        return super::token::revoke_node(op, name.clone());
    }
    let data_dir = args.data_dir.context("--data-dir")?;
    if let (Some(path), Some(secs)) = (&args.join_file, args.join_wait) {
        wait_for_file(path, Duration::from_secs(secs))?;
    }
    let join_line = super::token::secret_line(
        args.join.as_deref(),
        args.join_file.as_deref(),
        "--join",
        "--join-file",
    )?;
    let join = match join_line.as_deref() {
        Some(j) if j.contains('@') => {
            Some(super::token::parse_target(j, args.trust_on_first_use).context("--join")?)
        }
        Some(token) => Some(discover(token)?),
        None => None,
    };
    let memory_budget = args
        .memory_budget
        .as_deref()
        .map(MemoryBudget::parse)
        .transpose()
        .context("--memory-budget")?;
    let expert_budget = match args.expert_budget.as_deref().map(MemoryBudget::parse) {
        None => None,
        Some(Ok(MemoryBudget::Bytes(b))) => Some(b),
        Some(Ok(MemoryBudget::PercentOfTotal(_))) => {
            anyhow::bail!("--expert-budget: give an absolute size, e.g. 200MiB")
        }
        Some(Err(e)) => return Err(anyhow::Error::new(e).context("--expert-budget")),
    };
    if let Some(m) = &args.model {
        anyhow::ensure!(m.is_file(), "--model {}: no such file", m.display());
    }
    if let Some(cap) = args.max_isa {
        let isa = tessera_engine::kernels::set_max_isa(cap).context("--max-isa")?;
        tracing::info!("kernels: {isa} (capped at {cap})");
    }
    let config = AgentConfig {
        data_dir,
        join,
        listen: args.listen,
        advertise: args.advertise,
        name: args.name,
        memory_budget,
        model: args.model,
        threads: args.threads.unwrap_or_else(super::default_threads),
        probe: if args.quick_probe {
            ProbeLevel::Quick
        } else {
            ProbeLevel::Full
        },
        progress: true,
        expert_budget,
        sealed: tessera_node::agent::SealedOptions {
            tier: args.device_tier,
            operator_dir: args.operator_dir,
            fault_alter_tokens: args.fault_alter_tokens,
            fault_ship_altered_tokens: args.fault_ship_altered_tokens,
        },
        prefix_cache: args.prefix_cache,
        fault_unchecked_weights: args.fault_unchecked_weights,
    };
    if args.inventory {
        std::fs::create_dir_all(&config.data_dir)?;
        let inv = tessera_node::agent::measure_inventory(&config)?;
        println!("{}", serde_json::to_string_pretty(&inv)?);
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(tessera_node::agent::run_until(config, shutdown_signal()))?;
    Ok(())
}

/// `--join-wait`: returns once `path` holds something (the head replaces it whole, so
/// anything there is a complete line), or fails after `limit`.
fn wait_for_file(path: &Path, limit: Duration) -> anyhow::Result<()> {
    let has_line = || std::fs::metadata(path).is_ok_and(|m| m.len() > 0);
    if has_line() {
        return Ok(());
    }
    say!(
        "waiting up to {} s for the join line in {}",
        limit.as_secs(),
        path.display()
    );
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        if has_line() {
            return Ok(());
        }
    }
    anyhow::bail!(
        "--join-file {}: no join line appeared within {} s (--join-wait)",
        path.display(),
        limit.as_secs()
    )
}

/// `--advertise HOST:PORT`: resolved once, here; an address peers cannot dial is refused.
fn parse_advertise(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let addr = s
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {s}: {e}"))?
        .next()
        .ok_or_else(|| format!("{s} resolves to no address"))?;
    if addr.ip().is_unspecified() || addr.port() == 0 {
        return Err(format!(
            "{addr} cannot be dialled: give the host and port peers should reach"
        ));
    }
    Ok(addr)
}

/// Completes on Ctrl-C or SIGTERM, so connections are closed cleanly (peers see a departure at
/// once instead of after an idle timeout).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Finds the coordinator a bare join token names, by mDNS on the local network.
#[cfg(feature = "mdns")]
fn discover(token: &str) -> anyhow::Result<JoinTarget> {
    let token: tessera_net::JoinToken = token.parse().context("--join")?;
    let id = token.coordinator().ok_or_else(|| {
        anyhow::anyhow!("this join token names no coordinator: give TOKEN@HOST:PORT")
    })?;
    eprintln!("looking for coordinator {id} on the local network (mDNS)...");
    let addr = tessera_coord::discovery::find(id, std::time::Duration::from_secs(10))?;
    eprintln!("found it at {addr}");
    Ok(JoinTarget { token, addr })
}

#[cfg(not(feature = "mdns"))]
fn discover(_token: &str) -> anyhow::Result<JoinTarget> {
    anyhow::bail!("--join needs TOKEN@HOST:PORT: this build has no mDNS support")
}
