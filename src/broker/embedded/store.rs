//! The embedded broker's SQL: the schema, and each operation as statements on one open
//! transaction. Rows read from the file are checked: a corrupted row is an error, never a
//! panic.
//!
//! A message is ready when `visible_at` is 0 (published, handed back) or past (a delayed copy
//! come due, a lease run out); claiming one sets `visible_at` to the lease's end and names
//! its owner, so a consumer that dies without settling simply lets it come due again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rusqlite::{Connection, OptionalExtension as _, params};
use serde_json::Value;

use super::super::{BrokerError, Drift, HeaderValue, Headers, QueueStats, route};
use crate::config::ExchangeKind;
use crate::topology::Plan;

/// How long a writer waits for another process's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The size the write-ahead log is cut back to once a checkpoint has emptied it: about what
/// SQLite's automatic checkpoint (every 1,000 pages) lets it grow to.
pub const WAL_LIMIT: i64 = 4 << 20;

/// Milliseconds since the epoch: the clock of `visible_at` and lease ends.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Milliseconds of a duration, saturating.
pub(super) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A message to write.
#[derive(Debug, Clone)]
pub(super) struct NewMessage {
    pub body: Bytes,
    pub headers: Headers,
    pub message_id: Option<String>,
    pub kind: Option<String>,
    pub timestamp: Option<u64>,
}

/// A message claimed from the file.
#[derive(Debug)]
pub(super) struct Stored {
    pub id: i64,
    pub message: NewMessage,
}

/// The declarations routing needs, cached until a declare (by any process) bumps the version.
#[derive(Default)]
struct Topology {
    version: i64,
    exchanges: HashMap<String, ExchangeKind>,
    queues: HashMap<String, QueueRule>,
    bindings: Vec<(String, String, String, BTreeMap<String, Value>)>,
}

/// What the store enforces of a queue's declaration.
struct QueueRule {
    max_length: Option<u64>,
    single_active_consumer: bool,
}

/// The statements on a store, and what they cache; the connection stays the caller's, so a
/// transaction on it and these can be used together.
pub(super) struct Store {
    path: String,
    topology: Option<Topology>,
    /// Ready messages of the queues with `max_length` that this batch published to: counted
    /// once per batch, then kept up to date by its inserts and claims.
    ready_counts: HashMap<String, u64>,
}

fn kind_from(text: &str) -> Option<ExchangeKind> {
    [ExchangeKind::Direct, ExchangeKind::Fanout, ExchangeKind::Topic, ExchangeKind::Headers]
        .into_iter()
        .find(|k| k.as_str() == text)
}

/// Headers as the JSON text the file keeps.
fn headers_text(headers: &Headers) -> String {
    let map: serde_json::Map<String, Value> = headers
        .iter()
        .map(|(k, v)| {
            let v = match v {
                HeaderValue::Str(s) => Value::from(s.as_str()),
                HeaderValue::Int(i) => Value::from(*i),
            };
            (k.clone(), v)
        })
        .collect();
    Value::Object(map).to_string()
}

fn headers_from(text: &str) -> Result<Headers, String> {
    let Value::Object(map) = serde_json::from_str(text).map_err(|e| format!("headers: {e}"))? else {
        return Err("headers: not a JSON object".into());
    };
    map.into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, HeaderValue::Str(s))),
            Value::Number(n) => {
                n.as_i64().map(|i| (k.clone(), HeaderValue::Int(i))).ok_or(format!("header \"{k}\": {n}"))
            }
            other => Err(format!("header \"{k}\": {other}")),
        })
        .collect()
}

impl Store {
    /// Opens (creating) the file: WAL, `synchronous=NORMAL`, incremental auto-vacuum, the schema.
    pub fn open(path: &Path) -> Result<(Connection, Store), BrokerError> {
        let shown = path.display().to_string();
        let fail = |e: &dyn std::fmt::Display| BrokerError::Connect { url: shown.clone(), reason: e.to_string() };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| fail(&e))?;
        }
        let mut conn = Connection::open(path).map_err(|e| fail(&e))?;
        conn.busy_timeout(BUSY_TIMEOUT).map_err(|e| fail(&e))?;
        // auto_vacuum takes effect only before the first table: on a new file.
        conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL;").map_err(|e| fail(&e))?;
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0)).map_err(|e| fail(&e))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(fail(&format!("journal mode is {mode}, not wal")));
        }
        conn.execute_batch("PRAGMA synchronous = NORMAL;").map_err(|e| fail(&e))?;
        // Without a limit the write-ahead log keeps the size of its largest batch of pages
        // until the last connection closes; with it, each restart after a checkpoint cuts it.
        conn.pragma_update(None, "journal_size_limit", WAL_LIMIT).map_err(|e| fail(&e))?;
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).map_err(|e| fail(&e))?;
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
             INSERT OR IGNORE INTO meta (key, value) VALUES ('topology', 0);
             CREATE TABLE IF NOT EXISTS exchanges (name TEXT PRIMARY KEY, kind TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS queues (name TEXT PRIMARY KEY, declaration TEXT NOT NULL,
                 max_length INTEGER, single_active INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS bindings (exchange TEXT NOT NULL, queue TEXT NOT NULL,
                 routing_key TEXT NOT NULL, arguments TEXT NOT NULL,
                 PRIMARY KEY (exchange, queue, routing_key, arguments));
             CREATE TABLE IF NOT EXISTS messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
                 queue TEXT NOT NULL, visible_at INTEGER NOT NULL, lease_owner INTEGER,
                 body BLOB NOT NULL, headers TEXT NOT NULL, message_id TEXT, kind TEXT,
                 timestamp INTEGER);
             CREATE INDEX IF NOT EXISTS messages_due ON messages (queue, visible_at, id);
             CREATE TABLE IF NOT EXISTS consumers (owner INTEGER PRIMARY KEY, queue TEXT NOT NULL,
                 until INTEGER NOT NULL, since INTEGER NOT NULL);",
        )
        .map_err(|e| fail(&e))?;
        tx.commit().map_err(|e| fail(&e))?;
        Ok((conn, Store { path: shown, topology: None, ready_counts: HashMap::new() }))
    }

    /// Drops the cached declarations (read in a transaction that did not commit).
    pub fn forget(&mut self) {
        self.topology = None;
        self.ready_counts.clear();
    }

    /// Starts a batch: counts from another transaction may be stale.
    pub fn new_batch(&mut self) {
        self.ready_counts.clear();
    }

    /// An SQLite error as the broker's.
    pub fn error(&self, e: impl std::fmt::Display) -> BrokerError {
        BrokerError::Lost(format!("embedded broker {}: {e}", self.path))
    }

    /// Reloads the cached declarations if a declare changed them since.
    fn refresh(&mut self, db: &Connection) -> Result<(), BrokerError> {
        let version: i64 = db
            .prepare_cached("SELECT value FROM meta WHERE key = 'topology'")
            .and_then(|mut s| s.query_row([], |r| r.get(0)))
            .map_err(|e| self.error(e))?;
        if self.topology.as_ref().is_some_and(|t| t.version == version) {
            return Ok(());
        }
        let load = || -> Result<Topology, String> {
            let mut t = Topology { version, ..Topology::default() };
            let mut s = db.prepare("SELECT name, kind FROM exchanges").map_err(|e| e.to_string())?;
            let rows = s.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)));
            for row in rows.map_err(|e| e.to_string())? {
                let (name, kind) = row.map_err(|e| e.to_string())?;
                let kind = kind_from(&kind).ok_or(format!("exchange \"{name}\": unknown type \"{kind}\""))?;
                t.exchanges.insert(name, kind);
            }
            let mut s = db.prepare("SELECT name, max_length, single_active FROM queues").map_err(|e| e.to_string())?;
            let rows =
                s.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?, r.get::<_, bool>(2)?)));
            for row in rows.map_err(|e| e.to_string())? {
                let (name, max, single_active_consumer) = row.map_err(|e| e.to_string())?;
                let max_length =
                    max.map(u64::try_from).transpose().map_err(|_| format!("queue \"{name}\": max_length"))?;
                t.queues.insert(name, QueueRule { max_length, single_active_consumer });
            }
            let mut s = db
                .prepare("SELECT exchange, queue, routing_key, arguments FROM bindings")
                .map_err(|e| e.to_string())?;
            let rows = s.query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?, r.get::<_, String>(3)?))
            });
            for row in rows.map_err(|e| e.to_string())? {
                let (exchange, queue, key, args) = row.map_err(|e| e.to_string())?;
                let args = serde_json::from_str(&args).map_err(|e| format!("binding arguments: {e}"))?;
                t.bindings.push((exchange, queue, key, args));
            }
            Ok(t)
        };
        let topology = load().map_err(|e| self.error(e))?;
        self.topology = Some(topology);
        Ok(())
    }

    /// Declares a plan: checks everything first (a conflict changes nothing), then creates
    /// what is missing.
    pub fn declare(&self, db: &Connection, plan: &Plan) -> Result<(), BrokerError> {
        let e = |err| self.error(err);
        if let Some(Drift::Conflict { what, name, detail }) =
            self.drift(db, plan)?.into_iter().find(|d| matches!(d, Drift::Conflict { .. }))
        {
            return Err(BrokerError::Conflict(format!("{what} \"{name}\" conflicts with what exists: {detail}")));
        }
        for x in &plan.exchanges {
            db.execute(
                "INSERT OR IGNORE INTO exchanges (name, kind) VALUES (?1, ?2)",
                params![x.name, x.kind.as_str()],
            )
            .map_err(e)?;
        }
        for q in &plan.queues {
            let declared = serde_json::to_string(q).map_err(|err| self.error(err))?;
            let max = q.max_length.map(|m| i64::try_from(m).unwrap_or(i64::MAX));
            db.execute(
                "INSERT OR IGNORE INTO queues (name, declaration, max_length, single_active)
                 VALUES (?1, ?2, ?3, ?4)",
                params![q.name, declared, max, q.single_active_consumer],
            )
            .map_err(e)?;
        }
        for b in &plan.bindings {
            let args = serde_json::to_string(&b.arguments).map_err(|err| self.error(err))?;
            db.execute(
                "INSERT OR IGNORE INTO bindings (exchange, queue, routing_key, arguments) VALUES (?1, ?2, ?3, ?4)",
                params![b.exchange, b.queue, b.routing_key, args],
            )
            .map_err(e)?;
        }
        db.execute("UPDATE meta SET value = value + 1 WHERE key = 'topology'", []).map_err(e)?;
        Ok(())
    }

    /// Routes a message and writes one copy into each queue it reaches, or nothing at all;
    /// returns the queues.
    pub fn publish(
        &mut self,
        db: &Connection,
        exchange: &str,
        routing_key: &str,
        message: &NewMessage,
    ) -> Result<Vec<String>, BrokerError> {
        self.refresh(db)?;
        let Some(topology) = &self.topology else { return Err(self.error("no topology")) };
        let targets: BTreeSet<&str> = if exchange.is_empty() {
            topology.queues.keys().filter(|q| *q == routing_key).map(String::as_str).collect()
        } else {
            let kind = *topology
                .exchanges
                .get(exchange)
                .ok_or_else(|| BrokerError::NotFound(format!("exchange \"{exchange}\"")))?;
            topology
                .bindings
                .iter()
                .filter(|(x, _, key, args)| {
                    x == exchange && route::routes(kind, key, args, routing_key, &message.headers)
                })
                .map(|(_, q, _, _)| q.as_str())
                .collect()
        };
        if targets.is_empty() {
            return Err(BrokerError::Unroutable { exchange: exchange.into(), routing_key: routing_key.into() });
        }
        let targets: Vec<String> = targets.into_iter().map(String::from).collect();
        for queue in &targets {
            self.check_room(db, exchange, queue)?;
        }
        for queue in &targets {
            self.insert(db, queue, message, 0)?;
        }
        Ok(targets)
    }

    /// Writes one copy into `queue`, visible from `visible_at` (0: at once).
    pub fn copy(
        &mut self,
        db: &Connection,
        queue: &str,
        message: &NewMessage,
        visible_at: i64,
    ) -> Result<(), BrokerError> {
        self.refresh(db)?;
        self.check_room(db, "", queue)?;
        self.insert(db, queue, message, visible_at)
    }

    /// A queue with `max_length` refuses a message once it holds that many ready ones
    /// (RabbitMQ's reject-publish).
    fn check_room(&mut self, db: &Connection, exchange: &str, queue: &str) -> Result<(), BrokerError> {
        let Some(topology) = &self.topology else { return Err(self.error("no topology")) };
        let rule = topology.queues.get(queue).ok_or_else(|| BrokerError::NotFound(format!("queue \"{queue}\"")))?;
        let Some(max) = rule.max_length else { return Ok(()) };
        let ready = match self.ready_counts.get(queue) {
            Some(n) => *n,
            None => {
                let n = u64::from(self.ready(db, queue)?);
                self.ready_counts.insert(queue.to_string(), n);
                n
            }
        };
        if ready >= max {
            return Err(BrokerError::Nacked { exchange: exchange.into() });
        }
        Ok(())
    }

    fn insert(&mut self, db: &Connection, queue: &str, m: &NewMessage, visible_at: i64) -> Result<(), BrokerError> {
        if visible_at <= now_ms()
            && let Some(n) = self.ready_counts.get_mut(queue)
        {
            *n += 1;
        }
        let timestamp = m.timestamp.map(|t| i64::try_from(t).unwrap_or(i64::MAX));
        db.prepare_cached(
            "INSERT INTO messages (queue, visible_at, body, headers, message_id, kind, timestamp)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )
        .and_then(|mut s| {
            s.execute(params![
                queue,
                visible_at,
                &m.body[..],
                headers_text(&m.headers),
                m.message_id,
                m.kind,
                timestamp
            ])
        })
        .map_err(|e| self.error(e))?;
        Ok(())
    }

    /// Leases up to `n` ready messages of `queue` to `owner` until `until`, oldest first; none
    /// to a consumer that is not the active one of a single-active-consumer queue (the live
    /// one registered first).
    pub fn claim(
        &mut self,
        db: &Connection,
        queue: &str,
        owner: i64,
        n: u32,
        until: i64,
    ) -> Result<Vec<Stored>, BrokerError> {
        self.refresh(db)?;
        let e = |err| self.error(err);
        let single = self.topology.as_ref().and_then(|t| t.queues.get(queue)).is_some_and(|q| q.single_active_consumer);
        if single {
            let active: Option<i64> = db
                .prepare_cached("SELECT owner FROM consumers WHERE queue = ?1 AND until > ?2 ORDER BY since LIMIT 1")
                .and_then(|mut s| s.query_row(params![queue, now_ms()], |r| r.get(0)).optional())
                .map_err(e)?;
            if active != Some(owner) {
                return Ok(Vec::new());
            }
        }
        // What came due (delayed copies, run-out leases) becomes plainly ready, in id order.
        db.prepare_cached(
            "UPDATE messages SET visible_at = 0, lease_owner = NULL
             WHERE queue = ?1 AND visible_at > 0 AND visible_at <= ?2",
        )
        .and_then(|mut s| s.execute(params![queue, now_ms()]))
        .map_err(e)?;
        let mut s = db
            .prepare_cached(
                "UPDATE messages SET visible_at = ?3, lease_owner = ?4
                 WHERE id IN (SELECT id FROM messages WHERE queue = ?1 AND visible_at = 0 ORDER BY id LIMIT ?2)
                 RETURNING id, body, headers, message_id, kind, timestamp",
            )
            .map_err(e)?;
        let rows = s
            .query_map(params![queue, n, until, owner], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, Option<String>>(3)?,
                    r.get::<_, Option<String>>(4)?,
                    r.get::<_, Option<i64>>(5)?,
                ))
            })
            .map_err(e)?;
        let mut claimed = Vec::new();
        for row in rows {
            let (id, body, headers, message_id, kind, timestamp) = row.map_err(e)?;
            let headers = headers_from(&headers).map_err(|err| self.error(format!("message {id}: {err}")))?;
            let timestamp = timestamp
                .map(u64::try_from)
                .transpose()
                .map_err(|_| self.error(format!("message {id}: negative timestamp")))?;
            claimed
                .push(Stored { id, message: NewMessage { body: body.into(), headers, message_id, kind, timestamp } });
        }
        claimed.sort_by_key(|s| s.id);
        if let Some(n) = self.ready_counts.get_mut(queue) {
            *n = n.saturating_sub(claimed.len() as u64);
        }
        Ok(claimed)
    }

    /// Removes settled messages still leased to `owner`.
    pub fn ack(&self, db: &Connection, owner: i64, ids: &[i64]) -> Result<(), BrokerError> {
        let mut s =
            db.prepare_cached("DELETE FROM messages WHERE id = ?1 AND lease_owner = ?2").map_err(|e| self.error(e))?;
        for id in ids {
            s.execute(params![id, owner]).map_err(|e| self.error(e))?;
        }
        Ok(())
    }

    /// Hands `owner`'s messages back, ready at once in their old places.
    pub fn release(&mut self, db: &Connection, owner: i64, ids: &[i64]) -> Result<(), BrokerError> {
        self.ready_counts.clear();
        let mut s = db
            .prepare_cached("UPDATE messages SET visible_at = 0, lease_owner = NULL WHERE id = ?1 AND lease_owner = ?2")
            .map_err(|e| self.error(e))?;
        for id in ids {
            s.execute(params![id, owner]).map_err(|e| self.error(e))?;
        }
        Ok(())
    }

    /// Extends `owner`'s leases to `until`, and its consumer's registration while `register`
    /// (else removes it: a cancelled or closed consumer no longer counts).
    pub fn renew(
        &self,
        db: &Connection,
        owner: i64,
        queue: &str,
        ids: &[i64],
        until: i64,
        register: bool,
    ) -> Result<(), BrokerError> {
        let e = |err| self.error(err);
        if register {
            // Registrations of consumers that died unclosed (their lease ran out) go.
            db.prepare_cached("DELETE FROM consumers WHERE until <= ?1")
                .and_then(|mut s| s.execute([now_ms()]))
                .map_err(e)?;
            db.execute(
                "INSERT INTO consumers (owner, queue, until, since)
                 VALUES (?1, ?2, ?3, (SELECT coalesce(max(since), 0) + 1 FROM consumers))
                 ON CONFLICT (owner) DO UPDATE SET until = excluded.until",
                params![owner, queue, until],
            )
            .map_err(e)?;
        } else {
            db.execute("DELETE FROM consumers WHERE owner = ?1", [owner]).map_err(e)?;
        }
        let mut s =
            db.prepare_cached("UPDATE messages SET visible_at = ?3 WHERE id = ?1 AND lease_owner = ?2").map_err(e)?;
        for id in ids {
            s.execute(params![id, owner, until]).map_err(e)?;
        }
        Ok(())
    }

    /// Ready messages of `queue` (leased ones and delayed copies not yet due excluded).
    pub fn ready(&self, db: &Connection, queue: &str) -> Result<u32, BrokerError> {
        let n: i64 = db
            .prepare_cached("SELECT count(*) FROM messages WHERE queue = ?1 AND visible_at <= ?2")
            .and_then(|mut s| s.query_row(params![queue, now_ms()], |r| r.get(0)))
            .map_err(|e| self.error(e))?;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Whether `queue` has a message to claim now: the cheap check of an idle consumer.
    pub fn has_ready(&self, db: &Connection, queue: &str) -> Result<bool, BrokerError> {
        db.prepare_cached("SELECT 1 FROM messages WHERE queue = ?1 AND visible_at <= ?2 LIMIT 1")
            .and_then(|mut s| s.exists(params![queue, now_ms()]))
            .map_err(|e| self.error(e))
    }

    /// Ready messages and live consumers (of every process) of `queue`.
    pub fn stats(&self, db: &Connection, queue: &str) -> Result<QueueStats, BrokerError> {
        let exists = db
            .prepare_cached("SELECT 1 FROM queues WHERE name = ?1")
            .and_then(|mut s| s.exists([queue]))
            .map_err(|e| self.error(e))?;
        if !exists {
            return Err(BrokerError::NotFound(format!("queue \"{queue}\"")));
        }
        let consumers: i64 = db
            .prepare_cached("SELECT count(*) FROM consumers WHERE queue = ?1 AND until > ?2")
            .and_then(|mut s| s.query_row(params![queue, now_ms()], |r| r.get(0)))
            .map_err(|e| self.error(e))?;
        Ok(QueueStats { ready: self.ready(db, queue)?, consumers: u32::try_from(consumers).unwrap_or(u32::MAX) })
    }

    /// Messages not yet due back, in every queue (a scan of the messages): delayed copies,
    /// and deliveries under a lease, whose consumer may have died with them.
    pub fn delayed(&self, db: &Connection) -> Result<u32, BrokerError> {
        let n: i64 = db
            .query_row("SELECT count(*) FROM messages WHERE visible_at > ?1", [now_ms()], |r| r.get(0))
            .map_err(|e| self.error(e))?;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// How the file's declarations differ from `plan`.
    pub fn drift(&self, db: &Connection, plan: &Plan) -> Result<Vec<Drift>, BrokerError> {
        let e = |err| self.error(err);
        let mut drift = Vec::new();
        for x in &plan.exchanges {
            let kind: Option<String> = db
                .query_row("SELECT kind FROM exchanges WHERE name = ?1", [&x.name], |r| r.get(0))
                .optional()
                .map_err(e)?;
            match kind {
                None => drift.push(Drift::MissingExchange { name: x.name.clone() }),
                Some(kind) if kind != x.kind.as_str() => drift.push(Drift::Conflict {
                    what: "exchange".into(),
                    name: x.name.clone(),
                    detail: format!("type: declared {} but current is {kind}", x.kind.as_str()),
                }),
                Some(_) => {}
            }
        }
        for q in &plan.queues {
            let declared = serde_json::to_string(q).map_err(|err| self.error(err))?;
            let existing: Option<String> = db
                .query_row("SELECT declaration FROM queues WHERE name = ?1", [&q.name], |r| r.get(0))
                .optional()
                .map_err(e)?;
            match existing {
                None => drift.push(Drift::MissingQueue { name: q.name.clone() }),
                Some(existing) if existing != declared => drift.push(Drift::Conflict {
                    what: "queue".into(),
                    name: q.name.clone(),
                    detail: settings_differing(&declared, &existing),
                }),
                Some(_) => {}
            }
        }
        for b in &plan.bindings {
            let args = serde_json::to_string(&b.arguments).map_err(|err| self.error(err))?;
            let exists = db
                .prepare_cached(
                    "SELECT 1 FROM bindings WHERE exchange = ?1 AND queue = ?2 AND routing_key = ?3 AND arguments = ?4",
                )
                .and_then(|mut s| s.exists(params![b.exchange, b.queue, b.routing_key, args]))
                .map_err(e)?;
            if !exists {
                drift.push(Drift::MissingBinding {
                    exchange: b.exchange.clone(),
                    queue: b.queue.clone(),
                    routing_key: b.routing_key.clone(),
                });
            }
        }
        Ok(drift)
    }

    /// Copies the write-ahead log into the file and cuts it to nothing, when the broker is idle:
    /// otherwise it keeps up to [`WAL_LIMIT`] until the next write, or the size of the last
    /// burst until the last connection closes. Skipped, not waited for, while another process
    /// reads (the next idle moment tries again).
    pub fn empty_log(&self, db: &Connection) {
        let emptied = db
            .busy_timeout(Duration::ZERO)
            .and_then(|()| db.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get::<_, i64>(0)))
            .and(db.busy_timeout(BUSY_TIMEOUT));
        if let Err(e) = emptied {
            tracing::debug!(error = %e, "embedded broker: the write-ahead log was not emptied");
        }
    }

    /// Gives free pages back to the file system, a bounded number at a time, once acks have
    /// left many (the file would otherwise keep a drained backlog's size).
    pub fn reclaim(&self, db: &Connection) -> Result<(), BrokerError> {
        let free: i64 = db.query_row("PRAGMA freelist_count", [], |r| r.get(0)).map_err(|e| self.error(e))?;
        if free > 256 {
            // Each step frees pages: run it to the end.
            let mut vacuum = db.prepare("PRAGMA incremental_vacuum(4096)").map_err(|e| self.error(e))?;
            let mut rows = vacuum.query([]).map_err(|e| self.error(e))?;
            while rows.next().map_err(|e| self.error(e))?.is_some() {}
        }
        Ok(())
    }
}

/// The settings two queue declarations (as stored, JSON objects) differ in, each with both
/// values: `max_length: declared 100 but current is 50`.
fn settings_differing(declared: &str, existing: &str) -> String {
    let object =
        |text: &str| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text).unwrap_or_default();
    let (declared, existing) = (object(declared), object(existing));
    let names: std::collections::BTreeSet<&String> = declared.keys().chain(existing.keys()).collect();
    let none = serde_json::Value::Null;
    names
        .into_iter()
        .filter_map(|name| {
            let (d, e) = (declared.get(name).unwrap_or(&none), existing.get(name).unwrap_or(&none));
            (d != e).then(|| format!("{name}: declared {d} but current is {e}"))
        })
        .collect::<Vec<_>>()
        .join("; ")
}
