//! The control session with the coordinator: connecting (enrolling the first time) and
//! reconnecting with backoff, the hello and welcome, then the coordinator's messages —
//! assignments, expert placements, link-up, the lease and its heartbeats, releases, sequences
//! and inventory requests — until the session ends, when whatever it had placed here is void.

use std::sync::Arc;
use std::time::Duration;

use tessera_net::{Connection, Endpoint};
use tokio::sync::mpsc;

use crate::error::FabricError;
use crate::inventory::{measure, Inventory, ProbeOptions};
use crate::store::ShardStore;
use tessera_proto::{frame, limits, stream, CoordToNode, Hello, NodeToCoord, PROTOCOL_VERSION};

use super::load::{load_assignment, LoadCtx};
use super::peer_links::{measure_peers, Measured};
use super::ring::link_next;
use super::stage_thread::WorkerMsg;
use super::{AgentConfig, CoordinatorRecord, EpochAction, EpochEvent, Shared};

/// Connects (enrolling the first time), serves a session, and reconnects with backoff.
pub(super) async fn serve_sessions(
    config: &AgentConfig,
    hello: &Hello,
    endpoint: &Endpoint,
    shared: &Arc<Shared>,
    store: &Arc<ShardStore>,
    inventory: &Inventory,
    ctrl_rx: &Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<NodeToCoord>>>,
) -> Result<(), FabricError> {
    let mut join = config.join.clone();
    let mut backoff = Duration::from_millis(500);
    loop {
        let conn = match &join {
            Some(j) => match with_timeout(endpoint.enroll(j.addr, &j.token)).await {
                Ok(conn) => {
                    CoordinatorRecord {
                        addr: j.addr,
                        key: conn.peer_key(),
                    }
                    .save(&config.data_dir)?;
                    join = None;
                    Ok(conn)
                }
                Err(e @ tessera_net::NetError::EnrolmentRefused { .. }) => return Err(e.into()),
                Err(e) => Err(e),
            },
            None => {
                let rec =
                    CoordinatorRecord::load(&config.data_dir).ok_or(FabricError::NotEnrolled)?;
                with_timeout(endpoint.connect(rec.addr, rec.key)).await
            }
        };
        let result = match conn {
            Ok(conn) => {
                backoff = Duration::from_millis(500);
                let ctx = Arc::new(LoadCtx {
                    conn: conn.clone(),
                    store: store.clone(),
                    inventory: inventory.clone(),
                    threads: config.threads,
                    progress: config.progress,
                    expert_budget: config.expert_budget,
                    prefix_cache: config.prefix_cache,
                    fault_unchecked_weights: config.fault_unchecked_weights,
                });
                let r = session(
                    &conn,
                    hello,
                    config.advertise,
                    endpoint,
                    shared,
                    &ctx,
                    ctrl_rx,
                )
                .await;
                conn.close("session over");
                r
            }
            Err(e) => Err(e.into()),
        };
        // Whatever the coordinator had placed here is void now.
        forget_epoch(shared);
        match result {
            Err(e @ (FabricError::Refused(_) | FabricError::VersionMismatch { .. })) => {
                return Err(e);
            }
            Err(e) => tracing::warn!(
                event = "session_failed",
                error = %e,
                "coordinator session: {e}; retrying in {backoff:?}"
            ),
            Ok(()) => tracing::warn!("the coordinator ended the session; retrying in {backoff:?}"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

/// How long one attempt to reach the coordinator may take (a cut link must not hold the agent
/// for a whole QUIC idle timeout).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

async fn with_timeout(
    f: impl std::future::Future<Output = Result<Connection, tessera_net::NetError>>,
) -> Result<Connection, tessera_net::NetError> {
    match tokio::time::timeout(CONNECT_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(tessera_net::NetError::Timeout(format!(
            "no answer from the coordinator within {CONNECT_TIMEOUT:?}"
        ))),
    }
}

fn forget_epoch(shared: &Shared) {
    shared.handle_epochs(EpochEvent::SessionEnded, |_, _| {});
}

/// One control session with the coordinator: hello, welcome, then its messages until it ends.
async fn session(
    conn: &Connection,
    hello: &Hello,
    advertise: Option<std::net::SocketAddr>,
    endpoint: &Endpoint,
    shared: &Arc<Shared>,
    ctx: &Arc<LoadCtx>,
    ctrl_rx: &Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<NodeToCoord>>>,
) -> Result<(), FabricError> {
    let mut ctrl = conn.open_stream(stream::CONTROL).await?;
    ctrl.reader.set_max_len(limits::CONTROL);
    ctrl.writer
        .write_message(frame::MSG, &NodeToCoord::Hello(hello.clone()))
        .await?;
    ctrl.writer
        .write_message(
            frame::MSG,
            &NodeToCoord::Listening {
                addr: match advertise {
                    Some(a) => a,
                    None => endpoint.local_addr()?,
                },
                advertised: advertise.is_some(),
            },
        )
        .await?;
    match ctrl.reader.read_message::<CoordToNode>(frame::MSG).await? {
        CoordToNode::Welcome {
            protocol_version,
            coordinator,
            observed_addr,
        } => {
            if protocol_version != PROTOCOL_VERSION {
                return Err(FabricError::VersionMismatch {
                    ours: PROTOCOL_VERSION,
                    theirs: protocol_version,
                });
            }
            tracing::info!(
                event = "joined",
                coordinator = %coordinator,
                name = %hello.name,
                "joined coordinator {coordinator} as {} ({observed_addr})",
                hello.name
            );
        }
        CoordToNode::Refused { reason } => return Err(FabricError::Refused(reason)),
        other => {
            return Err(FabricError::Protocol(format!(
                "expected a welcome, got {other:?}"
            )))
        }
    }
    // Messages queued for an earlier session are stale.
    let mut rx = ctrl_rx.clone().lock_owned().await;
    while rx.try_recv().is_ok() {}
    let mut ctrl_writer = ctrl.writer;
    let sh = shared.clone();
    let writer_task = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            // A sealed job's own sequence reports to the job, not to the coordinator.
            let out = match sh.sealed.intercept(m, &sh.worker) {
                Ok(m) => vec![m],
                Err(follow) => follow,
            };
            for m in out {
                if let Err(e) = ctrl_writer.write_message(frame::MSG, &m).await {
                    tracing::warn!("control stream: {e}");
                    return;
                }
            }
        }
    });
    shared.publish_claims();
    // Answer the coordinator's measurement streams.
    let measure_task = {
        let conn = conn.clone();
        tokio::spawn(async move { while let Ok(Some(_)) = conn.accept_stream().await {} })
    };
    let result = control_loop(&mut ctrl.reader, endpoint, shared, ctx).await;
    writer_task.abort();
    measure_task.abort();
    result
}

async fn control_loop(
    reader: &mut tessera_net::FrameReader<tessera_net::quinn::RecvStream>,
    endpoint: &Endpoint,
    shared: &Arc<Shared>,
    ctx: &Arc<LoadCtx>,
) -> Result<(), FabricError> {
    // Heartbeats for this session's lease (aborted when the session ends).
    struct Heartbeat(Option<tokio::task::JoinHandle<()>>);
    impl Drop for Heartbeat {
        fn drop(&mut self) {
            if let Some(h) = self.0.take() {
                h.abort();
            }
        }
    }
    let mut heartbeat = Heartbeat(None);
    // Peer link measurements: which peers were measured, and the tasks measuring (aborted
    // with the session).
    let mut measured = Measured::default();
    let mut measuring = tokio::task::JoinSet::new();
    // The coordinator's lease: once it has told one, its silence for that long ends the
    // session (it is gone, or the link is cut) and the node reconnects.
    let mut coordinator_lease: Option<(u64, Duration)> = None;
    loop {
        let frame = match coordinator_lease {
            Some((_, lease)) => match tokio::time::timeout(lease, reader.read_frame()).await {
                Ok(f) => f?,
                Err(_) => {
                    return Err(FabricError::Stopped(format!(
                        "the coordinator was silent for {lease:?}"
                    )))
                }
            },
            None => reader.read_frame().await?,
        };
        let msg = match frame {
            None => {
                tracing::info!("the coordinator closed the session");
                return Ok(());
            }
            Some(f) if f.kind == frame::MSG => f.json::<CoordToNode>()?,
            Some(f) => {
                return Err(FabricError::Protocol(format!(
                    "unexpected frame kind {:#06x} on the control stream",
                    f.kind
                )))
            }
        };
        match msg {
            CoordToNode::Assign(a) => {
                let epoch = a.epoch;
                tracing::info!(
                    event = "assigned",
                    epoch,
                    stage = a.stage,
                    "assigned epoch {epoch}: stage {} of {}, layers {}..{}",
                    a.stage,
                    a.n_stages,
                    a.layers.start,
                    a.layers.end
                );
                shared.handle_epochs(EpochEvent::Assign(a), |_, action| {
                    if let EpochAction::Load {
                        ticket,
                        assignment,
                        experts,
                    } = action
                    {
                        let (shared, ctx) = (shared.clone(), ctx.clone());
                        tokio::spawn(async move {
                            let epoch = assignment.epoch;
                            let loaded =
                                load_assignment(ticket, *assignment, experts, &ctx, &shared).await;
                            if let Err(e) = loaded {
                                tracing::warn!("cannot take epoch {epoch}: {e}");
                                let _ = shared.ctrl.send(NodeToCoord::LoadFailed {
                                    epoch,
                                    reason: e.to_string(),
                                });
                                shared.handle_epochs(EpochEvent::LoadFailed { ticket }, |_, _| {});
                            }
                        });
                    }
                });
            }
            CoordToNode::AssignExperts { epoch, experts } => {
                shared.handle_epochs(EpochEvent::AssignExperts { epoch, experts }, |_, _| {});
            }
            CoordToNode::Link { epoch } => {
                let (shared, endpoint) = (shared.clone(), endpoint.clone());
                tokio::spawn(async move {
                    let msg = match link_next(epoch, &endpoint, &shared).await {
                        Ok(link) => NodeToCoord::Linked { epoch, link },
                        // An epoch released while it linked wants no answer.
                        Err(e) if !shared.holds_epoch(epoch) => {
                            tracing::info!("epoch {epoch} went while it linked: {}", e.error);
                            return;
                        }
                        Err(e) => NodeToCoord::LinkFailed {
                            epoch,
                            reason: e.error.to_string(),
                            peer: e.peer,
                        },
                    };
                    let _ = shared.ctrl.send(msg);
                });
            }
            CoordToNode::Lease {
                heartbeat_ms,
                lease_ms,
            } => {
                let lease = Duration::from_millis(lease_ms.max(1));
                let same = coordinator_lease.is_some_and(|(h, _)| h == heartbeat_ms);
                coordinator_lease = Some((heartbeat_ms, lease));
                if same {
                    continue;
                }
                let every = Duration::from_millis(heartbeat_ms.clamp(10, 60_000));
                tracing::info!("lease {lease_ms} ms: heartbeat every {every:?}");
                let ctrl = shared.ctrl.clone();
                let sh = shared.clone();
                let task = tokio::spawn(async move {
                    let mut tick = tokio::time::interval(every);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tick.tick().await;
                        let expert_cache = sh.expert_cache();
                        if ctrl.send(NodeToCoord::Heartbeat { expert_cache }).is_err() {
                            break;
                        }
                    }
                });
                if let Some(old) = heartbeat.0.replace(task) {
                    old.abort();
                }
            }
            CoordToNode::Release { epoch } => {
                shared.handle_epochs(EpochEvent::Release { epoch }, |_, _| {});
            }
            CoordToNode::Open(o) => {
                let _ = shared.worker.send(WorkerMsg::Open(o));
            }
            CoordToNode::Start { seq, reuse } => {
                let _ = shared.worker.send(WorkerMsg::Start(seq, reuse));
            }
            CoordToNode::SealedJob { envelope } => {
                let holding = shared.sealed_holding();
                if let Err(refusal) = shared
                    .sealed
                    .take(envelope, holding.as_ref(), &shared.worker)
                {
                    let _ = shared.ctrl.send(*refusal);
                }
            }
            CoordToNode::Close { seq, keep } => {
                let _ = shared.worker.send(WorkerMsg::Close(seq, keep));
            }
            CoordToNode::MeasurePeers { mut peers } => {
                peers.truncate(CoordToNode::MAX_MEASURED_PEERS);
                let keys = peers.iter().map(|p| (p.node_id, p.key)).collect();
                shared.handle_epochs(EpochEvent::MeasurePeers(keys), |_, _| {});
                let new = measured.take_new(&peers);
                while measuring.try_join_next().is_some() {}
                if !new.is_empty() {
                    let (ctrl, endpoint) = (shared.ctrl.clone(), endpoint.clone());
                    measuring.spawn(async move {
                        let links = measure_peers(&endpoint, &new).await;
                        let _ = ctrl.send(NodeToCoord::PeerLinks { links });
                    });
                }
            }
            CoordToNode::MeasureInventory => {
                let shared = shared.clone();
                let ctx = ctx.clone();
                tokio::task::spawn_blocking(move || {
                    let mut inv = measure(&ProbeOptions {
                        disk_dir: Some(ctx.store.data_dir().to_owned()),
                        threads: Some(ctx.threads),
                        ..Default::default()
                    });
                    inv.memory_budget = ctx.inventory.memory_budget.clone();
                    let _ = shared.ctrl.send(NodeToCoord::Inventory(Box::new(inv)));
                });
            }
            CoordToNode::Welcome { .. } | CoordToNode::Refused { .. } => {
                return Err(FabricError::Protocol(
                    "a second welcome on the control stream".into(),
                ))
            }
        }
    }
}
