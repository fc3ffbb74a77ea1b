//! Who a request counts against, and the refusal when it holds its share: part of
//! [`SubmitError`](crate::SubmitError). The rule that decides it is the gateway's fair
//! admission (`tessera_gateway::admission`).

use std::net::IpAddr;
use std::sync::Arc;

/// Who a request counts against.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ClientId {
    /// The name of the API key it presented.
    Key(Arc<str>),
    /// Where it came from, when the server has no keys.
    Address(IpAddr),
    /// A router served without the gateway's `serve` (tests, embedders): no address known.
    Unknown,
}

impl std::fmt::Display for ClientId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Key(name) => write!(f, "key {name}"),
            Self::Address(ip) => write!(f, "address {ip}"),
            Self::Unknown => f.write_str("an unidentified client"),
        }
    }
}

/// Refused: the client holds its share, or everything is taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverShare {
    pub client: ClientId,
    pub held: usize,
    pub share: usize,
    /// Sequences the server holds for everyone, running and queued.
    pub capacity: usize,
}

impl std::fmt::Display for OverShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the request queue is shared fairly: {} holds {} of this server's {} places \
             (running and queued), its share now being {}; retry when one of them finishes",
            self.client, self.held, self.capacity, self.share
        )
    }
}
