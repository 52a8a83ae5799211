//! What each broker can honour, as data (issue 32 item 1): `validate --broker` and `run` check
//! a pipeline against it before anything is declared, and refuse at file:line:column what the
//! broker cannot honour, naming the capability and the broker, instead of a run-time error
//! (or a silent difference) later. Known from the broker's kind alone: no connection needed.
//!
//! Each value says what the broker does today; where sluice itself makes up for a broker
//! (a delay longer than one copy can wait is served in hops by the runtime), the capability
//! says the broker's limit and the pipeline is not refused.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::source::escape_token;
use crate::config::{Config, ExchangeKind, QueueKind, Validation};

/// The orderings a queue can be consumed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ordering {
    /// One consumer at a time receives, in queue order (`ordered: true`).
    SingleActiveConsumer,
    /// In order per key, consumers in parallel across keys.
    PerKey,
}

/// How a consumer's unsettled deliveries go back to the broker when it closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandBack {
    /// Each delivery, by itself: exactly this consumer's, none of another's.
    PerMessage,
    /// By going back to the last offset committed: what follows it comes again, another
    /// consumer's included (a log).
    FromOffset,
}

/// What a broker can honour of a pipeline, and how it keeps the contract where brokers may
/// differ (`broker/mod.rs`, "The rules a broker keeps").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// The broker's name in messages ("the Redis broker").
    pub name: &'static str,
    /// The longest one delayed copy can wait (a longer delay is served in hops); `None`: any.
    pub longest_delay: Option<Duration>,
    /// The largest message body, in bytes, the broker keeps.
    pub largest_body: usize,
    /// Whether a queue can have priority levels (`priority:`).
    pub priorities: bool,
    /// Whether a queue can expire its messages (`message_ttl:`).
    pub message_ttl: bool,
    /// Whether a queue can be bounded, refusing publishes once full (`max_length:`).
    pub max_length: bool,
    /// The queue types (`type:`) it takes.
    pub queue_types: &'static [QueueKind],
    /// The exchange kinds it routes.
    pub exchange_kinds: &'static [ExchangeKind],
    /// The orderings it offers besides none.
    pub orderings: &'static [Ordering],
    /// Whether a queue's broker-side `arguments:` pass through to the broker.
    pub arguments: bool,
    /// How closing a consumer hands its unsettled deliveries back.
    pub hand_back: HandBack,
    /// Whether a consumer's deliveries are leased: those of a session lost without closing
    /// come back when the lease runs out, not at once.
    pub leases: bool,
    /// Whether an ack of a delivery behind an unsettled one may be held back, to go with it
    /// in one cumulative ack (making no room in the credit while held, lost with the session:
    /// that message comes again).
    pub holds_acks: bool,
    /// Whether the broker's own store holds idempotency keys, recorded in the ack's
    /// transaction ([`Consumer::ack_recording`](super::Consumer::ack_recording)).
    pub holds_keys: bool,
    /// Whether browsing reads a queue in its order.
    pub browse_in_order: bool,
    /// Whether a redrive's copy and the removal of its original are one step.
    pub atomic_copy_and_remove: bool,
    /// How many messages a queue at its `max_length` takes past it before refusing
    /// publishes (a quorum queue checks the limit only once it is exceeded: one).
    pub admits_past_max_length: usize,
    /// Whether queue statistics count the consumers of a single-active-consumer queue that
    /// wait their turn.
    pub counts_waiting_consumers: bool,
}

const EVERY_QUEUE_TYPE: &[QueueKind] = &[QueueKind::Quorum, QueueKind::Classic];
const EVERY_EXCHANGE_KIND: &[ExchangeKind] =
    &[ExchangeKind::Direct, ExchangeKind::Fanout, ExchangeKind::Topic, ExchangeKind::Headers];

/// RabbitMQ: everything sluice offers; delays up to the delay cascade's longest (about 38
/// days); bodies up to the 512 MiB it takes whatever it is configured to.
pub const RABBITMQ: Capabilities = Capabilities {
    name: "RabbitMQ",
    longest_delay: Some(super::amqp::MAX_DELAY),
    largest_body: crate::config::MAX_MESSAGE_BYTES,
    priorities: true,
    message_ttl: true,
    max_length: true,
    queue_types: EVERY_QUEUE_TYPE,
    exchange_kinds: EVERY_EXCHANGE_KIND,
    orderings: &[Ordering::SingleActiveConsumer],
    arguments: true,
    hand_back: HandBack::PerMessage,
    leases: false,
    holds_acks: true,
    holds_keys: false,
    browse_in_order: true,
    atomic_copy_and_remove: false,
    admits_past_max_length: 1,
    counts_waiting_consumers: false,
};

/// The embedded broker (SQLite): any delay; bodies up to SQLite's default 1 GB; no priorities,
/// no expiry, no broker arguments (its declare refuses them). Both queue types are taken and
/// kept alike (one file on one machine).
pub const EMBEDDED: Capabilities = Capabilities {
    name: "the embedded broker",
    longest_delay: None,
    largest_body: 1_000_000_000,
    priorities: false,
    message_ttl: false,
    max_length: true,
    queue_types: EVERY_QUEUE_TYPE,
    exchange_kinds: EVERY_EXCHANGE_KIND,
    orderings: &[Ordering::SingleActiveConsumer],
    arguments: false,
    hand_back: HandBack::PerMessage,
    leases: true,
    holds_acks: false,
    holds_keys: true,
    browse_in_order: true,
    atomic_copy_and_remove: false,
    admits_past_max_length: 0,
    counts_waiting_consumers: true,
};

/// Redis (streams): any delay (a sorted set); bodies up to Redis's 512 MiB string; no
/// priorities, no expiry, no broker arguments (its declare refuses them). Both queue types
/// are taken and kept alike.
pub const REDIS: Capabilities = Capabilities {
    name: "the Redis broker",
    largest_body: 512 << 20,
    holds_keys: false,
    atomic_copy_and_remove: true,
    ..EMBEDDED
};

/// The in-memory test double: as the embedded broker, unless a test gives it a longest delay.
pub const MEMORY: Capabilities =
    Capabilities { name: "the in-memory broker", leases: false, holds_keys: false, ..EMBEDDED };

/// One setting of a pipeline the broker cannot honour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The file that holds it, where the config knows it (queues; exchanges are found by
    /// their pointer).
    pub file: Option<PathBuf>,
    /// The setting's JSON pointer in its file.
    pub pointer: String,
    pub message: String,
}

impl Capabilities {
    /// Adds to `validation` an error, at its place, for each setting of its config that this
    /// broker cannot honour (the config is then none): what `validate --broker`, `run` and a
    /// reload check before anything is declared.
    pub fn check(&self, validation: &mut Validation) {
        if let Some(config) = &validation.config {
            let refusals: Vec<_> = self.refusals(config).into_iter().map(|r| (r.file, r.pointer, r.message)).collect();
            validation.refuse(refusals);
        }
    }

    /// Every setting of `config` this broker cannot honour, each naming the capability.
    pub fn refusals(&self, config: &Config) -> Vec<Refusal> {
        let mut refusals = Vec::new();
        let mut refuse = |file: Option<&PathBuf>, pointer: String, what: String| {
            let message = format!("{} does not support {what}", self.name);
            refusals.push(Refusal { file: file.cloned(), pointer, message });
        };
        for x in config.exchanges.values() {
            if !self.exchange_kinds.contains(&x.kind) {
                let pointer = format!("/exchanges/{}/type", escape_token(&x.name));
                refuse(None, pointer, format!("{} exchanges", x.kind.as_str()));
            }
        }
        for q in config.queues.values() {
            let base = format!("/queues/{}", escape_token(&q.name));
            let file = Some(&q.file);
            if !self.queue_types.contains(&q.kind) {
                let kind = serde_json::to_value(q.kind).ok().and_then(|v| v.as_str().map(String::from));
                refuse(file, format!("{base}/type"), format!("{} queues", kind.unwrap_or_default()));
            }
            if q.priority.is_some() && !self.priorities {
                refuse(file, format!("{base}/priority"), "priorities".into());
            }
            if q.message_ttl.is_some() && !self.message_ttl {
                refuse(file, format!("{base}/message_ttl"), "a message TTL (message_ttl)".into());
            }
            if q.max_length.is_some() && !self.max_length {
                refuse(file, format!("{base}/max_length"), "a queue bounded by max_length".into());
            }
            if q.ordered && !self.orderings.contains(&Ordering::SingleActiveConsumer) {
                refuse(file, format!("{base}/ordered"), "ordered queues (a single active consumer)".into());
            }
            if q.max_message_bytes > self.largest_body {
                let what = format!("bodies over {} bytes (max_message_bytes)", self.largest_body);
                refuse(file, format!("{base}/max_message_bytes"), what);
            }
            if !self.arguments {
                for name in q.arguments.keys() {
                    let pointer = format!("{base}/arguments/{}", escape_token(name));
                    refuse(file, pointer, "broker arguments (arguments:); they are RabbitMQ's".into());
                }
            }
        }
        refusals
    }
}
