//! The deliveries of the brokers that store messages themselves (embedded, Redis, in-memory):
//! one [`Delivery`] implementation over what each keeps to settle and copy a message (its
//! tag), and the stream of one consumer's deliveries, which counts the bytes it holds unread.
//! It owns what a delivery shows; it must not settle one (its consumer does, through its
//! broker).

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::Stream;
use tokio::sync::{Notify, mpsc};

use crate::broker::{BrokerError, Delivery, Edits, HeaderValue, Headers, Outgoing, Route};

/// How many bytes of bodies a consumer of these brokers holds read from the store and not yet
/// read from its stream before it claims no more.
pub(crate) const CLAIM_BYTES: u64 = 4 << 20;

/// What a message carries beside its body, as these brokers keep it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Properties {
    pub headers: Headers,
    pub message_id: Option<String>,
    /// The producer's name for what the message is (AMQP `type`).
    pub kind: Option<String>,
    /// The body's media type (AMQP `content_type`).
    pub content_type: Option<String>,
    /// Seconds since the epoch.
    pub timestamp: Option<u64>,
    /// The exchange and routing key it was published with (a copy keeps its original's).
    pub route: Option<Route>,
}

/// A message to publish as these brokers keep it: its body and its properties, with the route
/// it is published with. Refused with a priority, which they do not keep (`broker`
/// names the one refusing).
pub(crate) fn published(
    broker: &str,
    exchange: &str,
    routing_key: &str,
    message: Outgoing,
) -> Result<(Bytes, Properties), BrokerError> {
    if message.priority.is_some() {
        return Err(BrokerError::Conflict(
            format!("{broker} has no message priorities: publish without --priority, or run on RabbitMQ").into(),
        ));
    }
    let properties = Properties {
        headers: message.headers,
        message_id: message.message_id,
        kind: message.kind,
        content_type: message.content_type,
        timestamp: message.timestamp,
        route: Some(Route { exchange: exchange.into(), routing_key: routing_key.into() }),
    };
    Ok((message.body.into(), properties))
}

/// A message handed to a consumer.
pub struct Kept<Tag> {
    /// What its broker needs to settle or copy it.
    pub(crate) tag: Tag,
    /// Its body as read (empty when held back over the consumer's limit), and its size.
    pub(crate) body: Bytes,
    pub(crate) size: usize,
    pub(crate) properties: Properties,
    /// Its consumer is open: it may still be acked.
    pub(crate) live: Arc<AtomicBool>,
}

impl Kept<()> {
    /// A message of no broker (a message file, a test's message), to decode and render as a
    /// delivery; it cannot be acked.
    pub fn standalone(body: Bytes, properties: Properties) -> Kept<()> {
        Kept::whole((), body, properties, Arc::new(AtomicBool::new(false)))
    }
}

impl<Tag> Kept<Tag> {
    /// A delivery of `body` whole.
    pub(crate) fn whole(tag: Tag, body: Bytes, properties: Properties, live: Arc<AtomicBool>) -> Kept<Tag> {
        Kept { tag, size: body.len(), body, properties, live }
    }

    /// Its properties with its headers edited as `edits` says, for a copy.
    pub(crate) fn copied_properties(&self, edits: &Edits) -> Properties {
        let mut properties = self.properties.clone();
        edits.apply(&mut properties.headers);
        properties
    }
}

impl<Tag: Send + Sync + 'static> Delivery for Kept<Tag> {
    fn body(&self) -> &Bytes {
        &self.body
    }

    fn size(&self) -> usize {
        self.size
    }

    fn header(&self, name: &str) -> Option<HeaderValue> {
        self.properties.headers.get(name).cloned()
    }

    fn timestamp(&self) -> Option<u64> {
        self.properties.timestamp
    }

    fn message_id(&self) -> Option<&str> {
        self.properties.message_id.as_deref()
    }

    fn kind(&self) -> Option<&str> {
        self.properties.kind.as_deref()
    }

    fn content_type(&self) -> Option<&str> {
        self.properties.content_type.as_deref()
    }

    fn route(&self) -> Option<&Route> {
        self.properties.route.as_ref()
    }

    fn headers(&self) -> BTreeMap<String, serde_json::Value> {
        self.properties.headers.iter().map(|(k, v)| (k.clone(), v.to_json())).collect()
    }

    fn is_live(&self) -> bool {
        self.live.load(Ordering::SeqCst)
    }
}

/// The deliveries of one consumer.
pub struct KeptDeliveries<Tag> {
    pub(crate) receiver: mpsc::UnboundedReceiver<Result<Kept<Tag>, BrokerError>>,
    /// Its consumer's count of body bytes sent and not yet read, and what to poke when a read
    /// brings it under [`CLAIM_BYTES`].
    pub(crate) unread: Arc<AtomicU64>,
    pub(crate) room: Arc<Notify>,
}

impl<Tag> Stream for KeptDeliveries<Tag> {
    type Item = Result<Kept<Tag>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = self.receiver.poll_recv(cx);
        if let Poll::Ready(Some(Ok(delivery))) = &item {
            let read = delivery.body.len() as u64;
            let before = self.unread.fetch_sub(read, Ordering::SeqCst);
            // Only a read that makes room again wakes the consumer (it waits on no other).
            if before >= CLAIM_BYTES && before - read < CLAIM_BYTES {
                self.room.notify_one();
            }
        }
        item
    }
}

#[cfg(test)]
mod tests {
    use futures_util::{FutureExt as _, StreamExt as _};

    use super::*;

    #[test]
    fn a_published_message_keeps_its_route_and_a_priority_is_refused() {
        let message = Outgoing {
            body: b"{}".to_vec(),
            message_id: Some("m1".into()),
            kind: Some("t".into()),
            content_type: Some("application/octet-stream".into()),
            timestamp: Some(42),
            headers: [("h".to_string(), HeaderValue::Int(1))].into(),
            ..Outgoing::default()
        };
        let (body, properties) =
            published("the test broker", "ev", "a.b", message.clone()).expect("no priority: published");
        assert_eq!(body.as_ref(), &b"{}"[..]);
        let route = Some(Route { exchange: "ev".into(), routing_key: "a.b".into() });
        let want = Properties {
            headers: message.headers.clone(),
            message_id: Some("m1".into()),
            kind: Some("t".into()),
            content_type: Some("application/octet-stream".into()),
            timestamp: Some(42),
            route,
        };
        assert_eq!(properties, want);
        let refused = published("the test broker", "ev", "a.b", Outgoing { priority: Some(5), ..message });
        let refused = refused.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("the test broker has no message priorities"), "{refused}");
    }

    #[test]
    fn a_copy_merges_headers_over_its_originals() {
        let properties =
            Properties { headers: [("a".to_string(), HeaderValue::Int(1))].into(), ..Properties::default() };
        let kept = Kept::whole((), Bytes::new(), properties, Arc::new(AtomicBool::new(true)));
        let copied = kept.copied_properties(&Edits::setting([("a".to_string(), HeaderValue::Int(2))].into()));
        assert_eq!(copied.headers.get("a"), Some(&HeaderValue::Int(2)));
    }

    /// Only the read that brings the unread bytes under `CLAIM_BYTES` wakes the claim loop.
    #[tokio::test]
    async fn a_read_that_makes_room_pokes_the_consumer() {
        let (sender, receiver) = mpsc::unbounded_channel();
        let (unread, room) = (Arc::new(AtomicU64::new(0)), Arc::new(Notify::new()));
        let mut deliveries = KeptDeliveries { receiver, unread: unread.clone(), room: room.clone() };
        let half = usize::try_from(CLAIM_BYTES / 2).unwrap_or(usize::MAX);
        for _ in 0..3 {
            let body = Bytes::from(vec![0; half]);
            let kept = Kept::whole((), body, Properties::default(), Arc::new(AtomicBool::new(true)));
            assert!(sender.send(Ok(kept)).is_ok());
        }
        unread.store(CLAIM_BYTES / 2 * 3, Ordering::SeqCst);
        let poked = || room.notified().now_or_never().is_some();
        assert!(deliveries.next().await.is_some());
        assert!(!poked(), "still CLAIM_BYTES unread");
        assert!(deliveries.next().await.is_some());
        assert!(poked(), "under CLAIM_BYTES now");
        assert!(deliveries.next().await.is_some());
        assert!(!poked(), "was under already");
    }
}
