//! Where the stage's ring outputs go: back to this stage (a one-stage ring), or queued for a
//! writer task that sends them to the next stage. The stage thread holds one per installed
//! epoch; the ring module makes them when it links.

use tessera_net::FrameWriter;
use tokio::sync::mpsc;

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
