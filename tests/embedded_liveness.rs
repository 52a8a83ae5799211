//! The embedded broker kept live (issue 19) with real `sluice` processes: acks that fail while
//! another process holds the broker's write lock past the busy timeout, and `sluice dlq` on a
//! dead-letter queue of large messages.
//!
//! What the ack tests guarantee: nothing is lost, and a message whose handler ran is not run
//! again. While acks are retried (up to 30 s) the runner holds the messages it handled; past
//! that the session ends and they come back, and the idempotency keys the runner recorded
//! before acking make them duplicates, acked without calling the receiver again.

use crate::support;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use sluice::broker::{Broker, HeaderValue, Headers, Outgoing, Publish};
use sluice::envelope::{self, Envelope};
use support::*;

/// Another process's write transaction on the embedded broker's file, held until dropped.
struct WriteLock {
    _transaction: rusqlite::Connection,
}

impl WriteLock {
    fn take(place: &EmbeddedDir) -> WriteLock {
        let path = Path::new(&place.url()).join(sluice::broker::embedded::FILE);
        let db = rusqlite::Connection::open(&path).expect("open the broker's file");
        // The runner may be committing right now.
        db.busy_timeout(Duration::from_secs(30)).expect("busy timeout");
        db.execute_batch("BEGIN IMMEDIATE").expect("take the write lock");
        WriteLock { _transaction: db }
    }
}

/// `/readyz` of the runner at `admin`: status and body (None while it does not answer).
async fn readyz(admin: &str) -> Option<(u16, String)> {
    let response = http().get(format!("http://{admin}/readyz")).send().await.ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

/// A runner (`concurrency: 4`, an admin port) on `n` messages published before it starts, whose
/// receiver holds the first four requests 3 s: time to take the write lock while they run. Once
/// it is taken, their acks fail after the 10 s busy timeout.
struct Stalled {
    place: EmbeddedDir,
    receiver: Receiver,
    runner: Sluice,
    admin: String,
    lock: WriteLock,
    _dir: tempfile::TempDir,
}

impl Stalled {
    async fn start(n: usize) -> Stalled {
        let place = EmbeddedDir::new();
        let first = AtomicUsize::new(0);
        let receiver = Receiver::start(move |_, _| {
            if first.fetch_add(1, Ordering::SeqCst) < 4 {
                Reply::ok().after(Duration::from_secs(3))
            } else {
                Reply::ok()
            }
        })
        .await;
        let dir = webhook_pipeline(&receiver, "    concurrency: 4\n");
        let broker = place.connect().await;
        declare(dir.path(), &broker).await;
        for i in 0..n {
            publish(&broker, "ev", "x", &format!("k{i}"), json!({"n": i})).await;
        }
        broker.close().await;
        let admin = format!("127.0.0.1:{}", free_port());
        let runner = Sluice::run(dir.path(), &place.url(), &["--admin", &admin]);
        receiver.wait_for(4, Duration::from_secs(30)).await;
        let lock = WriteLock::take(&place);
        Stalled { place, receiver, runner, admin, lock, _dir: dir }
    }

    /// Waits until `/readyz` answers 503 with a body containing `text`; whether it did in time.
    async fn unready_saying(&self, text: &str, deadline: Duration) -> bool {
        let start = std::time::Instant::now();
        while start.elapsed() < deadline {
            if readyz(&self.admin).await.is_some_and(|(status, body)| status == 503 && body.contains(text)) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// Releases the lock, then checks that all `n` messages are handled, each once, the runner
    /// ready again and the queues empty, and that it stops cleanly.
    async fn release_and_drain(self, n: usize) {
        let Stalled { place, receiver, mut runner, admin, lock, _dir } = self;
        drop(lock);
        wait_until(Duration::from_secs(90), "every message handled", || async { receiver.succeeded_keys().len() == n })
            .await;
        wait_until(Duration::from_secs(30), "/readyz ready again", || async {
            readyz(&admin).await.is_some_and(|(status, _)| status == 200)
        })
        .await;
        assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "clean exit; log:\n{}", runner.log());
        let per_key = counts(receiver.hits().iter().map(|h| h.key().to_string()));
        assert_eq!(per_key.len(), n, "every key reached the receiver");
        let twice: Vec<_> = per_key.iter().filter(|(_, count)| **count > 1).collect();
        assert!(twice.is_empty(), "handled twice: {twice:?}; log:\n{}", runner.log());
        assert_eq!((place.depth("work").await, place.depth("work.dlq").await), (0, 0), "nothing left behind");
    }
}

/// Issue 19: acks that fail while another process holds the write lock past the busy timeout
/// are retried once it is released, `/readyz` saying meanwhile that they fail: every message is
/// handled, none twice. (Each failed ack kept its prefetch slot until a restart: with all four
/// taken, the queue stalled for good while `/readyz` said ready.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_failing_under_a_held_write_lock_are_retried_and_the_queue_drains() {
    const N: usize = 40;
    let stalled = Stalled::start(N).await;
    // Released as soon as an ack has failed (or after a minute without a sign of one).
    let said = stalled.unready_saying("acks failing", Duration::from_secs(60)).await;
    let log = stalled.runner.log();
    stalled.release_and_drain(N).await;
    assert!(said, "/readyz never said the acks were failing; log:\n{log}");
}

/// Issue 19: acks that keep failing past the retry bound end the session, as a failed claim
/// does: the runner reconnects (not ready meanwhile), and the messages it held come back to a
/// consumer able to settle them; their recorded keys keep the receiver from a second call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_failing_past_the_bound_end_the_session_and_nothing_stays_leased() {
    const N: usize = 20;
    let stalled = Stalled::start(N).await;
    let said = stalled.unready_saying("acks failing", Duration::from_secs(60)).await;
    // Held until the runner has given up on this session (30 s of failing acks).
    let ended = said && stalled.unready_saying("not connected", Duration::from_secs(90)).await;
    let log = stalled.runner.log();
    stalled.release_and_drain(N).await;
    assert!(said && ended, "/readyz said acks failing: {said}, then not connected: {ended}; log:\n{log}");
}

/// Writes `n` dead letters of about `size` bytes each into `work.dlq`; their ids, in order.
/// The padding is copied into each encoded envelope, not serialized with it: serializing
/// 1 MiB strings byte by byte in a test build took a third of the test's time.
async fn plant_large<B: Publish>(broker: &B, n: usize, size: usize) -> Vec<String> {
    const EMPTY_PAD: &[u8] = br#""pad":"""#;
    let pad = "x".repeat(size);
    let mut ids = Vec::new();
    for i in 0..n {
        let key = format!("big-{i}");
        let envelope = Envelope::new("test.event", &json!({"n": i, "pad": ""}), Some(key));
        let small = envelope.encode();
        let at =
            small.windows(EMPTY_PAD.len()).position(|w| w == EMPTY_PAD).expect("an empty pad") + EMPTY_PAD.len() - 1;
        let body = [&small[..at], pad.as_bytes(), &small[at..]].concat();
        let headers = Headers::from([
            (envelope::REASON_HEADER.to_string(), HeaderValue::Str("exhausted".into())),
            (envelope::SOURCE_QUEUE_HEADER.to_string(), HeaderValue::Str("work".into())),
        ]);
        let message = Outgoing {
            body,
            message_id: Some(envelope.id.clone()),
            kind: Some(envelope.kind.clone()),
            headers,
            ..Default::default()
        };
        broker.publish("", "work.dlq", message).await.expect("plant a dead letter");
        ids.push(envelope.id.clone());
    }
    ids
}

/// Issue 19: `sluice dlq` sees and acts on every message of a dead-letter queue of 120 × 1 MiB,
/// its memory bounded by a few of them. (From 100 × 1 MB, `list` showed nothing, `show` found
/// nothing, `redrive` and `purge` did nothing: one claim read 1,024 rows with their bodies,
/// which took longer than the 3 s a browse waited for the next message, and held them all.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_tools_see_and_act_on_every_message_of_a_dead_letter_queue_of_large_messages() {
    const N: usize = 120;
    const MIB: usize = 1 << 20;
    let place = EmbeddedDir::new();
    let dir = work_pipeline("    handler:\n      webhook: {url: \"http://127.0.0.1:9/hook\"}\n");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let ids = plant_large(&broker, N, MIB).await;
    let (url, d) = (place.url(), dir.path().to_str().expect("utf-8 path").to_string());
    let dlq = |args: &[&str]| {
        let mut all = vec!["dlq"];
        all.extend_from_slice(args);
        all.extend(["--pipelines", d.as_str(), "--broker", url.as_str()]);
        let done = sluice_cli(&all, &[], Duration::from_secs(300));
        assert_eq!(done.code, Some(0), "sluice {all:?}: {}", done.stderr);
        done
    };

    let listed = dlq(&["list", "work", "--format", "json"]);
    let entries: Vec<Value> = serde_json::from_str(&listed.stdout).expect("JSON");
    let listed_ids: Vec<&str> = entries.iter().filter_map(|e| e["id"].as_str()).collect();
    assert_eq!(listed_ids, ids, "every message, in order; stderr: {}", listed.stderr);
    let peak_mib = listed.peak_rss_kib / 1024;
    eprintln!("peak RSS of `sluice dlq list` over {N} x 1 MiB: {peak_mib} MiB");
    assert!(peak_mib < 200, "`dlq list` held {peak_mib} MiB at its peak");

    let last = ids.last().expect("planted");
    let shown = dlq(&["show", "work", last, "--format", "json"]);
    let shown: Value = serde_json::from_str(&shown.stdout).expect("JSON");
    assert_eq!(shown["id"], last.as_str());
    assert_eq!(shown["body"]["payload"]["n"], N - 1);

    let redriven = dlq(&["redrive", "work"]);
    assert!(redriven.stdout.starts_with(&format!("{N} message(s) redriven to work")), "{}", redriven.stdout);
    assert_eq!((place.depth("work").await, place.depth("work.dlq").await), (N as u32, 0));

    plant_large(&broker, N, MIB).await;
    let purged = dlq(&["purge", "work", "--yes"]);
    assert!(purged.stdout.starts_with(&format!("{N} message(s) purged")), "{}", purged.stdout);
    assert_eq!((place.depth("work").await, place.depth("work.dlq").await), (N as u32, 0));
    broker.close().await;
}
