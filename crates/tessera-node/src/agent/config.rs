//! The agent's settings: where and how to join ([`JoinTarget`]), how hard the start-up probes
//! work ([`ProbeLevel`]), the [`AgentConfig`] the CLI validates, and the [`CoordinatorRecord`]
//! (`coordinator.json`) of the coordinator this node enrolled with, pinned from then on.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tessera_net::{JoinToken, PublicKey};

use crate::error::FabricError;
use crate::inventory::MemoryBudget;

/// Where and how to join: `TOKEN@HOST:PORT`.
#[derive(Clone, Debug)]
pub struct JoinTarget {
    pub token: JoinToken,
    pub addr: SocketAddr,
}

impl FromStr for JoinTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (token, addr) = s
            .trim()
            .rsplit_once('@')
            .ok_or_else(|| "expected TOKEN@HOST:PORT".to_string())?;
        let token: JoinToken = token.parse().map_err(|e| format!("{e}"))?;
        let addr = addr
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {addr}: {e}"))?
            .next()
            .ok_or_else(|| format!("{addr} resolves to no address"))?;
        Ok(Self { token, addr })
    }
}

/// How hard the start-up probes work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeLevel {
    /// Full probes (hundreds of MiB of memory and disk traffic, ~2 s).
    Full,
    /// Small buffers, short limits: for tests and quick starts. Figures are less accurate.
    Quick,
}

/// The agent's settings, validated by the CLI.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub data_dir: PathBuf,
    /// Enrol with this token (and coordinator); `None` reconnects to the recorded coordinator.
    pub join: Option<JoinTarget>,
    /// UDP address to bind (peers dial it; the coordinator is dialled from it).
    pub listen: SocketAddr,
    /// The address peers are told to dial for this node's data links (ring and expert
    /// streams), when it is not the one the coordinator sees: a port forward, a proxy, a link
    /// emulator. `None`: the listening port at the address the coordinator observed.
    pub advertise: Option<SocketAddr>,
    pub name: Option<String>,
    pub memory_budget: Option<MemoryBudget>,
    /// A local copy of a model: adopted (hashed) at start, never downloaded.
    pub model: Option<PathBuf>,
    /// Compute threads for the engine.
    pub threads: usize,
    pub probe: ProbeLevel,
    /// Draw progress bars on stderr (when it is a terminal).
    pub progress: bool,
    /// Stream assigned experts from disk with at most this many bytes of them in memory
    /// (`None`: only when the assigned experts exceed the memory budget).
    pub expert_budget: Option<u64>,
    /// How this node takes sealed jobs (its device tier; test-only faults).
    pub sealed: super::sealed::SealedOptions,
    /// Closed sequences' caches each stage keeps for prompts that begin with the same tokens
    /// (a chat's next turn), within the memory budget; 0: none.
    pub prefix_cache: usize,
    /// Test only: load cached model bytes without re-hashing them against the manifest (a
    /// node whose weights were altered on disk), so verification has something to catch.
    pub fault_unchecked_weights: bool,
}

/// The coordinator this node enrolled with, pinned from then on.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CoordinatorRecord {
    pub addr: SocketAddr,
    pub key: PublicKey,
}

const COORDINATOR_FILE: &str = "coordinator.json";

impl CoordinatorRecord {
    pub fn load(data_dir: &Path) -> Option<Self> {
        let bytes = std::fs::read(data_dir.join(COORDINATOR_FILE)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    pub fn save(&self, data_dir: &Path) -> Result<(), FabricError> {
        let path = data_dir.join(COORDINATOR_FILE);
        let tmp = data_dir.join(".coordinator.json.tmp");
        let json = serde_json::to_vec_pretty(self).expect("record serializes");
        std::fs::write(&tmp, json)
            .and_then(|_| std::fs::rename(&tmp, &path))
            .map_err(|e| FabricError::io(format!("writing {}", path.display()), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_target_parses() {
        let t = JoinToken::generate(None).unwrap();
        let j: JoinTarget = format!("{t}@127.0.0.1:4000").parse().unwrap();
        assert_eq!(j.addr, "127.0.0.1:4000".parse().unwrap());
        assert_eq!(j.token, t);
        assert!("nonsense".parse::<JoinTarget>().is_err());
        assert!(format!("{t}@").parse::<JoinTarget>().is_err());
    }
}
