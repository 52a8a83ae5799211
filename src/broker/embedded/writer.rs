//! The one thread that talks to the file for a broker handle: it takes every request waiting
//! on its channel and runs them in one write transaction (group commit), and answers each only
//! once the transaction has committed. A request refused (a full queue, no route, a conflict)
//! is refused before it writes anything, so the others go on; an error of the store itself
//! fails the whole batch, which is rolled back. SQLite allows one writer at a time anyway; batching is
//! what lets thousands of messages a second through on a few commits.
//!
//! Every [`CHECK_FILES_EVERY`], and before it empties the write-ahead log, it checks that the
//! file and its log are still the ones it opened, the log as long as its index says; once
//! either was deleted, replaced or cut, it keeps what it can and answers every request from
//! then on with [`BrokerError::Damaged`] (see [`Store::give_up`]).

use std::collections::BTreeSet;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::{Notify, oneshot};

use super::POLL;
use super::keys::{self, Claim, Claims};
use super::store::{Claimed, NewMessage, Registration, Store, now_ms};
use crate::broker::{BrokerError, Cause, Drift, Headers, QueueStats};
use crate::topology::{BindingDecl, Plan};

/// The most requests in one transaction: a bound on how long one commit keeps others waiting.
const BATCH: usize = 512;

/// How often, at most, freed pages are given back and the write-ahead log emptied.
const RECLAIM_EVERY: Duration = Duration::from_secs(1);

/// How often the writer checks that its files are still there.
const CHECK_FILES_EVERY: Duration = Duration::from_secs(1);

type Reply<T> = oneshot::Sender<Result<T, BrokerError>>;

/// A request to the writer.
pub(super) enum Op {
    Declare(Plan, Reply<()>),
    Unbind(Vec<BindingDecl>, Reply<()>),
    Publish {
        exchange: String,
        routing_key: String,
        message: NewMessage,
        reply: Reply<()>,
    },
    /// A copy into one queue, visible from `visible_at` (0: at once).
    Copy {
        queue: String,
        message: NewMessage,
        visible_at: i64,
        reply: Reply<()>,
    },
    /// At most `n` messages and `bytes` of bodies (a larger first one goes alone); bodies over
    /// `max_body` are not read.
    Claim {
        queue: String,
        owner: i64,
        n: u32,
        bytes: u64,
        max_body: u64,
        until: i64,
        reply: Reply<Claimed>,
    },
    /// Removes `owner`'s settled messages and records the idempotency keys `done` until
    /// `until`, in one transaction.
    Ack {
        owner: i64,
        ids: Vec<i64>,
        done: Vec<String>,
        until: i64,
        reply: Reply<()>,
    },
    /// Registers this writer's holder of idempotency keys (see [`keys`]).
    RegisterKeys(Reply<keys::Mode>),
    /// Takes an idempotency key by row for this writer's holder until `until`.
    ClaimKey {
        key: String,
        until: i64,
        reply: Reply<Claim>,
    },
    /// Records idempotency keys done until `until`, without an ack.
    CompleteKeys {
        keys: Vec<String>,
        until: i64,
        reply: Reply<()>,
    },
    ReleaseKey {
        key: String,
        reply: Reply<()>,
    },
    Release {
        owner: i64,
        queue: String,
        ids: Vec<i64>,
        reply: Reply<()>,
    },
    /// Leases and registrations of consumers, extended to `until`.
    Renew {
        renewals: Vec<Renewal>,
        until: i64,
        reply: Reply<()>,
    },
    Stats {
        queue: String,
        reply: Reply<QueueStats>,
    },
    /// The queues a publish would reach, with the largest body each takes.
    Limits {
        exchange: String,
        routing_key: String,
        headers: Headers,
        reply: Reply<Vec<(String, Option<u64>)>>,
    },
    Delayed(Reply<u32>),
    Drift(Plan, Reply<Vec<Drift>>),
    /// The messages of a queue under a running lease, and when the last lease ends (ms since
    /// the epoch), once what dead processes held is handed back.
    Leased {
        queue: String,
        reply: Reply<(u32, i64)>,
    },
}

impl Op {
    fn writes(&self) -> bool {
        !matches!(self, Op::Stats { .. } | Op::Limits { .. } | Op::Delayed(_) | Op::Drift(..))
    }
}

/// One consumer's part of a renewal: its unsettled ids, and what becomes of its registration.
pub(super) struct Renewal {
    pub owner: i64,
    pub queue: String,
    pub ids: Vec<i64>,
    pub registration: Registration,
}

/// One [`Notify`] per queue that has consumers in this process: poked after a commit that made
/// messages ready there, so only that queue's consumers look, and by the writer's [`Watch`].
#[derive(Default)]
pub(super) struct Wakers {
    queues: Mutex<HashMap<String, Arc<Notify>>>,
    /// Queues given a consumer since the watch last looked: when their next message comes
    /// due is not known yet.
    joined: Mutex<Vec<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Wakers {
    /// The queue's notifier for a new consumer, made on first use.
    pub fn of(&self, queue: &str) -> Arc<Notify> {
        lock(&self.joined).push(queue.to_string());
        lock(&self.queues).entry(queue.to_string()).or_default().clone()
    }

    pub(super) fn wake(&self, queue: &str) {
        if let Some(notify) = lock(&self.queues).get(queue) {
            notify.notify_waiters();
        }
    }

    /// The queues some consumer of this process still waits on; forgets the others.
    fn watched(&self) -> Vec<String> {
        let mut queues = lock(&self.queues);
        queues.retain(|_, notify| Arc::strong_count(notify) > 1);
        queues.keys().cloned().collect()
    }

    fn is_empty(&self) -> bool {
        lock(&self.queues).is_empty()
    }
}

/// What no commit of this process announces, looked for once every [`POLL`] for the whole
/// process, whatever the number of queues: another process's commits (SQLite's
/// `data_version` changes; then every watched queue is read once), and delayed copies and
/// leases coming due (each queue is read when its next one is due). An idle runner reads one
/// number per look.
#[derive(Default)]
struct Watch {
    version: Option<i64>,
    /// When each queue's next message not yet visible comes due, by time and by queue.
    due: BTreeSet<(i64, String)>,
    at: HashMap<String, i64>,
}

impl Watch {
    /// Remembers that `queue` has a message coming due at `at`, unless an earlier one is known.
    fn schedule(&mut self, queue: &str, at: i64) {
        match self.at.get(queue) {
            Some(&known) if known <= at => {}
            known => {
                if let Some(known) = known {
                    self.due.remove(&(*known, queue.to_string()));
                }
                self.at.insert(queue.to_string(), at);
                self.due.insert((at, queue.to_string()));
            }
        }
    }

    /// Wakes the consumers of every queue with something to claim that no commit of this
    /// process announced.
    fn look(&mut self, conn: &Connection, store: &Store, wakers: &Wakers) -> Result<(), BrokerError> {
        let mut queues = std::mem::take(&mut *lock(&wakers.joined));
        let version = store.data_version(conn)?;
        if self.version.replace(version).is_some_and(|before| before != version) {
            queues = wakers.watched();
        }
        let now = now_ms();
        while let Some((at, _)) = self.due.first()
            && *at <= now
        {
            if let Some((_, queue)) = self.due.pop_first() {
                self.at.remove(&queue);
                queues.push(queue);
            }
        }
        queues.sort_unstable();
        queues.dedup();
        for queue in queues {
            let (ready, next) = store.due(conn, &queue)?;
            if ready {
                wakers.wake(&queue);
            }
            if let Some(at) = next {
                self.schedule(&queue, at);
            }
        }
        Ok(())
    }
}

/// An answer held until the commit: sent as computed, or as the commit's error.
type Finish = Box<dyn FnOnce(Option<&BrokerError>) + Send>;

fn finish<T: Send + 'static>(reply: Reply<T>, result: Result<T, BrokerError>) -> Finish {
    Box::new(move |failed| {
        let _ = reply.send(match failed {
            Some(e) => Err(e.clone()),
            None => result,
        });
    })
}

/// Opens the file (with `create`, making it when missing) and starts the writer thread, which
/// wakes `wakers` after its commits.
/// Its idempotency keys' holder comes with it.
pub(super) fn start(
    path: &Path,
    create: bool,
    wakers: Arc<Wakers>,
) -> Result<(mpsc::Sender<Op>, Arc<Claims>), BrokerError> {
    let (conn, store) = Store::open(path, create)?;
    let claims = Arc::new(Claims::open(path, &store)?);
    let (sender, receiver) = mpsc::channel();
    let holder = claims.clone();
    std::thread::Builder::new()
        .name("sluice-embedded".into())
        .spawn(move || run(conn, store, receiver, &wakers, &holder))
        .map_err(|e| BrokerError::Connect { url: path.display().to_string(), reason: Cause::from_error(e) })?;
    Ok((sender, claims))
}

/// Serves requests until every sender is gone, [watches](Watch) while this process has
/// consumers, and looks at the other holders of idempotency keys ([`keys::look`]) while its
/// own holder is registered.
fn run(mut conn: Connection, mut store: Store, receiver: mpsc::Receiver<Op>, wakers: &Wakers, claims: &Arc<Claims>) {
    let (mut last_reclaim, mut last_check, mut last_look) = (Instant::now(), Instant::now(), Instant::now());
    let mut watch = Watch::default();
    let mut neighbours = keys::Neighbours::default();
    // Where the sweep of expired idempotency keys goes on.
    let mut sweep = String::new();
    // Whether the last look failed: a failure is logged once, not at every look.
    let mut blind = false;
    // Acks left pages free since the last reclaim.
    let mut freed = false;
    // Once a file vanished or was cut: the answer to every request.
    let mut gone: Option<BrokerError> = None;
    loop {
        let watching = gone.is_none() && !wakers.is_empty();
        let keyed = gone.is_none() && claims.is_registered();
        let wait = match watching || keyed {
            true => POLL.saturating_sub(last_look.elapsed()),
            false => RECLAIM_EVERY.min(CHECK_FILES_EVERY),
        };
        let first = match receiver.recv_timeout(wait) {
            Ok(op) => Some(op),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                if gone.is_none()
                    && let Err(e) = keys::leave(&store, &mut conn, claims)
                {
                    tracing::warn!(%e, "embedded broker: deregistering this runner's idempotency claims failed; they stop counting once it exits");
                }
                return;
            }
        };
        if let Some(first) = first {
            let mut ops = vec![first];
            while ops.len() < BATCH {
                match receiver.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(_) => break,
                }
            }
            match &gone {
                Some(e) => ops.into_iter().for_each(|op| fail(op, e.clone())(None)),
                None => {
                    freed |= ops.iter().any(|op| matches!(op, Op::Ack { .. } | Op::CompleteKeys { .. }));
                    serve(&mut conn, &mut store, ops, wakers, &mut watch, claims);
                }
            }
        }
        if (watching || keyed) && last_look.elapsed() >= POLL {
            last_look = Instant::now();
            let looked = match watching {
                true => watch.look(&conn, &store, wakers),
                false => Ok(()),
            };
            match looked.and_then(|()| keys::look(&store, &mut conn, claims, &mut neighbours)) {
                Ok(()) => blind = false,
                Err(e) if !blind => {
                    blind = true;
                    tracing::warn!(%e, "embedded broker: looking for other processes' messages failed; retrying");
                }
                Err(_) => {}
            }
        }
        let reclaim = freed && last_reclaim.elapsed() >= RECLAIM_EVERY;
        // Before a checkpoint too: one copying a cut log into the file would copy garbage.
        if gone.is_none() && (reclaim || last_check.elapsed() >= CHECK_FILES_EVERY) {
            last_check = Instant::now();
            gone = store.broken().map(|broken| store.give_up(&conn, &broken));
            if gone.is_some() {
                // Idle consumers send nothing that would hear of it: each asks once more.
                wakers.watched().iter().for_each(|queue| wakers.wake(queue));
            }
        }
        if gone.is_none() && reclaim {
            last_reclaim = Instant::now();
            freed = false;
            if let Err(e) = keys::expire(&store, &conn, now_ms(), &mut sweep).and_then(|_| store.reclaim(&conn)) {
                tracing::warn!(%e, "embedded broker: reclaiming free pages failed");
            }
            store.empty_log(&conn);
        }
    }
}

/// What a batch's commit makes claimable: queues with ready messages now, and copies that
/// come due later.
#[derive(Default)]
struct Readied {
    now: Vec<String>,
    later: Vec<(String, i64)>,
}

/// Runs a batch: the writes in one transaction, answered after its commit.
fn serve(
    conn: &mut Connection,
    store: &mut Store,
    ops: Vec<Op>,
    wakers: &Wakers,
    watch: &mut Watch,
    claims: &Arc<Claims>,
) {
    store.new_batch();
    let mut ready = Readied::default();
    if !ops.iter().any(Op::writes) {
        for op in ops {
            apply(store, conn, op, &mut ready, claims).0(None);
        }
        return;
    }
    let mut finished = Vec::with_capacity(ops.len());
    let failed = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
        Err(e) => {
            let e = store.error(e);
            finished.extend(ops.into_iter().map(|op| fail(op, e.clone())));
            None
        }
        Ok(tx) => {
            let mut broken = None;
            for op in ops {
                if let Some(e) = &broken {
                    finished.push(fail(op, BrokerError::clone(e)));
                    continue;
                }
                let (done, result) = apply(store, &tx, op, &mut ready, claims);
                // Refusals come before any write; only the store's own errors leave half a request.
                if let Err(e @ BrokerError::Lost(_)) = result {
                    broken = Some(e);
                }
                finished.push(done);
            }
            match broken {
                Some(e) => Some(e),
                None => tx.commit().err().map(|e| store.error(e)),
            }
        }
    };
    if failed.is_some() {
        // What the cache read inside a transaction that did not commit may be gone.
        store.forget();
    }
    for f in finished {
        f(failed.as_ref());
    }
    if failed.is_none() {
        ready.now.sort_unstable();
        ready.now.dedup();
        for queue in ready.now {
            wakers.wake(&queue);
        }
        for (queue, at) in ready.later {
            watch.schedule(&queue, at);
        }
    }
}

/// The answer to a request that could not run.
fn fail(op: Op, e: BrokerError) -> Finish {
    match op {
        Op::Declare(_, reply)
        | Op::Unbind(_, reply)
        | Op::Publish { reply, .. }
        | Op::Copy { reply, .. }
        | Op::Ack { reply, .. }
        | Op::CompleteKeys { reply, .. }
        | Op::ReleaseKey { reply, .. }
        | Op::Release { reply, .. }
        | Op::Renew { reply, .. } => finish(reply, Err(e)),
        Op::Claim { reply, .. } => finish(reply, Err(e)),
        Op::ClaimKey { reply, .. } => finish(reply, Err(e)),
        Op::RegisterKeys(reply) => finish(reply, Err(e)),
        Op::Stats { reply, .. } => finish(reply, Err(e)),
        Op::Limits { reply, .. } => finish(reply, Err(e)),
        Op::Delayed(reply) => finish(reply, Err(e)),
        Op::Drift(_, reply) => finish(reply, Err(e)),
        Op::Leased { reply, .. } => finish(reply, Err(e)),
    }
}

/// The answer to a request that records `keys` done: once committed, their claims are let go
/// of (not before, or a duplicate could be claimed in between).
fn recorded(
    reply: Reply<()>,
    result: Result<(), BrokerError>,
    keys: Vec<String>,
    claims: &Arc<Claims>,
) -> (Finish, Result<(), BrokerError>) {
    let outcome = result.clone();
    let claims = claims.clone();
    let finished = Box::new(move |failed: Option<&BrokerError>| {
        if failed.is_none() && result.is_ok() {
            claims.done(&keys);
        }
        finish(reply, result)(failed);
    });
    (finished, outcome)
}

/// Runs one request, says how it went, and adds to `ready` the queues it gave messages.
fn apply(
    store: &mut Store,
    db: &Connection,
    op: Op,
    ready: &mut Readied,
    claims: &Arc<Claims>,
) -> (Finish, Result<(), BrokerError>) {
    fn done<T: Send + 'static>(reply: Reply<T>, result: Result<T, BrokerError>) -> (Finish, Result<(), BrokerError>) {
        let outcome = result.as_ref().map(drop).map_err(BrokerError::clone);
        (finish(reply, result), outcome)
    }
    match op {
        Op::Declare(plan, reply) => done(reply, store.declare(db, &plan)),
        Op::Unbind(bindings, reply) => done(reply, store.unbind(db, &bindings)),
        Op::Publish { exchange, routing_key, message, reply } => {
            let result = store.publish(db, &exchange, &routing_key, &message);
            if let Ok(targets) = &result {
                ready.now.extend(targets.iter().cloned());
            }
            done(reply, result.map(drop))
        }
        Op::Copy { queue, message, visible_at, reply } => {
            let result = store.copy(db, &queue, &message, visible_at);
            match (&result, visible_at) {
                (Err(_), _) => {}
                (Ok(()), 0) => ready.now.push(queue),
                (Ok(()), _) => ready.later.push((queue, visible_at)),
            }
            done(reply, result)
        }
        Op::Claim { queue, owner, n, bytes, max_body, until, reply } => {
            done(reply, store.claim(db, &queue, owner, n, bytes, max_body, until))
        }
        Op::Ack { owner, ids, done: keys, until, reply } => {
            let result = store.ack(db, owner, &ids).and_then(|()| keys::complete(store, db, &keys, until));
            recorded(reply, result, keys, claims)
        }
        Op::RegisterKeys(reply) => {
            let result = keys::register(store, db, claims);
            let outcome = result.as_ref().map(drop).map_err(BrokerError::clone);
            let claims = claims.clone();
            let registered = Box::new(move |failed: Option<&BrokerError>| {
                if let (None, Ok(mode)) = (failed, &result) {
                    claims.registered(*mode);
                }
                finish(reply, result)(failed);
            });
            (registered, outcome)
        }
        Op::ClaimKey { key, until, reply } => done(reply, keys::claim(store, db, claims, &key, now_ms(), until)),
        Op::CompleteKeys { keys, until, reply } => {
            let result = keys::complete(store, db, &keys, until);
            recorded(reply, result, keys, claims)
        }
        Op::ReleaseKey { key, reply } => done(reply, keys::release(store, db, claims, &key)),
        Op::Release { owner, queue, ids, reply } => {
            let result = store.release(db, owner, &ids);
            if result.is_ok() && !ids.is_empty() {
                ready.now.push(queue);
            }
            done(reply, result)
        }
        // Each renewal (a consumer's start, and every third of the lease) also takes back what
        // consumers of dead processes held.
        Op::Renew { renewals, until, reply } => {
            let result = renewals
                .iter()
                .try_for_each(|r| store.renew(db, r.owner, &r.queue, &r.ids, until, r.registration))
                .and_then(|()| store.release_the_dead(db))
                .map(|queues| ready.now.extend(queues));
            done(reply, result)
        }
        Op::Stats { queue, reply } => done(reply, store.stats(db, &queue)),
        Op::Limits { exchange, routing_key, headers, reply } => {
            done(reply, store.limits(db, &exchange, &routing_key, &headers))
        }
        Op::Delayed(reply) => done(reply, store.delayed(db)),
        Op::Drift(plan, reply) => done(reply, store.drift(db, &plan)),
        // A write: what dead processes held is handed back first, to be read at once.
        Op::Leased { queue, reply } => {
            let result = store.release_the_dead(db).and_then(|queues| {
                ready.now.extend(queues);
                store.leased(db, &queue)
            });
            done(reply, result)
        }
    }
}
