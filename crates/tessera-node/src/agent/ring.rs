//! The stage ring: linking to the next stage (dial, measure the link, open the ring stream),
//! and serving connections from other nodes — ring streams from the current previous stage,
//! read with a size limit (a malformed frame ends that stream), and expert streams from
//! admitted clients.

use std::sync::Arc;
use std::time::Duration;

use tessera_net::{measure_link, Connection, Endpoint, LinkMeasurement};
use tokio::sync::mpsc;

use crate::error::FabricError;
use tessera_proto::{frame, limits, stream, RingToken, StepHeader};

use super::data_links::{keep_link, report_lost_link, LinkUpFailed, DATA_LINK_LIVENESS};
use super::experts::{link_experts, serve_experts};
use super::hop_ledger::Arrival;
use super::ring_out::RingOut;
use super::shared::Shared;
use super::stage_thread::WorkerMsg;
use super::DataLink;

/// How long a worker waits for an expert stream's first frame (its epoch): the home writes it
/// as it opens the stream.
const EXPERT_EPOCH_WAIT: Duration = Duration::from_secs(5);

/// Connects to the next stage of the current epoch, measures the link, opens the ring stream.
pub(super) async fn link_next(
    epoch: u64,
    endpoint: &Endpoint,
    shared: &Arc<Shared>,
) -> Result<Option<LinkMeasurement>, LinkUpFailed> {
    let a = shared
        .lock_epochs()
        .machine
        .installed(epoch)
        .cloned()
        .ok_or_else(|| LinkUpFailed {
            peer: None,
            error: FabricError::Protocol(format!("link for epoch {epoch}, which is not loaded")),
        })?;
    link_experts(epoch, endpoint, shared).await?;
    let Some(next) = a.next else {
        let _ = shared
            .worker
            .send(WorkerMsg::Ring(epoch, RingOut::Loopback));
        return Ok(None);
    };
    let failed = LinkUpFailed::to(next.node_id);
    let up = async {
        let conn = endpoint
            .connect_with_liveness(next.addr, next.key, DATA_LINK_LIVENESS)
            .await?;
        let link = measure_link(&conn, 8, 1 << 20).await?;
        let s = conn.open_stream(stream::RING).await?;
        Ok::<_, FabricError>((conn, link, s))
    };
    let (conn, link, mut s) = up.await.map_err(failed)?;
    s.reader.set_max_len(limits::RING);
    if !keep_link(shared, epoch, DataLink::RingToNext, &conn) {
        return Err(LinkUpFailed::released(epoch));
    }
    let out = RingOut::stream(s.writer);
    let _ = shared.worker.send(WorkerMsg::Ring(epoch, out));
    Ok(Some(link))
}

/// Serves a connection from another node: ring streams from the current previous stage, and
/// expert streams from the homes this node serves. The loss of a connection that carried the
/// current epoch's ring or expert stream is reported ([`report_lost_link`]).
pub(super) async fn serve_peer(conn: Connection, shared: Arc<Shared>) {
    // The epoch and link of the streams this connection carried.
    let mut carried: Option<(u64, DataLink)> = None;
    loop {
        let mut s = match conn.accept_stream().await {
            Ok(Some(s)) => s,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("peer {}: {e}", conn.peer_id().short());
                if let Some((epoch, link)) = carried {
                    report_lost_link(&shared, epoch, link, conn.peer_id(), &e);
                }
                return;
            }
        };
        // The newest installed epoch whose previous stage is this peer (while a new split is
        // switched to, both epochs' previous stages may dial in), and its hidden width.
        let ring = shared.lock_epochs().machine.ring_from(&conn.peer_key());
        if s.kind == stream::EXPERT {
            // The stream's first frame names its epoch; a home that does not send it at once
            // is not waited for.
            s.reader.set_max_len(limits::EXPERT);
            let epoch = match tokio::time::timeout(EXPERT_EPOCH_WAIT, s.reader.read_frame()).await {
                Ok(Ok(Some(f))) if f.kind == frame::EXPERT_EPOCH => {
                    <[u8; 8]>::try_from(&f.payload[..])
                        .ok()
                        .map(u64::from_le_bytes)
                }
                _ => None,
            };
            let serving = epoch.and_then(|epoch| {
                let g = shared.lock_epochs();
                g.machine
                    .serves_experts_to(epoch, &conn.peer_key())
                    .then(|| Some((epoch, g.serving.get(&epoch)?.clone())))
                    .flatten()
            });
            match serving {
                Some((epoch, model)) => {
                    carried = Some((epoch, DataLink::ExpertFromHome));
                    let peer = conn.peer_id();
                    tokio::spawn(async move {
                        if let Err(e) = serve_experts(s, model).await {
                            tracing::warn!("expert stream from {}: {e}; closing it", peer.short());
                        }
                    });
                }
                None => {
                    tracing::info!(
                        "peer {}: refusing an expert stream (no experts of epoch {epoch:?} served \
                         to it)",
                        conn.peer_id().short()
                    );
                    let _ = s.writer.finish().await;
                }
            }
            continue;
        }
        let Some((epoch, n_embd)) = ring.filter(|_| s.kind == stream::RING) else {
            tracing::info!(
                "peer {}: refusing a stream of kind {:#06x}",
                conn.peer_id().short(),
                s.kind
            );
            let _ = s.writer.finish().await;
            continue;
        };
        carried = Some((epoch, DataLink::RingFromPrevious));
        s.reader.set_max_len(limits::RING);
        let worker = shared.worker.clone();
        let peer = conn.peer_id();
        tokio::spawn(async move {
            if let Err(e) = read_ring(&mut s.reader, n_embd, &worker).await {
                tracing::warn!(
                    "ring stream from {}: {e}; closing that stream",
                    peer.short()
                );
            }
        });
    }
}

/// Reads ring frames and hands them to the stage thread. Any malformed frame ends the stream.
async fn read_ring<R: tokio::io::AsyncRead + Unpin>(
    reader: &mut tessera_net::FrameReader<R>,
    n_embd: usize,
    worker: &mpsc::UnboundedSender<WorkerMsg>,
) -> Result<(), FabricError> {
    while let Some(f) = reader.read_frame().await? {
        let msg = match f.kind {
            frame::HIDDEN => {
                let (r, a) = Arrival::stamp(|| StepHeader::decode(&f.payload, n_embd));
                let (h, d) = r?;
                WorkerMsg::Hidden(h, d, Some(a))
            }
            frame::TOKEN => {
                let (r, a) = Arrival::stamp(|| RingToken::decode(&f.payload));
                WorkerMsg::Token(r?, Some(a))
            }
            k => {
                return Err(FabricError::Protocol(format!(
                    "unexpected frame kind {k:#06x} on a ring stream"
                )))
            }
        };
        if worker.send(msg).is_err() {
            break;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_net::frame::FrameWriter;
    use tessera_proto::StepEntry;

    #[tokio::test]
    async fn a_malformed_ring_frame_ends_that_stream_after_the_good_ones() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut w = FrameWriter::new(a);
        let h = StepHeader {
            n_embd: 4,
            entries: vec![StepEntry {
                seq: 1,
                start_pos: 0,
                n_tokens: 1,
                flags: StepEntry::SAMPLE,
            }],
        };
        w.write_frame(frame::HIDDEN, &h.encode_with(&[1.0, 2.0, 3.0, 4.0]))
            .await
            .unwrap();
        w.write_frame(
            frame::TOKEN,
            &RingToken {
                seq: 1,
                pos: 1,
                token: 7,
                drafts: vec![],
            }
            .encode(),
        )
        .await
        .unwrap();
        // Width 8 where the model has 4: refused.
        let wide = StepHeader {
            n_embd: 8,
            ..h.clone()
        };
        w.write_frame(frame::HIDDEN, &wide.encode_with(&[0.0; 8]))
            .await
            .unwrap();
        w.write_frame(frame::TOKEN, &[1, 2, 3]).await.unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut r = tessera_net::FrameReader::new(b).with_max_len(limits::RING);
        let err = read_ring(&mut r, 4, &tx).await.unwrap_err();
        assert!(matches!(err, FabricError::Frame(_)), "{err}");
        assert!(matches!(rx.try_recv(), Ok(WorkerMsg::Hidden(..))));
        assert!(matches!(rx.try_recv(), Ok(WorkerMsg::Token(..))));
        assert!(rx.try_recv().is_err(), "nothing after the bad frame");
    }

    #[tokio::test]
    async fn an_oversized_ring_frame_is_refused_before_allocation() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut w = FrameWriter::new(a);
        w.write_frame(frame::HIDDEN, &vec![0u8; 2048])
            .await
            .unwrap();
        let (tx, _rx) = mpsc::unbounded_channel();
        let mut r = tessera_net::FrameReader::new(b).with_max_len(1024);
        let err = read_ring(&mut r, 4, &tx).await.unwrap_err();
        assert!(
            matches!(
                err,
                FabricError::Net(tessera_net::NetError::FrameTooLarge {
                    len: 2048,
                    max: 1024,
                    ..
                })
            ),
            "{err}"
        );
    }
}
