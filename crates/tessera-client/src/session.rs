//! A client's control session with a coordinator: enrol (or reconnect) as a client, say hello,
//! then exchange `tessera_proto`'s client messages. `tessera run --coordinator`, `tessera token`
//! and the sealing client each open one; what they print stays with them.

use std::net::SocketAddr;

use tessera_net::{Connection, Endpoint, FramedStream, JoinToken, NodeIdentity};
use tessera_proto::{
    frame, limits, stream, ClientToCoord, CoordToClient, Hello, Role, PROTOCOL_VERSION,
};

use crate::error::ClientError;

/// Enrols (or reconnects) as a client and opens a control session past the coordinator's
/// welcome: the endpoint, the connection and the session's stream.
pub async fn connect_client(
    identity: &NodeIdentity,
    addr: SocketAddr,
    token: &JoinToken,
) -> Result<(Endpoint, Connection, FramedStream), ClientError> {
    let bind: SocketAddr = if addr.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let endpoint = Endpoint::bind(bind, identity, tessera_net::AllowList::new())?;
    let conn = endpoint.enroll(addr, token).await?;
    let mut s = conn.open_stream(stream::CONTROL).await?;
    s.reader.set_max_len(limits::CONTROL);
    s.writer
        .write_message(
            frame::MSG,
            &ClientToCoord::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                role: Role::Client,
                name: format!("client-{}", identity.node_id().short()),
                inventory: None,
                memory_budget_bytes: None,
                models: Vec::new(),
            }),
        )
        .await?;
    match s.reader.read_message::<CoordToClient>(frame::MSG).await? {
        CoordToClient::Welcome { .. } => Ok((endpoint, conn, s)),
        CoordToClient::Refused { reason } => Err(ClientError::Protocol(format!(
            "the coordinator refused this client: {reason}"
        ))),
        other => Err(ClientError::Protocol(format!(
            "unexpected first message {other:?}"
        ))),
    }
}

/// One open control session: send requests, read what the coordinator says, close.
pub struct ClusterSession {
    endpoint: Endpoint,
    conn: Connection,
    stream: FramedStream,
}

impl ClusterSession {
    /// Connects past the coordinator's welcome ([`connect_client`]).
    pub async fn connect(
        identity: &NodeIdentity,
        addr: SocketAddr,
        token: &JoinToken,
    ) -> Result<Self, ClientError> {
        let (endpoint, conn, stream) = connect_client(identity, addr, token).await?;
        Ok(Self {
            endpoint,
            conn,
            stream,
        })
    }

    /// Sends one message (a run, an admin request...).
    pub async fn send(&mut self, msg: &ClientToCoord) -> Result<(), ClientError> {
        Ok(self.stream.writer.write_message(frame::MSG, msg).await?)
    }

    /// The coordinator's next message.
    pub async fn next(&mut self) -> Result<CoordToClient, ClientError> {
        Ok(self.stream.reader.read_message(frame::MSG).await?)
    }

    /// Ends the session: finishes the stream and closes the connection and the endpoint.
    pub async fn close(mut self) {
        let _ = self.stream.writer.finish().await;
        self.conn.close("done");
        self.endpoint.close();
    }
}
