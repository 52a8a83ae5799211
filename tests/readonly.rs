//! The read-only commands (`sluice status`, `sluice dlq list`, `sluice dlq show`) on the
//! embedded broker read its file without writing: they work on a file and directory no one
//! may write (run as `nobody` through `setpriv`: the tests run as root, whom permissions do
//! not stop), and on a live broker's file they take no lease and write nothing.

use crate::support;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use sluice::broker::{Broker as _, Credit};
use support::{EmbeddedDir, Place};

/// A dead letter of 90 s ago, reason `exhausted`, after 3 attempts, in `work.dlq`.
async fn plant<B: sluice::broker::Publish>(broker: &B, key: &str) -> String {
    crate::dlq::plant(broker, key, "exhausted", Duration::from_secs(90)).await
}

/// The files of the broker's directory and their bytes.
fn contents(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("read the broker's directory")
        .map(|e| e.expect("entry").path())
        .map(|p| {
            let bytes = std::fs::read(&p).expect("read a broker file");
            (p, bytes)
        })
        .collect();
    files.sort();
    files
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Runs `sluice ARGS` as `nobody`, who may not write the broker's directory or files.
fn as_nobody(args: &[&str]) -> (bool, String, String) {
    let out = Command::new("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", env!("CARGO_BIN_EXE_sluice")])
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run setpriv (util-linux)");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// Two pipeline messages ready and two dead letters, the broker closed: a stopped runner's
/// file.
async fn stopped_broker(place: &EmbeddedDir, pipelines: &Path) -> Vec<String> {
    let broker = place.connect().await;
    support::declare(pipelines, &broker).await;
    support::publish(&broker, "ev", "x", "ready-1", json!({})).await;
    support::publish(&broker, "ev", "x", "ready-2", json!({})).await;
    let ids = vec![plant(&broker, "key-1").await, plant(&broker, "key-2").await];
    broker.close().await;
    drop(broker);
    // Its writer thread checkpoints the log into the file and deletes it as it ends.
    let wal = Path::new(&place.url()).join(format!("{}-wal", sluice::broker::embedded::FILE));
    support::wait_until(Duration::from_secs(10), "the broker's writer ends", || async { !wal.exists() }).await;
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_dlq_read_a_broker_file_no_one_may_write() {
    let place = EmbeddedDir::new();
    let pipelines = support::work_pipeline("    handler:\n      webhook: {url: \"http://127.0.0.1:9/hook\"}\n");
    let ids = stopped_broker(&place, pipelines.path()).await;
    let broker_dir = PathBuf::from(place.url());
    // Readable by nobody, writable by no one but root.
    chmod(place.dir.path(), 0o755);
    chmod(pipelines.path(), 0o755);
    for (file, _) in contents(&broker_dir) {
        chmod(&file, 0o444);
    }
    chmod(&broker_dir, 0o555);
    let before = contents(&broker_dir);
    let (url, d) = (place.url(), pipelines.path().to_str().expect("utf-8 path"));

    let (ok, stdout, stderr) =
        as_nobody(&["dlq", "list", "work", "--pipelines", d, "--format", "json", "--broker", &url]);
    assert!(ok, "dlq list: {stderr}");
    let listed: Vec<Value> = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let listed: Vec<&str> = listed.iter().map(|e| e["id"].as_str().expect("id")).collect();
    assert_eq!(listed, ids, "every dead letter, in order");

    let (ok, stdout, stderr) =
        as_nobody(&["dlq", "show", "work", &ids[1], "--pipelines", d, "--format", "json", "--broker", &url]);
    assert!(ok, "dlq show: {stderr}");
    let shown: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(shown["body"]["idempotency_key"], "key-2");
    assert_eq!(shown["headers"]["x-sluice-source-queue"], "work");
    assert_eq!(shown["attempts"], 3);

    let (ok, stdout, stderr) = as_nobody(&["status", d, "--format", "json", "--broker", &url]);
    assert!(ok, "status: {stderr}");
    let status: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let row = &status["queues"][0];
    assert_eq!(
        (row["queue"].as_str(), row["ready"].as_u64(), row["dead_lettered"].as_u64()),
        (Some("work"), Some(2), Some(2))
    );
    assert!(row["oldest_dead_letter_age_seconds"].as_u64().is_some_and(|a| (89..120).contains(&a)), "{row}");

    let after = contents(&broker_dir);
    let names = |files: &[(PathBuf, Vec<u8>)]| files.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>();
    assert_eq!(names(&after), names(&before));
    assert!(after == before, "the broker's files changed");
    // A missing file is still said so, and nothing is made.
    let missing = place.dir.path().join("nowhere");
    let (ok, _, stderr) = as_nobody(&["status", d, "--broker", missing.to_str().expect("utf-8")]);
    assert!(!ok && stderr.contains("no broker there"), "{stderr}");
    assert!(!missing.exists());
    chmod(&broker_dir, 0o755);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_on_a_live_broker_takes_no_lease_and_writes_nothing() {
    let place = EmbeddedDir::new();
    let pipelines = support::work_pipeline("    handler:\n      webhook: {url: \"http://127.0.0.1:9/hook\"}\n");
    // The broker stays open in this process, as a runner's would.
    let broker = place.connect().await;
    support::declare(pipelines.path(), &broker).await;
    let ids = vec![plant(&broker, "key-1").await, plant(&broker, "key-2").await, plant(&broker, "key-3").await];
    let file = Path::new(&place.url()).join(sluice::broker::embedded::FILE);
    let wal = PathBuf::from(format!("{}-wal", file.display()));
    let rows = || {
        let db = rusqlite::Connection::open_with_flags(&file, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("open the broker's file");
        let mut s = db.prepare("SELECT id, visible_at, lease_owner, headers FROM messages ORDER BY id").expect("sql");
        let rows = s.query_map([], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, Option<i64>>(2)?, r.get::<_, String>(3)?))
        });
        rows.expect("rows").collect::<Result<Vec<_>, _>>().expect("rows")
    };
    let (rows_before, wal_before) = (rows(), std::fs::read(&wal).expect("the write-ahead log"));
    let (url, d) = (place.url(), pipelines.path().to_str().expect("utf-8 path"));
    for args in [
        vec!["dlq", "list", "work", "--pipelines", d, "--format", "json"],
        vec!["dlq", "show", "work", &ids[0], "--pipelines", d],
        vec!["status", d],
    ] {
        let mut args = args.clone();
        args.extend(["--broker", &url]);
        let finished = tokio::task::block_in_place(|| support::sluice_cli(&args, &[], Duration::from_secs(60)));
        assert_eq!(finished.code, Some(0), "{}", finished.stderr);
        assert_eq!(place.leased("work.dlq"), 0);
    }
    assert_eq!(rows(), rows_before, "order, visibility, leases and headers untouched");
    assert!(std::fs::read(&wal).expect("the write-ahead log") == wal_before, "nothing written");
    // The live broker goes on: its consumer gets the dead letters in order.
    let (mut deliveries, consumer) = broker.consume("work.dlq", Credit::at_most(10)).await.expect("consume");
    for id in &ids {
        use futures_util::StreamExt as _;
        use sluice::broker::Delivery as _;
        let delivery = tokio::time::timeout(Duration::from_secs(10), deliveries.next()).await.expect("delivered");
        let delivery = delivery.expect("open").expect("delivery");
        assert_eq!(delivery.message_id(), Some(id.as_str()));
    }
    sluice::broker::Consumer::close(&consumer).await;
    broker.close().await;
}
