//! A damaged embedded broker (issue 19) with real `sluice` processes: a stored message that
//! cannot be read is quarantined (to its queue's dead-letter queue, reason `internal`) while
//! the queue goes on; a file that is not a usable SQLite database ends `sluice run` with an
//! error saying what to do, instead of a reconnect loop; a write-ahead log (or the file)
//! deleted under a live runner is noticed, what was committed is kept, and the runner stops.

use crate::support;

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use sluice::envelope::Envelope;
use support::*;

/// The broker's file in `place`.
fn file(place: &EmbeddedDir) -> PathBuf {
    Path::new(&place.url()).join(sluice::broker::embedded::FILE)
}

/// Writes a message row straight into the broker's file, as no sluice process would: `body`,
/// `headers` and `timestamp` are SQL expressions.
fn insert_row(place: &EmbeddedDir, queue: &str, body: &str, headers: &str, timestamp: &str) {
    let db = rusqlite::Connection::open(file(place)).expect("open the broker's file");
    db.busy_timeout(Duration::from_secs(30)).expect("busy timeout");
    let sql = format!(
        "INSERT INTO messages (queue, visible_at, body, headers, timestamp) VALUES (?1, 0, {body}, {headers}, {timestamp})"
    );
    db.execute(&sql, [queue]).unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Lets the broker's `messages` table hold a NULL body, as a damaged file may (its schema
/// says NOT NULL).
fn allow_null_bodies(place: &EmbeddedDir) {
    let db = rusqlite::Connection::open(file(place)).expect("open the broker's file");
    db.execute_batch(
        "PRAGMA writable_schema = ON;
         UPDATE sqlite_schema SET sql = replace(sql, 'body BLOB NOT NULL', 'body BLOB') WHERE name = 'messages';
         PRAGMA writable_schema = OFF;",
    )
    .expect("relax the schema");
}

/// An envelope's body as an SQL blob literal.
fn blob(envelope: &Envelope) -> String {
    let hex: String = envelope.encode().iter().map(|b| format!("{b:02x}")).collect();
    format!("x'{hex}'")
}

/// The error line `sluice` printed last (its own, after the logs).
fn error_line(log: &str) -> &str {
    log.lines().rev().find(|l| l.starts_with("error: ")).unwrap_or_default()
}

/// Runs `sluice ARGS --broker URL` off the async runtime (the receiver keeps serving); its
/// stdout, once it has succeeded.
async fn cli(args: &[&str], place: &EmbeddedDir) -> String {
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.extend(["--broker".into(), place.url()]);
    let done = tokio::task::spawn_blocking(move || {
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        sluice_cli(&all, &[], Duration::from_secs(60))
    })
    .await
    .expect("cli task");
    assert_eq!(done.code, Some(0), "sluice {args:?}\nstdout: {}\nstderr: {}", done.stdout, done.stderr);
    done.stdout
}

/// `sluice dlq ARGS` on the pipeline in `dir`; its stdout.
async fn dlq(args: &[&str], dir: &Path, place: &EmbeddedDir) -> String {
    let dir = dir.display().to_string();
    let all: Vec<&str> = ["dlq"].iter().chain(args).chain(&["--pipelines", dir.as_str()]).copied().collect();
    cli(&all, place).await
}

/// Publishes a message with idempotency key `key` through `sluice publish`, which confirms it
/// and exits; the key.
async fn publish_cli(place: &EmbeddedDir, key: &str) -> String {
    let args = ["publish", "--exchange", "ev", "--routing-key", "x", "--type", "test.event", "--payload", "{}"];
    cli(&[&args[..], &["--idempotency-key", key]].concat(), place).await;
    key.to_string()
}

/// Issue 19: rows of `work` that cannot be read (headers that are not JSON, a body that is not
/// a blob or NULL, a negative timestamp) go to `work.dlq` with reason `internal`, and the messages
/// around them are handled; one in `work.dlq` itself is listed there with the same reason.
/// (Each failed the claim of its queue, whose error ended the session of every queue: the
/// runner reconnected in a loop and handled nothing, and no command could remove the row.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_that_cannot_be_read_are_quarantined_and_the_queue_goes_on() {
    let place = EmbeddedDir::new();
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let mut keys = BTreeSet::new();
    for i in 0..3 {
        publish(&broker, "ev", "x", &format!("before-{i}"), json!({"n": i})).await;
        keys.insert(format!("before-{i}"));
    }
    let bad = |n: usize| Envelope::new("test.event", &json!({"bad": n}), Some(format!("bad-{n}")));
    insert_row(&place, "work", &blob(&bad(1)), "'{not json'", "NULL");
    insert_row(&place, "work", "42", "'{}'", "NULL");
    insert_row(&place, "work", &blob(&bad(3)), "'{}'", "-5");
    allow_null_bodies(&place);
    insert_row(&place, "work", "NULL", "'{}'", "NULL");
    insert_row(&place, "work.dlq", &blob(&bad(4)), "x'00ff'", "NULL");
    for i in 0..3 {
        publish(&broker, "ev", "x", &format!("after-{i}"), json!({"n": i})).await;
        keys.insert(format!("after-{i}"));
    }
    drop(broker);

    let mut runner = Sluice::run(dir.path(), &place.url(), &[]);
    wait_until(Duration::from_secs(30), "the readable messages handled", || async {
        receiver.succeeded_keys() == keys
    })
    .await;
    wait_until(Duration::from_secs(30), "the unreadable rows out of work", || async { place.depth("work").await == 0 })
        .await;
    assert!(runner.is_running(), "the runner goes on; log:\n{}", runner.log());

    let listed: Vec<Value> =
        serde_json::from_str(&dlq(&["list", "work", "--format", "json"], dir.path(), &place).await).expect("JSON");
    let reasons: Vec<&str> = listed.iter().filter_map(|e| e["reason"].as_str()).collect();
    assert_eq!(reasons, ["internal"; 5], "{listed:?}");
    let keys: BTreeSet<&str> = listed.iter().filter_map(|e| e["idempotency_key"].as_str()).collect();
    assert_eq!(keys, BTreeSet::from(["bad-1", "bad-3", "bad-4"]), "what could be read of them is kept: {listed:?}");
    let purged = dlq(&["purge", "work", "--reason", "internal", "--yes"], dir.path(), &place).await;
    assert!(purged.starts_with("5 message(s) purged"), "{purged}");
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "log:\n{}", runner.log());
}

/// Issue 19: `sluice run` on a file that is not an SQLite database exits at once with an error
/// naming the file and what to do. (It retried forever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_that_is_not_a_database_ends_the_run_with_a_clear_error() {
    let place = EmbeddedDir::new();
    let dir = work_pipeline("    handler:\n      webhook: {url: \"http://127.0.0.1:9/hook\"}\n");
    std::fs::create_dir_all(place.url()).expect("broker dir");
    std::fs::write(file(&place), "not a database\n".repeat(1000)).expect("write");
    let mut runner = Sluice::run(dir.path(), &place.url(), &[]);
    assert_eq!(runner.wait(Duration::from_secs(30)), Some(1), "log:\n{}", runner.log());
    let log = runner.log();
    let error = error_line(&log);
    assert!(error.contains(&file(&place).display().to_string()), "{log}");
    assert!(error.contains("not a usable SQLite database") && error.contains("move it aside"), "{log}");
}

/// Empties the write-ahead log into the broker's file, which no other process is using.
fn checkpoint(place: &EmbeddedDir) {
    let db = rusqlite::Connection::open(file(place)).expect("open");
    db.busy_timeout(Duration::from_secs(30)).expect("busy timeout");
    let busy: i64 = db.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0)).expect("checkpoint");
    assert_eq!(busy, 0, "the whole log copied into the file");
}

/// A pipeline with 300 messages in `work`, whose broker's file then has the bytes `garbage`
/// (of the file's length) overwritten with garbage.
async fn damaged(place: &EmbeddedDir, garbage: fn(usize) -> Range<usize>) -> (Receiver, tempfile::TempDir) {
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for i in 0..300 {
        publish(&broker, "ev", "x", &format!("k{i}"), json!({"pad": "x".repeat(2000)})).await;
    }
    drop(broker);
    checkpoint(place);
    let mut bytes = std::fs::read(file(place)).expect("read");
    let garbage = garbage(bytes.len());
    bytes[garbage].iter_mut().for_each(|b| *b = 0x55);
    std::fs::write(file(place), bytes).expect("write");
    (receiver, dir)
}

/// Issue 19: a file damaged in the middle (pages of messages overwritten) ends the run with
/// the same error once the runner, handling the messages before them, reads there. (The session was lost and opened again,
/// forever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_damaged_in_the_middle_ends_the_run_with_a_clear_error() {
    let place = EmbeddedDir::new();
    let (_receiver, dir) = damaged(&place, |len| len / 3..len * 2 / 3).await;
    let mut runner = Sluice::run(dir.path(), &place.url(), &[]);
    assert_eq!(runner.wait(Duration::from_secs(60)), Some(1), "log:\n{}", runner.log());
    let log = runner.log();
    assert!(error_line(&log).contains("not a usable SQLite database"), "{log}");
}

/// Runs `sluice ARGS --broker URL` to completion, off the async runtime.
async fn attempt(args: &[&str], place: &EmbeddedDir) -> Finished {
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.extend(["--broker".into(), place.url()]);
    tokio::task::spawn_blocking(move || {
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        sluice_cli(&all, &[], Duration::from_secs(60))
    })
    .await
    .expect("cli task")
}

/// Issue 31 (left by round 3): once `run` has found the file damaged, `publish` refuses to
/// confirm a message into it and `status` to read it, each naming the file and what to do;
/// once the file is moved aside as the error says, `run` starts an empty broker that takes
/// messages again. (Both went on: `publish` confirmed messages into a file no runner could
/// read, and `status` showed its counts.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_status_refuse_a_file_run_found_damaged() {
    let place = EmbeddedDir::new();
    // One garbage page among the messages' bodies, where `run` reads and `publish` does not.
    let (_receiver, dir) = damaged(&place, |len| len / 2 / 4096 * 4096..len / 2 / 4096 * 4096 + 4096).await;
    let mut runner = Sluice::run(dir.path(), &place.url(), &[]);
    assert_eq!(runner.wait(Duration::from_secs(60)), Some(1), "log:\n{}", runner.log());
    assert!(error_line(&runner.log()).contains("not a usable SQLite database"), "{}", runner.log());
    let shown = file(&place).display().to_string();
    let publish = ["publish", "--exchange", "ev", "--routing-key", "x", "--type", "test.event", "--payload", "{}"];
    let pipelines = dir.path().display().to_string();
    for args in [&publish[..], &["status", &pipelines]] {
        let refused = attempt(args, &place).await;
        assert_eq!(refused.code, Some(1), "{args:?} refused\nstdout: {}\nstderr: {}", refused.stdout, refused.stderr);
        let error = error_line(&refused.stderr);
        assert!(
            error.contains(&shown) && error.contains("damaged") && error.contains("move it aside"),
            "{args:?}: {error}"
        );
    }

    // As the error says: the file and its -wal and -shm files.
    for suffix in ["", "-wal", "-shm"] {
        let (from, to) = (format!("{shown}{suffix}"), format!("{shown}.bad{suffix}"));
        if Path::new(&from).exists() {
            std::fs::rename(&from, &to).expect("move aside");
        }
    }
    let fresh = attempt(&["run", &pipelines, "--exit-when-idle"], &place).await;
    assert_eq!(fresh.code, Some(0), "an empty broker: {}", fresh.stderr);
    let published = attempt(&publish, &place).await;
    assert_eq!(published.code, Some(0), "{}", published.stderr);
}

/// A runner on 40 messages published before it started (keys `k0`..), handling them one at
/// a time, 100 ms each, and 5 handled: most are still to handle when a test deletes a file.
struct Busy {
    receiver: Receiver,
    dir: tempfile::TempDir,
    keys: BTreeSet<String>,
    runner: Sluice,
}

impl Busy {
    async fn start(place: &EmbeddedDir) -> Busy {
        let receiver = Receiver::start(|_, _| Reply::ok().after(Duration::from_millis(100))).await;
        let dir = webhook_pipeline(&receiver, "    concurrency: 1\n");
        let broker = place.connect().await;
        declare(dir.path(), &broker).await;
        let keys: BTreeSet<String> = (0..40).map(|i| format!("k{i}")).collect();
        for key in &keys {
            publish(&broker, "ev", "x", key, json!({})).await;
        }
        drop(broker);
        // All in the file, none in the write-ahead log alone, before the runner starts.
        checkpoint(place);
        let runner = Sluice::run(dir.path(), &place.url(), &[]);
        receiver.wait_for(5, Duration::from_secs(30)).await;
        Busy { receiver, dir, keys, runner }
    }
}

/// Issue 19: a write-ahead log deleted under a live runner is noticed: what was committed is
/// copied into the file, the runner stops with an error (for its supervisor to start it
/// again), the broker takes publishes again, and the next runner handles every message whose
/// publish was confirmed, those confirmed just before the deletion included. (The runner went
/// on unaware, writing into the deleted log, where what was committed since the last
/// checkpoint was lost once the process ended without a clean close, and other processes'
/// publishes failed with "disk I/O error" meanwhile.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_ahead_log_deleted_under_a_live_runner_is_noticed_and_nothing_confirmed_is_lost() {
    let place = EmbeddedDir::new();
    let Busy { receiver, dir, mut keys, mut runner } = Busy::start(&place).await;
    // Confirmed just before the log goes: in the log alone until the next checkpoint.
    for i in 0..5 {
        keys.insert(publish_cli(&place, &format!("before-{i}")).await);
    }
    let wal = PathBuf::from(format!("{}-wal", file(&place).display()));
    std::fs::remove_file(&wal).expect("delete the write-ahead log");
    assert_eq!(runner.wait(Duration::from_secs(30)), Some(1), "the runner stops; log:\n{}", runner.log());
    let log = runner.log();
    assert!(error_line(&log).contains("write-ahead log") && error_line(&log).contains("start sluice again"), "{log}");
    // Once it has stopped, the broker takes messages again.
    for i in 0..5 {
        keys.insert(publish_cli(&place, &format!("after-{i}")).await);
    }

    let mut again = Sluice::run(dir.path(), &place.url(), &[]);
    wait_until(Duration::from_secs(90), "every confirmed message handled", || async {
        receiver.succeeded_keys().is_superset(&keys)
    })
    .await;
    assert_eq!(again.stop(Duration::from_secs(30)), Some(0), "log:\n{}", again.log());
}

/// Issue 19: the broker's file deleted under a live runner is noticed too: what it held is
/// saved as a copy beside it, the runner stops with an error naming the copy, and once the
/// copy is put back a runner handles every message. (The runner went on in a file no other
/// process could see, and all it held went with it at the next restart.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_deleted_under_a_live_runner_is_saved_as_a_copy_and_the_runner_stops() {
    let place = EmbeddedDir::new();
    let Busy { receiver, dir, keys, mut runner } = Busy::start(&place).await;
    std::fs::remove_file(file(&place)).expect("delete the broker's file");
    assert_eq!(runner.wait(Duration::from_secs(30)), Some(1), "the runner stops; log:\n{}", runner.log());
    let log = runner.log();
    let copies: Vec<PathBuf> = std::fs::read_dir(place.url())
        .expect("broker dir")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.display().to_string().contains(".rescued-"))
        .collect();
    let [copy] = &copies[..] else { panic!("one copy beside the file: {copies:?}; log:\n{log}") };
    assert!(error_line(&log).contains(&copy.display().to_string()), "the error names the copy: {log}");

    std::fs::rename(copy, file(&place)).expect("put the copy back");
    let mut again = Sluice::run(dir.path(), &place.url(), &[]);
    wait_until(Duration::from_secs(90), "every message handled", || async { receiver.succeeded_keys() == keys }).await;
    assert_eq!(again.stop(Duration::from_secs(30)), Some(0), "log:\n{}", again.log());
}

/// Issue 31 (left by round 3): a write-ahead log truncated to nothing under a live runner is
/// noticed as a deleted one is: the runner stops with an error naming the log (for its
/// supervisor to start it again) without copying what is left of the log into the file, the
/// broker takes publishes again, and the next runner handles every message whose publish was
/// confirmed (what the runner did since the last checkpoint went with the log: the messages
/// it had acked come back, and are handled again). (The runner went on unaware, writing
/// after a hole where the log had been.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_ahead_log_truncated_under_a_live_runner_is_noticed_and_nothing_confirmed_is_lost() {
    let place = EmbeddedDir::new();
    let Busy { receiver, dir, mut keys, mut runner } = Busy::start(&place).await;
    let wal = PathBuf::from(format!("{}-wal", file(&place).display()));
    {
        // A reader holds the log's frames where they are (the runner's checkpoints, which
        // would empty it, wait for readers), so that the runner's acks are in it.
        let reader = rusqlite::Connection::open(file(&place)).expect("open");
        reader.execute_batch("BEGIN; SELECT count(*) FROM messages;").expect("a read transaction");
        wait_until(Duration::from_secs(30), "the runner's acks in the log", || async {
            std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0)
        })
        .await;
        std::fs::OpenOptions::new().write(true).open(&wal).expect("open the log").set_len(0).expect("truncate");
    }
    assert_eq!(runner.wait(Duration::from_secs(30)), Some(1), "the runner stops; log:\n{}", runner.log());
    let log = runner.log();
    let error = error_line(&log);
    assert!(
        error.contains("write-ahead log") && error.contains("truncated") && error.contains("start sluice again"),
        "{log}"
    );
    for i in 0..5 {
        keys.insert(publish_cli(&place, &format!("after-{i}")).await);
    }

    let mut again = Sluice::run(dir.path(), &place.url(), &[]);
    wait_until(Duration::from_secs(90), "every confirmed message handled", || async {
        receiver.succeeded_keys().is_superset(&keys)
    })
    .await;
    assert_eq!(again.stop(Duration::from_secs(30)), Some(0), "log:\n{}", again.log());
}
