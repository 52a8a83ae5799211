//! RabbitMQ over AMQP 0-9-1 (lapin): one connection per session, a confirm-mode channel for
//! publishing, one channel per consumed queue (its prefetch and its acks), and a channel for
//! declarations and depth reads that is reopened when the broker closes it.
//!
//! No reconnection here: the runtime supervises sessions and opens a new one when this dies.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::Map;
use lapin::Confirmation;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde_json::Value;
use tokio::sync::Mutex;

use super::{Broker, BrokerError, Delivery, HeaderValue, Headers, Outgoing};
use crate::topology::{self, DestinationKind, Plan};

/// How long a publish may wait for the broker's confirm before it counts as failed.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// A live RabbitMQ session.
#[derive(Clone)]
pub struct Amqp {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Connection,
    publisher: Channel,
    control: Mutex<Channel>,
    consumers: Mutex<HashMap<String, (Channel, ShortString)>>,
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

impl Amqp {
    /// Connects and opens the publishing and control channels.
    pub async fn connect(url: &str) -> Result<Amqp, BrokerError> {
        let fail = |e: lapin::Error| BrokerError::Connect { url: redact(url), reason: e.to_string() };
        let properties = ConnectionProperties::default().with_connection_name("sluice".into());
        let connection = Connection::connect(url, properties).await.map_err(fail)?;
        let publisher = connection.create_channel().await.map_err(fail)?;
        publisher.confirm_select(ConfirmSelectOptions::default()).await.map_err(fail)?;
        let control = connection.create_channel().await.map_err(fail)?;
        Ok(Amqp {
            inner: Arc::new(Inner {
                connection,
                publisher,
                control: Mutex::new(control),
                consumers: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The control channel, reopened if the broker closed it after an error.
    async fn control(&self) -> Result<Channel, BrokerError> {
        let mut channel = self.inner.control.lock().await;
        if !channel.status().connected() {
            *channel = self.inner.connection.create_channel().await.map_err(lost)?;
        }
        Ok(channel.clone())
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
        let confirmation = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
            .await
            .map_err(|_| BrokerError::ConfirmTimeout(CONFIRM_TIMEOUT))?
            .map_err(lost)?;
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => {
                Err(BrokerError::Unroutable { exchange: exchange.into(), routing_key: routing_key.into() })
            }
            Confirmation::Nack(_) | Confirmation::NotRequested => {
                Err(BrokerError::Nacked { exchange: exchange.into() })
            }
        }
    }

    /// Publishes the original's body and properties with `headers` merged over `base`.
    async fn copy(
        &self,
        exchange: &str,
        routing_key: &str,
        original: &AmqpDelivery,
        base: FieldTable,
        headers: &Headers,
    ) -> Result<(), BrokerError> {
        let properties =
            original.0.properties.clone().with_delivery_mode(2).with_headers(headers_table(&base, headers));
        self.publish_raw(exchange, routing_key, &original.0.data, properties).await
    }
}

/// The headers without the broker's dead-letter history (`x-death`, `x-first-death-*`,
/// `x-last-death-*`). A retry copy passes through the delay cascade again; RabbitMQ takes a
/// message whose `x-death` already names the queue it is dead-lettered into for a cycle, and
/// strands it (at-least-once) or drops it. Each trip through the cascade starts afresh.
fn without_death_history(headers: Option<&FieldTable>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in headers.map(|h| h.inner().iter()).into_iter().flatten() {
        let name = k.as_str();
        if !(name == "x-death" || name.starts_with("x-first-death-") || name.starts_with("x-last-death-")) {
            t.insert(k.clone(), v.clone());
        }
    }
    t
}

/// A delivery from RabbitMQ.
pub struct AmqpDelivery(lapin::message::Delivery);

impl Delivery for AmqpDelivery {
    fn body(&self) -> &[u8] {
        &self.0.data
    }

    fn tag(&self) -> u64 {
        self.0.delivery_tag
    }

    fn header(&self, name: &str) -> Option<HeaderValue> {
        let headers = self.0.properties.headers().as_ref()?;
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
        *self.0.properties.timestamp()
    }

    fn message_id(&self) -> Option<&str> {
        self.0.properties.message_id().as_ref().map(|s| s.as_str())
    }

    fn is_live(&self) -> bool {
        self.0.acker.usable()
    }

    async fn ack(&self, multiple: bool) -> Result<(), BrokerError> {
        self.0.acker.ack(BasicAckOptions { multiple }).await.map(|_| ()).map_err(lost)
    }
}

type MapDelivery = fn(lapin::Result<lapin::message::Delivery>) -> Result<AmqpDelivery, BrokerError>;

fn wrap(item: lapin::Result<lapin::message::Delivery>) -> Result<AmqpDelivery, BrokerError> {
    item.map(AmqpDelivery).map_err(lost)
}

impl Broker for Amqp {
    type Delivery = AmqpDelivery;
    type Deliveries = Map<lapin::Consumer, MapDelivery>;

    async fn declare(&self, plan: &Plan) -> Result<(), BrokerError> {
        for e in &plan.exchanges {
            let channel = self.control().await?;
            let kind = match e.kind.as_str() {
                "direct" => ExchangeKind::Direct,
                "fanout" => ExchangeKind::Fanout,
                "headers" => ExchangeKind::Headers,
                "topic" => ExchangeKind::Topic,
                other => ExchangeKind::Custom(other.to_string()),
            };
            let options = ExchangeDeclareOptions { durable: true, ..Default::default() };
            channel
                .exchange_declare(e.name.as_str().into(), kind, options, FieldTable::default())
                .await
                .map_err(|err| conflict("exchange", &e.name, err))?;
        }
        for q in &plan.queues {
            let channel = self.control().await?;
            let options = QueueDeclareOptions { durable: true, ..Default::default() };
            channel
                .queue_declare(q.name.as_str().into(), options, table(q.arguments.iter()))
                .await
                .map_err(|err| conflict("queue", &q.name, err))?;
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

    async fn publish(&self, exchange: &str, routing_key: &str, message: Outgoing) -> Result<(), BrokerError> {
        let mut properties = BasicProperties::default()
            .with_content_type("application/json".into())
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
        self.publish_raw(exchange, routing_key, &message.body, properties).await
    }

    async fn republish(
        &self,
        exchange: &str,
        routing_key: &str,
        original: &AmqpDelivery,
        headers: Headers,
    ) -> Result<(), BrokerError> {
        let base = original.0.properties.headers().clone().unwrap_or_default();
        self.copy(exchange, routing_key, original, base, &headers).await
    }

    async fn publish_delayed(
        &self,
        queue: &str,
        delay: Duration,
        original: &AmqpDelivery,
        headers: Headers,
    ) -> Result<(), BrokerError> {
        let (exchange, routing_key) = topology::delay_route(queue, delay);
        let base = without_death_history(original.0.properties.headers().as_ref());
        self.copy(&exchange, &routing_key, original, base, &headers).await
    }

    async fn consume(&self, queue: &str, prefetch: u16) -> Result<Self::Deliveries, BrokerError> {
        let channel = self.inner.connection.create_channel().await.map_err(lost)?;
        channel.basic_qos(prefetch, BasicQosOptions::default()).await.map_err(lost)?;
        let tag: ShortString = format!("sluice-{}", uuid::Uuid::now_v7()).into();
        let consumer = channel
            .basic_consume(queue.into(), tag.clone(), BasicConsumeOptions::default(), FieldTable::default())
            .await
            .map_err(|err| conflict("queue", queue, err))?;
        self.inner.consumers.lock().await.insert(queue.to_string(), (channel, tag));
        Ok(consumer.map(wrap as MapDelivery))
    }

    async fn cancel(&self, queue: &str) -> Result<(), BrokerError> {
        let entry = self.inner.consumers.lock().await.get(queue).cloned();
        if let Some((channel, tag)) = entry {
            channel.basic_cancel(tag, BasicCancelOptions::default()).await.map_err(lost)?;
        }
        Ok(())
    }

    async fn depth(&self, queue: &str) -> Result<u32, BrokerError> {
        let channel = self.control().await?;
        let options = QueueDeclareOptions { passive: true, ..Default::default() };
        let q = channel
            .queue_declare(queue.into(), options, FieldTable::default())
            .await
            .map_err(|err| conflict("queue", queue, err))?;
        Ok(q.message_count())
    }

    fn is_connected(&self) -> bool {
        self.inner.connection.status().connected() && self.inner.publisher.status().connected()
    }

    async fn close(&self) {
        let _ = self.inner.connection.close(200, "sluice shutting down".into()).await;
    }
}

fn lost(e: lapin::Error) -> BrokerError {
    let text = e.to_string();
    if text.contains("NOT_FOUND") { BrokerError::NotFound(text) } else { BrokerError::Lost(text) }
}

/// A declaration error, worded for the user: which object, and the broker's own reason (which
/// names the argument and both values for PRECONDITION_FAILED).
fn conflict(what: &str, name: &str, e: lapin::Error) -> BrokerError {
    let text = e.to_string();
    if text.contains("PRECONDITION_FAILED") {
        BrokerError::Conflict(format!(
            "{what} \"{name}\" conflicts with what exists on the broker: {text}; sluice never deletes a queue, so change the file back or remove the {what} yourself"
        ))
    } else if text.contains("NOT_FOUND") {
        BrokerError::NotFound(format!("{what} \"{name}\": {text}"))
    } else {
        BrokerError::Lost(format!("declaring {what} \"{name}\": {text}"))
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

    #[test]
    fn redacts_passwords() {
        assert_eq!(super::redact("amqp://guest:secret@host:5672/%2f"), "amqp://guest:***@host:5672/%2f");
        assert_eq!(super::redact("amqp://host"), "amqp://host");
    }
}
