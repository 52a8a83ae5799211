//! Idempotency stores: `claim(key, lease)` → `Claimed | Done | Busy`, `complete(key, ttl)`,
//! `release(key)`. Embedded (completions in a fjall LSM store, claims in memory: one runner,
//! survives kill -9) or Redis (many runners on many machines). Keys are namespaced by queue,
//! so a fan-out's queues each handle the same event once; expired keys are dropped by
//! compactions (embedded) or expire natively (Redis).
//!
//! A store only remembers; what to do with `Busy` or an unreachable store is the runtime's call.

mod embedded;
mod redis_store;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use sha2::{Digest as _, Sha256};

pub use embedded::EmbeddedStore;
pub use redis_store::RedisStore;

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This worker owns the key until the lease ends: run the handler.
    Claimed,
    /// Already handled successfully within its TTL: a duplicate.
    Done,
    /// Another worker holds a live lease on it.
    Busy,
}

/// The store could not answer.
#[derive(Debug, Clone, thiserror::Error)]
#[error("idempotency store: {0}")]
pub struct StoreError(pub String);

/// Where idempotency keys live, chosen by `--dedup`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A directory for the embedded store (the default: `.sluice/dedup`).
    File(PathBuf),
    /// A Redis URL (`redis://` or `rediss://`).
    Redis(String),
}

impl Location {
    /// Parses `--dedup`: a redis URL, `file:PATH`, or a path.
    pub fn parse(text: &str) -> Location {
        if text.starts_with("redis://") || text.starts_with("rediss://") {
            Location::Redis(text.to_string())
        } else {
            Location::File(PathBuf::from(text.strip_prefix("file:").unwrap_or(text)))
        }
    }
}

impl Default for Location {
    fn default() -> Self {
        Location::File(PathBuf::from(".sluice/dedup"))
    }
}

/// An open store.
#[derive(Clone)]
pub enum Store {
    Embedded(EmbeddedStore),
    Redis(RedisStore),
}

impl Store {
    /// Opens (creating if need be) the store at `location`.
    pub async fn open(location: &Location) -> Result<Store, StoreError> {
        match location {
            Location::File(path) => Ok(Store::Embedded(EmbeddedStore::open(path)?)),
            Location::Redis(url) => Ok(Store::Redis(RedisStore::open(url).await?)),
        }
    }

    /// Takes the key for `lease` unless it is done or leased by someone else.
    pub async fn claim(&self, queue: &str, key: &str, lease: Duration) -> Result<Claim, StoreError> {
        match self {
            Store::Embedded(s) => s.claim(&namespaced(queue, key), lease),
            Store::Redis(s) => s.claim(&namespaced(queue, key), lease).await,
        }
    }

    /// Marks the keys handled for `ttl`, all at once (one transaction or round trip).
    pub async fn complete(&self, queue: &str, keys: &[String], ttl: Duration) -> Result<(), StoreError> {
        let keys: Vec<String> = keys.iter().map(|key| namespaced(queue, key)).collect();
        match self {
            Store::Embedded(s) => s.complete(&keys, ttl),
            Store::Redis(s) => s.complete(&keys, ttl).await,
        }
    }

    /// Gives up this worker's lease so another attempt can claim the key.
    pub async fn release(&self, queue: &str, key: &str) -> Result<(), StoreError> {
        match self {
            Store::Embedded(s) => {
                s.release(&namespaced(queue, key));
                Ok(())
            }
            Store::Redis(s) => s.release(&namespaced(queue, key)).await,
        }
    }
}

/// Keys longer than this are known by their digest, in the stores and downstream alike.
pub const MAX_KEY_BYTES: usize = 256;

/// The key as stored and as sent downstream (`Idempotency-Key`, `SLUICE_IDEMPOTENCY_KEY`): the
/// key itself, or for a key over [`MAX_KEY_BYTES`], `sha256:` and its SHA-256 in lowercase hex.
/// Producers choose keys, so their length is theirs too; the embedded store refuses keys of
/// 64 KiB, and receivers cap header sizes far below that.
pub fn effective_key(key: String) -> String {
    if key.len() <= MAX_KEY_BYTES {
        return key;
    }
    let digest = Sha256::digest(key.as_bytes());
    let mut text = String::with_capacity(7 + 64);
    text.push_str("sha256:");
    for byte in digest {
        // Writing to a String cannot fail.
        let _ = write!(text, "{byte:02x}");
    }
    text
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
    fn long_keys_are_known_by_their_digest() {
        let short = "k".repeat(MAX_KEY_BYTES);
        assert_eq!(effective_key(short.clone()), short);
        // Issue 9: a 70 KB key (the embedded store panicked at 64 KiB) becomes 71 bytes.
        let long = "k".repeat(70_000);
        let digest = effective_key(long.clone());
        assert_eq!(digest.len(), 71);
        assert!(
            digest.starts_with("sha256:")
                && digest[7..].bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(effective_key(long), digest);
        assert_ne!(effective_key("k".repeat(MAX_KEY_BYTES + 1)), digest);
        assert_eq!(
            effective_key("a".repeat(MAX_KEY_BYTES + 1)),
            format!("sha256:{:x}", Sha256::digest("a".repeat(MAX_KEY_BYTES + 1)))
        );
    }

    #[test]
    fn locations() {
        assert_eq!(Location::parse("redis://127.0.0.1:6379/0"), Location::Redis("redis://127.0.0.1:6379/0".into()));
        assert_eq!(Location::parse("file:/tmp/d"), Location::File("/tmp/d".into()));
        assert_eq!(Location::parse("state/d"), Location::File("state/d".into()));
    }
}
