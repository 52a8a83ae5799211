//! The embedded store, for one runner: completed keys in a fjall database (an LSM tree: a
//! journal appended per batch, sorted tables written in the background), claims in memory.
//!
//! A claim only has to outlive its handler, and the handler dies with the runner: after a
//! crash the messages it had in flight come back and may be claimed again at once, which is
//! what a lease ending would allow anyway. So a claim costs a map lookup and one read, and the
//! store is written only when keys are done: the runtime completes each batch of keys it is
//! about to ack in one write batch, which is in the OS's hands (and so survives `kill -9`)
//! before the acks go out. A key's value is when it expires; compactions drop expired keys,
//! so the store does not grow without bound.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fjall::compaction::filter::{CompactionFilter, Context, Factory, ItemAccessor, Verdict};
use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};

use super::{Claim, StoreError, millis};

const KEYSPACE: &str = "done";

/// Small memtables and cache: the store must not dominate the runner's memory.
const MEMTABLE_BYTES: u64 = 2 << 20;
const CACHE_BYTES: u64 = 4 << 20;

/// The embedded idempotency store.
#[derive(Clone)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// Keys this runner's handlers hold, and when each lease ends.
    leases: Mutex<HashMap<String, Instant>>,
    db: Database,
    done: Keyspace,
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(e.to_string())
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(millis).unwrap_or_default()
}

fn expiry(value: &[u8]) -> i64 {
    value.try_into().map(i64::from_le_bytes).unwrap_or_default()
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the map leaves nothing half-done in it.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Drops expired keys when compactions rewrite them.
struct DropExpired;

impl Factory for DropExpired {
    fn name(&self) -> &str {
        "sluice-drop-expired"
    }

    fn make_filter(&self, _: &Context) -> Box<dyn CompactionFilter> {
        Box::new(ExpiredBefore(now_ms()))
    }
}

struct ExpiredBefore(i64);

impl CompactionFilter for ExpiredBefore {
    fn filter_item(&mut self, item: ItemAccessor<'_>, _: &Context) -> Result<Verdict, fjall::LsmError> {
        Ok(if expiry(&item.value()?) <= self.0 { Verdict::Remove } else { Verdict::Keep })
    }
}

impl EmbeddedStore {
    /// Opens or creates the store's directory; fails if another runner has it open.
    pub fn open(path: &Path) -> Result<EmbeddedStore, StoreError> {
        let db = Database::builder(path)
            .cache_size(CACHE_BYTES)
            .with_compaction_filter_factories(Arc::new(|_| Some(Arc::new(DropExpired))))
            .open()
            .map_err(|e| match e {
                fjall::Error::Locked => StoreError(format!(
                    "{} is in use by another sluice run; give each runner its own --dedup directory, \
                     or share one Redis store between them (--dedup redis://HOST:6379)",
                    path.display()
                )),
                e => StoreError(format!("cannot open {}: {e}", path.display())),
            })?;
        let done = db
            .keyspace(KEYSPACE, || KeyspaceCreateOptions::default().max_memtable_size(MEMTABLE_BYTES))
            .map_err(err)?;
        Ok(EmbeddedStore { inner: Arc::new(Inner { leases: Mutex::default(), db, done }) })
    }

    /// Answers from memory and one read; nothing is written.
    pub fn claim(&self, key: &str, lease: Duration) -> Result<Claim, StoreError> {
        let now = Instant::now();
        {
            let mut leases = lock(&self.inner.leases);
            match leases.get_mut(key) {
                Some(until) if *until > now => return Ok(Claim::Busy),
                Some(until) => *until = now + lease,
                None => {
                    leases.insert(key.to_string(), now + lease);
                }
            }
        }
        match self.inner.done.get(key) {
            Ok(Some(value)) if expiry(&value) > now_ms() => {
                self.release(key);
                Ok(Claim::Done)
            }
            Ok(_) => Ok(Claim::Claimed),
            Err(e) => {
                self.release(key);
                Err(err(e))
            }
        }
    }

    /// Records the keys done in one write batch, and ends their leases once it is written (so
    /// a duplicate meanwhile finds its key busy, never free).
    pub fn complete(&self, keys: &[String], ttl: Duration) -> Result<(), StoreError> {
        let expires_at = now_ms().saturating_add(millis(ttl)).to_le_bytes();
        // In the OS's hands before the acks: a killed runner keeps every completion.
        let mut batch = self.inner.db.batch().durability(Some(PersistMode::Buffer));
        for key in keys {
            batch.insert(&self.inner.done, key.as_str(), expires_at);
        }
        batch.commit().map_err(err)?;
        let mut leases = lock(&self.inner.leases);
        for key in keys {
            leases.remove(key);
        }
        Ok(())
    }

    pub fn release(&self, key: &str) {
        lock(&self.inner.leases).remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, EmbeddedStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&dir.path().join("state/dedup")).unwrap();
        (dir, store)
    }

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn claim_complete_release_cycle() {
        let (_dir, s) = store();
        assert_eq!(s.claim("k", MINUTE).unwrap(), Claim::Claimed);
        assert_eq!(s.claim("k", MINUTE).unwrap(), Claim::Busy);
        s.release("k");
        assert_eq!(s.claim("k", MINUTE).unwrap(), Claim::Claimed);
        s.complete(&["k".into()], MINUTE).unwrap();
        assert_eq!(s.claim("k", MINUTE).unwrap(), Claim::Done);
        // release never undoes a completion
        s.release("k");
        assert_eq!(s.claim("k", MINUTE).unwrap(), Claim::Done);
        // a batch completes together
        let batch = ["a".to_string(), "b".to_string()];
        for key in &batch {
            assert_eq!(s.claim(key, MINUTE).unwrap(), Claim::Claimed);
        }
        s.complete(&batch, MINUTE).unwrap();
        for key in &batch {
            assert_eq!(s.claim(key, MINUTE).unwrap(), Claim::Done);
        }
    }

    #[test]
    fn expired_leases_and_keys_can_be_claimed_again() {
        let (_dir, s) = store();
        assert_eq!(s.claim("lease", Duration::from_millis(1)).unwrap(), Claim::Claimed);
        s.complete(&["done".into()], Duration::from_millis(1)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.claim("lease", MINUTE).unwrap(), Claim::Claimed);
        assert_eq!(s.claim("done", MINUTE).unwrap(), Claim::Claimed);
    }

    #[test]
    fn compactions_drop_expired_keys_so_the_store_does_not_grow() {
        let (_dir, s) = store();
        let keys = |prefix: &str| (0..1000).map(|i| format!("{prefix}{i}")).collect::<Vec<_>>();
        s.complete(&keys("old"), Duration::from_millis(1)).unwrap();
        s.complete(&keys("kept"), MINUTE).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let done = &s.inner.done;
        done.rotate_memtable_and_wait().unwrap();
        done.major_compact().unwrap();
        assert_eq!(done.len().unwrap(), 1000);
        assert!(done.prefix("old").next().is_none());
    }

    #[test]
    fn completions_survive_reopening_and_claims_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dedup");
        let first = EmbeddedStore::open(&path).unwrap();
        first.complete(&["done".into()], MINUTE).unwrap();
        assert_eq!(first.claim("held", MINUTE).unwrap(), Claim::Claimed);
        drop(first);
        let again = EmbeddedStore::open(&path).unwrap();
        assert_eq!(again.claim("done", Duration::from_secs(1)).unwrap(), Claim::Done);
        assert_eq!(again.claim("held", Duration::from_secs(1)).unwrap(), Claim::Claimed);
    }

    #[test]
    fn a_second_runner_on_the_same_store_is_refused() {
        let (dir, _first) = store();
        let e = EmbeddedStore::open(&dir.path().join("state/dedup")).err().unwrap();
        assert!(e.0.contains("in use by another sluice run"), "{e}");
    }
}
