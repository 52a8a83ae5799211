//! `sluice status`: every pipeline queue at a glance, read from the broker (no management
//! plugin needed): ready messages, consumers, the dead-letter queue's depth and how long its
//! oldest message has waited, and the retries waiting in the shared delay queues. RabbitMQ
//! does not tell unacknowledged counts over AMQP: those come from the runners themselves,
//! the `sluice_in_flight` gauge of each `/metrics` named with `--admin`.

use std::collections::BTreeMap;

use serde::Serialize;

use super::dlq;
use crate::broker::{Broker, BrokerError};
use crate::config::Config;

/// One pipeline queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    pub queue: String,
    pub ready: u32,
    pub consumers: u32,
    /// Deliveries the named runners hold (received, not yet acked); None without runners.
    pub unacked: Option<u64>,
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

/// Reads the status of every queue in `config`; `in_flight` is what the runners hold, by queue
/// (None when no runner was asked).
pub async fn read<B: Broker>(
    broker: &B,
    config: &Config,
    in_flight: Option<&BTreeMap<String, u64>>,
) -> Result<Status, BrokerError> {
    let mut queues = Vec::new();
    for q in config.queues.values() {
        let stats = broker.stats(&q.name).await?;
        let dead_lettered = broker.depth(&q.dead_letter).await?;
        let oldest = match dead_lettered {
            0 => None,
            _ => dlq::head(broker, &q.dead_letter).await?.and_then(|e| e.age_seconds),
        };
        queues.push(Row {
            queue: q.name.clone(),
            ready: stats.ready,
            consumers: stats.consumers,
            unacked: in_flight.map(|held| held.get(&q.name).copied().unwrap_or(0)),
            dead_letter_queue: q.dead_letter.clone(),
            dead_lettered,
            oldest_dead_letter_age_seconds: oldest,
        });
    }
    Ok(Status { queues, retries_waiting: broker.delayed().await? })
}

/// Adds the `sluice_in_flight{queue="..."}` samples of one runner's `/metrics` text to `held`.
/// Queue names are plain (validate allows no quotes or backslashes), so no label unescaping.
pub fn add_in_flight(metrics: &str, held: &mut BTreeMap<String, u64>) {
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("sluice_in_flight{") else { continue };
        let Some((labels, value)) = rest.rsplit_once("} ") else { continue };
        let queue = labels.split(',').find_map(|l| l.strip_prefix("queue=\"")?.strip_suffix('"'));
        if let (Some(queue), Ok(value)) = (queue, value.trim().parse::<f64>()) {
            // A gauge of whole deliveries; a negative or fractional value would be a bug upstream.
            *held.entry(queue.to_string()).or_default() += value.max(0.0) as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    #[test]
    fn in_flight_is_summed_by_queue_across_runners() {
        let a = "# HELP sluice_in_flight Deliveries being handled.\n# TYPE sluice_in_flight gauge\n\
                 sluice_in_flight{queue=\"orders.charge\"} 3\nsluice_in_flight{queue=\"orders.email\"} 0\n\
                 sluice_in_flight_other{queue=\"x\"} 9\nsluice_queue_depth{queue=\"orders.charge\"} 7\n";
        let b = "sluice_in_flight{queue=\"orders.charge\"} 2\nsluice_in_flight{queue=\"broken\"} nonsense\n";
        let mut held = BTreeMap::new();
        super::add_in_flight(a, &mut held);
        super::add_in_flight(b, &mut held);
        assert_eq!(held, BTreeMap::from([("orders.charge".to_string(), 5), ("orders.email".to_string(), 0)]));
    }
}
