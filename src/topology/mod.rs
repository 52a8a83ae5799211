//! From a validated `Config` to a broker-neutral plan: every exchange, queue, binding and
//! dead-letter queue, as typed declarations any broker can map; and the diff of two configs,
//! which says what a reload starts, drains, replaces and unbinds.
//!
//! Pure: no broker here, and no broker's notions either (no `x-` arguments, no delay queues):
//! each broker maps the plan to its own declarations (`broker::amqp::declare`).

mod diff;
pub mod route;

use std::collections::BTreeMap;

use serde::Serialize;

pub use diff::{Diff, diff};

use crate::config::{Config, Queue};
use crate::vocab::{ExchangeKind, QueueKind};

/// Everything a pipeline needs to exist on the broker.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Plan {
    pub exchanges: Vec<ExchangeDecl>,
    pub queues: Vec<QueueDecl>,
    pub bindings: Vec<BindingDecl>,
}

/// An exchange to declare (durable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExchangeDecl {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: ExchangeKind,
}

/// What a queue is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Consumed by a handler.
    Work,
    /// Holds the failures of a work queue.
    DeadLetter,
}

/// A queue to declare (durable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueDecl {
    pub name: String,
    pub role: Role,
    #[serde(rename = "type")]
    pub kind: QueueKind,
    /// Where the broker itself puts what it drops (work queues: their dead-letter queue).
    pub dead_letter: Option<String>,
    /// With producers refused once full.
    pub max_length: Option<u64>,
    /// One consumer at a time receives, in queue order.
    pub single_active_consumer: bool,
    /// Milliseconds a message may wait here before the broker dead-letters it (`expired`).
    /// Left out of the declaration when unset, as are the two below, so that the
    /// declarations of earlier versions read the same.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_ttl_ms: Option<u64>,
    /// Priority levels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_priority: Option<u8>,
    /// Other broker arguments, as the pipeline gives them (RabbitMQ's `x-` arguments).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub arguments: BTreeMap<String, serde_json::Value>,
    /// The largest body its consumers take (`max_message_bytes`): the runner's limit, not
    /// the broker's, so not part of the declaration (a change is no conflict); a broker that
    /// can keep it tells publishers what no queue would accept.
    #[serde(skip)]
    pub max_message_bytes: Option<usize>,
    /// Its `order_by` key, for a broker that groups a queue's messages by key itself (SQS FIFO
    /// message groups) and so must render the key where a message is sent. The runner's
    /// setting, not part of the declaration, as `max_message_bytes`.
    #[serde(skip)]
    pub order_key: Option<OrderKey>,
}

/// An `order_by` key as a broker renders it: the template's source and the format the queue
/// reads its messages in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderKey {
    pub template: String,
    pub format: crate::vocab::format::Format,
}

impl QueueDecl {
    /// A quorum queue named `name` in `role`, with no other setting.
    pub fn new(name: &str, role: Role) -> QueueDecl {
        QueueDecl {
            name: name.into(),
            role,
            kind: QueueKind::Quorum,
            dead_letter: None,
            max_length: None,
            single_active_consumer: false,
            message_ttl_ms: None,
            max_priority: None,
            arguments: BTreeMap::new(),
            max_message_bytes: None,
            order_key: None,
        }
    }
}

/// A queue bound to an exchange.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BindingDecl {
    pub exchange: String,
    pub queue: String,
    pub routing_key: String,
    /// For headers exchanges: `x-match` and the headers to match, as the pipeline says.
    pub arguments: BTreeMap<String, serde_json::Value>,
}

impl Plan {
    /// The declaration of a queue by name.
    pub fn queue(&self, name: &str) -> Option<&QueueDecl> {
        self.queues.iter().find(|q| q.name == name)
    }
}

/// Plans the topology of a config.
pub fn plan(config: &Config) -> Plan {
    let mut plan = Plan::default();
    for e in config.exchanges.values() {
        plan.exchanges.push(ExchangeDecl { name: e.name.clone(), kind: e.kind });
    }
    for q in config.queues.values() {
        plan.queues.push(QueueDecl {
            name: q.name.clone(),
            role: Role::Work,
            kind: q.kind,
            dead_letter: Some(q.dead_letter.clone()),
            max_length: q.max_length,
            single_active_consumer: q.ordered || q.order_by.is_some(),
            message_ttl_ms: q.message_ttl.map(|ttl| u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
            max_priority: q.priority,
            arguments: q.arguments.clone(),
            max_message_bytes: Some(q.max_message_bytes),
            order_key: q.order_by.as_ref().map(|o| OrderKey { template: o.key.source().to_string(), format: q.format }),
        });
        plan.queues.push(QueueDecl { kind: q.kind, ..QueueDecl::new(&q.dead_letter, Role::DeadLetter) });
        plan.bindings.extend(bindings(q));
    }
    plan
}

/// The bindings of one queue, as its `bind:` list says.
fn bindings(q: &Queue) -> impl Iterator<Item = BindingDecl> + '_ {
    q.bindings.iter().map(|b| BindingDecl {
        exchange: b.exchange.clone(),
        queue: q.name.clone(),
        routing_key: b.routing_key.clone(),
        arguments: b.arguments.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_comes_with_its_dead_letter_queue_and_bindings() {
        let text = "version: 1\nexchanges:\n  ev: {type: topic}\nqueues:\n  work:\n    type: classic\n    ordered: true\n    max_length: 10\n    bind: [{exchange: ev, routing_key: \"a.*\"}]\n    handler: {command: {program: /bin/true}}\n";
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("p.yaml"), text).expect("write");
        let loaded = crate::config::load(&[dir.path().to_path_buf()]);
        let plan = plan(loaded.config.as_ref().expect("valid"));
        assert_eq!(plan.exchanges, [ExchangeDecl { name: "ev".into(), kind: ExchangeKind::Topic }]);
        assert_eq!(
            plan.queues,
            [
                QueueDecl {
                    name: "work".into(),
                    role: Role::Work,
                    kind: QueueKind::Classic,
                    dead_letter: Some("work.dlq".into()),
                    max_length: Some(10),
                    single_active_consumer: true,
                    message_ttl_ms: None,
                    max_priority: None,
                    arguments: Default::default(),
                    max_message_bytes: Some(crate::config::DEFAULT_MAX_MESSAGE_BYTES),
                    order_key: None,
                },
                QueueDecl {
                    name: "work.dlq".into(),
                    role: Role::DeadLetter,
                    kind: QueueKind::Classic,
                    dead_letter: None,
                    max_length: None,
                    single_active_consumer: false,
                    message_ttl_ms: None,
                    max_priority: None,
                    arguments: Default::default(),
                    max_message_bytes: None,
                    order_key: None,
                },
            ]
        );
        assert_eq!(
            plan.bindings,
            [BindingDecl {
                exchange: "ev".into(),
                queue: "work".into(),
                routing_key: "a.*".into(),
                arguments: BTreeMap::new()
            }]
        );
    }
}
