//! The embedded broker: the [`Broker`] trait on one SQLite file (WAL mode), for running
//! without RabbitMQ. It owns the file's tables (declarations, bindings, messages, consumers),
//! routes as RabbitMQ does ([`route`](super::route): direct, fanout, topic, headers), refuses
//! a publish to a full queue (`max_length`, reject-publish) writing nothing, delays a copy
//! exactly with no head-of-line blocking (a copy is invisible until due; consumers take what
//! is visible in id order), and leases what it delivers: a consumer renews the lease of its
//! unsettled messages while it lives, so those of a killed process come back once the lease
//! runs out ([`LEASE`]).
//!
//! Durability is SQLite's: each commit is in the write-ahead log before a publish is
//! confirmed, and with `synchronous=NORMAL` a commit survives the process being killed (not
//! necessarily the machine losing power, which may take back the last commits). No storage
//! engine here: every write is SQL in one transaction per batch of requests (group commit, on
//! a thread of its own).
//!
//! Other processes (`sluice publish`, `sluice dlq`, `sluice status`) open the same file and
//! work on the same state; their consumers count in `stats` while their registration is
//! renewed. In-process publishes wake consumers at once; another process's, within [`POLL`].
//! Freed pages go back to the file system a bounded number at a time (incremental
//! auto-vacuum), so the file shrinks after a backlog drains.
//!
//! Limits: a delayed copy is delivered within [`POLL`] after it is due; `delayed()` scans the
//! messages, and counts deliveries under a lease as not yet due back (a killed runner's are
//! held until theirs runs out, so `run --exit-when-idle` waits for them); `max_length` counts ready messages as RabbitMQ does (not those delivered, nor
//! delayed copies not yet due); a row corrupted in the file fails each claim of its queue (an
//! error on the consumer's stream, never a panic) until it is removed. One machine only: the
//! file must be on a local disk (SQLite's WAL needs shared memory between the processes).

mod store;
#[cfg(test)]
mod tests;
mod writer;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak, mpsc};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use tokio::sync::{Notify, mpsc as channel, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub(crate) use self::store::now_ms;
use self::store::{NewMessage, Stored, ms};
use self::writer::{Op, Wakers};
use super::{Broker, BrokerError, Consumer, Delivery, Drift, HeaderValue, Headers, Outgoing, QueueStats};
use crate::envelope;
use crate::topology::Plan;

/// How long a delivered message stays leased to its consumer without a renewal. A live
/// consumer renews every third of it; a killed one's messages come back after at most this.
pub const LEASE: Duration = Duration::from_secs(30);

/// How often an idle consumer looks for what other processes wrote.
pub const POLL: Duration = Duration::from_millis(50);

/// The most messages claimed in one request.
const CLAIM_MAX: u32 = 1024;

/// A session with the embedded broker. Cheap to clone; clones share the writer thread.
#[derive(Clone)]
pub struct Embedded {
    inner: Arc<Inner>,
}

struct Inner {
    ops: mpsc::Sender<Op>,
    wakers: Arc<Wakers>,
    lease: Duration,
    connected: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The broker's file in the directory `--broker` names.
pub const FILE: &str = "broker.db";

impl Embedded {
    /// Opens the broker's file, creating it and its directory. Several processes may open
    /// the same file.
    pub fn open(path: &Path) -> Result<Embedded, BrokerError> {
        Embedded::open_with_lease(path, LEASE)
    }

    /// Opens the broker whose directory is `dir` (its [`FILE`]).
    pub fn open_dir(dir: &Path) -> Result<Embedded, BrokerError> {
        Embedded::open(&dir.join(FILE))
    }

    /// Opens with another lease than [`LEASE`].
    fn open_with_lease(path: &Path, lease: Duration) -> Result<Embedded, BrokerError> {
        let wakers = Arc::new(Wakers::default());
        let ops = writer::start(path, wakers.clone())?;
        Ok(Embedded { inner: Arc::new(Inner { ops, wakers, lease, connected: AtomicBool::new(true) }) })
    }

    /// Sends a request to the writer and waits for its answer (after the commit).
    async fn call<T>(&self, op: impl FnOnce(oneshot::Sender<Result<T, BrokerError>>) -> Op) -> Result<T, BrokerError> {
        let (reply, answer) = oneshot::channel();
        let stopped = || BrokerError::Lost("the embedded broker's writer stopped".into());
        self.inner.ops.send(op(reply)).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    async fn copy(&self, queue: &str, message: NewMessage, visible_at: i64) -> Result<(), BrokerError> {
        self.call(|reply| Op::Copy { queue: queue.into(), message, visible_at, reply }).await
    }

    async fn open_consumer(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<(EmbeddedDeliveries, EmbeddedConsumer), BrokerError> {
        let owner = rand::random::<i64>();
        self.call(|reply| Op::Stats { queue: queue.into(), reply }).await?;
        let until = now_ms().saturating_add(ms(self.inner.lease));
        self.call(|reply| Op::Renew { owner, queue: queue.into(), ids: Vec::new(), until, register: true, reply })
            .await?;
        let state = Arc::new(ConsumerState {
            owner,
            queue: queue.into(),
            // AMQP's prefetch 0 is no limit.
            prefetch: if prefetch == 0 { u32::from(u16::MAX) } else { u32::from(prefetch) },
            unsettled: Mutex::new(BTreeSet::new()),
            room: Notify::new(),
            cancelled: CancellationToken::new(),
            closed: CancellationToken::new(),
            live: Arc::new(AtomicBool::new(true)),
        });
        let (sender, receiver) = channel::unbounded_channel();
        tokio::spawn(consume(self.clone(), Arc::downgrade(&state), sender));
        Ok((EmbeddedDeliveries(receiver), EmbeddedConsumer { broker: self.clone(), state }))
    }
}

struct ConsumerState {
    owner: i64,
    queue: String,
    prefetch: u32,
    /// Ids delivered and not yet acked; changed under this lock together with `live`.
    unsettled: Mutex<BTreeSet<i64>>,
    /// Poked by an ack: there is room for more.
    room: Notify,
    cancelled: CancellationToken,
    closed: CancellationToken,
    live: Arc<AtomicBool>,
}

/// A consumer's task: claims what fits its prefetch when woken (a commit of this process, an
/// ack, or every [`POLL`] when another process may have written), and renews its leases.
/// Ends when the consumer closes, when it is cancelled and has nothing left unsettled, or
/// when every handle to it is gone without a close (its leases then run out, as a killed
/// process's do).
async fn consume(
    broker: Embedded,
    state: Weak<ConsumerState>,
    sender: channel::UnboundedSender<Result<EmbeddedDelivery, BrokerError>>,
) {
    let lease = broker.inner.lease;
    let mut sender = Some(sender);
    let mut renew_at = Instant::now() + lease / 3;
    let mut registered = true;
    // Whether to look before claiming: only after a quiet poll, to keep idle polls read-only.
    let mut look = false;
    let Some(queue) = state.upgrade().map(|s| s.queue.clone()) else { return };
    let wake = broker.inner.wakers.of(&queue);
    loop {
        let Some(s) = state.upgrade() else { return };
        if s.closed.is_cancelled() {
            return;
        }
        let woken = wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let room = s.prefetch.saturating_sub(u32::try_from(lock(&s.unsettled).len()).unwrap_or(u32::MAX));
        let mut claimed_all = false;
        if let Some(out) = sender.as_ref().filter(|_| !s.cancelled.is_cancelled() && room > 0) {
            let claim = async {
                if look && !broker.call(|reply| Op::HasReady { queue: s.queue.clone(), reply }).await? {
                    return Ok(Vec::new());
                }
                let until = now_ms().saturating_add(ms(lease));
                let n = room.min(CLAIM_MAX);
                broker.call(|reply| Op::Claim { queue: s.queue.clone(), owner: s.owner, n, until, reply }).await
            };
            match claim.await {
                Ok(rows) => {
                    claimed_all = u32::try_from(rows.len()).is_ok_and(|n| n == room.min(CLAIM_MAX));
                    deliver(&broker, &s, out, rows).await;
                }
                Err(e) => {
                    let _ = out.send(Err(e));
                    sender = None;
                }
            }
        }
        if s.cancelled.is_cancelled() {
            sender = None;
            if lock(&s.unsettled).is_empty() {
                if registered {
                    let _ = renew(&broker, &s, false).await;
                }
                return;
            }
        }
        if Instant::now() >= renew_at || (registered && sender.is_none()) {
            registered = sender.is_some();
            // A failed renewal is tried again at the next tick; the lease has two more.
            if renew(&broker, &s, registered).await.is_ok() {
                renew_at = Instant::now() + lease / 3;
            }
        }
        if claimed_all {
            look = false;
            continue;
        }
        let poll = if sender.is_some() { POLL } else { renew_at.saturating_duration_since(Instant::now()) };
        tokio::select! {
            () = s.closed.cancelled() => return,
            () = s.cancelled.cancelled(), if sender.is_some() => look = false,
            () = &mut woken => look = false,
            () = s.room.notified() => look = false,
            () = tokio::time::sleep(poll) => look = true,
        }
    }
}

/// Hands claimed messages to the stream, or back to the queue if the consumer closed meanwhile.
async fn deliver(
    broker: &Embedded,
    s: &ConsumerState,
    out: &channel::UnboundedSender<Result<EmbeddedDelivery, BrokerError>>,
    rows: Vec<Stored>,
) {
    let mut unsettled = lock(&s.unsettled);
    if !s.live.load(Ordering::SeqCst) {
        drop(unsettled);
        let ids = rows.iter().map(|r| r.id).collect();
        let _ = broker.call(|reply| Op::Release { owner: s.owner, queue: s.queue.clone(), ids, reply }).await;
        return;
    }
    for row in rows {
        unsettled.insert(row.id);
        let _ = out.send(Ok(EmbeddedDelivery { id: row.id, message: row.message, live: s.live.clone() }));
    }
}

/// Extends the consumer's leases, and its registration while `register` (else removes it).
async fn renew(broker: &Embedded, s: &ConsumerState, register: bool) -> Result<(), BrokerError> {
    let ids: Vec<i64> = lock(&s.unsettled).iter().copied().collect();
    let until = now_ms().saturating_add(ms(broker.inner.lease));
    broker.call(|reply| Op::Renew { owner: s.owner, queue: s.queue.clone(), ids, until, register, reply }).await
}

/// A delivery from the embedded broker.
pub struct EmbeddedDelivery {
    id: i64,
    message: NewMessage,
    live: Arc<AtomicBool>,
}

impl EmbeddedDelivery {
    /// A copy of this message with `headers` merged over its own.
    fn copy(&self, headers: Headers) -> NewMessage {
        let mut message = self.message.clone();
        message.headers.extend(headers);
        message
    }
}

impl Delivery for EmbeddedDelivery {
    fn body(&self) -> &Bytes {
        &self.message.body
    }

    fn header(&self, name: &str) -> Option<HeaderValue> {
        self.message.headers.get(name).cloned()
    }

    fn timestamp(&self) -> Option<u64> {
        self.message.timestamp
    }

    fn message_id(&self) -> Option<&str> {
        self.message.message_id.as_deref()
    }

    fn headers(&self) -> BTreeMap<String, serde_json::Value> {
        self.message.headers.iter().map(|(k, v)| (k.clone(), v.to_json())).collect()
    }

    fn is_live(&self) -> bool {
        self.live.load(Ordering::SeqCst)
    }
}

/// The deliveries of one consumer.
pub struct EmbeddedDeliveries(channel::UnboundedReceiver<Result<EmbeddedDelivery, BrokerError>>);

impl Stream for EmbeddedDeliveries {
    type Item = Result<EmbeddedDelivery, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

/// A consumer of the embedded broker. Cheap to clone; clones share the consumer.
#[derive(Clone)]
pub struct EmbeddedConsumer {
    broker: Embedded,
    state: Arc<ConsumerState>,
}

impl Consumer for EmbeddedConsumer {
    type Delivery = EmbeddedDelivery;

    async fn ack(&self, settled: Vec<EmbeddedDelivery>) -> Result<(), BrokerError> {
        let s = &self.state;
        if !s.live.load(Ordering::SeqCst) {
            return Err(BrokerError::Lost("consumer closed".into()));
        }
        let ids: Vec<i64> = settled.iter().map(|d| d.id).collect();
        self.broker.call(|reply| Op::Ack { owner: s.owner, ids: ids.clone(), reply }).await?;
        let mut unsettled = lock(&s.unsettled);
        for id in ids {
            unsettled.remove(&id);
        }
        drop(unsettled);
        s.room.notify_one();
        Ok(())
    }

    async fn cancel(&self) -> Result<(), BrokerError> {
        self.state.cancelled.cancel();
        Ok(())
    }

    async fn close(&self) {
        let s = &self.state;
        let ids: Vec<i64> = {
            let mut unsettled = lock(&s.unsettled);
            s.live.store(false, Ordering::SeqCst);
            std::mem::take(&mut *unsettled).into_iter().collect()
        };
        s.cancelled.cancel();
        s.closed.cancel();
        let _ = self.broker.call(|reply| Op::Release { owner: s.owner, queue: s.queue.clone(), ids, reply }).await;
        let _ = renew(&self.broker, s, false).await;
    }
}

impl Broker for Embedded {
    type Delivery = EmbeddedDelivery;
    type Deliveries = EmbeddedDeliveries;
    type Consumer = EmbeddedConsumer;

    async fn declare(&self, plan: &Plan) -> Result<(), BrokerError> {
        self.call(|reply| Op::Declare(plan.clone(), reply)).await
    }

    async fn publish(&self, exchange: &str, routing_key: &str, message: Outgoing) -> Result<(), BrokerError> {
        let message = NewMessage {
            body: message.body.into(),
            headers: message.headers,
            message_id: message.message_id,
            kind: message.kind,
            timestamp: message.timestamp,
        };
        self.call(|reply| Op::Publish { exchange: exchange.into(), routing_key: routing_key.into(), message, reply })
            .await
    }

    async fn publish_delayed(
        &self,
        queue: &str,
        delay: Duration,
        original: &EmbeddedDelivery,
        headers: Headers,
    ) -> Result<(), BrokerError> {
        self.copy(queue, original.copy(headers), now_ms().saturating_add(ms(delay)).max(1)).await
    }

    async fn dead_letter(
        &self,
        dead_letter: &str,
        original: &EmbeddedDelivery,
        headers: Headers,
    ) -> Result<(), BrokerError> {
        self.copy(dead_letter, original.copy(headers), 0).await
    }

    async fn consume(&self, queue: &str, prefetch: u16) -> Result<(EmbeddedDeliveries, EmbeddedConsumer), BrokerError> {
        self.open_consumer(queue, prefetch).await
    }

    async fn browse(&self, queue: &str, window: u16) -> Result<(EmbeddedDeliveries, EmbeddedConsumer), BrokerError> {
        self.open_consumer(queue, window).await
    }

    async fn redrive(&self, queue: &str, original: &EmbeddedDelivery) -> Result<(), BrokerError> {
        let mut message = original.message.clone();
        for name in envelope::FAILURE_HEADERS {
            message.headers.remove(name);
        }
        message.headers.insert(envelope::ATTEMPT_HEADER.into(), HeaderValue::Int(1));
        self.copy(queue, message, 0).await
    }

    /// Ready messages, and the consumers of every process whose registration is renewed.
    async fn stats(&self, queue: &str) -> Result<QueueStats, BrokerError> {
        self.call(|reply| Op::Stats { queue: queue.into(), reply }).await
    }

    async fn drift(&self, plan: &Plan) -> Result<Vec<Drift>, BrokerError> {
        self.call(|reply| Op::Drift(plan.clone(), reply)).await
    }

    async fn delayed(&self) -> Result<u32, BrokerError> {
        self.call(Op::Delayed).await
    }

    fn is_connected(&self) -> bool {
        self.inner.connected.load(Ordering::SeqCst)
    }

    async fn close(&self) {
        self.inner.connected.store(false, Ordering::SeqCst);
    }
}
