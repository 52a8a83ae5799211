//! The embedded broker's SQL: the schema, and each operation as statements on one open
//! transaction. Rows read from the file are checked: a message row that cannot be read is
//! quarantined (see [`Store::claim`]), never a panic nor an error that stops its queue; a file
//! SQLite finds damaged is [`BrokerError::Damaged`], as is one deleted or replaced under a
//! live connection, or its write-ahead log cut ([`Store::broken`]).
//!
//! A body is stored once, in `bodies`, and named by every message row that carries it: the
//! copies of a fan-out, a delayed retry, a dead-letter or redriven copy write no body again,
//! and a body no row names any longer goes with the last of them (a trigger). A claim reads a
//! body only when it is within the consumer's limit: a larger one is delivered as its size.
//!
//! A message is ready when `visible_at` is 0 (published, handed back) or past (a delayed copy
//! come due, a lease run out); claiming one sets `visible_at` to the lease's end and names
//! its owner, so a consumer that dies without settling simply lets it come due again (at once
//! when its process is known dead: [`Store::release_the_dead`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rusqlite::config::DbConfig;
use rusqlite::types::ValueRef;
use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension as _, params};
use serde_json::Value;

use super::super::declaration::{self, unsupported};
use super::super::kit::headers;
use super::super::kit::topology::{Cache, QueueRule, Topology, exchange_kind};
use super::super::{BrokerError, Cause, Drift, Headers, Properties, QueueStats, Route};
use super::process::{alive, process};
use crate::envelope::{ATTEMPT_HEADER, Reason, attempt_in, dead_letter_headers};
use crate::topology::{BindingDecl, Plan};

/// This broker, as a refused declaration names it.
pub(super) const BROKER: &str = "the embedded broker";

/// Where this broker looks for declarations, as a refusal on an empty one says.
const PLACE: &str = "on it";

/// How long a writer waits for another process's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The size the write-ahead log is cut back to once a checkpoint has emptied it: about what
/// SQLite's automatic checkpoint (every 1,000 pages) lets it grow to.
pub const WAL_LIMIT: i64 = 4 << 20;

/// Bodies this large or larger are written into their row in place ([`Store::body_id`]).
const IN_PLACE: usize = 1 << 20;

/// The file's layout, recorded in `meta`: 2 since bodies are stored apart and idempotency keys
/// kept (files without the record are of layout 1, converted on opening), 3 since messages keep
/// their content type (for message formats: an earlier sluice copying a message would drop
/// it). A file of a later layout is refused, not misread; one of an earlier layout is converted
/// by `run`, not read by the commands that only read.
const LAYOUT: i64 = 3;

/// Milliseconds since the epoch: the clock of `visible_at` and lease ends.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Milliseconds of a duration, saturating.
pub(super) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A message's body: bytes to store, or one the file holds already (by its id in `bodies`).
#[derive(Debug, Clone)]
pub(super) enum Body {
    New(Bytes),
    Stored(i64),
}

/// A message to write.
#[derive(Debug, Clone)]
pub(super) struct NewMessage {
    pub body: Body,
    pub properties: Properties,
}

/// A message claimed from the file: its body [stored](Body::Stored), and read unless it is
/// over the claim's limit (then empty).
#[derive(Debug)]
pub(super) struct Stored {
    pub id: i64,
    pub message: NewMessage,
    pub body: Bytes,
    /// The body's length, read or not.
    pub size: u64,
}

/// What a claim took, and whether it took all it was allowed (so more may be ready).
#[derive(Debug)]
pub(super) struct Claimed {
    pub rows: Vec<Stored>,
    pub full: bool,
    /// Rows it met that could not be read, moved out of the queue's way.
    pub quarantined: Vec<Quarantined>,
}

/// A message row that could not be read, and where what could be read of it went.
#[derive(Debug)]
pub(super) struct Quarantined {
    pub id: i64,
    /// The queue's dead-letter queue; for a queue without one, the queue itself.
    pub to: String,
    /// What could not be read.
    pub fault: String,
}

/// A consumer's registration, which makes it count among its queue's consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Registration {
    /// A new consumer registers.
    New,
    /// Extended, if it is still there.
    Keep,
    /// Removed.
    Drop,
}

/// A stored body and its length, or what can be read of a damaged one and what is wrong.
type BodyRead = Result<(Bytes, u64), (Bytes, String)>;

/// How often [`Store::release_the_dead`] looks at most: a runner's start registers a consumer
/// per queue, each a renewal, and thousands of queues would each scan every registration.
const RELEASE_EVERY: Duration = Duration::from_secs(1);

/// Adds `column` (a name and its type) to `table` of a file written before the column existed.
fn add_column(tx: &rusqlite::Transaction, table: &str, column: &str) -> rusqlite::Result<()> {
    let name = column.split_whitespace().next().unwrap_or(column);
    let there =
        tx.query_row("SELECT 1 FROM pragma_table_info(?1) WHERE name = ?2", [table, name], |_| Ok(())).optional()?;
    match there {
        Some(()) => Ok(()),
        None => tx.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column};")),
    }
}

/// The statements on a store, and what they cache; the connection stays the caller's, so a
/// transaction on it and these can be used together.
pub(super) struct Store {
    path: String,
    /// The file and its write-ahead log, each with the file (device, inode) it was when opened.
    opened: Vec<(PathBuf, (u64, u64))>,
    /// The declarations routing needs, cached until a declare (by any process) bumps the
    /// version in `meta`.
    topology: Cache<i64>,
    /// Ready messages of the queues with `max_length` that this batch published to: counted
    /// once per batch, then kept up to date by its inserts and claims.
    ready_counts: HashMap<String, u64>,
    /// When [`Store::release_the_dead`] last looked: at most once per [`RELEASE_EVERY`].
    released_at: Option<std::time::Instant>,
}

/// What went wrong in the store, and whether it says that the file itself is damaged.
pub(super) struct Fault {
    cause: Cause,
    damaged: bool,
}

impl From<rusqlite::Error> for Fault {
    fn from(e: rusqlite::Error) -> Fault {
        let damaged = matches!(e.sqlite_error_code(), Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase));
        Fault { cause: Cause::from_error(e), damaged }
    }
}

impl From<Cause> for Fault {
    fn from(cause: Cause) -> Fault {
        Fault { cause, damaged: false }
    }
}

impl From<String> for Fault {
    fn from(text: String) -> Fault {
        Fault::from(Cause::from(text))
    }
}

impl From<&str> for Fault {
    fn from(text: &str) -> Fault {
        Fault::from(Cause::from(text))
    }
}

impl From<serde_json::Error> for Fault {
    fn from(e: serde_json::Error) -> Fault {
        Fault::from(Cause::from_error(e))
    }
}

/// The error for a file SQLite finds damaged or not a database at all, saying what to do.
fn damaged(path: &str, cause: Cause) -> BrokerError {
    BrokerError::Damaged(cause.within(format_args!(
        "the embedded broker's file {path} is not a usable SQLite database ({})",
        mend(Path::new(path))
    )))
}

/// What to do with a damaged file at `path`.
fn mend(path: &Path) -> String {
    format!(
        "stop every sluice process using it, then restore it from a backup and delete {}, or move it aside together with its -wal and -shm files: `sluice run` then starts an empty broker, and `sqlite3 FILE .recover` may salvage messages from the damaged copy",
        damage_mark(path).display()
    )
}

/// The file beside the broker's that says a process found it damaged (see [`Store::error`]):
/// the damage may lie where the next command does not read, and a message published into a
/// file no runner can read is lost all the same.
fn damage_mark(path: &Path) -> PathBuf {
    with_suffix(path, ".damaged")
}

/// Refuses the file at `path` (whose content is `shown`) if a process found it damaged, as
/// its [mark](damage_mark) says. A mark naming another file than the one there now (the
/// damaged one moved aside, another put in its place) is stale: `remove` drops it.
fn refuse_if_marked(path: &Path, shown: &str, remove: bool) -> Result<(), BrokerError> {
    let mark = damage_mark(path);
    let Ok(text) = std::fs::read_to_string(&mark) else { return Ok(()) };
    let (first, found) = text.split_once('\n').unwrap_or((&text, ""));
    let marked = first.split_once(' ').and_then(|(dev, ino)| Some((dev.parse().ok()?, ino.parse().ok()?)));
    if marked.is_some() && marked == identity(path) {
        return Err(BrokerError::Damaged(
            format!(
                "the embedded broker's file {shown} was found damaged ({}): nothing is published into it nor read from it until it is mended ({})",
                found.trim(),
                mend(path)
            )
            .into(),
        ));
    }
    if remove && let Err(e) = std::fs::remove_file(&mark) {
        tracing::warn!(mark = %mark.display(), error = %e, "embedded broker: removing a stale damage mark failed");
    }
    Ok(())
}

/// How a connection's files were changed under it by something else than SQLite
/// ([`Store::broken`]).
#[derive(Debug)]
pub(super) enum Broken {
    /// The file (or, with `log`, its write-ahead log) is no longer at its path the one the
    /// connection opened: deleted, or replaced.
    Vanished { file: PathBuf, log: bool },
    /// The write-ahead log no longer holds what its index says it does (cut short, perhaps
    /// written after since, leaving a hole where its start was), with `unsaved` frames that
    /// were not yet copied into the file.
    Truncated { wal: PathBuf, unsaved: u32 },
}

/// What [`Store::broken`] reads of a write-ahead log: its length, its header and where its
/// first hole begins. SQLite writes a log from its start without gaps, so a hole (where the
/// file system keeps them) is a log cut short and written after.
struct LogFile {
    length: u64,
    /// The log's 32-byte header, if it is that long.
    header: Option<[u8; 32]>,
    hole: u64,
}

impl LogFile {
    fn read(path: &Path) -> Option<LogFile> {
        use std::io::Read as _;
        use std::os::fd::AsRawFd as _;
        let mut file = std::fs::File::open(path).ok()?;
        let length = file.metadata().ok()?.len();
        let mut header = [0u8; 32];
        let header = file.read_exact(&mut header).ok().map(|()| header);
        // SAFETY: lseek(2) on a descriptor this function owns; no memory is passed.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_HOLE) };
        // Where holes cannot be asked for, the end of the file.
        let hole = u64::try_from(hole).unwrap_or(length);
        Some(LogFile { length, header, hole })
    }
}

/// What the write-ahead log's index (the `-shm` file, in the layout SQLite documents at
/// <https://www.sqlite.org/walformat.html>) says of the log.
struct LogIndex {
    /// The index's header as read: the same at two reads when nothing changed in between.
    header: [u8; 48],
    page_size: u64,
    /// Frames in the log (a frame holds a page).
    frames: u32,
    /// Frames copied into the file by checkpoints.
    backfilled: u32,
}

impl LogIndex {
    /// The index at `shm`, unless it cannot be read or is being written (its header's two
    /// copies differ) or not set up yet.
    fn read(shm: &Path) -> Option<LogIndex> {
        use std::io::Read as _;
        let mut bytes = [0u8; 100];
        std::fs::File::open(shm).ok()?.read_exact(&mut bytes).ok()?;
        let (header, copy) = bytes.split_at(48);
        let word = |at: usize| bytes.get(at..at + 4)?.try_into().ok().map(u32::from_ne_bytes);
        // The version SQLite has written since 3.7.0, and `isInit`.
        if header != &copy[..48] || word(0)? != 3_007_000 || header[12] != 1 {
            return None;
        }
        let page_size = match u16::from_ne_bytes([header[14], header[15]]) {
            1 => 65_536,
            size => u64::from(size),
        };
        Some(LogIndex { header: header.try_into().ok()?, page_size, frames: word(16)?, backfilled: word(96)? })
    }

    /// Whether `log` holds the index's frames: as long as a 32-byte header and each frame's
    /// 24-byte header and page, without a hole, and its header of the same generation (the
    /// salts the index copied from it).
    fn matches(&self, log: &LogFile) -> bool {
        let needs = 32 + u64::from(self.frames) * (24 + self.page_size);
        let magic = |h: &[u8; 32]| matches!(h[..4], [0x37, 0x7f, 0x06, 0x82 | 0x83]);
        let salts = &self.header[32..40];
        log.length >= needs && log.hole >= needs && log.header.is_some_and(|h| magic(&h) && h[16..24] == *salts)
    }
}

/// Which file a path leads to now (device and inode), if any.
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// A path with `suffix` added to its file name: the write-ahead log's, a rescued copy's.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// What can be read of a value that should have been a body (a blob): its bytes, or its text.
fn bytes_of(value: ValueRef<'_>) -> Bytes {
    match value {
        ValueRef::Text(t) | ValueRef::Blob(t) => Bytes::copy_from_slice(t),
        ValueRef::Integer(i) => i.to_string().into(),
        ValueRef::Real(f) => f.to_string().into(),
        ValueRef::Null => Bytes::new(),
    }
}

/// A stored message row, whatever its columns hold (another program may have written them, or
/// the disk damaged them): its id, the message (its body by reference, not read), and what of
/// it could not be read (nothing for a sound row). What can be is kept: a body written into
/// the row itself as its text, the rest left out.
fn read_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(i64, NewMessage, Vec<String>)> {
    let mut faults = Vec::new();
    let id = r.get(0)?;
    let body = match r.get_ref(1)? {
        ValueRef::Integer(reference) => Body::Stored(reference),
        other => {
            faults.push(format!("body: {}, not a stored body's id", other.data_type()));
            Body::New(bytes_of(other))
        }
    };
    let headers = match r.get_ref(2)? {
        ValueRef::Text(t) => {
            std::str::from_utf8(t).map_err(|e| format!("headers: {e}")).and_then(|_| headers::decode(t))
        }
        other => Err(format!("headers: {}, not JSON text", other.data_type())),
    };
    let headers = headers.unwrap_or_else(|fault| {
        faults.push(fault);
        Headers::new()
    });
    let mut text = |column: usize, name: &str| -> rusqlite::Result<Option<String>> {
        let value = r.get_ref(column)?;
        if let ValueRef::Null = value {
            return Ok(None);
        }
        match value.as_str() {
            Ok(s) => Ok(Some(s.to_string())),
            Err(_) => {
                faults.push(format!("{name}: {}, not UTF-8 text", value.data_type()));
                Ok(None)
            }
        }
    };
    let (message_id, kind, content_type) = (text(3, "message_id")?, text(4, "kind")?, text(8, "content_type")?);
    // Absent from rows written before sluice kept them, or by another program.
    let route = match (text(6, "exchange")?, text(7, "routing_key")?) {
        (Some(exchange), Some(routing_key)) => Some(Route { exchange, routing_key }),
        _ => None,
    };
    let timestamp = match r.get_ref(5)? {
        ValueRef::Null => None,
        ValueRef::Integer(t) if t >= 0 => u64::try_from(t).ok(),
        ValueRef::Integer(t) => {
            faults.push(format!("timestamp: {t}, negative"));
            None
        }
        other => {
            faults.push(format!("timestamp: {}, not an integer", other.data_type()));
            None
        }
    };
    let properties = Properties { headers, message_id, kind, content_type, timestamp, route };
    Ok((id, NewMessage { body, properties }, faults))
}

/// Gives what could be read of message row `id` of `queue` the dead-letter headers of reason
/// `internal`, saying what could not be read (`fault`).
fn mark_unreadable(message: &mut NewMessage, id: i64, fault: &str, queue: &str) {
    let attempts = attempt_in(message.properties.headers.get(ATTEMPT_HEADER));
    let error = format!("the embedded broker could not read stored message {id}: {fault}");
    message.properties.headers.extend(dead_letter_headers(Reason::Internal, &error, attempts, queue));
}

/// Why an operator's command finds no broker where `--broker` points.
const NO_BROKER: &str = "no broker there: the file does not exist, and only `sluice run` creates it (check --broker, $SLUICE_BROKER and the working directory)";

/// `path` as an SQLite URI opening it read-only as an immutable file (`%`, `?` and `#` escaped).
fn immutable_uri(path: &Path) -> String {
    let text = path.display().to_string().replace('%', "%25").replace('?', "%3f").replace('#', "%23");
    format!("file:{text}?immutable=1")
}

impl Store {
    /// Opens an existing file read-only, writing nothing to it nor beside it: for the commands
    /// that only read (`status`, `dlq list`, `dlq show`). Where the write-ahead log's shared
    /// memory (`-shm`) cannot be made (a directory this user may not write), the file is
    /// opened as immutable instead: a snapshot of what was checkpointed into it, which is all
    /// of a cleanly stopped runner's file, but not the commits a killed or live runner left in
    /// its `-wal` (said in a warning).
    pub fn open_read_only(path: &Path) -> Result<(Connection, Store), BrokerError> {
        let shown = path.display().to_string();
        let fail = |reason: Cause| BrokerError::Connect { url: shown.clone(), reason };
        if !path.is_file() {
            return Err(fail(NO_BROKER.into()));
        }
        refuse_if_marked(path, &shown, false)?;
        let sql = |e: rusqlite::Error| match Fault::from(e) {
            Fault { damaged: true, cause } => damaged(&shown, cause),
            Fault { cause, .. } => fail(cause),
        };
        let read_only = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let layout = |db: &Connection| -> rusqlite::Result<Option<i64>> {
            db.busy_timeout(BUSY_TIMEOUT)?;
            db.query_row("SELECT value FROM meta WHERE key = 'layout'", [], |r| r.get(0)).optional()
        };
        let opened = Connection::open_with_flags(path, read_only).and_then(|db| Ok((layout(&db)?, db)));
        let (layout, db) = match opened {
            Ok((layout, db)) => (layout, db),
            Err(e) if matches!(e.sqlite_error_code(), Some(ErrorCode::CannotOpen | ErrorCode::ReadOnly)) => {
                let db = Connection::open_with_flags(immutable_uri(path), read_only | OpenFlags::SQLITE_OPEN_URI)
                    .map_err(sql)?;
                let wal = with_suffix(path, "-wal");
                let pending = std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0);
                let layout = match layout(&db) {
                    Ok(layout) => layout,
                    Err(_) if pending => {
                        return Err(fail(
                            format!(
                                "nothing is checkpointed into the file yet, all is in {}, which SQLite reads only beside a -shm file this user may not create here: run this as a user who may write the directory",
                                wal.display()
                            )
                            .into(),
                        ));
                    }
                    Err(e) => return Err(sql(e)),
                };
                if pending {
                    tracing::warn!(
                        file = %shown,
                        "read as a snapshot (this user may not write the directory, so SQLite cannot share the write-ahead log): \
                         commits still in {} are not seen; a cleanly stopped runner leaves none",
                        wal.display()
                    );
                }
                (layout, db)
            }
            Err(e) => return Err(sql(e)),
        };
        match layout {
            Some(LAYOUT) => {}
            Some(newer) if newer > LAYOUT => {
                return Err(BrokerError::Damaged(
                    format!(
                        "{shown} was written by a newer sluice (file layout {newer}; this one reads up to {LAYOUT}): \
                     run that version or a later one on it"
                    )
                    .into(),
                ));
            }
            _ => {
                return Err(fail(
                    "the file is of an earlier sluice's layout: `sluice run` converts it (this command only reads)"
                        .into(),
                ));
            }
        }
        Ok((db, Store::new(shown, Vec::new())))
    }

    /// Opens the file (with `create`, making it and its directory when missing): WAL,
    /// `synchronous=NORMAL`, incremental auto-vacuum, the schema.
    pub fn open(path: &Path, create: bool) -> Result<(Connection, Store), BrokerError> {
        let shown = path.display().to_string();
        let fail = |reason: Cause| BrokerError::Connect { url: shown.clone(), reason };
        let flags = if create {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                crate::file::create_private_dir(dir).map_err(|e| fail(Cause::from_error(e)))?;
            }
            OpenFlags::default()
        } else {
            if !path.is_file() {
                return Err(fail(NO_BROKER.into()));
            }
            // Nor a new file if this one goes in the meantime.
            OpenFlags::default().difference(OpenFlags::SQLITE_OPEN_CREATE)
        };
        // Links are resolved once: the file is the one opened, wherever a link on its path
        // points later (a checked-out release, a repointed state directory), and it is that
        // file whose deletion `broken` notices.
        let resolved =
            path.parent().filter(|d| !d.as_os_str().is_empty()).and_then(|dir| std::fs::canonicalize(dir).ok());
        let path = &match (resolved, path.file_name()) {
            (Some(dir), Some(name)) => dir.join(name),
            _ => path.to_path_buf(),
        };
        refuse_if_marked(path, &shown, true)?;
        // SQLite reads the file only from the first statement: a file that is no database, or
        // a damaged one, fails there.
        let sql = |e: rusqlite::Error| match Fault::from(e) {
            Fault { damaged: true, cause } => damaged(&shown, cause),
            Fault { cause, .. } => fail(cause),
        };
        let mut conn = Connection::open_with_flags(path, flags).map_err(sql)?;
        conn.busy_timeout(BUSY_TIMEOUT).map_err(sql)?;
        // auto_vacuum takes effect only before the first table: on a new file.
        conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL;").map_err(sql)?;
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0)).map_err(sql)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(fail(format!("journal mode is {mode}, not wal").into()));
        }
        conn.execute_batch("PRAGMA synchronous = NORMAL;").map_err(sql)?;
        // Without a limit the write-ahead log keeps the size of its largest batch of pages
        // until the last connection closes; with it, each restart after a checkpoint cuts it.
        conn.pragma_update(None, "journal_size_limit", WAL_LIMIT).map_err(sql)?;
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).map_err(sql)?;
        let bodies_apart = tx
            .query_row("SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'bodies'", [], |_| Ok(()))
            .optional()
            .map_err(sql)?
            .is_some();
        tx.execute_batch("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);")
            .map_err(sql)?;
        // A file a newer sluice has written may hold what this one would misread: refused.
        let layout: Option<i64> =
            tx.query_row("SELECT value FROM meta WHERE key = 'layout'", [], |r| r.get(0)).optional().map_err(sql)?;
        if let Some(newer) = layout.filter(|l| *l > LAYOUT) {
            return Err(BrokerError::Damaged(
                format!(
                    "{shown} was written by a newer sluice (file layout {newer}; this one reads up to {LAYOUT}): \
                 run that version or a later one on it"
                )
                .into(),
            ));
        }
        tx.execute_batch(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('topology', 0);
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
             -- `body` holds the id of the message's body in `bodies`.
             CREATE INDEX IF NOT EXISTS messages_due ON messages (queue, visible_at, id);
             CREATE TABLE IF NOT EXISTS bodies (id INTEGER PRIMARY KEY, data BLOB NOT NULL);
             CREATE INDEX IF NOT EXISTS messages_body ON messages (body);
             CREATE TRIGGER IF NOT EXISTS messages_body_gone AFTER DELETE ON messages BEGIN
                 DELETE FROM bodies WHERE id = old.body
                     AND NOT EXISTS (SELECT 1 FROM messages WHERE body = old.body);
             END;
             CREATE TABLE IF NOT EXISTS consumers (owner INTEGER PRIMARY KEY, queue TEXT NOT NULL,
                 until INTEGER NOT NULL, since INTEGER NOT NULL);
             CREATE INDEX IF NOT EXISTS consumers_queue ON consumers (queue, since);
             -- The idempotency keys (keys.rs): `until` is when a claim's lease or a done key's
             -- TTL ends (ms). No index on `until`: it would cost every claim and completion a
             -- second B-tree write; expired keys are found by a sweep in key order instead.
             -- `key_holders`: the holders that claim keys, and whether each writes its claims
             -- as rows (`shared`).
             CREATE TABLE IF NOT EXISTS idempotency (key TEXT PRIMARY KEY,
                 done INTEGER NOT NULL, until INTEGER NOT NULL, holder TEXT) WITHOUT ROWID;
             DROP INDEX IF EXISTS idempotency_until;
             CREATE TABLE IF NOT EXISTS key_holders (holder TEXT PRIMARY KEY, shared INTEGER NOT NULL)
                 WITHOUT ROWID;",
        )
        .map_err(sql)?;
        // Kept apart from the declaration: a limit of the runner's, no conflict when it changes.
        add_column(&tx, "queues", "max_message_bytes INTEGER").map_err(sql)?;
        // The process of each consumer ([`process`]), so that what a killed one held comes back
        // at once; registrations from before have none, and wait for their lease.
        add_column(&tx, "consumers", "process TEXT").map_err(sql)?;
        // Where a message was published to, for binding filters; rows from before have none.
        add_column(&tx, "messages", "exchange TEXT").map_err(sql)?;
        add_column(&tx, "messages", "routing_key TEXT").map_err(sql)?;
        // The body's media type, for message formats; rows from before have none.
        add_column(&tx, "messages", "content_type TEXT").map_err(sql)?;
        if !bodies_apart {
            // A file of an earlier version keeps each body in its row: it moves to `bodies`,
            // under the row's id.
            tx.execute_batch(
                "INSERT INTO bodies (id, data) SELECT id, body FROM messages WHERE typeof(body) = 'blob';
                 UPDATE messages SET body = id WHERE typeof(body) = 'blob';",
            )
            .map_err(sql)?;
        }
        tx.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('layout', ?1)", [LAYOUT]).map_err(sql)?;
        tx.commit().map_err(sql)?;
        // Both exist now: the log since the first transaction in WAL mode.
        let opened = [path.to_path_buf(), with_suffix(path, "-wal")]
            .into_iter()
            .filter_map(|file| identity(&file).map(|id| (file, id)))
            .collect();
        Ok((conn, Store::new(shown, opened)))
    }

    /// A store of the file shown as `path`, whose files as opened are `opened`, with nothing
    /// cached yet.
    fn new(path: String, opened: Vec<(PathBuf, (u64, u64))>) -> Store {
        Store { path, opened, topology: Cache::default(), ready_counts: HashMap::new(), released_at: None }
    }

    /// Drops the cached declarations (read in a transaction that did not commit).
    pub fn forget(&mut self) {
        self.topology.forget();
        self.ready_counts.clear();
    }

    /// Starts a batch: counts from another transaction may be stale.
    pub fn new_batch(&mut self) {
        self.ready_counts.clear();
    }

    /// An error of the store as the broker's: [`BrokerError::Damaged`] when SQLite says the
    /// file is damaged, else a lost session (retried). Damage found by a process that may
    /// write is [marked](damage_mark) beside the file, for the processes that open it next.
    pub fn error(&self, e: impl Into<Fault>) -> BrokerError {
        match e.into() {
            Fault { damaged: true, cause } => {
                self.mark_damaged(&cause);
                damaged(&self.path, cause)
            }
            Fault { cause, .. } => BrokerError::Lost(cause.within(format_args!("embedded broker {}", self.path))),
        }
    }

    /// Writes the [mark](damage_mark) that refuses the file to every process that opens it
    /// from now on (`run`, `publish`, `status`, `dlq`), naming the file as opened (device and
    /// inode: one put in its place is not refused) and what was found.
    fn mark_damaged(&self, cause: &Cause) {
        // Pages read from a log cut or replaced under this connection are garbage: the file
        // itself may be sound (and `broken` says what happened).
        if self.broken().is_some() {
            return;
        }
        let Some((file, (dev, ino))) = self.opened.first() else { return };
        let at = humantime::format_rfc3339_seconds(SystemTime::now());
        let text = format!("{dev} {ino}\n{cause}; found at {at} by process {}\n", std::process::id());
        if let Err(e) = std::fs::write(damage_mark(file), text) {
            tracing::warn!(file = %file.display(), error = %e, "embedded broker: marking the file damaged failed");
        }
    }

    /// How the file or its write-ahead log was changed under this connection by something
    /// else than SQLite, if it was: what this connection writes then reaches neither other
    /// processes nor, once it closes, anyone.
    pub fn broken(&self) -> Option<Broken> {
        let vanished = self.opened.iter().position(|(file, id)| identity(file) != Some(*id));
        if let Some(i) = vanished {
            return Some(Broken::Vanished { file: self.opened[i].0.clone(), log: i > 0 });
        }
        let [(file, _), (wal, _)] = &self.opened[..] else { return None };
        // The index, the log, the index again: the log is compared only with an index that
        // did not change meanwhile (a commit writes its frames before its index says so, and
        // a checkpoint empties the index before it cuts the log).
        let shm = with_suffix(file, "-shm");
        let before = LogIndex::read(&shm)?;
        let log = LogFile::read(wal)?;
        let index = LogIndex::read(&shm)?;
        let cut = index.frames > 0 && !index.matches(&log);
        (index.header == before.header && cut)
            .then(|| Broken::Truncated { wal: wal.clone(), unsaved: index.frames.saturating_sub(index.backfilled) })
    }

    /// Makes the best of a [broken](Store::broken) file, through the descriptors still open,
    /// before this connection stops for good: a deleted write-ahead log's commits are copied
    /// into the file (they would go with the log), and nothing is done to the files when the
    /// connection closes (the log at that path, if any, is another process's); a deleted
    /// file's content is saved as a copy beside it; a truncated log is not copied into the
    /// file (what is missing of it would be copied as garbage). The error every request gets
    /// from then on, saying what was kept and what to do.
    pub fn give_up(&self, db: &Connection, broken: &Broken) -> BrokerError {
        let no_checkpoint_on_close = || {
            if let Err(e) = db.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true) {
                tracing::warn!(error = %e, "embedded broker: closing may still touch the write-ahead log");
            }
        };
        let (file, log) = match broken {
            Broken::Vanished { file, log } => (file, *log),
            Broken::Truncated { wal, unsaved } => {
                no_checkpoint_on_close();
                let what = match unsaved {
                    0 => format!("everything committed was in {} already", self.path),
                    n => format!(
                        "the last {n} page(s) written, not yet copied into {}, went with it: the commits since the last checkpoint are lost (messages published then; acks, whose messages come back)",
                        self.path
                    ),
                };
                return BrokerError::Damaged(format!(
                    "the embedded broker's write-ahead log {} was truncated while in use (only sluice may change the broker's files while it runs); {what}. Stopped without copying what is left of it into the file: start sluice again",
                    wal.display()
                ).into());
            }
        };
        let rescue = with_suffix(Path::new(&self.path), &format!(".rescued-{}", now_ms()));
        let saved = match log {
            true => Ok(()),
            false => db.execute("VACUUM INTO ?1", [rescue.display().to_string()]).map(drop),
        };
        // A full copy of the log into the file, waiting for readers: then the log is empty.
        let copied = db.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get::<_, i64>(0));
        let copied = match copied {
            Ok(0) => Ok(()),
            Ok(_) => Err("other processes were reading".to_string()),
            Err(e) => Err(e.to_string()),
        };
        if log {
            no_checkpoint_on_close();
        }
        let what = match (log, saved, copied) {
            (true, _, Ok(())) => format!("what was committed is in {} now", self.path),
            (true, _, Err(e)) => {
                format!("copying what was committed into {} failed ({e}): the last commits may be lost", self.path)
            }
            (false, Ok(()), _) => format!(
                "what it held is saved as {}: once every sluice process on it has stopped, put that copy at {}",
                rescue.display(),
                self.path
            ),
            (false, Err(e), _) => format!("saving what it held as {} failed ({e})", rescue.display()),
        };
        BrokerError::Damaged(format!(
            "the embedded broker's {} {} was deleted or replaced while in use (only sluice may delete the broker's files while it runs); {what}. Stopped: start sluice again",
            if log { "write-ahead log" } else { "file" },
            file.display(),
        ).into())
    }

    /// An exchange or queue (`what`) not declared here, with the closest declared name; or, on
    /// a file where nothing is declared, that the broker is empty (pointed at the wrong one?).
    fn missing(&self, db: &Connection, what: &'static str, name: &str) -> BrokerError {
        match self.refresh(db) {
            Ok(topology) => topology.missing(what, name, PLACE),
            Err(e) => e,
        }
    }

    /// The declarations, read again if a declare changed them since.
    fn refresh(&self, db: &Connection) -> Result<Arc<Topology<i64>>, BrokerError> {
        let version: i64 = db
            .prepare_cached("SELECT value FROM meta WHERE key = 'topology'")
            .and_then(|mut s| s.query_row([], |r| r.get(0)))
            .map_err(|e| self.error(e))?;
        if let Some(topology) = self.topology.at(&version) {
            return Ok(topology);
        }
        let load = || -> Result<Topology<i64>, Fault> {
            let mut t = Topology { version, ..Topology::default() };
            let mut s = db.prepare("SELECT name, kind FROM exchanges")?;
            let rows = s.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
            for row in rows {
                let (name, kind) = row?;
                let kind = exchange_kind(&kind).ok_or(format!("exchange \"{name}\": unknown type \"{kind}\""))?;
                t.exchanges.insert(name, kind);
            }
            let mut s =
                db.prepare("SELECT name, max_length, single_active, declaration, max_message_bytes FROM queues")?;
            let rows = s.query_map([], |r| {
                Ok((
                    (r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?, r.get::<_, bool>(2)?),
                    (r.get::<_, String>(3)?, r.get::<_, Option<i64>>(4)?),
                ))
            })?;
            for row in rows {
                let ((name, max, single_active), (declaration, max_body)) = row?;
                let max_length =
                    max.map(u64::try_from).transpose().map_err(|_| format!("queue \"{name}\": max_length"))?;
                let dead_letter = serde_json::from_str::<Value>(&declaration)
                    .ok()
                    .and_then(|d| Some(d.get("dead_letter")?.as_str()?.to_string()));
                let max_body = max_body.and_then(|m| u64::try_from(m).ok());
                t.queues.insert(name, QueueRule { max_length, single_active, dead_letter, max_body });
            }
            let mut s = db.prepare("SELECT exchange, queue, routing_key, arguments FROM bindings")?;
            let rows = s.query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?, r.get::<_, String>(3)?))
            })?;
            for row in rows {
                let (exchange, queue, routing_key, args) = row?;
                let arguments =
                    serde_json::from_str(&args).map_err(|e| Cause::from_error(e).within("binding arguments"))?;
                t.bindings.push(BindingDecl { exchange, queue, routing_key, arguments });
            }
            Ok(t)
        };
        let topology = load().map_err(|e| self.error(e))?;
        Ok(self.topology.keep(topology))
    }

    /// Declares a plan: checks everything first (a conflict changes nothing), then creates
    /// what is missing.
    pub fn declare(&self, db: &Connection, plan: &Plan) -> Result<(), BrokerError> {
        let e = |err| self.error(err);
        if let Some((q, detail)) = plan.queues.iter().find_map(|q| Some((q, unsupported(q, BROKER)?))) {
            return Err(BrokerError::Conflict(format!("queue \"{}\": {detail}", q.name).into()));
        }
        if let Some(Drift::Conflict { what, name, detail }) =
            self.drift(db, plan)?.into_iter().find(|d| matches!(d, Drift::Conflict { .. }))
        {
            return Err(BrokerError::Conflict(
                format!("{what} \"{name}\" conflicts with what exists: {detail}").into(),
            ));
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
            let max_body = q.max_message_bytes.map(|m| i64::try_from(m).unwrap_or(i64::MAX));
            db.execute("UPDATE queues SET max_message_bytes = ?2 WHERE name = ?1", params![q.name, max_body])
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

    /// Removes bindings (those absent are no error); every process routes without them from
    /// its next publish.
    pub fn unbind(&self, db: &Connection, bindings: &[BindingDecl]) -> Result<(), BrokerError> {
        let e = |err| self.error(err);
        for b in bindings {
            let args = serde_json::to_string(&b.arguments).map_err(|err| self.error(err))?;
            db.execute(
                "DELETE FROM bindings WHERE exchange = ?1 AND queue = ?2 AND routing_key = ?3 AND arguments = ?4",
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
        let (topology, targets) = self.route(db, exchange, routing_key, &message.properties.headers)?;
        for queue in &targets {
            self.check_room(db, &topology, exchange, queue)?;
        }
        // One body for every copy.
        let body = self.body_id(db, &message.body)?;
        for queue in &targets {
            self.insert(db, queue, message, body, 0)?;
        }
        Ok(targets)
    }

    /// The queues a publish would reach, each with the largest body its consumers take, as
    /// far as the last declare said.
    pub fn limits(
        &mut self,
        db: &Connection,
        exchange: &str,
        routing_key: &str,
        headers: &Headers,
    ) -> Result<Vec<(String, Option<u64>)>, BrokerError> {
        let (topology, targets) = self.route(db, exchange, routing_key, headers)?;
        let limit = |q: &str| topology.queues.get(q).and_then(|rule| rule.max_body);
        Ok(targets.into_iter().map(|q| (limit(&q), q)).map(|(max, q)| (q, max)).collect())
    }

    /// The declarations, and the queues a message reaches under them (at least one).
    fn route(
        &self,
        db: &Connection,
        exchange: &str,
        routing_key: &str,
        headers: &Headers,
    ) -> Result<(Arc<Topology<i64>>, Vec<String>), BrokerError> {
        let topology = self.refresh(db)?;
        let targets = topology.route(exchange, routing_key, headers, PLACE)?;
        Ok((topology, targets))
    }

    /// Writes one copy into `queue`, visible from `visible_at` (0: at once).
    pub fn copy(
        &mut self,
        db: &Connection,
        queue: &str,
        message: &NewMessage,
        visible_at: i64,
    ) -> Result<(), BrokerError> {
        let topology = self.refresh(db)?;
        self.check_room(db, &topology, "", queue)?;
        let body = self.body_id(db, &message.body)?;
        self.insert(db, queue, message, body, visible_at)
    }

    /// A queue with `max_length` refuses a message once it holds that many ready ones
    /// (RabbitMQ's reject-publish).
    fn check_room(
        &mut self,
        db: &Connection,
        topology: &Topology<i64>,
        exchange: &str,
        queue: &str,
    ) -> Result<(), BrokerError> {
        let Some(rule) = topology.queues.get(queue) else { return Err(topology.missing("queue", queue, PLACE)) };
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
            return Err(BrokerError::Rejected {
                exchange: exchange.into(),
                reason: format!("queue \"{queue}\" is full"),
            });
        }
        Ok(())
    }

    /// The id in `bodies` of a message's body, stored first if it is new. (A stored one is
    /// there: its message, leased to the consumer copying it, still names it.) A large body is
    /// written into its row in place: bound as a value, SQLite would copy it twice (the value,
    /// then the record), holding three of it at once.
    fn body_id(&self, db: &Connection, body: &Body) -> Result<i64, BrokerError> {
        let bytes = match body {
            Body::New(bytes) => bytes,
            Body::Stored(id) => return Ok(*id),
        };
        let e = |err| self.error(err);
        if bytes.len() < IN_PLACE {
            return db
                .prepare_cached("INSERT INTO bodies (data) VALUES (?1) RETURNING id")
                .and_then(|mut s| s.query_row([&bytes[..]], |r| r.get(0)))
                .map_err(e);
        }
        let length = i64::try_from(bytes.len()).map_err(|_| self.error("a body over 2^63 bytes"))?;
        let id = db
            .prepare_cached("INSERT INTO bodies (data) VALUES (zeroblob(?1)) RETURNING id")
            .and_then(|mut s| s.query_row([length], |r| r.get(0)))
            .map_err(e)?;
        let mut blob = db.blob_open(rusqlite::MAIN_DB, c"bodies", c"data", id, false).map_err(e)?;
        blob.write_all_at(bytes, 0).map_err(e)?;
        Ok(id)
    }

    fn insert(
        &mut self,
        db: &Connection,
        queue: &str,
        m: &NewMessage,
        body: i64,
        visible_at: i64,
    ) -> Result<(), BrokerError> {
        if visible_at <= now_ms()
            && let Some(n) = self.ready_counts.get_mut(queue)
        {
            *n += 1;
        }
        let timestamp = m.properties.timestamp.map(|t| i64::try_from(t).unwrap_or(i64::MAX));
        db.prepare_cached(
            "INSERT INTO messages (queue, visible_at, body, headers, message_id, kind, timestamp, exchange, routing_key,
                 content_type)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
        )
        .and_then(|mut s| {
            let (exchange, routing_key) = m.properties.route.as_ref().map(|r| (&r.exchange, &r.routing_key)).unzip();
            s.execute(params![
                queue,
                visible_at,
                body,
                headers::encode(&m.properties.headers),
                m.properties.message_id,
                m.properties.kind,
                timestamp,
                exchange,
                routing_key,
                m.properties.content_type
            ])
        })
        .map_err(|e| self.error(e))?;
        Ok(())
    }

    /// Leases the oldest ready messages of `queue` to `owner` until `until`: up to `n`, and
    /// bodies of up to `bytes` in all (a larger first one goes alone); none to a consumer that
    /// is not the active one of a single-active-consumer queue (the live one registered first).
    /// A body over `max_body` is not read (nor counted in `bytes`): its message comes with its
    /// size alone. A row among them that cannot be read is [quarantined](Store::quarantine)
    /// instead.
    #[allow(clippy::too_many_arguments)]
    pub fn claim(
        &mut self,
        db: &Connection,
        queue: &str,
        owner: i64,
        n: u32,
        bytes: u64,
        max_body: u64,
        until: i64,
    ) -> Result<Claimed, BrokerError> {
        let topology = self.refresh(db)?;
        let e = |err| self.error(err);
        let single = topology.queues.get(queue).is_some_and(|q| q.single_active);
        if single {
            let active: Option<i64> = db
                .prepare_cached("SELECT owner FROM consumers WHERE queue = ?1 AND until > ?2 ORDER BY since LIMIT 1")
                .and_then(|mut s| s.query_row(params![queue, now_ms()], |r| r.get(0)).optional())
                .map_err(e)?;
            if active != Some(owner) {
                return Ok(Claimed { rows: Vec::new(), full: false, quarantined: Vec::new() });
            }
        }
        // What came due (delayed copies, run-out leases) becomes plainly ready, in id order.
        db.prepare_cached(
            "UPDATE messages SET visible_at = 0, lease_owner = NULL
             WHERE queue = ?1 AND visible_at > 0 AND visible_at <= ?2",
        )
        .and_then(|mut s| s.execute(params![queue, now_ms()]))
        .map_err(e)?;
        // The last of the oldest ready messages that fit, by their lengths (read without the
        // bodies): claiming 1,024 large bodies in one statement held them all in memory at once.
        let (mut last, mut total, mut taken, mut full) = (None, 0u64, 0u32, false);
        {
            let mut s = db
                .prepare_cached(
                    "SELECT m.id, length(b.data) FROM messages m LEFT JOIN bodies b ON b.id = m.body
                     WHERE m.queue = ?1 AND m.visible_at = 0 ORDER BY m.id LIMIT ?2",
                )
                .map_err(e)?;
            let mut rows = s.query(params![queue, n]).map_err(e)?;
            while let Some(row) = rows.next().map_err(e)? {
                // No length for a missing body: a damaged row, quarantined below.
                let (id, length): (i64, Option<i64>) = (row.get(0).map_err(e)?, row.get(1).map_err(e)?);
                let length = length.and_then(|l| u64::try_from(l).ok()).unwrap_or(0);
                total = total.saturating_add(if length > max_body { 0 } else { length });
                if last.is_some() && total > bytes {
                    full = true;
                    break;
                }
                (last, taken) = (Some(id), taken + 1);
            }
        }
        full |= taken == n;
        let Some(last) = last else { return Ok(Claimed { rows: Vec::new(), full, quarantined: Vec::new() }) };
        let mut s = db
            .prepare_cached(
                "UPDATE messages SET visible_at = ?3, lease_owner = ?4
                 WHERE queue = ?1 AND visible_at = 0 AND id <= ?2
                 RETURNING id, body, headers, message_id, kind, timestamp, exchange, routing_key, content_type",
            )
            .map_err(e)?;
        let rows =
            s.query_map(params![queue, last, until, owner], read_row).and_then(Iterator::collect::<Result<Vec<_>, _>>);
        let (mut claimed, mut unreadable) = (Vec::new(), Vec::new());
        for (id, mut message, mut faults) in rows.map_err(e)? {
            let (mut body, mut size) = (Bytes::new(), 0);
            if let Body::Stored(reference) = message.body {
                match self.read_body(db, reference, max_body)? {
                    Ok(read) => (body, size) = read,
                    Err((bytes, fault)) => {
                        faults.push(fault);
                        message.body = Body::New(bytes);
                    }
                }
            }
            match faults.is_empty() {
                true => claimed.push(Stored { id, message, body, size }),
                false => unreadable.push((id, message, faults.join("; "))),
            }
        }
        if let Some(n) = self.ready_counts.get_mut(queue) {
            *n = n.saturating_sub((claimed.len() + unreadable.len()) as u64);
        }
        let quarantined = unreadable
            .into_iter()
            .map(|(id, message, fault)| self.quarantine(db, &topology, queue, id, message, fault))
            .collect::<Result<Vec<_>, _>>()?;
        claimed.sort_by_key(|s| s.id);
        // Rows quarantined back into this queue are ready, as may be more behind them.
        Ok(Claimed { rows: claimed, full: full || !quarantined.is_empty(), quarantined })
    }

    /// The body `reference` names and its length, unless it is over `max_body` (then empty);
    /// or, for one that cannot be read, what can be and why not.
    fn read_body(&self, db: &Connection, reference: i64, max_body: u64) -> Result<BodyRead, BrokerError> {
        let max = i64::try_from(max_body).unwrap_or(i64::MAX);
        let mut s = db
            .prepare_cached(
                "SELECT typeof(data), length(data), CASE WHEN typeof(data) <> 'blob' OR length(data) <= ?2 THEN data END
                 FROM bodies WHERE id = ?1",
            )
            .map_err(|e| self.error(e))?;
        let read = s.query_row(params![reference, max], |r| {
            let (kind, length): (String, Option<i64>) = (r.get(0)?, r.get(1)?);
            let size = length.and_then(|l| u64::try_from(l).ok()).unwrap_or(0);
            Ok(match (kind.as_str(), r.get_ref(2)?) {
                ("blob", ValueRef::Blob(b)) => Ok((Bytes::copy_from_slice(b), size)),
                ("blob", _) => Ok((Bytes::new(), size)),
                (kind, value) => Err((bytes_of(value), format!("body {reference}: {kind}, not a blob"))),
            })
        });
        match read.optional().map_err(|e| self.error(e))? {
            Some(read) => Ok(read),
            None => Ok(Err((Bytes::new(), format!("body {reference}: missing")))),
        }
    }

    /// Moves a message row of `queue` that could not be read (`fault`) out of its way, so
    /// that the queue goes on: what could be read of it (`message`), with the dead-letter
    /// headers of reason `internal`, goes to the queue's dead-letter queue, where `sluice dlq`
    /// shows it and can purge it; for a queue without one (a dead-letter queue itself), back
    /// into the queue, readable now. The row goes.
    fn quarantine(
        &mut self,
        db: &Connection,
        t: &Topology<i64>,
        queue: &str,
        id: i64,
        mut message: NewMessage,
        fault: String,
    ) -> Result<Quarantined, BrokerError> {
        let to = t
            .queues
            .get(queue)
            .and_then(|rule| rule.dead_letter.as_ref().filter(|dlq| t.queues.contains_key(*dlq)))
            .map_or_else(|| queue.to_string(), String::clone);
        mark_unreadable(&mut message, id, &fault, queue);
        let body = self.body_id(db, &message.body)?;
        self.insert(db, &to, &message, body, 0)?;
        db.prepare_cached("DELETE FROM messages WHERE id = ?1")
            .and_then(|mut s| s.execute([id]))
            .map_err(|e| self.error(e))?;
        Ok(Quarantined { id, to, fault })
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

    /// Extends `owner`'s leases to `until`, and registers its consumer, extends its
    /// registration (if still there: one removed is never brought back by a renewal sent before
    /// the removal) or removes it (a cancelled or closed consumer no longer counts).
    pub fn renew(
        &self,
        db: &Connection,
        owner: i64,
        queue: &str,
        ids: &[i64],
        until: i64,
        registration: Registration,
    ) -> Result<(), BrokerError> {
        let e = |err| self.error(err);
        match registration {
            Registration::New => {
                // Registrations of consumers that died unclosed (their lease ran out) go.
                db.prepare_cached("DELETE FROM consumers WHERE until <= ?1")
                    .and_then(|mut s| s.execute([now_ms()]))
                    .map_err(e)?;
                db.prepare_cached(
                    "INSERT INTO consumers (owner, queue, until, since, process)
                     VALUES (?1, ?2, ?3, (SELECT coalesce(max(since), 0) + 1 FROM consumers), ?4)
                     ON CONFLICT (owner) DO UPDATE SET until = excluded.until",
                )
                .and_then(|mut s| s.execute(params![owner, queue, until, process()]))
                .map_err(e)?;
            }
            // Its own row only: a scan of every consumer per renewal made idle cost grow with
            // the square of the number of queues.
            Registration::Keep => {
                db.prepare_cached("UPDATE consumers SET until = ?2 WHERE owner = ?1")
                    .and_then(|mut s| s.execute(params![owner, until]))
                    .map_err(e)?;
            }
            Registration::Drop => {
                db.prepare_cached("DELETE FROM consumers WHERE owner = ?1")
                    .and_then(|mut s| s.execute([owner]))
                    .map_err(e)?;
            }
        }
        let mut s =
            db.prepare_cached("UPDATE messages SET visible_at = ?3 WHERE id = ?1 AND lease_owner = ?2").map_err(e)?;
        for id in ids {
            s.execute(params![id, owner, until]).map_err(e)?;
        }
        Ok(())
    }

    /// Hands back, ready at once in their old places, the messages leased to consumers of
    /// processes that no longer run (a `kill -9`), and removes their registrations, so that a
    /// single-active-consumer queue's next consumer takes over at once; the queues whose
    /// messages came back. A consumer whose process cannot be known dead (see [`alive`])
    /// keeps its leases until they run out. Looks at most once per [`RELEASE_EVERY`] (the
    /// first call always: a runner's first registration finds its killed predecessor's).
    pub fn release_the_dead(&mut self, db: &Connection) -> Result<Vec<String>, BrokerError> {
        if self.released_at.is_some_and(|at| at.elapsed() < RELEASE_EVERY) {
            return Ok(Vec::new());
        }
        self.released_at = Some(std::time::Instant::now());
        let e = |err| self.error(err);
        let consumers: Vec<(i64, String, String)> = db
            .prepare_cached("SELECT owner, queue, process FROM consumers WHERE typeof(process) = 'text'")
            .and_then(|mut s| s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?.collect())
            .map_err(e)?;
        let mut known: HashMap<String, bool> = HashMap::new();
        let mut queues = Vec::new();
        for (owner, queue, process) in consumers {
            if *known.entry(process).or_insert_with_key(|p| alive(p)) {
                continue;
            }
            let back = db
                .prepare_cached(
                    "UPDATE messages SET visible_at = 0, lease_owner = NULL WHERE queue = ?1 AND lease_owner = ?2",
                )
                .and_then(|mut s| s.execute(params![queue, owner]))
                .map_err(e)?;
            db.prepare_cached("DELETE FROM consumers WHERE owner = ?1")
                .and_then(|mut s| s.execute([owner]))
                .map_err(e)?;
            if back > 0 {
                queues.push(queue);
            }
        }
        if !queues.is_empty() {
            self.ready_counts.clear();
        }
        Ok(queues)
    }

    /// The messages of `queue` leased to a consumer with the lease still running, and when the
    /// last of those leases ends (ms since the epoch; 0 when there is none).
    pub fn leased(&self, db: &Connection, queue: &str) -> Result<(u32, i64), BrokerError> {
        let (n, until): (i64, Option<i64>) = db
            .prepare_cached(
                "SELECT count(*), max(visible_at) FROM messages
                 WHERE queue = ?1 AND lease_owner IS NOT NULL AND visible_at > ?2",
            )
            .and_then(|mut s| s.query_row(params![queue, now_ms()], |r| Ok((r.get(0)?, r.get(1)?))))
            .map_err(|e| self.error(e))?;
        Ok((u32::try_from(n).unwrap_or(u32::MAX), until.unwrap_or(0)))
    }

    /// Ready messages of `queue` (leased ones and delayed copies not yet due excluded).
    pub fn ready(&self, db: &Connection, queue: &str) -> Result<u32, BrokerError> {
        let n: i64 = db
            .prepare_cached("SELECT count(*) FROM messages WHERE queue = ?1 AND visible_at <= ?2")
            .and_then(|mut s| s.query_row(params![queue, now_ms()], |r| r.get(0)))
            .map_err(|e| self.error(e))?;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Whether `queue` has a message to claim now, and when the next one not yet visible (a
    /// delayed copy, a lease) comes due: two lookups in the queue's index.
    pub fn due(&self, db: &Connection, queue: &str) -> Result<(bool, Option<i64>), BrokerError> {
        let now = now_ms();
        let e = |err| self.error(err);
        let ready = db
            .prepare_cached("SELECT 1 FROM messages WHERE queue = ?1 AND visible_at <= ?2 LIMIT 1")
            .and_then(|mut s| s.exists(params![queue, now]))
            .map_err(e)?;
        let next = db
            .prepare_cached("SELECT min(visible_at) FROM messages WHERE queue = ?1 AND visible_at > ?2")
            .and_then(|mut s| s.query_row(params![queue, now], |r| r.get(0)))
            .map_err(e)?;
        Ok((ready, next))
    }

    /// A number that changes when another connection commits to the file (SQLite's
    /// `data_version`); this connection's own commits leave it as it was.
    pub fn data_version(&self, db: &Connection) -> Result<i64, BrokerError> {
        db.query_row("PRAGMA data_version", [], |r| r.get(0)).map_err(|e| self.error(e))
    }

    /// Ready messages and live consumers (of every process) of `queue`.
    pub fn stats(&mut self, db: &Connection, queue: &str) -> Result<QueueStats, BrokerError> {
        let exists = db
            .prepare_cached("SELECT 1 FROM queues WHERE name = ?1")
            .and_then(|mut s| s.exists([queue]))
            .map_err(|e| self.error(e))?;
        if !exists {
            return Err(self.missing(db, "queue", queue));
        }
        let consumers: i64 = db
            .prepare_cached("SELECT count(*) FROM consumers WHERE queue = ?1 AND until > ?2")
            .and_then(|mut s| s.query_row(params![queue, now_ms()], |r| r.get(0)))
            .map_err(|e| self.error(e))?;
        Ok(QueueStats { ready: self.ready(db, queue)?, consumers: u32::try_from(consumers).unwrap_or(u32::MAX) })
    }

    /// The messages of `queue` after id `after` up to id `last`, in id order, read without
    /// taking them (no lease): at most `n`, and bodies of up to `bytes` in all (a larger first
    /// one alone). A row that cannot be read comes as what can be read of it, marked as the
    /// claim that meets it will [quarantine](Store::quarantine) it (reason `internal`).
    pub fn peek(
        &self,
        db: &Connection,
        queue: &str,
        (after, last): (i64, i64),
        n: u32,
        bytes: u64,
    ) -> Result<Vec<Stored>, BrokerError> {
        let e = |err| self.error(err);
        let mut s = db
            .prepare_cached(
                "SELECT id, body, headers, message_id, kind, timestamp, exchange, routing_key, content_type FROM messages
                 WHERE queue = ?1 AND id > ?2 AND id <= ?3 ORDER BY id LIMIT ?4",
            )
            .map_err(e)?;
        let mut rows = s.query(params![queue, after, last, n]).map_err(e)?;
        let (mut read, mut total) = (Vec::new(), 0u64);
        while let Some(row) = rows.next().map_err(e)? {
            let (id, mut message, mut faults) = read_row(row).map_err(e)?;
            let body = match &message.body {
                Body::Stored(reference) => match self.read_body(db, *reference, u64::MAX)? {
                    Ok((body, _)) => body,
                    Err((body, fault)) => {
                        faults.push(fault);
                        body
                    }
                },
                Body::New(text) => text.clone(),
            };
            if !faults.is_empty() {
                mark_unreadable(&mut message, id, &faults.join("; "), queue);
            }
            let size = body.len() as u64;
            total = total.saturating_add(size);
            read.push(Stored { id, message, body, size });
            if total >= bytes {
                break;
            }
        }
        Ok(read)
    }

    /// Messages of `queue` up to id `last`.
    pub fn count_up_to(&self, db: &Connection, queue: &str, last: i64) -> Result<u32, BrokerError> {
        let n: i64 = db
            .prepare_cached("SELECT count(*) FROM messages WHERE queue = ?1 AND id <= ?2")
            .and_then(|mut s| s.query_row(params![queue, last], |r| r.get(0)))
            .map_err(|e| self.error(e))?;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// The highest message id of `queue` (0 for none).
    pub fn last_id(&self, db: &Connection, queue: &str) -> Result<i64, BrokerError> {
        db.prepare_cached("SELECT coalesce(max(id), 0) FROM messages WHERE queue = ?1")
            .and_then(|mut s| s.query_row([queue], |r| r.get(0)))
            .map_err(|e| self.error(e))
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
        let exchange =
            |name: &str| db.query_row("SELECT kind FROM exchanges WHERE name = ?1", [name], |r| r.get(0)).optional();
        let queue = |name: &str| {
            db.query_row("SELECT declaration FROM queues WHERE name = ?1", [name], |r| r.get(0)).optional()
        };
        let bound = |b: &BindingDecl| {
            let args = serde_json::to_string(&b.arguments).unwrap_or_default();
            db.prepare_cached(
                "SELECT 1 FROM bindings WHERE exchange = ?1 AND queue = ?2 AND routing_key = ?3 AND arguments = ?4",
            )
            .and_then(|mut s| s.exists(params![b.exchange, b.queue, b.routing_key, args]))
        };
        declaration::drift(plan, Some(BROKER), exchange, queue, bound).map_err(|e| self.error(e))
    }

    /// Copies the write-ahead log into the file and cuts it to nothing, after acks freed
    /// pages (at most once a [`reclaim`](Store::reclaim)): otherwise a drained backlog leaves
    /// the log at [`WAL_LIMIT`] until the last connection closes. Skipped, not waited for,
    /// while another process reads (the next reclaim tries again).
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
