//! RabbitMQ's declarations for a plan: the `x-` arguments of each queue (dead-lettering,
//! delivery limit, overflow, single active consumer), the shared delay cascade that carries
//! retries, and where a delayed copy is published. `sluice plan` shows these ([`Declarations::picture`]).
//!
//! Pure: it declares nothing itself.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};

use crate::broker::render::{Bound, Picture, Shown};
use crate::topology::{self, Plan};
use crate::vocab::QueueKind;

/// Retry delays are whole multiples of this unit (rounded up).
pub const DELAY_UNIT: Duration = Duration::from_millis(100);

/// Delay levels: level L holds messages for 2^L units, so 25 levels cover 2^25 - 1 units
/// (about 38.8 days), beyond the 30 days `validate` allows.
pub const DELAY_LEVELS: u32 = 25;

/// The longest delay the cascade holds: every level once, 2^LEVELS - 1 units.
pub const MAX_DELAY: Duration = Duration::from_millis(DELAY_UNIT.as_millis() as u64 * ((1 << DELAY_LEVELS) - 1));

/// Where delayed copies leave the cascade, bound to every work queue.
pub const DELIVERY_EXCHANGE: &str = "sluice.delay.delivery";

/// How often a quorum queue redelivers a message (crash loops, lost channels) before the broker
/// dead-letters it. Explicit because RabbitMQ 4 defaults to 20 and, without a dead-letter
/// route, drops.
pub const DELIVERY_LIMIT: i64 = 20;

/// Everything to declare on RabbitMQ.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Declarations {
    pub exchanges: Vec<Exchange>,
    pub queues: Vec<Queue>,
    pub bindings: Vec<Binding>,
}

/// An exchange to declare (durable).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Exchange {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
}

/// What a queue is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Consumed by a handler.
    Work,
    /// Holds the failures of a work queue.
    DeadLetter,
    /// One level of the delay cascade.
    Delay,
}

/// A queue to declare (durable) with its arguments.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Queue {
    pub name: String,
    pub role: Role,
    pub arguments: BTreeMap<String, Value>,
}

/// The destination of a binding: a queue, or (for the cascade) another exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DestinationKind {
    Queue,
    Exchange,
}

/// A binding to declare.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Binding {
    pub source: String,
    pub destination: String,
    pub destination_kind: DestinationKind,
    pub routing_key: String,
    pub arguments: BTreeMap<String, Value>,
}

impl Declarations {
    /// The declaration of a queue by name.
    pub fn queue(&self, name: &str) -> Option<&Queue> {
        self.queues.iter().find(|q| q.name == name)
    }

    /// What `sluice plan` shows: the queues with their `x-` arguments and the bindings of the
    /// pipelines, with the cascade's exchanges, queues and bindings summarised in one line.
    pub fn picture(&self) -> Picture {
        let internal = |name: &str| name.starts_with("sluice.delay.");
        Picture {
            title: None,
            exchanges: self
                .exchanges
                .iter()
                .filter(|e| !internal(&e.name))
                .map(|e| (e.name.clone(), e.kind.clone()))
                .collect(),
            queues: self
                .queues
                .iter()
                .filter(|q| q.role != Role::Delay)
                .map(|q| Shown {
                    name: q.name.clone(),
                    dead_letter_queue: q.role == Role::DeadLetter,
                    dead_letter: q.arguments.get("x-dead-letter-routing-key").and_then(Value::as_str).map(Into::into),
                    settings: q.arguments.iter().map(|(k, v)| (k.clone(), v.to_string())).collect(),
                })
                .collect(),
            bindings: self
                .bindings
                .iter()
                .filter(|b| !internal(&b.source) && b.destination_kind == DestinationKind::Queue)
                .map(|b| Bound {
                    exchange: b.source.clone(),
                    queue: b.destination.clone(),
                    routing_key: b.routing_key.clone(),
                    arguments: b.arguments.clone(),
                })
                .collect(),
            delays: format!(
                "delay cascade: {DELAY_LEVELS} levels (sluice.delay.00 .. sluice.delay.{:02}) in units of {}ms, into {DELIVERY_EXCHANGE}",
                DELAY_LEVELS - 1,
                DELAY_UNIT.as_millis(),
            ),
            delay_node: Some("delay cascade"),
            json: serde_json::to_value(self).unwrap_or_default(),
        }
    }
}

/// What RabbitMQ needs for a plan, the delay cascade included.
pub fn declarations(plan: &Plan) -> Declarations {
    let mut d = Declarations::default();
    for e in &plan.exchanges {
        d.exchanges.push(Exchange { name: e.name.clone(), kind: e.kind.as_str().into() });
    }
    for q in &plan.queues {
        let kind = match q.kind {
            QueueKind::Quorum => "quorum",
            QueueKind::Classic => "classic",
        };
        let mut args = BTreeMap::from([("x-queue-type".to_string(), json!(kind))]);
        let role = match q.role {
            topology::Role::Work => Role::Work,
            topology::Role::DeadLetter => Role::DeadLetter,
        };
        if let Some(dlq) = &q.dead_letter {
            args.insert("x-dead-letter-exchange".into(), json!(""));
            args.insert("x-dead-letter-routing-key".into(), json!(dlq));
        }
        if role == Role::Work {
            args.insert("x-overflow".into(), json!("reject-publish"));
            if q.kind == QueueKind::Quorum {
                args.insert("x-delivery-limit".into(), json!(DELIVERY_LIMIT));
                args.insert("x-dead-letter-strategy".into(), json!("at-least-once"));
            }
        }
        if let Some(n) = q.max_length {
            args.insert("x-max-length".into(), json!(n));
        }
        if q.single_active_consumer {
            args.insert("x-single-active-consumer".into(), json!(true));
        }
        if let Some(ttl) = q.message_ttl_ms {
            args.insert("x-message-ttl".into(), json!(ttl));
        }
        if let Some(levels) = q.max_priority {
            args.insert("x-max-priority".into(), json!(levels));
        }
        args.extend(q.arguments.iter().map(|(name, value)| (name.clone(), value.clone())));
        d.queues.push(Queue { name: q.name.clone(), role, arguments: args });
    }
    for b in &plan.bindings {
        d.bindings.push(Binding {
            source: b.exchange.clone(),
            destination: b.queue.clone(),
            destination_kind: DestinationKind::Queue,
            routing_key: b.routing_key.clone(),
            arguments: b.arguments.clone(),
        });
    }
    let work: Vec<String> = d.queues.iter().filter(|q| q.role == Role::Work).map(|q| q.name.clone()).collect();
    for queue in &work {
        d.bindings.push(Binding {
            source: DELIVERY_EXCHANGE.into(),
            destination: queue.clone(),
            destination_kind: DestinationKind::Queue,
            routing_key: format!("{}{}", "*.".repeat(DELAY_LEVELS as usize), queue),
            arguments: BTreeMap::new(),
        });
    }
    if !work.is_empty() {
        add_cascade(&mut d);
    }
    d
}

pub(super) fn level_name(level: u32) -> String {
    format!("sluice.delay.{level:02}")
}

/// The routing-key pattern that matches bit `level` being `bit`.
fn bit_pattern(level: u32, bit: char) -> String {
    format!("{}{bit}.#", "*.".repeat((DELAY_LEVELS - 1 - level) as usize))
}

/// NServiceBus-style cascade: level L's exchange routes messages whose bit L is set into its
/// queue (TTL 2^L units) and the rest on to level L-1; an expired message dead-letters into
/// level L-1's exchange with its routing key unchanged; level 0 leads to the delivery exchange.
fn add_cascade(plan: &mut Declarations) {
    plan.exchanges.push(Exchange { name: DELIVERY_EXCHANGE.into(), kind: "topic".into() });
    for level in (0..DELAY_LEVELS).rev() {
        let name = level_name(level);
        let next = if level == 0 { DELIVERY_EXCHANGE.to_string() } else { level_name(level - 1) };
        let ttl = DELAY_UNIT.as_millis() as u64 * (1u64 << level);
        plan.exchanges.push(Exchange { name: name.clone(), kind: "topic".into() });
        plan.queues.push(Queue {
            name: name.clone(),
            role: Role::Delay,
            arguments: BTreeMap::from([
                ("x-queue-type".to_string(), json!("quorum")),
                ("x-message-ttl".to_string(), json!(ttl)),
                ("x-dead-letter-exchange".to_string(), json!(next)),
                ("x-dead-letter-strategy".to_string(), json!("at-least-once")),
                ("x-overflow".to_string(), json!("reject-publish")),
            ]),
        });
        plan.bindings.push(Binding {
            source: name.clone(),
            destination: name.clone(),
            destination_kind: DestinationKind::Queue,
            routing_key: bit_pattern(level, '1'),
            arguments: BTreeMap::new(),
        });
        plan.bindings.push(Binding {
            source: name,
            destination: next,
            destination_kind: DestinationKind::Exchange,
            routing_key: bit_pattern(level, '0'),
            arguments: BTreeMap::new(),
        });
    }
}

/// Where to publish a copy of a message so that it reaches `queue` after `delay`:
/// the exchange and the routing key (the delay's bits, most significant first, then the queue).
pub fn delay_route(queue: &str, delay: Duration) -> (String, String) {
    let max_units = (1u64 << DELAY_LEVELS) - 1;
    let units = delay.as_nanos().div_ceil(DELAY_UNIT.as_nanos()).min(u128::from(max_units)) as u64;
    let mut key = String::with_capacity(DELAY_LEVELS as usize * 2 + queue.len());
    for level in (0..DELAY_LEVELS).rev() {
        key.push(if units >> level & 1 == 1 { '1' } else { '0' });
        key.push('.');
    }
    key.push_str(queue);
    let exchange = match units {
        0 => DELIVERY_EXCHANGE.to_string(),
        n => level_name(63 - n.leading_zeros()),
    };
    (exchange, key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::route::topic_match;

    /// Follows a copy through the planned cascade the way the broker would, summing the TTLs.
    fn simulate(plan: &Declarations, exchange: &str, key: &str) -> (String, Duration) {
        let mut at = exchange.to_string();
        let mut waited = Duration::ZERO;
        for _ in 0..200 {
            let hits: Vec<&Binding> =
                plan.bindings.iter().filter(|b| b.source == at && topic_match(&b.routing_key, key)).collect();
            assert_eq!(hits.len(), 1, "exactly one route from {at} for {key}: {hits:?}");
            let b = hits[0];
            match b.destination_kind {
                DestinationKind::Exchange => at = b.destination.clone(),
                DestinationKind::Queue => {
                    let q = plan.queue(&b.destination).expect("declared");
                    if q.role != Role::Delay {
                        return (q.name.clone(), waited);
                    }
                    waited += Duration::from_millis(q.arguments["x-message-ttl"].as_u64().expect("ttl"));
                    at = q.arguments["x-dead-letter-exchange"].as_str().expect("dlx").to_string();
                }
            }
        }
        panic!("no destination reached");
    }

    /// Two work queues, one named like a routing-key prefix of the other, with their
    /// dead-letter queues: what `topology::plan` makes of two queues with no settings.
    fn two_queues() -> Declarations {
        let queues = ["work", "acc.work"].into_iter().flat_map(|name| {
            let dlq = format!("{name}.dlq");
            let work = topology::QueueDecl {
                dead_letter: Some(dlq.clone()),
                ..topology::QueueDecl::new(name, topology::Role::Work)
            };
            [work, topology::QueueDecl::new(&dlq, topology::Role::DeadLetter)]
        });
        declarations(&Plan { queues: queues.collect(), ..Plan::default() })
    }

    #[test]
    fn every_delay_arrives_exactly_at_its_queue() {
        let plan = two_queues();
        let delays = [0, 1, 99, 100, 101, 250, 1_000, 60_000, 3_600_000, 86_400_000 * 30];
        for ms in delays {
            for queue in ["work", "acc.work"] {
                let (exchange, key) = delay_route(queue, Duration::from_millis(ms));
                let (reached, waited) = simulate(&plan, &exchange, &key);
                assert_eq!(reached, queue, "{ms}ms");
                let want = Duration::from_millis(ms.div_ceil(100) * 100);
                assert_eq!(waited, want, "{ms}ms to {queue}");
            }
        }
    }

    /// Issue 24: `publish --delay` refuses what the cascade cannot hold; it holds every level
    /// once (more than the 30 days `validate` allows a retry: the application's tests check that), and a
    /// longer delay waits that long.
    #[test]
    fn the_longest_delay_is_every_level_once() {
        let plan = two_queues();
        for delay in [MAX_DELAY, MAX_DELAY + Duration::from_secs(3600)] {
            let (exchange, key) = delay_route("work", delay);
            assert_eq!(simulate(&plan, &exchange, &key), ("work".to_string(), MAX_DELAY), "{delay:?}");
        }
    }

    #[test]
    fn work_queue_arguments() {
        let plan = two_queues();
        let q = plan.queue("work").unwrap();
        assert_eq!(q.arguments["x-queue-type"], "quorum");
        assert_eq!(q.arguments["x-dead-letter-routing-key"], "work.dlq");
        assert_eq!(q.arguments["x-delivery-limit"], DELIVERY_LIMIT);
        assert_eq!(q.arguments["x-dead-letter-strategy"], "at-least-once");
        assert_eq!(plan.queue("work.dlq").unwrap().role, Role::DeadLetter);
        assert_eq!(plan.queues.iter().filter(|q| q.role == Role::Delay).count(), DELAY_LEVELS as usize);
    }
}
