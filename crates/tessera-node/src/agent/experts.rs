//! Expert split: the links to the workers owning the rest of this node's stage's experts, and
//! serving expert streams for other homes (each stream names its epoch). Which epoch serves
//! whom, and what goes with a release, is the epoch machine's ([`super::epochs`]).

use std::sync::Arc;

use tessera_engine::Model;
use tessera_net::{Endpoint, FrameWriter};

use crate::error::FabricError;
use tessera_proto::{frame, limits, stream};

use super::data_links::{keep_link, LinkUpFailed, DATA_LINK_LIVENESS};
use super::shared::Shared;
use super::stage_thread::WorkerMsg;
use super::DataLink;

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

/// Expert split: opens one expert stream to every worker owning experts of this stage's layers
/// and hands the links to the stage thread.
pub(super) async fn link_experts(
    epoch: u64,
    endpoint: &Endpoint,
    shared: &Arc<Shared>,
) -> Result<(), LinkUpFailed> {
    let peers = shared.lock_epochs().machine.expert_peers(epoch);
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
        if !keep_link(shared, epoch, DataLink::ExpertToWorker, &conn) {
            return Err(LinkUpFailed::released(epoch));
        }
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
