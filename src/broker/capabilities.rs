//! What each broker can honour, as data (issue 32 item 1): one [`Capabilities`] value a broker.
//! `validate --broker` and `run` check a pipeline against it (`config` does, since the type lives
//! below both in [`crate::vocab`]) before anything is declared, and refuse at file:line:column
//! what the broker cannot honour, naming the capability and the broker, instead of a run-time
//! error (or a silent difference) later. Known from the broker's kind alone: no connection needed.
//!
//! Each value says what the broker does today; where sluice itself makes up for a broker
//! (a delay longer than one copy can wait is served in hops by the runtime), the capability
//! says the broker's limit and the pipeline is not refused.

pub use crate::vocab::capabilities::{Capabilities, HandBack, Ordering, QueueNames};
use crate::vocab::{ExchangeKind, QueueKind};

/// RabbitMQ's, with its delay cascade in `amqp`.
pub use super::amqp::CAPABILITIES as RABBITMQ;

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
    queue_types: QueueKind::ALL,
    exchange_kinds: ExchangeKind::ALL,
    orderings: &[Ordering::SingleActiveConsumer],
    arguments: false,
    hand_back: HandBack::PerMessage,
    leases: true,
    holds_acks: false,
    holds_keys: true,
    browse_in_order: true,
    atomic_copy_and_remove: false,
    admits_past_max_length: 0,
    queue_names: None,
    counts_consumers: true,
    counts_waiting_consumers: true,
};

/// Redis (streams): any delay (a sorted set); bodies up to Redis's 512 MiB string; no
/// priorities, no expiry, no broker arguments (its declare refuses them). Both queue types
/// are taken and kept alike.
pub const REDIS: Capabilities =
    Capabilities { name: "the Redis broker", largest_body: 512 << 20, atomic_copy_and_remove: true, ..EMBEDDED };

/// NATS JetStream: any delay (a NAK with the time left); bodies up to the 64 MiB NATS allows
/// (the server's `max_payload`, 1 MiB by default, must be raised for bodies past it); no priorities, no expiry, no broker arguments, no single active
/// consumer (nats-server 2.9 has no pinned consumers). sluice routes every exchange kind
/// itself. A delayed copy waits in its queue's stream, so `max_length` counts it.
pub const JETSTREAM: Capabilities = Capabilities {
    name: "the JetStream broker",
    largest_body: 64 << 20,
    orderings: &[],
    holds_keys: false,
    atomic_copy_and_remove: false,
    counts_waiting_consumers: false,
    ..EMBEDDED
};

/// Amazon SQS, with its names in `sqs`.
pub use super::sqs::CAPABILITIES as SQS;

/// The in-memory test double: as the embedded broker, unless a test gives it a longest delay.
pub const MEMORY: Capabilities =
    Capabilities { name: "the in-memory broker", leases: false, holds_keys: false, ..EMBEDDED };
