//! The stage ring: where the stage's ring outputs go ([`RingOut`]), linking to the next stage
//! (dial, measure the link, open the ring stream), and serving connections from other nodes —
//! ring streams from the current previous stage, read with a size limit (a malformed frame ends
//! that stream), and expert streams from admitted clients.

use std::sync::Arc;
use std::time::Duration;

use tessera_net::{measure_link, Connection, Endpoint, FrameWriter, LinkMeasurement, Liveness};
use tokio::sync::mpsc;

use crate::error::FabricError;
use tessera_proto::{frame, limits, stream, NodeToCoord, RingToken, StepHeader};

use super::experts::{link_experts, serve_experts};
use super::hop_ledger::Arrival;
use super::stage_thread::WorkerMsg;
use super::{DataLink, EpochAction, EpochEvent, Shared};

/// Where the stage's ring outputs go.
pub(super) enum RingOut {
    /// A one-stage ring: tokens come straight back to this stage.
    Loopback,
    /// Frames for the next stage, written to its stream by a task on the agent's runtime
    /// ([`RingOut::stream`]). The stage thread only queues them. Written from the stage
    /// thread (through `Handle::block_on`), the write woke the connection's driver from
    /// outside the runtime; the likely cost (not confirmed: the queue send alone still reads
    /// 60–140 µs, so scheduling may be most of it) is that wake under the connection's lock,
    /// which from a worker is a push onto its own queue with the driver running right after.
    /// `tessera lab hop`, interleaved runs on the loaded 2-core VM: a hop added 112 → 79 µs
    /// (medians of 8 and 9 runs) on a 0.5 ms link, 143 → 99 µs on loopback. The queue is
    /// bounded, so QUIC flow control still holds the stage thread back.
    Stream(mpsc::Sender<(u16, Vec<u8>)>),
}

/// Frames queued for the next stage before the stage thread waits: a few prefill chunks.
const RING_QUEUE: usize = 4;

/// How long a worker waits for an expert stream's first frame (its epoch): the home writes it
/// as it opens the stream.
const EXPERT_EPOCH_WAIT: Duration = Duration::from_secs(5);

impl RingOut {
    /// A writer task for `writer` on the current runtime, and the stage thread's end of it.
    pub(super) fn stream(mut writer: FrameWriter<tessera_net::quinn::SendStream>) -> Self {
        let (tx, mut rx) = mpsc::channel::<(u16, Vec<u8>)>(RING_QUEUE);
        tokio::spawn(async move {
            while let Some((kind, payload)) = rx.recv().await {
                if let Err(e) = writer.write_frame(kind, &payload).await {
                    tracing::warn!("ring stream to the next stage: {e}");
                    break;
                }
            }
        });
        Self::Stream(tx)
    }

    /// Queues one frame for the next stage; false if the stream is gone.
    pub(super) fn send(&mut self, kind: u16, payload: Vec<u8>) -> bool {
        match self {
            Self::Stream(tx) => tx.blocking_send((kind, payload)).is_ok(),
            Self::Loopback => false,
        }
    }
}

/// How a data link (ring or expert) notices that its peer stopped answering, mid-epoch.
///
/// QUIC's idle timeout, shortened on data links only: the link is declared lost once *nothing*
/// has arrived from the peer for this long — no data, and not even an acknowledgement of ours
/// or an answer to a keep-alive, which the dialer sends every second so that a quiet ring (no
/// sequence running) is never idle. This is the choice over a per-step deadline on the peer's
/// reply: how long a step may take depends on the peer's compute, its batch, the stages after
/// it and the link's bandwidth, and a deadline derived from those fires on a slow but live
/// link or a busy peer; acknowledgements flow on a slow link as long as it carries anything,
/// so only a link (or a peer) that went silent trips this. QUIC also never lets the timeout
/// fall below three probe timeouts, so a high-latency link gets more. Both ends use it (QUIC
/// takes the smaller of the two sides' timeouts), and both report the loss. The control
/// link to the coordinator keeps the endpoint's longer timeout: its loss is the lease's
/// business.
pub(super) const DATA_LINK_LIVENESS: Liveness = Liveness {
    idle_timeout: Duration::from_secs(5),
    keep_alive: Duration::from_secs(1),
};

/// Reports a data link of `epoch` lost while that epoch is still this node's
/// ([`NodeToCoord::LinkFailed`], naming the peer): the coordinator fails the epoch and plans
/// around the pair. A link closed on purpose (an epoch released here or at the peer, a node
/// shutting down) is not a failure; nor is any loss once a newer epoch was assigned.
pub(super) fn report_lost_link(
    shared: &Shared,
    epoch: u64,
    link: DataLink,
    peer: tessera_net::NodeId,
    error: &dyn std::fmt::Display,
) {
    let lost = EpochEvent::LinkLost { epoch, link, peer };
    shared.handle_epochs(lost, |_, action| {
        if let EpochAction::ReportLinkLost { epoch, link, peer } = action {
            tracing::warn!(
                event = "link_lost",
                epoch,
                peer = %peer,
                link = ?link,
                error = %error,
                "epoch {epoch}: {link} ({}) is lost: {error}",
                peer.short()
            );
            let _ = shared.ctrl.send(NodeToCoord::LinkFailed {
                epoch,
                reason: format!("{link} ({}) is lost: {error}", peer.short()),
                peer: Some(peer),
            });
        }
    });
}

/// Watches a data link this node dialled for `epoch` and reports its loss.
fn watch_link(conn: Connection, epoch: u64, link: DataLink, shared: Arc<Shared>) {
    tokio::spawn(async move {
        let e = conn.quinn().closed().await;
        use tessera_net::quinn::ConnectionError::{ApplicationClosed, LocallyClosed};
        if !matches!(e, LocallyClosed | ApplicationClosed(_)) {
            report_lost_link(&shared, epoch, link, conn.peer_id(), &e);
        }
    });
}

/// A data link of an epoch that could not be made, and to whom.
#[derive(Debug)]
pub(super) struct LinkUpFailed {
    /// The node at the other end (`None`: the failure was not a link's).
    pub(super) peer: Option<tessera_net::NodeId>,
    pub(super) error: FabricError,
}

impl LinkUpFailed {
    /// The epoch went while its links were made.
    pub(super) fn released(epoch: u64) -> Self {
        Self {
            peer: None,
            error: FabricError::Stopped(format!("epoch {epoch} was released while it linked")),
        }
    }

    pub(super) fn to(peer: tessera_net::NodeId) -> impl FnOnce(FabricError) -> Self {
        move |error| Self {
            peer: Some(peer),
            error,
        }
    }
}

/// Keeps `conn`, a data link of `epoch` just made, and watches it, if the epoch is still
/// installed; else closes it (the epoch went while it linked) and says so. A new ring link of
/// an epoch replaces its old one.
pub(super) fn keep_link(
    shared: &Arc<Shared>,
    epoch: u64,
    link: DataLink,
    conn: &Connection,
) -> bool {
    let mut kept = false;
    shared.handle_epochs(EpochEvent::LinkUp { epoch }, |g, action| match action {
        EpochAction::KeepLink { .. } => {
            if matches!(link, DataLink::RingToNext) {
                g.links
                    .retain(|(e, l, _)| !(*e == epoch && matches!(l, DataLink::RingToNext)));
            }
            g.links.push((epoch, link, conn.clone()));
            kept = true;
        }
        EpochAction::DropLink { .. } => conn.close("epoch released"),
        _ => {}
    });
    if kept {
        watch_link(conn.clone(), epoch, link, shared.clone());
    }
    kept
}

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
        assert!(err.to_string().contains("exceeds"), "{err}");
    }
}
