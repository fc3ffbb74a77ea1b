//! What the coordinator remembers across restarts: its join token, the enrolled keys, revoked
//! nodes, and every plan epoch with its placement and evidence.
//!
//! A small trait ([`EnrolmentState`]) in front of the storage. The coordinator uses
//! [`RedbState`] (`state.redb`, an embedded transactional database: a crash mid-write leaves
//! the previous state); [`RedbState::in_memory`] is the same database without a file, for
//! tests. [`JsonFileState`] (written atomically) remains for data directories from before the
//! database, and for inspection.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tessera_host::ContentHash;
use tessera_net::{JoinToken, LinkMeasurement, NodeId, PublicKey, TokenId};
use tessera_proto::{LoadReport, Role};

use crate::authz::Grant;
use crate::tokens::TokenRecord;

/// One enrolled key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnrolledNode {
    pub node_id: NodeId,
    pub key: PublicKey,
    /// The name it announced in its first session (names are bound to keys).
    pub name: Option<String>,
    pub role: Option<Role>,
    pub enrolled_at_unix_ms: u64,
    /// What the credential it enrolled with grants (`None`: enrolled before credentials had
    /// roles; it is then what `role` says, a client never an operator).
    #[serde(default)]
    pub grant: Option<Grant>,
    /// The token it enrolled with (`None`: enrolled before this was recorded), so that
    /// revoking a token can revoke the keys it let in.
    #[serde(default)]
    pub token: Option<TokenId>,
}

impl EnrolledNode {
    /// What this key may be.
    pub fn grant(&self) -> Grant {
        match (self.grant, self.role) {
            (Some(g), _) => g,
            (None, Some(Role::Client)) => Grant::Client,
            (None, _) => Grant::Node,
        }
    }
}

/// The persisted state.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Snapshot {
    /// The cluster join token (reused across restarts so printed tokens stay valid).
    pub token: Option<JoinToken>,
    pub nodes: Vec<EnrolledNode>,
    /// Nodes whose keys are refused from now on (they cannot enrol again with the token).
    #[serde(default)]
    pub revoked: Vec<NodeId>,
    /// Every token issued, with its role, uses, expiry and revocation.
    #[serde(default)]
    pub tokens: Vec<TokenRecord>,
    /// The operator token the coordinator prints at start (its record is in `tokens`).
    #[serde(default)]
    pub operator_token: Option<JoinToken>,
}

/// One stage of a recorded epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochStageRecord {
    pub node_id: NodeId,
    pub name: Option<String>,
    pub layers: Range<usize>,
    /// What the node reported when it loaded its part (evidence of the placement).
    pub load: Option<LoadReport>,
    pub link_to_next: Option<LinkMeasurement>,
}

/// A plan epoch as recorded: its placement, its last phase, and its evidence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochRecord {
    pub epoch: u64,
    pub model: ContentHash,
    /// `loading`, `linking`, `ready`, `failed: REASON` or `released`.
    pub phase: String,
    pub stages: Vec<EpochStageRecord>,
    pub recorded_at_unix_ms: u64,
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
    #[error("{path}: database: {reason}")]
    Db { path: PathBuf, reason: String },
}

/// Storage of the coordinator's [`Snapshot`] and its plan epochs.
pub trait EnrolmentState: Send + Sync {
    fn load(&self) -> Result<Snapshot, StateError>;
    fn save(&self, snapshot: &Snapshot) -> Result<(), StateError>;
    /// Records (or updates) one plan epoch.
    fn record_epoch(&self, record: &EpochRecord) -> Result<(), StateError>;
    /// Every recorded epoch, oldest first.
    fn epochs(&self) -> Result<Vec<EpochRecord>, StateError>;
    /// The highest epoch number recorded.
    fn last_epoch(&self) -> Result<Option<u64>, StateError> {
        Ok(self.epochs()?.iter().map(|e| e.epoch).max())
    }
}

impl<T: EnrolmentState + ?Sized> EnrolmentState for Arc<T> {
    fn load(&self) -> Result<Snapshot, StateError> {
        (**self).load()
    }
    fn save(&self, snapshot: &Snapshot) -> Result<(), StateError> {
        (**self).save(snapshot)
    }
    fn record_epoch(&self, record: &EpochRecord) -> Result<(), StateError> {
        (**self).record_epoch(record)
    }
    fn epochs(&self) -> Result<Vec<EpochRecord>, StateError> {
        (**self).epochs()
    }
    fn last_epoch(&self) -> Result<Option<u64>, StateError> {
        (**self).last_epoch()
    }
}

fn upsert(epochs: &mut Vec<EpochRecord>, record: &EpochRecord) {
    match epochs.iter_mut().find(|e| e.epoch == record.epoch) {
        Some(e) => *e = record.clone(),
        None => {
            epochs.push(record.clone());
            epochs.sort_by_key(|e| e.epoch);
        }
    }
}

/// `state.redb` in the coordinator's data directory: tables `meta` (the join token), `nodes`
/// (enrolled keys by node id), `revoked` and `epochs` (by number). Each save is one
/// transaction.
pub struct RedbState {
    path: PathBuf,
    db: redb::Database,
}

impl std::fmt::Debug for RedbState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedbState")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
const NODES: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("nodes");
const REVOKED: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("revoked");
const EPOCHS: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("epochs");
const TOKENS: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("tokens");

impl RedbState {
    /// Opens (or creates, mode 0600: it holds the join token) `state.redb` in `data_dir`.
    pub fn open(data_dir: &Path) -> Result<Self, StateError> {
        let path = data_dir.join("state.redb");
        let db = redb::Database::create(&path).map_err(|e| StateError::Db {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
        }
        Self::with_tables(Self { path, db })
    }

    /// The same database in memory (nothing survives it), for tests.
    pub fn in_memory() -> Result<Self, StateError> {
        let path = PathBuf::from("(in memory)");
        let db = redb::Builder::new()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(|e| StateError::Db {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        Self::with_tables(Self { path, db })
    }

    fn with_tables(me: Self) -> Result<Self, StateError> {
        // Create the tables, so that readers find them.
        let tx = me.db.begin_write().map_err(|e| me.err(e))?;
        {
            tx.open_table(META).map_err(|e| me.err(e))?;
            tx.open_table(NODES).map_err(|e| me.err(e))?;
            tx.open_table(REVOKED).map_err(|e| me.err(e))?;
            tx.open_table(EPOCHS).map_err(|e| me.err(e))?;
            tx.open_table(TOKENS).map_err(|e| me.err(e))?;
        }
        tx.commit().map_err(|e| me.err(e))?;
        Ok(me)
    }

    fn err(&self, e: impl std::fmt::Display) -> StateError {
        StateError::Db {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }

    fn corrupt(&self, e: impl std::fmt::Display) -> StateError {
        StateError::Corrupt {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }
}

impl EnrolmentState for RedbState {
    fn load(&self) -> Result<Snapshot, StateError> {
        use redb::ReadableTable;
        let tx = self.db.begin_read().map_err(|e| self.err(e))?;
        let meta = tx.open_table(META).map_err(|e| self.err(e))?;
        let token = match meta.get("token").map_err(|e| self.err(e))? {
            Some(v) => Some(serde_json::from_slice(v.value()).map_err(|e| self.corrupt(e))?),
            None => None,
        };
        let mut nodes = Vec::new();
        for row in tx
            .open_table(NODES)
            .map_err(|e| self.err(e))?
            .iter()
            .map_err(|e| self.err(e))?
        {
            let (_, v) = row.map_err(|e| self.err(e))?;
            nodes.push(serde_json::from_slice(v.value()).map_err(|e| self.corrupt(e))?);
        }
        let mut revoked = Vec::new();
        for row in tx
            .open_table(REVOKED)
            .map_err(|e| self.err(e))?
            .iter()
            .map_err(|e| self.err(e))?
        {
            let (_, v) = row.map_err(|e| self.err(e))?;
            revoked.push(serde_json::from_slice(v.value()).map_err(|e| self.corrupt(e))?);
        }
        let operator_token = match meta.get("operator_token").map_err(|e| self.err(e))? {
            Some(v) => Some(serde_json::from_slice(v.value()).map_err(|e| self.corrupt(e))?),
            None => None,
        };
        let mut tokens = Vec::new();
        for row in tx
            .open_table(TOKENS)
            .map_err(|e| self.err(e))?
            .iter()
            .map_err(|e| self.err(e))?
        {
            let (_, v) = row.map_err(|e| self.err(e))?;
            tokens.push(serde_json::from_slice(v.value()).map_err(|e| self.corrupt(e))?);
        }
        Ok(Snapshot {
            token,
            nodes,
            revoked,
            tokens,
            operator_token,
        })
    }

    fn save(&self, snapshot: &Snapshot) -> Result<(), StateError> {
        use redb::ReadableTable;
        let tx = self.db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut meta = tx.open_table(META).map_err(|e| self.err(e))?;
            match &snapshot.token {
                Some(t) => {
                    let v = serde_json::to_vec(t).expect("token serializes");
                    meta.insert("token", v.as_slice())
                        .map_err(|e| self.err(e))?;
                }
                None => {
                    meta.remove("token").map_err(|e| self.err(e))?;
                }
            }
            match &snapshot.operator_token {
                Some(t) => {
                    let v = serde_json::to_vec(t).expect("token serializes");
                    meta.insert("operator_token", v.as_slice())
                        .map_err(|e| self.err(e))?;
                }
                None => {
                    meta.remove("operator_token").map_err(|e| self.err(e))?;
                }
            }
            let mut tokens = tx.open_table(TOKENS).map_err(|e| self.err(e))?;
            for t in &snapshot.tokens {
                let v = serde_json::to_vec(t).expect("token record serializes");
                tokens
                    .insert(t.id().to_string().as_str(), v.as_slice())
                    .map_err(|e| self.err(e))?;
            }
            let mut nodes = tx.open_table(NODES).map_err(|e| self.err(e))?;
            let old: Vec<String> = nodes
                .iter()
                .map_err(|e| self.err(e))?
                .filter_map(|r| r.ok().map(|(k, _)| k.value().to_string()))
                .collect();
            for k in old {
                nodes.remove(k.as_str()).map_err(|e| self.err(e))?;
            }
            for n in &snapshot.nodes {
                let v = serde_json::to_vec(n).expect("node serializes");
                nodes
                    .insert(n.node_id.to_string().as_str(), v.as_slice())
                    .map_err(|e| self.err(e))?;
            }
            let mut revoked = tx.open_table(REVOKED).map_err(|e| self.err(e))?;
            for id in &snapshot.revoked {
                let v = serde_json::to_vec(id).expect("id serializes");
                revoked
                    .insert(id.to_string().as_str(), v.as_slice())
                    .map_err(|e| self.err(e))?;
            }
        }
        tx.commit().map_err(|e| self.err(e))
    }

    fn record_epoch(&self, record: &EpochRecord) -> Result<(), StateError> {
        let tx = self.db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut t = tx.open_table(EPOCHS).map_err(|e| self.err(e))?;
            let v = serde_json::to_vec(record).expect("epoch serializes");
            t.insert(record.epoch, v.as_slice())
                .map_err(|e| self.err(e))?;
        }
        tx.commit().map_err(|e| self.err(e))
    }

    fn epochs(&self) -> Result<Vec<EpochRecord>, StateError> {
        use redb::ReadableTable;
        let tx = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = tx.open_table(EPOCHS).map_err(|e| self.err(e))?;
        let mut out = Vec::new();
        for row in t.iter().map_err(|e| self.err(e))? {
            let (_, v) = row.map_err(|e| self.err(e))?;
            out.push(serde_json::from_slice(v.value()).map_err(|e| self.corrupt(e))?);
        }
        Ok(out)
    }

    fn last_epoch(&self) -> Result<Option<u64>, StateError> {
        use redb::ReadableTable;
        let tx = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = tx.open_table(EPOCHS).map_err(|e| self.err(e))?;
        let last = t.last().map_err(|e| self.err(e))?;
        Ok(last.map(|(k, _)| k.value()))
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
        write_json(&self.path, snapshot)
    }

    fn record_epoch(&self, record: &EpochRecord) -> Result<(), StateError> {
        let mut epochs = self.epochs()?;
        upsert(&mut epochs, record);
        write_json(&self.path.with_file_name("epochs.json"), &epochs)
    }

    fn epochs(&self) -> Result<Vec<EpochRecord>, StateError> {
        let path = self.path.with_file_name("epochs.json");
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| StateError::Corrupt {
                path,
                reason: e.to_string(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(source) => Err(StateError::Io { path, source }),
        }
    }
}

/// Writes `value` as JSON to `path` atomically, mode 0600.
fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), StateError> {
    {
        let io = |source| StateError::Io {
            path: path.to_owned(),
            source,
        };
        let tmp = path.with_extension("json.tmp");
        let json = serde_json::to_vec_pretty(value).expect("state serializes");
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
        std::fs::rename(&tmp, path).map_err(io)
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
                grant: Some(Grant::Node),
                token: Some(tessera_net::TokenId([7; 8])),
            }],
            revoked: Vec::new(),
            ..Snapshot::default()
        };
        st.save(&snap).unwrap();
        let back = st.load().unwrap();
        assert_eq!(back.nodes, snap.nodes);
        assert_eq!(back.token, snap.token);
        std::fs::write(dir.path().join("state.json"), b"{nope").unwrap();
        assert!(matches!(st.load(), Err(StateError::Corrupt { .. })));
    }

    #[test]
    fn redb_state_round_trips_nodes_revocations_and_epochs_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let a = tessera_net::NodeIdentity::generate().unwrap();
        let b = tessera_net::NodeIdentity::generate().unwrap();
        let node = |id: &tessera_net::NodeIdentity, name: &str| EnrolledNode {
            node_id: id.node_id(),
            key: id.public_key(),
            name: Some(name.into()),
            role: Some(Role::Node),
            enrolled_at_unix_ms: 5,
            grant: None,
            token: None,
        };
        let token = JoinToken::generate(None).unwrap();
        let epoch = |n: u64| EpochRecord {
            epoch: n,
            model: ContentHash([3; 32]),
            phase: "ready".into(),
            stages: vec![EpochStageRecord {
                node_id: a.node_id(),
                name: Some("a".into()),
                layers: 0..5,
                load: Some(LoadReport::default()),
                link_to_next: None,
            }],
            recorded_at_unix_ms: 9,
        };
        {
            let st = RedbState::open(dir.path()).unwrap();
            assert!(st.load().unwrap().nodes.is_empty());
            assert_eq!(st.last_epoch().unwrap(), None);
            st.save(&Snapshot {
                token: Some(token.clone()),
                nodes: vec![node(&a, "a"), node(&b, "b")],
                revoked: vec![],
                ..Snapshot::default()
            })
            .unwrap();
            // A later save replaces the node set.
            st.save(&Snapshot {
                token: Some(token.clone()),
                nodes: vec![node(&a, "a")],
                revoked: vec![b.node_id()],
                ..Snapshot::default()
            })
            .unwrap();
            st.record_epoch(&epoch(3)).unwrap();
            st.record_epoch(&epoch(7)).unwrap();
            let mut e = epoch(7);
            e.phase = "failed: gone".into();
            st.record_epoch(&e).unwrap();
        }
        let st = RedbState::open(dir.path()).unwrap();
        let snap = st.load().unwrap();
        assert_eq!(snap.token, Some(token));
        assert_eq!(snap.nodes, vec![node(&a, "a")]);
        assert_eq!(snap.revoked, vec![b.node_id()]);
        assert_eq!(st.last_epoch().unwrap(), Some(7));
        let epochs = st.epochs().unwrap();
        assert_eq!(epochs.len(), 2);
        assert_eq!(epochs[1].phase, "failed: gone");
    }
}
