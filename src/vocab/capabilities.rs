//! What a broker can honour of a pipeline, as a value: each broker declares one
//! (`broker::capabilities`), and `config` checks a pipeline against it. Data only.

use std::time::Duration;

use super::{ExchangeKind, QueueKind};

/// The orderings a queue can be consumed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ordering {
    /// One consumer at a time receives, in queue order (`ordered: true`).
    SingleActiveConsumer,
    /// In order per key, consumers in parallel across keys (SQS FIFO message groups): the
    /// broker keeps `ordered` (one key) and `order_by` across runners by itself.
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

/// How a broker names queues, where it takes fewer names than sluice does: each character
/// outside its own set (letters, digits, `-`, `_`) written as `-`, at most `longest`
/// characters after its deployment's prefix. Two names written alike would meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueNames {
    /// The most characters of a queue's name as written, its deployment's prefix left out.
    pub longest: usize,
    /// How many of those an ordered queue's name (`ordered`, `order_by`) and its dead-letter
    /// queue's take more (SQS's `.fifo`).
    pub ordered_suffix: usize,
}

impl Capabilities {
    /// Whether it keeps a queue's order (`ordered`, `order_by`) across runners, one way or the
    /// other.
    pub fn orders(&self) -> bool {
        !self.orderings.is_empty()
    }
}

impl QueueNames {
    /// `name` as the broker writes it.
    pub fn write(name: &str) -> String {
        name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '-' }).collect()
    }
}

/// What a broker can honour of a pipeline, and how it keeps the broker contract where
/// brokers may differ (`broker/mod.rs`, "The rules a broker keeps").
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
    /// transaction (the broker contract's `Consumer::ack_recording`).
    pub holds_keys: bool,
    /// Whether browsing reads a queue in its order.
    pub browse_in_order: bool,
    /// Whether a redrive's copy and the removal of its original are one step.
    pub atomic_copy_and_remove: bool,
    /// How many messages a queue at its `max_length` takes past it before refusing
    /// publishes (a quorum queue checks the limit only once it is exceeded: one).
    pub admits_past_max_length: usize,
    /// How it names queues, where it takes fewer names than sluice (`None`: every name).
    pub queue_names: Option<QueueNames>,
    /// Whether queue statistics count a queue's consumers at all (SQS does not know them).
    pub counts_consumers: bool,
    /// Whether queue statistics count the consumers of a single-active-consumer queue that
    /// wait their turn.
    pub counts_waiting_consumers: bool,
}
