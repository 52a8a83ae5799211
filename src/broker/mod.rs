//! The broker contract. [`Broker`] is what `run` needs and nothing more: declare a plan (and
//! make sure it still stands after a lost session), remove the bindings a reload dropped,
//! consume with a [`Credit`] through a consumer handle (ack, cancel, close), put a copy of a
//! delivery somewhere ([`Target`]: a queue, a dead-letter queue, or a queue later), queue
//! statistics and delayed copies for the depth metrics and `--exit-when-idle`, and what the
//! broker can honour ([`Capabilities`], data read before anything runs). [`Publish`] is what
//! `sluice publish` adds (new messages, and where they would go); [`Operate`] what operators'
//! tools add (browsing a queue in order, a redrive's copy-and-remove, how the broker differs
//! from a plan). One contract, so every broker shares every rule in the runtime.
//!
//! The trait carries no broker's notions (delivery tags, cumulative acks, broker arguments,
//! delay queues): each implementation maps them its own way. Implementations do transport
//! only: no retry policy, no classification, no envelopes.
//!
//! # The rules a broker keeps
//!
//! Each rule is named by the body in `tests/conformance.rs` that checks it on every broker;
//! where brokers may differ, the body reads the broker's [`Capabilities`] instead of skipping.
//!
//! 1. **Routing**: a message published to an exchange reaches every queue bound with a
//!    matching key (direct: equal; topic: `*` one word, `#` zero or more; fanout: all;
//!    headers: `x-match` all/any), or none when one of them is full
//!    (`every_exchange_type_routes_as_rabbitmq_does`, `a_full_queue_refuses_publishes`).
//! 2. **Credit is a bound**: a consumer holds at most its [`Credit`] of unsettled
//!    deliveries, in queue order (`prefetch_is_a_bound_and_close_hands_back_in_order`).
//! 3. **Acks in any order, overlapping**: [`Consumer::ack`] takes settled deliveries in any
//!    order, from many tasks at once; each is acked exactly once and no call's ack makes
//!    another's fail. A broker that acks cumulatively may hold an ack behind an unsettled
//!    delivery ([`Capabilities::holds_acks`]): it is lost with the session and that message
//!    comes again (`acks_in_any_order_settle_each_once`).
//! 4. **What `close` hands back**: exactly this consumer's unsettled deliveries, never
//!    another's, delivered again in their order (`prefetch_is_a_bound_and_close_hands_back_in_order`);
//!    a session lost without closing hands them back at once, or when their lease runs out
//!    (`a_lost_sessions_unacked_deliveries_come_again_to_another_consumer`).
//! 5. **Never early**: a copy to [`Target::Later`] is delivered no sooner than its delay,
//!    and blocks nothing behind it; a delay longer than [`Capabilities::longest_delay`] is
//!    held that long (the runtime serves the rest in hops), never less
//!    (`delays_are_exact_and_block_nothing`).
//! 6. **Copies keep the message**: a copy has the original's body and properties (message id,
//!    type, content type, timestamp), its headers edited as [`Edits`] says (`dead_letter_and_redrive_keep_the_message_and_edit_headers`).
//! 7. **Conflicts are named**: declaring what exists with other settings fails naming the
//!    setting and both values (`a_differing_declaration_names_the_setting_and_both_values`).
//! 8. **One at a time where asked**: a single-active-consumer queue delivers to one consumer
//!    (`a_single_active_consumer_queue_delivers_to_one_at_a_time`).
//! 9. **Browsing**: [`Operate::browse`] reads in queue order where
//!    [`Capabilities::browse_in_order`] says so, and hands back what it did not remove
//!    (`browsing_reads_in_order_and_hands_back_the_rest`).
//! 10. **Statistics**: ready messages and consumers of a queue, an undeclared queue being
//!     [`BrokerError::NotFound`] (`stats_count_ready_messages_and_consumers`).
//! 11. **Unbinding** removes the bindings and only them; twice is no error
//!     (`unbinding_removes_only_the_bindings`).

pub mod amqp;
pub mod capabilities;
mod declaration;
pub mod embedded;
pub mod failover;
pub mod jetstream;
pub(crate) mod kit;
/// The in-memory test double: public (hidden) so that the conformance suite in `tests/` runs
/// the same test bodies against it as against every real broker.
#[doc(hidden)]
pub mod memory;
pub mod redis;
pub mod render;
pub mod sqs;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use serde::Serialize;

use crate::topology::{BindingDecl, Plan};

pub use self::capabilities::Capabilities;
pub use self::kit::kept::{Kept, KeptDeliveries, Properties};
pub use crate::envelope::{HeaderValue, Headers};

/// A new message: the body and the properties sluice sets.
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    pub body: Vec<u8>,
    pub message_id: Option<String>,
    pub kind: Option<String>,
    /// The body's media type; `application/json` when none is given.
    pub content_type: Option<String>,
    /// Seconds since the epoch.
    pub timestamp: Option<u64>,
    /// Delivered before lower ones from a queue with priority levels (RabbitMQ only).
    pub priority: Option<u8>,
    pub headers: Headers,
}

/// How a copy's headers differ from its original's ([`Broker::copy`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Edits {
    /// Headers removed from the original's.
    pub remove: Vec<String>,
    /// Headers set over the original's (after `remove`).
    pub set: Headers,
    /// Whether to drop what the broker itself recorded of the original being dead-lettered
    /// ([`Delivery::dead_letter_record`]), so the copy starts afresh.
    pub drop_history: bool,
}

impl Edits {
    /// Edits that set `headers` over the original's and change nothing else.
    pub fn setting(headers: Headers) -> Edits {
        Edits { set: headers, ..Edits::default() }
    }

    /// `headers` with these edits applied, for a broker that keeps headers as [`Headers`]
    /// (and keeps no dead-letter history of its own).
    pub fn apply(&self, headers: &mut Headers) {
        for name in &self.remove {
            headers.remove(name);
        }
        headers.extend(self.set.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
}

/// What a broker itself recorded when it dead-lettered a message (a delivery limit, a full
/// queue), as [`Delivery::dead_letter_record`] reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetterRecord {
    /// The broker's word for why (such as `delivery_limit`, `maxlen`, `expired`).
    pub reason: Option<String>,
    /// How many times it was dead-lettered so.
    pub count: Option<i64>,
    /// When, in seconds since the epoch.
    pub time: Option<u64>,
}

/// The queues a publish would reach, each with the largest body it takes where known.
pub type BodyLimits = Vec<(String, Option<usize>)>;

/// How many unsettled deliveries a consumer may hold at once: at least one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Credit(std::num::NonZeroU16);

impl Credit {
    /// At most `n` unsettled deliveries; 0 is taken as 1 (a consumer always holds one).
    pub fn at_most(n: u16) -> Credit {
        Credit(std::num::NonZeroU16::new(n).unwrap_or(std::num::NonZeroU16::MIN))
    }

    /// The number of deliveries.
    pub fn get(self) -> u16 {
        self.0.get()
    }
}

impl std::fmt::Display for Credit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Where [`Broker::copy`] puts the copy of a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target<'a> {
    /// Ready in this queue at once (a redrive).
    Queue(&'a str),
    /// In this dead-letter queue, kept with what the broker recorded of the original.
    DeadLetter(&'a str),
    /// Ready in this queue once `delay` has passed (a retry), never sooner. A broker holds a
    /// copy at most its [`Capabilities::longest_delay`]: the runtime serves a longer delay in
    /// hops.
    Later { queue: &'a str, delay: Duration },
}

impl Target<'_> {
    /// The queue the copy goes into.
    pub fn queue(&self) -> &str {
        match self {
            Target::Queue(queue) | Target::DeadLetter(queue) | Target::Later { queue, .. } => queue,
        }
    }
}

/// What the broker says of a queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct QueueStats {
    /// Messages ready for delivery (not those delivered and unacknowledged).
    pub ready: u32,
    /// Consumers attached.
    pub consumers: u32,
}

/// One way the broker differs from a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Drift {
    MissingExchange {
        name: String,
    },
    MissingQueue {
        name: String,
    },
    MissingBinding {
        exchange: String,
        queue: String,
        routing_key: String,
    },
    /// Exists with other settings; `detail` names the setting and both values.
    Conflict {
        what: String,
        name: String,
        detail: String,
    },
    /// The broker cannot say whether the bindings exist (RabbitMQ tells only through a plugin
    /// sluice does not need).
    BindingsUnchecked {
        reason: String,
    },
    /// A binding into a queue of the plan that the plan does not declare (on Redis: another
    /// set of pipeline files on the same prefix, whose messages the queue takes too).
    ExtraBinding {
        exchange: String,
        queue: String,
        routing_key: String,
    },
}

impl Drift {
    /// How a broker with nothing declared differs from `plan`: everything is missing.
    pub fn all_missing(plan: &Plan) -> Vec<Drift> {
        let exchanges = plan.exchanges.iter().map(|x| Drift::MissingExchange { name: x.name.clone() });
        let queues = plan.queues.iter().map(|q| Drift::MissingQueue { name: q.name.clone() });
        let bindings = plan.bindings.iter().map(|b| Drift::MissingBinding {
            exchange: b.exchange.clone(),
            queue: b.queue.clone(),
            routing_key: b.routing_key.clone(),
        });
        exchanges.chain(queues).chain(bindings).collect()
    }
}

impl std::fmt::Display for Drift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Drift::MissingExchange { name } => write!(f, "missing exchange \"{name}\""),
            Drift::MissingQueue { name } => write!(f, "missing queue \"{name}\""),
            Drift::MissingBinding { exchange, queue, routing_key } => {
                write!(f, "missing binding {exchange} -> {queue} (routing key \"{routing_key}\")")
            }
            Drift::Conflict { what, name, detail } => write!(f, "conflict: {what} \"{name}\": {detail}"),
            Drift::BindingsUnchecked { reason } => write!(f, "bindings not checked: {reason}"),
            Drift::ExtraBinding { exchange, queue, routing_key } => write!(
                f,
                "binding {exchange} -> {queue} (routing key \"{routing_key}\") is not in the files: another set of pipeline files on this prefix? Its messages reach the queue too"
            ),
        }
    }
}

/// What can go wrong talking to a broker.
///
/// Where an error comes from a lower one (lapin's, Redis's, SQLite's, an I/O error), that
/// error is kept whole as its [`source`](std::error::Error::source), for code that asks what
/// failed underneath; the variant's [`Cause`] adds what was being done. The message says
/// everything, the lower error's own words last (`…: {source}`), as lapin's errors do: logs
/// and the admin API show an error with `{e}`, never walking its sources. The command line's
/// report does walk them (for its `anyhow` contexts), leaving out a source whose words are
/// already shown. Variants without a lower error say what happened in their own words.
#[derive(Debug, Clone)]
pub enum BrokerError {
    /// The broker could not be reached or the session not opened: another try may succeed.
    Connect { url: String, reason: Cause },
    /// The broker turned the session down for good: credentials, a missing virtual host.
    Refused { url: String, reason: Cause },
    /// A declaration conflicts with what exists on the broker.
    Conflict(Cause),
    /// The broker took the message and refused to keep it (a full queue); `reason` says why,
    /// in the broker's terms.
    Rejected { exchange: String, reason: String },
    /// No queue is bound for the message's route.
    Unroutable { exchange: String, routing_key: String },
    /// An exchange or queue that is not declared.
    NotFound(Cause),
    /// No confirm of a publish came in time: the node may be frozen or cut off. (tokio's
    /// `Elapsed`, which says nothing more, is not kept as a source.)
    ConfirmTimeout(Duration),
    /// The session broke, or a call on it failed: another session may carry on.
    Lost(Cause),
    /// The embedded broker's file is not usable (corrupt, not a database, or deleted or replaced
    /// under a live process): no retry or other session can help, a person must act.
    Damaged(Cause),
}

impl std::fmt::Display for BrokerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BrokerError::Connect { url, reason } | BrokerError::Refused { url, reason } => {
                write!(f, "cannot connect to the broker at {url}: {reason}")
            }
            BrokerError::Conflict(cause) | BrokerError::Damaged(cause) => write!(f, "{cause}"),
            BrokerError::Rejected { exchange, reason } => {
                write!(f, "the broker refused the message on exchange \"{exchange}\" ({reason})")
            }
            BrokerError::Unroutable { exchange, routing_key } => {
                write!(f, "unroutable: no queue is bound to exchange \"{exchange}\" for routing key \"{routing_key}\"")
            }
            BrokerError::NotFound(cause) => write!(f, "not found: {cause}"),
            BrokerError::ConfirmTimeout(waited) => write!(f, "no confirm from the broker within {waited:?}"),
            BrokerError::Lost(cause) => write!(f, "broker connection lost: {cause}"),
        }
    }
}

impl std::error::Error for BrokerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BrokerError::Connect { reason: cause, .. }
            | BrokerError::Refused { reason: cause, .. }
            | BrokerError::Conflict(cause)
            | BrokerError::NotFound(cause)
            | BrokerError::Lost(cause)
            | BrokerError::Damaged(cause) => cause.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static)),
            BrokerError::Rejected { .. } | BrokerError::Unroutable { .. } | BrokerError::ConfirmTimeout(_) => None,
        }
    }
}

/// Why a [`BrokerError`] happened: words (what was being done, on which queue or file) and
/// the lower error it came from, if any, shared so that the error stays `Clone`. Shown as the
/// words, then the lower error's own (`declaring queue "a": …`).
#[derive(Debug, Clone)]
pub struct Cause {
    words: String,
    source: Option<std::sync::Arc<dyn std::error::Error + Send + Sync>>,
}

impl Cause {
    /// The lower error `source`, in its own words until [`within`](Cause::within) adds some.
    pub fn from_error(source: impl std::error::Error + Send + Sync + 'static) -> Cause {
        Cause { words: String::new(), source: Some(std::sync::Arc::new(source)) }
    }

    /// The same cause, met while doing `context` (said first).
    pub fn within(self, context: impl std::fmt::Display) -> Cause {
        let words = if self.words.is_empty() { context.to_string() } else { format!("{context}: {}", self.words) };
        Cause { words, ..self }
    }
}

impl From<String> for Cause {
    fn from(words: String) -> Cause {
        Cause { words, source: None }
    }
}

impl From<&str> for Cause {
    fn from(words: &str) -> Cause {
        Cause::from(words.to_string())
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.source {
            None => f.write_str(&self.words),
            Some(source) if self.words.is_empty() => write!(f, "{source}"),
            Some(source) => write!(f, "{}: {source}", self.words),
        }
    }
}

impl BrokerError {
    /// Retrying cannot help: the configuration (pipeline files, URL, credentials) must change.
    pub fn is_fatal(&self) -> bool {
        matches!(self, BrokerError::Refused { .. } | BrokerError::Conflict(_) | BrokerError::NotFound(_))
    }

    /// The broker's store is damaged: `run` stops rather than reconnecting.
    pub fn is_damaged(&self) -> bool {
        matches!(self, BrokerError::Damaged(_))
    }

    /// The session is gone (or given up): another session, with the next node of a cluster,
    /// may carry on where this one stopped.
    pub fn is_session_loss(&self) -> bool {
        matches!(self, BrokerError::Connect { .. } | BrokerError::Lost(_) | BrokerError::ConfirmTimeout(_))
    }
}

/// Where a message was published to: the exchange and the routing key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub exchange: String,
    pub routing_key: String,
}

/// One message handed to a consumer; settled through its consumer's [`Consumer::ack`].
pub trait Delivery: Send + Sync + 'static {
    /// The body as published, shared (not copied) with whatever sends it on; empty for one
    /// held back because it is over the consumer's limit ([`Broker::consume_within`]).
    fn body(&self) -> &Bytes;
    /// The body's length as published, held back or not.
    fn size(&self) -> usize {
        self.body().len()
    }
    fn header(&self, name: &str) -> Option<HeaderValue>;
    /// The `timestamp` property, seconds since the epoch.
    fn timestamp(&self) -> Option<u64>;
    fn message_id(&self) -> Option<&str>;
    /// The producer's name for what the message is (AMQP `type`), where it set one.
    fn kind(&self) -> Option<&str>;
    /// The body's media type (AMQP `content_type`), where the producer set one.
    fn content_type(&self) -> Option<&str>;
    /// The exchange and routing key the message was published with, as far as the broker
    /// keeps them (a delayed or redriven copy may carry the broker's own).
    fn route(&self) -> Option<&Route>;
    /// Every header, as JSON (tables and arrays included), for showing a message to a person.
    fn headers(&self) -> BTreeMap<String, serde_json::Value>;
    /// Whether this delivery can still be acked (its consumer is open).
    fn is_live(&self) -> bool;
    /// What the broker itself recorded when it last dead-lettered this message, if it keeps
    /// such a record; `None` by default.
    fn dead_letter_record(&self) -> Option<DeadLetterRecord> {
        None
    }
}

/// One consumer of one queue: what the runtime holds to settle, stop and hand back what it
/// was given. Cheap to clone; clones share the consumer.
pub trait Consumer: Clone + Send + Sync + 'static {
    type Delivery: Delivery;

    /// Acknowledges settled deliveries of this consumer, in any order; the broker may batch.
    /// Calls may overlap (from many tasks at once, on clones): each delivery given is acked
    /// exactly once, and no call's ack may make another's fail (a cumulative ack must never
    /// cover a delivery another call still sends). Acking a delivery twice is the caller's
    /// bug. On an error each delivery is either still live (this consumer's, unsettled: acking
    /// it again may succeed) or no longer live (handed back: the broker delivers it again).
    fn ack(&self, settled: &[Self::Delivery]) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Acks settled deliveries and records `keys` (idempotency keys, as the store names them)
    /// handled for `ttl`, in one transaction, where the broker's own store holds the keys
    /// ([`Capabilities::holds_keys`]: only such a broker's key store rides its acks,
    /// [`crate::dedup::Store::rides_acks`]). Any other broker refuses, acking nothing, so
    /// that no key is ever taken as recorded when it is not.
    fn ack_recording(
        &self,
        settled: &[Self::Delivery],
        keys: &[String],
        ttl: Duration,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send {
        let _ = (settled, keys, ttl);
        std::future::ready(Err(BrokerError::Conflict("this broker holds no idempotency keys".into())))
    }

    /// Stops new deliveries; those already sent still arrive, then the stream ends.
    fn cancel(&self) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Hands this consumer's unsettled deliveries back to the broker (and only them, never
    /// another consumer's), to be delivered again.
    fn close(&self) -> impl Future<Output = ()> + Send;
}

/// A live session with a broker. Cheap to clone; all clones share the session.
pub trait Broker: Clone + Send + Sync + 'static {
    type Delivery: Delivery;
    type Deliveries: Stream<Item = Result<Self::Delivery, BrokerError>> + Send + Unpin + 'static;
    type Consumer: Consumer<Delivery = Self::Delivery>;

    /// Declares everything in the plan, idempotently; a conflict is an error naming it.
    fn declare(&self, plan: &Plan) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// After a lost session, makes sure a plan declared before still stands, declaring it
    /// again only where something is missing. A broker whose declarations wait on other nodes
    /// (RabbitMQ: a declaration is a transaction on every node of a cluster, a frozen one
    /// too) checks what exists without declaring; by default, it declares again.
    fn redeclare(&self, plan: &Plan) -> impl Future<Output = Result<(), BrokerError>> + Send {
        self.declare(plan)
    }

    /// Removes these bindings, and only them: their queues, the messages in them and their
    /// exchanges stay. Idempotent: a binding already gone (or whose queue or exchange is) is
    /// no error.
    fn unbind(&self, bindings: &[BindingDecl]) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Puts a copy of a delivery (original body and properties, headers edited as `edits`
    /// says) into the target's queue, and only it; waits until the broker has taken it.
    fn copy(
        &self,
        original: &Self::Delivery,
        target: Target<'_>,
        edits: &Edits,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Starts consuming `queue`, holding at most `credit` unsettled deliveries.
    fn consume(
        &self,
        queue: &str,
        credit: Credit,
    ) -> impl Future<Output = Result<(Self::Deliveries, Self::Consumer), BrokerError>> + Send;

    /// As [`consume`](Broker::consume), for a queue that takes no body over `max_body` bytes:
    /// a broker that knows a message's size without reading its body delivers a larger one
    /// as its [size](Delivery::size) alone, to be dead-lettered unread. By default (a broker
    /// that sends every body whole) it delivers every body.
    fn consume_within(
        &self,
        queue: &str,
        credit: Credit,
        max_body: usize,
    ) -> impl Future<Output = Result<(Self::Deliveries, Self::Consumer), BrokerError>> + Send {
        let _ = max_body;
        self.consume(queue, credit)
    }

    /// Ready messages and consumers of `queue`.
    fn stats(&self, queue: &str) -> impl Future<Output = Result<QueueStats, BrokerError>> + Send;

    /// Messages ready in `queue`.
    fn depth(&self, queue: &str) -> impl Future<Output = Result<u32, BrokerError>> + Send {
        async move { Ok(self.stats(queue).await?.ready) }
    }

    /// Delayed copies not yet due back, whoever published them. The embedded broker counts
    /// its leased deliveries too: a killed runner's come back only when their lease runs out,
    /// where RabbitMQ has them ready again as soon as the connection is gone.
    fn delayed(&self) -> impl Future<Output = Result<u32, BrokerError>> + Send;

    /// What this broker can honour; among it the longest a copy to [`Target::Later`] can wait
    /// (a longer delay is held this long: the runtime serves it in hops).
    fn capabilities(&self) -> Capabilities;

    /// Whether the session is still connected.
    fn is_connected(&self) -> bool;

    /// Closes the session cleanly.
    fn close(&self) -> impl Future<Output = ()> + Send;
}

/// What `sluice publish` needs beyond what `run` needs: new messages, and where one would go.
pub trait Publish: Broker {
    /// Publishes a new persistent message, refused when no queue is bound for its route, and
    /// waits until the broker has taken it.
    fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: Outgoing,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// The queues a message published to `exchange` with `routing_key` and `headers` would
    /// reach, each with the largest body it takes where the broker was told (the runner's
    /// `max_message_bytes`, kept by the embedded broker when declared); `None` from a broker
    /// that cannot tell before the message is sent (RabbitMQ routes only then, and keeps no
    /// such limit). An unroutable message is an error, as its publish would be.
    fn body_limits(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &Headers,
    ) -> impl Future<Output = Result<Option<BodyLimits>, BrokerError>> + Send {
        let _ = (exchange, routing_key, headers);
        std::future::ready(Ok(None))
    }
}

/// What operators' tools (`sluice dlq`, `status`, `plan --broker`, the console) need beyond
/// what `run` and `publish` need: reading a queue in order, a redrive's copy-and-remove, and
/// comparing the broker with a plan. A broker that only runs pipelines need not offer it
/// (apalis splits a backend's capabilities the same way).
pub trait Operate: Publish {
    /// Opens a browsing consumer of `queue`: its messages in queue order where the broker
    /// keeps one ([`Capabilities::browse_in_order`]), at most `window` unsettled; each one
    /// acked is removed at once, and closing the consumer hands back the rest. For reading a
    /// dead-letter queue without losing anything.
    fn browse(
        &self,
        queue: &str,
        window: Credit,
    ) -> impl Future<Output = Result<(Self::Deliveries, Self::Consumer), BrokerError>> + Send;

    /// [`copy`](Broker::copy) into `queue`, and the original (a delivery of the browsing consumer given)
    /// removed in the same step where the broker can: a confirmed copy is then never left
    /// with its original still queued, for a lost session to hand back and a second pass to
    /// copy again. Answers whether it removed the original; when not (by default: a copy
    /// only), the caller acks it once the copy is confirmed.
    fn copy_and_remove(
        &self,
        queue: &str,
        _consumer: &Self::Consumer,
        original: &Self::Delivery,
        edits: &Edits,
    ) -> impl Future<Output = Result<bool, BrokerError>> + Send {
        async move { self.copy(original, Target::Queue(queue), edits).await.map(|()| false) }
    }

    /// How what exists on the broker differs from `plan`, changing nothing.
    fn drift(&self, plan: &Plan) -> impl Future<Output = Result<Vec<Drift>, BrokerError>> + Send;

    /// The messages of `queue` that consumers hold under a lease still running (delivered, not
    /// settled), which no browse reads until it runs out: a killed `sluice dlq` holds its
    /// messages so. None when there are none, or where a broker has no leases (RabbitMQ hands
    /// a dead consumer's messages back as soon as its connection is gone). The embedded broker
    /// first hands back what consumers of processes known dead held.
    fn leased(&self, queue: &str) -> impl Future<Output = Result<Option<Leased>, BrokerError>> + Send {
        let _ = queue;
        std::future::ready(Ok(None))
    }

    /// The oldest message of `queue` (`None` when it has none), read without taking it and
    /// without writing, where the broker can (Redis: what `status` reads of a full server);
    /// `None` by default: browse it instead.
    fn oldest(&self, _queue: &str) -> impl Future<Output = Result<Option<Option<Self::Delivery>>, BrokerError>> + Send {
        std::future::ready(Ok(None))
    }
}

/// Messages held under a lease (see [`Operate::leased`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Leased {
    pub count: u32,
    /// When the last of their leases runs out, unless the consumer holding it lives and renews
    /// it: seconds since the epoch.
    pub until: u64,
}

impl Leased {
    /// `count` messages held (none: `None`), for a broker that keeps no lease's end: the last
    /// runs out at most one `lease` from now.
    pub fn within(count: u64, lease: Duration) -> Option<Leased> {
        let until = std::time::SystemTime::now() + lease;
        let until = until.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        (count > 0).then_some(Leased { count: u32::try_from(count).unwrap_or(u32::MAX), until })
    }
}
