//! The embedded store: one SQLite file in WAL mode with `synchronous = NORMAL`, which keeps
//! every committed claim across a killed process (only an OS crash can lose the last ones).
//! Calls run on tokio's blocking pool; one connection behind a mutex is plenty for one runner.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension, params};

use super::{Claim, StoreError, millis};

const IN_PROGRESS: i64 = 0;
const DONE: i64 = 1;

/// The embedded idempotency store.
#[derive(Clone)]
pub struct SqliteStore {
    connection: Arc<Mutex<Connection>>,
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(e.to_string())
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(millis).unwrap_or_default()
}

impl SqliteStore {
    /// Opens or creates the file (and its directory).
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| StoreError(format!("cannot create {}: {e}", dir.display())))?;
        }
        let connection =
            Connection::open(path).map_err(|e| StoreError(format!("cannot open {}: {e}", path.display())))?;
        connection
            .execute_batch(
                "PRAGMA journal_mode = WAL;
                 PRAGMA synchronous = NORMAL;
                 PRAGMA busy_timeout = 5000;
                 CREATE TABLE IF NOT EXISTS claims (
                     key TEXT PRIMARY KEY,
                     state INTEGER NOT NULL,
                     expires_at INTEGER NOT NULL
                 ) WITHOUT ROWID;
                 CREATE INDEX IF NOT EXISTS claims_expiry ON claims (expires_at);",
            )
            .map_err(err)?;
        Ok(SqliteStore { connection: Arc::new(Mutex::new(connection)) })
    }

    async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let connection = self.connection.clone();
        tokio::task::spawn_blocking(move || {
            let guard = connection.lock().map_err(|_| StoreError("store lock poisoned".into()))?;
            f(&guard).map_err(err)
        })
        .await
        .map_err(err)?
    }

    pub async fn claim(&self, key: &str, lease: Duration) -> Result<Claim, StoreError> {
        let key = key.to_string();
        let lease = millis(lease);
        self.with(move |c| {
            let now = now_ms();
            // Insert, or take over a row whose lease or TTL has run out.
            let changed = c.execute(
                "INSERT INTO claims (key, state, expires_at) VALUES (?1, ?2, ?3)
                 ON CONFLICT (key) DO UPDATE SET state = ?2, expires_at = ?3 WHERE claims.expires_at <= ?4",
                params![key, IN_PROGRESS, now.saturating_add(lease), now],
            )?;
            if changed == 1 {
                return Ok(Claim::Claimed);
            }
            let state: Option<i64> =
                c.query_row("SELECT state FROM claims WHERE key = ?1", params![key], |r| r.get(0)).optional()?;
            Ok(if state == Some(DONE) { Claim::Done } else { Claim::Busy })
        })
        .await
    }

    pub async fn complete(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        let key = key.to_string();
        let ttl = millis(ttl);
        self.with(move |c| {
            c.execute(
                "INSERT INTO claims (key, state, expires_at) VALUES (?1, ?2, ?3)
                 ON CONFLICT (key) DO UPDATE SET state = ?2, expires_at = ?3",
                params![key, DONE, now_ms().saturating_add(ttl)],
            )
            .map(|_| ())
        })
        .await
    }

    pub async fn release(&self, key: &str) -> Result<(), StoreError> {
        let key = key.to_string();
        self.with(move |c| {
            c.execute("DELETE FROM claims WHERE key = ?1 AND state = ?2", params![key, IN_PROGRESS]).map(|_| ())
        })
        .await
    }

    pub async fn purge(&self) -> Result<usize, StoreError> {
        self.with(|c| c.execute("DELETE FROM claims WHERE expires_at <= ?1", params![now_ms()])).await
    }

    /// Keys stored, expired or not (for tests of the purge).
    pub async fn count(&self) -> Result<usize, StoreError> {
        self.with(|c| c.query_row("SELECT count(*) FROM claims", [], |r| r.get::<_, i64>(0)))
            .await
            .map(|n| usize::try_from(n).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("state/dedup.sqlite")).unwrap();
        (dir, store)
    }

    #[tokio::test]
    async fn claim_complete_release_cycle() {
        let (_dir, s) = store();
        let lease = Duration::from_secs(60);
        assert_eq!(s.claim("k", lease).await.unwrap(), Claim::Claimed);
        assert_eq!(s.claim("k", lease).await.unwrap(), Claim::Busy);
        s.release("k").await.unwrap();
        assert_eq!(s.claim("k", lease).await.unwrap(), Claim::Claimed);
        s.complete("k", Duration::from_secs(60)).await.unwrap();
        assert_eq!(s.claim("k", lease).await.unwrap(), Claim::Done);
        // release never undoes a completion
        s.release("k").await.unwrap();
        assert_eq!(s.claim("k", lease).await.unwrap(), Claim::Done);
    }

    #[tokio::test]
    async fn expired_leases_and_keys_can_be_claimed_again_and_are_purged() {
        let (_dir, s) = store();
        assert_eq!(s.claim("lease", Duration::from_millis(1)).await.unwrap(), Claim::Claimed);
        s.complete("done", Duration::from_millis(1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(s.claim("lease", Duration::from_secs(60)).await.unwrap(), Claim::Claimed);
        assert_eq!(s.claim("done", Duration::from_secs(60)).await.unwrap(), Claim::Claimed);
        s.complete("old", Duration::from_millis(1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(s.purge().await.unwrap(), 1);
        assert_eq!(s.count().await.unwrap(), 2);
    }

    #[tokio::test]
    async fn survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sqlite");
        SqliteStore::open(&path).unwrap().complete("k", Duration::from_secs(60)).await.unwrap();
        let again = SqliteStore::open(&path).unwrap();
        assert_eq!(again.claim("k", Duration::from_secs(1)).await.unwrap(), Claim::Done);
    }
}
