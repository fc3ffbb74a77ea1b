//! Expert split: this node's expert serving state for the current epoch, the links to the
//! workers owning the rest of its stage's experts, serving expert streams for other homes, and
//! releasing all of it with its epoch.

use std::sync::Arc;

use tessera_engine::Model;
use tessera_net::{Endpoint, FrameWriter};

use crate::error::FabricError;
use crate::protocol::{frame, limits, stream, ExpertAssignment};

use super::ring::{watch_link, DataLink, LinkUpFailed, DATA_LINK_LIVENESS};
use super::stage_thread::WorkerMsg;
use super::Shared;

/// Expert split state of the current epoch.
#[derive(Clone)]
pub(super) struct ExpertServing {
    pub(super) epoch: u64,
    pub(super) assignment: ExpertAssignment,
    /// Experts this node computes for other homes (`None`: it serves none).
    pub(super) model: Option<Arc<Model>>,
}

/// A blocking expert link over a network stream, driven by the agent's runtime from the stage
/// thread (like the ring).
struct NetExpertLink {
    writer: FrameWriter<tessera_net::quinn::SendStream>,
    reader: tessera_net::FrameReader<tessera_net::quinn::RecvStream>,
    rt: tokio::runtime::Handle,
}

impl crate::expert::ExpertLink for NetExpertLink {
    fn send(&mut self, kind: u16, payload: Vec<u8>) -> Result<(), String> {
        self.rt
            .block_on(self.writer.write_frame(kind, &payload))
            .map_err(|e| e.to_string())
    }
    fn recv(&mut self) -> Result<(u16, Vec<u8>), String> {
        match self.rt.block_on(self.reader.read_frame()) {
            Ok(Some(f)) => Ok((f.kind, f.payload.to_vec())),
            Ok(None) => Err("the worker closed the stream".into()),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// Drops the expert split state of `epoch` (or of any epoch): its serving model, its worker
/// connections and the admission of its clients.
pub(super) fn release_experts(shared: &Shared, epoch: Option<u64>) {
    let mut ex = shared.experts.lock().unwrap_or_else(|p| p.into_inner());
    if ex
        .as_ref()
        .is_some_and(|e| epoch.is_none_or(|epoch| e.epoch == epoch))
    {
        if let Some(e) = ex.take() {
            for c in &e.assignment.clients {
                shared.allow.remove(&c.node_id);
            }
        }
        for c in shared
            .expert_conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            c.close("epoch released");
        }
    }
    let mut pending = shared
        .pending_experts
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    match epoch {
        Some(epoch) => {
            pending.remove(&epoch);
        }
        None => pending.clear(),
    }
}

/// Expert split: opens one expert stream to every worker owning experts of this stage's layers
/// and hands the links to the stage thread.
pub(super) async fn link_experts(
    epoch: u64,
    endpoint: &Endpoint,
    shared: &Arc<Shared>,
) -> Result<(), LinkUpFailed> {
    let peers = shared
        .experts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .filter(|e| e.epoch == epoch && !e.assignment.expert_only)
        .map(|e| e.assignment.peers.clone())
        .unwrap_or_default();
    if peers.is_empty() {
        return Ok(());
    }
    let mut remote = Vec::with_capacity(peers.len());
    for p in peers {
        let up = async {
            let conn = endpoint
                .connect_with_liveness(p.peer.addr, p.peer.key, DATA_LINK_LIVENESS)
                .await?;
            let s = conn.open_stream(stream::EXPERT).await?;
            Ok::<_, FabricError>((conn, s))
        };
        let (conn, mut s) = up.await.map_err(LinkUpFailed::to(p.peer.node_id))?;
        s.reader.set_max_len(limits::EXPERT);
        watch_link(
            conn.clone(),
            epoch,
            DataLink::ExpertToWorker,
            shared.clone(),
        );
        shared
            .expert_conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(conn);
        remote.push(crate::expert::RemotePeer {
            name: p.peer.node_id.short(),
            experts: p.experts,
            link: Box::new(NetExpertLink {
                writer: s.writer,
                reader: s.reader,
                rt: tokio::runtime::Handle::current(),
            }),
        });
    }
    let _ = shared.worker.send(WorkerMsg::Experts(
        epoch,
        crate::expert::RemotePeers::new(remote),
    ));
    Ok(())
}

/// Serves an expert stream: each request is computed on the serving model (off the runtime)
/// and answered in order.
pub(super) async fn serve_experts(
    mut s: tessera_net::FramedStream,
    model: Arc<Model>,
) -> Result<(), FabricError> {
    s.reader.set_max_len(limits::EXPERT);
    while let Some(f) = s.reader.read_frame().await? {
        if f.kind != frame::EXPERT_REQ {
            return Err(FabricError::Protocol(format!(
                "unexpected frame kind {:#06x} on an expert stream",
                f.kind
            )));
        }
        let m = model.clone();
        let (kind, payload) =
            tokio::task::spawn_blocking(move || crate::expert::answer(&m, &f.payload))
                .await
                .map_err(|e| FabricError::Stopped(format!("expert worker: {e}")))?;
        s.writer.write_frame(kind, &payload).await?;
    }
    Ok(())
}
