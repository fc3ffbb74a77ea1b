//! Expert split: this node's expert serving state per installed epoch, the links to the
//! workers owning the rest of its stage's experts, serving expert streams for other homes (each
//! stream names its epoch), and releasing all of it with its epoch.

use std::sync::Arc;

use tessera_engine::Model;
use tessera_net::{Endpoint, FrameWriter};

use crate::error::FabricError;
use crate::protocol::{frame, limits, stream, ExpertAssignment};

use super::ring::{watch_link, DataLink, LinkUpFailed, DATA_LINK_LIVENESS};
use super::stage_thread::WorkerMsg;
use super::Shared;

/// Expert split state of one installed epoch.
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

/// Drops the expert split state of `epoch` (or of every epoch): its serving model, its worker
/// connections and the admission of its clients (a home another installed epoch still serves,
/// or whose ring stream an installed epoch takes, stays admitted).
pub(super) fn release_experts(shared: &Shared, epoch: Option<u64>) {
    let released = |e: u64| epoch.is_none_or(|x| x == e);
    let (gone, kept_clients) = {
        let mut ex = shared.experts.lock().unwrap_or_else(|p| p.into_inner());
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut *ex)
            .into_iter()
            .partition(|x| released(x.epoch));
        *ex = kept;
        let kept_clients: Vec<_> = ex
            .iter()
            .flat_map(|x| x.assignment.clients.iter().map(|c| c.node_id))
            .collect();
        (gone, kept_clients)
    };
    let prevs: Vec<_> = shared
        .current
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(|c| c.assignment.prev.as_ref().map(|p| p.node_id))
        .collect();
    for c in gone.iter().flat_map(|x| &x.assignment.clients) {
        if !kept_clients.contains(&c.node_id) && !prevs.contains(&c.node_id) {
            shared.allow.remove(&c.node_id);
        }
    }
    shared
        .expert_conns
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|(e, c)| {
            if released(*e) {
                c.close("epoch released");
            }
            !released(*e)
        });
    let mut pending = shared
        .pending_experts
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    pending.retain(|e, _| !released(*e));
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
        .iter()
        .find(|e| e.epoch == epoch && !e.assignment.expert_only)
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
            let mut s = conn.open_stream(stream::EXPERT).await?;
            // The worker may serve two epochs' experts (a split being switched to): say which.
            s.writer
                .write_frame(frame::EXPERT_EPOCH, &epoch.to_le_bytes())
                .await?;
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
            .push((epoch, conn));
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
