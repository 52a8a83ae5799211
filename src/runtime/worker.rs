//! One worker per queue: consume with prefetch = concurrency (none while paused or its
//! circuit breaker is open, one while half-open), run each delivery through decode → schema →
//! render → gate (pause, breaker, in-flight limit) → rate limit → handler, turn the result into exactly one
//! [`Disposition`], make it durable (its [`Effect`]: a confirmed retry or dead-letter copy),
//! then ack.
//!
//! A delivery whose copy is not confirmed is never acked: the worker keeps retrying the
//! publish while the delivery's channel lives, and otherwise leaves it to the broker to
//! redeliver. A failed ack is retried the same way (the work is done: running it again would
//! repeat its side effect), with the queue reported unready meanwhile, until
//! [`ACK_RETRY_FOR`] has passed: then the session ends, as a lost connection ends it, and the
//! broker delivers those messages again (their idempotency keys, recorded done before the
//! ack, make them duplicates).

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::future::Fuse;
use futures_util::{FutureExt as _, StreamExt};
use governor::{DefaultDirectRateLimiter, Quota};
use rand::Rng;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument as _, error, info, warn};

use super::events::{self, Activity, QueueEvents, Seen};
use super::gate::{Admission, Changes, Gate, Mode, Permit};
use super::outcome::{self, Disposition, Effect};
use super::{Readiness, clock, filter};
use crate::backoff;
use crate::broker::{Broker, BrokerError, Consumer, Credit, Delivery, Edits, Headers, Target};
use crate::call::{Call, Execute};
use crate::config::{OnDeadLetter, Queue};
use crate::dedup::{self, Claim, Store};
use crate::envelope::{self, Reason, attempt_in};
use crate::handler::{HandlerError, Observed};
use crate::trace;

/// A claim's lease outlives the handler's timeout (twice over, for recording the success in
/// the store afterwards) by this much. After a crash, a key claimed in Redis is free again once its lease
/// ends; the embedded store's claims are in memory and end with the runner.
const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// How long a claim on one of `q`'s keys lasts.
fn lease(q: &Queue) -> Duration {
    q.handler.timeout() * 2 + LEASE_MARGIN
}

/// The longest wait before retrying a message whose key could not be claimed.
const STORE_DOWN_WAIT: Duration = Duration::from_secs(5);

/// How long a batch whose acks fail is retried before the session ends. The embedded broker's
/// leases, renewed meanwhile if the store takes writes at all, last as long.
pub const ACK_RETRY_FOR: Duration = Duration::from_secs(30);

/// An `order_by` queue's prefetch, per handler it may run at once.
const LANE_PREFETCH: u16 = 4;

/// The longest pause between two attempts to ack a batch.
const ACK_BACKOFF_CAP: Duration = Duration::from_secs(2);

/// A settled delivery on its way to the ack loop, with the idempotency key to record done.
type Settled<D> = (D, Option<String>);

/// The ack loop's task; fused: polled again after it ended (it ends early only on an error),
/// it stays pending.
type Acker = Fuse<JoinHandle<Result<(), BrokerError>>>;

/// Everything a queue's worker needs, shared by its delivery tasks; it owns its queue.
pub struct Worker {
    queue: Arc<Queue>,
    limiter: Option<DefaultDirectRateLimiter>,
    /// What runs the handler's calls.
    handlers: Arc<dyn Execute>,
    /// What this runner has under way, across all workers (for `--exit-when-idle`).
    activity: Arc<Activity>,
    store: Option<Store>,
    events: QueueEvents,
    /// Whether to consume, and how many handlers may run.
    gate: Gate,
    /// Told while the queue's acks fail.
    readiness: Readiness,
    /// Set when the idempotency store is found damaged (no retry mends it): the consumer
    /// then ends as on a damaged broker, and the run with it.
    damaged: std::sync::OnceLock<BrokerError>,
    damaged_found: tokio::sync::Notify,
    /// An `order_by` queue's keys held by a dead-lettered message (`on_dead_letter: hold`), by
    /// that message's id: the key's next message is that one, redriven.
    held: std::sync::Mutex<HashMap<String, String>>,
}

/// The lanes of an `order_by` queue's consumer: per key with a message being handled (or
/// held), the deliveries waiting behind it, in arrival order. They stay unacked, within the
/// consumer's prefetch.
struct Lanes<D> {
    waiting: std::sync::Mutex<HashMap<String, VecDeque<D>>>,
    /// Cancelled when the consumer stops: a lane then starts nothing more, and what it holds
    /// goes back to the broker unsettled, in order.
    ending: CancellationToken,
}

impl<D> Lanes<D> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<D>>> {
        self.waiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The key's next delivery; none left: the lane ends (its key is free).
    fn next(&self, key: &str) -> Option<D> {
        let mut waiting = self.lock();
        let next = waiting.get_mut(key).and_then(VecDeque::pop_front);
        if next.is_none() {
            waiting.remove(key);
        }
        next
    }
}

/// How a lane's delivery ended.
enum LaneEnd {
    /// Settled: the key's next message may run.
    Next,
    /// Dead-lettered under `on_dead_letter: hold`: the key waits for this message id.
    Hold(String),
    /// The consumer stopped first: handed back unsettled.
    GaveUp,
}

impl Worker {
    /// A worker for `queue`, through `gate` (made for that queue), its calls run by
    /// `handlers`.
    pub fn new(
        queue: Arc<Queue>,
        gate: Gate,
        handlers: Arc<dyn Execute>,
        activity: Arc<Activity>,
        store: Option<Store>,
        readiness: Readiness,
    ) -> Worker {
        let limiter = queue.rate_limit.and_then(|r| {
            let quota = Quota::with_period(r.per / r.count.get())?.allow_burst(r.count);
            Some(DefaultDirectRateLimiter::direct(quota))
        });
        let events = QueueEvents::new(&queue.name, activity.clone(), activity.attempts.of(&queue.name));
        let (damaged, damaged_found, held) = Default::default();
        Worker { queue, limiter, handlers, activity, store, events, gate, readiness, damaged, damaged_found, held }
    }

    /// The queue it consumes, as its config defines it.
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// Consumes until `stop`, then drains: no new deliveries, those already delivered are
    /// finished and acked, and the consumer closes once none is left, or at `release`, which
    /// hands whatever is still unsettled back to the broker. (The runner bounds the drain by
    /// its grace: it releases the worker, or [retires](Worker::retire) it and lets its calls
    /// end beside its successor.) While the queue is paused or its breaker open it does not
    /// consume at all. Returns an error only when the session is lost.
    pub async fn run<B: Broker>(
        self: Arc<Self>,
        broker: B,
        stop: CancellationToken,
        release: CancellationToken,
    ) -> Result<(), BrokerError> {
        let mut changes = self.gate.changes();
        loop {
            match self.gate.mode() {
                Mode::Consume { prefetch } => {
                    if self.clone().consume(&broker, prefetch, &stop, &release, &mut changes).await? {
                        return Ok(());
                    }
                }
                Mode::Idle { until } => {
                    let opening_ends = async {
                        match until {
                            Some(at) => tokio::time::sleep_until(at).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        _ = stop.cancelled() => return Ok(()),
                        () = changes.next() => {}
                        () = opening_ends => self.gate.tick(),
                    }
                }
            }
        }
    }

    /// Starts no more calls: those running keep their deliveries (and their slots, which the
    /// queue's next worker counts) until they end and are settled; the deliveries not yet
    /// started are handed back, for the next worker.
    pub fn retire(&self) {
        self.gate.retire();
    }

    /// One consumer with `prefetch`, until `stop` (true) or until the gate's mode changes
    /// (false); drains either way, until nothing is in flight or until `release`.
    async fn consume<B: Broker>(
        self: Arc<Self>,
        broker: &B,
        prefetch: u16,
        stop: &CancellationToken,
        release: &CancellationToken,
        changes: &mut Changes,
    ) -> Result<bool, BrokerError> {
        let queue = self.queue();
        // What waits behind a busy key takes prefetch too: more of it keeps the other keys busy.
        let credit = match queue.order_by {
            Some(_) => prefetch.saturating_mul(LANE_PREFETCH),
            None => prefetch,
        };
        let (mut deliveries, consumer) =
            broker.consume_within(&queue.name, Credit::at_most(credit), queue.max_message_bytes).await?;
        info!(queue = %queue.name, prefetch = credit, adaptive = queue.adaptive, "consuming");
        let lanes = queue
            .order_by
            .as_ref()
            .map(|_| Arc::new(Lanes { waiting: Default::default(), ending: CancellationToken::new() }));
        let end_lanes = || lanes.iter().for_each(|l| l.ending.cancel());
        let tracker = TaskTracker::new();
        let (acks, ack_events) = mpsc::unbounded_channel();
        let mut acker = tokio::spawn(self.clone().ack_loop(consumer.clone(), ack_events)).fuse();
        let (mut stopped, mut cancelled) = (false, false);
        let result = loop {
            tokio::select! {
                _ = stop.cancelled(), if !stopped => {
                    stopped = true;
                    end_lanes();
                    if !std::mem::replace(&mut cancelled, true) && let Err(e) = consumer.cancel().await {
                        break Err(e);
                    }
                }
                // The runner gave up waiting for the stream to end after `stop`.
                () = release.cancelled() => break Ok(()),
                () = self.damaged_found.notified() => {
                    break Err(self.damaged.get().cloned().unwrap_or_else(|| BrokerError::Damaged("the idempotency store".into())));
                }
                acked = &mut acker => {
                    break Err(match acked {
                        Ok(Err(e)) => e,
                        Ok(Ok(())) | Err(_) => BrokerError::Lost(format!("the acks of \"{}\" stopped", queue.name).into()),
                    });
                }
                () = changes.next(), if !cancelled => {
                    if self.gate.mode() != (Mode::Consume { prefetch }) {
                        cancelled = true;
                        end_lanes();
                        if let Err(e) = consumer.cancel().await {
                            break Err(e);
                        }
                    }
                }
                item = deliveries.next() => match item {
                    Some(Ok(delivery)) => match &lanes {
                        Some(lanes) => self.clone().enqueue(&tracker, broker, lanes, delivery, acks.clone()),
                        None => self.clone().start(&tracker, broker, delivery, acks.clone()),
                    },
                    Some(Err(e)) => break Err(e),
                    None if cancelled => break Ok(()),
                    None => break Err(BrokerError::Lost(format!("consumer of \"{}\" ended", queue.name).into())),
                }
            }
        };
        drop(acks);
        end_lanes();
        if result.is_ok() {
            self.drain(&tracker, &mut acker, release).await;
        }
        // What waited behind held keys goes back with the rest.
        for waiting in lanes.iter().flat_map(|l| std::mem::take(&mut *l.lock())).flat_map(|(_, w)| w) {
            drop(waiting);
            self.events.settled();
            self.activity.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        self.events.keys_blocked(0);
        consumer.close().await;
        result.map(|()| stop.is_cancelled())
    }

    /// Starts settling a delivery whose disposition is known already (see [`Worker::start`]).
    fn start_settled<B: Broker>(
        self: Arc<Self>,
        tracker: &TaskTracker,
        broker: &B,
        delivery: B::Delivery,
        disposition: Disposition,
        acks: mpsc::UnboundedSender<Settled<B::Delivery>>,
    ) {
        self.start_with(tracker, broker, delivery, Some(disposition), acks);
    }

    /// Starts handling a delivery on `tracker`: decide, settle, then hand it to the ack loop.
    fn start<B: Broker>(
        self: Arc<Self>,
        tracker: &TaskTracker,
        broker: &B,
        delivery: B::Delivery,
        acks: mpsc::UnboundedSender<Settled<B::Delivery>>,
    ) {
        self.start_with(tracker, broker, delivery, None, acks);
    }

    /// Starts handling a delivery on `tracker`: decide (unless `decided`), settle, then hand it
    /// to the ack loop.
    fn start_with<B: Broker>(
        self: Arc<Self>,
        tracker: &TaskTracker,
        broker: &B,
        delivery: B::Delivery,
        decided: Option<Disposition>,
        acks: mpsc::UnboundedSender<Settled<B::Delivery>>,
    ) {
        self.activity.in_flight.fetch_add(1, Ordering::SeqCst);
        self.events.received(delivery.timestamp());
        let broker = broker.clone();
        let message = events::message_span(delivery.message_id());
        let receive = trace::receive_span(&self.queue().name, &delivery, &message);
        // Log lines see the message span; exported spans start at receive.
        let (exported, logged) = (receive.clone(), message.clone());
        tracker.spawn(
            async move {
                let mut seen = Seen::default();
                let disposition = match decided {
                    Some(disposition) => disposition,
                    None => self.decide(&delivery, &message, &mut seen).instrument(trace::handle_span(&receive)).await,
                };
                let settled =
                    self.settle(&broker, &delivery, &disposition).instrument(trace::settle_span(&receive)).await;
                if settled {
                    self.events.outcome(&disposition, seen);
                    self.to_ack(&acks, delivery, disposition).await;
                }
                self.events.settled();
                self.activity.in_flight.fetch_sub(1, Ordering::SeqCst);
            }
            .instrument(exported)
            .instrument(logged),
        );
    }

    /// Puts a delivery of an `order_by` queue in its key's lane: it runs at once when the key
    /// is free, else waits behind the key's earlier ones; the redriven message that holds its
    /// key runs first and frees it. One whose key cannot be told is handled alone (decoding
    /// dead-letters it) or dead-lettered (`template`).
    fn enqueue<B: Broker>(
        self: Arc<Self>,
        tracker: &TaskTracker,
        broker: &B,
        lanes: &Arc<Lanes<B::Delivery>>,
        delivery: B::Delivery,
        acks: mpsc::UnboundedSender<Settled<B::Delivery>>,
    ) {
        let q = self.queue();
        let (key, id) = match outcome::decode(q, &delivery, attempt_of(&delivery)) {
            Err(_) => return self.start(tracker, broker, delivery, acks),
            Ok(message) => match crate::call::order_key(q, &message) {
                Ok(key) => (key.unwrap_or_default(), message.envelope.id.to_string()),
                Err(e) => {
                    let dead = Disposition::DeadLetter {
                        reason: Reason::Template,
                        error: e.to_string(),
                        attempts: attempt_of(&delivery),
                    };
                    return self.start_settled(tracker, broker, delivery, dead, acks);
                }
            },
        };
        self.activity.in_flight.fetch_add(1, Ordering::SeqCst);
        self.events.received(delivery.timestamp());
        let start = {
            let mut waiting = lanes.lock();
            let mut held = self.held.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let redriven = held.get(&key) == Some(&id);
            let busy = waiting.contains_key(&key);
            let lane = waiting.entry(key.clone()).or_default();
            if redriven {
                held.remove(&key);
                lane.push_front(delivery);
            } else {
                lane.push_back(delivery);
            }
            self.count_blocked(&waiting, &held);
            redriven || (!busy && !held.contains_key(&key))
        };
        if start {
            let (worker, broker, lanes) = (self.clone(), broker.clone(), lanes.clone());
            tracker.spawn(async move { worker.lane(broker, lanes, key, acks).await });
        }
    }

    /// Tells `sluice_keys_blocked`: the keys with deliveries waiting behind a busy one, and
    /// the held ones.
    fn count_blocked<D>(&self, waiting: &HashMap<String, VecDeque<D>>, held: &HashMap<String, String>) {
        let behind = waiting.iter().filter(|(key, w)| !w.is_empty() && !held.contains_key(*key)).count();
        self.events.keys_blocked(behind + held.len());
    }

    /// Runs a key's lane: its deliveries one at a time, each settled before the next starts,
    /// until none waits, the key is held, or the consumer stops (what is left goes back).
    async fn lane<B: Broker>(
        self: Arc<Self>,
        broker: B,
        lanes: Arc<Lanes<B::Delivery>>,
        key: String,
        acks: mpsc::UnboundedSender<Settled<B::Delivery>>,
    ) {
        let hold = self.queue().order_by.as_ref().is_some_and(|o| o.on_dead_letter == OnDeadLetter::Hold);
        while let Some(delivery) = lanes.next(&key) {
            {
                // In the order `enqueue` takes them.
                let waiting = lanes.lock();
                let held = self.held.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                self.count_blocked(&waiting, &held);
            }
            let end = match lanes.ending.is_cancelled() {
                true => LaneEnd::GaveUp,
                false => self.run_in_lane(&broker, delivery, &lanes.ending, &acks, hold).await,
            };
            match end {
                LaneEnd::Next => {}
                LaneEnd::Hold(id) => {
                    warn!(queue = %self.queue().name, key, message_id = id, "key held: its message was dead-lettered; the key's later messages wait until it is redriven");
                    let waiting = lanes.lock();
                    let mut held = self.held.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                    held.insert(key, id);
                    self.count_blocked(&waiting, &held);
                    return;
                }
                LaneEnd::GaveUp => {
                    // Unsettled, it goes back to the broker: no lane of this consumer may
                    // start another message, which could overtake it.
                    lanes.ending.cancel();
                    let left = lanes.lock().remove(&key).map_or(0, |w| w.len());
                    for _ in 0..=left {
                        self.events.settled();
                        self.activity.in_flight.fetch_sub(1, Ordering::SeqCst);
                    }
                    return;
                }
            }
        }
    }

    /// Handles one delivery of a lane until it is settled: a retry (or a wait: paused, key
    /// busy elsewhere, not yet due) waits here, holding the delivery and its key, and runs
    /// again, never overtaken by a copy.
    async fn run_in_lane<B: Broker>(
        &self,
        broker: &B,
        delivery: B::Delivery,
        ending: &CancellationToken,
        acks: &mpsc::UnboundedSender<Settled<B::Delivery>>,
        hold: bool,
    ) -> LaneEnd {
        let message = events::message_span(delivery.message_id());
        let receive = trace::receive_span(&self.queue().name, &delivery, &message);
        let mut attempt = attempt_of(&delivery);
        loop {
            let mut seen = Seen::default();
            let disposition = self
                .decide_at(&delivery, attempt, &message, &mut seen)
                .instrument(trace::handle_span(&receive))
                .instrument(message.clone())
                .await;
            let again = match &disposition {
                Disposition::Retry { next, after, .. } => Some((*next, *after)),
                Disposition::Wait { attempt, after, .. } | Disposition::Scheduled { attempt, after } => {
                    Some((*attempt, *after))
                }
                _ => None,
            };
            if let Some((next, after)) = again {
                self.events.outcome(&disposition, seen);
                tokio::select! {
                    () = tokio::time::sleep(after) => {
                        attempt = next;
                        continue;
                    }
                    () = ending.cancelled() => return LaneEnd::GaveUp,
                }
            }
            if !self.settle(broker, &delivery, &disposition).instrument(trace::settle_span(&receive)).await {
                return LaneEnd::GaveUp;
            }
            self.events.outcome(&disposition, seen);
            let id = match &disposition {
                Disposition::DeadLetter { .. } if hold => {
                    outcome::decode(self.queue(), &delivery, attempt).map(|m| m.envelope.id.to_string()).ok()
                }
                _ => None,
            };
            self.to_ack(acks, delivery, disposition).await;
            self.events.settled();
            self.activity.in_flight.fetch_sub(1, Ordering::SeqCst);
            return id.map_or(LaneEnd::Next, LaneEnd::Hold);
        }
    }

    /// Hands a settled delivery to the ack loop, with its key when it completed. When the ack
    /// loop has given up on this session there is no ack, but a success is still recorded, so
    /// that its redelivery is a duplicate.
    async fn to_ack<D>(&self, acks: &mpsc::UnboundedSender<Settled<D>>, delivery: D, disposition: Disposition) {
        let key = match disposition {
            Disposition::Completed { key } => Some(key),
            _ => None,
        };
        if let Err(mpsc::error::SendError((_, Some(key)))) = acks.send((delivery, key)) {
            self.complete(&[key]).await;
        }
    }

    /// Waits for the calls under way (their timeout bounds them) and their acks, unless
    /// `release` hands their deliveries back first.
    async fn drain(&self, tracker: &TaskTracker, acker: &mut Acker, release: &CancellationToken) {
        let queue = self.queue().name.as_str();
        tracker.close();
        tokio::select! {
            () = tracker.wait() => {}
            () = release.cancelled() => {
                warn!(queue, "grace expired with handlers still running; their messages go back to the broker");
                return;
            }
        }
        // The acks of what finished go out before the rest is handed back.
        tokio::select! {
            _ = acker => {}
            () = release.cancelled() => warn!(queue, "acks not sent within the grace; those messages go back to the broker"),
        }
    }

    /// Decides what happens to a delivery. Whatever goes wrong in here, a panic included, ends
    /// as a disposition of this delivery alone: a panic is dead-lettered as `internal`.
    /// What it showed on the way goes into `seen`.
    pub async fn decide<D: Delivery>(&self, delivery: &D, message: &tracing::Span, seen: &mut Seen) -> Disposition {
        self.decide_at(delivery, attempt_of(delivery), message, seen).await
    }

    /// [`Worker::decide`] at `attempt` (a lane's retries run in the runner, the delivery's
    /// header still at its first).
    async fn decide_at<D: Delivery>(
        &self,
        delivery: &D,
        attempt: u32,
        message: &tracing::Span,
        seen: &mut Seen,
    ) -> Disposition {
        seen.attempt = attempt;
        let decided = async {
            match self.prepare(delivery, attempt, message, seen) {
                Ok((key, call)) => self.run_call(key, call, attempt, seen).await,
                Err(disposition) => disposition,
            }
        };
        match AssertUnwindSafe(decided).catch_unwind().await {
            Ok(disposition) => disposition,
            Err(panic) => {
                let error = panic_text(panic.as_ref());
                self.events.internal_error(delivery.message_id(), &error);
                Disposition::DeadLetter {
                    reason: Reason::Internal,
                    error: format!("internal error: {error}"),
                    attempts: attempt,
                }
            }
        }
    }

    /// The checks before a handler runs, in order: a copy back early from a hop waits again,
    /// a bad message is dead-lettered, a filtered one acked, a scheduled one waits; the rest
    /// come out as their idempotency key and rendered call.
    fn prepare<D: Delivery>(
        &self,
        delivery: &D,
        attempt: u32,
        message: &tracing::Span,
        seen: &mut Seen,
    ) -> Result<(String, Call), Disposition> {
        let q = self.queue();
        // A copy that came back from a hop before its due time waits again, attempt unspent.
        if let Some(after) = envelope::due_in(delivery.header(envelope::DUE_HEADER).as_ref(), clock::now()) {
            return Err(Disposition::Scheduled { attempt, after });
        }
        let keep = self.events.keeps_attempts();
        if keep {
            seen.message_id = delivery.message_id().map(str::to_string);
        }
        let decoded = outcome::decode(q, delivery, attempt)?;
        let envelope = &decoded.envelope;
        events::decoded(message, envelope, delivery.message_id().is_some());
        if keep {
            seen.message_id.get_or_insert_with(|| envelope.id.clone());
            seen.idempotency_key = Some(envelope.idempotency_key().to_string());
        }
        let headers = filter::headers(q, |name| delivery.header(name));
        outcome::filter(q, &decoded, delivery.route(), &headers, attempt)?;
        // Before anything is rendered or waited for: a scheduled message holds no slot.
        if let Some(after) = envelope.due_in(clock::now()) {
            return Err(Disposition::Scheduled { attempt, after });
        }
        let context = trace::outgoing(trace::incoming(delivery));
        if keep {
            let mut hex = String::with_capacity(32);
            for byte in context.trace_id {
                // Writing to a String cannot fail.
                let _ = write!(hex, "{byte:02x}");
            }
            seen.trace_id = Some(hex);
        }
        outcome::prepare(q, &decoded, attempt, Some(&context.to_string()))
    }

    /// Runs a prepared call once the gate and the rate limiter let it, under an idempotency
    /// claim taken only then.
    async fn run_call(&self, key: String, call: Call, attempt: u32, seen: &mut Seen) -> Disposition {
        let q = self.queue();
        // The waits hold no claim: a lease taken before them could run out while the message
        // waits, and let a duplicate run beside it.
        let permit = match self.gate.admit().await {
            Admission::Run(permit) => permit,
            Admission::HandBack { after, why } => return Disposition::Wait { attempt, after, why: why.into() },
        };
        if let Some(limiter) = &self.limiter {
            limiter.until_ready().await;
        }
        let (Some(_), Some(store)) = (&q.idempotency, &self.store) else {
            return self.handle(call, attempt, permit, seen).await;
        };
        if let Err(disposition) = self.claim(store, &key, attempt).await {
            return disposition;
        }
        match self.handle(call, attempt, permit, seen).await {
            Disposition::Ack => Disposition::Completed { key },
            other => {
                if let Err(e) = store.release(&q.name, &key).await {
                    warn!(queue = %q.name, error = %e, "releasing the idempotency claim failed; it expires with its lease");
                }
                other
            }
        }
    }

    /// Claims `key` for a handler run, or says why not: a duplicate, a key busy elsewhere, a
    /// store that does not answer.
    async fn claim(&self, store: &Store, key: &str, attempt: u32) -> Result<(), Disposition> {
        let q = self.queue();
        match store.claim(&q.name, key, lease(q)).await {
            Ok(Claim::Claimed) => Ok(()),
            Ok(Claim::Done) => Err(Disposition::Duplicate),
            Ok(Claim::Busy) => {
                let after = q.retry.initial.max(Duration::from_secs(1)).mul_f64(rand::rng().random_range(0.5..=1.0));
                Err(Disposition::Wait { attempt, after, why: "another worker holds this key".into() })
            }
            Err(e) => {
                if e.damaged && self.damaged.set(BrokerError::Damaged(e.message.clone().into())).is_ok() {
                    self.damaged_found.notify_one();
                }
                let after = backoff::reconnect_delay(6, STORE_DOWN_WAIT, &mut rand::rng());
                Err(Disposition::Wait { attempt, after, why: format!("no claim, so no handler run: {e}") })
            }
        }
    }

    /// Records successes before their acks, retrying while the lease lasts (not when the
    /// store is damaged, which no retry mends): a success the store does not know of could
    /// run again when its message is delivered twice.
    async fn complete(&self, keys: &[String]) {
        let q = self.queue();
        let (Some(store), Some(idempotency)) = (&self.store, &q.idempotency) else { return };
        let lease = lease(q);
        let started = Instant::now();
        let mut failures = 0;
        while let Err(e) = store.complete(&q.name, keys, idempotency.ttl).await {
            failures += 1;
            if e.damaged || started.elapsed() >= lease {
                error!(queue = %q.name, error = %e, keys = keys.len(), "could not record successes in the idempotency store; duplicates of these messages may run again");
                return;
            }
            error!(queue = %q.name, error = %e, failures, "recording successes in the idempotency store failed; retrying");
            let delay = backoff::reconnect_delay(failures, Duration::from_secs(5), &mut rand::rng());
            tokio::time::sleep(delay).await;
        }
    }

    /// Runs the handler's call under its gate permit, tells the gate how it went, and
    /// classifies the result; what the handler showed goes into `seen`.
    async fn handle(&self, call: Call, attempt: u32, permit: Permit<'_>, seen: &mut Seen) -> Disposition {
        let started = Instant::now();
        let mut observed = Observed::default();
        let result = self.handlers.execute(call, &mut observed).await;
        let rtt = started.elapsed();
        seen.handler = Some((observed, rtt));
        self.events.handler_ran(rtt);
        permit.finish(rtt, result.as_ref().is_err_and(HandlerError::is_unwell));
        outcome::disposition(self.queue(), result, attempt)
    }

    /// Makes a disposition durable (its [`Effect`]); true when the delivery may now be acked.
    /// A copy the broker refuses is published again while the delivery's channel lives.
    async fn settle<B: Broker>(&self, broker: &B, delivery: &B::Delivery, disposition: &Disposition) -> bool {
        let q = self.queue();
        let effect = disposition.effect(&q.name);
        let mut failures = 0;
        loop {
            let published = match &effect {
                Effect::Ack => return true,
                Effect::Delayed { after, headers } => {
                    let (delay, headers) = hop(*after, broker.capabilities().longest_delay, headers);
                    broker.copy(delivery, Target::Later { queue: &q.name, delay }, &Edits::setting(headers)).await
                }
                Effect::DeadLetter { headers } => {
                    broker.copy(delivery, Target::DeadLetter(&q.dead_letter), &Edits::setting(headers.clone())).await
                }
            };
            match published {
                Ok(()) => {
                    if let Effect::Delayed { after, .. } = &effect {
                        self.activity.delayed_until(*after);
                    }
                    return true;
                }
                Err(e) if !delivery.is_live() || !broker.is_connected() => {
                    self.events.copy_abandoned(&e);
                    return false;
                }
                Err(e) => {
                    failures += 1;
                    self.events.copy_refused(failures, &e);
                    let delay = backoff::reconnect_delay(failures, Duration::from_secs(10), &mut rand::rng());
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Acks settled deliveries as they come, in batches: the keys of a batch are recorded done
    /// (in one transaction or round trip) before any of it is acked. Ends once every sender is
    /// gone, or with the error of a batch that could not be acked ([`Worker::ack`]).
    async fn ack_loop<C: Consumer>(
        self: Arc<Self>,
        consumer: C,
        mut events: mpsc::UnboundedReceiver<Settled<C::Delivery>>,
    ) -> Result<(), BrokerError> {
        let mut batch = Vec::new();
        // With the embedded broker's own store, the keys go in the acks' transaction.
        let riding = self.store.as_ref().is_some_and(Store::rides_acks);
        while events.recv_many(&mut batch, 1024).await > 0 {
            let (settled, keys): (Vec<_>, Vec<Option<String>>) = batch.drain(..).unzip();
            let mut keys: Vec<String> = keys.into_iter().flatten().collect();
            if !keys.is_empty() && !riding {
                self.complete(&keys).await;
                keys.clear();
            }
            if let Err(e) = self.ack(&consumer, &settled, &keys).await {
                // This batch (when its keys were to ride on its acks) and what waits behind it
                // were handled too: their keys are recorded, so that their redeliveries are
                // duplicates. Closed first: a handler finishing later records its own key (see
                // `start`).
                events.close();
                while let Ok((_, key)) = events.try_recv() {
                    keys.extend(key);
                }
                if !keys.is_empty() {
                    self.complete(&keys).await;
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Acks a batch of handled deliveries, with `keys` recorded in the same transaction when
    /// there are any ([`Store::rides_acks`]), retrying with backoff while they are still the
    /// consumer's (the queue reported unready meanwhile); once they are not, the broker
    /// delivers them again, and the keys are recorded alone. An error when acks kept failing
    /// for [`ACK_RETRY_FOR`]: the session must end, so that a new one settles what this one
    /// could not.
    async fn ack<C: Consumer>(
        &self,
        consumer: &C,
        settled: &[C::Delivery],
        keys: &[String],
    ) -> Result<(), BrokerError> {
        let started = Instant::now();
        let mut failing = None;
        let mut failures = 0;
        let q = self.queue();
        let riding = q.idempotency.as_ref().filter(|_| !keys.is_empty()).map(|i| (dedup::names(&q.name, keys), i.ttl));
        loop {
            let acked = match &riding {
                Some((names, ttl)) => consumer.ack_recording(settled, names, *ttl).await,
                None => consumer.ack(settled).await,
            };
            let error = match acked {
                Ok(()) => {
                    if failures > 0 {
                        self.events.acked_after(failures);
                    }
                    return Ok(());
                }
                Err(e) => e,
            };
            if !settled.iter().any(|d| d.is_live()) {
                self.events.ack_abandoned(&error);
                if !keys.is_empty() {
                    self.complete(keys).await;
                }
                return Ok(());
            }
            // No retry mends a damaged store: the run ends.
            if error.is_damaged() {
                return Err(error);
            }
            failures += 1;
            if started.elapsed() >= ACK_RETRY_FOR {
                self.events.acks_given_up(failures, ACK_RETRY_FOR, &error);
                // Not ready until a new session consumes: closing this one can take a while
                // when the broker cannot write.
                self.readiness.set(false);
                return Err(error);
            }
            failing.get_or_insert_with(|| self.readiness.acks_failing(&self.queue.name));
            self.events.ack_failed(failures, &error);
            let delay = backoff::reconnect_delay(failures, ACK_BACKOFF_CAP, &mut rand::rng());
            tokio::time::sleep(delay).await;
        }
    }
}

/// The delivery's attempt number, from its header (1 when absent or nonsense).
fn attempt_of<D: Delivery>(delivery: &D) -> u32 {
    attempt_in(delivery.header(envelope::ATTEMPT_HEADER).as_ref())
}

/// What a panic said, when it said it with a string.
fn panic_text(panic: &(dyn Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_string(),
        (None, Some(s)) => s.clone(),
        (None, None) => "a panic without a message".to_string(),
    }
}

/// How long to hold a copy delayed `after` on a broker whose copies wait at most `longest`,
/// and its headers: a longer delay is held `longest` (one hop), its due time recorded, so that
/// the copy arriving early is delayed again ([`envelope::due_in`]) and never handled before.
fn hop(after: Duration, longest: Option<Duration>, headers: &Headers) -> (Duration, Headers) {
    let mut headers = headers.clone();
    match longest {
        Some(longest) if after > longest => {
            // The header holds whole milliseconds: rounded up, the copy is never early.
            headers.extend(envelope::due_header(clock::now(), after + Duration::from_nanos(999_999)));
            (longest, headers)
        }
        _ => (after, headers),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use bytes::Bytes;

    use super::*;
    use crate::broker::HeaderValue;

    /// A delivery whose body cannot be read: the stand-in for any bug that panics mid-delivery.
    struct Panicking;

    impl Delivery for Panicking {
        fn body(&self) -> &Bytes {
            panic!("a bug while reading the body")
        }
        fn header(&self, _: &str) -> Option<HeaderValue> {
            None
        }
        fn timestamp(&self) -> Option<u64> {
            None
        }
        fn message_id(&self) -> Option<&str> {
            Some("m-1")
        }
        fn kind(&self) -> Option<&str> {
            None
        }
        fn content_type(&self) -> Option<&str> {
            None
        }
        fn route(&self) -> Option<&crate::broker::Route> {
            None
        }
        fn headers(&self) -> BTreeMap<String, serde_json::Value> {
            BTreeMap::new()
        }
        fn is_live(&self) -> bool {
            true
        }
    }

    /// Issue 9: a panic while handling one delivery ends it as DLQ(internal), never unsettled.
    #[tokio::test]
    async fn a_panic_while_handling_a_delivery_dead_letters_it_as_internal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let yaml = "version: 1\nqueues:\n  work:\n    handler: {webhook: {url: \"http://127.0.0.1:9/x\"}}\n";
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
        let config = crate::config::load(&[dir.path().to_path_buf()]).config.expect("valid");
        let handlers = Arc::new(crate::call::Handlers::new().expect("client"));
        let queue = config.queues["work"].clone();
        let gate = Gate::new(&queue, &Default::default(), &Default::default(), Arc::default());
        let worker = Worker::new(queue, gate, handlers, Arc::default(), None, Readiness::default());
        let disposition = worker.decide(&Panicking, &tracing::Span::none(), &mut Seen::default()).await;
        let Disposition::DeadLetter { reason, error, attempts } = disposition else {
            panic!("not dead-lettered: {disposition:?}");
        };
        assert_eq!((reason, attempts), (Reason::Internal, 1));
        assert_eq!(error, "internal error: a bug while reading the body");
    }
}
