//! The shared store: Redis, so many runners on many machines agree. A claim is one atomic
//! script (`SET NX PX` or read what is there); leases carry this runner's id so a runner never
//! releases a lease another runner took over. Keys expire natively. The URL may carry the
//! Redis broker's `?prefix=` (and `?lease=`, unused here): keys are `PREFIX` + `dedup:` + key,
//! `sluice:dedup:` by default, so a Redis broker and its keys share one deployment's prefix.
//!
//! The server is checked as the broker's is (the password, a standalone primary, every command
//! the store runs, and a `maxmemory-policy` that never evicts: `volatile-lru` evicts these keys
//! first, and messages run twice), when the store opens and every few seconds after: while the
//! server fails the check, claims and completions fail with its reason (messages wait). Its
//! scripts run on a full server: a runner draining it needs its claims and completions.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::Script;

use super::{Claim, StoreError, millis};
use crate::broker::redis::link::{Link, Timeouts};
use crate::broker::redis::server::{self, Checks, Purpose};
use crate::broker::redis::{DONE, Location};

/// The Redis idempotency store.
#[derive(Clone)]
pub struct RedisStore {
    connection: Link,
    /// The deployment (its prefix names the keys: [`Location::idempotency_key`]).
    location: Location,
    /// `busy:<runner id>`: the value of this runner's leases.
    lease_value: String,
    claim_script: Script,
    complete_script: Script,
    release_script: Script,
    /// On a cluster, the hash tags of the queues whose keys it named ([`RedisStore::name`]).
    tags: Arc<Mutex<std::collections::HashMap<String, String>>>,
    /// Why the server may not be used, as its last check found: every call fails with it.
    refused: Arc<Mutex<Option<String>>>,
    /// The keys are the Redis broker's deployment's: its acks record them.
    rides_acks: bool,
}

fn err(e: redis::RedisError) -> StoreError {
    StoreError::new(format!("redis: {e}"))
}

impl RedisStore {
    /// Connects (to one server, reconnecting by itself after a drop, or to the primary the
    /// sentinels name, found again after a loss) once the server passes the
    /// checks; `allow_evicting` runs on a server whose policy can evict keys.
    pub async fn open(url: &str, allow_evicting: bool) -> Result<RedisStore, StoreError> {
        let location = Location::parse(url).map_err(|e| StoreError::new(e.to_string()))?;
        let shown = crate::broker::amqp::redact(url);
        let timeouts = Timeouts { connect: Duration::from_secs(2), response: Duration::from_secs(2) };
        let mut connection =
            Link::open(&location.url, timeouts, 1).await.map_err(|e| refusal(&server::opening_error(&shown, e)))?;
        let user = connection.user();
        let checks = Checks::new(Purpose::Dedup, allow_evicting);
        server::check(&mut connection, &location, &user, &shown, &checks).await.map_err(|e| refusal(&e))?;
        let store = RedisStore {
            connection,
            location: location.clone(),
            lease_value: format!("busy:{}", uuid::Uuid::now_v7()),
            claim_script: Script::new(
                "#!lua flags=allow-oom
                 if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 'claimed' end
                 return redis.call('GET', KEYS[1]) or 'claimed-late'",
            ),
            complete_script: Script::new(
                "#!lua flags=allow-oom
                 for _, key in ipairs(KEYS) do redis.call('SET', key, ARGV[1], 'PX', ARGV[2]) end
                 return #KEYS",
            ),
            release_script: Script::new(
                "#!lua flags=allow-oom
                 if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            ),
            tags: Arc::default(),
            refused: Arc::default(),
            rides_acks: false,
        };
        let watched = (store.connection.clone(), Arc::downgrade(&store.refused));
        tokio::spawn(watch(watched, location, shown, checks));
        Ok(store)
    }

    /// This store, its keys recorded by the acks of a Redis broker on the same server and
    /// prefix.
    pub fn riding_acks(self) -> RedisStore {
        RedisStore { rides_acks: true, ..self }
    }

    pub fn rides_acks(&self) -> bool {
        self.rides_acks
    }

    /// An idempotency key's name (`key` is `QUEUE\0KEY`): on a cluster in its queue's slot,
    /// under the hash tag the queue was declared with (the topology's `tags`, read once per
    /// queue; a queue not tagged yet goes by its name).
    async fn name(&self, key: &str) -> Result<String, StoreError> {
        let Some((queue, rest)) = key.split_once('\0').filter(|_| self.location.cluster) else {
            return Ok(self.location.idempotency_key(key));
        };
        let known = crate::broker::kit::lock(&self.tags).get(queue).cloned();
        let tag = match known {
            Some(tag) => tag,
            None => {
                let mut c = self.connection.clone();
                let found: Option<String> = redis::cmd("HGET")
                    .arg(self.location.topology_key("tags"))
                    .arg(queue)
                    .query_async(&mut c)
                    .await
                    .map_err(err)?;
                if let Some(tag) = &found {
                    crate::broker::kit::lock(&self.tags).insert(queue.to_string(), tag.clone());
                }
                found.unwrap_or_else(|| queue.to_string())
            }
        };
        Ok(self.location.idempotency_key(&format!("{tag}\0{rest}")))
    }

    /// Fails while the server's last check refused it.
    fn usable(&self) -> Result<(), StoreError> {
        match &*self.refused.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) {
            Some(why) => Err(StoreError::new(why.clone())),
            None => Ok(()),
        }
    }

    pub async fn claim(&self, key: &str, lease: Duration) -> Result<Claim, StoreError> {
        self.usable()?;
        let mut c = self.connection.clone();
        let answer: String = self
            .claim_script
            .key(self.name(key).await?)
            .arg(&self.lease_value)
            .arg(millis(lease).max(1))
            .invoke_async(&mut c)
            .await
            .map_err(err)?;
        Ok(match answer.as_str() {
            "claimed" => Claim::Claimed,
            DONE => Claim::Done,
            // The key expired between SET and GET: nobody holds it, but try again later
            // rather than run without a lease.
            _ => Claim::Busy,
        })
    }

    /// Records the keys done in one round trip.
    pub async fn complete(&self, keys: &[String], ttl: Duration) -> Result<(), StoreError> {
        self.usable()?;
        if keys.is_empty() {
            return Ok(());
        }
        let ttl = u64::try_from(millis(ttl)).unwrap_or(u64::MAX).max(1);
        let mut names = Vec::with_capacity(keys.len());
        for key in keys {
            names.push(self.name(key).await?);
        }
        // On a cluster, a queue's keys are in its slot: the keys of several queues go apart.
        let chunks: Vec<&[String]> =
            if self.connection.is_cluster() { names.chunks(1).collect() } else { vec![&names] };
        let each = chunks.into_iter().map(|names| {
            let mut invocation = self.complete_script.prepare_invoke();
            for name in names {
                invocation.key(name);
            }
            let mut c = self.connection.clone();
            async move { invocation.arg(DONE).arg(ttl).invoke_async::<i64>(&mut c).await }
        });
        futures_util::future::try_join_all(each).await.map(|_| ()).map_err(err)
    }

    pub async fn release(&self, key: &str) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        self.release_script
            .key(self.name(key).await?)
            .arg(&self.lease_value)
            .invoke_async::<i64>(&mut c)
            .await
            .map(|_| ())
            .map_err(err)
    }
}

/// The store's words for a server refused (or not reached) as the broker says it.
fn refusal(e: &crate::broker::BrokerError) -> StoreError {
    match e {
        crate::broker::BrokerError::Refused { url, reason } => StoreError::new(format!("{url}: {reason}")),
        other => StoreError::new(other.to_string()),
    }
}

/// Checks the store's server every [`server::WATCH`] while the store lives (a reconnect of its
/// connection can find another server, or the same with another policy): a refusal is kept,
/// logged once, for every call to fail with until a check passes again.
async fn watch(
    (mut c, refused): (Link, Weak<Mutex<Option<String>>>),
    location: Location,
    shown: String,
    checks: Checks,
) {
    loop {
        tokio::time::sleep(server::WATCH).await;
        let found = server::inspect(&mut c, &location, &shown, &checks, false).await;
        let Some(refused) = refused.upgrade() else { return };
        let now = match found {
            Err(e) if e.is_fatal() => Some(refusal(&e).message),
            // Unreachable: the calls say so themselves.
            Err(_) => continue,
            Ok(_) => None,
        };
        let mut kept = refused.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match (&*kept, &now) {
            (None, Some(why)) => {
                tracing::error!(error = %why, "the idempotency store's Redis can no longer be used: messages wait until it can")
            }
            (Some(_), None) => tracing::info!("the idempotency store's Redis can be used again"),
            _ => {}
        }
        *kept = now;
    }
}
