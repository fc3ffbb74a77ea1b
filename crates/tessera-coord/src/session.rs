//! Control sessions: the hello, then either a node's session (its outbox, its messages turned
//! into the cluster's inputs) or a client's (`driver::client_session`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{BoxStream, StreamExt};
use tessera_net::quinn::RecvStream;
use tessera_net::{measure_link, Connection, FrameReader, FramedStream, NodeId};
use tessera_proto::{frame, limits, CoordToNode, Hello, NodeToCoord, Role, PROTOCOL_VERSION};
use tokio::sync::{mpsc, oneshot};

use crate::cluster::ClusterInput;
use crate::enrol::EnrolRefusal;
use crate::error::CoordError;
use crate::membership::Member;
use crate::shared::{Command, Shared};

pub(crate) async fn control_session(
    shared: Arc<Shared>,
    conn: Connection,
    mut s: FramedStream,
) -> Result<(), CoordError> {
    s.reader.set_max_len(limits::CONTROL);
    let first = s.reader.recv_kind(frame::MSG, "a hello").await?;
    let v: serde_json::Value = serde_json::from_slice(&first)
        .map_err(|e| CoordError::Protocol(format!("malformed hello: {e}")))?;
    let hello: Hello = match v.get("type").and_then(|t| t.as_str()) {
        Some("hello") => serde_json::from_value(v)
            .map_err(|e| CoordError::Protocol(format!("malformed hello: {e}")))?,
        _ => {
            return Err(CoordError::Protocol(
                "the first message must be a hello".into(),
            ))
        }
    };
    if hello.protocol_version != PROTOCOL_VERSION {
        let reason = format!(
            "protocol version mismatch: the coordinator speaks {PROTOCOL_VERSION}, the peer {}",
            hello.protocol_version
        );
        let msg = CoordToNode::Refused {
            reason: reason.clone(),
        };
        let _ = s_write(&mut s.writer, &msg).await;
        let _ = s.writer.finish().await;
        return Err(CoordError::Protocol(reason));
    }
    let (key, name, role) = (conn.peer_key(), hello.name.clone(), hello.role);
    let bound = shared
        .ask(move |core, _| core.enrolment.bind_name(&key, &name, role))
        .await
        .unwrap_or_else(|| {
            Err(EnrolRefusal::NotRecorded(
                "the coordinator is closing".into(),
            ))
        });
    if let Err(r) = bound {
        let reason = r.to_string();
        let _ = s_write(
            &mut s.writer,
            &CoordToNode::Refused {
                reason: reason.clone(),
            },
        )
        .await;
        let _ = s.writer.finish().await;
        return Err(CoordError::Protocol(reason));
    }
    match hello.role {
        Role::Node => node_session(shared, conn, s, hello).await,
        Role::Client => crate::driver::client_session(shared, conn, s).await,
    }
}

pub(crate) async fn s_write<T: serde::Serialize>(
    w: &mut tessera_net::FrameWriter<tessera_net::quinn::SendStream>,
    msg: &T,
) -> Result<(), CoordError> {
    Ok(w.write_message(frame::MSG, msg).await?)
}

async fn node_session(
    shared: Arc<Shared>,
    conn: Connection,
    s: FramedStream,
    hello: Hello,
) -> Result<(), CoordError> {
    let id = conn.peer_id();
    let key = crate::sealed::edge::node_key(&conn.peer_key());
    let FramedStream {
        mut reader,
        mut writer,
        ..
    } = s;
    let (tx, mut rx) = mpsc::unbounded_channel::<CoordToNode>();
    let _ = tx.send(CoordToNode::Welcome {
        protocol_version: PROTOCOL_VERSION,
        coordinator: shared.id,
        observed_addr: conn.remote_addr(),
    });
    let lease = shared.lease();
    let lease_msg = CoordToNode::Lease {
        heartbeat_ms: (lease.as_millis() as u64 / 4).max(1),
        lease_ms: lease.as_millis() as u64,
    };
    let _ = tx.send(lease_msg.clone());
    // The coordinator's own heartbeat: the lease, repeated.
    let _beat = {
        let tx = tx.clone();
        AbortOnDrop(tokio::spawn(async move {
            let mut tick = tokio::time::interval((lease / 4).max(Duration::from_millis(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                if tx.send(lease_msg.clone()).is_err() {
                    break;
                }
            }
        }))
    };
    // The port the node listens on, sent right after its hello (see
    // `NodeToCoord::Listening`); any other first message is handled after the join.
    let mut addr = conn.remote_addr();
    let mut early = None;
    match tokio::time::timeout(lease, reader.read_frame()).await {
        Ok(Ok(Some(f))) if f.kind == frame::MSG => match f.json::<NodeToCoord>() {
            Ok(NodeToCoord::Listening {
                addr: a,
                advertised,
            }) => addr = if advertised { a } else { peer_addr(addr, a) },
            Ok(m) => early = Some(m),
            Err(e) => return Err(e.into()),
        },
        Ok(Ok(Some(f))) => {
            return Err(CoordError::Protocol(format!(
                "unexpected frame kind {:#06x} on a control stream",
                f.kind
            )))
        }
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => {}
    }
    let writer_task = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if writer.write_message(frame::MSG, &m).await.is_err() {
                break;
            }
        }
    });
    let session = shared.open_session(
        Member {
            memory_budget_bytes: hello.memory_budget_bytes,
            inventory: hello.inventory.map(|b| *b),
            models: hello.models,
            ..Member::hello(conn.peer_key(), hello.name.clone(), addr)
        },
        tx,
        conn.clone(),
    );
    tracing::info!(
        event = "node_joined",
        node = %hello.name,
        node_id = %id,
        session,
        "node joined: {} ({}) at {addr}",
        hello.name,
        id.short()
    );
    // Measure the link to the node in the background.
    {
        let (shared, conn, name) = (shared.clone(), conn.clone(), hello.name.clone());
        tokio::spawn(async move {
            match measure_link(&conn, 8, 1 << 20).await {
                Ok(link) => {
                    tracing::info!(
                        "link to {}: round trip {:.2} ms, {:.1} MB/s",
                        name,
                        link.rtt_median.as_secs_f64() * 1e3,
                        link.bytes_per_s / 1e6
                    );
                    shared.handle(ClusterInput::LinkMeasured { node: id, link });
                }
                Err(e) => tracing::warn!("measuring the link to {}: {e}", id.short()),
            }
        });
    }
    if let Some(m) = early {
        shared.run(node_command(&shared, id, session, key, m));
    }
    // From here the core task reads the stream itself: a node's message becomes the cluster's
    // input where the cluster is, with no channel or lock between them. This task keeps the
    // outbox's writer until the core says the stream ended.
    let (ended_tx, ended) = oneshot::channel();
    shared.add_reader(node_frames(NodeFrames {
        shared: shared.clone(),
        conn: conn.clone(),
        reader,
        id,
        session,
        key,
        ended: Some(ended_tx),
        rights_checked: None,
    }));
    let result = ended.await.unwrap_or(Ok(()));
    writer_task.abort();
    tracing::info!(event = "node_left", node = %hello.name, node_id = %id, "node left: {} {}", hello.name, id.short());
    result
}

/// A node's control stream as the core task reads it.
struct NodeFrames {
    shared: Arc<Shared>,
    conn: Connection,
    reader: FrameReader<RecvStream>,
    id: NodeId,
    session: u64,
    key: tessera_seal::NodeKey,
    /// Told how the stream ended.
    ended: Option<oneshot::Sender<Result<(), CoordError>>>,
    /// The enrolment's change count when this key's rights were last checked.
    rights_checked: Option<u64>,
}

/// Each frame of a node's control stream as a command for the core (polled on the core task,
/// so checking and decoding a frame happen there), then one command that ends the session:
/// the stream ended, failed, broke the protocol, or its key was revoked. Every message renews
/// the lease (the membership machine expires it: a node silent for a whole lease, dead,
/// frozen or cut off, is declared gone and its connection closed under the read).
fn node_frames(frames: NodeFrames) -> BoxStream<'static, Command> {
    futures_util::stream::unfold(Some(frames), |state| async move {
        let mut f = state?;
        match next_message(&mut f).await {
            Ok(Some(msg)) => {
                let command = node_command(&f.shared, f.id, f.session, f.key, msg);
                Some((command, Some(f)))
            }
            end => {
                let (id, session, ended) = (f.id, f.session, f.ended.take());
                let end = end.map(|_| ());
                // If it held a stage, the cluster fails the epoch and plans one on the
                // survivors, and runs on it resume there; the sealed desk moves its jobs on.
                let command = Command::With(Box::new(move |core, shared| {
                    core.close_session(shared, id, session);
                    if let Some(tx) = ended {
                        let _ = tx.send(end);
                    }
                }));
                Some((command, None))
            }
        }
    })
    .boxed()
}

/// The next message on a node's control stream; `None` when it ended.
async fn next_message(f: &mut NodeFrames) -> Result<Option<NodeToCoord>, CoordError> {
    let Some(frame) = f.reader.read_frame().await? else {
        return Ok(None);
    };
    if frame.kind != frame::MSG {
        return Err(CoordError::Protocol(format!(
            "unexpected frame kind {:#06x} on a control stream",
            frame.kind
        )));
    }
    // Rights are the key's now, not at the session's start: a revoked key's session ends at
    // its next message. Checked again only when the records changed since.
    let changes = f.shared.enrol.changes();
    if f.rights_checked != Some(changes) {
        if f.shared.enrol.grant_of(&f.conn.peer_key()) != Some(crate::authz::Grant::Node) {
            f.conn.close("revoked");
            return Err(CoordError::Protocol(format!("{} is revoked", f.id.short())));
        }
        f.rights_checked = Some(changes);
    }
    Ok(Some(frame.json()?))
}

/// A node's message as a command for the core: refused if it may not say it, the sealed
/// desk's if it is about a sealed job, else the cluster's (every message renews the lease
/// there).
fn node_command(
    shared: &Shared,
    id: NodeId,
    session: u64,
    key: tessera_seal::NodeKey,
    msg: NodeToCoord,
) -> Command {
    let sender = crate::authz::SenderFacts {
        node: id,
        grant: crate::authz::Grant::Node,
    };
    // Heard all the same: the lease is about liveness, not manners.
    let heard = ClusterInput::Node {
        node: id,
        session,
        msg: NodeToCoord::Heartbeat { expert_cache: None },
    };
    if shared.authz.check_node(&sender, &msg).is_err() {
        Command::Input(heard)
    } else if crate::sealed::edge::is_sealed(&msg) {
        Command::With(Box::new(move |core, shared| {
            crate::sealed::edge::node_message(&mut core.edge(shared), key, &msg);
            core.handle(shared, heard);
        }))
    } else {
        if let NodeToCoord::Hello(_) = msg {
            tracing::warn!("{}: a second hello; ignored", id.short());
        }
        Command::Input(ClusterInput::Node {
            node: id,
            session,
            msg,
        })
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The address peers should dial for a node that listens on `advertised` and was seen at
/// `observed`: the advertised port at the observed host when the hosts agree (or the node
/// listens on every address), else what was observed (e.g. behind NAT). A node started with
/// `--advertise` says so, and its address is taken as it is.
fn peer_addr(observed: SocketAddr, advertised: SocketAddr) -> SocketAddr {
    if advertised.ip().is_unspecified() {
        SocketAddr::new(observed.ip(), advertised.port())
    } else if advertised.ip() == observed.ip() {
        advertised
    } else {
        observed
    }
}
