//! TLS 1.3 with certificates bound to node keys, and the verifiers that pin them.
//!
//! Every endpoint presents a self-signed X.509 certificate whose subject public key is its
//! ed25519 node key and whose only subject alternative name is `<node id>.tessera`. No CA is
//! involved: a client accepts a server only if the certificate's key is the one it expects
//! ([`ExpectedPeer`]); a server accepts a client only if its [`PeerPolicy`] says so. The TLS 1.3
//! `CertificateVerify` signature is always checked against the certificate's key with rustls's
//! webpki helpers, so presenting someone else's certificate does not work without their secret.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::ParsedCertificate;
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::error::{NetError, Refusal};
use crate::identity::{NodeId, NodeIdentity, PublicKey};

/// ALPN protocol id; a peer speaking anything else fails the handshake.
pub const ALPN: &[u8] = b"tessera/1";
/// DNS suffix of the name a node certificate is issued for: `<node id>.tessera`.
pub const NAME_SUFFIX: &str = "tessera";

/// Whom a dialing client is willing to talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpectedPeer {
    /// Exactly this key (pinned). The normal case.
    Key(PublicKey),
    /// Any key whose node id is this one (e.g. the coordinator id carried in a join token).
    Id(NodeId),
    /// Any well-formed node certificate. Only for enrolment with a token that names no
    /// coordinator: trust on first use. The enrolment proof is bound to this TLS session and to
    /// the server's key, so a man in the middle cannot replay it to the real coordinator.
    Unpinned,
}

impl From<PublicKey> for ExpectedPeer {
    fn from(k: PublicKey) -> Self {
        Self::Key(k)
    }
}

impl From<NodeId> for ExpectedPeer {
    fn from(id: NodeId) -> Self {
        Self::Id(id)
    }
}

/// How a server-side [`PeerPolicy`] admits a client key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// An enrolled node: the connection is a full peer connection.
    Member,
    /// An unknown key that may only enrol: the connection is handed to the caller as an
    /// [`EnrolmentRequest`](crate::EnrolmentRequest) and is useless until it proves a join token.
    Enrolment,
}

/// The server's decision on which client keys to let through the TLS handshake.
///
/// Called during every inbound handshake (and once more right after it) with the key from the
/// client's certificate, after the certificate has been checked to be bound to that key. The
/// coordinator implements this over its enrolment records; [`AllowList`] is a ready-made one.
/// Closures `Fn(&PublicKey) -> Result<Admission, Refusal>` implement it too.
pub trait PeerPolicy: Send + Sync + 'static {
    /// Admit `peer` as a member or for enrolment only, or refuse it.
    fn allow(&self, peer: &PublicKey) -> Result<Admission, Refusal>;
}

impl fmt::Debug for dyn PeerPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PeerPolicy")
    }
}

impl<F> PeerPolicy for F
where
    F: Fn(&PublicKey) -> Result<Admission, Refusal> + Send + Sync + 'static,
{
    fn allow(&self, peer: &PublicKey) -> Result<Admission, Refusal> {
        self(peer)
    }
}

/// A thread-safe set of enrolled keys, with a switch for admitting unknown keys to enrolment.
#[derive(Debug, Default)]
pub struct AllowList {
    inner: std::sync::RwLock<AllowListInner>,
}

#[derive(Debug, Default)]
struct AllowListInner {
    keys: std::collections::HashMap<NodeId, PublicKey>,
    enrolment_open: bool,
}

impl AllowList {
    /// An empty list with enrolment closed: everyone is refused.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `key` as enrolled.
    pub fn insert(&self, key: PublicKey) {
        self.write().keys.insert(key.node_id(), key);
    }

    /// Forgets a node; it will be refused (or sent to enrolment, if open).
    pub fn remove(&self, id: &NodeId) -> Option<PublicKey> {
        self.write().keys.remove(id)
    }

    /// Whether `key` is enrolled.
    pub fn contains(&self, key: &PublicKey) -> bool {
        self.read().keys.get(&key.node_id()) == Some(key)
    }

    /// Opens or closes enrolment for unknown keys.
    pub fn set_enrolment_open(&self, open: bool) {
        self.write().enrolment_open = open;
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, AllowListInner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, AllowListInner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }
}

impl PeerPolicy for AllowList {
    fn allow(&self, peer: &PublicKey) -> Result<Admission, Refusal> {
        let g = self.read();
        let id = peer.node_id();
        match g.keys.get(&id) {
            Some(k) if k == peer => Ok(Admission::Member),
            Some(_) => Err(Refusal::KeyMismatch { id }),
            None if g.enrolment_open => Ok(Admission::Enrolment),
            None => Err(Refusal::Unknown(id)),
        }
    }
}

impl<P: PeerPolicy + ?Sized> PeerPolicy for Arc<P> {
    fn allow(&self, peer: &PublicKey) -> Result<Admission, Refusal> {
        (**self).allow(peer)
    }
}

/// The DNS name a node's certificate is issued for.
pub fn node_dns_name(id: &NodeId) -> String {
    format!("{id}.{NAME_SUFFIX}")
}

/// A self-signed certificate for `identity`, and its secret key, for rustls.
pub fn node_certificate(
    identity: &NodeIdentity,
) -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>), NetError> {
    certificate_with_name(identity, &node_dns_name(&identity.node_id()))
}

/// Like [`node_certificate`] but issued for an arbitrary name: lets tests forge a certificate
/// that claims another node's id.
pub(crate) fn certificate_with_name(
    identity: &NodeIdentity,
    dns_name: &str,
) -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>), NetError> {
    let setup = |e: rcgen::Error| NetError::TlsSetup(format!("certificate: {e}"));
    let pkcs8 = PrivatePkcs8KeyDer::from(identity.pkcs8_der());
    let key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &rcgen::PKCS_ED25519)
        .map_err(setup)?;
    let mut params = rcgen::CertificateParams::new(vec![dns_name.to_string()]).map_err(setup)?;
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(rcgen::DnType::CommonName, identity.node_id().to_string());
    params.distinguished_name = dn;
    let cert = params.self_signed(&key).map_err(setup)?;
    Ok((cert.der().clone(), PrivateKeyDer::Pkcs8(pkcs8)))
}

/// Extracts the node key from a peer certificate and checks the certificate is bound to it:
/// a well-formed X.509 certificate, an ed25519 subject key, valid for `<id of that key>.tessera`.
pub fn certificate_key(cert: &CertificateDer<'_>) -> Result<PublicKey, CertError> {
    let parsed =
        ParsedCertificate::try_from(cert).map_err(|e| CertError::Malformed(e.to_string()))?;
    let spki = parsed.subject_public_key_info();
    let key = PublicKey::from_spki_der(spki.as_ref()).ok_or(CertError::NotEd25519)?;
    let name = ServerName::try_from(node_dns_name(&key.node_id()))
        .map_err(|e| CertError::Malformed(e.to_string()))?;
    rustls::client::verify_server_name(&parsed, &name)
        .map_err(|_| CertError::NotBoundToKey(key.node_id()))?;
    Ok(key)
}

/// Why a peer certificate was rejected.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertError {
    /// Not parseable as an X.509 certificate.
    #[error("malformed certificate: {0}")]
    Malformed(String),
    /// The subject key is not ed25519.
    #[error("certificate key is not ed25519")]
    NotEd25519,
    /// The certificate's name is not the node id of its key.
    #[error("certificate is not bound to its key (not issued for node {0})")]
    NotBoundToKey(NodeId),
    /// More than one certificate was presented.
    #[error("certificate chains are not accepted, only a single self-signed node certificate")]
    Chain,
    /// The key is not the pinned one.
    #[error("peer key {got} is not the pinned key {expected}")]
    NotPinnedKey {
        /// The pinned key.
        expected: PublicKey,
        /// The presented key.
        got: PublicKey,
    },
    /// The key's node id is not the expected one.
    #[error("peer node {got} is not the expected node {expected}")]
    NotExpectedId {
        /// The expected id.
        expected: NodeId,
        /// The presented key's id.
        got: NodeId,
    },
    /// The server's policy refused the key.
    #[error("refused by policy: {0}")]
    Refused(Refusal),
}

// rustls shows the inner error with `Debug`; make that the readable message.
impl fmt::Debug for CertError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

fn cert_err(e: CertError) -> rustls::Error {
    rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(e))))
}

/// The ring crypto provider restricted to what Tessera uses.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn algorithms() -> WebPkiSupportedAlgorithms {
    rustls::crypto::ring::default_provider().signature_verification_algorithms
}

fn verify_tls13(
    message: &[u8],
    cert: &CertificateDer<'_>,
    dss: &DigitallySignedStruct,
    algs: &WebPkiSupportedAlgorithms,
) -> Result<HandshakeSignatureValid, rustls::Error> {
    if dss.scheme != SignatureScheme::ED25519 {
        return Err(rustls::PeerMisbehaved::SignedHandshakeWithUnadvertisedSigScheme.into());
    }
    rustls::crypto::verify_tls13_signature(message, cert, dss, algs)
}

fn no_tls12() -> rustls::Error {
    rustls::Error::PeerIncompatible(rustls::PeerIncompatible::Tls13RequiredForQuic)
}

/// Client side: accepts the server only if its certificate carries the expected key.
pub(crate) struct PinnedServerVerifier {
    expected: ExpectedPeer,
    algs: WebPkiSupportedAlgorithms,
}

impl PinnedServerVerifier {
    pub(crate) fn new(expected: ExpectedPeer) -> Self {
        Self {
            expected,
            algs: algorithms(),
        }
    }
}

impl fmt::Debug for PinnedServerVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedServerVerifier")
            .field("expected", &self.expected)
            .finish()
    }
}

impl ServerCertVerifier for PinnedServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if !intermediates.is_empty() {
            return Err(cert_err(CertError::Chain));
        }
        let got = certificate_key(end_entity).map_err(cert_err)?;
        match self.expected {
            ExpectedPeer::Key(expected) if expected != got => {
                Err(cert_err(CertError::NotPinnedKey { expected, got }))
            }
            ExpectedPeer::Id(expected) if expected != got.node_id() => {
                Err(cert_err(CertError::NotExpectedId {
                    expected,
                    got: got.node_id(),
                }))
            }
            _ => Ok(ServerCertVerified::assertion()),
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(no_tls12())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

/// Server side: mandatory client certificates, admitted by a [`PeerPolicy`].
pub(crate) struct PolicyClientVerifier {
    policy: Arc<dyn PeerPolicy>,
    algs: WebPkiSupportedAlgorithms,
}

impl PolicyClientVerifier {
    pub(crate) fn new(policy: Arc<dyn PeerPolicy>) -> Self {
        Self {
            policy,
            algs: algorithms(),
        }
    }
}

impl fmt::Debug for PolicyClientVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PolicyClientVerifier")
    }
}

impl ClientCertVerifier for PolicyClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        if !intermediates.is_empty() {
            return Err(cert_err(CertError::Chain));
        }
        let key = certificate_key(end_entity).map_err(cert_err)?;
        self.policy
            .allow(&key)
            .map_err(|r| cert_err(CertError::Refused(r)))?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(no_tls12())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

/// Our certificate and signing key, checked to belong together.
pub(crate) fn certified_key(
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<CertifiedKey>, NetError> {
    CertifiedKey::from_der(vec![cert], key, &provider())
        .map(Arc::new)
        .map_err(|e| NetError::TlsSetup(e.to_string()))
}

/// rustls client config: TLS 1.3 only, our certificate, the pinning verifier.
pub(crate) fn client_config(
    ours: &Arc<CertifiedKey>,
    expected: ExpectedPeer,
) -> Result<rustls::ClientConfig, NetError> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| NetError::TlsSetup(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedServerVerifier::new(expected)))
        .with_client_cert_resolver(Arc::new(SingleCertAndKey::from(ours.clone())));
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// rustls server config: TLS 1.3 only, our certificate, mandatory client auth by policy.
pub(crate) fn server_config(
    ours: &Arc<CertifiedKey>,
    policy: Arc<dyn PeerPolicy>,
) -> Result<rustls::ServerConfig, NetError> {
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| NetError::TlsSetup(e.to_string()))?
        .with_client_cert_verifier(Arc::new(PolicyClientVerifier::new(policy)))
        .with_cert_resolver(Arc::new(SingleCertAndKey::from(ours.clone())));
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificate_is_bound_to_node_key() {
        let id = NodeIdentity::generate().unwrap();
        let (cert, _) = node_certificate(&id).unwrap();
        assert_eq!(certificate_key(&cert).unwrap(), id.public_key());

        let other = NodeIdentity::generate().unwrap();
        let (forged, _) = certificate_with_name(&id, &node_dns_name(&other.node_id())).unwrap();
        assert_eq!(
            certificate_key(&forged),
            Err(CertError::NotBoundToKey(id.node_id()))
        );
        assert!(matches!(
            certificate_key(&CertificateDer::from(vec![0x30, 0x03, 1, 2, 3])),
            Err(CertError::Malformed(_))
        ));
    }

    #[test]
    fn allow_list_decisions() {
        let a = NodeIdentity::generate().unwrap().public_key();
        let b = NodeIdentity::generate().unwrap().public_key();
        let list = AllowList::new();
        list.insert(a);
        assert_eq!(list.allow(&a), Ok(Admission::Member));
        assert_eq!(list.allow(&b), Err(Refusal::Unknown(b.node_id())));
        list.set_enrolment_open(true);
        assert_eq!(list.allow(&b), Ok(Admission::Enrolment));
        assert!(list.contains(&a) && !list.contains(&b));
    }
}
