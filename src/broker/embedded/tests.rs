//! The embedded broker (issue 12) on real files in temporary directories: routing as
//! RabbitMQ routes, prefetch, order, hand-back, leases, delays, reject-publish, declarations,
//! dead-letter and redrive headers, a second process on the same file, and disk space.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt as _;
use serde_json::json;
use tokio::time::Instant;

use super::*;
use crate::broker::{Delivery as _, HeaderValue};
use crate::envelope;
use crate::topology::{BindingDecl, ExchangeDecl, QueueDecl, Role};
use crate::vocab::ExchangeKind;

/// How long a condition may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(5);

fn queue(name: &str) -> QueueDecl {
    QueueDecl::new(name, Role::Work)
}

fn binding(exchange: &str, queue: &str, key: &str, arguments: serde_json::Value) -> BindingDecl {
    let arguments = match arguments {
        serde_json::Value::Object(map) => map.into_iter().collect(),
        _ => BTreeMap::new(),
    };
    BindingDecl { exchange: exchange.into(), queue: queue.into(), routing_key: key.into(), arguments }
}

/// One work queue `work` and its dead-letter queue `work.dlq`.
fn work_plan() -> Plan {
    Plan { exchanges: Vec::new(), queues: vec![queue("work"), queue("work.dlq")], bindings: Vec::new() }
}

fn message(body: &str) -> Outgoing {
    Outgoing {
        body: body.as_bytes().to_vec(),
        message_id: Some(format!("id-{body}")),
        kind: Some("t".into()),
        content_type: None,
        timestamp: Some(1_700_000_000),
        priority: None,
        headers: Headers::from([(envelope::ATTEMPT_HEADER.into(), HeaderValue::Int(1))]),
    }
}

async fn open(dir: &tempfile::TempDir) -> Embedded {
    Embedded::open(&dir.path().join("broker").join("sluice.db")).expect("open")
}

/// A broker in `dir` with the single-active-consumer queue `ordered` declared.
async fn with_ordered_queue(dir: &tempfile::TempDir) -> Embedded {
    let broker = open(dir).await;
    let plan = Plan { queues: vec![QueueDecl { single_active_consumer: true, ..queue("ordered") }], ..Plan::default() };
    broker.declare(&plan).await.expect("declare");
    broker
}

async fn next(deliveries: &mut EmbeddedDeliveries) -> EmbeddedDelivery {
    tokio::time::timeout(DEADLINE, deliveries.next())
        .await
        .expect("a delivery in time")
        .expect("the stream is open")
        .expect("no error")
}

fn text(d: &EmbeddedDelivery) -> String {
    String::from_utf8_lossy(d.body()).into_owned()
}

/// Asserts that nothing arrives for a while (after a positive condition showed the consumer
/// is running).
async fn nothing_for(deliveries: &mut EmbeddedDeliveries, wait: Duration) {
    if let Ok(Some(d)) = tokio::time::timeout(wait, deliveries.next()).await {
        panic!("unexpected delivery {:?}", d.map(|d| text(&d)));
    }
}

#[tokio::test]
async fn prefetch_order_ack_and_hand_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    broker.declare(&work_plan()).await.expect("declare");
    for i in 0..6 {
        broker.publish("", "work", message(&i.to_string())).await.expect("publish");
    }
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(2)).await.expect("consume");
    let (a, b) = (next(&mut deliveries).await, next(&mut deliveries).await);
    assert_eq!((text(&a), text(&b)), ("0".into(), "1".into()));
    assert_eq!(a.message_id(), Some("id-0"));
    assert_eq!(a.timestamp(), Some(1_700_000_000));
    assert_eq!(a.header(envelope::ATTEMPT_HEADER), Some(HeaderValue::Int(1)));
    assert_eq!(a.headers()[envelope::ATTEMPT_HEADER], json!(1));
    nothing_for(&mut deliveries, Duration::from_millis(200)).await;
    assert_eq!(broker.stats("work").await.expect("stats"), QueueStats { ready: 4, consumers: 1 });
    consumer.ack(&[a]).await.expect("ack");
    let c = next(&mut deliveries).await;
    assert_eq!(text(&c), "2");
    nothing_for(&mut deliveries, Duration::from_millis(100)).await;
    // Closing hands back b and c, which come first again, in order.
    consumer.close().await;
    assert!(!b.is_live());
    assert!(matches!(consumer.ack(&[b]).await, Err(BrokerError::Lost(_))));
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(100)).await.expect("consume");
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(next(&mut deliveries).await);
    }
    assert_eq!(got.iter().map(text).collect::<Vec<_>>(), ["1", "2", "3", "4", "5"]);
    consumer.ack(&got).await.expect("ack");
    assert_eq!(broker.stats("work").await.expect("stats"), QueueStats { ready: 0, consumers: 1 });
    // Cancelled: the stream ends; closed: no consumer left.
    consumer.cancel().await.expect("cancel");
    assert!(tokio::time::timeout(DEADLINE, deliveries.next()).await.expect("ends").is_none());
    consumer.close().await;
    assert_eq!(broker.stats("work").await.expect("stats").consumers, 0);
}

#[tokio::test]
async fn another_process_on_the_same_file_sees_and_wakes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = open(&dir).await;
    runner.declare(&work_plan()).await.expect("declare");
    let other = open(&dir).await;
    let (mut deliveries, consumer) = runner.consume("work", Credit::at_most(10)).await.expect("consume");
    // Let the consumer go idle, polling.
    nothing_for(&mut deliveries, Duration::from_millis(150)).await;
    assert_eq!(other.stats("work").await.expect("stats"), QueueStats { ready: 0, consumers: 1 });
    let sent = Instant::now();
    other.publish("", "work", message("from afar")).await.expect("publish");
    let d = next(&mut deliveries).await;
    let waited = sent.elapsed();
    assert_eq!(text(&d), "from afar");
    assert!(waited < Duration::from_millis(300), "woken after {waited:?}");
    consumer.ack(&[d]).await.expect("ack");
    assert_eq!(other.depth("work").await.expect("depth"), 0);
    consumer.close().await;
}

/// Issue 19.11: 5,000 idle queues cost 69 % of a core, each consumer polling the file every
/// 50 ms and renewing its registration on its own. Idle consumers now cost no request at all,
/// and one request renews every consumer's lease, however many queues there are.
#[tokio::test]
async fn idle_consumers_send_no_requests_whatever_their_number() {
    const QUEUES: u64 = 100;
    let dir = tempfile::tempdir().expect("tempdir");
    // A short lease: its renewals, every third of it, fall inside the idle period.
    let lease = Duration::from_millis(300);
    let broker = Embedded::open_with_lease(&dir.path().join("sluice.db"), lease).expect("open");
    let names: Vec<String> = (0..QUEUES).map(|i| format!("q{i}")).collect();
    let plan = Plan { exchanges: Vec::new(), queues: names.iter().map(|n| queue(n)).collect(), bindings: Vec::new() };
    broker.declare(&plan).await.expect("declare");
    let mut consumers = Vec::new();
    for name in &names {
        consumers.push(broker.consume(name, Credit::at_most(4)).await.expect("consume"));
    }
    // Each consumer has opened (two requests) and made its first claim (one more).
    let started = Instant::now();
    while broker.inner.requests.load(Ordering::SeqCst) < 1 + 3 * QUEUES {
        assert!(started.elapsed() < DEADLINE, "the consumers' first claims never came");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let before = broker.inner.requests.load(Ordering::SeqCst);
    // The idle period itself is what is measured.
    tokio::time::sleep(lease * 3).await;
    let idle = broker.inner.requests.load(Ordering::SeqCst) - before;
    assert!(idle < QUEUES, "{QUEUES} idle consumers sent {idle} requests in {:?}", lease * 3);
    // Still awake: a publish reaches its consumer, and a renewed lease kept the delivery.
    broker.publish("", "q7", message("late")).await.expect("publish");
    let (deliveries, consumer) = &mut consumers[7];
    let d = next(deliveries).await;
    assert_eq!(text(&d), "late");
    tokio::time::sleep(lease * 2).await;
    assert_eq!(broker.depth("q7").await.expect("depth"), 0, "the lease was renewed");
    consumer.ack(&[d]).await.expect("ack");
    for (_, consumer) in consumers {
        consumer.close().await;
    }
    assert_eq!(broker.stats("q7").await.expect("stats").consumers, 0);
}

#[tokio::test]
async fn a_killed_consumers_messages_come_back_after_the_lease() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sluice.db");
    let lease = Duration::from_millis(400);
    let killed = Embedded::open_with_lease(&path, lease).expect("open");
    killed.declare(&work_plan()).await.expect("declare");
    for i in 0..3 {
        killed.publish("", "work", message(&i.to_string())).await.expect("publish");
    }
    let (mut deliveries, consumer) = killed.consume("work", Credit::at_most(2)).await.expect("consume");
    let _held = (next(&mut deliveries).await, next(&mut deliveries).await);
    // The consumer renews its leases while it lives.
    tokio::time::sleep(lease * 2).await;
    let survivor = Embedded::open_with_lease(&path, lease).expect("open");
    assert_eq!(survivor.depth("work").await.expect("depth"), 1, "the two held stay leased");
    // Killed: every handle dropped, nothing closed.
    drop((deliveries, consumer, killed));
    let since = Instant::now();
    let (mut deliveries, consumer) = survivor.consume("work", Credit::at_most(10)).await.expect("consume");
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(next(&mut deliveries).await);
    }
    assert!(since.elapsed() < lease * 4, "back after {:?}", since.elapsed());
    let mut bodies: Vec<String> = got.iter().map(text).collect();
    bodies.sort();
    assert_eq!(bodies, ["0", "1", "2"]);
    consumer.ack(&got).await.expect("ack");
    consumer.close().await;
}

/// A consumer of a process that died (`kill -9`) holds nothing: the next consumer to start,
/// or the next renewal of a live one, hands its messages back at once and removes its
/// registration, so a single-active-consumer queue's next consumer takes over at once too,
/// not when the lease (30 s) runs out.
#[tokio::test]
async fn a_dead_processes_consumer_hands_back_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = with_ordered_queue(&dir).await;
    for i in 0..3 {
        broker.publish("", "ordered", message(&i.to_string())).await.expect("publish");
    }
    let (mut deliveries, consumer) = broker.consume("ordered", Credit::at_most(2)).await.expect("consume");
    let _held = (next(&mut deliveries).await, next(&mut deliveries).await);
    // Its process as a killed one's would read: the same namespace, a pid that is not running.
    let namespace = process::process().rsplit(':').next().expect("pid:start:namespace");
    let db = rusqlite::Connection::open(dir.path().join("broker").join("sluice.db")).expect("open");
    db.execute("UPDATE consumers SET process = ?1", [format!("{}:1:{namespace}", u32::MAX)]).expect("update");
    drop((deliveries, consumer));

    // The next runner: a handle of its own on the file.
    let next_runner = open(&dir).await;
    let since = Instant::now();
    let (mut deliveries, consumer) = next_runner.consume("ordered", Credit::at_most(10)).await.expect("consume");
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(next(&mut deliveries).await);
    }
    assert!(since.elapsed() < LEASE / 3, "back after {:?}", since.elapsed());
    assert_eq!(got.iter().map(text).collect::<Vec<_>>(), ["0", "1", "2"], "in their old places");
    assert_eq!(next_runner.stats("ordered").await.expect("stats").consumers, 1, "the dead one's registration gone");
    consumer.ack(&got).await.expect("ack");
    consumer.close().await;
}

#[tokio::test]
async fn delayed_copies_wait_without_blocking_each_other() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    broker.declare(&work_plan()).await.expect("declare");
    broker.publish("", "work", message("original")).await.expect("publish");
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(10)).await.expect("consume");
    let original = next(&mut deliveries).await;
    let retry = |n: i64| Headers::from([(envelope::ATTEMPT_HEADER.into(), HeaderValue::Int(n))]);
    broker
        .copy(&original, Target::Later { queue: "work", delay: Duration::from_secs(3600) }, &Edits::setting(retry(9)))
        .await
        .expect("long");
    let sent = Instant::now();
    broker
        .copy(&original, Target::Later { queue: "work", delay: Duration::from_millis(300) }, &Edits::setting(retry(2)))
        .await
        .expect("short");
    consumer.ack(&[original]).await.expect("ack");
    assert_eq!(broker.delayed().await.expect("delayed"), 2);
    assert_eq!(broker.depth("work").await.expect("depth"), 0, "invisible until due");
    let copy = next(&mut deliveries).await;
    let waited = sent.elapsed();
    // The file's clock counts whole milliseconds: due at most one early by this process's clock.
    assert!(waited + Duration::from_millis(1) >= Duration::from_millis(300), "due after 300 ms, came after {waited:?}");
    // Not held behind the hour-long copy (a bound far from both, for a busy machine).
    assert!(waited < Duration::from_secs(60), "came after {waited:?}");
    assert_eq!(copy.header(envelope::ATTEMPT_HEADER), Some(HeaderValue::Int(2)));
    assert_eq!((text(&copy), copy.message_id()), ("original".into(), Some("id-original")));
    assert_eq!(broker.delayed().await.expect("delayed"), 2, "the long copy, and the short one under its lease");
    consumer.ack(&[copy]).await.expect("ack");
    assert_eq!(broker.delayed().await.expect("delayed"), 1);
    consumer.close().await;
}

#[tokio::test]
async fn a_full_queue_refuses_the_whole_publish() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    let plan = Plan {
        exchanges: vec![ExchangeDecl { name: "f".into(), kind: ExchangeKind::Fanout }],
        queues: vec![QueueDecl { max_length: Some(2), ..queue("small") }, queue("big")],
        bindings: vec![binding("f", "small", "", json!(null)), binding("f", "big", "", json!(null))],
    };
    broker.declare(&plan).await.expect("declare");
    for i in 0..2 {
        broker.publish("f", "", message(&i.to_string())).await.expect("room");
    }
    let refused = broker.publish("f", "", message("3")).await;
    assert!(matches!(&refused, Err(BrokerError::Rejected { exchange, .. }) if exchange == "f"), "{refused:?}");
    let refused = refused.expect_err("refused").to_string();
    assert_eq!(refused, "the broker refused the message on exchange \"f\" (queue \"small\" is full)");
    assert_eq!((broker.depth("small").await.expect("d"), broker.depth("big").await.expect("d")), (2, 2));

    // Publishes that land in one batch count each other.
    let racing: Vec<_> = (0..10).map(|i| broker.publish("", "small", message(&i.to_string()))).collect();
    let results = futures_util::future::join_all(racing).await;
    assert!(results.iter().all(|r| matches!(r, Err(BrokerError::Rejected { .. }))), "{results:?}");
    let (mut deliveries, consumer) = broker.consume("small", Credit::at_most(1)).await.expect("consume");
    let taken = next(&mut deliveries).await;
    let racing: Vec<_> = (0..10).map(|i| broker.publish("", "small", message(&i.to_string()))).collect();
    let accepted = futures_util::future::join_all(racing).await.iter().filter(|r| r.is_ok()).count();
    assert_eq!(accepted, 1, "room for one");
    consumer.ack(&[taken]).await.expect("ack");
    consumer.close().await;
    assert_eq!(broker.depth("small").await.expect("depth"), 2);
}

#[tokio::test]
async fn a_differing_declaration_is_a_conflict_naming_both() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    let mut plan = work_plan();
    plan.exchanges.push(ExchangeDecl { name: "ev".into(), kind: ExchangeKind::Topic });
    plan.bindings.push(binding("ev", "work", "a.*", json!(null)));
    assert_eq!(broker.drift(&plan).await.expect("drift"), Drift::all_missing(&plan), "a new broker has nothing");
    broker.declare(&plan).await.expect("declare");
    broker.declare(&plan).await.expect("idempotent");
    assert_eq!(broker.drift(&plan).await.expect("drift"), []);

    let mut bigger = plan.clone();
    bigger.queues[0].max_length = Some(5);
    let Err(BrokerError::Conflict(text)) = broker.declare(&bigger).await else { panic!("a conflict") };
    let text = text.to_string();
    assert!(
        text.contains("queue \"work\" conflicts with what exists: max_length: declared 5 but current is null"),
        "{text}"
    );
    let mut other_kind = plan.clone();
    other_kind.exchanges[0].kind = ExchangeKind::Direct;
    let Err(BrokerError::Conflict(text)) = broker.declare(&other_kind).await else { panic!("a conflict") };
    assert_eq!(
        text.to_string(),
        "exchange \"ev\" conflicts with what exists: type: declared direct but current is topic"
    );
    let drift = broker.drift(&other_kind).await.expect("drift");
    assert!(matches!(&drift[..], [Drift::Conflict { what, .. }] if what == "exchange"), "{drift:?}");
}

#[tokio::test]
async fn dead_letter_and_redrive_carry_the_right_headers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    broker.declare(&work_plan()).await.expect("declare");
    broker.publish("", "work", message("m")).await.expect("publish");
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(1)).await.expect("consume");
    let original = next(&mut deliveries).await;
    let failure: Headers = [
        (envelope::REASON_HEADER, HeaderValue::Str("permanent".into())),
        (envelope::ERROR_HEADER, HeaderValue::Str("HTTP 422".into())),
        (envelope::ATTEMPTS_HEADER, HeaderValue::Int(3)),
        (envelope::FAILED_AT_HEADER, HeaderValue::Str("2026-12-01T00:00:00Z".into())),
        (envelope::SOURCE_QUEUE_HEADER, HeaderValue::Str("work".into())),
        (envelope::ATTEMPT_HEADER, HeaderValue::Int(3)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    broker
        .copy(&original, Target::DeadLetter("work.dlq"), &Edits::setting(failure.clone()))
        .await
        .expect("dead-letter");
    consumer.ack(&[original]).await.expect("ack");
    consumer.close().await;

    let (mut dead, browser) = broker.browse("work.dlq", Credit::at_most(10)).await.expect("browse");
    let copy = next(&mut dead).await;
    assert_eq!(text(&copy), "m");
    for (k, v) in &failure {
        assert_eq!(copy.header(k).as_ref(), Some(v), "{k}");
    }
    broker.copy(&copy, Target::Queue("work"), &crate::ops::dlq::redrive_edits()).await.expect("redrive");
    browser.ack(&[copy]).await.expect("ack");
    browser.close().await;
    assert_eq!(broker.depth("work.dlq").await.expect("depth"), 0);

    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(1)).await.expect("consume");
    let again = next(&mut deliveries).await;
    assert_eq!(again.headers(), BTreeMap::from([(envelope::ATTEMPT_HEADER.to_string(), json!(1))]));
    assert_eq!(again.message_id(), Some("id-m"));
    consumer.ack(&[again]).await.expect("ack");
    consumer.close().await;
}

/// Publishes `n` messages from 32 tasks and consumes them with one consumer acking in
/// batches; returns messages a second, end to end.
async fn publish_consume_ack(broker: &Embedded, n: usize, body: &[u8]) -> f64 {
    let started = Instant::now();
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(256)).await.expect("consume");
    let publishers: Vec<_> = (0..32)
        .map(|p| {
            let (broker, body) = (broker.clone(), body.to_vec());
            tokio::spawn(async move {
                for _ in (p..n).step_by(32) {
                    let m = Outgoing { body: body.clone(), ..Outgoing::default() };
                    broker.publish("", "work", m).await.expect("publish");
                }
            })
        })
        .collect();
    let mut batch = Vec::new();
    for _ in 0..n {
        batch.push(next(&mut deliveries).await);
        if batch.len() == 64 {
            consumer.ack(&std::mem::take(&mut batch)).await.expect("ack");
        }
    }
    consumer.ack(&batch).await.expect("ack");
    for p in publishers {
        p.await.expect("publisher");
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    consumer.close().await;
    rate
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_passes_and_its_space_comes_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sluice.db");
    let broker = Embedded::open(&path).expect("open");
    broker.declare(&work_plan()).await.expect("declare");
    let rate = publish_consume_ack(&broker, 10_000, &[b'x'; 200]).await;
    eprintln!("publish, consume and ack: {rate:.0} messages/s");
    assert_eq!(broker.depth("work").await.expect("depth"), 0);

    for i in 0..2_000 {
        broker
            .publish("", "work", Outgoing { body: vec![b'y'; 4096], ..message(&i.to_string()) })
            .await
            .expect("publish");
    }
    let db = rusqlite::Connection::open(&path).expect("inspect");
    let pages = |db: &rusqlite::Connection| -> (i64, i64) {
        let count = db.query_row("PRAGMA page_count", [], |r| r.get(0)).expect("page_count");
        let free = db.query_row("PRAGMA freelist_count", [], |r| r.get(0)).expect("freelist_count");
        (count, free)
    };
    let (full, _) = pages(&db);
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(500)).await.expect("consume");
    for _ in 0..4 {
        let mut batch = Vec::new();
        for _ in 0..500 {
            batch.push(next(&mut deliveries).await);
        }
        consumer.ack(&batch).await.expect("ack");
    }
    consumer.close().await;
    let wal = |path: &std::path::Path| {
        let mut name = path.as_os_str().to_owned();
        name.push("-wal");
        std::fs::metadata(name).map_or(0, |m| m.len())
    };
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (count, free) = pages(&db);
        let log = wal(&path);
        if count < full / 2 && free < 300 && log <= store::WAL_LIMIT as u64 {
            break;
        }
        assert!(Instant::now() < deadline, "{count} pages ({free} free) of {full}, write-ahead log {log} bytes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_single_active_consumer_queue_delivers_to_one_consumer_at_a_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = with_ordered_queue(&dir).await;
    let (mut first, active) = broker.consume("ordered", Credit::at_most(10)).await.expect("consume");
    let (mut second, standby) = broker.consume("ordered", Credit::at_most(10)).await.expect("consume");
    for i in 0..3 {
        broker.publish("", "ordered", message(&i.to_string())).await.expect("publish");
    }
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(text(&next(&mut first).await));
    }
    assert_eq!(got, ["0", "1", "2"]);
    nothing_for(&mut second, Duration::from_millis(200)).await;
    assert_eq!(broker.stats("ordered").await.expect("stats").consumers, 2);
    // The active one goes: the other takes over, from what it handed back, in order.
    active.close().await;
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(next(&mut second).await);
    }
    assert_eq!(got.iter().map(text).collect::<Vec<_>>(), ["0", "1", "2"]);
    standby.ack(&got).await.expect("ack");
    standby.close().await;
}

/// Issue 19: a row that cannot be read (headers that are not JSON) is quarantined by the
/// claim that meets it, with what could be read of it and reason `internal`: into its queue's
/// dead-letter queue, or back into a queue that has none, readable now; the rest is delivered.
/// (Each claim of its queue failed until someone removed the row by hand.)
#[tokio::test]
async fn a_row_that_cannot_be_read_is_quarantined_and_the_queue_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sluice.db");
    let broker = Embedded::open(&path).expect("open");
    let mut plan = work_plan();
    plan.queues[0].dead_letter = Some("work.dlq".into());
    broker.declare(&plan).await.expect("declare");
    for (queue, body) in [("work", "bad"), ("work", "good"), ("work.dlq", "bad too")] {
        broker.publish("", queue, message(body)).await.expect("publish");
    }
    let db = rusqlite::Connection::open(&path).expect("open");
    db.execute(
        "UPDATE messages SET headers = '[1' WHERE body IN (SELECT id FROM bodies WHERE CAST(data AS TEXT) LIKE 'bad%')",
        [],
    )
    .expect("corrupt");

    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(10)).await.expect("consume");
    let good = next(&mut deliveries).await;
    assert_eq!(text(&good), "good");
    consumer.ack(&[good]).await.expect("ack");
    consumer.close().await;
    let (mut deliveries, consumer) = broker.consume("work.dlq", Credit::at_most(10)).await.expect("consume");
    let mut quarantined = vec![next(&mut deliveries).await, next(&mut deliveries).await];
    quarantined.sort_by_key(text);
    let seen: Vec<(String, Option<HeaderValue>, Option<HeaderValue>)> = quarantined
        .iter()
        .map(|d| (text(d), d.header(envelope::REASON_HEADER), d.header(envelope::SOURCE_QUEUE_HEADER)))
        .collect();
    let internal = Some(HeaderValue::Str("internal".into()));
    let from = |queue: &str| Some(HeaderValue::Str(queue.into()));
    assert_eq!(seen, [("bad".into(), internal.clone(), from("work")), ("bad too".into(), internal, from("work.dlq"))]);
    let Some(HeaderValue::Str(error)) = quarantined[0].header(envelope::ERROR_HEADER) else { panic!("an error") };
    assert!(error.contains("headers"), "{error}");
    consumer.ack(&quarantined).await.expect("ack");
    consumer.close().await;
}

/// Issue 19: a failed ack (here a trigger refusing the delete, as a full disk refuses a write)
/// changes nothing: the deliveries stay the consumer's, their leases renewed past their length
/// and their prefetch slots taken, until an ack goes through and frees them.
#[tokio::test]
async fn a_failed_ack_leaves_its_deliveries_leased_to_the_consumer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sluice.db");
    let lease = Duration::from_millis(400);
    let broker = Embedded::open_with_lease(&path, lease).expect("open");
    broker.declare(&work_plan()).await.expect("declare");
    for i in 0..2 {
        broker.publish("", "work", message(&i.to_string())).await.expect("publish");
    }
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(1)).await.expect("consume");
    let first = next(&mut deliveries).await;
    let db = rusqlite::Connection::open(&path).expect("open");
    db.execute_batch("CREATE TRIGGER refuse BEFORE DELETE ON messages BEGIN SELECT RAISE(ABORT, 'disk full'); END")
        .expect("refuse deletes");
    let first = [first];
    let failed = consumer.ack(&first).await;
    let Err(failed @ BrokerError::Lost(_)) = failed else { panic!("a lost session: {failed:?}") };
    assert!(failed.to_string().contains("disk full"), "{failed:?}");
    let sqlite = std::error::Error::source(&failed).and_then(|e| e.downcast_ref::<rusqlite::Error>());
    assert!(sqlite.is_some_and(|e| e.to_string() == "disk full"), "SQLite's error is the source: {failed:?}");
    assert!(first[0].is_live());
    nothing_for(&mut deliveries, lease * 2).await;
    let other = Embedded::open_with_lease(&path, lease).expect("open");
    assert_eq!(other.depth("work").await.expect("depth"), 1, "still leased after two lease lengths");
    db.execute_batch("DROP TRIGGER refuse").expect("accept deletes");
    consumer.ack(&first).await.expect("the same ack, again");
    assert_eq!(text(&next(&mut deliveries).await), "1", "the slot is free");
    consumer.close().await;
}

/// Issue 19: a claim takes bodies of a few MiB at most, and a consumer whose stream is not read
/// claims no more once it holds that much unread: a browse of large messages keeps a few in
/// memory. (One claim took up to 1,024 rows with their bodies.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_are_claimed_a_few_at_a_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sluice.db");
    let broker = Embedded::open(&path).expect("open");
    broker.declare(&work_plan()).await.expect("declare");
    let size = 3 << 20;
    for i in 0..8 {
        let body = format!("{i}{}", " ".repeat(size));
        broker.publish("", "work", Outgoing { body: body.into_bytes(), ..Outgoing::default() }).await.expect("publish");
    }
    let leased = || {
        let db = rusqlite::Connection::open(&path).expect("open");
        db.query_row("SELECT count(*) FROM messages WHERE lease_owner IS NOT NULL", [], |r| r.get::<_, i64>(0))
            .expect("count")
    };
    let (mut deliveries, consumer) = broker.browse("work", Credit::at_most(100)).await.expect("browse");
    // Unread: 3 MiB, under the bound, so one more claim; then 6 MiB, over it.
    let deadline = Instant::now() + DEADLINE;
    while leased() < 2 {
        assert!(Instant::now() < deadline, "two claimed in time");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(leased(), 2, "no more claimed while the stream holds 6 MiB unread");
    let mut got = Vec::new();
    for _ in 0..8 {
        let d = next(&mut deliveries).await;
        assert!(leased() <= i64::try_from(got.len()).expect("small") + 3, "a few ahead of the reader");
        got.push(d.body()[0]);
        drop(d);
    }
    assert_eq!(got, b"01234567", "all, in order");
    consumer.close().await;
}

/// Issue 31 (left by round 3): a body of 1 MiB or more, written into its row in place rather
/// than bound as a value, comes back byte for byte, as one just under does.
#[tokio::test]
async fn large_bodies_written_in_place_come_back_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    broker.declare(&work_plan()).await.expect("declare");
    let bodies: Vec<Vec<u8>> =
        [(1 << 20) - 1, 1 << 20, (3 << 20) + 7].iter().map(|n| (0..*n).map(|i| (i % 251) as u8).collect()).collect();
    for body in &bodies {
        broker.publish("", "work", Outgoing { body: body.clone(), ..Outgoing::default() }).await.expect("publish");
    }
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(10)).await.expect("consume");
    for body in &bodies {
        let d = next(&mut deliveries).await;
        assert!(
            d.body() == &body[..],
            "a body of {} bytes came back as {} bytes, or changed",
            body.len(),
            d.body().len()
        );
    }
    consumer.close().await;
}

#[tokio::test]
async fn keys_are_recorded_in_the_transaction_of_their_acks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    broker.declare(&work_plan()).await.expect("declare");
    broker.publish("", "work", message("a")).await.expect("publish");
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(10)).await.expect("consume");
    let a = next(&mut deliveries).await;
    assert_eq!(broker.claim_key("work\0a", Duration::from_secs(60)).await.expect("claim"), Claim::Claimed);
    // A failed ack records nothing: the delivery is no longer the consumer's.
    consumer.close().await;
    assert!(consumer.ack_recording(&[a], &["work\0a".into()], Duration::from_secs(60)).await.is_err());
    broker.release_key("work\0a").await.expect("release");
    assert_eq!(broker.claim_key("work\0a", Duration::from_secs(60)).await.expect("claim"), Claim::Claimed);
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(10)).await.expect("consume");
    let a = next(&mut deliveries).await;
    consumer.ack_recording(&[a], &["work\0a".into()], Duration::from_secs(60)).await.expect("ack");
    assert_eq!(broker.depth("work").await.expect("depth"), 0);
    assert_eq!(broker.claim_key("work\0a", Duration::from_secs(60)).await.expect("claim"), Claim::Done);
    // A second session on the same file, as another process's, sees the key done.
    let other = Embedded::open(&dir.path().join("broker").join("sluice.db")).expect("open");
    assert_eq!(other.claim_key("work\0a", Duration::from_secs(60)).await.expect("claim"), Claim::Done);
}

#[tokio::test]
async fn expired_keys_are_deleted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    let keys: Vec<String> = (0..100).map(|n| format!("q\0{n}")).collect();
    broker.complete_keys(&keys, Duration::from_millis(1)).await.expect("complete");
    broker.complete_keys(&["q\0kept".into()], Duration::from_secs(60)).await.expect("complete");
    let path = dir.path().join("broker").join("sluice.db");
    let count = || {
        let db = rusqlite::Connection::open(&path).expect("open");
        db.query_row("SELECT count(*) FROM idempotency", [], |r| r.get::<_, i64>(0)).expect("count")
    };
    assert_eq!(count(), 101);
    // The writer deletes expired keys at its next reclaim, within a second or two.
    let deadline = Instant::now() + DEADLINE;
    while count() > 1 {
        assert!(Instant::now() < deadline, "expired keys still there: {}", count());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The number of bodies the file holds.
fn bodies(path: &std::path::Path) -> i64 {
    let db = rusqlite::Connection::open(path).expect("open");
    db.query_row("SELECT count(*) FROM bodies", [], |r| r.get(0)).expect("count")
}

/// Issue 19: a fan-out, a delayed copy and a dead-letter copy store the body once; it goes
/// with the last message naming it.
#[tokio::test]
async fn copies_share_one_stored_body_that_goes_with_the_last() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("broker.db");
    let broker = Embedded::open(&path).expect("open");
    let plan = Plan {
        exchanges: vec![ExchangeDecl { name: "f".into(), kind: ExchangeKind::Fanout }],
        queues: vec![queue("a"), queue("b"), queue("work.dlq")],
        bindings: vec![binding("f", "a", "", json!(null)), binding("f", "b", "", json!(null))],
    };
    broker.declare(&plan).await.expect("declare");
    broker.publish("f", "", message("shared")).await.expect("publish");
    assert_eq!(bodies(&path), 1, "one body for both queues");
    let (mut deliveries, consumer) = broker.consume("a", Credit::at_most(1)).await.expect("consume");
    let a = next(&mut deliveries).await;
    broker.copy(&a, Target::DeadLetter("work.dlq"), &Edits::setting(Headers::new())).await.expect("dead-letter");
    broker
        .copy(&a, Target::Later { queue: "a", delay: Duration::from_secs(60) }, &Edits::setting(Headers::new()))
        .await
        .expect("delay");
    consumer.ack(&[a]).await.expect("ack");
    assert_eq!(bodies(&path), 1, "the copies name the same body");
    for queue in ["b", "work.dlq"] {
        let (mut deliveries, consumer) = broker.consume(queue, Credit::at_most(1)).await.expect("consume");
        let d = next(&mut deliveries).await;
        assert_eq!(text(&d), "shared");
        consumer.ack(&[d]).await.expect("ack");
    }
    assert_eq!(bodies(&path), 1, "the delayed copy still names it");
    rusqlite::Connection::open(&path).expect("open").execute("DELETE FROM messages", []).expect("delete");
    assert_eq!(bodies(&path), 0, "gone with the last message naming it");
}

/// Issue 19: a consumer with a limit gets a larger message as its size, body unread, and its
/// dead-letter copy keeps the whole body.
#[tokio::test]
async fn a_body_over_the_consumers_limit_comes_as_its_size_and_is_dead_lettered_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    broker.declare(&work_plan()).await.expect("declare");
    let large = "x".repeat(1000);
    for body in ["small", large.as_str(), "after"] {
        broker.publish("", "work", message(body)).await.expect("publish");
    }
    let (mut deliveries, consumer) = broker.consume_within("work", Credit::at_most(10), 100).await.expect("consume");
    let (small, held, after) = (next(&mut deliveries).await, next(&mut deliveries).await, next(&mut deliveries).await);
    assert_eq!((text(&small), small.size()), ("small".into(), 5));
    assert_eq!((held.body().len(), held.size()), (0, 1000), "the size alone");
    assert_eq!(held.message_id(), Some(format!("id-{large}").as_str()));
    assert_eq!(text(&after), "after");
    broker.copy(&held, Target::DeadLetter("work.dlq"), &Edits::setting(Headers::new())).await.expect("dead-letter");
    consumer.ack(&[small, held, after]).await.expect("ack");
    let (mut deliveries, _dlq) = broker.browse("work.dlq", Credit::at_most(1)).await.expect("browse");
    let copy = next(&mut deliveries).await;
    assert_eq!(text(&copy), large, "the dead-letter copy keeps the body");
}

/// Issue 19: a file of an earlier version, its bodies in the message rows, is read as before.
#[tokio::test]
async fn a_file_with_bodies_in_its_rows_moves_them_apart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("broker.db");
    let db = rusqlite::Connection::open(&path).expect("create");
    db.execute_batch(
        "CREATE TABLE queues (name TEXT PRIMARY KEY, declaration TEXT NOT NULL,
             max_length INTEGER, single_active INTEGER NOT NULL);
         CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
             queue TEXT NOT NULL, visible_at INTEGER NOT NULL, lease_owner INTEGER,
             body BLOB NOT NULL, headers TEXT NOT NULL, message_id TEXT, kind TEXT, timestamp INTEGER);
         INSERT INTO messages (queue, visible_at, body, headers) VALUES ('work', 0, x'6f6c64', '{}');",
    )
    .expect("an earlier version's file");
    drop(db);
    let broker = Embedded::open(&path).expect("open");
    broker.declare(&work_plan()).await.expect("declare");
    let (mut deliveries, _consumer) = broker.consume("work", Credit::at_most(1)).await.expect("consume");
    assert_eq!(text(&next(&mut deliveries).await), "old");
}

/// Issue 34: a file of layout 2 (messages without a content type) is converted by `run`, its
/// messages read as before, and left to `run` by the commands that only read.
#[tokio::test]
async fn a_file_without_content_types_is_converted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(FILE);
    let broker = Embedded::open(&path).expect("open");
    broker.declare(&work_plan()).await.expect("declare");
    broker.publish("", "work", message("old")).await.expect("publish");
    broker.close().await;
    drop(broker);
    let db = rusqlite::Connection::open(&path).expect("open");
    db.execute_batch("ALTER TABLE messages DROP COLUMN content_type; UPDATE meta SET value = 2 WHERE key = 'layout';")
        .expect("as layout 2 had it");
    drop(db);
    let refused = super::reader::ReadOnly::open_dir(dir.path()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(refused.contains("`sluice run` converts it"), "{refused}");
    let broker = Embedded::open(&path).expect("converted");
    let sent = Outgoing { content_type: Some("application/x-protobuf".into()), ..message("new") };
    broker.publish("", "work", sent).await.expect("publish");
    let (mut deliveries, _consumer) = broker.consume("work", Credit::at_most(2)).await.expect("consume");
    let (old, new) = (next(&mut deliveries).await, next(&mut deliveries).await);
    assert_eq!((text(&old).as_str(), old.content_type(), old.kind()), ("old", None, Some("t")));
    assert_eq!((text(&new).as_str(), new.content_type()), ("new", Some("application/x-protobuf")));
    assert!(super::reader::ReadOnly::open_dir(dir.path()).is_ok(), "read once converted");
}

#[tokio::test]
async fn a_file_of_a_newer_layout_is_refused_not_misread() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("broker.db");
    drop(Embedded::open(&path).expect("open"));
    let db = rusqlite::Connection::open(&path).expect("open");
    let layout: i64 = db.query_row("SELECT value FROM meta WHERE key = 'layout'", [], |r| r.get(0)).expect("layout");
    db.execute("UPDATE meta SET value = ?1 WHERE key = 'layout'", [layout + 1]).expect("update");
    drop(db);
    let refused = Embedded::open(&path).err().expect("refused");
    assert!(
        matches!(&refused, BrokerError::Damaged(text) if text.to_string().contains("written by a newer sluice")),
        "{refused:?}"
    );
}

/// A file SQLite cannot read is damaged, said with SQLite's own error, which is kept as the
/// source.
#[test]
fn a_file_that_is_no_database_is_damaged_with_sqlite_s_error_as_the_source() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("broker.db");
    std::fs::write(&path, "not a database\n".repeat(1000)).expect("write");
    let refused = Embedded::open(&path).err().expect("refused");
    assert!(refused.is_damaged(), "{refused:?}");
    let sqlite = std::error::Error::source(&refused).and_then(|e| e.downcast_ref::<rusqlite::Error>());
    let sqlite = sqlite.expect("SQLite's error is the source");
    assert_eq!(sqlite.sqlite_error_code(), Some(rusqlite::ErrorCode::NotADatabase));
    let text = refused.to_string();
    assert!(text.contains("is not a usable SQLite database (") && text.ends_with(&format!(": {sqlite}")), "{text}");
}

/// Issue 21: a runner alone on its file takes and gives up idempotency keys in memory, with no
/// request to the writer once registered; completing a key still goes through the file.
#[tokio::test]
async fn a_holder_alone_claims_in_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    let minute = Duration::from_secs(60);
    assert_eq!(broker.claim_key("q\0first", minute).await.expect("claim"), Claim::Claimed);
    assert_eq!(broker.inner.claims.mode(), keys::Mode::Alone);
    let before = broker.inner.requests.load(Ordering::SeqCst);
    for n in 0..100 {
        let key = format!("q\0{n}");
        assert_eq!(broker.claim_key(&key, minute).await.expect("claim"), Claim::Claimed);
        assert_eq!(broker.claim_key(&key, minute).await.expect("claim"), Claim::Busy, "held by this holder");
        broker.release_key(&key).await.expect("release");
    }
    assert_eq!(broker.inner.requests.load(Ordering::SeqCst), before, "no request for claims and releases");
    broker.complete_keys(&["q\0first".into()], minute).await.expect("complete");
    assert_eq!(broker.claim_key("q\0first", minute).await.expect("claim"), Claim::Done);
}

/// Issue 21: a second holder (another runner on the same state directory) arriving while the
/// first holds claims in memory: it takes no key until the first has written them as rows,
/// then sees them held, and a key the first still holds is handled by neither twice. Once the
/// second is gone, the first is alone again.
#[tokio::test]
async fn a_second_holder_waits_for_the_first_to_share_its_claims() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = open(&dir).await;
    let minute = Duration::from_secs(60);
    assert_eq!(first.claim_key("q\0held", minute).await.expect("claim"), Claim::Claimed);
    assert_eq!(first.inner.claims.mode(), keys::Mode::Alone);
    let second = open(&dir).await;
    // The second's claims wait for the first to share; a free key is its own once it has.
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert_eq!(second.claim_key("q\0held", minute).await.expect("claim"), Claim::Busy, "the first holds it");
        match second.claim_key("q\0free", minute).await.expect("claim") {
            Claim::Claimed => break,
            found => assert_eq!(found, Claim::Busy),
        }
        assert!(Instant::now() < deadline, "the first never shared its claims");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(first.inner.claims.mode(), keys::Mode::Shared);
    assert_eq!(second.inner.claims.mode(), keys::Mode::Shared);
    assert_eq!(first.claim_key("q\0free", minute).await.expect("claim"), Claim::Busy, "the second holds it");
    // Claims taken while sharing are rows the other sees at once.
    assert_eq!(first.claim_key("q\0later", minute).await.expect("claim"), Claim::Claimed);
    assert_eq!(second.claim_key("q\0later", minute).await.expect("claim"), Claim::Busy);
    // The first's success: the second finds the key done; a release frees the key for it.
    first.complete_keys(&["q\0held".into()], minute).await.expect("complete");
    assert_eq!(second.claim_key("q\0held", minute).await.expect("claim"), Claim::Done);
    first.release_key("q\0later").await.expect("release");
    assert_eq!(second.claim_key("q\0later", minute).await.expect("claim"), Claim::Claimed);
    // The second leaves (its writer deregisters it, its claims with it): the first is alone
    // again, and the keys the second held are free.
    drop(second);
    let deadline = Instant::now() + DEADLINE;
    while first.inner.claims.mode() != keys::Mode::Alone {
        assert!(Instant::now() < deadline, "the first never found itself alone again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(first.claim_key("q\0free", minute).await.expect("claim"), Claim::Claimed);
    assert_eq!(first.claim_key("q\0later", minute).await.expect("claim"), Claim::Claimed);
}
