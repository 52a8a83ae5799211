//! RabbitMQ over AMQP 0-9-1 (lapin): one connection per session, a confirm-mode channel for
//! publishing, one channel per consumer (its prefetch, its acks, and closing it hands back
//! exactly its unsettled deliveries), and a channel for declarations and depth reads that is
//! reopened when the broker closes it. The plan's typed declarations become `x-` arguments
//! and the delay cascade here ([`declare`]); acks of a batch become contiguous `multiple`
//! acks ([`AckWindow`]).
//!
//! No reconnection here: the runtime supervises sessions and opens a new one when this dies.

mod declare;

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use lapin::Confirmation;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde_json::Value;

use crate::vocab::{
    self,
    capabilities::{self, Capabilities},
};

use self::declare::DestinationKind;
pub use self::declare::{DELAY_LEVELS, DELAY_UNIT, DELIVERY_LIMIT, Declarations, MAX_DELAY, declarations, delay_route};
use super::kit::AckWindow;
use super::{
    Broker, BrokerError, Cause, Consumer, Credit, DeadLetterRecord, Delivery, Drift, Edits, HeaderValue, Headers,
    Operate, Outgoing, Publish, QueueStats, Route, Target,
};
use crate::envelope::ERROR_HEADER;
use crate::topology::{BindingDecl, Plan};

/// How long connecting (TCP, TLS, the AMQP handshake and the first channels) and waiting for
/// one publisher confirm may take.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub connect: Duration,
    /// A confirm that does not come in time ends the session (a frozen node, a quorum queue
    /// without its majority): the delivery it was for is not acked and comes back.
    pub confirm: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts { connect: Duration::from_secs(10), confirm: Duration::from_secs(15) }
    }
}

/// The heartbeat asked for unless the URL names one: lapin declares a silent server dead after
/// twice the negotiated value (looking every half of it), so a frozen node is noticed in 4 to
/// 5 s, and a false alarm needs a server silent for 4 s. A heartbeat is an 8-byte frame, sent
/// only when the connection has carried nothing else for a while.
pub const HEARTBEAT_SECONDS: u16 = 2;

/// RabbitMQ: everything sluice offers; delays up to the delay cascade's longest (about 38
/// days); bodies up to the 512 MiB it takes whatever it is configured to.
pub const CAPABILITIES: Capabilities = Capabilities {
    name: "RabbitMQ",
    longest_delay: Some(MAX_DELAY),
    largest_body: vocab::MAX_MESSAGE_BYTES,
    priorities: true,
    message_ttl: true,
    max_length: true,
    queue_types: vocab::QueueKind::ALL,
    exchange_kinds: vocab::ExchangeKind::ALL,
    orderings: &[capabilities::Ordering::SingleActiveConsumer],
    arguments: true,
    hand_back: capabilities::HandBack::PerMessage,
    leases: false,
    holds_acks: true,
    holds_keys: false,
    browse_in_order: true,
    atomic_copy_and_remove: false,
    admits_past_max_length: 1,
    queue_names: None,
    counts_consumers: true,
    counts_waiting_consumers: false,
};

/// How long closing a connection may wait for the broker's answer.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A live RabbitMQ session.
#[derive(Clone)]
pub struct Amqp {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Connection,
    /// Connections opened for consumers once the first one's channels ran out (the
    /// negotiated `channel_max`, 2,047 on RabbitMQ by default): one channel per consumer.
    more: tokio::sync::Mutex<Vec<Arc<Connection>>>,
    /// How to open one of those: the URL as connected, and the time it may take.
    url: String,
    connect_timeout: Duration,
    publisher: Channel,
    control: tokio::sync::Mutex<Channel>,
    confirm_timeout: Duration,
    /// Set when a confirm timed out: the session is given up even if the socket lives.
    broken: AtomicBool,
}

/// The URL with its password masked, fit for logs and errors.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

/// The URL with a `heartbeat` of [`HEARTBEAT_SECONDS`] unless it names one.
fn with_heartbeat(url: &str) -> String {
    let query = url.split_once('?').map(|(_, q)| q);
    if query.is_some_and(|q| q.split('&').any(|p| p.starts_with("heartbeat="))) {
        return url.to_string();
    }
    let sep = if query.is_some() { '&' } else { '?' };
    format!("{url}{sep}heartbeat={HEARTBEAT_SECONDS}")
}

/// The node a URL names, for logs and the `sluice_broker_connected` gauge: `host:port`.
pub fn node_name(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let host = rest.split(['/', '?']).next().unwrap_or(rest);
    match (host.contains(':') && !host.ends_with(']'), url.starts_with("amqps://")) {
        (true, _) => host.to_string(),
        (false, true) => format!("{host}:5671"),
        (false, false) => format!("{host}:5672"),
    }
}

impl Amqp {
    /// Connects and opens the publishing and control channels, all within `timeouts.connect`:
    /// a broker that accepts TCP and never finishes the handshake must not hang the caller.
    pub async fn connect(url: &str, timeouts: Timeouts) -> Result<Amqp, BrokerError> {
        let timeout = timeouts.connect;
        let url = with_heartbeat(url);
        let opening = async {
            let connection = open(&url).await?;
            let publisher = connection.create_channel().await?;
            publisher.confirm_select(ConfirmSelectOptions::default()).await?;
            let control = connection.create_channel().await?;
            Ok::<_, lapin::Error>((connection, publisher, control))
        };
        let (connection, publisher, control) = within(&url, timeout, opening).await?;
        let control = tokio::sync::Mutex::new(control);
        let (confirm_timeout, broken) = (timeouts.confirm, AtomicBool::new(false));
        let more = tokio::sync::Mutex::default();
        let inner =
            Inner { connection, more, url, connect_timeout: timeout, publisher, control, confirm_timeout, broken };
        Ok(Amqp { inner: Arc::new(inner) })
    }

    /// Closes every connection of the session (the first, and those opened for more consumers)
    /// at once, each waiting at most [`CLOSE_TIMEOUT`]: a frozen or blocked node never answers.
    async fn close_all(&self, code: u16, why: &str) {
        let more: Vec<Arc<Connection>> = self.inner.more.lock().await.clone();
        let connections = std::iter::once(&self.inner.connection).chain(more.iter().map(|c| &**c));
        let closing = connections.map(|connection| async move {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, connection.close(code, why.into())).await;
        });
        futures_util::future::join_all(closing).await;
    }

    /// A channel for a consumer, on the first connection with one free; a new connection when
    /// none has.
    async fn consumer_channel(&self) -> Result<Channel, BrokerError> {
        let mut more = self.inner.more.lock().await;
        for connection in std::iter::once(&self.inner.connection).chain(more.iter().map(|c| &**c)) {
            match connection.create_channel().await {
                Err(e) if matches!(e.kind(), lapin::ErrorKind::ChannelsLimitReached) => continue,
                created => return created.map_err(lost),
            }
        }
        let url = &self.inner.url;
        let opening = async {
            let connection = open(url).await?;
            let channel = connection.create_channel().await?;
            Ok((connection, channel))
        };
        let (connection, channel) = within(url, self.inner.connect_timeout, opening).await?;
        tracing::info!(
            connections = more.len() + 2,
            "another connection for consumers: the others have no channel left"
        );
        more.push(Arc::new(connection));
        Ok(channel)
    }

    /// Gives the session up: a confirm that never came says the node is frozen or cut off.
    /// The connection is closed in the background (a frozen node never answers the close), so
    /// its consumers end and their unsettled deliveries go back to the queue.
    fn give_up(&self) {
        if self.inner.broken.swap(true, Ordering::SeqCst) {
            return;
        }
        let session = self.clone();
        tokio::spawn(async move { session.close_all(320, "sluice: no publisher confirm in time").await });
    }

    /// The control channel, reopened if the broker closed it after an error.
    async fn control(&self) -> Result<Channel, BrokerError> {
        let mut channel = self.inner.control.lock().await;
        if !channel.status().connected() {
            *channel = self.inner.connection.create_channel().await.map_err(lost)?;
        }
        Ok(channel.clone())
    }

    /// A consumer on a channel of its own; settled deliveries beyond an unsettled one are
    /// acked one by one once more than `hold` wait.
    async fn open_consumer(
        &self,
        queue: &str,
        prefetch: u16,
        hold: usize,
    ) -> Result<(AmqpDeliveries, AmqpConsumer), BrokerError> {
        let channel = self.consumer_channel().await?;
        channel.basic_qos(prefetch, BasicQosOptions::default()).await.map_err(lost)?;
        let tag: ShortString = format!("sluice-{}", uuid::Uuid::now_v7()).into();
        let inner = channel
            .basic_consume(queue.into(), tag.clone(), BasicConsumeOptions::default(), FieldTable::default())
            .await
            .map_err(|err| conflict("queue", queue, err))?;
        let window = Arc::new(Mutex::new(AckWindow::new(hold)));
        let sending = Arc::default();
        Ok((AmqpDeliveries { inner, window: window.clone() }, AmqpConsumer { channel, tag, window, sending }))
    }

    async fn publish_raw(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), BrokerError> {
        let options = BasicPublishOptions { mandatory: true, ..Default::default() };
        let confirm = self
            .inner
            .publisher
            .basic_publish(exchange.into(), routing_key.into(), options, body, properties)
            .await
            .map_err(lost)?;
        let timeout = self.inner.confirm_timeout;
        let confirmation = match tokio::time::timeout(timeout, confirm).await {
            Ok(confirmation) => confirmation.map_err(lost)?,
            Err(_) => {
                self.give_up();
                return Err(BrokerError::ConfirmTimeout(timeout));
            }
        };
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => {
                Err(BrokerError::Unroutable { exchange: exchange.into(), routing_key: routing_key.into() })
            }
            Confirmation::Nack(_) | Confirmation::NotRequested => {
                Err(BrokerError::Rejected { exchange: exchange.into(), reason: "nack".into() })
            }
        }
    }

    /// Publishes the original's body and properties with `headers` merged over `base`, shedding
    /// the largest original headers if the copy would not fit the connection's frame size.
    async fn send_copy(
        &self,
        exchange: &str,
        routing_key: &str,
        original: &AmqpDelivery,
        base: FieldTable,
        headers: &Headers,
    ) -> Result<(), BrokerError> {
        let mut table = headers_table(&base, headers);
        fit_frame(&original.delivery.properties, &mut table, self.inner.connection.configuration().frame_max());
        let properties = original.delivery.properties.clone().with_delivery_mode(2).with_headers(table);
        self.publish_raw(exchange, routing_key, &original.body, properties).await
    }
}

/// What a content header frame adds to its properties: frame type, channel, size, class,
/// weight, body size, frame end.
const HEADER_FRAME_OVERHEAD: usize = 1 + 2 + 4 + 2 + 2 + 8 + 1;

/// The encoded size of a message's properties.
fn properties_size(properties: &BasicProperties) -> usize {
    cookie_factory::gen_simple(lapin::protocol::basic::gen_properties(properties), Vec::new())
        .map_or(usize::MAX, |v| v.len())
}

/// Makes a copy's headers fit one frame of `frame_max` bytes with the copy's other properties:
/// the broker closes the whole connection over a frame too large, and with it every other
/// delivery in flight. The largest headers the copy inherited are shed (sluice's own are
/// small and kept) and named in `x-sluice-error`.
fn fit_frame(properties: &BasicProperties, table: &mut FieldTable, frame_max: u32) {
    let limit = usize::try_from(frame_max).unwrap_or(usize::MAX).saturating_sub(HEADER_FRAME_OVERHEAD);
    let size = |table: &FieldTable| properties_size(&properties.clone().with_headers(table.clone()));
    if frame_max == 0 || size(table) <= limit {
        return;
    }
    let error = match table.inner().get(ERROR_HEADER) {
        Some(AMQPValue::LongString(s)) => format!("{}; ", String::from_utf8_lossy(s.as_bytes())),
        _ => String::new(),
    };
    let mut shed: Vec<String> = Vec::new();
    while size(table) > limit {
        let largest = table
            .inner()
            .iter()
            .filter(|(name, _)| !name.as_str().starts_with("x-sluice-"))
            .max_by_key(|(name, value)| {
                let mut one = FieldTable::default();
                one.insert((*name).clone(), (*value).clone());
                properties_size(&BasicProperties::default().with_headers(one))
            })
            .map(|(name, _)| name.clone());
        let Some(name) = largest else { return };
        let mut kept = FieldTable::default();
        for (k, v) in table.inner() {
            if *k != name {
                kept.insert(k.clone(), v.clone());
            }
        }
        shed.push(name.as_str().to_string());
        let note = format!("{error}headers left out to fit the broker's frame size: {}", shed.join(", "));
        kept.insert(ERROR_HEADER.into(), AMQPValue::LongString(note.chars().take(MAX_NOTE).collect::<String>().into()));
        *table = kept;
    }
}

/// The longest error text a copy carries.
const MAX_NOTE: usize = 2000;

/// The headers without the broker's dead-letter history (`x-death`, `x-first-death-*`,
/// `x-last-death-*`). A retry copy passes through the delay cascade again; RabbitMQ takes a
/// message whose `x-death` already names the queue it is dead-lettered into for a cycle, and
/// strands it (at-least-once) or drops it. Each trip through the cascade starts afresh.
fn without_death_history(headers: Option<&FieldTable>) -> FieldTable {
    without(headers, |name| {
        name == "x-death" || name.starts_with("x-first-death-") || name.starts_with("x-last-death-")
    })
}

/// The headers but those `drop` names.
fn without(headers: Option<&FieldTable>, drop: impl Fn(&str) -> bool) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in headers.map(|h| h.inner().iter()).into_iter().flatten() {
        if !drop(k.as_str()) {
            t.insert(k.clone(), v.clone());
        }
    }
    t
}

/// A delivery from RabbitMQ; its body is moved out of lapin's delivery, to be shared.
pub struct AmqpDelivery {
    body: Bytes,
    /// Copied out of lapin's delivery once, to be lent as the trait lends it.
    route: Route,
    delivery: lapin::message::Delivery,
}

impl Delivery for AmqpDelivery {
    fn body(&self) -> &Bytes {
        &self.body
    }

    fn header(&self, name: &str) -> Option<HeaderValue> {
        let headers = self.delivery.properties.headers().as_ref()?;
        match headers.inner().get(name)? {
            AMQPValue::LongString(s) => Some(HeaderValue::Str(String::from_utf8_lossy(s.as_bytes()).into_owned())),
            AMQPValue::ShortString(s) => Some(HeaderValue::Str(s.as_str().to_string())),
            AMQPValue::ShortShortInt(i) => Some(HeaderValue::Int(i64::from(*i))),
            AMQPValue::ShortShortUInt(i) => Some(HeaderValue::Int(i64::from(*i))),
            AMQPValue::ShortInt(i) => Some(HeaderValue::Int(i64::from(*i))),
            AMQPValue::ShortUInt(i) => Some(HeaderValue::Int(i64::from(*i))),
            AMQPValue::LongInt(i) => Some(HeaderValue::Int(i64::from(*i))),
            AMQPValue::LongUInt(i) => Some(HeaderValue::Int(i64::from(*i))),
            AMQPValue::LongLongInt(i) => Some(HeaderValue::Int(*i)),
            _ => None,
        }
    }

    fn timestamp(&self) -> Option<u64> {
        *self.delivery.properties.timestamp()
    }

    fn message_id(&self) -> Option<&str> {
        self.delivery.properties.message_id().as_ref().map(|s| s.as_str())
    }

    fn kind(&self) -> Option<&str> {
        self.delivery.properties.kind().as_ref().map(|s| s.as_str())
    }

    fn content_type(&self) -> Option<&str> {
        self.delivery.properties.content_type().as_ref().map(|s| s.as_str())
    }

    fn route(&self) -> Option<&Route> {
        Some(&self.route)
    }

    fn headers(&self) -> BTreeMap<String, Value> {
        let table = self.delivery.properties.headers().as_ref();
        table
            .map(|t| t.inner().iter().map(|(k, v)| (k.as_str().to_string(), json_value(v))).collect())
            .unwrap_or_default()
    }

    fn is_live(&self) -> bool {
        self.delivery.acker.usable()
    }

    /// The newest entry of `x-death`: RabbitMQ puts the latest dead-lettering first.
    fn dead_letter_record(&self) -> Option<DeadLetterRecord> {
        let table = self.delivery.properties.headers().as_ref()?;
        let AMQPValue::FieldArray(deaths) = table.inner().get("x-death")? else { return None };
        let death = json_value(deaths.as_slice().first()?);
        Some(DeadLetterRecord {
            reason: death.get("reason").and_then(Value::as_str).map(str::to_string),
            count: death.get("count").and_then(Value::as_i64),
            time: death.get("time").and_then(Value::as_u64),
        })
    }
}

fn lock(window: &Mutex<AckWindow>) -> MutexGuard<'_, AckWindow> {
    // The window is left whole between its calls, panic or not.
    window.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The deliveries of one consumer; each is entered in its consumer's ack window as it passes.
pub struct AmqpDeliveries {
    inner: lapin::Consumer,
    window: Arc<Mutex<AckWindow>>,
}

impl Stream for AmqpDeliveries {
    type Item = Result<AmqpDelivery, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.inner).poll_next(cx).map(|item| {
            item.map(|result| {
                let mut delivery = result.map_err(lost)?;
                lock(&self.window).received(delivery.delivery_tag);
                let route = Route {
                    exchange: delivery.exchange.as_str().to_string(),
                    routing_key: delivery.routing_key.as_str().to_string(),
                };
                Ok(AmqpDelivery { body: Bytes::from(std::mem::take(&mut delivery.data)), route, delivery })
            })
        })
    }
}

/// One consumer on a channel of its own: its prefetch, its acks, and its unsettled
/// deliveries, which closing the channel hands back.
#[derive(Clone)]
pub struct AmqpConsumer {
    channel: Channel,
    tag: ShortString,
    window: Arc<Mutex<AckWindow>>,
    /// Held from choosing a call's acks until they are sent: a `multiple` ack of a later call
    /// must not reach the broker before the acks it covers (an ack of a tag already acked
    /// closes the channel).
    sending: Arc<tokio::sync::Mutex<()>>,
}

impl Consumer for AmqpConsumer {
    type Delivery = AmqpDelivery;

    async fn ack(&self, settled: &[AmqpDelivery]) -> Result<(), BrokerError> {
        let _turn = self.sending.lock().await;
        let acks = lock(&self.window).settle(settled.iter().map(|d| d.delivery.delivery_tag));
        for (tag, multiple) in acks {
            if let Err(e) = self.channel.basic_ack(tag, BasicAckOptions { multiple }).await {
                // The window has let go of these tags, so they cannot be acked again: closing
                // the channel makes sure RabbitMQ delivers them again (and they are not live).
                self.close_channel().await;
                return Err(lost(e));
            }
        }
        Ok(())
    }

    async fn cancel(&self) -> Result<(), BrokerError> {
        self.channel.basic_cancel(self.tag.clone(), BasicCancelOptions::default()).await.map_err(lost)
    }

    /// Acks what was settled and waits behind an unsettled delivery (one by one), then closes:
    /// only what is unsettled goes back to the queue.
    async fn close(&self) {
        {
            let _turn = self.sending.lock().await;
            let settled = lock(&self.window).take_settled();
            for tag in settled {
                if self.channel.basic_ack(tag, BasicAckOptions { multiple: false }).await.is_err() {
                    // The channel is gone: the broker delivers these again (at-least-once).
                    break;
                }
            }
        }
        self.close_channel().await;
    }
}

impl AmqpConsumer {
    /// Closes the channel: whatever is unacked on it goes back to the queue, and the broker
    /// delivers it again.
    async fn close_channel(&self) {
        let _ = self.channel.close(200, "sluice: consumer closed".into()).await;
    }
}

impl Broker for Amqp {
    type Delivery = AmqpDelivery;
    type Deliveries = AmqpDeliveries;
    type Consumer = AmqpConsumer;

    async fn declare(&self, plan: &Plan) -> Result<(), BrokerError> {
        let plan = declarations(plan);
        for e in &plan.exchanges {
            declare_exchange(&self.control().await?, e, false)
                .await
                .map_err(|err| conflict("exchange", &e.name, err))?;
        }
        for q in &plan.queues {
            declare_queue(&self.control().await?, q, false).await.map_err(|err| conflict("queue", &q.name, err))?;
        }
        for b in &plan.bindings {
            let channel = self.control().await?;
            let args = table(b.arguments.iter());
            let (source, destination, key) =
                (b.source.as_str().into(), b.destination.as_str().into(), b.routing_key.as_str().into());
            let result = match b.destination_kind {
                DestinationKind::Queue => {
                    channel.queue_bind(destination, source, key, QueueBindOptions::default(), args).await
                }
                DestinationKind::Exchange => {
                    channel.exchange_bind(destination, source, key, ExchangeBindOptions::default(), args).await
                }
            };
            let what = format!("binding {} -> {}", b.source, b.destination);
            result.map_err(|err| conflict("binding", &what, err))?;
        }
        Ok(())
    }

    async fn redeclare(&self, plan: &Plan) -> Result<(), BrokerError> {
        // A passive declaration is a lookup on the node the session is with.
        let declarations = declarations(plan);
        for e in &declarations.exchanges {
            if !found(declare_exchange(&self.control().await?, e, true).await)? {
                return self.declare(plan).await;
            }
        }
        for q in &declarations.queues {
            if !found(declare_queue(&self.control().await?, q, true).await)? {
                return self.declare(plan).await;
            }
        }
        Ok(())
    }

    /// Unbinds each queue from its exchange with the routing key and arguments it was bound
    /// with (RabbitMQ names a binding by all four). A removed queue's binding to the delay
    /// cascade stays: only that queue's own retry copies use it, so it takes no new traffic,
    /// and the copies already in the cascade land in the queue, where they wait with its other
    /// messages. Without it they would be unroutable at the end of the cascade, held and
    /// retried by the last delay queue's at-least-once dead-lettering, seen by no depth.
    async fn unbind(&self, bindings: &[BindingDecl]) -> Result<(), BrokerError> {
        for b in bindings {
            let channel = self.control().await?;
            let (queue, exchange, key) =
                (b.queue.as_str().into(), b.exchange.as_str().into(), b.routing_key.as_str().into());
            match channel.queue_unbind(queue, exchange, key, table(b.arguments.iter())).await {
                Ok(()) => {}
                // A queue or exchange gone (RabbitMQ 4 answers ok anyway): so is the binding.
                // The control channel this closed is reopened by its next use.
                Err(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => {}
                Err(e) => {
                    let what =
                        format!("removing binding {} -> {} (routing key \"{}\")", b.exchange, b.queue, b.routing_key);
                    return Err(BrokerError::Lost(Cause::from_error(e).within(what)));
                }
            }
        }
        Ok(())
    }

    /// A retry's copy goes through the delay cascade, and starts afresh: the cascade's own
    /// dead-letterings would otherwise pile up in its `x-death`; a dead-letter copy keeps it.
    async fn copy(&self, original: &AmqpDelivery, target: Target<'_>, edits: &Edits) -> Result<(), BrokerError> {
        let headers = original.delivery.properties.headers().as_ref();
        let base = match edits.drop_history || matches!(target, Target::Later { .. }) {
            true => without_death_history(headers),
            false => headers.cloned().unwrap_or_default(),
        };
        let base = without(Some(&base), |name| edits.remove.iter().any(|r| r == name));
        let (exchange, routing_key) = match target {
            Target::Later { queue, delay } => delay_route(queue, delay),
            Target::Queue(queue) | Target::DeadLetter(queue) => (String::new(), queue.to_string()),
        };
        self.send_copy(&exchange, &routing_key, original, base, &edits.set).await
    }

    async fn consume(&self, queue: &str, credit: Credit) -> Result<(AmqpDeliveries, AmqpConsumer), BrokerError> {
        // One slow handler may hold up the acks of at most half the window behind it.
        self.open_consumer(queue, credit.get(), usize::from(credit.get()) / 2).await
    }

    async fn stats(&self, queue: &str) -> Result<QueueStats, BrokerError> {
        let channel = self.control().await?;
        let options = QueueDeclareOptions { passive: true, ..Default::default() };
        let q = channel
            .queue_declare(queue.into(), options, FieldTable::default())
            .await
            .map_err(|err| conflict("queue", queue, err))?;
        Ok(QueueStats { ready: q.message_count(), consumers: q.consumer_count() })
    }

    async fn delayed(&self) -> Result<u32, BrokerError> {
        let mut total = 0u32;
        for level in 0..DELAY_LEVELS {
            total = total.saturating_add(self.depth(&declare::level_name(level)).await?);
        }
        Ok(total)
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn is_connected(&self) -> bool {
        // A consumers' connection being opened holds the lock: the others are looked at next time.
        let more = self.inner.more.try_lock().map_or(true, |more| more.iter().all(|c| c.status().connected()));
        !self.inner.broken.load(Ordering::SeqCst)
            && self.inner.connection.status().connected()
            && self.inner.publisher.status().connected()
            && more
    }

    /// Closes the session. One given up for a missing confirm is being closed in the
    /// background already ([`Amqp::give_up`]): a node that sent no confirm answers no close
    /// either, so waiting [`CLOSE_TIMEOUT`] for it again would only hold up the next node
    /// (`sluice publish` under a disk alarm gave up after 3 × (1 s + 5 s) with
    /// `--confirm-timeout 1s`).
    async fn close(&self) {
        if self.inner.broken.load(Ordering::SeqCst) {
            return;
        }
        self.close_all(200, "sluice shutting down").await;
    }
}

impl Publish for Amqp {
    async fn publish(&self, exchange: &str, routing_key: &str, message: Outgoing) -> Result<(), BrokerError> {
        let content_type = message.content_type.unwrap_or_else(|| "application/json".into());
        let mut properties = BasicProperties::default()
            .with_content_type(content_type.into())
            .with_delivery_mode(2)
            .with_headers(headers_table(&FieldTable::default(), &message.headers));
        if let Some(id) = message.message_id {
            properties = properties.with_message_id(id.into());
        }
        if let Some(kind) = message.kind {
            properties = properties.with_type(kind.into());
        }
        if let Some(ts) = message.timestamp {
            properties = properties.with_timestamp(ts);
        }
        if let Some(priority) = message.priority {
            properties = properties.with_priority(priority);
        }
        self.publish_raw(exchange, routing_key, &message.body, properties).await
    }
}

impl Operate for Amqp {
    async fn browse(&self, queue: &str, window: Credit) -> Result<(AmqpDeliveries, AmqpConsumer), BrokerError> {
        // Held messages are never settled: each settled one is acked at once, not behind them.
        self.open_consumer(queue, window.get(), 0).await
    }

    async fn drift(&self, plan: &Plan) -> Result<Vec<Drift>, BrokerError> {
        // A passive declaration says whether it exists; then the same declaration as `run`
        // makes it, which changes nothing where it matches and otherwise fails with the
        // broker's words naming the setting and both values. Nothing is created.
        let plan = declarations(plan);
        let mut drift = Vec::new();
        for e in &plan.exchanges {
            if !found(declare_exchange(&self.control().await?, e, true).await)? {
                drift.push(Drift::MissingExchange { name: e.name.clone() });
            } else if let Err(err) = declare_exchange(&self.control().await?, e, false).await {
                drift.push(conflict_drift("exchange", &e.name, err)?);
            }
        }
        for q in &plan.queues {
            if !found(declare_queue(&self.control().await?, q, true).await)? {
                drift.push(Drift::MissingQueue { name: q.name.clone() });
            } else if let Err(err) = declare_queue(&self.control().await?, q, false).await {
                drift.push(conflict_drift("queue", &q.name, err)?);
            }
        }
        drift.push(Drift::BindingsUnchecked {
            reason: "RabbitMQ lists bindings only through its management plugin; `sluice run` declares them".into(),
        });
        Ok(drift)
    }
}

/// Declares an exchange durable, or with `passive` only checks that it exists.
async fn declare_exchange(channel: &Channel, e: &declare::Exchange, passive: bool) -> Result<(), lapin::Error> {
    let kind = match e.kind.as_str() {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "headers" => ExchangeKind::Headers,
        "topic" => ExchangeKind::Topic,
        other => ExchangeKind::Custom(other.to_string()),
    };
    let options = ExchangeDeclareOptions { durable: true, passive, ..Default::default() };
    channel.exchange_declare(e.name.as_str().into(), kind, options, FieldTable::default()).await
}

/// Declares a queue durable with its arguments, or with `passive` only checks that it exists.
async fn declare_queue(channel: &Channel, q: &declare::Queue, passive: bool) -> Result<(), lapin::Error> {
    let options = QueueDeclareOptions { durable: true, passive, ..Default::default() };
    let args = if passive { FieldTable::default() } else { table(q.arguments.iter()) };
    channel.queue_declare(q.name.as_str().into(), options, args).await.map(|_| ())
}

/// Opens a connection to `url` (which carries the heartbeat), named for the broker's lists.
async fn open(url: &str) -> Result<Connection, lapin::Error> {
    let properties = ConnectionProperties::default().with_connection_name("sluice".into());
    Connection::connect(url, properties).await
}

/// `opening` (a connection and its first channels), given at most `timeout`: a broker that
/// accepts TCP and never finishes the handshake must not hang the caller.
async fn within<T>(
    url: &str,
    timeout: Duration,
    opening: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, BrokerError> {
    match tokio::time::timeout(timeout, opening).await {
        Ok(Ok(opened)) => Ok(opened),
        Ok(Err(e)) => Err(connect_error(url, e)),
        Err(_) => {
            let reason = format!("no AMQP handshake within {timeout:?} (is it a RabbitMQ port?)");
            Err(BrokerError::Connect { url: redact(url), reason: reason.into() })
        }
    }
}

/// The AMQP reply code of a protocol error (the broker's own words are in its message).
fn amqp_error(e: &lapin::Error) -> Option<&lapin::protocol::AMQPError> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp),
        _ => None,
    }
}

fn is_soft(e: &lapin::Error, code: AMQPSoftError) -> bool {
    amqp_error(e).is_some_and(|a| *a.kind() == AMQPErrorKind::Soft(code))
}

/// What a passive declaration says: whether the exchange or queue exists.
fn found(declared: Result<(), lapin::Error>) -> Result<bool, BrokerError> {
    match declared {
        Ok(()) => Ok(true),
        Err(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => Ok(false),
        Err(e) => Err(lost(e)),
    }
}

fn lost(e: lapin::Error) -> BrokerError {
    if is_soft(&e, AMQPSoftError::NOTFOUND) {
        BrokerError::NotFound(Cause::from_error(e))
    } else {
        BrokerError::Lost(Cause::from_error(e))
    }
}

/// A failed connection attempt: refused credentials and a vhost the user may not open are
/// the user's to fix, not worth retrying; anything else may pass.
fn connect_error(url: &str, e: lapin::Error) -> BrokerError {
    let url = redact(url);
    match amqp_error(&e).map(|a| a.kind()) {
        Some(AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)) => {
            BrokerError::Refused { url, reason: Cause::from_error(e).within("the broker refused the credentials") }
        }
        Some(AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)) => {
            BrokerError::Refused { url, reason: Cause::from_error(e).within("the broker refused the virtual host") }
        }
        _ => BrokerError::Connect { url, reason: Cause::from_error(e) },
    }
}

/// A declaration error, worded for the user: which object, and the broker's own reason (which
/// names the argument and both values for PRECONDITION_FAILED).
fn conflict(what: &str, name: &str, e: lapin::Error) -> BrokerError {
    if is_soft(&e, AMQPSoftError::PRECONDITIONFAILED) {
        BrokerError::Conflict(Cause::from_error(e).within(format_args!(
            "{what} \"{name}\" conflicts with what exists on the broker (sluice never deletes a queue: change the file back or remove the {what} yourself)"
        )))
    } else if is_soft(&e, AMQPSoftError::NOTFOUND) {
        BrokerError::NotFound(Cause::from_error(e).within(format_args!("{what} \"{name}\"")))
    } else {
        BrokerError::Lost(Cause::from_error(e).within(format_args!("declaring {what} \"{name}\"")))
    }
}

/// A declaration `run` would make that the broker refuses: a conflict in the broker's words.
fn conflict_drift(what: &str, name: &str, e: lapin::Error) -> Result<Drift, BrokerError> {
    match amqp_error(&e) {
        Some(a) if *a.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) => {
            Ok(Drift::Conflict { what: what.into(), name: name.into(), detail: a.get_message().to_string() })
        }
        _ => Err(lost(e)),
    }
}

/// A header value as JSON: tables and arrays (the broker's `x-death`) whole.
fn json_value(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(i) => Value::from(*i),
        AMQPValue::ShortShortUInt(i) => Value::from(*i),
        AMQPValue::ShortInt(i) => Value::from(*i),
        AMQPValue::ShortUInt(i) => Value::from(*i),
        AMQPValue::LongInt(i) => Value::from(*i),
        AMQPValue::LongUInt(i) => Value::from(*i),
        AMQPValue::LongLongInt(i) => Value::from(*i),
        AMQPValue::Timestamp(t) => Value::from(*t),
        AMQPValue::Float(f) => Value::from(f64::from(*f)),
        AMQPValue::Double(f) => Value::from(*f),
        AMQPValue::ShortString(s) => Value::from(s.as_str()),
        AMQPValue::LongString(s) => Value::from(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ByteArray(b) => Value::from(String::from_utf8_lossy(b.as_slice())),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(json_value).collect()),
        AMQPValue::FieldTable(t) => {
            Value::Object(t.inner().iter().map(|(k, v)| (k.as_str().to_string(), json_value(v))).collect())
        }
        AMQPValue::DecimalValue(d) => Value::from(format!("{d:?}")),
        AMQPValue::Void => Value::Null,
    }
}

fn amqp_value(v: &Value) -> AMQPValue {
    match v {
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or_default()),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_str())),
        other => AMQPValue::LongString(LongString::from(other.to_string())),
    }
}

fn table<'a>(entries: impl Iterator<Item = (&'a String, &'a Value)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(k.as_str().into(), amqp_value(v));
    }
    t
}

fn headers_table(base: &FieldTable, headers: &Headers) -> FieldTable {
    let mut t = base.clone();
    for (k, v) in headers {
        let value = match v {
            HeaderValue::Str(s) => AMQPValue::LongString(LongString::from(s.as_str())),
            HeaderValue::Int(i) => AMQPValue::LongLongInt(*i),
        };
        t.insert(k.as_str().into(), value);
    }
    t
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable};

    use crate::envelope::ERROR_HEADER;

    /// lapin's errors are kept as the sources of the broker's, each said after what was
    /// being done; refused credentials stay fatal, a dropped connection a lost session.
    #[test]
    fn lapin_errors_are_the_sources() {
        use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};
        use std::error::Error as _;

        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset");
        let lost = super::lost(lapin::Error::from(io));
        assert!(lost.is_session_loss(), "{lost:?}");
        assert_eq!(lost.to_string(), "broker connection lost: IO error: connection reset");
        let lapin = lost.source().and_then(|e| e.downcast_ref::<lapin::Error>()).expect("lapin's error");
        assert!(lapin.is_io_error());

        let protocol = |kind: AMQPSoftError, message: &str| {
            lapin::Error::from(lapin::ErrorKind::ProtocolError(AMQPError::new(
                AMQPErrorKind::Soft(kind),
                message.into(),
            )))
        };
        let refused = super::connect_error(
            "amqp://guest:secret@h/",
            protocol(AMQPSoftError::ACCESSREFUSED, "ACCESS_REFUSED - Login was refused"),
        );
        assert!(matches!(refused, super::BrokerError::Refused { .. }) && refused.is_fatal(), "{refused:?}");
        let text = refused.to_string();
        assert!(text.contains("the broker refused the credentials: ") && !text.contains("secret"), "{text}");
        assert!(refused.source().is_some_and(|e| e.is::<lapin::Error>()), "{refused:?}");

        let conflict =
            super::conflict("queue", "work", protocol(AMQPSoftError::PRECONDITIONFAILED, "inequivalent arg"));
        assert!(conflict.is_fatal() && conflict.to_string().ends_with("inequivalent arg"), "{conflict}");
        assert!(conflict.source().is_some_and(|e| e.is::<lapin::Error>()), "{conflict:?}");
    }

    /// `amqps://` goes through rustls with ring, the one crypto provider: against a server
    /// that does not speak TLS the connection fails with an error.
    #[tokio::test]
    async fn amqps_reaches_a_tls_handshake() {
        use tokio::io::AsyncWriteExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let _ = stream.write_all(b"AMQP\x00\x00\x09\x01").await;
            }
        });
        let url = format!("amqps://guest:guest@127.0.0.1:{port}/%2f");
        let timeouts = super::Timeouts { connect: std::time::Duration::from_secs(5), ..super::Timeouts::default() };
        assert!(super::Amqp::connect(&url, timeouts).await.is_err());
    }

    #[test]
    fn retry_copies_drop_the_dead_letter_history() {
        let mut headers = FieldTable::default();
        let names = ["x-death", "x-first-death-queue", "x-last-death-reason", "x-sluice-attempt", "traceparent"];
        for name in names {
            headers.insert(name.into(), AMQPValue::LongString("v".into()));
        }
        let kept = super::without_death_history(Some(&headers));
        let kept: Vec<&str> = kept.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(kept, ["traceparent", "x-sluice-attempt"]);
        assert!(super::without_death_history(None).inner().is_empty());
    }

    /// Issue 9: a header just under the frame size made the dead-letter copy too large, and
    /// the broker closed the connection with every delivery on it.
    #[test]
    fn copies_shed_the_largest_inherited_headers_to_fit_a_frame() {
        use lapin::BasicProperties;
        let frame_max = 131_072;
        let mut table = FieldTable::default();
        table.insert("x-big".into(), AMQPValue::LongString("b".repeat(130_950).into()));
        table.insert("x-medium".into(), AMQPValue::LongString("m".repeat(500).into()));
        table.insert("traceparent".into(), AMQPValue::LongString("00-abc-def-01".into()));
        table.insert(ERROR_HEADER.into(), AMQPValue::LongString("HTTP 422".into()));
        table.insert("x-sluice-reason".into(), AMQPValue::LongString("permanent".into()));
        let properties = BasicProperties::default().with_message_id("m".into()).with_delivery_mode(2);
        let limit = frame_max as usize - super::HEADER_FRAME_OVERHEAD;
        let size = |t: &FieldTable| super::properties_size(&properties.clone().with_headers(t.clone()));
        assert!(size(&table) > limit);

        let mut fitted = table.clone();
        super::fit_frame(&properties, &mut fitted, frame_max);
        assert!(size(&fitted) <= limit);
        let names: Vec<&str> = fitted.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["traceparent", "x-medium", "x-sluice-error", "x-sluice-reason"]);
        let Some(AMQPValue::LongString(error)) = fitted.inner().get(ERROR_HEADER) else { panic!("no error header") };
        assert_eq!(
            String::from_utf8_lossy(error.as_bytes()),
            "HTTP 422; headers left out to fit the broker's frame size: x-big"
        );

        // What fits is left alone, and a broker without a frame limit takes anything.
        let mut small = FieldTable::default();
        small.insert("traceparent".into(), AMQPValue::LongString("00-abc-def-01".into()));
        let mut unchanged = small.clone();
        super::fit_frame(&properties, &mut unchanged, frame_max);
        assert_eq!(unchanged, small);
        let mut unlimited = table.clone();
        super::fit_frame(&properties, &mut unlimited, 0);
        assert_eq!(unlimited, table);
    }

    /// Issue 20: a silent node is noticed in seconds unless the URL chose its own heartbeat.
    #[test]
    fn asks_for_a_short_heartbeat_unless_the_url_names_one() {
        assert_eq!(super::with_heartbeat("amqp://h/%2f"), "amqp://h/%2f?heartbeat=2");
        assert_eq!(super::with_heartbeat("amqp://h/%2f?frame_max=8192"), "amqp://h/%2f?frame_max=8192&heartbeat=2");
        assert_eq!(super::with_heartbeat("amqp://h/%2f?heartbeat=30"), "amqp://h/%2f?heartbeat=30");
        assert_eq!(super::with_heartbeat("amqp://h?channel_max=9&heartbeat=0"), "amqp://h?channel_max=9&heartbeat=0");
    }

    #[test]
    fn names_nodes_by_host_and_port() {
        assert_eq!(super::node_name("amqp://guest:pw@10.0.0.1:5682/%2f?heartbeat=5"), "10.0.0.1:5682");
        assert_eq!(super::node_name("amqp://rabbit"), "rabbit:5672");
        assert_eq!(super::node_name("amqps://u:p@rabbit.example/vh"), "rabbit.example:5671");
        assert_eq!(super::node_name("amqp://[::1]:5673/"), "[::1]:5673");
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(super::redact("amqp://guest:secret@host:5672/%2f"), "amqp://guest:***@host:5672/%2f");
        assert_eq!(super::redact("amqp://host"), "amqp://host");
    }
}
