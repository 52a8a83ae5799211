//! The embedded broker: the [`Broker`] trait on one SQLite file (WAL mode), for running
//! without RabbitMQ. It owns the file's tables (declarations, bindings, messages, consumers),
//! routes as RabbitMQ does ([`route`](super::route): direct, fanout, topic, headers), refuses
//! a publish to a full queue (`max_length`, reject-publish) writing nothing, delays a copy
//! exactly with no head-of-line blocking (a copy is invisible until due; consumers take what
//! is visible in id order), and leases what it delivers: a consumer renews the lease of its
//! unsettled messages while it lives, so those of a killed process come back once the lease
//! runs out ([`LEASE`]). A failed ack changes nothing: the deliveries stay leased to their
//! consumer, to be acked again. A claim takes 4 MiB of bodies at most (a larger one alone),
//! and a consumer whose stream holds that much unread claims no more: memory holds a few
//! large messages, not a claim's worth. A body is stored once, whatever copies of it are
//! made (fan-out, retries, dead-lettering, redrive), and a consumer with a limit
//! ([`Broker::consume_within`]) gets a larger message as its size alone, never read.
//!
//! Durability is SQLite's: each commit is in the write-ahead log before a publish is
//! confirmed, and with `synchronous=NORMAL` a commit survives the process being killed (not
//! necessarily the machine losing power, which may take back the last commits). No storage
//! engine here: every write is SQL in one transaction per batch of requests (group commit, on
//! a thread of its own).
//!
//! Other processes (`sluice publish`, `sluice dlq`, `sluice status`) open the same file, never
//! creating one ([`Embedded::open_existing_dir`]), and work on the same state; their consumers count in `stats` while their registration is
//! renewed. The commands that only read (`status`, `dlq list`, `dlq show`) open it read-only
//! ([`ReadOnly`]) and write nothing, not even a lease. In-process publishes wake consumers at once; another process's, within [`POLL`].
//! Idleness costs the same whatever the number of queues: the writer alone looks every
//! [`POLL`] (one number read, unless another process wrote or something came due), idle
//! consumers never wake, and one request renews every consumer's leases.
//! Freed pages go back to the file system a bounded number at a time (incremental
//! auto-vacuum), so the file shrinks after a backlog drains.
//!
//! Limits: a delayed copy is delivered within [`POLL`] after it is due; `delayed()` scans the
//! messages, and counts deliveries under a lease as not yet due back (a killed runner's are
//! held until theirs runs out, so `run --exit-when-idle` waits for them); `max_length` counts ready messages as RabbitMQ does (not those delivered, nor
//! delayed copies not yet due). One machine only: the file must be on a local disk (SQLite's
//! WAL needs shared memory between the processes).
//!
//! Damage: a message row that cannot be read is quarantined by the claim that meets it (to
//! its queue's dead-letter queue, reason `internal`), and the queue goes on; a file SQLite
//! finds damaged, or the file or its write-ahead log deleted, replaced or cut under a live
//! process, is [`BrokerError::Damaged`], which ends `sluice run` (see the store's and writer's
//! docs). A file a process found damaged is marked so beside it (`broker.db.damaged`), and
//! every process refuses it from then on, though the damage may lie where it does not read.

mod keys;
mod process;
mod reader;
mod store;
#[cfg(test)]
mod tests;
mod writer;

use std::path::Path;
#[cfg(test)]
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak, mpsc};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};

pub use self::keys::Claim;
use self::keys::{Begin, Claims};
pub use self::reader::{Messages, ReadOnly, Short};
pub(crate) use self::store::now_ms;
use self::store::{Body, NewMessage, Registration, Stored, ms};
use self::writer::{Op, Renewal, Wakers};
use super::declaration;
use super::kit::claim::{self, Ask, Claimed, Claimer, Holder};
use super::kit::kept::CLAIM_BYTES;
use super::kit::{kept, lease, lock};
use super::render::Picture;
use super::{
    BodyLimits, Broker, BrokerError, Consumer, Credit, Drift, Edits, Headers, Kept, KeptDeliveries, Operate, Outgoing,
    Publish, QueueStats, Target,
};
use crate::topology::{BindingDecl, Plan};
/// This process as a claim or a consumer names it (`pid:start:namespace`), and whether the
/// process a name gives still runs: the tests name what they make on shared servers so, to
/// remove what a killed run left.
#[doc(hidden)]
pub use process::{alive as process_alive, process as this_process};

/// How long a delivered message stays leased to its consumer without a renewal. A live
/// consumer renews every third of it; a killed one's messages come back after at most this
/// (at once when its process is known dead: see `Store::release_the_dead`).
pub const LEASE: Duration = Duration::from_secs(30);

/// How often the writer looks for what no commit of this process announced: another process's
/// writes, delayed copies and leases come due (once for every queue of the process).
pub const POLL: Duration = Duration::from_millis(50);

/// A session with the embedded broker. Cheap to clone; clones share the writer thread.
#[derive(Clone)]
pub struct Embedded {
    inner: Arc<Inner>,
    /// Until this session is closed ([`Embedded::session`] makes another on the same file).
    connected: Arc<AtomicBool>,
}

struct Inner {
    ops: mpsc::Sender<Op>,
    wakers: Arc<Wakers>,
    /// The writer's holder of idempotency keys, and the claims it holds.
    claims: Arc<Claims>,
    lease: Duration,
    /// The consumers of this handle, whose leases and registrations [`renew_all`] renews.
    consumers: Mutex<Vec<Weak<ConsumerState>>>,
    /// Whether [`renew_all`] runs.
    renewing: AtomicBool,
    /// Requests sent to the writer, for tests that count what idleness costs.
    #[cfg(test)]
    requests: AtomicU64,
}

/// The writer's answer to a request sent.
type Answer<T> = oneshot::Receiver<Result<T, BrokerError>>;

async fn answer<T>(answer: Answer<T>) -> Result<T, BrokerError> {
    answer.await.map_err(|_| stopped())?
}

fn stopped() -> BrokerError {
    BrokerError::Lost("the embedded broker's writer stopped".into())
}

/// The broker's file in the directory `--broker` names.
pub const FILE: &str = "broker.db";

/// What `sluice plan --broker DIR` shows: the plan as this broker keeps it in `dir`'s file.
pub fn picture(plan: &Plan, dir: &Path) -> Picture {
    let title =
        format!("the embedded broker in {} (every process on this directory shares it)", dir.join(FILE).display());
    let delays = "delays: a retry waits in its queue's table until it is due (exact: no delay queues)";
    declaration::picture(plan, store::BROKER, title, delays.into(), |_| None)
}

impl Embedded {
    /// Opens the broker's file, creating it and its directory. Several processes may open
    /// the same file.
    pub fn open(path: &Path) -> Result<Embedded, BrokerError> {
        Embedded::open_file(path, LEASE, true)
    }

    /// Opens the broker whose directory is `dir` (its [`FILE`]), creating it: for `run`.
    pub fn open_dir(dir: &Path) -> Result<Embedded, BrokerError> {
        Embedded::open(&dir.join(FILE))
    }

    /// Opens the broker whose directory is `dir` only if it is there: for the operator's
    /// commands, which must not leave an empty broker where a mistyped `--broker` (or another
    /// working directory than `run`'s) points.
    pub fn open_existing_dir(dir: &Path) -> Result<Embedded, BrokerError> {
        Embedded::open_file(&dir.join(FILE), LEASE, false)
    }

    /// Opens with another lease than [`LEASE`].
    #[cfg(test)]
    fn open_with_lease(path: &Path, lease: Duration) -> Result<Embedded, BrokerError> {
        Embedded::open_file(path, lease, true)
    }

    /// Opens the file (with `create`, making it and its directory when missing).
    fn open_file(path: &Path, lease: Duration, create: bool) -> Result<Embedded, BrokerError> {
        let wakers = Arc::new(Wakers::default());
        let (ops, claims) = writer::start(path, create, wakers.clone())?;
        let inner = Inner {
            ops,
            wakers,
            claims,
            lease,
            consumers: Mutex::new(Vec::new()),
            renewing: AtomicBool::new(false),
            #[cfg(test)]
            requests: AtomicU64::new(0),
        };
        Ok(Embedded { inner: Arc::new(inner), connected: Arc::new(AtomicBool::new(true)) })
    }

    /// A new session on the same file and writer thread: closing it closes only it. The
    /// runner's sessions and its idempotency store share one writer, so that keys and acks
    /// go in one transaction and never wait on each other's locks.
    pub fn session(&self) -> Embedded {
        Embedded { inner: self.inner.clone(), connected: Arc::new(AtomicBool::new(true)) }
    }

    /// Sends a request to the writer and waits for its answer (after the commit).
    async fn call<T>(&self, op: impl FnOnce(oneshot::Sender<Result<T, BrokerError>>) -> Op) -> Result<T, BrokerError> {
        answer(self.send(op)?).await
    }

    /// Sends a request to the writer at once; its [`answer`] comes after the commit.
    fn send<T>(
        &self,
        op: impl FnOnce(oneshot::Sender<Result<T, BrokerError>>) -> Op,
    ) -> Result<Answer<T>, BrokerError> {
        let (reply, answer) = oneshot::channel();
        self.inner.ops.send(op(reply)).map_err(|_| stopped())?;
        #[cfg(test)]
        self.inner.requests.fetch_add(1, Ordering::SeqCst);
        Ok(answer)
    }

    /// Takes the idempotency key for this session's writer for `lease`, unless it is done or
    /// another live holder has it: the embedded idempotency store (keys as the store names
    /// them). In memory while no other holder is on the file, else by row (see [`keys`]).
    pub async fn claim_key(&self, key: &str, lease: Duration) -> Result<Claim, BrokerError> {
        let claims = &self.inner.claims;
        loop {
            let now = now_ms();
            let until = now.saturating_add(ms(lease));
            let taken = match claims.begin(key, now, until) {
                Begin::Held => return Ok(Claim::Busy),
                Begin::Unregistered => {
                    self.call(Op::RegisterKeys).await?;
                    continue;
                }
                Begin::Alone => claims.read(key, now).await,
                Begin::Shared => {
                    let taken = self.call(|reply| Op::ClaimKey { key: key.into(), until, reply }).await;
                    if let Ok(Claim::Claimed) = taken {
                        claims.written(key);
                    }
                    taken
                }
            };
            if !matches!(taken, Ok(Claim::Claimed)) && claims.forget(key) {
                // Written as a row meanwhile (a neighbour came): not this holder's after all.
                self.call(|reply| Op::ReleaseKey { key: key.into(), reply }).await?;
            }
            return taken;
        }
    }

    /// Records the idempotency keys handled for `ttl` (without an ack: see
    /// [`Consumer::ack_recording`]).
    pub async fn complete_keys(&self, keys: &[String], ttl: Duration) -> Result<(), BrokerError> {
        let until = now_ms().saturating_add(ms(ttl));
        self.call(|reply| Op::CompleteKeys { keys: keys.to_vec(), until, reply }).await
    }

    /// Gives up this session's writer's claim on the idempotency key.
    pub async fn release_key(&self, key: &str) -> Result<(), BrokerError> {
        if self.inner.claims.forget(key) {
            self.call(|reply| Op::ReleaseKey { key: key.into(), reply }).await?;
        }
        Ok(())
    }

    async fn send_copy(&self, queue: &str, message: NewMessage, visible_at: i64) -> Result<(), BrokerError> {
        self.call(|reply| Op::Copy { queue: queue.into(), message, visible_at, reply }).await
    }

    async fn open_consumer(
        &self,
        queue: &str,
        prefetch: u16,
        max_body: u64,
    ) -> Result<(EmbeddedDeliveries, EmbeddedConsumer), BrokerError> {
        let owner = rand::random::<i64>();
        self.call(|reply| Op::Stats { queue: queue.into(), reply }).await?;
        let until = now_ms().saturating_add(ms(self.inner.lease));
        let renewals = vec![Renewal { owner, queue: queue.into(), ids: Vec::new(), registration: Registration::New }];
        self.call(|reply| Op::Renew { renewals, until, reply }).await?;
        let lessee = Lessee { owner, max_body, registered: AtomicBool::new(true) };
        let state = Arc::new(Holder::new(queue, prefetch, lessee));
        lock(&self.inner.consumers).push(Arc::downgrade(&state));
        if !self.inner.renewing.swap(true, Ordering::SeqCst) {
            tokio::spawn(renew_all(Arc::downgrade(&self.inner)));
        }
        let wake = self.inner.wakers.of(queue);
        let deliveries = claim::start(EmbeddedClaimer { broker: self.clone(), wake }, &state);
        Ok((deliveries, EmbeddedConsumer { broker: self.clone(), state }))
    }
}

/// A consumer as the embedded broker keeps it.
type ConsumerState = Holder<i64, Lessee>;

/// What the embedded broker keeps of a consumer besides what it holds.
struct Lessee {
    /// Its name in the file: the owner of its leases and its registration.
    owner: i64,
    /// Bodies larger are not read: their messages come with their size alone.
    max_body: u64,
    /// Counted among the queue's consumers (until it delivers no more).
    registered: AtomicBool,
}

/// A consumer's claims: what fits its prefetch when woken (a commit of this process, an ack,
/// or the writer's watch: another process's commit, a delayed copy come due). It never polls,
/// and leaves its leases to [`renew_all`]: an idle consumer does not wake at all.
struct EmbeddedClaimer {
    broker: Embedded,
    wake: Arc<Notify>,
}

impl Claimer for EmbeddedClaimer {
    type Id = i64;
    type Tag = Row;
    type Own = Lessee;

    fn id(row: &Row) -> i64 {
        row.id
    }

    fn wake(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    async fn claim(&mut self, s: &ConsumerState, ask: Ask) -> Claimed<Row> {
        if ask.room == 0 {
            return Claimed::default();
        }
        let until = now_ms().saturating_add(ms(self.broker.inner.lease));
        let (queue, owner, max_body) = (s.queue.clone(), s.own.owner, s.own.max_body);
        let n = u32::try_from(ask.room).unwrap_or(u32::MAX);
        let bytes = CLAIM_BYTES;
        let claimed = self.broker.call(|reply| Op::Claim { queue, owner, n, bytes, max_body, until, reply }).await;
        let store::Claimed { rows, full, quarantined } = match claimed {
            Ok(claimed) => claimed,
            Err(e) => return Claimed::failed(e),
        };
        for q in quarantined {
            let (row, to, fault) = (q.id, q.to, q.fault);
            tracing::error!(queue = %s.queue, row, %to, %fault, "unreadable stored message quarantined (reason internal)");
        }
        let deliveries = rows.into_iter().map(|row| delivery(row, s.live.clone())).collect();
        Claimed { deliveries, more: full, within: None, failed: None }
    }

    async fn hand_back(&mut self, s: &ConsumerState, ids: Vec<i64>) {
        let (owner, queue) = (s.own.owner, s.queue.clone());
        let _ = self.broker.call(|reply| Op::Release { owner, queue, ids, reply }).await;
    }

    /// A consumer that can deliver no more no longer counts as one.
    async fn retire(&mut self, s: &ConsumerState) {
        let _ = deregister(&self.broker, s).await;
    }

    async fn end(&mut self, s: &ConsumerState) {
        let _ = deregister(&self.broker, s).await;
    }
}

/// Removes the consumer's registration (once), extending its leases. Sent under the lock that
/// [`renew_all`] sends under, so that no renewal of the registration taken before lands after
/// it. Should it fail, the registration runs out with the lease.
async fn deregister(broker: &Embedded, s: &ConsumerState) -> Result<(), BrokerError> {
    let answer = {
        let _consumers = lock(&broker.inner.consumers);
        if !s.own.registered.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        let until = now_ms().saturating_add(ms(broker.inner.lease));
        broker.send(|reply| Op::Renew { renewals: vec![renewal(s)], until, reply })?
    };
    self::answer(answer).await
}

/// What renewing `s` takes: its unsettled ids, and its registration while it has one.
fn renewal(s: &ConsumerState) -> Renewal {
    let registration = if s.own.registered.load(Ordering::SeqCst) { Registration::Keep } else { Registration::Drop };
    Renewal { owner: s.own.owner, queue: s.queue.clone(), ids: s.held(), registration }
}

/// Renews the leases and registrations of every consumer of a handle every third of the
/// lease, in one request: one wake-up and one transaction however many queues there are. A
/// consumer whose handles are all gone without a close is no longer renewed (its leases run
/// out, as a killed process's do). Ends when the handle has no consumer left.
async fn renew_all(inner: Weak<Inner>) {
    let Some(lease) = inner.upgrade().map(|i| i.lease) else { return };
    let mut schedule = lease::Renewal::new(lease);
    loop {
        schedule.due().await;
        let Some(broker) = inner.upgrade().map(|inner| Embedded { inner, connected: Arc::new(AtomicBool::new(true)) })
        else {
            return;
        };
        let answer = {
            let mut consumers = lock(&broker.inner.consumers);
            consumers.retain(|c| c.upgrade().is_some_and(|s| !s.is_closed()));
            if consumers.is_empty() {
                // Under the lock that `open_consumer` pushes under: a new consumer starts another.
                broker.inner.renewing.store(false, Ordering::SeqCst);
                return;
            }
            let renewals: Vec<Renewal> = consumers
                .iter()
                .filter_map(Weak::upgrade)
                .map(|s| renewal(&s))
                .filter(|r| r.registration == Registration::Keep || !r.ids.is_empty())
                .collect();
            let until = now_ms().saturating_add(ms(lease));
            broker.send(|reply| Op::Renew { renewals, until, reply })
        };
        // A failed renewal is tried again after a poll's time; the lease has two more ticks.
        let renewed = match answer {
            Ok(sent) => self::answer(sent).await,
            Err(e) => Err(e),
        };
        match renewed {
            Ok(()) => schedule.renewed(),
            Err(_) => schedule.failed(POLL),
        }
    }
}

/// What the embedded broker keeps of a delivery to settle and copy it: its row, its body by
/// reference (what its copies carry).
pub struct Row {
    id: i64,
    body: Body,
}

/// A delivery from the embedded broker.
pub type EmbeddedDelivery = Kept<Row>;

/// A stored message as delivered (to a consumer whose deliveries are `live`).
fn delivery(stored: Stored, live: Arc<AtomicBool>) -> EmbeddedDelivery {
    let NewMessage { body, properties } = stored.message;
    Kept {
        tag: Row { id: stored.id, body },
        body: stored.body,
        size: usize::try_from(stored.size).unwrap_or(usize::MAX),
        properties,
        live,
    }
}

/// A copy of a delivered message with its headers edited (its body by reference).
fn copy(original: &EmbeddedDelivery, edits: &Edits) -> NewMessage {
    NewMessage { body: original.tag.body.clone(), properties: original.copied_properties(edits) }
}

/// The deliveries of one consumer.
pub type EmbeddedDeliveries = KeptDeliveries<Row>;

/// A consumer of the embedded broker. Cheap to clone; clones share the consumer.
#[derive(Clone)]
pub struct EmbeddedConsumer {
    broker: Embedded,
    state: Arc<ConsumerState>,
}

impl EmbeddedConsumer {
    /// Removes settled messages, recording `done` keys until `until` in the same transaction.
    async fn settle(&self, settled: &[EmbeddedDelivery], done: Vec<String>, until: i64) -> Result<(), BrokerError> {
        let s = &self.state;
        s.still_open()?;
        let ids: Vec<i64> = settled.iter().map(|d| d.tag.id).collect();
        self.broker.call(|reply| Op::Ack { owner: s.own.owner, ids: ids.clone(), done, until, reply }).await?;
        s.settled(&ids);
        Ok(())
    }
}

impl Consumer for EmbeddedConsumer {
    type Delivery = EmbeddedDelivery;

    /// A failed ack (a full disk, another process's write lock held past the busy timeout)
    /// changes nothing: its deliveries stay unsettled, leased and renewed, to be acked again.
    async fn ack(&self, settled: &[EmbeddedDelivery]) -> Result<(), BrokerError> {
        self.settle(settled, Vec::new(), 0).await
    }

    /// The keys are written in the acks' transaction: a key is done exactly when its message
    /// is gone.
    async fn ack_recording(
        &self,
        settled: &[EmbeddedDelivery],
        keys: &[String],
        ttl: Duration,
    ) -> Result<(), BrokerError> {
        self.settle(settled, keys.to_vec(), now_ms().saturating_add(ms(ttl))).await
    }

    async fn cancel(&self) -> Result<(), BrokerError> {
        self.state.cancel();
        Ok(())
    }

    async fn close(&self) {
        let s = &self.state;
        let ids = s.close();
        let _ = self.broker.call(|reply| Op::Release { owner: s.own.owner, queue: s.queue.clone(), ids, reply }).await;
        let _ = deregister(&self.broker, s).await;
        // The queue's other consumers in this process claim again: a single-active-consumer
        // queue passes to the next only once this registration is gone, and the release's
        // wake-up may have come before that (the next then waited for the lease).
        self.broker.inner.wakers.wake(&s.queue);
    }
}

impl Broker for Embedded {
    type Delivery = EmbeddedDelivery;
    type Deliveries = EmbeddedDeliveries;
    type Consumer = EmbeddedConsumer;

    async fn declare(&self, plan: &Plan) -> Result<(), BrokerError> {
        self.call(|reply| Op::Declare(plan.clone(), reply)).await
    }

    async fn unbind(&self, bindings: &[BindingDecl]) -> Result<(), BrokerError> {
        self.call(|reply| Op::Unbind(bindings.to_vec(), reply)).await
    }

    async fn copy(&self, original: &EmbeddedDelivery, target: Target<'_>, edits: &Edits) -> Result<(), BrokerError> {
        let message = copy(original, edits);
        let due = match target {
            Target::Later { delay, .. } => now_ms().saturating_add(ms(delay)).max(1),
            Target::Queue(_) | Target::DeadLetter(_) => 0,
        };
        self.send_copy(target.queue(), message, due).await
    }

    async fn consume(
        &self,
        queue: &str,
        credit: Credit,
    ) -> Result<(EmbeddedDeliveries, EmbeddedConsumer), BrokerError> {
        self.open_consumer(queue, credit.get(), u64::MAX).await
    }

    /// A message over `max_body` comes as its size: its body is never read into memory, and
    /// a dead-letter copy of it carries the stored body by reference.
    async fn consume_within(
        &self,
        queue: &str,
        credit: Credit,
        max_body: usize,
    ) -> Result<(EmbeddedDeliveries, EmbeddedConsumer), BrokerError> {
        self.open_consumer(queue, credit.get(), u64::try_from(max_body).unwrap_or(u64::MAX)).await
    }

    /// Ready messages, and the consumers of every process whose registration is renewed.
    async fn stats(&self, queue: &str) -> Result<QueueStats, BrokerError> {
        self.call(|reply| Op::Stats { queue: queue.into(), reply }).await
    }

    async fn delayed(&self) -> Result<u32, BrokerError> {
        self.call(Op::Delayed).await
    }

    /// A delayed copy is a row with the time it is due (milliseconds since the epoch, 64 bits):
    /// any delay fits.
    fn capabilities(&self) -> crate::broker::Capabilities {
        crate::broker::capabilities::EMBEDDED
    }

    fn is_connected(&self) -> bool {
        self.connected.load(Ordering::SeqCst)
    }

    async fn close(&self) {
        self.connected.store(false, Ordering::SeqCst);
    }
}

impl Publish for Embedded {
    async fn publish(&self, exchange: &str, routing_key: &str, message: Outgoing) -> Result<(), BrokerError> {
        let (body, properties) = kept::published(store::BROKER, exchange, routing_key, message)?;
        let message = NewMessage { body: Body::New(body), properties };
        self.call(|reply| Op::Publish { exchange: exchange.into(), routing_key: routing_key.into(), message, reply })
            .await
    }

    async fn body_limits(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &Headers,
    ) -> Result<Option<BodyLimits>, BrokerError> {
        let (exchange, routing_key, headers) = (exchange.into(), routing_key.into(), headers.clone());
        let limits = self.call(|reply| Op::Limits { exchange, routing_key, headers, reply }).await?;
        let size = |max: u64| usize::try_from(max).unwrap_or(usize::MAX);
        Ok(Some(limits.into_iter().map(|(queue, max)| (queue, max.map(size))).collect()))
    }
}

impl Operate for Embedded {
    async fn browse(&self, queue: &str, window: Credit) -> Result<(EmbeddedDeliveries, EmbeddedConsumer), BrokerError> {
        self.open_consumer(queue, window.get(), u64::MAX).await
    }

    async fn drift(&self, plan: &Plan) -> Result<Vec<Drift>, BrokerError> {
        self.call(|reply| Op::Drift(plan.clone(), reply)).await
    }

    async fn leased(&self, queue: &str) -> Result<Option<super::Leased>, BrokerError> {
        let (count, until_ms) = self.call(|reply| Op::Leased { queue: queue.into(), reply }).await?;
        let until = u64::try_from(until_ms / 1000).unwrap_or(0);
        Ok((count > 0).then_some(super::Leased { count, until }))
    }
}
