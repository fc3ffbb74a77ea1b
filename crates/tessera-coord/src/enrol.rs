//! Enrolment: who may connect, and how an unknown key becomes a member.
//!
//! [`Enrolment`] is the coordinator's [`PeerPolicy`]: an enrolled key is a member; an unknown
//! key is admitted to the enrolment handshake only (it can do nothing else until it proves the
//! join token, see [`tessera_net::enroll`]); a known node id with another key is refused. On a
//! successful proof the key is recorded in the persistent state before the session goes on.
//! The join token is a cluster secret, usable by any number of nodes until it is rotated.

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use tessera_net::{
    Admission, AllowList, Connection, EnrolmentRequest, JoinToken, NodeId, PeerPolicy, PublicKey,
    Refusal,
};
use tessera_node::protocol::Role;

use crate::error::CoordError;
use crate::state::{EnrolledNode, EnrolmentState, Snapshot};

/// The enrolment records, the live allow-list and the token.
pub struct Enrolment {
    allow: AllowList,
    token: JoinToken,
    state: Box<dyn EnrolmentState>,
    snapshot: Mutex<Snapshot>,
}

impl std::fmt::Debug for Enrolment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enrolment")
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl Enrolment {
    /// Loads the state; makes (and persists) a join token naming `coordinator` if there is none.
    pub fn open(
        state: Box<dyn EnrolmentState>,
        coordinator: NodeId,
    ) -> Result<Arc<Self>, CoordError> {
        let mut snap = state.load()?;
        let token = match &snap.token {
            Some(t) if t.coordinator() == Some(coordinator) => t.clone(),
            _ => {
                let t = JoinToken::generate(Some(coordinator))?;
                snap.token = Some(t.clone());
                state.save(&snap)?;
                t
            }
        };
        let allow = AllowList::new();
        for n in snap
            .nodes
            .iter()
            .filter(|n| !snap.revoked.contains(&n.node_id))
        {
            allow.insert(n.key);
        }
        allow.set_enrolment_open(true);
        Ok(Arc::new(Self {
            allow,
            token,
            state,
            snapshot: Mutex::new(snap),
        }))
    }

    pub fn token(&self) -> &JoinToken {
        &self.token
    }

    /// Whether `key` is enrolled.
    pub fn is_enrolled(&self, key: &PublicKey) -> bool {
        self.allow.contains(key)
    }

    /// Runs the enrolment handshake of an unknown key and records it on success.
    pub async fn complete(&self, req: EnrolmentRequest) -> Result<Connection, CoordError> {
        let token = self.token.clone();
        let conn = req
            .complete(move |claim| {
                if claim.token_id == token.id() {
                    Ok(token.clone())
                } else {
                    Err(Refusal::BadToken)
                }
            })
            .await?;
        self.record(conn.peer_key())?;
        Ok(conn)
    }

    fn record(&self, key: PublicKey) -> Result<(), CoordError> {
        let mut snap = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        if snap.revoked.contains(&key.node_id()) {
            return Err(CoordError::Run(format!(
                "node {} is revoked",
                key.node_id()
            )));
        }
        if !snap.nodes.iter().any(|n| n.key == key) {
            snap.nodes.push(EnrolledNode {
                node_id: key.node_id(),
                key,
                name: None,
                role: None,
                enrolled_at_unix_ms: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
            });
            self.state.save(&snap)?;
        }
        self.allow.insert(key);
        Ok(())
    }

    /// Binds `name` and `role` to `key` on its first session. A name already bound to another
    /// key is refused: a node cannot take over another's identity by announcing its name.
    pub fn bind_name(&self, key: &PublicKey, name: &str, role: Role) -> Result<(), Refusal> {
        let mut snap = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(other) = snap
            .nodes
            .iter()
            .find(|n| n.name.as_deref() == Some(name) && n.key != *key)
        {
            return Err(Refusal::Other(format!(
                "the name {name:?} belongs to node {} (another key); pick another --name",
                other.node_id
            )));
        }
        let Some(me) = snap.nodes.iter_mut().find(|n| n.key == *key) else {
            return Err(Refusal::Unknown(key.node_id()));
        };
        if me.name.as_deref() != Some(name) || me.role != Some(role) {
            me.name = Some(name.to_string());
            me.role = Some(role);
            let snap = snap.clone();
            self.state
                .save(&snap)
                .map_err(|e| Refusal::Other(format!("cannot record the node: {e}")))?;
        }
        Ok(())
    }

    /// Revokes a node: its key is refused from now on, and it cannot enrol again.
    pub fn revoke(&self, node: NodeId) -> Result<(), CoordError> {
        let mut snap = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = snap.nodes.iter().find(|n| n.node_id == node) {
            self.allow.remove(&n.node_id);
        }
        if !snap.revoked.contains(&node) {
            snap.revoked.push(node);
            self.state.save(&snap)?;
        }
        Ok(())
    }

    /// Whether `node` is revoked.
    pub fn is_revoked(&self, node: &NodeId) -> bool {
        self.snapshot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .revoked
            .contains(node)
    }

    /// The enrolled records.
    pub fn enrolled(&self) -> Vec<EnrolledNode> {
        self.snapshot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .nodes
            .clone()
    }
}

impl PeerPolicy for Enrolment {
    fn allow(&self, peer: &PublicKey) -> Result<Admission, Refusal> {
        self.allow.allow(peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::MemoryState;
    use tessera_net::NodeIdentity;

    #[test]
    fn policy_admits_members_sends_strangers_to_enrolment_and_binds_names() {
        let me = NodeIdentity::generate().unwrap();
        let e = Enrolment::open(Box::<MemoryState>::default(), me.node_id()).unwrap();
        assert_eq!(e.token().coordinator(), Some(me.node_id()));
        let a = NodeIdentity::generate().unwrap().public_key();
        let b = NodeIdentity::generate().unwrap().public_key();
        assert_eq!(e.allow(&a), Ok(Admission::Enrolment));
        e.record(a).unwrap();
        e.record(b).unwrap();
        assert_eq!(e.allow(&a), Ok(Admission::Member));
        e.bind_name(&a, "alpha", Role::Node).unwrap();
        // Another key cannot take the name.
        assert!(e.bind_name(&b, "alpha", Role::Node).is_err());
        e.bind_name(&b, "beta", Role::Node).unwrap();
        assert_eq!(e.enrolled().len(), 2);
    }

    #[test]
    fn token_and_members_survive_a_restart() {
        let me = NodeIdentity::generate().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let a = NodeIdentity::generate().unwrap().public_key();
        let token = {
            let e = Enrolment::open(
                Box::new(crate::state::JsonFileState::new(dir.path())),
                me.node_id(),
            )
            .unwrap();
            e.record(a).unwrap();
            e.token().clone()
        };
        let e = Enrolment::open(
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
            let e = Enrolment::open(
                Box::new(crate::state::RedbState::open(dir.path()).unwrap()),
                me.node_id(),
            )
            .unwrap();
            e.record(a).unwrap();
            e.revoke(a.node_id()).unwrap();
            assert_eq!(e.allow(&a), Ok(Admission::Enrolment));
        }
        let e = Enrolment::open(
            Box::new(crate::state::RedbState::open(dir.path()).unwrap()),
            me.node_id(),
        )
        .unwrap();
        assert!(e.is_revoked(&a.node_id()));
        assert_ne!(e.allow(&a), Ok(Admission::Member));
        assert!(e.record(a).is_err(), "the token does not bring it back");
    }
}
