//! Handshakes against forged certificates, over real sockets. These need crate internals to
//! build certificates that the public API never produces.

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;
use tokio::sync::mpsc;

use crate::tls::{self, certificate_with_name, node_certificate, node_dns_name};
use crate::{AllowList, Endpoint, EndpointConfig, ExpectedPeer, NetError, NodeIdentity};

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// `cert` presented, handshakes signed by `signer`'s key (no check that they match).
fn forged(
    cert: rustls::pki_types::CertificateDer<'static>,
    signer: &NodeIdentity,
) -> Arc<CertifiedKey> {
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(signer.pkcs8_der()));
    let signing = tls::provider().key_provider.load_private_key(key).unwrap();
    Arc::new(CertifiedKey::new(vec![cert], signing))
}

fn genuine(id: &NodeIdentity) -> Arc<CertifiedKey> {
    let (c, k) = node_certificate(id).unwrap();
    tls::certified_key(c, k).unwrap()
}

/// Binds `certified` as the endpoint's certificate, with `allow` as policy, and reports the
/// outcome of every inbound handshake.
fn serve(
    public: crate::PublicKey,
    certified: Arc<CertifiedKey>,
    allow: Arc<AllowList>,
) -> (SocketAddr, mpsc::UnboundedReceiver<Result<(), NetError>>) {
    let ep = Endpoint::bind_with_cert(
        any_port(),
        public,
        certified,
        allow,
        EndpointConfig::default(),
    )
    .unwrap();
    let addr = ep.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(inc) = ep.accept().await {
            let r = inc.handshake().await.map(|_| ());
            let _ = tx.send(r);
        }
    });
    (addr, rx)
}

async fn server_error(rx: &mut mpsc::UnboundedReceiver<Result<(), NetError>>) -> String {
    match rx.recv().await.unwrap() {
        Err(NetError::Handshake { reason, .. }) => reason,
        r => panic!("expected a server-side handshake failure, got {r:?}"),
    }
}

#[tokio::test]
async fn known_node_id_presented_with_another_key_is_refused() {
    let server = NodeIdentity::generate().unwrap();
    let enrolled = NodeIdentity::generate().unwrap();
    let allow = Arc::new(AllowList::new());
    allow.insert(enrolled.public_key());
    let (addr, mut rx) = serve(server.public_key(), genuine(&server), allow.clone());

    // The attacker's certificate claims the enrolled node's id but carries the attacker's key.
    let attacker = NodeIdentity::generate().unwrap();
    let (cert, _) = certificate_with_name(&attacker, &node_dns_name(&enrolled.node_id())).unwrap();
    let ep = Endpoint::bind_with_cert(
        any_port(),
        attacker.public_key(),
        forged(cert, &attacker),
        Arc::new(AllowList::new()),
        EndpointConfig::default(),
    )
    .unwrap();
    let r = ep.connect(addr, server.public_key()).await;
    assert!(matches!(r, Err(NetError::Handshake { .. })), "{r:?}");
    let reason = server_error(&mut rx).await;
    assert!(reason.contains("not bound to its key"), "{reason}");

    // The same attacker with an honest certificate is simply unknown.
    let ep2 = Endpoint::bind(any_port(), &attacker, AllowList::new()).unwrap();
    assert!(ep2.connect(addr, server.public_key()).await.is_err());
    let reason = server_error(&mut rx).await;
    assert!(reason.contains("unknown node key"), "{reason}");
}

#[tokio::test]
async fn stolen_client_certificate_without_its_secret_key_fails_signature_check() {
    let server = NodeIdentity::generate().unwrap();
    let enrolled = NodeIdentity::generate().unwrap();
    let allow = Arc::new(AllowList::new());
    allow.insert(enrolled.public_key());
    let (addr, mut rx) = serve(server.public_key(), genuine(&server), allow);

    // The enrolled node's genuine certificate (public), but handshakes signed by another key.
    let attacker = NodeIdentity::generate().unwrap();
    let (cert, _) = node_certificate(&enrolled).unwrap();
    let ep = Endpoint::bind_with_cert(
        any_port(),
        enrolled.public_key(),
        forged(cert, &attacker),
        Arc::new(AllowList::new()),
        EndpointConfig::default(),
    )
    .unwrap();
    let r = ep.connect(addr, server.public_key()).await;
    assert!(matches!(r, Err(NetError::Handshake { .. })), "{r:?}");
    let reason = server_error(&mut rx).await;
    assert!(reason.to_lowercase().contains("signature"), "{reason}");
}

#[tokio::test]
async fn server_certificate_not_bound_to_claimed_key_fails() {
    let client_id = NodeIdentity::generate().unwrap();
    let allow = Arc::new(AllowList::new());
    allow.insert(client_id.public_key());
    let client = Endpoint::bind(any_port(), &client_id, AllowList::new()).unwrap();

    // The server claims to be `claimed` (by name) while its certificate carries its own key.
    let server = NodeIdentity::generate().unwrap();
    let claimed = NodeIdentity::generate().unwrap();
    let (cert, _) = certificate_with_name(&server, &node_dns_name(&claimed.node_id())).unwrap();
    let (addr, _rx) = serve(server.public_key(), forged(cert, &server), allow.clone());
    for expected in [
        ExpectedPeer::Id(claimed.node_id()),
        ExpectedPeer::Key(server.public_key()),
        ExpectedPeer::Unpinned,
    ] {
        match client.connect(addr, expected).await {
            Err(NetError::Handshake { reason, .. }) => {
                assert!(reason.contains("not bound to its key"), "{reason}")
            }
            r => panic!("expected a handshake failure, got {r:?}"),
        }
    }

    // A server presenting the expected key's genuine certificate without its secret key.
    let victim = NodeIdentity::generate().unwrap();
    let (cert, _) = node_certificate(&victim).unwrap();
    let (addr, _rx) = serve(victim.public_key(), forged(cert, &server), allow);
    match client.connect(addr, victim.public_key()).await {
        Err(NetError::Handshake { reason, .. }) => {
            assert!(reason.to_lowercase().contains("signature"), "{reason}")
        }
        r => panic!("expected a handshake failure, got {r:?}"),
    }
}
