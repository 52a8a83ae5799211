//! The embedded store: one SQLite file in WAL mode with `synchronous = NORMAL`, which keeps
//! every committed claim across a killed process (only an OS crash can lose the last ones).
//! One writer thread owns the connection and commits the calls that queue up meanwhile in one
//! transaction (group commit); each caller hears back only after its transaction committed.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension, params};
use tokio::sync::{mpsc, oneshot};

use super::{Claim, StoreError, millis};

const IN_PROGRESS: i64 = 0;
const DONE: i64 = 1;

/// The embedded idempotency store.
#[derive(Clone)]
pub struct SqliteStore {
    jobs: mpsc::UnboundedSender<Job>,
}

/// A call run on the writer thread; what it returns answers the caller once the batch's
/// transaction has committed (or failed).
type Job = Box<dyn FnOnce(&Connection) -> Answer + Send>;
type Answer = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// The most calls committed in one transaction.
const BATCH: usize = 512;

fn writer(connection: Connection, mut jobs: mpsc::UnboundedReceiver<Job>) {
    while let Some(first) = jobs.blocking_recv() {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let begun = connection.execute_batch("BEGIN IMMEDIATE").map_err(err);
        let answers: Vec<Answer> = batch.into_iter().map(|job| job(&connection)).collect();
        let committed = begun.and_then(|()| connection.execute_batch("COMMIT").map_err(err));
        if committed.is_err() {
            let _ = connection.execute_batch("ROLLBACK");
        }
        for answer in answers {
            answer(committed.clone());
        }
    }
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
        let (jobs, receiver) = mpsc::unbounded_channel();
        std::thread::Builder::new()
            .name("sluice-dedup".into())
            .spawn(move || writer(connection, receiver))
            .map_err(|e| StoreError(format!("cannot start the store's writer thread: {e}")))?;
        Ok(SqliteStore { jobs })
    }

    async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        let job: Job = Box::new(move |connection| {
            let result = f(connection).map_err(err);
            Box::new(move |committed: Result<(), StoreError>| {
                let _ = reply.send(committed.and(result));
            })
        });
        let stopped = || StoreError("the store's writer thread stopped".into());
        self.jobs.send(job).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    pub async fn claim(&self, key: &str, lease: Duration) -> Result<Claim, StoreError> {
        let key = key.to_string();
        let lease = millis(lease);
        self.with(move |c| {
            let now = now_ms();
            // Insert, or take over a row whose lease or TTL has run out.
            let changed = c
                .prepare_cached(
                    "INSERT INTO claims (key, state, expires_at) VALUES (?1, ?2, ?3)
                     ON CONFLICT (key) DO UPDATE SET state = ?2, expires_at = ?3 WHERE claims.expires_at <= ?4",
                )?
                .execute(params![key, IN_PROGRESS, now.saturating_add(lease), now])?;
            if changed == 1 {
                return Ok(Claim::Claimed);
            }
            let state: Option<i64> = c
                .prepare_cached("SELECT state FROM claims WHERE key = ?1")?
                .query_row(params![key], |r| r.get(0))
                .optional()?;
            Ok(if state == Some(DONE) { Claim::Done } else { Claim::Busy })
        })
        .await
    }

    pub async fn complete(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        let key = key.to_string();
        let ttl = millis(ttl);
        self.with(move |c| {
            c.prepare_cached(
                "INSERT INTO claims (key, state, expires_at) VALUES (?1, ?2, ?3)
                 ON CONFLICT (key) DO UPDATE SET state = ?2, expires_at = ?3",
            )?
            .execute(params![key, DONE, now_ms().saturating_add(ttl)])
            .map(|_| ())
        })
        .await
    }

    pub async fn release(&self, key: &str) -> Result<(), StoreError> {
        let key = key.to_string();
        self.with(move |c| {
            c.prepare_cached("DELETE FROM claims WHERE key = ?1 AND state = ?2")?
                .execute(params![key, IN_PROGRESS])
                .map(|_| ())
        })
        .await
    }

    pub async fn purge(&self) -> Result<usize, StoreError> {
        self.with(|c| c.execute("DELETE FROM claims WHERE expires_at <= ?1", params![now_ms()])).await
    }

    /// Keys stored, expired or not (for tests of the purge).
    #[cfg(test)]
    async fn count(&self) -> Result<usize, StoreError> {
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
