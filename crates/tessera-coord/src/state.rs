//! What the coordinator remembers across restarts: its join token and the enrolled keys.
//!
//! A small trait ([`EnrolmentState`]) in front of the storage, with a JSON file implementation
//! ([`JsonFileState`], written atomically) and an in-memory twin ([`MemoryState`]) for tests.
//! A later issue moves this to an embedded database.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tessera_net::{JoinToken, NodeId, PublicKey};
use tessera_node::protocol::Role;

/// One enrolled key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnrolledNode {
    pub node_id: NodeId,
    pub key: PublicKey,
    /// The name it announced in its first session (names are bound to keys).
    pub name: Option<String>,
    pub role: Option<Role>,
    pub enrolled_at_unix_ms: u64,
}

/// The persisted state.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Snapshot {
    /// The cluster join token (reused across restarts so printed tokens stay valid).
    pub token: Option<JoinToken>,
    pub nodes: Vec<EnrolledNode>,
}

/// Why the state could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a coordinator state file: {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

/// Storage of the coordinator's [`Snapshot`].
pub trait EnrolmentState: Send + Sync {
    fn load(&self) -> Result<Snapshot, StateError>;
    fn save(&self, snapshot: &Snapshot) -> Result<(), StateError>;
}

/// In memory, for tests.
#[derive(Debug, Default)]
pub struct MemoryState(Mutex<Snapshot>);

impl EnrolmentState for MemoryState {
    fn load(&self) -> Result<Snapshot, StateError> {
        Ok(self.0.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }
    fn save(&self, snapshot: &Snapshot) -> Result<(), StateError> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = snapshot.clone();
        Ok(())
    }
}

/// `state.json` in the coordinator's data directory, mode 0600 (it holds the join token).
#[derive(Debug)]
pub struct JsonFileState {
    path: PathBuf,
}

impl JsonFileState {
    pub fn new(data_dir: &Path) -> Self {
        Self {
            path: data_dir.join("state.json"),
        }
    }
}

impl EnrolmentState for JsonFileState {
    fn load(&self) -> Result<Snapshot, StateError> {
        match std::fs::read(&self.path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| StateError::Corrupt {
                path: self.path.clone(),
                reason: e.to_string(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Snapshot::default()),
            Err(source) => Err(StateError::Io {
                path: self.path.clone(),
                source,
            }),
        }
    }

    fn save(&self, snapshot: &Snapshot) -> Result<(), StateError> {
        let io = |source| StateError::Io {
            path: self.path.clone(),
            source,
        };
        let tmp = self.path.with_extension("json.tmp");
        let json = serde_json::to_vec_pretty(snapshot).expect("state serializes");
        {
            use std::io::Write;
            let mut o = std::fs::OpenOptions::new();
            o.write(true).create(true).truncate(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                o.mode(0o600);
            }
            let mut f = o.open(&tmp).map_err(io)?;
            f.write_all(&json).map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, &self.path).map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_state_round_trips_and_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        let st = JsonFileState::new(dir.path());
        assert!(st.load().unwrap().nodes.is_empty());
        let id = tessera_net::NodeIdentity::generate().unwrap();
        let snap = Snapshot {
            token: Some(JoinToken::generate(None).unwrap()),
            nodes: vec![EnrolledNode {
                node_id: id.node_id(),
                key: id.public_key(),
                name: Some("a".into()),
                role: Some(Role::Node),
                enrolled_at_unix_ms: 1,
            }],
        };
        st.save(&snap).unwrap();
        let back = st.load().unwrap();
        assert_eq!(back.nodes, snap.nodes);
        assert_eq!(back.token, snap.token);
        std::fs::write(dir.path().join("state.json"), b"{nope").unwrap();
        assert!(matches!(st.load(), Err(StateError::Corrupt { .. })));
    }
}
