//! The stage ring: where the stage's ring outputs go ([`RingOut`]), linking to the next stage
//! (dial, measure the link, open the ring stream), and serving connections from other nodes —
//! ring streams from the current previous stage, read with a size limit (a malformed frame ends
//! that stream), and expert streams from admitted clients.

use std::sync::Arc;

use tessera_net::{measure_link, Connection, Endpoint, FrameWriter, LinkMeasurement};
use tokio::sync::mpsc;

use crate::error::FabricError;
use crate::protocol::{frame, limits, stream, RingToken, StepHeader};

use super::experts::{link_experts, serve_experts};
use super::stage_thread::WorkerMsg;
use super::Shared;

/// Where the stage's ring outputs go.
pub(super) enum RingOut {
    /// A one-stage ring: tokens come straight back to this stage.
    Loopback,
    /// The stream to the next stage, written by the stage thread itself (no hand-off to
    /// another thread on the hot path; QUIC flow control is the back-pressure), driven by the
    /// agent's runtime.
    Stream(
        Box<FrameWriter<tessera_net::quinn::SendStream>>,
        tokio::runtime::Handle,
    ),
}

impl RingOut {
    /// Writes one frame to the next stage; false if the stream is gone.
    pub(super) fn send(&mut self, kind: u16, payload: &[u8]) -> bool {
        match self {
            Self::Stream(w, rt) => match rt.block_on(w.write_frame(kind, payload)) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!("ring stream to the next stage: {e}");
                    false
                }
            },
            Self::Loopback => false,
        }
    }
}

/// Connects to the next stage of the current epoch, measures the link, opens the ring stream.
pub(super) async fn link_next(
    epoch: u64,
    endpoint: &Endpoint,
    shared: &Shared,
) -> Result<Option<LinkMeasurement>, FabricError> {
    let a = shared
        .current
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map(|c| c.assignment.clone())
        .filter(|a| a.epoch == epoch)
        .ok_or_else(|| {
            FabricError::Protocol(format!("link for epoch {epoch}, which is not loaded"))
        })?;
    link_experts(epoch, endpoint, shared).await?;
    let Some(next) = a.next else {
        let _ = shared
            .worker
            .send(WorkerMsg::Ring(epoch, RingOut::Loopback));
        return Ok(None);
    };
    let conn = endpoint.connect(next.addr, next.key).await?;
    let link = measure_link(&conn, 8, 1 << 20).await?;
    let mut s = conn.open_stream(stream::RING).await?;
    s.reader.set_max_len(limits::RING);
    *shared.next_conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn);
    let out = RingOut::Stream(Box::new(s.writer), tokio::runtime::Handle::current());
    let _ = shared.worker.send(WorkerMsg::Ring(epoch, out));
    Ok(Some(link))
}

/// Serves a connection from another node: ring streams from the current previous stage.
pub(super) async fn serve_peer(conn: Connection, shared: Arc<Shared>) {
    loop {
        let mut s = match conn.accept_stream().await {
            Ok(Some(s)) => s,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("peer {}: {e}", conn.peer_id().short());
                return;
            }
        };
        let cur = shared
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if s.kind == stream::EXPERT {
            let serving = shared
                .experts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .filter(|e| {
                    e.assignment
                        .clients
                        .iter()
                        .any(|c| c.key == conn.peer_key())
                })
                .and_then(|e| e.model);
            match serving {
                Some(model) => {
                    let peer = conn.peer_id();
                    tokio::spawn(async move {
                        if let Err(e) = serve_experts(s, model).await {
                            tracing::warn!("expert stream from {}: {e}; closing it", peer.short());
                        }
                    });
                }
                None => {
                    tracing::info!(
                        "peer {}: refusing an expert stream (no experts served to it)",
                        conn.peer_id().short()
                    );
                    let _ = s.writer.finish().await;
                }
            }
            continue;
        }
        let expected = cur
            .as_ref()
            .and_then(|c| c.assignment.prev.as_ref())
            .is_some_and(|p| p.key == conn.peer_key());
        if s.kind != stream::RING || !expected {
            tracing::info!(
                "peer {}: refusing a stream of kind {:#06x}",
                conn.peer_id().short(),
                s.kind
            );
            let _ = s.writer.finish().await;
            continue;
        }
        let n_embd = cur.map_or(0, |c| c.n_embd);
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
                let (h, d) = StepHeader::decode(&f.payload, n_embd)?;
                WorkerMsg::Hidden(h, d)
            }
            frame::TOKEN => WorkerMsg::Token(RingToken::decode(&f.payload)?),
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
    use crate::protocol::StepEntry;
    use tessera_net::frame::FrameWriter;

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
        assert!(matches!(rx.try_recv(), Ok(WorkerMsg::Token(_))));
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
