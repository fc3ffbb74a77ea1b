//! The sealed desk's memory of job ids across restarts: each submitted job id with the latest
//! expiry of its envelopes, in `sealed.redb` in the coordinator's data directory (redb, the
//! embedded database of `state.redb`; a file of its own, since the enrolment state's handle
//! belongs to the shared state). A job id seen before a restart is refused again until its
//! envelopes have expired, after which no worker would run them anyway.

use std::path::{Path, PathBuf};

use tessera_seal::{JobId, UnixMillis};

const SEEN: redb::TableDefinition<&[u8], u64> = redb::TableDefinition::new("seen_jobs");

/// Submitted job ids and their envelopes' expiry, on disk.
pub(crate) struct SeenJobs {
    path: PathBuf,
    db: redb::Database,
}

impl SeenJobs {
    /// Opens (or creates) `sealed.redb` in `data_dir`, dropping entries expired by `now`.
    pub(crate) fn open(data_dir: &Path, now: UnixMillis) -> Result<Self, String> {
        let path = data_dir.join("sealed.redb");
        let shown = path.display().to_string();
        let err = |e: &dyn std::fmt::Display| format!("{shown}: {e}");
        let db = redb::Database::create(&path).map_err(|e| err(&e))?;
        let me = Self { path, db };
        let tx = me.db.begin_write().map_err(|e| err(&e))?;
        {
            let mut t = tx.open_table(SEEN).map_err(|e| err(&e))?;
            t.retain(|_, expires| expires > now.0)
                .map_err(|e| err(&e))?;
        }
        tx.commit().map_err(|e| err(&e))?;
        Ok(me)
    }

    /// Whether `job` was submitted and its envelopes have not expired by `now`.
    pub(crate) fn contains(&self, job: JobId, now: UnixMillis) -> bool {
        // redb's error is large, and lives only until it is logged here.
        #[allow(clippy::result_large_err)]
        let read = || -> Result<bool, redb::Error> {
            let tx = self.db.begin_read()?;
            let t = tx.open_table(SEEN)?;
            Ok(t.get(&job.as_bytes()[..])?
                .is_some_and(|v| v.value() > now.0))
        };
        read().unwrap_or_else(|e| {
            tracing::warn!("reading {}: {e}", self.path.display());
            false
        })
    }

    /// Records `job` until `expires`.
    pub(crate) fn insert(&self, job: JobId, expires: UnixMillis) {
        #[allow(clippy::result_large_err)]
        let write = || -> Result<(), redb::Error> {
            let tx = self.db.begin_write()?;
            tx.open_table(SEEN)?
                .insert(&job.as_bytes()[..], expires.0)?;
            tx.commit()?;
            Ok(())
        };
        if let Err(e) = write() {
            tracing::warn!("recording sealed job {job} in {}: {e}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_id_is_remembered_across_a_reopen_until_its_envelopes_expire() {
        let dir = std::env::temp_dir().join(format!("tessera-sealed-seen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (JobId::from_bytes([1; 16]), JobId::from_bytes([2; 16]));
        {
            let s = SeenJobs::open(&dir, UnixMillis(0)).unwrap();
            s.insert(a, UnixMillis(10_000));
            s.insert(b, UnixMillis(2_000));
        }
        let s = SeenJobs::open(&dir, UnixMillis(5_000)).unwrap();
        assert!(s.contains(a, UnixMillis(5_000)));
        assert!(!s.contains(b, UnixMillis(5_000)), "expired, and dropped");
        assert!(!s.contains(a, UnixMillis(10_000)));
        drop(s);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
