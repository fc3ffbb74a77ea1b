//! The desk's edge: the wall clock, client sessions' outboxes, node sessions, and the test-only
//! faults of a coordinator that misbehaves.

use std::collections::HashMap;

use tessera_net::NodeId;
use tessera_proto::{CoordToClient, CoordToNode, NodeToCoord};
use tessera_seal::{KeyId, LeaseConfig, NodeKey, UnixMillis};
use tokio::sync::mpsc;

use super::{verify_config, ClientId, SealedConfig, SealedDesk, SealedInput, SealedOutput};

/// A coordinator that misbehaves on purpose, so tests can show what the workers make of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SealedFault {
    /// Re-address each envelope to another worker (or an unknown key) and deliver it there.
    RewriteRecipient,
    /// Push each envelope's expiry an hour later.
    RewriteTtl,
    /// Deliver each envelope twice.
    Replay,
    /// List a worker of the coordinator's own making first among the holders: a node key and a
    /// sealing key it holds, claims signed with it, vouched for by no operator.
    ListOwnWorker,
}

impl std::str::FromStr for SealedFault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "rewrite-recipient" => Ok(Self::RewriteRecipient),
            "rewrite-ttl" => Ok(Self::RewriteTtl),
            "replay" => Ok(Self::Replay),
            "list-own-worker" => Ok(Self::ListOwnWorker),
            _ => Err(format!(
                "unknown fault {s:?} (rewrite-recipient, rewrite-ttl, replay or list-own-worker)"
            )),
        }
    }
}

/// How the coordinator treats sealed jobs.
#[derive(Clone, Debug, Default)]
pub struct SealedSettings {
    /// Share of answers re-run on a second worker, in thousandths, for every device tier
    /// (`None`: each tier's own rate).
    pub verify_per_mille: Option<u32>,
    pub fault: Option<SealedFault>,
    /// Where submitted job ids are kept across restarts (`sealed.redb`); `None`: in memory
    /// only.
    pub data_dir: Option<std::path::PathBuf>,
}

/// What the desk's edge needs of the coordinator around it: its own state, the desk (which
/// the cluster owns), the node sessions it sends envelopes on, and the members' names for its
/// log lines. The coordinator's core implements it (`shared.rs`, on the one task that owns
/// both); the edge names no type of the shell, so the layers read bottom-up.
pub(crate) trait SealedHost {
    /// The clients' outboxes, the faults and the job ids seen.
    fn edge(&mut self) -> &mut SealedEdge;
    /// The desk, to read or to take claims.
    fn desk(&mut self) -> &mut SealedDesk;
    /// Feeds the desk through the cluster; the desk's outputs come back to [`carry_out`].
    fn feed(&mut self, input: SealedInput);
    /// Sends `msg` on node `to`'s control session; false when it has none.
    fn send(&mut self, to: NodeId, msg: CoordToNode) -> bool;
    /// Node `id`'s name in the membership, if it is a member.
    fn member_name(&self, id: &NodeId) -> Option<String>;
}

/// The clients' outboxes, the settings, and what the faults remember.
pub(crate) struct SealedEdge {
    clients: HashMap<ClientId, mpsc::UnboundedSender<CoordToClient>>,
    next_client: ClientId,
    fault: Option<SealedFault>,
    /// [`SealedFault::RewriteRecipient`]: where each re-addressed attempt really went, and
    /// whose it was; the refusal of the node it went to is the job's holder's refusal.
    redirected: HashMap<(tessera_seal::JobId, u32), (NodeKey, NodeKey)>,
    /// Job ids submitted before, kept on disk: a resubmission after a restart is refused.
    seen: Option<super::seen::SeenJobs>,
}

/// A desk for these settings, its verification seeded at random (a worker must not know which
/// answers will be checked).
pub(crate) fn desk(settings: &SealedSettings) -> SealedDesk {
    let mut seed = [0u8; 32];
    seed[..16].copy_from_slice(tessera_seal::JobId::random().as_bytes());
    seed[16..].copy_from_slice(tessera_seal::JobId::random().as_bytes());
    SealedDesk::new(SealedConfig {
        leases: LeaseConfig::default(),
        // Logits are bit-identical across the scalar, AVX2 and AVX-512 kernel paths
        // (tessera-engine's `isa_paths` test), so answers of any two paths compare.
        verify: verify_config(seed, settings.verify_per_mille, true),
        fault: None,
    })
}

impl SealedEdge {
    pub fn new(settings: &SealedSettings) -> Self {
        Self {
            clients: HashMap::new(),
            next_client: 1,
            fault: settings.fault,
            redirected: HashMap::new(),
            seen: settings.data_dir.as_deref().and_then(|d| {
                super::seen::SeenJobs::open(d, UnixMillis::now())
                    .map_err(|e| tracing::warn!("sealed job ids will not survive a restart: {e}"))
                    .ok()
            }),
        }
    }
}

pub(crate) fn node_key(id: &tessera_net::PublicKey) -> NodeKey {
    NodeKey::from_bytes(*id.as_bytes())
}

fn node_id(key: &NodeKey) -> NodeId {
    tessera_net::PublicKey::from_bytes(*key.as_bytes()).node_id()
}

/// A node's name in the membership (its key when it has none).
fn name_of(shared: &impl SealedHost, node: &NodeKey) -> String {
    shared
        .member_name(&node_id(node))
        .unwrap_or_else(|| node.to_string())
}

/// Registers a client session's outbox for sealed news.
pub(crate) fn client_joined(
    shared: &mut impl SealedHost,
    tx: mpsc::UnboundedSender<CoordToClient>,
) -> ClientId {
    let e = shared.edge();
    let id = e.next_client;
    e.next_client += 1;
    e.clients.insert(id, tx);
    id
}

pub(crate) fn client_left(shared: &mut impl SealedHost, client: ClientId) {
    shared.edge().clients.remove(&client);
    shared.feed(SealedInput::ClientLeft { client });
}

/// The workers' current claims for a client.
pub(crate) fn holders(
    shared: &mut impl SealedHost,
    model: Option<&str>,
) -> Vec<tessera_seal::SignedClaims> {
    let mut holders = shared.desk().holders(model);
    if shared.edge().fault == Some(SealedFault::ListOwnWorker) {
        if let Some(own) = holders.first().map(own_worker) {
            holders.insert(0, own);
        }
    }
    holders
}

/// [`SealedFault::ListOwnWorker`]: the claims of a worker the coordinator made up, like
/// `like`'s but with keys of its own (a real attacker would keep the secrets and read what is
/// sealed to them).
fn own_worker(like: &tessera_seal::SignedClaims) -> tessera_seal::SignedClaims {
    let seed = [0x5e; 32];
    let mut c = like.claims.clone();
    c.node = NodeKey::of_seed(&seed);
    c.seal_key = tessera_seal::SecretKey::derive(b"its sealing key").public_key();
    c.epoch = 1;
    c.sign(&seed).expect("valid claims")
}

pub(crate) fn submit(
    shared: &mut impl SealedHost,
    client: ClientId,
    s: tessera_proto::SealedSubmit,
) {
    let now = UnixMillis::now();
    if let Some(first) = s.envelopes.first() {
        let job = first.header.job;
        let e = shared.edge();
        if let Some(seen) = &e.seen {
            if seen.contains(job, now) {
                tracing::info!(
                    event = "sealed_resubmitted",
                    job = %job,
                    "job {job} was submitted before (it is on disk): refused"
                );
                if let Some(tx) = e.clients.get(&client) {
                    let _ = tx.send(CoordToClient::Sealed {
                        job,
                        news: tessera_proto::SealedNews::Failed {
                            reason: tessera_proto::SealedFailure::AlreadySubmitted { job },
                        },
                    });
                }
                return;
            }
            let expires = s
                .envelopes
                .iter()
                .map(|e| e.header.expires_at)
                .max()
                .unwrap_or(now);
            seen.insert(job, expires);
        }
    }
    shared.feed(SealedInput::Submit {
        client,
        envelopes: s.envelopes,
        verified_only: s.verified_only,
        now: UnixMillis::now(),
    });
}

/// What a claim changed, as words for a log line (the claim epochs, unix milliseconds, are
/// in the event's fields).
fn claim_change_words(change: &tessera_seal::claims::ClaimChange) -> &'static str {
    use tessera_seal::claims::ClaimChange;
    match change {
        ClaimChange::New => "announced what it runs for sealed jobs",
        ClaimChange::Unchanged => "announced its sealed-job claim again, unchanged",
        ClaimChange::Superseded {
            revoked_seal_key: None,
            ..
        } => "renewed its sealed-job claim",
        ClaimChange::Superseded {
            revoked_seal_key: Some(_),
            ..
        } => "renewed its sealed-job claim with a new sealing key",
    }
}

/// Whether `msg` is one of the sealed desk's (the rest are the cluster's).
pub(crate) fn is_sealed(msg: &NodeToCoord) -> bool {
    matches!(
        msg,
        NodeToCoord::Claims(_)
            | NodeToCoord::SealedProgress { .. }
            | NodeToCoord::SealedResult { .. }
            | NodeToCoord::SealedRefused { .. }
    )
}

/// A node's sealed-job message; false when `msg` is not one ([`is_sealed`]).
pub(crate) fn node_message(shared: &mut impl SealedHost, from: NodeKey, msg: &NodeToCoord) -> bool {
    let input = match msg {
        NodeToCoord::Claims(c) => {
            let r = shared.desk().offer_claims(from, (**c).clone());
            match r {
                Ok(change) => tracing::info!(
                    event = "claims",
                    node = %from,
                    name = %name_of(shared, &from),
                    kernel_path = %c.claims.kernel_path,
                    epoch = c.claims.epoch,
                    models = c.claims.models.len(),
                    "{} {}",
                    name_of(shared, &from),
                    claim_change_words(&change)
                ),
                Err(e) => {
                    tracing::warn!(node = %from, "the sealed-job claims of {} were refused: {e}", name_of(shared, &from))
                }
            }
            return true;
        }
        NodeToCoord::SealedProgress {
            job,
            attempt,
            tokens,
        } => SealedInput::Progress {
            job: *job,
            attempt: *attempt,
            from,
            tokens: *tokens,
            now: UnixMillis::now(),
        },
        NodeToCoord::SealedResult { result } => SealedInput::Result {
            result: result.clone(),
            from,
            now: UnixMillis::now(),
        },
        NodeToCoord::SealedRefused {
            job,
            attempt,
            reason,
        } => SealedInput::Refused {
            job: *job,
            attempt: *attempt,
            from: match shared.edge().redirected.remove(&(*job, *attempt)) {
                Some((went_to, holder)) if went_to == from => holder,
                _ => from,
            },
            reason: reason.clone(),
            now: UnixMillis::now(),
        },
        _ => return false,
    };
    shared.feed(input);
    true
}

pub(crate) fn node_left(shared: &mut impl SealedHost, node: NodeKey) {
    shared.feed(SealedInput::NodeLeft {
        node,
        now: UnixMillis::now(),
    });
}

/// Moves jobs whose leases ran out (the core task calls this every [`SEALED_TICK`]).
pub(crate) fn tick(shared: &mut impl SealedHost) {
    if shared.desk().in_flight() > 0 {
        shared.feed(SealedInput::Tick {
            now: UnixMillis::now(),
        });
    }
}

/// Carries out what the desk decided: envelopes onto the node sessions (as the test-only faults
/// bend them), news to the clients, quarantines into the log. A node with no session to take
/// its envelope counts as gone at once.
pub(crate) fn carry_out(shared: &mut impl SealedHost, outputs: Vec<SealedOutput>) {
    let fault = shared.edge().fault;
    let other_keys: Vec<(NodeKey, KeyId)> = if fault == Some(SealedFault::RewriteRecipient) {
        shared
            .desk()
            .holders(None)
            .iter()
            .map(|s| (s.claims.node, s.claims.seal_key.key_id()))
            .collect()
    } else {
        Vec::new()
    };
    let mut undeliverable: Vec<NodeKey> = Vec::new();
    for o in outputs {
        match o {
            SealedOutput::Dispatch { to, mut envelope } => {
                let mut to = to;
                let mut copies = 1;
                match fault {
                    None | Some(SealedFault::ListOwnWorker) => {}
                    Some(SealedFault::RewriteTtl) => {
                        envelope.header.expires_at = envelope.header.expires_at.plus(3_600_000);
                    }
                    Some(SealedFault::Replay) => copies = 2,
                    Some(SealedFault::RewriteRecipient) => {
                        match other_keys.iter().find(|(n, _)| *n != to) {
                            Some((n, k)) => {
                                envelope.header.recipient = *k;
                                let h = &envelope.header;
                                shared
                                    .edge()
                                    .redirected
                                    .insert((h.job, h.attempt), (*n, to));
                                to = *n;
                            }
                            None => envelope.header.recipient = KeyId::from_bytes([0xee; 16]),
                        }
                    }
                }
                let mut delivered = false;
                for _ in 0..copies {
                    delivered |= shared.send(
                        node_id(&to),
                        CoordToNode::SealedJob {
                            envelope: envelope.clone(),
                        },
                    );
                }
                if !delivered {
                    // No session to send it on: the node is gone, whatever the desk last
                    // heard. Said at once (the job moves on now), never dropped silently.
                    undeliverable.push(to);
                }
            }
            SealedOutput::Quarantined { node, job } => {
                let name = name_of(shared, &node);
                tracing::warn!(
                    event = "quarantined",
                    node = %node,
                    name = %name,
                    job = %job,
                    "{name} ({node}) answered job {job} unlike two other workers: quarantined"
                );
            }
            SealedOutput::Tell { client, job, news } => {
                if let Some(tx) = shared.edge().clients.get(&client) {
                    let _ = tx.send(CoordToClient::Sealed { job, news });
                }
            }
        }
    }
    for node in undeliverable {
        tracing::info!(
            event = "sealed_undeliverable",
            node = %node,
            "a sealed job for {node} has no session to go on: the node counts as gone"
        );
        node_left(shared, node);
    }
}

/// How often the sealed desk's clock ticks: job leases are timed to this, whatever the node
/// lease (the cluster's own timer table).
pub(crate) const SEALED_TICK: std::time::Duration = std::time::Duration::from_millis(250);
