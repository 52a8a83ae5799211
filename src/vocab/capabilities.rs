//! What a broker can honour of a pipeline, as a value: each broker declares one
//! (`broker::capabilities`), and `config` checks a pipeline against it. Data only.

use std::time::Duration;

use super::{ExchangeKind, QueueKind};

/// The orderings a queue can be consumed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ordering {
    /// One consumer at a time receives, in queue order (`ordered: true`).
    SingleActiveConsumer,
    /// In order per key, consumers in parallel across keys.
    PerKey,
}

/// What a broker can honour of a pipeline.
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
}
