//! `sluice status`: every pipeline queue at a glance, read from the broker (no management
//! plugin needed): ready messages, consumers, the dead-letter queue's depth and how long its
//! oldest message has waited, and the retries waiting in the shared delay queues.

use serde::Serialize;

use super::dlq;
use crate::broker::{Broker, BrokerError, Consumer as _};
use crate::config::Config;
use futures_util::StreamExt as _;

/// One pipeline queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    pub queue: String,
    pub ready: u32,
    pub consumers: u32,
    pub dead_letter_queue: String,
    pub dead_lettered: u32,
    /// Seconds since the oldest dead-lettered message failed.
    pub oldest_dead_letter_age_seconds: Option<u64>,
}

/// Every queue, and the retries waiting (RabbitMQ holds them in delay queues shared by all
/// queues, so only their total is known without reading them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Status {
    pub queues: Vec<Row>,
    pub retries_waiting: u32,
}

/// Reads the status of every queue in `config`.
pub async fn read<B: Broker>(broker: &B, config: &Config) -> Result<Status, BrokerError> {
    let mut queues = Vec::new();
    for q in config.queues.values() {
        let stats = broker.stats(&q.name).await?;
        let dead_lettered = broker.depth(&q.dead_letter).await?;
        let oldest = if dead_lettered > 0 { oldest_age(broker, &q.dead_letter).await? } else { None };
        queues.push(Row {
            queue: q.name.clone(),
            ready: stats.ready,
            consumers: stats.consumers,
            dead_letter_queue: q.dead_letter.clone(),
            dead_lettered,
            oldest_dead_letter_age_seconds: oldest,
        });
    }
    Ok(Status { queues, retries_waiting: broker.delayed().await? })
}

/// The age of the message at the head of a dead-letter queue, read and handed back.
async fn oldest_age<B: Broker>(broker: &B, dlq: &str) -> Result<Option<u64>, BrokerError> {
    let (mut deliveries, consumer) = broker.browse(dlq, 1).await?;
    let head = tokio::time::timeout(std::time::Duration::from_secs(1), deliveries.next()).await;
    consumer.close().await;
    match head {
        Ok(Some(delivery)) => Ok(dlq::describe(&delivery?, dlq::now()).age_seconds),
        _ => Ok(None),
    }
}
