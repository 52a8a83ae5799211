//! The one thread that talks to the file for a broker handle: it takes every request waiting
//! on its channel and runs them in one write transaction (group commit), and answers each only
//! once the transaction has committed. A request refused (a full queue, no route, a conflict)
//! is refused before it writes anything, so the others go on; an error of the store itself
//! fails the whole batch, which is rolled back. SQLite allows one writer at a time anyway; batching is
//! what lets thousands of messages a second through on a few commits.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::{Notify, oneshot};

use super::store::{NewMessage, Store, Stored};
use crate::broker::{BrokerError, Drift, QueueStats};
use crate::topology::Plan;

/// The most requests in one transaction: a bound on how long one commit keeps others waiting.
const BATCH: usize = 512;

/// How often, at most, freed pages are given back.
const RECLAIM_EVERY: Duration = Duration::from_secs(1);

type Reply<T> = oneshot::Sender<Result<T, BrokerError>>;

/// A request to the writer.
pub(super) enum Op {
    Declare(Plan, Reply<()>),
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
    Claim {
        queue: String,
        owner: i64,
        n: u32,
        until: i64,
        reply: Reply<Vec<Stored>>,
    },
    Ack {
        owner: i64,
        ids: Vec<i64>,
        reply: Reply<()>,
    },
    Release {
        owner: i64,
        queue: String,
        ids: Vec<i64>,
        reply: Reply<()>,
    },
    Renew {
        owner: i64,
        queue: String,
        ids: Vec<i64>,
        until: i64,
        register: bool,
        reply: Reply<()>,
    },
    HasReady {
        queue: String,
        reply: Reply<bool>,
    },
    Stats {
        queue: String,
        reply: Reply<QueueStats>,
    },
    Delayed(Reply<u32>),
    Drift(Plan, Reply<Vec<Drift>>),
}

impl Op {
    fn writes(&self) -> bool {
        !matches!(self, Op::HasReady { .. } | Op::Stats { .. } | Op::Delayed(_) | Op::Drift(..))
    }
}

/// One [`Notify`] per queue that has consumers in this process: poked after a commit that made
/// messages ready there, so only that queue's consumers look.
#[derive(Default)]
pub(super) struct Wakers(Mutex<HashMap<String, Arc<Notify>>>);

impl Wakers {
    /// The queue's notifier, made on first use.
    pub fn of(&self, queue: &str) -> Arc<Notify> {
        let mut map = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        map.entry(queue.to_string()).or_default().clone()
    }

    fn wake(&self, queue: &str) {
        let map = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(notify) = map.get(queue) {
            notify.notify_waiters();
        }
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

/// Opens the file and starts the writer thread, which wakes `wakers` after its commits.
pub(super) fn start(path: &Path, wakers: Arc<Wakers>) -> Result<mpsc::Sender<Op>, BrokerError> {
    let (conn, store) = Store::open(path)?;
    let (sender, receiver) = mpsc::channel();
    std::thread::Builder::new()
        .name("sluice-embedded".into())
        .spawn(move || run(conn, store, receiver, &wakers))
        .map_err(|e| BrokerError::Connect { url: path.display().to_string(), reason: e.to_string() })?;
    Ok(sender)
}

/// Serves requests until every sender is gone.
fn run(mut conn: Connection, mut store: Store, receiver: mpsc::Receiver<Op>, wakers: &Wakers) {
    let mut last_reclaim = Instant::now();
    // Acks left pages free since the last reclaim.
    let mut freed = false;
    // Written since the write-ahead log was last emptied.
    let mut logged = false;
    loop {
        let first = match receiver.recv_timeout(RECLAIM_EVERY) {
            Ok(op) => Some(op),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if std::mem::take(&mut logged) {
                    store.empty_log(&conn);
                }
                None
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        logged |= first.is_some();
        if let Some(first) = first {
            let mut ops = vec![first];
            while ops.len() < BATCH {
                match receiver.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(_) => break,
                }
            }
            freed |= ops.iter().any(|op| matches!(op, Op::Ack { .. }));
            serve(&mut conn, &mut store, ops, wakers);
        }
        if freed && last_reclaim.elapsed() >= RECLAIM_EVERY {
            last_reclaim = Instant::now();
            freed = false;
            logged = true;
            if let Err(e) = store.reclaim(&conn) {
                tracing::warn!(%e, "embedded broker: reclaiming free pages failed");
            }
        }
    }
}

/// Runs a batch: the writes in one transaction, answered after its commit.
fn serve(conn: &mut Connection, store: &mut Store, ops: Vec<Op>, wakers: &Wakers) {
    store.new_batch();
    // Queues given ready messages by this batch.
    let mut ready = Vec::new();
    if !ops.iter().any(Op::writes) {
        for op in ops {
            apply(store, conn, op, &mut ready).0(None);
        }
        return;
    }
    let mut finished = Vec::with_capacity(ops.len());
    let failed = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
        Err(e) => {
            finished.extend(ops.into_iter().map(|op| fail(op, store.error(&e))));
            None
        }
        Ok(tx) => {
            let mut broken = None;
            for op in ops {
                if let Some(e) = &broken {
                    finished.push(fail(op, BrokerError::clone(e)));
                    continue;
                }
                let (done, result) = apply(store, &tx, op, &mut ready);
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
        ready.sort_unstable();
        ready.dedup();
        for queue in ready {
            wakers.wake(&queue);
        }
    }
}

/// The answer to a request that could not run.
fn fail(op: Op, e: BrokerError) -> Finish {
    match op {
        Op::Declare(_, reply)
        | Op::Publish { reply, .. }
        | Op::Copy { reply, .. }
        | Op::Ack { reply, .. }
        | Op::Release { reply, .. }
        | Op::Renew { reply, .. } => finish(reply, Err(e)),
        Op::Claim { reply, .. } => finish(reply, Err(e)),
        Op::HasReady { reply, .. } => finish(reply, Err(e)),
        Op::Stats { reply, .. } => finish(reply, Err(e)),
        Op::Delayed(reply) => finish(reply, Err(e)),
        Op::Drift(_, reply) => finish(reply, Err(e)),
    }
}

/// Runs one request, says how it went, and adds to `ready` the queues it gave ready messages.
fn apply(store: &mut Store, db: &Connection, op: Op, ready: &mut Vec<String>) -> (Finish, Result<(), BrokerError>) {
    fn done<T: Send + 'static>(reply: Reply<T>, result: Result<T, BrokerError>) -> (Finish, Result<(), BrokerError>) {
        let outcome = result.as_ref().map(drop).map_err(BrokerError::clone);
        (finish(reply, result), outcome)
    }
    match op {
        Op::Declare(plan, reply) => done(reply, store.declare(db, &plan)),
        Op::Publish { exchange, routing_key, message, reply } => {
            let result = store.publish(db, &exchange, &routing_key, &message);
            if let Ok(targets) = &result {
                ready.extend(targets.iter().cloned());
            }
            done(reply, result.map(drop))
        }
        Op::Copy { queue, message, visible_at, reply } => {
            let result = store.copy(db, &queue, &message, visible_at);
            if result.is_ok() && visible_at == 0 {
                ready.push(queue);
            }
            done(reply, result)
        }
        Op::Claim { queue, owner, n, until, reply } => done(reply, store.claim(db, &queue, owner, n, until)),
        Op::Ack { owner, ids, reply } => done(reply, store.ack(db, owner, &ids)),
        Op::Release { owner, queue, ids, reply } => {
            let result = store.release(db, owner, &ids);
            if result.is_ok() && !ids.is_empty() {
                ready.push(queue);
            }
            done(reply, result)
        }
        Op::Renew { owner, queue, ids, until, register, reply } => {
            done(reply, store.renew(db, owner, &queue, &ids, until, register))
        }
        Op::HasReady { queue, reply } => done(reply, store.has_ready(db, &queue)),
        Op::Stats { queue, reply } => done(reply, store.stats(db, &queue)),
        Op::Delayed(reply) => done(reply, store.delayed(db)),
        Op::Drift(plan, reply) => done(reply, store.drift(db, &plan)),
    }
}
