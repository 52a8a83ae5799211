//! Idempotency keys in the broker's file: the embedded idempotency store. A key is either
//! claimed (a handler runs for it, until its lease ends) or done (handled, until its TTL
//! ends). A runner's completed keys are written in the transaction that acks their messages
//! (see [`Op::Ack`](super::writer::Op)), so a key is done exactly when its message is gone.
//!
//! Several processes share the file, and so the keys. A claim names its holder, the process
//! that took it; a claim whose holder has died (a `kill -9` mid-handler) no longer counts, so
//! the redelivered message runs at once rather than waiting for the lease to end.

use std::sync::OnceLock;

use rusqlite::{Connection, OptionalExtension as _, params};

use super::store::Store;
use crate::broker::BrokerError;
use crate::dedup::Claim;

/// The keys' table; `until` is when a claim's lease or a done key's TTL ends (ms). No index on
/// `until`: it would cost every claim and completion a second B-tree write; expired keys are
/// found by a sweep in key order instead ([`expire`]).
pub(super) const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS idempotency (key TEXT PRIMARY KEY,
         done INTEGER NOT NULL, until INTEGER NOT NULL, holder TEXT) WITHOUT ROWID;
     DROP INDEX IF EXISTS idempotency_until;";

/// Keys a sweep step looks at (see [`expire`]): a million keys are swept in a few minutes of
/// steps, each a bounded pause for the writer.
const SWEEP: i64 = 2_000;

/// This process, as a claim names it: its pid and its start time (pids are reused).
pub(super) fn holder() -> &'static str {
    static HOLDER: OnceLock<String> = OnceLock::new();
    HOLDER.get_or_init(|| {
        let pid = std::process::id();
        format!("{pid}:{}", started(pid).unwrap_or_default())
    })
}

/// A process's start time (clock ticks since boot, `/proc/PID/stat` field 22), where the
/// system says.
fn started(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name (field 2) is in parentheses and may hold spaces: count after its end.
    stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process a claim names still runs. Where that cannot be known (no `/proc`: the
/// holder was written without a start time), it counts as alive: its claim holds until the
/// lease ends.
fn alive(holder: &str) -> bool {
    let Some((pid, start)) = holder.split_once(':').and_then(|(p, s)| Some((p.parse().ok()?, s.parse().ok()?))) else {
        return true;
    };
    started(pid) == Some(start)
}

/// Takes `key` for this process until `until`, unless it is done or a live process's lease
/// on it runs.
pub(super) fn claim(store: &Store, db: &Connection, key: &str, now: i64, until: i64) -> Result<Claim, BrokerError> {
    let found: Option<(bool, i64, Option<String>)> = db
        .prepare_cached("SELECT done, until, holder FROM idempotency WHERE key = ?1")
        .and_then(|mut s| s.query_row([key], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).optional())
        .map_err(|e| store.error(e))?;
    match found {
        Some((true, ends, _)) if ends > now => return Ok(Claim::Done),
        // This process's own claim is busy too: another of its handlers runs for the key.
        Some((false, ends, Some(other))) if ends > now && (other == holder() || alive(&other)) => {
            return Ok(Claim::Busy);
        }
        _ => {}
    }
    db.prepare_cached("INSERT OR REPLACE INTO idempotency (key, done, until, holder) VALUES (?1, 0, ?2, ?3)")
        .and_then(|mut s| s.execute(params![key, until, holder()]))
        .map_err(|e| store.error(e))?;
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

/// Gives up this process's claim on `key` (a done key, or another's claim, stays).
pub(super) fn release(store: &Store, db: &Connection, key: &str) -> Result<(), BrokerError> {
    db.prepare_cached("DELETE FROM idempotency WHERE key = ?1 AND done = 0 AND holder = ?2")
        .and_then(|mut s| s.execute(params![key, holder()]))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_made_up_one_is_not() {
        assert!(alive(holder()), "{}", holder());
        let (pid, start) = holder().split_once(':').expect("pid:start");
        assert!(!alive(&format!("{pid}:{}", start.parse::<u64>().expect("start") + 1)), "a reused pid");
        assert!(!alive(&format!("{}:1", u32::MAX)), "no such pid");
        assert!(alive("not a holder"), "unknown forms hold until the lease ends");
    }
}
