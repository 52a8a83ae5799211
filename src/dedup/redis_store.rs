//! The shared store: Redis, so many runners on many machines agree. A claim is one atomic
//! script (`SET NX PX` or read what is there); leases carry this runner's id so a runner never
//! releases a lease another runner took over. Keys expire natively. The URL may carry the
//! Redis broker's `?prefix=` (and `?lease=`, unused here): keys are `PREFIX` + `dedup:` + key,
//! `sluice:dedup:` by default, so a Redis broker and its keys share one deployment's prefix.

use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionManager;

use super::{Claim, StoreError, millis};

const DONE: &str = "done";

/// The Redis idempotency store.
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    /// What every key starts with.
    prefix: String,
    /// `busy:<runner id>`: the value of this runner's leases.
    lease_value: String,
    claim_script: Script,
    release_script: Script,
}

fn err(e: redis::RedisError) -> StoreError {
    StoreError::new(format!("redis: {e}"))
}

impl RedisStore {
    /// Connects (the manager reconnects by itself after a drop).
    pub async fn open(url: &str) -> Result<RedisStore, StoreError> {
        let location = crate::broker::redis::Location::parse(url).map_err(|e| StoreError::new(e.to_string()))?;
        let client = redis::Client::open(location.url.as_str()).map_err(err)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(1);
        let connection = ConnectionManager::new_with_config(client, config).await.map_err(err)?;
        Ok(RedisStore {
            connection,
            prefix: format!("{}dedup:", location.prefix),
            lease_value: format!("busy:{}", uuid::Uuid::now_v7()),
            claim_script: Script::new(
                "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 'claimed' end
                 return redis.call('GET', KEYS[1]) or 'claimed-late'",
            ),
            release_script: Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            ),
        })
    }

    pub async fn claim(&self, key: &str, lease: Duration) -> Result<Claim, StoreError> {
        let mut c = self.connection.clone();
        let answer: String = self
            .claim_script
            .key(format!("{}{key}", self.prefix))
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
        let mut c = self.connection.clone();
        let ttl = u64::try_from(millis(ttl)).unwrap_or(u64::MAX).max(1);
        let mut pipe = redis::pipe();
        for key in keys {
            pipe.pset_ex(format!("{}{key}", self.prefix), DONE, ttl).ignore();
        }
        pipe.query_async::<()>(&mut c).await.map_err(err)
    }

    pub async fn release(&self, key: &str) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        self.release_script
            .key(format!("{}{key}", self.prefix))
            .arg(&self.lease_value)
            .invoke_async::<i64>(&mut c)
            .await
            .map(|_| ())
            .map_err(err)
    }
}
