//! `tessera coordinator`: the control plane. Prints the join token, enrols nodes, distributes
//! the model, places layer ranges on nodes and drives generations for `tessera run`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use tessera_coord::{Coordinator, CoordinatorConfig};
use tessera_placement::assignment::{parse_experts, parse_split, PlanFile};

/// Where in its data directory the coordinator writes the node join line.
pub const JOIN_TOKEN_FILE: &str = "join.token";
/// Where in its data directory the coordinator writes the operator line.
pub const OPERATOR_TOKEN_FILE: &str = "operator.token";

#[derive(clap::Args, Debug)]
pub struct CoordinatorArgs {
    /// The GGUF model the cluster serves (default: the built-in stories260K). The coordinator
    /// reads its metadata and serves its chunks; it loads no weights.
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// UDP address to listen on.
    #[arg(long, default_value = "0.0.0.0:7070")]
    listen: SocketAddr,
    /// The address nodes and operators dial, written in the join and operator lines in place
    /// of --listen's: a name or address reachable from them (a compose service name, a port
    /// forward). Kept as written; each node resolves a name itself.
    #[arg(long, value_name = "HOST:PORT", value_parser = super::join_line::parse_advertise)]
    advertise: Option<String>,
    /// Also write the node join line to this file (owner-only, replaced whole): e.g. on a
    /// volume the nodes mount for `tessera node --join-file`, apart from --data-dir.
    #[arg(long, value_name = "PATH")]
    join_copy: Option<PathBuf>,
    /// Where the coordinator keeps its key, the join token and the enrolled nodes.
    #[arg(long)]
    data_dir: PathBuf,
    /// Apply this split as soon as enough nodes have joined, e.g. `0..3,3..5` (stages take nodes
    /// in the order they joined). Starting again at layer 0 adds a cell, a whole copy of the
    /// model taking whole requests: `0..5,0..5` is two single-node cells.
    #[arg(long, conflicts_with = "plan")]
    split: Option<String>,
    /// Apply this plan file (JSON: `{"stages":[{"node":"NAME","layers":"0..3"},...]}`), or
    /// `auto`: once `--nodes-expected` nodes have joined, plan from their measured inventory and
    /// links (printing the explanation, and writing it to `DATA_DIR/plan-auto.json`) and apply
    /// the chosen stage split or expert split.
    #[arg(long)]
    plan: Option<PathBuf>,
    /// With `--plan auto`: plan with this calibrated graph's rates (a cluster file or scenario,
    /// e.g. `tessera lab run --save-calibrated`) in place of the measured ones, for the nodes
    /// and links it names.
    #[arg(long, value_name = "FILE")]
    calibrated: Option<PathBuf>,
    /// With `--plan auto`: how many nodes to wait for before planning.
    #[arg(long, default_value_t = 1, value_name = "N")]
    nodes_expected: usize,
    /// Split every MoE layer's experts across nodes, e.g. `0-3@a,4-7@b` (expert ids or
    /// inclusive ranges joined by `+`, at a node name or id prefix). Stage nodes compute the
    /// experts they are given for their own layers; named nodes that are not stages hold only
    /// experts and serve the stages' requests. The first plan waits for every named node. When
    /// a node holding experts leaves, its experts go to the others (by free memory; a node
    /// given more than its budget streams them from disk) until it is back.
    #[arg(long, value_name = "SPLIT")]
    experts: Option<String>,
    /// Most positions per sequence (default: the model's context length).
    #[arg(long)]
    max_context: Option<usize>,
    /// KV cache element type: f16 (default), q8_0 (half the bytes again; heads of whole
    /// 32-blocks) or f32 (llama.cpp's non-flash numerics).
    #[arg(long, default_value = "f16")]
    kv_type: tessera_engine::KvType,
    /// Bytes per chunk of the model's manifest: nodes fetch and verify the model in chunks,
    /// and a node given some experts fetches only the chunks that overlap them. Smaller chunks
    /// waste less at the edges of expert slices (useful when a slice is not much larger than a
    /// chunk), at the cost of a longer manifest.
    #[arg(long, default_value_t = tessera_node::store::DEFAULT_CHUNK_SIZE, value_name = "BYTES",
          value_parser = clap::value_parser!(u32).range(4096..=tessera_node::store::MAX_CHUNK_SIZE as i64))]
    chunk_size: u32,
    /// Advertise this coordinator on the local network by mDNS, so nodes can join with the
    /// token alone (`tessera node --join TOKEN`).
    #[arg(long)]
    mdns: bool,
    /// Node lease, ms: a node silent this long (dead, frozen or cut off) is declared gone and
    /// the model is re-planned onto the others. Nodes heartbeat four times per lease.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(100..))]
    lease_ms: u64,
    /// Sealed jobs (`tessera client submit`): re-run this share of answers, in thousandths, on a
    /// second worker and compare the token ids before the client gets them (a third worker
    /// breaks a tie; the odd one out is quarantined). Default: each device tier's own rate
    /// (phones 200, laptops 100, workstations 50, servers 20).
    #[arg(long, value_name = "PER_MILLE", value_parser = clap::value_parser!(u32).range(0..=1000))]
    verify_per_mille: Option<u32>,
    /// Test only: misbehave with sealed jobs (rewrite-recipient, rewrite-ttl, replay), to show
    /// that workers refuse what a coordinator altered.
    #[arg(long, hide = true, value_name = "FAULT")]
    fault_sealed: Option<tessera_coord::sealed::SealedFault>,
}

pub fn run(args: CoordinatorArgs) -> anyhow::Result<()> {
    let model = crate::default_model::resolve(args.model)?;
    let auto = args.plan.as_deref() == Some(std::path::Path::new("auto"));
    let split = match (&args.split, &args.plan) {
        (Some(s), _) => Some(parse_split(s).context("--split")?),
        (None, Some(_)) if auto => None,
        (None, Some(p)) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let plan: PlanFile =
                serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
            Some(plan.stages)
        }
        (None, None) => None,
    };
    if args.calibrated.is_some() && !auto {
        anyhow::bail!("--calibrated is for --plan auto");
    }
    let calibrated = args
        .calibrated
        .as_deref()
        .map(super::auto_plan::read_calibrated)
        .transpose()?;
    if auto && args.experts.is_some() {
        anyhow::bail!("--experts with --plan auto: the plan chooses the expert split");
    }
    let experts = args
        .experts
        .as_deref()
        .map(parse_experts)
        .transpose()
        .context("--experts")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let gguf = tessera_model::GgufFile::open(&model)?;
        let ctx = tessera_model::ModelConfig::from_gguf(&gguf)?.context_length;
        let profile = if auto {
            Some(
                tessera_model::ModelProfile::from_gguf(&gguf)
                    .context("reading the model profile")?,
            )
        } else {
            None
        };
        drop(gguf);
        let max_context = args.max_context.unwrap_or(ctx);
        let data_dir = args.data_dir.clone();
        let coordinator = Coordinator::bind(CoordinatorConfig {
            data_dir: args.data_dir,
            listen: args.listen,
            model: model.clone(),
            split,
            max_context,
            progress: true,
            chunk_size: args.chunk_size,
        })
        .await
        .context("starting the coordinator")?;
        coordinator.set_lease(std::time::Duration::from_millis(args.lease_ms));
        coordinator.set_expert_split(experts).await;
        coordinator.set_kv_type(args.kv_type).await;
        coordinator.set_sealed(&tessera_coord::sealed::SealedSettings {
            verify_per_mille: args.verify_per_mille,
            fault: args.fault_sealed,
            data_dir: Some(data_dir.clone()),
        });
        let addr = coordinator.local_addr()?;
        say!("coordinator {}", coordinator.node_id());
        say!(
            "model {} ({:?}), hash {}",
            model.display(),
            coordinator.model().config.arch,
            coordinator.manifest().model_hash.short()
        );
        let advertised = args.advertise.as_deref();
        let (addr_s, join, operator) = (
            addr.to_string(),
            super::join_line::line(coordinator.token(), addr, advertised),
            super::join_line::line(coordinator.operator_token(), addr, advertised),
        );
        crate::logging::announce(
            "listening",
            &[("addr", &addr_s)],
            &format!("listening on {addr}"),
        );
        crate::logging::announce(
            "join_token",
            &[("token", &join)],
            &format!("join token: {join}"),
        );
        crate::logging::announce(
            "operator_token",
            &[("token", &operator)],
            &format!("operator token: {operator}"),
        );
        // The same lines in owner-only files, for `--join-file` and `--coordinator-file`
        // (a token on a command line is visible to every user in the process list).
        let (join_file, operator_file) = (
            data_dir.join(JOIN_TOKEN_FILE),
            data_dir.join(OPERATOR_TOKEN_FILE),
        );
        super::up::write_secret(&join_file, &format!("{join}\n"))?;
        super::up::write_secret(&operator_file, &format!("{operator}\n"))?;
        if let Some(copy) = &args.join_copy {
            super::join_line::write_copy(copy, &join)?;
        }
        let (jf, of) = (
            join_file.display().to_string(),
            operator_file.display().to_string(),
        );
        crate::logging::announce(
            "token_files",
            &[("join", &jf), ("operator", &of)],
            &format!("token files: {jf} (nodes: --join-file), {of} (--coordinator-file)"),
        );
        let _advertisement = if args.mdns {
            advertise(coordinator.node_id(), addr.port())?
        } else {
            None
        };
        if addr.ip().is_unspecified() && advertised.is_none() {
            say!(
                "(nodes on other machines use this machine's address in place of {})",
                addr.ip()
            );
        }
        let planning = async {
            if let Some(p) = &profile {
                let context = super::auto_plan::ContextChoice {
                    max: max_context,
                    fixed: args.max_context.is_some(),
                };
                let expected = args.nodes_expected;
                if let Err(e) = super::auto_plan::run(
                    &coordinator,
                    p,
                    expected,
                    context,
                    1,
                    &data_dir,
                    calibrated.as_ref(),
                )
                .await
                {
                    say_err!("--plan auto: {e:#}");
                }
            }
            std::future::pending::<()>().await
        };
        tokio::select! {
            r = coordinator.run() => r?,
            () = planning => {}
            () = super::node::shutdown_signal() => {
                say!("shutting down");
                coordinator.close();
                coordinator.wait_idle().await;
            }
        }
        anyhow::Ok(())
    })
}

#[cfg(feature = "mdns")]
fn advertise(
    id: tessera_net::NodeId,
    port: u16,
) -> anyhow::Result<Option<tessera_coord::discovery::Advertisement>> {
    let a = tessera_coord::discovery::advertise(id, port).context("advertising by mDNS")?;
    say!(
        "advertised by mDNS as {}",
        tessera_coord::discovery::SERVICE_TYPE
    );
    Ok(Some(a))
}

#[cfg(not(feature = "mdns"))]
fn advertise(_id: tessera_net::NodeId, _port: u16) -> anyhow::Result<Option<()>> {
    anyhow::bail!("this build has no mDNS support (build with the `mdns` feature)")
}
