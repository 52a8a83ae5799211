//! Idempotency keys in the broker's file: the embedded idempotency store. A key is either
//! claimed (a handler runs for it, until its lease ends) or done (handled, until its TTL
//! ends). A runner's completed keys are written in the transaction that acks their messages
//! (see [`Op::Ack`](super::writer::Op)), so a key is done exactly when its message is gone.
//! Their tables, `idempotency` and `key_holders`, are made with the file's others, by the store.
//!
//! Several processes share the file, and so the keys. A claim names its holder (a writer of
//! some process); a claim whose process has died (a `kill -9` mid-handler) no longer counts,
//! so the redelivered message runs at once rather than waiting for the lease to end.
//!
//! Claims cost no write while one holder is alone on the file: each holder that claims keys
//! registers in `key_holders`, and one that finds no other live holder there keeps its claims
//! in memory ([`Claims`]); a claim is then a read of the key's row. A holder that arrives
//! beside it registers as sharing and takes no key until every live holder shares: the one
//! that was alone notices the newcomer within [`POLL`](super::POLL), writes the claims it
//! holds as rows, and from then on claims by rows, until it finds itself alone again. The
//! newcomer's claims meanwhile answer [`Claim::Busy`] (its messages come back a little later).
//! A holder's process, as its claims name it, is its pid, start time and pid namespace
//! ([`process`](super::process::process)), so a killed one's memory claims die with it, and
//! its rows and registration stop counting at once.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use rusqlite::{Connection, OpenFlags, OptionalExtension as _, TransactionBehavior, params};
use tokio::sync::oneshot;

use super::process::{alive, process};
use super::store::{Store, now_ms};
use crate::broker::{BrokerError, Cause};

/// What a claim found: the key table's answer, and every idempotency store's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This worker owns the key until the lease ends: run the handler.
    Claimed,
    /// Already handled successfully within its TTL: a duplicate.
    Done,
    /// Another worker holds a live lease on it.
    Busy,
}

/// Keys a sweep step looks at (see [`expire`]): a million keys are swept in a few minutes of
/// steps, each a bounded pause for the writer.
const SWEEP: i64 = 2_000;

/// How often a holder that shares its claims looks whether it is alone again (a killed
/// neighbour commits nothing that would tell it sooner).
const ALONE_AGAIN_EVERY: i64 = 1_000;

/// How a holder takes keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Not registered yet: no key taken.
    Unregistered,
    /// The only live holder on the file: claims in memory.
    Alone,
    /// Beside other holders: claims are rows too.
    Shared,
}

/// A claim this holder has: when its lease ends, and whether it is a row in the file too.
struct Held {
    until: i64,
    row: bool,
}

struct State {
    mode: Mode,
    keys: HashMap<String, Held>,
    /// The map's size at which expired claims (never completed nor released) are dropped.
    prune_at: usize,
}

/// One writer's holder: its name in the file, its claims (the truth about its own claims,
/// whatever the mode), and a connection of its own to read keys on without the writer.
pub(super) struct Claims {
    holder: String,
    state: Mutex<State>,
    reader: Mutex<Connection>,
    /// Keys waiting for [`Claims::read`]'s next read of the file, each with where its answer
    /// goes.
    pending: Mutex<Vec<(String, Answer)>>,
}

type Answer = oneshot::Sender<Result<Claim, BrokerError>>;

/// What [`Claims::begin`] found.
pub(super) enum Begin {
    /// This holder holds the key already.
    Held,
    /// Registration first.
    Unregistered,
    /// Taken in memory: the key's row is to be read ([`Claims::read`]).
    Alone,
    /// Taken in memory: the writer is to claim it by row.
    Shared,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Claims {
    /// The claims of a new holder on the file at `path`, in this process.
    pub fn open(path: &Path, store: &Store) -> Result<Claims, BrokerError> {
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let reader = Connection::open_with_flags(path, flags)
            .and_then(|db| db.busy_timeout(std::time::Duration::from_secs(5)).map(|()| db))
            .map_err(|e| store.error(e))?;
        Ok(Claims {
            holder: format!("{}:{}", process(), rand::random::<u64>()),
            state: Mutex::new(State { mode: Mode::Unregistered, keys: HashMap::new(), prune_at: 1024 }),
            reader: Mutex::new(reader),
            pending: Mutex::new(Vec::new()),
        })
    }

    /// Takes `key` in memory until `until`, unless this holder holds it already (or is not
    /// registered yet).
    pub fn begin(&self, key: &str, now: i64, until: i64) -> Begin {
        let mut state = lock(&self.state);
        let row = match state.mode {
            Mode::Unregistered => return Begin::Unregistered,
            Mode::Alone => false,
            Mode::Shared => true,
        };
        if state.keys.get(key).is_some_and(|held| held.until > now) {
            return Begin::Held;
        }
        if state.keys.len() >= state.prune_at {
            state.keys.retain(|_, held| held.until > now);
            state.prune_at = (state.keys.len() * 2).max(1024);
        }
        // A row only once the writer has written it (see `Claims::written`).
        state.keys.insert(key.to_string(), Held { until, row: false });
        if row { Begin::Shared } else { Begin::Alone }
    }

    /// The writer took `key` by row.
    pub fn written(&self, key: &str) {
        if let Some(held) = lock(&self.state).keys.get_mut(key) {
            held.row = true;
        }
    }

    /// What the file says of `key`, taken in memory by [`Claims::begin`] while alone: done, a
    /// live claim of another holder, or free. Read on a connection of its own, which in WAL
    /// mode never waits for the writer, together with the keys other claims ask for meanwhile:
    /// the first to ask lets the tasks ready to run ask too, then reads them all in one read
    /// transaction. A transaction's locks cost system calls (a claim's read was 6.5 % of a
    /// drain's samples, most of it in them); its point reads cost little.
    ///
    /// Answers read after a key was taken in memory are as true as answers read at once: while
    /// this holder is alone, no one else writes done keys, and its own completions are written
    /// only for keys it holds, so none of the pending keys.
    pub async fn read(&self, key: &str, now: i64) -> Result<Claim, BrokerError> {
        let (answer, answered) = oneshot::channel();
        let first = {
            let mut pending = lock(&self.pending);
            pending.push((key.to_string(), answer));
            pending.len() == 1
        };
        if first {
            let reading = Reading(self, now);
            tokio::task::yield_now().await;
            drop(reading);
        }
        answered.await.unwrap_or_else(|_| Err(BrokerError::Lost("the read of an idempotency key was dropped".into())))
    }

    /// Reads the pending keys in one read transaction and answers each.
    fn read_pending(&self, now: i64) {
        let pending = std::mem::take(&mut *lock(&self.pending));
        if pending.is_empty() {
            return;
        }
        let mut db = lock(&self.reader);
        let read = |db: &mut Connection, key: &str| -> Result<Claim, BrokerError> {
            let found: Option<(bool, i64, Option<String>)> = db
                .prepare_cached("SELECT done, until, holder FROM idempotency WHERE key = ?1")
                .and_then(|mut s| s.query_row([key], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).optional())
                .map_err(read_failed)?;
            Ok(verdict(found, now, &self.holder).unwrap_or(Claim::Claimed))
        };
        // One key is one statement's own transaction; more share a deferred one (a read).
        let together = pending.len() > 1 && db.execute_batch("BEGIN DEFERRED").is_ok();
        for (key, answer) in pending {
            let _ = answer.send(read(&mut db, &key));
        }
        // A read that stayed open would show every later read this snapshot.
        if together && let Err(e) = db.execute_batch("COMMIT").or_else(|_| db.execute_batch("ROLLBACK")) {
            tracing::warn!(error = %e, "ending a read of idempotency keys failed");
        }
    }

    /// Lets go of `key` in memory; whether it may be a row of this holder's in the file.
    pub fn forget(&self, key: &str) -> bool {
        lock(&self.state).keys.remove(key).is_none_or(|held| held.row)
    }

    /// Lets go of keys recorded done (their rows, if any, are done rows now).
    pub fn done(&self, keys: &[String]) {
        let mut state = lock(&self.state);
        for key in keys {
            state.keys.remove(key);
        }
    }

    /// Whether the holder is registered (the writer looks at its neighbours then).
    pub fn is_registered(&self) -> bool {
        lock(&self.state).mode != Mode::Unregistered
    }

    /// The holder's registration committed, as `mode`.
    pub fn registered(&self, mode: Mode) {
        let mut state = lock(&self.state);
        if state.mode == Mode::Unregistered {
            state.mode = mode;
        }
    }

    #[cfg(test)]
    pub fn mode(&self) -> Mode {
        lock(&self.state).mode
    }
}

/// The first of a read's keys: reads them all once the tasks ready to run have added theirs,
/// or when dropped (its task ended first), so no key waits for a read that never comes.
struct Reading<'a>(&'a Claims, i64);

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.0.read_pending(self.1);
    }
}

/// What a key's row (done, until, holder) says to `holder` at `now`, if it says anything:
/// done, or a live claim of another holder. Its own rows say nothing: its memory knows.
fn verdict(found: Option<(bool, i64, Option<String>)>, now: i64, holder: &str) -> Option<Claim> {
    match found? {
        (true, ends, _) if ends > now => Some(Claim::Done),
        (false, ends, Some(other)) if ends > now && other != holder && alive(&other) => Some(Claim::Busy),
        _ => None,
    }
}

/// Registers `claims`' holder, in the writer's transaction: alone (claims in memory) when no
/// other live holder is registered, else sharing (claims as rows). The mode counts once the
/// transaction has committed ([`Claims::registered`]).
pub(super) fn register(store: &Store, db: &Connection, claims: &Claims) -> Result<Mode, BrokerError> {
    let mode = lock(&claims.state).mode;
    if mode != Mode::Unregistered {
        return Ok(mode);
    }
    let mode = match others(store, db, &claims.holder)?.is_empty() {
        true => Mode::Alone,
        false => Mode::Shared,
    };
    db.prepare_cached("INSERT OR REPLACE INTO key_holders (holder, shared) VALUES (?1, ?2)")
        .and_then(|mut s| s.execute(params![claims.holder, mode == Mode::Shared]))
        .map_err(|e| store.error(e))?;
    Ok(mode)
}

/// The other live holders registered, each with whether it shares its claims; the dead ones'
/// registrations are deleted.
fn others(store: &Store, db: &Connection, holder: &str) -> Result<Vec<(String, bool)>, BrokerError> {
    let all: Vec<(String, bool)> = db
        .prepare_cached("SELECT holder, shared FROM key_holders WHERE holder != ?1")
        .and_then(|mut s| s.query_map([holder], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
        .map_err(|e| store.error(e))?;
    let (live, dead): (Vec<_>, Vec<_>) = all.into_iter().partition(|(other, _)| alive(other));
    for (other, _) in dead {
        db.prepare_cached("DELETE FROM key_holders WHERE holder = ?1")
            .and_then(|mut s| s.execute([other]))
            .map_err(|e| store.error(e))?;
    }
    Ok(live)
}

/// What the writer last saw of the other holders.
#[derive(Default)]
pub(super) struct Neighbours {
    version: Option<i64>,
    looked: i64,
}

/// Looks whether `claims`' holder is still alone, or alone again: when another holder
/// registered beside one alone, its claims are written as rows and it shares from then on;
/// when the others are gone, it is alone again. Each switch is one transaction, with the
/// claims locked, so no claim is taken in memory once a neighbour may look at rows.
pub(super) fn look(
    store: &Store,
    db: &mut Connection,
    claims: &Claims,
    seen: &mut Neighbours,
) -> Result<(), BrokerError> {
    let now = now_ms();
    let version = store.data_version(db)?;
    let changed = seen.version.replace(version) != Some(version);
    let due = match lock(&claims.state).mode {
        Mode::Unregistered => false,
        Mode::Alone => changed,
        Mode::Shared => changed || now - seen.looked >= ALONE_AGAIN_EVERY,
    };
    if !due {
        return Ok(());
    }
    seen.looked = now;
    let alone = |db: &Connection| -> Result<bool, BrokerError> {
        let holders: Vec<String> = db
            .prepare_cached("SELECT holder FROM key_holders WHERE holder != ?1")
            .and_then(|mut s| s.query_map([&claims.holder], |r| r.get(0))?.collect())
            .map_err(|e| store.error(e))?;
        Ok(!holders.iter().any(|other| alive(other)))
    };
    let switch = |mode: Mode, alone: bool| matches!((mode, alone), (Mode::Alone, false) | (Mode::Shared, true));
    if !switch(lock(&claims.state).mode, alone(db)?) {
        return Ok(());
    }
    let mut state = lock(&claims.state);
    let tx = db.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| store.error(e))?;
    let alone = others(store, &tx, &claims.holder)?.is_empty();
    if !switch(state.mode, alone) {
        return tx.commit().map_err(|e| store.error(e));
    }
    let mode = match state.mode {
        Mode::Alone => {
            for (key, held) in &mut state.keys {
                if held.until <= now {
                    continue;
                }
                let found: Option<(bool, i64, Option<String>)> = tx
                    .prepare_cached("SELECT done, until, holder FROM idempotency WHERE key = ?1")
                    .and_then(|mut s| s.query_row([key], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).optional())
                    .map_err(|e| store.error(e))?;
                // Done, or another's: a claim about to be given up (see `Claims::read`).
                if verdict(found, now, &claims.holder).is_some() {
                    continue;
                }
                write_claim(store, &tx, key, held.until, &claims.holder)?;
                held.row = true;
            }
            Mode::Shared
        }
        _ => Mode::Alone,
    };
    let switched = tx
        .prepare_cached("UPDATE key_holders SET shared = ?2 WHERE holder = ?1")
        .and_then(|mut s| s.execute(params![claims.holder, mode == Mode::Shared]))
        .and_then(|_| tx.commit());
    match switched {
        Ok(()) => state.mode = mode,
        Err(e) => {
            // Rows this transaction wrote are gone with it: say so, or a release would skip them.
            let shared = state.mode == Mode::Shared;
            for held in state.keys.values_mut() {
                held.row &= shared;
            }
            return Err(store.error(e));
        }
    }
    Ok(())
}

/// Deregisters `claims`' holder, with the claims it still holds: its writer stops.
pub(super) fn leave(store: &Store, db: &mut Connection, claims: &Claims) -> Result<(), BrokerError> {
    if lock(&claims.state).mode == Mode::Unregistered {
        return Ok(());
    }
    let tx = db.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| store.error(e))?;
    tx.execute("DELETE FROM key_holders WHERE holder = ?1", [&claims.holder])
        .and_then(|_| tx.execute("DELETE FROM idempotency WHERE holder = ?1 AND done = 0", [&claims.holder]))
        .and_then(|_| tx.commit())
        .map_err(|e| store.error(e))
}

fn write_claim(store: &Store, db: &Connection, key: &str, until: i64, holder: &str) -> Result<(), BrokerError> {
    db.prepare_cached("INSERT OR REPLACE INTO idempotency (key, done, until, holder) VALUES (?1, 0, ?2, ?3)")
        .and_then(|mut s| s.execute(params![key, until, holder]))
        .map_err(|e| store.error(e))?;
    Ok(())
}

/// Takes `key` by row for `claims`' holder (sharing) until `until`, unless it is done, a live
/// claim of another holder's, or some live holder still keeps its claims in memory.
pub(super) fn claim(
    store: &Store,
    db: &Connection,
    claims: &Claims,
    key: &str,
    now: i64,
    until: i64,
) -> Result<Claim, BrokerError> {
    let found: Option<(bool, i64, Option<String>)> = db
        .prepare_cached("SELECT done, until, holder FROM idempotency WHERE key = ?1")
        .and_then(|mut s| s.query_row([key], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).optional())
        .map_err(|e| store.error(e))?;
    if let Some(verdict) = verdict(found, now, &claims.holder) {
        return Ok(verdict);
    }
    // A holder alone a moment ago has not written its claims yet: any key may be one of them.
    if others(store, db, &claims.holder)?.iter().any(|(_, shared)| !shared) {
        return Ok(Claim::Busy);
    }
    write_claim(store, db, key, until, &claims.holder)?;
    Ok(Claim::Claimed)
}

/// Records `keys` done until `until`.
pub(super) fn complete(store: &Store, db: &Connection, keys: &[String], until: i64) -> Result<(), BrokerError> {
    let mut s = db
        .prepare_cached("INSERT OR REPLACE INTO idempotency (key, done, until, holder) VALUES (?1, 1, ?2, NULL)")
        .map_err(|e| store.error(e))?;
    for key in keys {
        s.execute(params![key, until]).map_err(|e| store.error(e))?;
    }
    Ok(())
}

/// Deletes `claims`' holder's row claiming `key` (a done key, or another's claim, stays).
pub(super) fn release(store: &Store, db: &Connection, claims: &Claims, key: &str) -> Result<(), BrokerError> {
    db.prepare_cached("DELETE FROM idempotency WHERE key = ?1 AND done = 0 AND holder = ?2")
        .and_then(|mut s| s.execute(params![key, claims.holder]))
        .map_err(|e| store.error(e))?;
    Ok(())
}

/// One step of the sweep that deletes keys whose lease or TTL has ended: the next [`SWEEP`]
/// keys after `cursor` (in key order; empty: from the start), which moves on, back to the
/// start after the last key. How many were deleted.
pub(super) fn expire(store: &Store, db: &Connection, now: i64, cursor: &mut String) -> Result<usize, BrokerError> {
    let rows: Vec<(String, i64)> = db
        .prepare_cached("SELECT key, until FROM idempotency WHERE key > ?1 ORDER BY key LIMIT ?2")
        .and_then(|mut s| s.query_map(params![cursor.as_str(), SWEEP], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
        .map_err(|e| store.error(e))?;
    *cursor = match rows.last() {
        Some((key, _)) if rows.len() as i64 == SWEEP => key.clone(),
        _ => String::new(),
    };
    let mut delete =
        db.prepare_cached("DELETE FROM idempotency WHERE key = ?1 AND until <= ?2").map_err(|e| store.error(e))?;
    let mut deleted = 0;
    for (key, until) in rows {
        if until <= now {
            deleted += delete.execute(params![key, now]).map_err(|e| store.error(e))?;
        }
    }
    Ok(deleted)
}

/// A failed read of the keys: a file SQLite no longer takes for a database was changed under
/// this process (its write-ahead log cut or replaced: the reader may meet it before the
/// writer's look at the files does), which no retry mends; anything else may pass.
fn read_failed(e: rusqlite::Error) -> BrokerError {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase | rusqlite::ErrorCode::DatabaseCorrupt) => {
            BrokerError::Damaged(Cause::from_error(e).within(
                "the embedded broker's idempotency keys cannot be read: its write-ahead log or file was truncated or replaced while in use (only sluice may change the broker's files while it runs). Stopped: start sluice again",
            ))
        }
        _ => BrokerError::Lost(Cause::from_error(e).within("embedded idempotency store")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key read that meets a file SQLite takes for no database (its log cut under the
    /// runner: CI met it before the writer's look at the files did) is damage, which ends the
    /// run; another failure may pass.
    #[test]
    fn a_read_of_a_file_that_is_no_database_is_damage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let garbage = dir.path().join("broker.db");
        std::fs::write(&garbage, vec![0x5a; 8192]).expect("write");
        let db = Connection::open(&garbage).expect("open");
        let e = db.prepare("SELECT done FROM idempotency").expect_err("not a database");
        let error = read_failed(e);
        assert!(error.is_damaged(), "{error}");
        assert!(error.to_string().contains("truncated or replaced while in use"), "{error}");
        assert!(error.to_string().contains("start sluice again"), "{error}");

        let db = Connection::open_in_memory().expect("open");
        let e = db.prepare("SELECT done FROM idempotency").expect_err("no such table");
        assert!(!read_failed(e).is_damaged());
    }
}
