//! Data links of an epoch (the ring to the next stage, expert links to workers): how their
//! loss is noticed and reported, and how a link just made is kept only while its epoch is
//! installed. Both the ring and the expert split make them.

use std::sync::Arc;
use std::time::Duration;

use tessera_net::{Connection, Liveness};

use crate::error::FabricError;
use tessera_proto::NodeToCoord;

use super::shared::Shared;
use super::{DataLink, EpochAction, EpochEvent};

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
