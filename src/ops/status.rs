//! `sluice status`: every pipeline queue at a glance, read from the broker (no management
//! plugin needed): ready messages, consumers, the dead-letter queue's depth and how long its
//! oldest message has waited, and the retries waiting in the shared delay queues. RabbitMQ
//! does not tell unacknowledged counts over AMQP: those come from the runners themselves,
//! the `sluice_in_flight` gauge of each `/metrics` named with `--admin`, as do each queue's
//! circuit breaker state (`sluice_circuit_state`) and whether it is paused (`sluice_paused`).

use std::collections::BTreeMap;

use serde::Serialize;

use super::dlq;
use crate::broker::{BrokerError, Operate, QueueStats, embedded};
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
    /// The circuit breaker (closed, half-open, open; the worst of the named runners'); None
    /// without runners.
    pub circuit: Option<&'static str>,
    /// Paused by hand in any of the named runners; None without runners.
    pub paused: Option<bool>,
}

/// What the named runners say of one queue, summed or worst over them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Held {
    /// Deliveries held (received, not yet acked).
    pub in_flight: u64,
    /// The highest `sluice_circuit_state` (0 closed, 1 half-open, 2 open).
    pub circuit: f64,
    pub paused: bool,
    /// The handlers allowed at once (`sluice_concurrency_limit`), summed.
    pub concurrency_limit: f64,
}

impl Held {
    /// The breaker's state by name.
    pub fn circuit_name(&self) -> &'static str {
        match self.circuit {
            c if c >= 2.0 => "open",
            c if c >= 1.0 => "half-open",
            _ => "closed",
        }
    }
}

/// Every queue, and the retries waiting (RabbitMQ holds them in delay queues shared by all
/// queues, so only their total is known without reading them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Status {
    pub queues: Vec<Row>,
    pub retries_waiting: u32,
    /// On a cluster: the node this was read from, and the node each named runner is on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<Cluster>,
}

/// Which nodes of a cluster are in use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cluster {
    /// The node this status was read from.
    pub read_from: String,
    /// Every node given.
    pub nodes: Vec<String>,
    /// Each runner named with `--admin` (its address) and the node its session is with
    /// (`sluice_broker_connected`); None while it reconnects.
    pub runners: BTreeMap<String, Option<String>>,
}

/// Where [`read`] takes its counts from: a broker session ([`Session`]), or the embedded
/// broker's file read without writing ([`embedded::ReadOnly`]).
pub trait Counts {
    fn stats(&mut self, queue: &str) -> impl Future<Output = Result<QueueStats, BrokerError>>;
    /// The oldest message of a dead-letter queue, read and not taken.
    fn head(&mut self, dlq: &str) -> impl Future<Output = Result<Option<dlq::Entry>, BrokerError>>;
    fn delayed(&mut self) -> impl Future<Output = Result<u32, BrokerError>>;
}

/// A broker session as [`Counts`].
pub struct Session<'a, B>(pub &'a B);

impl<B: Operate> Counts for Session<'_, B> {
    async fn stats(&mut self, queue: &str) -> Result<QueueStats, BrokerError> {
        self.0.stats(queue).await
    }

    async fn head(&mut self, dlq: &str) -> Result<Option<dlq::Entry>, BrokerError> {
        dlq::head(self.0, dlq).await
    }

    async fn delayed(&mut self) -> Result<u32, BrokerError> {
        self.0.delayed().await
    }
}

impl Counts for embedded::ReadOnly {
    async fn stats(&mut self, queue: &str) -> Result<QueueStats, BrokerError> {
        embedded::ReadOnly::stats(self, queue)
    }

    async fn head(&mut self, dlq: &str) -> Result<Option<dlq::Entry>, BrokerError> {
        dlq::head_read_only(self, dlq).await
    }

    async fn delayed(&mut self) -> Result<u32, BrokerError> {
        embedded::ReadOnly::delayed(self)
    }
}

/// Reads the status of every queue in `config`; `runners` is what the runners say, by queue
/// (None when no runner was asked).
pub async fn read<C: Counts>(
    source: &mut C,
    config: &Config,
    runners: Option<&BTreeMap<String, Held>>,
) -> Result<Status, BrokerError> {
    let mut queues = Vec::new();
    for q in config.queues.values() {
        let stats = source.stats(&q.name).await?;
        let dead_lettered = source.stats(&q.dead_letter).await?.ready;
        let oldest = match dead_lettered {
            0 => None,
            _ => source.head(&q.dead_letter).await?.and_then(|e| e.age_seconds),
        };
        let held = runners.map(|r| r.get(&q.name).copied().unwrap_or_default());
        queues.push(Row {
            queue: q.name.clone(),
            ready: stats.ready,
            consumers: stats.consumers,
            unacked: held.map(|h| h.in_flight),
            dead_letter_queue: q.dead_letter.clone(),
            dead_lettered,
            oldest_dead_letter_age_seconds: oldest,
            circuit: held.map(|h| h.circuit_name()),
            paused: held.map(|h| h.paused),
        });
    }
    Ok(Status { queues, retries_waiting: source.delayed().await?, cluster: None })
}

/// The broker node a runner's `/metrics` text says its session is with.
pub fn connected_node(metrics: &str) -> Option<String> {
    metrics.lines().find_map(|line| {
        let rest = line.strip_prefix("sluice_broker_connected{")?;
        let (labels, value) = rest.rsplit_once("} ")?;
        let node = labels.split(',').find_map(|l| l.strip_prefix("node=\"")?.strip_suffix('"'))?;
        (value.trim().parse::<f64>().ok()? >= 1.0).then(|| node.to_string())
    })
}

/// Adds what one runner's `/metrics` text says of each queue (`sluice_in_flight`,
/// `sluice_circuit_state`, `sluice_paused`, `sluice_concurrency_limit`) to `held`. Queue names are plain (validate allows
/// no quotes or backslashes), so no label unescaping.
pub fn add_runner(metrics: &str, held: &mut BTreeMap<String, Held>) {
    for line in metrics.lines() {
        let Some((name, rest)) = line.split_once('{') else { continue };
        let Some((labels, value)) = rest.rsplit_once("} ") else { continue };
        let queue = labels.split(',').find_map(|l| l.strip_prefix("queue=\"")?.strip_suffix('"'));
        let (Some(queue), Ok(value)) = (queue, value.trim().parse::<f64>()) else { continue };
        if !matches!(name, "sluice_in_flight" | "sluice_circuit_state" | "sluice_paused" | "sluice_concurrency_limit") {
            continue;
        }
        let entry = held.entry(queue.to_string()).or_default();
        match name {
            // A gauge of whole deliveries; a negative or fractional value would be a bug upstream.
            "sluice_in_flight" => entry.in_flight += value.max(0.0) as u64,
            "sluice_circuit_state" => entry.circuit = entry.circuit.max(value),
            "sluice_paused" => entry.paused |= value >= 1.0,
            "sluice_concurrency_limit" => entry.concurrency_limit += value.max(0.0),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::Held;

    #[test]
    fn runners_are_summed_or_worst_by_queue() {
        let a = "# HELP sluice_in_flight Deliveries being handled.\n# TYPE sluice_in_flight gauge\n\
                 sluice_in_flight{queue=\"orders.charge\"} 3\nsluice_in_flight{queue=\"orders.email\"} 0\n\
                 sluice_in_flight_other{queue=\"x\"} 9\nsluice_queue_depth{queue=\"orders.charge\"} 7\n\
                 sluice_circuit_state{queue=\"orders.charge\"} 1\nsluice_paused{queue=\"orders.email\"} 0\n\
                 sluice_concurrency_limit{queue=\"orders.charge\"} 4\n";
        let b = "sluice_in_flight{queue=\"orders.charge\"} 2\nsluice_in_flight{queue=\"broken\"} nonsense\n\
                 sluice_circuit_state{queue=\"orders.charge\"} 2\nsluice_paused{queue=\"orders.email\"} 1\n";
        let mut held = BTreeMap::new();
        super::add_runner(a, &mut held);
        super::add_runner(b, &mut held);
        let charge = Held { in_flight: 5, circuit: 2.0, paused: false, concurrency_limit: 4.0 };
        let email = Held { in_flight: 0, circuit: 0.0, paused: true, concurrency_limit: 0.0 };
        assert_eq!(held, BTreeMap::from([("orders.charge".to_string(), charge), ("orders.email".to_string(), email)]));
        assert_eq!((charge.circuit_name(), email.circuit_name()), ("open", "closed"));
    }

    /// Issue 20: `sluice status --admin` names the node each runner is on.
    #[test]
    fn the_connected_node_is_the_one_at_1() {
        let metrics = "# TYPE sluice_broker_connected gauge\nsluice_broker_connected{node=\"127.0.0.1:5681\"} 0\n\
                       sluice_broker_connected{node=\"127.0.0.1:5682\"} 1\nsluice_paused{queue=\"a\"} 0\n";
        assert_eq!(super::connected_node(metrics).as_deref(), Some("127.0.0.1:5682"));
        assert_eq!(super::connected_node("sluice_broker_connected{node=\"a:1\"} 0\n"), None);
        assert_eq!(super::connected_node(""), None);
    }
}
