//! An in-memory broker for the runtime's unit tests: queues, bindings (routed as RabbitMQ does,
//! one copy per queue), consumers with prefetch, single active consumer, acks, delayed copies on
//! tokio's clock (so tests run on paused time, with no sleeps), dead-lettering, a full queue
//! refusing publishes, and a consumer's unsettled deliveries handed back when it or its session
//! closes. A declaration that differs from what exists is refused, naming the setting and both
//! values, as RabbitMQ refuses one.
//!
//! For tests only (compiled always, hidden from the docs, so that the conformance suite in
//! `tests/conformance.rs` reaches it): it implements the same trait as RabbitMQ, so the
//! runtime's rules are tested in-process, and that suite proves it keeps the contract.

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use tokio::sync::mpsc;

use super::declaration;
use super::{
    Broker, BrokerError, Consumer, Credit, Drift, Edits, HeaderValue, Kept, Operate, Outgoing, Properties, Publish,
    QueueStats, Route, Target,
};
use crate::topology::route;
use crate::topology::{BindingDecl, Plan, QueueDecl};
use crate::vocab::ExchangeKind;

/// A message as the broker keeps it.
#[derive(Debug, Clone)]
pub struct Message {
    pub body: Bytes,
    pub properties: Properties,
}

impl Message {
    /// A header as text, for assertions.
    pub fn header(&self, name: &str) -> Option<String> {
        self.properties.headers.get(name).map(HeaderValue::to_text)
    }
}

#[derive(Default)]
struct State {
    exchanges: BTreeMap<String, ExchangeKind>,
    queues: BTreeMap<String, (QueueDecl, VecDeque<Message>)>,
    bindings: Vec<BindingDecl>,
    consumers: BTreeMap<u64, ConsumerState>,
    next_id: u64,
    /// Delayed copies not yet due.
    delayed: u32,
    /// The longest one delayed copy waits (a longer delay is held this long), if any.
    longest_delay: Option<Duration>,
    /// Every delay a copy was held for, in order.
    held: Vec<Duration>,
    /// When set, the next declare fails with this.
    refuse_next_declare: Option<BrokerError>,
    /// When set, the next unbind fails with this.
    refuse_next_unbind: Option<BrokerError>,
    /// While set, acks fail and change nothing.
    refuse_acks: bool,
    /// While set, `stats` does not answer; unset, those waiting answer.
    stall_stats: bool,
    stats_released: Arc<tokio::sync::Notify>,
    /// `stats` calls so far, those under way, and the most under way at once.
    stats_asked: u64,
    stats_now: u64,
    stats_most: u64,
}

struct ConsumerState {
    queue: String,
    /// The session that opened it: closing the session closes it.
    session: u64,
    prefetch: usize,
    unacked: BTreeMap<u64, Message>,
    /// `None` once cancelled: the stream ends after what it was already sent.
    sender: Option<mpsc::UnboundedSender<MemoryDelivery>>,
    live: Arc<AtomicBool>,
}

/// A session of the broker. Cheap to clone; clones share the session, and every session
/// ([`Memory::session`]) shares the broker.
#[derive(Clone, Default)]
pub struct Memory {
    state: Arc<Mutex<State>>,
    session: u64,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Memory {
    pub fn new() -> Memory {
        Memory::default()
    }

    /// A broker whose delayed copies wait at most `longest` (as SQS's 15 minutes), a longer
    /// delay held only this long: for testing the runtime's hops.
    pub fn with_longest_delay(longest: Duration) -> Memory {
        let memory = Memory::new();
        lock(&memory.state).longest_delay = Some(longest);
        memory
    }

    /// Every delay a delayed copy was held for, in order.
    pub fn held_delays(&self) -> Vec<Duration> {
        lock(&self.state).held.clone()
    }

    /// Another session of the same broker: closing it closes only its consumers.
    pub fn session(&self) -> Memory {
        let mut state = lock(&self.state);
        state.next_id += 1;
        Memory { state: self.state.clone(), session: state.next_id }
    }

    /// Messages ready in `queue` (not delivered), oldest first.
    pub fn messages(&self, queue: &str) -> Vec<Message> {
        lock(&self.state).queues.get(queue).map(|(_, m)| m.iter().cloned().collect()).unwrap_or_default()
    }

    /// Deliveries handed to consumers of `queue` and not yet acked.
    pub fn unacked(&self, queue: &str) -> usize {
        lock(&self.state).consumers.values().filter(|c| c.queue == queue).map(|c| c.unacked.len()).sum()
    }

    /// Open consumers of `queue`.
    pub fn consumers(&self, queue: &str) -> usize {
        lock(&self.state).consumers.values().filter(|c| c.queue == queue).count()
    }

    /// Whether `queue` was declared.
    pub fn has_queue(&self, queue: &str) -> bool {
        lock(&self.state).queues.contains_key(queue)
    }

    /// The next declare fails with `error`.
    pub fn refuse_next_declare(&self, error: BrokerError) {
        lock(&self.state).refuse_next_declare = Some(error);
    }

    /// The next unbind fails with `error`, removing nothing.
    pub fn refuse_next_unbind(&self, error: BrokerError) {
        lock(&self.state).refuse_next_unbind = Some(error);
    }

    /// Acks fail (changing nothing, as when the broker cannot write them) while `refuse`.
    pub fn refuse_acks(&self, refuse: bool) {
        lock(&self.state).refuse_acks = refuse;
    }

    /// `stats` does not answer (as a frozen node that never answers a passive declaration)
    /// while `stall`; once unset, the calls waiting answer.
    pub fn stall_stats(&self, stall: bool) {
        let mut state = lock(&self.state);
        state.stall_stats = stall;
        if !stall {
            state.stats_released.notify_waiters();
        }
    }

    /// `stats` calls so far (answered or not), and the most under way at once: what reading
    /// the broker costs.
    pub fn stats_asked(&self) -> (u64, u64) {
        let state = lock(&self.state);
        (state.stats_asked, state.stats_most)
    }

    fn push(&self, queue: &str, message: Message) -> Result<(), BrokerError> {
        let mut state = lock(&self.state);
        push_all(&mut state, "", &[queue.to_string()], message)
    }
}

/// Puts a message into each of `targets`, or into none when one of them is full (its
/// `max_length` reached: refused, as by RabbitMQ's reject-publish); then hands it to consumers.
fn push_all(state: &mut State, exchange: &str, targets: &[String], message: Message) -> Result<(), BrokerError> {
    for queue in targets {
        let (declared, ready) =
            state.queues.get(queue).ok_or_else(|| BrokerError::NotFound(format!("queue \"{queue}\"").into()))?;
        if declared.max_length.is_some_and(|max| ready.len() as u64 >= max) {
            return Err(BrokerError::Rejected {
                exchange: exchange.into(),
                reason: format!("queue \"{queue}\" is full"),
            });
        }
    }
    for queue in targets {
        if let Some((_, ready)) = state.queues.get_mut(queue) {
            ready.push_back(message.clone());
        }
    }
    dispatch(state);
    Ok(())
}

/// Hands ready messages to consumers with room, in consumer order; on a single-active-consumer
/// queue, only to its oldest consumer not cancelled.
fn dispatch(state: &mut State) {
    let State { queues, consumers, next_id, .. } = state;
    let mut active: BTreeMap<String, u64> = BTreeMap::new();
    for (id, consumer) in consumers.iter().filter(|(_, c)| c.sender.is_some()) {
        active.entry(consumer.queue.clone()).or_insert(*id);
    }
    for (id, consumer) in consumers.iter_mut() {
        let Some(sender) = &consumer.sender else { continue };
        let Some((declared, ready)) = queues.get_mut(&consumer.queue) else { continue };
        if declared.single_active_consumer && active.get(&consumer.queue) != Some(id) {
            continue;
        }
        while consumer.unacked.len() < consumer.prefetch {
            let Some(message) = ready.pop_front() else { break };
            *next_id += 1;
            let tag = *next_id;
            consumer.unacked.insert(tag, message.clone());
            let _ = sender.send(Kept::whole(tag, message.body, message.properties, consumer.live.clone()));
        }
    }
}

/// A delivery from the in-memory broker, tagged as its consumer knows it.
pub type MemoryDelivery = Kept<u64>;

/// The deliveries of one consumer.
pub struct MemoryDeliveries(mpsc::UnboundedReceiver<MemoryDelivery>);

impl Stream for MemoryDeliveries {
    type Item = Result<MemoryDelivery, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|d| d.map(Ok))
    }
}

/// A consumer of the in-memory broker.
#[derive(Clone)]
pub struct MemoryConsumer {
    broker: Memory,
    id: u64,
}

impl Consumer for MemoryConsumer {
    type Delivery = MemoryDelivery;

    async fn ack(&self, settled: &[MemoryDelivery]) -> Result<(), BrokerError> {
        let mut state = lock(&self.broker.state);
        let refused = state.refuse_acks;
        let consumer = state.consumers.get_mut(&self.id).ok_or_else(|| BrokerError::Lost("consumer closed".into()))?;
        if refused {
            return Err(BrokerError::Lost("acks refused (as by a full disk)".into()));
        }
        for d in settled {
            consumer.unacked.remove(&d.tag);
        }
        dispatch(&mut state);
        Ok(())
    }

    async fn cancel(&self) -> Result<(), BrokerError> {
        if let Some(c) = lock(&self.broker.state).consumers.get_mut(&self.id) {
            c.sender = None;
        }
        Ok(())
    }

    async fn close(&self) {
        close_consumers(&mut lock(&self.broker.state), |id, _| id == self.id);
    }
}

/// Closes the consumers `which` picks, handing back their unsettled deliveries in order, ahead
/// of what is ready.
fn close_consumers(state: &mut State, which: impl Fn(u64, &ConsumerState) -> bool) {
    let closing: Vec<u64> = state.consumers.iter().filter(|(id, c)| which(**id, c)).map(|(id, _)| *id).collect();
    for id in closing {
        let Some(consumer) = state.consumers.remove(&id) else { continue };
        consumer.live.store(false, Ordering::SeqCst);
        if let Some((_, ready)) = state.queues.get_mut(&consumer.queue) {
            for message in consumer.unacked.into_values().rev() {
                ready.push_front(message);
            }
        }
    }
    dispatch(state);
}

/// A queue's declaration as compared for conflicts: what the plan serializes (so the runner's
/// `max_message_bytes` is no conflict, as on the other brokers).
fn declaration(q: &QueueDecl) -> String {
    serde_json::to_string(q).expect("a queue declaration serializes")
}

/// How the broker's state differs from `plan`.
fn drift(state: &State, plan: &Plan) -> Vec<Drift> {
    let found = declaration::drift::<std::convert::Infallible>(
        plan,
        None,
        |name| Ok(state.exchanges.get(name).map(|kind| kind.as_str().to_string())),
        |name| Ok(state.queues.get(name).map(|(existing, _)| declaration(existing))),
        |b| Ok(state.bindings.contains(b)),
    );
    match found {
        Ok(drift) => drift,
        Err(never) => match never {},
    }
}

impl Broker for Memory {
    type Delivery = MemoryDelivery;
    type Deliveries = MemoryDeliveries;
    type Consumer = MemoryConsumer;

    async fn declare(&self, plan: &Plan) -> Result<(), BrokerError> {
        let mut state = lock(&self.state);
        if let Some(e) = state.refuse_next_declare.take() {
            return Err(e);
        }
        // Check everything before changing anything: a refused plan leaves no trace.
        if let Some(Drift::Conflict { what, name, detail }) =
            drift(&state, plan).into_iter().find(|d| matches!(d, Drift::Conflict { .. }))
        {
            return Err(BrokerError::Conflict(
                format!("{what} \"{name}\" conflicts with what exists: {detail}").into(),
            ));
        }
        for e in &plan.exchanges {
            state.exchanges.insert(e.name.clone(), e.kind);
        }
        for q in &plan.queues {
            state.queues.entry(q.name.clone()).or_insert_with(|| (q.clone(), VecDeque::new()));
        }
        for b in &plan.bindings {
            if !state.bindings.contains(b) {
                state.bindings.push(b.clone());
            }
        }
        Ok(())
    }

    async fn unbind(&self, bindings: &[BindingDecl]) -> Result<(), BrokerError> {
        let mut state = lock(&self.state);
        if let Some(e) = state.refuse_next_unbind.take() {
            return Err(e);
        }
        state.bindings.retain(|b| !bindings.contains(b));
        Ok(())
    }

    async fn copy(&self, original: &MemoryDelivery, target: Target<'_>, edits: &Edits) -> Result<(), BrokerError> {
        let copy = Message { body: original.body.clone(), properties: original.copied_properties(edits) };
        let (queue, delay) = match target {
            Target::Later { queue, delay } => (queue, delay),
            Target::Queue(queue) | Target::DeadLetter(queue) => return self.push(queue, copy),
        };
        let delay = {
            let mut state = lock(&self.state);
            state.delayed += 1;
            let delay = state.longest_delay.map_or(delay, |longest| delay.min(longest));
            state.held.push(delay);
            delay
        };
        let (broker, queue) = (self.clone(), queue.to_string());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            // One step under the lock: the copy is never seen as neither delayed nor ready.
            let mut state = lock(&broker.state);
            state.delayed -= 1;
            if let Some((_, ready)) = state.queues.get_mut(&queue) {
                ready.push_back(copy);
                dispatch(&mut state);
            }
        });
        Ok(())
    }

    async fn consume(&self, queue: &str, credit: Credit) -> Result<(MemoryDeliveries, MemoryConsumer), BrokerError> {
        let mut state = lock(&self.state);
        if !state.queues.contains_key(queue) {
            return Err(BrokerError::NotFound(format!("queue \"{queue}\"").into()));
        }
        let (sender, receiver) = mpsc::unbounded_channel();
        state.next_id += 1;
        let id = state.next_id;
        let live = Arc::new(AtomicBool::new(true));
        state.consumers.insert(
            id,
            ConsumerState {
                queue: queue.into(),
                session: self.session,
                prefetch: usize::from(credit.get()),
                unacked: BTreeMap::new(),
                sender: Some(sender),
                live,
            },
        );
        dispatch(&mut state);
        Ok((MemoryDeliveries(receiver), MemoryConsumer { broker: self.clone(), id }))
    }

    async fn stats(&self, queue: &str) -> Result<QueueStats, BrokerError> {
        /// A call under way, counted out however it ends.
        struct Asking<'a>(&'a Mutex<State>);
        impl Drop for Asking<'_> {
            fn drop(&mut self) {
                lock(self.0).stats_now -= 1;
            }
        }
        let released = {
            let mut state = lock(&self.state);
            state.stats_asked += 1;
            state.stats_now += 1;
            state.stats_most = state.stats_most.max(state.stats_now);
            state.stats_released.clone()
        };
        let _asking = Asking(&self.state);
        loop {
            // Made before the flag is read: a release in between still wakes it.
            let notified = released.notified();
            if !lock(&self.state).stall_stats {
                break;
            }
            notified.await;
        }
        let state = lock(&self.state);
        let (_, ready) =
            state.queues.get(queue).ok_or_else(|| BrokerError::NotFound(format!("queue \"{queue}\"").into()))?;
        let consumers = state.consumers.values().filter(|c| c.queue == queue).count();
        Ok(QueueStats {
            ready: u32::try_from(ready.len()).unwrap_or(u32::MAX),
            consumers: u32::try_from(consumers).unwrap_or(u32::MAX),
        })
    }

    async fn delayed(&self) -> Result<u32, BrokerError> {
        Ok(lock(&self.state).delayed)
    }

    fn capabilities(&self) -> super::Capabilities {
        super::Capabilities { longest_delay: lock(&self.state).longest_delay, ..super::capabilities::MEMORY }
    }

    fn is_connected(&self) -> bool {
        true
    }

    /// Ends the session: its consumers close, handing back their unsettled deliveries, as
    /// RabbitMQ does when a connection ends.
    async fn close(&self) {
        close_consumers(&mut lock(&self.state), |_, c| c.session == self.session);
    }
}

impl Publish for Memory {
    async fn publish(&self, exchange: &str, routing_key: &str, message: Outgoing) -> Result<(), BrokerError> {
        let mut state = lock(&self.state);
        let declared = state.exchanges.get(exchange).copied();
        let targets = route::targets(
            exchange,
            routing_key,
            &message.headers,
            declared,
            |q| state.queues.contains_key(q),
            &state.bindings,
        )
        .ok_or_else(|| BrokerError::NotFound(format!("exchange \"{exchange}\"").into()))?;
        if targets.is_empty() {
            return Err(BrokerError::Unroutable { exchange: exchange.into(), routing_key: routing_key.into() });
        }
        let m = Message {
            body: message.body.into(),
            properties: Properties {
                headers: message.headers,
                message_id: message.message_id,
                kind: message.kind,
                content_type: message.content_type,
                timestamp: message.timestamp,
                route: Some(Route { exchange: exchange.into(), routing_key: routing_key.into() }),
            },
        };
        push_all(&mut state, exchange, &targets, m)
    }
}

impl Operate for Memory {
    async fn browse(&self, queue: &str, window: Credit) -> Result<(MemoryDeliveries, MemoryConsumer), BrokerError> {
        self.consume(queue, window).await
    }

    async fn drift(&self, plan: &Plan) -> Result<Vec<Drift>, BrokerError> {
        Ok(drift(&lock(&self.state), plan))
    }
}
