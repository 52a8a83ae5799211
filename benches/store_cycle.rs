//! Which store for the embedded broker (issue 12): the cycle every message goes through —
//! published durably, claimed in id order, deleted once handled — on SQLite (WAL,
//! `synchronous = NORMAL`, the broker's own schema and statements) and on fjall (an LSM tree,
//! its journal written to the OS per batch with `PersistMode::Buffer`). Both survive the
//! process being killed and may lose the last commits on power loss, so the durability is the
//! same. Every step is group-committed in batches of `--batch` (256, as the publisher keeps in
//! flight): one transaction (SQLite) or one write batch (fjall) per batch.
//!
//! fjall is measured two ways. "fjall" finds the next messages by scanning the ready index
//! from its start, as the SQL does through its index: a broker must, since messages handed
//! back, delayed copies come due and leases run out put older ids back in front. An LSM tree
//! keeps each deletion as a tombstone until compaction, so that scan walks past them.
//! "fjall-cursor" remembers where the last claim ended (its best case, which a broker could
//! use only alongside a second path for messages that come back).
//!
//! Not a broker (no routing, no leases that expire): a measurement of the store under the
//! broker's access pattern. Run by hand, e.g.
//! `cargo bench --bench store_cycle -- --dir /tmp/store-cycle --runs 3`; bare (as `cargo bench`
//! runs it) it only says so. BENCHMARKS.md has the figures.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use rusqlite::{Connection, params};

#[derive(Debug, Parser)]
struct Args {
    /// An empty directory on the disk to measure (each trial makes and removes its own
    /// subdirectory). Without it, the bench only says how to run it.
    #[arg(long)]
    dir: Option<PathBuf>,
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Trials per store; the order of the stores rotates every run.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Sqlite,
    Fjall,
    FjallCursor,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Sqlite => "sqlite",
            Kind::Fjall => "fjall",
            Kind::FjallCursor => "fjall-cursor",
        }
    }
}

/// One trial's figures.
#[derive(Debug, serde::Serialize)]
struct Trial {
    store: &'static str,
    run: usize,
    messages: u64,
    /// msg/s publishing; then claiming and deleting; and the whole cycle.
    publish_rate: f64,
    consume_rate: f64,
    cycle_rate: f64,
    /// CPU of the whole process (background threads included) per 1,000 messages, whole cycle.
    cpu_ms_per_1k: f64,
    /// Disk space allocated (blocks, not apparent length: fjall preallocates its journal) once
    /// published; once all are deleted; after giving space back (SQLite: `incremental_vacuum`,
    /// as the broker does every second; fjall: 2 s for its background work, then a flush and a
    /// major compaction); and once the store is closed (SQLite checkpoints and deletes its
    /// write-ahead log).
    published_mib: f64,
    deleted_mib: f64,
    reclaimed_mib: f64,
    closed_mib: f64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let Some(root) = &args.dir else {
        eprintln!("store_cycle measures SQLite against fjall on disk: pass --dir DIR (see the file's header)");
        return Ok(());
    };
    std::fs::create_dir_all(root)?;
    // The body the drain benchmark publishes: an envelope of about 230 bytes.
    let body = |i: u64| {
        format!(
            r#"{{"id":"0193a6e2-7c4b-7d3e-9f00-{i:012}","type":"order.created","time":"2026-12-01T20:00:00Z","payload":{{"order_id":{i},"amount_cents":1999,"email":"bench@example.com"}}}}"#
        )
        .into_bytes()
    };
    let mut order = vec![Kind::Sqlite, Kind::Fjall, Kind::FjallCursor];
    let mut trials = Vec::new();
    for run in 1..=args.runs {
        for &kind in &order {
            let dir = root.join(format!("{}-{run}", kind.name()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)?;
            let trial = match kind {
                Kind::Sqlite => sqlite(&dir, &args, run, &body)?,
                Kind::Fjall | Kind::FjallCursor => fjall(&dir, &args, run, kind, &body)?,
            };
            eprintln!("{trial:?}");
            trials.push(trial);
            std::fs::remove_dir_all(&dir)?;
        }
        order.rotate_left(1);
    }
    println!(
        "| store | publish msg/s | claim + delete msg/s | whole cycle msg/s | CPU ms / 1k msgs | MiB published | MiB after deleting | MiB after reclaiming | MiB closed |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for kind in [Kind::Sqlite, Kind::Fjall, Kind::FjallCursor] {
        let of: Vec<&Trial> = trials.iter().filter(|t| t.store == kind.name()).collect();
        let m = |f: fn(&Trial) -> f64| median(of.iter().map(|t| f(t)).collect());
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            kind.name(),
            m(|t| t.publish_rate),
            m(|t| t.consume_rate),
            m(|t| t.cycle_rate),
            m(|t| t.cpu_ms_per_1k),
            m(|t| t.published_mib),
            m(|t| t.deleted_mib),
            m(|t| t.reclaimed_mib),
            m(|t| t.closed_mib),
        );
    }
    println!("\nMedians of {} runs, {} messages in batches of {}.", args.runs, args.messages, args.batch);
    println!("\n```json\n{}\n```", serde_json::to_string_pretty(&trials)?);
    Ok(())
}

/// What a trial measures around the store-specific steps.
struct Clock {
    started: Instant,
    cpu: Duration,
}

impl Clock {
    fn start() -> Clock {
        Clock { started: Instant::now(), cpu: cpu() }
    }
}

#[allow(clippy::too_many_arguments)]
fn trial(
    kind: Kind,
    run: usize,
    n: u64,
    clock: &Clock,
    published_at: Instant,
    sizes: [u64; 4],
    cpu_end: Duration,
    ended: Instant,
) -> Trial {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    Trial {
        store: kind.name(),
        run,
        messages: n,
        publish_rate: n as f64 / (published_at - clock.started).as_secs_f64(),
        consume_rate: n as f64 / (ended - published_at).as_secs_f64(),
        cycle_rate: n as f64 / (ended - clock.started).as_secs_f64(),
        cpu_ms_per_1k: (cpu_end - clock.cpu).as_secs_f64() * 1e6 / n as f64,
        published_mib: mib(sizes[0]),
        deleted_mib: mib(sizes[1]),
        reclaimed_mib: mib(sizes[2]),
        closed_mib: mib(sizes[3]),
    }
}

/// The broker's schema, pragmas and statements (src/broker/embedded/store.rs).
fn sqlite(dir: &Path, args: &Args, run: usize, body: &dyn Fn(u64) -> Vec<u8>) -> anyhow::Result<Trial> {
    let mut db = Connection::open(dir.join("broker.db"))?;
    db.execute_batch("PRAGMA auto_vacuum = INCREMENTAL;")?;
    db.query_row("PRAGMA journal_mode = WAL", [], |r| r.get::<_, String>(0))?;
    db.execute_batch(
        "PRAGMA synchronous = NORMAL;
         CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
             queue TEXT NOT NULL, visible_at INTEGER NOT NULL, lease_owner INTEGER,
             body BLOB NOT NULL, headers TEXT NOT NULL, message_id TEXT, kind TEXT,
             timestamp INTEGER);
         CREATE INDEX messages_due ON messages (queue, visible_at, id);",
    )?;
    let clock = Clock::start();
    let mut i = 0;
    while i < args.messages {
        let tx = db.transaction()?;
        {
            let mut insert = tx.prepare_cached(
                "INSERT INTO messages (queue, visible_at, body, headers, message_id, kind, timestamp)
                 VALUES ('bench.work', 0, ?1, '{}', ?2, 'order.created', NULL)",
            )?;
            for _ in 0..args.batch.min((args.messages - i) as usize) {
                insert.execute(params![body(i), format!("0193a6e2-7c4b-7d3e-9f00-{i:012}")])?;
                i += 1;
            }
        }
        tx.commit()?;
    }
    let published_at = Instant::now();
    let published = dir_bytes(dir);
    let (owner, until) = (42_i64, i64::MAX);
    let mut consumed = 0;
    loop {
        // Claim: one transaction, as the broker's claim is.
        let tx = db.transaction()?;
        let ids: Vec<i64> = {
            let mut claim = tx.prepare_cached(
                "UPDATE messages SET visible_at = ?3, lease_owner = ?4
                 WHERE id IN (SELECT id FROM messages WHERE queue = ?1 AND visible_at = 0 ORDER BY id LIMIT ?2)
                 RETURNING id, body, headers, message_id, kind, timestamp",
            )?;
            let rows = claim.query_map(params!["bench.work", args.batch as i64, until, owner], |r| {
                let _: Vec<u8> = r.get(1)?;
                r.get(0)
            })?;
            rows.collect::<Result<_, _>>()?
        };
        tx.commit()?;
        if ids.is_empty() {
            break;
        }
        consumed += ids.len() as u64;
        // Ack: another.
        let tx = db.transaction()?;
        {
            let mut delete = tx.prepare_cached("DELETE FROM messages WHERE id = ?1 AND lease_owner = ?2")?;
            for id in ids {
                delete.execute(params![id, owner])?;
            }
        }
        tx.commit()?;
    }
    anyhow::ensure!(consumed == args.messages, "sqlite: consumed {consumed} of {}", args.messages);
    let (ended, cpu_end) = (Instant::now(), cpu());
    let deleted = dir_bytes(dir);
    // As the broker's writer does, once a second while acks free pages.
    loop {
        let free: i64 = db.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
        if free <= 256 {
            break;
        }
        let mut vacuum = db.prepare("PRAGMA incremental_vacuum(4096)")?;
        let mut rows = vacuum.query([])?;
        while rows.next()?.is_some() {}
    }
    let reclaimed = dir_bytes(dir);
    drop(db);
    let sizes = [published, deleted, reclaimed, dir_bytes(dir)];
    Ok(trial(Kind::Sqlite, run, args.messages, &clock, published_at, sizes, cpu_end, ended))
}

/// The natural layout on an LSM tree: the messages by id, an index of ready ids, and one of
/// leases; a claim moves ids from ready to leased, an ack removes the message and its lease.
fn fjall(dir: &Path, args: &Args, run: usize, kind: Kind, body: &dyn Fn(u64) -> Vec<u8>) -> anyhow::Result<Trial> {
    let db = Database::builder(dir).open()?;
    let keyspace = |name: &str| -> anyhow::Result<Keyspace> { Ok(db.keyspace(name, KeyspaceCreateOptions::default)?) };
    let (messages, ready, leased) = (keyspace("messages")?, keyspace("ready")?, keyspace("leased")?);
    let batch = || db.batch().durability(Some(PersistMode::Buffer));
    let clock = Clock::start();
    let mut i = 0;
    while i < args.messages {
        let mut b = batch();
        for _ in 0..args.batch.min((args.messages - i) as usize) {
            let key = i.to_be_bytes();
            // The SQL row's other columns, in the value beside the body.
            let mut value = body(i);
            value.extend_from_slice(format!("\0{{}}\00193a6e2-7c4b-7d3e-9f00-{i:012}\0order.created").as_bytes());
            b.insert(&messages, key, value);
            b.insert(&ready, key, []);
            i += 1;
        }
        b.commit()?;
    }
    let published_at = Instant::now();
    let published = dir_bytes(dir);
    let until = u64::MAX.to_be_bytes();
    let mut cursor = 0_u64;
    let mut consumed = 0;
    loop {
        let ids: Vec<[u8; 8]> = {
            let iter = match kind {
                Kind::FjallCursor => ready.range(cursor.to_be_bytes()..),
                _ => ready.iter(),
            };
            iter.take(args.batch).map(|g| Ok(g.key()?.as_ref().try_into()?)).collect::<anyhow::Result<_>>()?
        };
        if ids.is_empty() {
            break;
        }
        let mut claim = batch();
        for id in &ids {
            let _ = messages.get(id)?.ok_or_else(|| anyhow::anyhow!("message missing"))?;
            claim.remove(&ready, *id);
            claim.insert(&leased, *id, until);
        }
        claim.commit()?;
        consumed += ids.len() as u64;
        cursor = u64::from_be_bytes(ids[ids.len() - 1]) + 1;
        let mut ack = batch();
        for id in &ids {
            ack.remove(&messages, *id);
            ack.remove(&leased, *id);
        }
        ack.commit()?;
    }
    anyhow::ensure!(consumed == args.messages, "fjall: consumed {consumed} of {}", args.messages);
    let (ended, cpu_end) = (Instant::now(), cpu());
    let deleted = dir_bytes(dir);
    std::thread::sleep(Duration::from_secs(2));
    for k in [&messages, &ready, &leased] {
        k.rotate_memtable_and_wait()?;
        k.major_compact()?;
    }
    let reclaimed = dir_bytes(dir);
    drop((messages, ready, leased));
    drop(db);
    let sizes = [published, deleted, reclaimed, dir_bytes(dir)];
    Ok(trial(kind, run, args.messages, &clock, published_at, sizes, cpu_end, ended))
}

/// Bytes allocated to the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

/// CPU (user + system) of this process so far, every thread.
fn cpu() -> Duration {
    // SAFETY: getrusage only writes the struct we pass; a zeroed rusage is a valid value.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
