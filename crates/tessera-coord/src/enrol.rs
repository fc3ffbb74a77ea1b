//! Enrolment: who may connect, how an unknown key becomes a member, and as what.
//!
//! [`Enrolment`] is the coordinator's [`PeerPolicy`]: an enrolled key is a member; an unknown
//! key is admitted to the enrolment handshake only (it can do nothing else until it proves a
//! join token, see [`tessera_net::enroll`]); a known node id with another key is refused; a
//! revoked key is refused, whatever token it holds. On a successful proof the key is recorded
//! with the role the token grants ([`Grant`]) before the session goes on: the role is fixed
//! there, and a session's hello must announce that role ([`Enrolment::bind_name`]).
//!
//! Tokens have a life ([`crate::tokens`]): each expires, may be limited to a number of uses and
//! can be revoked. At start the coordinator makes sure it has a valid node token and a valid
//! operator token to print, issuing new ones when the old have expired or were revoked.
//!
//! Two halves: the records and their store are an [`EnrolmentBook`], owned by the coordinator's
//! core task (every change is a job there, in order with the cluster's inputs, so a revocation
//! and the closing of the key's connections are one step); what the rest reads — the live
//! allow-list the transport asks, the printed tokens and the records as of the last change —
//! is the [`Enrolment`], which the book publishes to after each change.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tessera_net::{
    Admission, AllowList, ClaimedEnrolment, JoinToken, NodeId, PeerPolicy, PublicKey, Refusal,
    TokenId,
};
use tessera_proto::{Role, TokenInfo};

use crate::authz::Grant;
use crate::error::CoordError;
use crate::state::{EnrolledNode, EnrolmentState, Snapshot};
use crate::tokens::{self, TokenRecord, TokenRefusal, DEFAULT_LIFETIME_MS};

/// Longest node or client name, bytes. Names go into logs, plan files and the dashboard.
pub const MAX_NAME_LEN: usize = 64;

/// Why an enrolment or a session's hello was refused. It reaches the peer as its sentence
/// ([`tessera_net::Refusal::Other`], or `CoordToNode::Refused`): the wire carries text, the
/// coordinator's own decisions stay typed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnrolRefusal {
    /// One the transport knows: unknown, revoked, a key that differs, a bad proof.
    #[error(transparent)]
    Peer(#[from] Refusal),
    /// The join token is unknown, expired, used up or revoked.
    #[error(transparent)]
    Token(#[from] TokenRefusal),
    #[error("cannot check the proof: {0}")]
    ProofUnchecked(String),
    /// Accepted, but the record could not be written (so it is undone).
    #[error("cannot record the node: {0}")]
    NotRecorded(String),
    #[error("a name must be 1 to {MAX_NAME_LEN} bytes (this one is {len})")]
    NameLength { len: usize },
    /// A newline in a name would forge log lines.
    #[error("a name may not contain control characters")]
    NameControlCharacters,
    #[error("the name {name:?} belongs to node {owner} (another key); pick another --name")]
    NameTaken { name: String, owner: NodeId },
    #[error("this key enrolled with a {grant} credential: its hello cannot claim the {} role", role_name(*.claimed))]
    WrongRole { grant: Grant, claimed: Role },
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Node => "node",
        Role::Client => "client",
    }
}

impl From<EnrolRefusal> for Refusal {
    fn from(r: EnrolRefusal) -> Self {
        match r {
            EnrolRefusal::Peer(r) => r,
            other => Self::Other(other.to_string()),
        }
    }
}

/// What everyone reads of the enrolment: the live allow-list, the printed tokens and the
/// records as the [`EnrolmentBook`] last published them.
pub struct Enrolment {
    allow: AllowList,
    coordinator: NodeId,
    token: JoinToken,
    operator_token: JoinToken,
    published: tokio::sync::watch::Sender<Arc<Snapshot>>,
    /// Bumped by every change of the records, after the change is published: a session
    /// re-checks its key's rights only when it moved ([`Enrolment::changes`]), not on every
    /// message.
    changes: AtomicU64,
}

/// The records and their store, changed only by their owner (the coordinator's core task);
/// each change is saved, then published to the [`Enrolment`].
pub struct EnrolmentBook {
    public: Arc<Enrolment>,
    snap: Snapshot,
    state: Box<dyn EnrolmentState>,
}

impl std::fmt::Debug for EnrolmentBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnrolmentBook")
            .field("nodes", &self.snap.nodes.len())
            .field("tokens", &self.snap.tokens.len())
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Enrolment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enrolment")
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

/// Milliseconds since the Unix epoch (the clock at the edge; the checks take it as input).
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Whether `name` may be a node's or client's name: 1..=[`MAX_NAME_LEN`] bytes, no control
/// characters (a newline in a name would forge log lines).
pub fn check_name(name: &str) -> Result<(), EnrolRefusal> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(EnrolRefusal::NameLength { len: name.len() });
    }
    if name.chars().any(char::is_control) {
        return Err(EnrolRefusal::NameControlCharacters);
    }
    Ok(())
}

impl Enrolment {
    /// Loads the state; makes sure a valid node token and operator token naming `coordinator`
    /// exist (issuing and persisting new ones if not). The book goes to the records' owner.
    pub fn open(
        state: Box<dyn EnrolmentState>,
        coordinator: NodeId,
    ) -> Result<(Arc<Self>, EnrolmentBook), CoordError> {
        Self::open_at(state, coordinator, now_unix_ms())
    }

    /// [`Enrolment::open`] at a given time.
    pub fn open_at(
        state: Box<dyn EnrolmentState>,
        coordinator: NodeId,
        now: u64,
    ) -> Result<(Arc<Self>, EnrolmentBook), CoordError> {
        let mut snap = state.load()?;
        // A token from before tokens had records: it keeps working as a node token for a day.
        if let Some(t) = snap.token.clone() {
            if !snap.tokens.iter().any(|r| r.token == t) {
                snap.tokens.push(TokenRecord {
                    token: t,
                    grant: Grant::Node,
                    uses_left: None,
                    expires_at_unix_ms: Some(now.saturating_add(DEFAULT_LIFETIME_MS)),
                    revoked: false,
                    created_at_unix_ms: now,
                    enrolled: 0,
                });
            }
        }
        let mut changed = false;
        let mut printable = |current: &Option<JoinToken>,
                             grant: Grant,
                             snap: &mut Snapshot|
         -> Result<JoinToken, CoordError> {
            let valid = current.as_ref().filter(|t| {
                t.coordinator() == Some(coordinator)
                    && snap
                        .tokens
                        .iter()
                        .any(|r| r.token == **t && r.grant == grant && r.check(now).is_ok())
            });
            if let Some(t) = valid {
                return Ok(t.clone());
            }
            let r = TokenRecord::issue(coordinator, grant, None, Some(DEFAULT_LIFETIME_MS), now)?;
            let t = r.token.clone();
            snap.tokens.push(r);
            changed = true;
            Ok(t)
        };
        let token = printable(&snap.token.clone(), Grant::Node, &mut snap)?;
        let operator_token = printable(&snap.operator_token.clone(), Grant::Operator, &mut snap)?;
        if changed || snap.token.as_ref() != Some(&token) {
            snap.token = Some(token.clone());
            snap.operator_token = Some(operator_token.clone());
            state.save(&snap)?;
        }
        let allow = AllowList::new();
        for n in snap
            .nodes
            .iter()
            .filter(|n| !snap.revoked.contains(&n.node_id))
        {
            allow.insert(n.key);
        }
        allow.set_enrolment_open(true);
        let public = Arc::new(Self {
            allow,
            coordinator,
            token,
            operator_token,
            published: tokio::sync::watch::Sender::new(Arc::new(snap.clone())),
            changes: AtomicU64::new(0),
        });
        let book = EnrolmentBook {
            public: public.clone(),
            snap,
            state,
        };
        Ok((public, book))
    }

    /// The records as last published.
    fn snap(&self) -> Arc<Snapshot> {
        self.published.borrow().clone()
    }

    /// How many times the records have changed (grants, names, revocations, tokens). A
    /// reader that sees the count move reads the change.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
    }

    /// The node join token the coordinator prints.
    pub fn token(&self) -> &JoinToken {
        &self.token
    }

    /// The operator token the coordinator prints (for `tessera run --split`, `tessera token`).
    pub fn operator_token(&self) -> &JoinToken {
        &self.operator_token
    }

    /// Whether `key` is enrolled.
    pub fn is_enrolled(&self, key: &PublicKey) -> bool {
        self.allow.contains(key)
    }

    /// What an enrolled, unrevoked key may be.
    pub fn grant_of(&self, key: &PublicKey) -> Option<Grant> {
        grant_in(&self.snap(), key)
    }

    /// Every token issued (without secrets), oldest first.
    pub fn tokens(&self) -> Vec<TokenInfo> {
        self.snap().tokens.iter().map(TokenRecord::info).collect()
    }

    /// Whether `node` is revoked.
    pub fn is_revoked(&self, node: &NodeId) -> bool {
        self.snap().revoked.contains(node)
    }

    /// The enrolled records.
    pub fn enrolled(&self) -> Vec<EnrolledNode> {
        self.snap().nodes.clone()
    }
}

impl EnrolmentBook {
    /// What everyone reads of these records.
    pub fn public(&self) -> &Arc<Enrolment> {
        &self.public
    }

    /// What an enrolled, unrevoked key may be, by these records.
    pub fn grant_of(&self, key: &PublicKey) -> Option<Grant> {
        grant_in(&self.snap, key)
    }

    /// Saves the records and publishes them; on failure nothing is published (the caller
    /// undoes its change, so memory and disk agree).
    fn commit(&mut self) -> Result<(), crate::state::StateError> {
        self.state.save(&self.snap)?;
        self.publish();
        Ok(())
    }

    /// Publishes the records, then moves the change count: a session that sees the count
    /// move reads the records that moved it.
    fn publish(&self) {
        self.public
            .published
            .send_replace(Arc::new(self.snap.clone()));
        self.public.changes.fetch_add(1, Ordering::SeqCst);
    }

    /// Judges an enrolment whose claim has been read, in one step of the records' owner: the
    /// claimed token must be one this coordinator still honours, and the claim must prove it
    /// on this session. Only then is a use of the token taken and the key recorded, with the
    /// role the token grants and the token's id, so a claim that fails its proof costs the
    /// token nothing. The caller answers the node ([`ClaimedEnrolment::accept`] or `refuse`).
    pub fn judge_now(&mut self, claimed: &ClaimedEnrolment) -> Result<(), EnrolRefusal> {
        self.judge(claimed, now_unix_ms())
    }

    fn judge(&mut self, claimed: &ClaimedEnrolment, now: u64) -> Result<(), EnrolRefusal> {
        let claim = claimed.claim();
        let snap = &mut self.snap;
        if snap.revoked.contains(&claim.node_id()) {
            return Err(Refusal::Revoked(claim.node_id()).into());
        }
        let Some(r) = tokens::find(&mut snap.tokens, &claim.token_id) else {
            return Err(TokenRefusal::Unknown.into());
        };
        r.check(now)?;
        let proved = claimed
            .proves(&r.token)
            .map_err(|e| EnrolRefusal::ProofUnchecked(e.to_string()))?;
        if !proved {
            return Err(Refusal::BadToken.into());
        }
        r.take_use();
        let (grant, token) = (r.grant, r.id());
        let added = Self::record_in(snap, claim.peer, grant, Some(token));
        if let Err(e) = self.commit() {
            // Not recorded durably: undo, so that memory and disk agree.
            if let Some(r) = tokens::find(&mut self.snap.tokens, &token) {
                r.give_back_use();
            }
            if added {
                self.snap.nodes.retain(|n| n.key != claim.peer);
            }
            return Err(EnrolRefusal::NotRecorded(e.to_string()));
        }
        self.public.allow.insert(claim.peer);
        Ok(())
    }

    /// Adds `key` to the enrolled records (a known key keeps its record); whether it was new.
    fn record_in(
        snap: &mut Snapshot,
        key: PublicKey,
        grant: Grant,
        token: Option<TokenId>,
    ) -> bool {
        if snap.nodes.iter().any(|n| n.key == key) {
            return false;
        }
        snap.nodes.push(EnrolledNode {
            node_id: key.node_id(),
            key,
            name: None,
            role: Some(grant.role()),
            enrolled_at_unix_ms: now_unix_ms(),
            grant: Some(grant),
            token,
        });
        true
    }

    #[cfg(test)]
    fn record(&mut self, key: PublicKey, grant: Grant) -> Result<(), CoordError> {
        if self.snap.revoked.contains(&key.node_id()) {
            return Err(CoordError::Run(format!(
                "node {} is revoked",
                key.node_id()
            )));
        }
        Self::record_in(&mut self.snap, key, grant, None);
        self.commit()?;
        self.public.allow.insert(key);
        Ok(())
    }

    /// Binds `name` and `role` to `key` on its first session. The role must be the one the
    /// key's credential grants (a hello cannot upgrade it); the name must be short and
    /// printable, and a name already bound to another key is refused: a node cannot take over
    /// another's identity by announcing its name.
    pub fn bind_name(
        &mut self,
        key: &PublicKey,
        name: &str,
        role: Role,
    ) -> Result<(), EnrolRefusal> {
        check_name(name)?;
        let snap = &mut self.snap;
        if snap.revoked.contains(&key.node_id()) {
            return Err(Refusal::Revoked(key.node_id()).into());
        }
        if let Some(other) = snap
            .nodes
            .iter()
            .find(|n| n.name.as_deref() == Some(name) && n.key != *key)
        {
            return Err(EnrolRefusal::NameTaken {
                name: name.to_string(),
                owner: other.node_id,
            });
        }
        let Some(me) = snap.nodes.iter_mut().find(|n| n.key == *key) else {
            return Err(Refusal::Unknown(key.node_id()).into());
        };
        let grant = me.grant();
        if grant.role() != role {
            return Err(EnrolRefusal::WrongRole {
                grant,
                claimed: role,
            });
        }
        if me.name.as_deref() != Some(name) {
            let before = me.name.replace(name.to_string());
            if let Err(e) = self.commit() {
                if let Some(me) = self.snap.nodes.iter_mut().find(|n| n.key == *key) {
                    me.name = before;
                }
                return Err(EnrolRefusal::NotRecorded(e.to_string()));
            }
        }
        Ok(())
    }

    /// Issues a token granting `grant`, for `uses` keys (`None`: any number) and `lifetime_ms`
    /// (`None`: it never expires).
    pub fn create_token(
        &mut self,
        grant: Grant,
        uses: Option<u32>,
        lifetime_ms: Option<u64>,
    ) -> Result<TokenRecord, CoordError> {
        let r = TokenRecord::issue(
            self.public.coordinator,
            grant,
            uses,
            lifetime_ms,
            now_unix_ms(),
        )?;
        self.snap.tokens.push(r.clone());
        if let Err(e) = self.commit() {
            self.snap.tokens.pop();
            return Err(e.into());
        }
        Ok(r)
    }

    /// Revokes the one token whose id starts with `prefix`, and with `with_keys` the keys that
    /// enrolled with it (`None`: only for a single-use token, whose one key is the one it was
    /// made for). Returns the token and the keys revoked now.
    pub fn revoke_token(
        &mut self,
        prefix: &str,
        with_keys: Option<bool>,
    ) -> Result<(TokenInfo, Vec<NodeId>), CoordError> {
        let snap = &mut self.snap;
        let mut hits = snap
            .tokens
            .iter_mut()
            .filter(|t| !prefix.is_empty() && t.id().to_string().starts_with(prefix));
        let (Some(t), None) = (hits.next(), hits.next()) else {
            return Err(CoordError::Run(
                "give a prefix of exactly one token id (`tessera token list`)".into(),
            ));
        };
        t.revoked = true;
        let info = t.info();
        let id = t.id();
        let keys: Vec<NodeId> = if with_keys.unwrap_or_else(|| t.single_use()) {
            let enrolled: Vec<NodeId> = snap
                .nodes
                .iter()
                .filter(|n| n.token == Some(id))
                .map(|n| n.node_id)
                .collect();
            let fresh: Vec<NodeId> = enrolled
                .into_iter()
                .filter(|n| !snap.revoked.contains(n))
                .collect();
            snap.revoked.extend(fresh.iter().copied());
            fresh
        } else {
            Vec::new()
        };
        self.commit()?;
        for n in &keys {
            self.public.allow.remove(n);
        }
        Ok((info, keys))
    }

    /// Revokes the enrolled key named `name` (its name, node id or an id prefix).
    pub fn revoke_named(&mut self, name: &str) -> Result<NodeId, CoordError> {
        // A name or a whole id first: a short name must not match another key whose id
        // happens to start with it. Then an id prefix of 4 characters or more.
        let nodes = &self.snap.nodes;
        let exact: Vec<NodeId> = nodes
            .iter()
            .filter(|n| n.name.as_deref() == Some(name) || n.node_id.to_string() == name)
            .map(|n| n.node_id)
            .collect();
        let prefixed: Vec<NodeId> = nodes
            .iter()
            .filter(|n| name.len() >= 4 && n.node_id.to_string().starts_with(name))
            .map(|n| n.node_id)
            .collect();
        let id = match (exact.as_slice(), prefixed.as_slice()) {
            ([one], _) | ([], [one]) => *one,
            _ => {
                return Err(CoordError::Run(
                    "give the name, node id or an id prefix (4+ characters) of exactly one \
                     enrolled key"
                        .into(),
                ))
            }
        };
        self.revoke(id)?;
        Ok(id)
    }

    /// Revokes a node: its key is refused from now on, and it cannot enrol again.
    pub fn revoke(&mut self, node: NodeId) -> Result<(), CoordError> {
        if self.snap.nodes.iter().any(|n| n.node_id == node) {
            self.public.allow.remove(&node);
        }
        if !self.snap.revoked.contains(&node) {
            self.snap.revoked.push(node);
            self.commit()?;
        }
        Ok(())
    }
}

/// What an enrolled, unrevoked key may be, by `snap`.
fn grant_in(snap: &Snapshot, key: &PublicKey) -> Option<Grant> {
    if snap.revoked.contains(&key.node_id()) {
        return None;
    }
    snap.nodes
        .iter()
        .find(|n| n.key == *key)
        .map(EnrolledNode::grant)
}

impl PeerPolicy for Enrolment {
    fn allow(&self, peer: &PublicKey) -> Result<Admission, Refusal> {
        self.allow.allow(peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::RedbState;
    use tessera_net::NodeIdentity;

    fn memory() -> Box<RedbState> {
        Box::new(RedbState::in_memory().unwrap())
    }

    #[test]
    fn policy_admits_members_sends_strangers_to_enrolment_and_binds_names() {
        let me = NodeIdentity::generate().unwrap();
        let (e, mut book) = Enrolment::open(memory(), me.node_id()).unwrap();
        assert_eq!(e.token().coordinator(), Some(me.node_id()));
        let a = NodeIdentity::generate().unwrap().public_key();
        let b = NodeIdentity::generate().unwrap().public_key();
        assert_eq!(e.allow(&a), Ok(Admission::Enrolment));
        book.record(a, Grant::Node).unwrap();
        book.record(b, Grant::Node).unwrap();
        assert_eq!(e.allow(&a), Ok(Admission::Member));
        book.bind_name(&a, "alpha", Role::Node).unwrap();
        // Another key cannot take the name.
        assert!(book.bind_name(&b, "alpha", Role::Node).is_err());
        book.bind_name(&b, "beta", Role::Node).unwrap();
        assert_eq!(e.enrolled().len(), 2);
    }

    #[test]
    fn token_and_members_survive_a_restart() {
        let me = NodeIdentity::generate().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let a = NodeIdentity::generate().unwrap().public_key();
        let token = {
            let (e, mut book) = Enrolment::open(
                Box::new(crate::state::JsonFileState::new(dir.path())),
                me.node_id(),
            )
            .unwrap();
            book.record(a, Grant::Node).unwrap();
            e.token().clone()
        };
        let (e, _) = Enrolment::open(
            Box::new(crate::state::JsonFileState::new(dir.path())),
            me.node_id(),
        )
        .unwrap();
        assert_eq!(e.token(), &token);
        assert_eq!(e.allow(&a), Ok(Admission::Member));
    }

    #[test]
    fn a_revoked_node_is_refused_and_cannot_enrol_again_after_a_restart() {
        let me = NodeIdentity::generate().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let a = NodeIdentity::generate().unwrap().public_key();
        {
            let (e, mut book) = Enrolment::open(
                Box::new(crate::state::RedbState::open(dir.path()).unwrap()),
                me.node_id(),
            )
            .unwrap();
            book.record(a, Grant::Node).unwrap();
            book.revoke(a.node_id()).unwrap();
            assert_eq!(e.allow(&a), Ok(Admission::Enrolment));
        }
        let (e, mut book) = Enrolment::open(
            Box::new(crate::state::RedbState::open(dir.path()).unwrap()),
            me.node_id(),
        )
        .unwrap();
        assert!(e.is_revoked(&a.node_id()));
        assert_ne!(e.allow(&a), Ok(Admission::Member));
        assert!(
            book.record(a, Grant::Node).is_err(),
            "the token does not bring it back"
        );
    }

    #[test]
    fn the_hello_cannot_upgrade_the_role_the_credential_grants() {
        let me = NodeIdentity::generate().unwrap();
        let (e, mut book) = Enrolment::open(memory(), me.node_id()).unwrap();
        let node = NodeIdentity::generate().unwrap().public_key();
        let client = NodeIdentity::generate().unwrap().public_key();
        book.record(node, Grant::Node).unwrap();
        book.record(client, Grant::Client).unwrap();
        assert_eq!(
            book.bind_name(&node, "n", Role::Client),
            Err(EnrolRefusal::WrongRole {
                grant: Grant::Node,
                claimed: Role::Client
            })
        );
        assert_eq!(
            book.bind_name(&client, "c", Role::Node),
            Err(EnrolRefusal::WrongRole {
                grant: Grant::Client,
                claimed: Role::Node
            })
        );
        book.bind_name(&node, "n", Role::Node).unwrap();
        book.bind_name(&client, "c", Role::Client).unwrap();
        assert_eq!(e.grant_of(&client), Some(Grant::Client));
    }

    #[test]
    fn a_revocation_moves_the_change_count_that_sessions_recheck_rights_on_and_a_read_does_not() {
        let me = NodeIdentity::generate().unwrap();
        let (e, mut book) = Enrolment::open(memory(), me.node_id()).unwrap();
        let a = NodeIdentity::generate().unwrap().public_key();
        book.record(a, Grant::Node).unwrap();
        let before = e.changes();
        assert_eq!(e.grant_of(&a), Some(Grant::Node));
        assert!(!e.is_revoked(&a.node_id()));
        assert_eq!(e.changes(), before, "reads change nothing");
        book.revoke(a.node_id()).unwrap();
        assert!(e.changes() > before);
        assert_eq!(e.grant_of(&a), None);
    }

    #[test]
    fn a_short_name_revokes_its_key_not_another_whose_id_starts_with_it() {
        let me = NodeIdentity::generate().unwrap();
        let (e, mut book) = Enrolment::open(memory(), me.node_id()).unwrap();
        let a = NodeIdentity::generate().unwrap().public_key();
        let b = NodeIdentity::generate().unwrap().public_key();
        book.record(a, Grant::Node).unwrap();
        book.record(b, Grant::Node).unwrap();
        let short = b.node_id().to_string()[..1].to_string();
        book.bind_name(&a, &short, Role::Node).unwrap();
        assert_eq!(book.revoke_named(&short).unwrap(), a.node_id());
        assert!(!e.is_revoked(&b.node_id()));
        // An id prefix shorter than 4 characters names nobody.
        assert!(book.revoke_named(&b.node_id().to_string()[..3]).is_err());
        let id = b.node_id().to_string();
        assert_eq!(book.revoke_named(&id[..6]).unwrap(), b.node_id());
    }

    #[test]
    fn names_are_short_and_printable() {
        let me = NodeIdentity::generate().unwrap();
        let (e, mut book) = Enrolment::open(memory(), me.node_id()).unwrap();
        let a = NodeIdentity::generate().unwrap().public_key();
        book.record(a, Grant::Node).unwrap();
        let huge = "x".repeat(3 << 20);
        let r = book.bind_name(&a, &huge, Role::Node).unwrap_err();
        assert_eq!(r, EnrolRefusal::NameLength { len: 3 << 20 });
        assert!(
            r.to_string().len() < 100,
            "the refusal does not echo the name"
        );
        assert_eq!(
            book.bind_name(&a, "a\nnode joined: evil", Role::Node),
            Err(EnrolRefusal::NameControlCharacters)
        );
        assert!(e.enrolled()[0].name.is_none(), "nothing was persisted");
    }

    #[test]
    fn printed_tokens_rotate_when_revoked_or_expired_and_the_rotation_survives_a_restart() {
        let me = NodeIdentity::generate().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let open = |now| {
            Enrolment::open_at(
                Box::new(crate::state::RedbState::open(dir.path()).unwrap()),
                me.node_id(),
                now,
            )
            .unwrap()
        };
        let (first, op) = {
            let (e, _) = open(1_000);
            assert_ne!(e.token(), e.operator_token());
            (e.token().clone(), e.operator_token().clone())
        };
        // Within its lifetime the same tokens are printed again.
        let (e, mut book) = open(2_000);
        assert_eq!(e.token(), &first);
        assert_eq!(e.operator_token(), &op);
        book.revoke_token(&first.id().to_string(), None).unwrap();
        drop((e, book));
        let (e, book) = open(3_000);
        assert_ne!(e.token(), &first, "a revoked token is replaced");
        assert_eq!(e.operator_token(), &op);
        let listed = e.tokens();
        assert!(listed
            .iter()
            .any(|t| t.id == first.id().to_string() && t.revoked));
        drop((e, book));
        // A day later both printed tokens have expired: new ones.
        let (e, _) = open(3_000 + DEFAULT_LIFETIME_MS + 1);
        assert_ne!(e.operator_token(), &op);
    }
}
