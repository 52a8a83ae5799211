//! Idempotency stores: `claim(key, lease)` → `Claimed | Done | Busy`, `complete(key, ttl)`,
//! `release(key)`. Embedded (the keys in the embedded broker's SQLite file, shared by the
//! processes on one state directory; with the embedded broker, completed keys are written in
//! the transaction of their acks) or Redis (many runners on many machines). Keys are
//! namespaced by queue, so a fan-out's queues each handle the same event once; expired keys
//! are deleted (embedded) or expire natively (Redis).
//!
//! A store only remembers; what to do with `Busy` or an unreachable store is the runtime's call.

mod embedded;
mod redis_store;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use embedded::EmbeddedStore;
pub use redis_store::RedisStore;

pub use crate::broker::embedded::Claim;
use crate::broker::embedded::Embedded;

/// The store could not answer.
#[derive(Debug, Clone, thiserror::Error)]
#[error("idempotency store: {message}")]
pub struct StoreError {
    pub message: String,
    /// No retry mends it: the embedded broker's file is damaged, deleted or replaced.
    pub damaged: bool,
}

impl StoreError {
    /// An error that a later try may not meet.
    pub fn new(message: impl Into<String>) -> StoreError {
        StoreError { message: message.into(), damaged: false }
    }
}

/// Where idempotency keys live, chosen by `--dedup`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A state directory, whose `broker.db` holds the keys (by default the embedded broker's
    /// directory, else `.sluice`).
    File(PathBuf),
    /// A Redis URL (`redis://`, `rediss://`, `redis+sentinel://` or `redis+cluster://`).
    Redis(String),
}

impl Location {
    /// Parses `--dedup`: a redis URL, `file:PATH`, or a path.
    pub fn parse(text: &str) -> Location {
        if ["redis://", "rediss://", crate::broker::redis::link::SENTINEL, crate::broker::redis::link::CLUSTER]
            .iter()
            .any(|s| text.starts_with(s))
        {
            Location::Redis(text.to_string())
        } else {
            Location::File(PathBuf::from(text.strip_prefix("file:").unwrap_or(text)))
        }
    }
}

/// Whether `dir` is the idempotency store of an earlier sluice (fjall's layout), which this
/// version no longer reads.
pub fn is_old_store(dir: &Path) -> bool {
    dir.join("keyspaces").is_dir() && dir.join("version").is_file()
}

/// What to do about an earlier sluice's store at `old`: its keys are not carried over.
pub fn old_store_advice(old: &Path) -> String {
    format!(
        "{} is the idempotency store of an earlier sluice, which this version no longer reads: keys now \
         live in the state directory's broker.db (--dedup names that directory; by default the embedded \
         broker's, else .sluice). A message handled before the upgrade whose duplicate comes within its ttl \
         runs once more. Delete {} once no earlier sluice runs on it",
        old.display(),
        old.display()
    )
}

/// An open store.
#[derive(Clone)]
pub enum Store {
    Embedded(EmbeddedStore),
    Redis(Box<RedisStore>),
}

impl Store {
    /// Opens (creating if need be) the store at `location`; `allow_evicting_redis` takes a
    /// Redis whose `maxmemory-policy` can evict keys.
    pub async fn open(location: &Location, allow_evicting_redis: bool) -> Result<Store, StoreError> {
        match location {
            Location::File(dir) => Ok(Store::Embedded(EmbeddedStore::open(dir)?)),
            Location::Redis(url) => Ok(Store::Redis(Box::new(RedisStore::open(url, allow_evicting_redis).await?))),
        }
    }

    /// The store in the runner's own embedded broker: keys ride on the acks.
    pub fn in_broker(broker: &Embedded) -> Store {
        Store::Embedded(EmbeddedStore::in_broker(broker))
    }

    /// The store when its keys are the Redis broker's own deployment's (one server, one
    /// prefix): keys ride on the acks.
    pub fn riding_redis_acks(self) -> Store {
        match self {
            Store::Redis(s) => Store::Redis(Box::new(s.riding_acks())),
            other => other,
        }
    }

    /// Whether completed keys are recorded by the acks themselves
    /// ([`crate::broker::Consumer::ack_recording`]) rather than by [`Store::complete`] first.
    pub fn rides_acks(&self) -> bool {
        match self {
            Store::Embedded(s) => s.rides_acks(),
            Store::Redis(s) => s.rides_acks(),
        }
    }

    /// Takes the key for `lease` unless it is done or leased by someone else.
    pub async fn claim(&self, queue: &str, key: &str, lease: Duration) -> Result<Claim, StoreError> {
        match self {
            Store::Embedded(s) => s.claim(&namespaced(queue, key), lease).await,
            Store::Redis(s) => s.claim(&namespaced(queue, key), lease).await,
        }
    }

    /// Marks the keys handled for `ttl`, all at once (one transaction or round trip).
    pub async fn complete(&self, queue: &str, keys: &[String], ttl: Duration) -> Result<(), StoreError> {
        let keys = names(queue, keys);
        match self {
            Store::Embedded(s) => s.complete(&keys, ttl).await,
            Store::Redis(s) => s.complete(&keys, ttl).await,
        }
    }

    /// Gives up this worker's lease so another attempt can claim the key.
    pub async fn release(&self, queue: &str, key: &str) -> Result<(), StoreError> {
        match self {
            Store::Embedded(s) => s.release(&namespaced(queue, key)).await,
            Store::Redis(s) => s.release(&namespaced(queue, key)).await,
        }
    }
}

/// The keys of `queue` as the store names them.
pub fn names(queue: &str, keys: &[String]) -> Vec<String> {
    keys.iter().map(|key| namespaced(queue, key)).collect()
}

/// One key space per queue: the queue name cannot contain a NUL.
fn namespaced(queue: &str, key: &str) -> String {
    format!("{queue}\u{0}{key}")
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_earlier_sluices_store_is_known_by_its_layout() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(!is_old_store(dir.path()));
        std::fs::create_dir(dir.path().join("keyspaces")).expect("mkdir");
        std::fs::write(dir.path().join("version"), b"3").expect("write");
        assert!(is_old_store(dir.path()));
    }

    #[test]
    fn locations() {
        assert_eq!(Location::parse("redis://127.0.0.1:6379/0"), Location::Redis("redis://127.0.0.1:6379/0".into()));
        assert_eq!(Location::parse("file:/tmp/d"), Location::File("/tmp/d".into()));
        assert_eq!(Location::parse("state/d"), Location::File("state/d".into()));
    }
}
