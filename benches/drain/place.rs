//! Where a trial's messages live: a RabbitMQ vhost of its own, a fresh directory of the
//! embedded broker, or a key prefix of its own on Redis. Either way the pipeline's topology is
//! declared through sluice's own plan and the backlog published with confirms, through the
//! `Broker` trait, before any consumer starts; the loading session is closed before the
//! consumer starts, so the consumer is alone on the broker (for the embedded broker: the only
//! process with the file open).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures_util::{StreamExt as _, TryStreamExt as _, stream};
use sluice::broker::amqp::Amqp;
use sluice::broker::embedded::{self, Embedded};
use sluice::broker::redis::Redis;
use sluice::broker::{Broker, Outgoing, Publish};
use sluice::envelope::Envelope;

use crate::QueueType;
use crate::keyspace::{Keyspace, Usage};
use crate::rabbit::Vhost;

/// Publishes awaiting their confirm at once, as `sluice publish --jsonl` does.
const IN_FLIGHT: usize = 256;

/// A trial's broker; removed on drop unless kept.
pub enum Place {
    Vhost(Vhost),
    /// The embedded broker's directory (outside the watched pipeline directory).
    Embedded(tempfile::TempDir),
    /// A key prefix on the Redis server (`--redis`).
    Redis(Keyspace),
}

impl Place {
    /// A place for `queue`'s trial; a Redis one on the server `redis` (`redis://host:port`).
    pub fn new(queue: QueueType, redis: &str) -> anyhow::Result<Place> {
        Ok(match queue {
            QueueType::Embedded => Place::Embedded(tempfile::Builder::new().prefix("sluice-bench-broker-").tempdir()?),
            QueueType::Redis => Place::Redis(Keyspace::new(redis)),
            QueueType::Classic | QueueType::Quorum => Place::Vhost(Vhost::new()?),
        })
    }

    /// What `sluice run --broker` takes.
    pub fn url(&self) -> String {
        match self {
            Place::Vhost(vhost) => vhost.url(),
            Place::Embedded(dir) => dir.path().display().to_string(),
            Place::Redis(keys) => keys.url(),
        }
    }

    /// The embedded broker's files (`broker.db` and its `-wal` and `-shm`).
    pub fn files(&self) -> Option<PathBuf> {
        match self {
            Place::Embedded(dir) => Some(dir.path().join(embedded::FILE)),
            Place::Vhost(_) | Place::Redis(_) => None,
        }
    }

    /// On Redis, what the server uses and the keys under the trial's prefix.
    pub fn redis_usage(&self) -> anyhow::Result<Option<(Usage, usize)>> {
        match self {
            Place::Redis(keys) => Ok(Some((keys.usage()?, keys.count()?))),
            Place::Vhost(_) | Place::Embedded(_) => Ok(None),
        }
    }

    /// Declares the topology of the pipeline in `pipelines` as `sluice run` will, then
    /// publishes `count` envelopes; returns the publish rate (msg/s).
    pub async fn load(&self, pipelines: &Path, exchange: &str, routing_key: &str, count: u64) -> anyhow::Result<f64> {
        let validation = sluice::config::load(&[pipelines.to_path_buf()]);
        let Some(config) = validation.config else {
            bail!("bench pipeline is invalid: {:?}", validation.diagnostics);
        };
        let plan = sluice::topology::plan(&config);
        match self {
            Place::Vhost(vhost) => {
                let broker = Amqp::connect(&vhost.url(), sluice::broker::amqp::Timeouts::default()).await?;
                broker.declare(&plan).await?;
                let rate = preload(&broker, exchange, routing_key, count).await;
                broker.close().await;
                rate
            }
            Place::Embedded(dir) => {
                let broker = Embedded::open_dir(dir.path())?;
                broker.declare(&plan).await?;
                let rate = preload(&broker, exchange, routing_key, count).await;
                broker.close().await;
                drop(broker);
                // The last handle gone, the writer thread closes the file, and SQLite, closing
                // its last connection, checkpoints the write-ahead log and deletes it: wait for
                // that, so that the consumer starts on the file as `sluice publish` leaves it.
                let wal = self.files().map(|f| wal(&f)).context("no file")?;
                let started = Instant::now();
                while wal.exists() && started.elapsed() < Duration::from_secs(10) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                rate
            }
            Place::Redis(keys) => {
                let broker = Redis::connect(&keys.url()).await?;
                broker.declare(&plan).await?;
                let rate = preload(&broker, exchange, routing_key, count).await;
                broker.close().await;
                rate
            }
        }
    }

    /// Leaves the vhost or the directory in place, for looking into a failed trial; says where.
    pub fn keep(self) -> String {
        match self {
            Place::Vhost(mut vhost) => {
                vhost.keep();
                let name = &vhost.name;
                format!("vhost {name} (rabbitmqctl list_queues -p {name}; rabbitmqctl delete_vhost {name})")
            }
            Place::Embedded(dir) => format!("embedded broker {}", dir.keep().display()),
            Place::Redis(mut keys) => {
                keys.keep();
                let prefix = &keys.prefix;
                format!("Redis keys {prefix}* (redis-cli --scan --pattern '{prefix}*' | xargs redis-cli unlink)")
            }
        }
    }
}

/// SQLite's write-ahead log beside `db`.
pub fn wal(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push("-wal");
    PathBuf::from(name)
}

/// Bytes of the embedded broker's files (the database, its write-ahead log and shared memory).
pub fn disk_bytes(db: &Path) -> u64 {
    let mut shm = db.as_os_str().to_owned();
    shm.push("-shm");
    [db.to_path_buf(), wal(db), PathBuf::from(shm)]
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum()
}

/// Bytes of the write-ahead log alone.
pub fn wal_bytes(db: &Path) -> u64 {
    std::fs::metadata(wal(db)).map_or(0, |m| m.len())
}

/// Publishes `count` envelopes to `exchange`/`routing_key`, each confirmed; returns msg/s.
async fn preload<B: Publish>(broker: &B, exchange: &str, routing_key: &str, count: u64) -> anyhow::Result<f64> {
    let started = Instant::now();
    stream::iter(0..count)
        .map(|i| {
            let payload = serde_json::json!({"order_id": i, "amount_cents": 1999, "email": "bench@example.com"});
            let envelope = Envelope::new("order.created", &payload, None);
            let message = Outgoing {
                body: envelope.encode(),
                message_id: Some(envelope.id.clone()),
                kind: Some(envelope.kind.clone()),
                ..Default::default()
            };
            async move { broker.publish(exchange, routing_key, message).await }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(count as f64 / started.elapsed().as_secs_f64())
}
