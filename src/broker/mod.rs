//! The broker seen by the runtime: declare a plan, publish with confirm, consume with
//! prefetch, ack, delayed publish to one queue, queue depth. One trait, so the embedded
//! broker and RabbitMQ share every rule in the runtime.
//!
//! Implementations do transport only: no retry policy, no classification, no envelopes.

pub mod amqp;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;

use crate::topology::{self, Plan};

/// AMQP header values sluice reads and writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderValue {
    Str(String),
    Int(i64),
}

impl HeaderValue {
    /// The value as text, whatever its type.
    pub fn to_text(&self) -> String {
        match self {
            HeaderValue::Str(s) => s.clone(),
            HeaderValue::Int(i) => i.to_string(),
        }
    }
}

/// Headers to set on a message (merged over the original's on a copy).
pub type Headers = BTreeMap<String, HeaderValue>;

/// A new message: the body and the properties sluice sets.
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    pub body: Vec<u8>,
    pub message_id: Option<String>,
    pub kind: Option<String>,
    /// Seconds since the epoch.
    pub timestamp: Option<u64>,
    pub headers: Headers,
}

/// What can go wrong talking to a broker.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    #[error("cannot connect to the broker at {url}: {reason}")]
    Connect { url: String, reason: String },
    /// The broker turned the session down for good: credentials, a missing virtual host.
    #[error("cannot connect to the broker at {url}: {reason}")]
    Refused { url: String, reason: String },
    /// A declaration conflicts with what exists on the broker.
    #[error("{0}")]
    Conflict(String),
    #[error("the broker refused the message (nack) on exchange \"{exchange}\"")]
    Nacked { exchange: String },
    #[error("unroutable: no queue is bound to exchange \"{exchange}\" for routing key \"{routing_key}\"")]
    Unroutable { exchange: String, routing_key: String },
    #[error("not found: {0}")]
    NotFound(String),
    #[error("no confirm from the broker within {0:?}")]
    ConfirmTimeout(Duration),
    #[error("broker connection lost: {0}")]
    Lost(String),
}

impl BrokerError {
    /// Retrying cannot help: the configuration (pipeline files, URL, credentials) must change.
    pub fn is_fatal(&self) -> bool {
        matches!(self, BrokerError::Refused { .. } | BrokerError::Conflict(_) | BrokerError::NotFound(_))
    }
}

/// One message handed to a consumer; settled by `ack`.
pub trait Delivery: Send + Sync + 'static {
    /// The body as published, shared (not copied) with whatever sends it on.
    fn body(&self) -> &Bytes;
    /// Increases per consumer; acks with `multiple` cover every lower tag of the same consumer.
    fn tag(&self) -> u64;
    fn header(&self, name: &str) -> Option<HeaderValue>;
    /// The `timestamp` property, seconds since the epoch.
    fn timestamp(&self) -> Option<u64>;
    fn message_id(&self) -> Option<&str>;
    /// Whether this delivery can still be acked (its channel is open).
    fn is_live(&self) -> bool;
    /// Acknowledges this delivery, and with `multiple` every earlier one of its consumer.
    fn ack(&self, multiple: bool) -> impl Future<Output = Result<(), BrokerError>> + Send;
}

/// A live session with a broker. Cheap to clone; all clones share the session.
pub trait Broker: Clone + Send + Sync + 'static {
    type Delivery: Delivery;
    type Deliveries: Stream<Item = Result<Self::Delivery, BrokerError>> + Send + Unpin + 'static;

    /// Declares everything in the plan, idempotently; a conflict is an error naming it.
    fn declare(&self, plan: &Plan) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Publishes a new persistent message, mandatory, and waits for the broker's confirm.
    fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: Outgoing,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Publishes a copy of a delivery (original body and properties, `headers` merged over its
    /// own), mandatory, and waits for the confirm.
    fn republish(
        &self,
        exchange: &str,
        routing_key: &str,
        original: &Self::Delivery,
        headers: Headers,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Publishes a copy that reaches `queue` (and only it) after `delay`.
    fn publish_delayed(
        &self,
        queue: &str,
        delay: Duration,
        original: &Self::Delivery,
        headers: Headers,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send {
        let (exchange, routing_key) = topology::delay_route(queue, delay);
        async move { self.republish(&exchange, &routing_key, original, headers).await }
    }

    /// Starts consuming `queue` with at most `prefetch` unacked deliveries.
    fn consume(&self, queue: &str, prefetch: u16)
    -> impl Future<Output = Result<Self::Deliveries, BrokerError>> + Send;

    /// Stops delivering from `queue`; deliveries already sent still arrive, then the stream ends.
    fn cancel(&self, queue: &str) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Messages ready in `queue`.
    fn depth(&self, queue: &str) -> impl Future<Output = Result<u32, BrokerError>> + Send;

    /// Whether the session is still connected.
    fn is_connected(&self) -> bool;

    /// Closes the session cleanly.
    fn close(&self) -> impl Future<Output = ()> + Send;
}
