//! Issue 23 (part 2): the broker contract, one suite for every broker. Each test body is
//! written once against the `Broker` trait and run, by [`conformance!`], on the in-memory test
//! double, the embedded broker (a directory of its own) and RabbitMQ (a vhost of its own): a
//! new broker is "implement, then pass", by adding one line to the list at the bottom.
//!
//! The rules checked are listed in `src/broker/mod.rs` ("The rules a broker keeps"), each
//! named by the body here that checks it; every member of the contract (`Broker`, `Publish`,
//! `Operate`, `Consumer`, `Delivery`) is exercised on every broker. Where brokers legitimately
//! differ, the body reads the broker's `Capabilities`, never skips.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use futures_util::{Stream, StreamExt as _};
use serde_json::json;
use sluice::broker::memory::Memory;
use sluice::broker::{
    Broker, BrokerError, Consumer, Credit, Delivery, Drift, Edits, HeaderValue, Headers, Operate, Outgoing, Publish,
    QueueStats, Target,
};
use sluice::config::{ExchangeKind, QueueKind};
use sluice::envelope;
use sluice::topology::{BindingDecl, ExchangeDecl, Plan, QueueDecl, Role};

use crate::support::{EmbeddedDir, NatsPrefix, Place, RedisPrefix, SqsPrefix, Vhost, not_before, wall_elapsed};

/// How long anything that should happen soon may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(15);

/// A broker under test, of the test's own: where its sessions come from, and how it
/// legitimately differs from the others.
pub trait Subject: Send + Sync {
    type Broker: Operate;

    /// A new session, as another process would open it.
    fn session(&self) -> impl Future<Output = Self::Broker> + Send;

    /// How long a lease runs, where the broker's deliveries are leased
    /// ([`Capabilities::leases`](sluice::broker::Capabilities::leases)): a lost session's
    /// unsettled deliveries come back only when it runs out.
    fn lease(&self) -> Duration {
        Duration::ZERO
    }
}

/// How long the unsettled deliveries of a consumer whose session ended without closing it may
/// take to be delivered again: at once where the broker sees the session end (RabbitMQ, the
/// in-memory broker); after its lease where it sees only that nobody renews the lease (a
/// killed process closes nothing).
fn lost_deliveries_return_within<S: Subject>(subject: &S, broker: &S::Broker) -> Duration {
    match broker.capabilities().leases {
        true => subject.lease() + DEADLINE,
        false => DEADLINE,
    }
}

/// The in-memory test double; each session is a handle of one broker in this process.
pub struct InMemory(Memory);

impl Subject for InMemory {
    type Broker = Memory;

    async fn session(&self) -> Memory {
        self.0.session()
    }
}

impl Subject for EmbeddedDir {
    type Broker = sluice::broker::embedded::Embedded;

    async fn session(&self) -> Self::Broker {
        self.connect().await
    }

    fn lease(&self) -> Duration {
        sluice::broker::embedded::LEASE
    }
}

impl Subject for Vhost {
    type Broker = sluice::broker::amqp::Amqp;

    async fn session(&self) -> Self::Broker {
        self.connect().await
    }
}

/// A key prefix of its own on the shared Redis, with short leases so that a lost session's
/// deliveries come back within the test's patience.
pub struct OnRedis(RedisPrefix);

/// The lease `OnRedis` asks for.
const REDIS_LEASE: Duration = Duration::from_secs(3);

impl Subject for OnRedis {
    type Broker = sluice::broker::redis::Redis;

    async fn session(&self) -> Self::Broker {
        self.0.connect().await
    }

    fn lease(&self) -> Duration {
        REDIS_LEASE
    }
}

/// A name prefix of its own on the shared NATS server, with short leases (as `OnRedis`).
pub struct OnNats(NatsPrefix);

/// The lease `OnNats` asks for.
const NATS_LEASE: Duration = Duration::from_secs(3);

impl Subject for OnNats {
    type Broker = sluice::broker::jetstream::JetStream;

    async fn session(&self) -> Self::Broker {
        self.0.connect().await
    }

    fn lease(&self) -> Duration {
        NATS_LEASE
    }
}

/// A name prefix of its own on the suite's SQS emulator, with short leases (as `OnRedis`).
pub struct OnSqs(SqsPrefix);

/// The lease `OnSqs` asks for.
const SQS_LEASE: Duration = Duration::from_secs(3);

impl Subject for OnSqs {
    type Broker = sluice::broker::sqs::Sqs;

    async fn session(&self) -> Self::Broker {
        self.0.connect().await
    }

    fn lease(&self) -> Duration {
        SQS_LEASE
    }
}

/// A work queue with no settings.
fn work(name: &str) -> QueueDecl {
    QueueDecl::new(name, Role::Work)
}

fn queues(queues: Vec<QueueDecl>) -> Plan {
    Plan { queues, ..Plan::default() }
}

fn binding(exchange: &str, queue: &str, key: &str, arguments: serde_json::Value) -> BindingDecl {
    let arguments = match arguments {
        serde_json::Value::Object(map) => map.into_iter().collect(),
        _ => BTreeMap::new(),
    };
    BindingDecl { exchange: exchange.into(), queue: queue.into(), routing_key: key.into(), arguments }
}

/// A message whose body is `body`, with an id and a timestamp of its own.
fn message(body: &str) -> Outgoing {
    Outgoing {
        body: body.as_bytes().to_vec(),
        message_id: Some(format!("id-{body}")),
        kind: Some("t".into()),
        content_type: Some("application/x-test".into()),
        timestamp: Some(1_700_000_000),
        ..Outgoing::default()
    }
}

fn headers(pairs: &[(&str, HeaderValue)]) -> Headers {
    pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

fn text(s: &str) -> HeaderValue {
    HeaderValue::Str(s.into())
}

fn body<D: Delivery>(d: &D) -> String {
    String::from_utf8_lossy(d.body()).into_owned()
}

/// Publishes each body to `queue` through the default exchange.
async fn publish_all<B: Publish>(broker: &B, queue: &str, bodies: &[&str]) {
    for b in bodies {
        broker.publish("", queue, message(b)).await.unwrap_or_else(|e| panic!("publish {b} to {queue}: {e}"));
    }
}

/// The next delivery of a stream, within `deadline`.
async fn next_within<D, S>(deliveries: &mut S, deadline: Duration, what: &str) -> D
where
    S: Stream<Item = Result<D, BrokerError>> + Unpin,
{
    match tokio::time::timeout(deadline, deliveries.next()).await {
        Ok(Some(Ok(d))) => d,
        Ok(Some(Err(e))) => panic!("{what}: {e}"),
        Ok(None) => panic!("{what}: the stream ended"),
        Err(_) => panic!("{what}: nothing within {deadline:?}"),
    }
}

async fn next<D, S>(deliveries: &mut S, what: &str) -> D
where
    S: Stream<Item = Result<D, BrokerError>> + Unpin,
{
    next_within(deliveries, DEADLINE, what).await
}

/// The bodies of the next `n` deliveries, in order, left unsettled.
async fn bodies<D: Delivery, S>(deliveries: &mut S, n: usize, what: &str) -> (Vec<String>, Vec<D>)
where
    S: Stream<Item = Result<D, BrokerError>> + Unpin,
{
    let mut out = Vec::new();
    for i in 0..n {
        out.push(next(deliveries, &format!("{what} ({} of {n})", i + 1)).await);
    }
    (out.iter().map(body).collect(), out)
}

/// Waits until the broker says `stats` of `queue` (no consumers, where it counts none).
async fn wait_for_stats<B: Publish>(broker: &B, queue: &str, mut stats: QueueStats) {
    if !broker.capabilities().counts_consumers {
        stats.consumers = 0;
    }
    let start = Instant::now();
    loop {
        let now = broker.stats(queue).await;
        if now.as_ref().is_ok_and(|s| *s == stats) {
            return;
        }
        assert!(start.elapsed() < DEADLINE, "{queue}: waited {DEADLINE:?} for {stats:?}; the broker says {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Everything in `queue` until `end` (published last, through the default exchange), acked:
/// whatever reached the queue before it.
async fn read_until_end<B: Publish>(broker: &B, queue: &str) -> Vec<String> {
    broker.publish("", queue, message("end")).await.unwrap_or_else(|e| panic!("end marker to {queue}: {e}"));
    let (mut deliveries, consumer) = broker.consume(queue, Credit::at_most(100)).await.expect("consume");
    let mut seen = Vec::new();
    loop {
        let d = next(&mut deliveries, &format!("{queue} up to its end marker")).await;
        consumer.ack(std::slice::from_ref(&d)).await.expect("ack");
        match body(&d) {
            end if end == "end" => break,
            other => seen.push(other),
        }
    }
    consumer.close().await;
    seen
}

/// Direct, fanout, topic (`*` one word, `#` zero or more) and headers (`x-match` all or any,
/// `x-` arguments not matched) exchanges route as RabbitMQ does: each queue reached gets one
/// copy however many of its bindings match, and a message no binding takes (the default exchange:
/// no queue of that name) is refused as unroutable.
async fn every_exchange_type_routes_as_rabbitmq_does<S: Subject>(subject: S) {
    let broker = subject.session().await;
    let exchange = |name: &str, kind| ExchangeDecl { name: name.into(), kind };
    let plan = Plan {
        exchanges: vec![
            exchange("d", ExchangeKind::Direct),
            exchange("f", ExchangeKind::Fanout),
            exchange("t", ExchangeKind::Topic),
            exchange("strict", ExchangeKind::Topic),
            exchange("h", ExchangeKind::Headers),
        ],
        queues: ["d1", "d2", "f1", "f2", "t1", "t2", "t3", "s1", "h-all", "h-any", "h-empty"].map(work).to_vec(),
        bindings: vec![
            binding("d", "d1", "k", json!(null)),
            binding("d", "d2", "other", json!(null)),
            binding("f", "f1", "ignored", json!(null)),
            binding("f", "f2", "", json!(null)),
            binding("t", "t1", "a.*", json!(null)),
            binding("t", "t2", "a.#.z", json!(null)),
            binding("t", "t3", "#", json!(null)),
            binding("t", "t3", "a.*", json!(null)),
            binding("strict", "s1", "a.*", json!(null)),
            // A built-in exchange, bound to without being declared.
            binding("amq.topic", "s1", "b.*", json!(null)),
            binding("h", "h-all", "", json!({"x-match": "all", "format": "pdf", "size": 2, "x-note": "skipped"})),
            binding("h", "h-any", "", json!({"x-match": "any", "format": "pdf", "size": 2})),
            binding("h", "h-empty", "", json!({})),
        ],
    };
    broker.declare(&plan).await.expect("declare");
    let routed: Vec<(&str, &str, Headers, &[&str])> = vec![
        ("d", "k", Headers::new(), &["d1"]),
        ("f", "anything", Headers::new(), &["f1", "f2"]),
        ("t", "a.b", Headers::new(), &["t1", "t3"]),
        ("t", "a.z", Headers::new(), &["t1", "t2", "t3"]),
        ("t", "a.b.c.z", Headers::new(), &["t2", "t3"]),
        ("t", "", Headers::new(), &["t3"]),
        ("strict", "a.b", Headers::new(), &["s1"]),
        ("amq.topic", "b.c", Headers::new(), &["s1"]),
        ("h", "", headers(&[("format", text("pdf")), ("size", HeaderValue::Int(2))]), &["h-all", "h-any", "h-empty"]),
        ("h", "", headers(&[("format", text("pdf"))]), &["h-any", "h-empty"]),
        ("h", "", headers(&[("size", text("2"))]), &["h-empty"]),
        ("", "d2", Headers::new(), &["d2"]),
    ];
    let mut expected: BTreeMap<&str, Vec<String>> = plan.queues.iter().map(|q| (q.name.as_str(), Vec::new())).collect();
    for (n, (exchange, key, headers, reached)) in routed.into_iter().enumerate() {
        let case = format!("case-{n}");
        let m = Outgoing { headers, ..message(&case) };
        broker.publish(exchange, key, m).await.unwrap_or_else(|e| panic!("{case}: {exchange:?} {key:?}: {e}"));
        for q in reached {
            expected.get_mut(q).expect("a declared queue").push(case.clone());
        }
    }
    for (exchange, key) in [("d", "none"), ("strict", "a"), ("strict", "a.b.c"), ("", "undeclared")] {
        let refused = broker.publish(exchange, key, message("unroutable")).await;
        assert!(
            matches!(&refused, Err(BrokerError::Unroutable { exchange: x, routing_key: k }) if x == exchange && k == key),
            "{exchange:?} {key:?}: {refused:?}"
        );
    }
    for (queue, cases) in expected {
        assert_eq!(read_until_end(&broker, queue).await, cases, "what reached {queue}");
    }
    // Last: RabbitMQ closes the publishing channel on a missing exchange.
    let missing = broker.publish("missing", "k", message("nowhere")).await;
    assert!(matches!(missing, Err(BrokerError::NotFound(_))), "an undeclared exchange: {missing:?}");
    broker.close().await;
}

/// A consumer never holds more than its prefetch unsettled; an ack makes room for one more;
/// closing it hands back its unsettled deliveries (and only those), in queue order, ahead of
/// the rest.
async fn prefetch_is_a_bound_and_close_hands_back_in_order<S: Subject>(subject: S) {
    let broker = subject.session().await;
    broker.declare(&queues(vec![work("q")])).await.expect("declare");
    publish_all(&broker, "q", &["m1", "m2", "m3", "m4", "m5", "m6"]).await;
    let (mut deliveries, consumer) = broker.consume("q", Credit::at_most(2)).await.expect("consume");
    let (first, held) = bodies(&mut deliveries, 2, "the first two").await;
    assert_eq!(first, ["m1", "m2"]);
    // Four ready: the broker holds back everything beyond the prefetch.
    wait_for_stats(&broker, "q", QueueStats { ready: 4, consumers: 1 }).await;
    // The oldest: no broker holds this ack back (see `Capabilities::holds_acks`).
    consumer.ack(&held[..1]).await.expect("ack m1");
    let third = next(&mut deliveries, "one more after an ack").await;
    assert_eq!(body(&third), "m3");
    wait_for_stats(&broker, "q", QueueStats { ready: 3, consumers: 1 }).await;
    assert!(held[1].is_live() && third.is_live(), "unsettled deliveries of an open consumer are live");
    // Acked behind the unsettled m2 (held, where the broker holds such acks): closing sends it.
    consumer.ack(std::slice::from_ref(&third)).await.expect("ack m3");
    consumer.close().await;
    assert!(!held[1].is_live(), "deliveries of a closed consumer are no longer live");
    wait_for_stats(&broker, "q", QueueStats { ready: 4, consumers: 0 }).await;
    let (mut again, other) = broker.consume("q", Credit::at_most(10)).await.expect("consume again");
    let (order, rest) = bodies(&mut again, 4, "after the hand-back").await;
    assert_eq!(order, ["m2", "m4", "m5", "m6"], "handed back in queue order, the acked ones gone");
    other.ack(&rest).await.expect("ack the rest");
    wait_for_stats(&broker, "q", QueueStats { ready: 0, consumers: 1 }).await;
    other.close().await;
    broker.close().await;
}

/// A consumer whose session ends (closed, lost, its process killed) without closing the
/// consumer: what it had not acked is delivered again to another consumer; what it acked is
/// not (an ack behind an unsettled delivery may be, where the broker holds such acks).
async fn a_lost_sessions_unacked_deliveries_come_again_to_another_consumer<S: Subject>(subject: S) {
    let survivor = subject.session().await;
    survivor.declare(&queues(vec![work("q")])).await.expect("declare");
    publish_all(&survivor, "q", &["m1", "m2", "m3", "m4"]).await;
    let lost = subject.session().await;
    let (mut deliveries, consumer) = lost.consume("q", Credit::at_most(10)).await.expect("consume");
    let (got, held) = bodies(&mut deliveries, 4, "the lost session's").await;
    assert_eq!(got, ["m1", "m2", "m3", "m4"]);
    consumer.ack(&held[..1]).await.expect("ack m1");
    consumer.ack(&held[2..3]).await.expect("ack m3, behind m2");
    let (mut again, other) = survivor.consume("q", Credit::at_most(10)).await.expect("another consumer");
    // The session ends with nothing closed or settled.
    lost.close().await;
    drop((deliveries, consumer, held, lost));
    let within = lost_deliveries_return_within(&subject, &survivor);
    let mut redelivered = Vec::new();
    // Anything handed back comes before this.
    let mut end_published = false;
    loop {
        let d =
            next_within(&mut again, within, &format!("the unacked ones again, then the end; so far {redelivered:?}"))
                .await;
        other.ack(std::slice::from_ref(&d)).await.expect("ack");
        match body(&d) {
            end if end == "end" => break,
            other => redelivered.push(other),
        }
        if redelivered.len() == 2 && !end_published {
            publish_all(&survivor, "q", &["end"]).await;
            end_published = true;
        }
    }
    redelivered.sort();
    let expected: &[&str] =
        if survivor.capabilities().holds_acks && redelivered.len() == 3 { &["m2", "m3", "m4"] } else { &["m2", "m4"] };
    assert_eq!(redelivered, expected, "the unacked ones again, the acked ones not");
    other.close().await;
    survivor.close().await;
}

/// A delayed copy arrives at its one queue no earlier than its delay, and a long delay does
/// not hold up a shorter one published after it (no head-of-line blocking). The copy keeps
/// the original's body and properties, with the given headers merged over its own.
async fn delays_are_exact_and_block_nothing<S: Subject>(subject: S) {
    let broker = subject.session().await;
    broker.declare(&queues(vec![work("q"), work("other")])).await.expect("declare");
    let (long, short) = (Duration::from_secs(3), Duration::from_millis(300));
    // A broker with a longest delay holds a longer one only that long: these must fit.
    if let Some(max) = broker.capabilities().longest_delay {
        assert!(long <= max, "the broker's longest delay ({max:?}) is shorter than this test's");
    }
    let original = Outgoing { headers: headers(&[("keep", text("k")), ("n", HeaderValue::Int(1))]), ..message("m") };
    broker.publish("", "q", original).await.expect("publish");
    let (mut deliveries, consumer) = broker.consume("q", Credit::at_most(10)).await.expect("consume");
    let d = next(&mut deliveries, "the original").await;
    // Due times are the brokers' wall clock's: measured on it.
    let long_sent = std::time::SystemTime::now();
    let which = |w: &str| headers(&[("which", text(w)), ("n", HeaderValue::Int(2))]);
    broker
        .copy(&d, Target::Later { queue: "q", delay: long }, &Edits::setting(which("long")))
        .await
        .expect("long delay");
    let short_sent = std::time::SystemTime::now();
    broker
        .copy(&d, Target::Later { queue: "q", delay: short }, &Edits::setting(which("short")))
        .await
        .expect("short delay");
    consumer.ack(&[d]).await.expect("ack the original");
    assert!(broker.delayed().await.expect("delayed") >= 1, "the long delay's copy is counted while it waits");
    let first = next(&mut deliveries, "the short delay").await;
    assert_eq!(first.header("which"), Some(text("short")), "the shorter delay arrives first");
    assert!(not_before(wall_elapsed(short_sent), short), "not before its delay");
    let second = next(&mut deliveries, "the long delay").await;
    assert_eq!(second.header("which"), Some(text("long")));
    assert!(not_before(wall_elapsed(long_sent), long), "not before its delay");
    for copy in [&first, &second] {
        assert_eq!(body(copy), "m");
        assert_eq!(copy.message_id(), Some("id-m"));
        assert_eq!(copy.timestamp(), Some(1_700_000_000));
        assert_eq!(copy.header("keep"), Some(text("k")), "the original's headers stay");
        assert_eq!(copy.header("n"), Some(HeaderValue::Int(2)), "the given headers win");
    }
    consumer.ack(&[first, second]).await.expect("ack the copies");
    wait_for_stats(&broker, "q", QueueStats { ready: 0, consumers: 1 }).await;
    assert_eq!(broker.stats("other").await.expect("stats").ready, 0, "a delayed copy reaches its queue only");
    consumer.close().await;
    broker.close().await;
}

/// A dead-lettered copy keeps the original's body and properties with the failure headers
/// merged over its own; a redriven copy of it is the original again: the failure headers
/// dropped, attempt 1, the rest kept.
async fn dead_letter_and_redrive_keep_the_message_and_edit_headers<S: Subject>(subject: S) {
    let broker = subject.session().await;
    let dlq = QueueDecl { role: Role::DeadLetter, ..work("q.dlq") };
    broker
        .declare(&queues(vec![QueueDecl { dead_letter: Some("q.dlq".into()), ..work("q") }, dlq]))
        .await
        .expect("declare");
    let original = headers(&[
        (envelope::ATTEMPT_HEADER, HeaderValue::Int(3)),
        ("traceparent", text("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")),
    ]);
    broker.publish("", "q", Outgoing { headers: original, ..message("m") }).await.expect("publish");
    let (mut deliveries, consumer) = broker.consume("q", Credit::at_most(1)).await.expect("consume");
    let d = next(&mut deliveries, "the original").await;
    let failure = headers(&[
        (envelope::REASON_HEADER, text("permanent")),
        (envelope::ERROR_HEADER, text("HTTP 422")),
        (envelope::ATTEMPTS_HEADER, HeaderValue::Int(3)),
        (envelope::FAILED_AT_HEADER, text("2026-12-04T00:00:00Z")),
        (envelope::SOURCE_QUEUE_HEADER, text("q")),
    ]);
    broker.copy(&d, Target::DeadLetter("q.dlq"), &Edits::setting(failure.clone())).await.expect("dead-letter");
    consumer.ack(&[d]).await.expect("ack the original");
    consumer.close().await;

    let (mut dead, dead_consumer) = broker.browse("q.dlq", Credit::at_most(1)).await.expect("browse the dead letters");
    let copy = next(&mut dead, "the dead-lettered copy").await;
    assert_eq!((body(&copy).as_str(), copy.message_id(), copy.timestamp()), ("m", Some("id-m"), Some(1_700_000_000)));
    assert_eq!((copy.kind(), copy.content_type()), (Some("t"), Some("application/x-test")), "the properties stay");
    for (name, value) in &failure {
        assert_eq!(copy.header(name).as_ref(), Some(value), "{name} on the dead-lettered copy");
    }
    assert_eq!(copy.header(envelope::ATTEMPT_HEADER), Some(HeaderValue::Int(3)), "the original's headers stay");
    // As `sluice dlq redrive` does: the original removed with its copy where the broker can,
    // else acked once the copy is confirmed.
    let edits = sluice::ops::dlq::redrive_edits();
    let removed = broker.copy_and_remove("q", &dead_consumer, &copy, &edits).await.expect("redrive");
    if !removed {
        dead_consumer.ack(&[copy]).await.expect("ack the dead letter");
    }
    wait_for_stats(&broker, "q.dlq", QueueStats { ready: 0, consumers: 1 }).await;
    dead_consumer.close().await;

    let (mut redriven, redriven_consumer) =
        broker.consume("q", Credit::at_most(1)).await.expect("consume the redriven copy");
    let again = next(&mut redriven, "the redriven copy").await;
    assert_eq!(
        (body(&again).as_str(), again.message_id(), again.timestamp()),
        ("m", Some("id-m"), Some(1_700_000_000))
    );
    assert_eq!((again.kind(), again.content_type()), (Some("t"), Some("application/x-test")), "the properties stay");
    for name in envelope::FAILURE_HEADERS {
        assert_eq!(again.header(name), None, "{name} dropped on redrive");
    }
    assert_eq!(again.header(envelope::ATTEMPT_HEADER), Some(HeaderValue::Int(1)), "attempt 1 again");
    assert_eq!(again.header("traceparent"), Some(text("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")));
    redriven_consumer.ack(&[again]).await.expect("ack");
    redriven_consumer.close().await;
    broker.close().await;
}

/// A queue at its `max_length` refuses a publish (the producer knows) and keeps
/// what it holds, the refused message not among it; it takes messages again once there is
/// room.
async fn a_full_queue_refuses_publishes<S: Subject>(subject: S) {
    let broker = subject.session().await;
    let plan = queues(vec![QueueDecl { max_length: Some(2), ..work("small") }]);
    if !broker.capabilities().max_length {
        let refused = broker.declare(&plan).await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("max_length"), "a broker that cannot bound a queue refuses max_length: {refused}");
        broker.close().await;
        return;
    }
    broker.declare(&plan).await.expect("declare");
    let most = 2 + broker.capabilities().admits_past_max_length;
    let mut accepted = Vec::new();
    let refused = loop {
        let b = format!("m{}", accepted.len() + 1);
        match broker.publish("", "small", message(&b)).await {
            Ok(()) if accepted.len() < most => accepted.push(b),
            other => break other,
        }
    };
    assert!(
        matches!(&refused, Err(BrokerError::Rejected { .. })),
        "publish {} to a full queue: {refused:?}",
        accepted.len() + 1
    );
    assert!(accepted.len() >= 2, "a queue of max_length 2 takes two: {accepted:?}");
    wait_for_stats(&broker, "small", QueueStats { ready: accepted.len() as u32, consumers: 0 }).await;
    let (mut deliveries, consumer) = broker.consume("small", Credit::at_most(1)).await.expect("consume");
    let d = next(&mut deliveries, "the oldest").await;
    consumer.ack(&[d]).await.expect("ack");
    consumer.close().await;
    wait_for_stats(&broker, "small", QueueStats { ready: accepted.len() as u32 - 1, consumers: 0 }).await;
    // Room again (on a broker that admits one past the limit, once below it).
    let (mut deliveries, consumer) = broker.consume("small", Credit::at_most(10)).await.expect("consume");
    let (held, rest) = bodies(&mut deliveries, accepted.len() - 1, "what the queue holds").await;
    assert_eq!(held, accepted[1..], "the accepted ones, in order; the refused one was never taken");
    consumer.ack(&rest).await.expect("ack");
    consumer.close().await;
    wait_for_stats(&broker, "small", QueueStats { ready: 0, consumers: 0 }).await;
    publish_all(&broker, "small", &["again"]).await;
    wait_for_stats(&broker, "small", QueueStats { ready: 1, consumers: 0 }).await;
    broker.close().await;
}

/// The same plan declared again changes nothing; a declaration that differs from what exists
/// is refused with a message naming the object, the setting (in the broker's words:
/// `max_length`, `x-max-length`) and both values, and none of the settings that agree.
async fn a_differing_declaration_names_the_setting_and_both_values<S: Subject>(subject: S) {
    let broker = subject.session().await;
    // The setting that differs: max_length, or the queue's type on a broker without bounds.
    let bounded = broker.capabilities().max_length;
    let queue =
        if bounded { QueueDecl { max_length: Some(1_234_567), ..work("conflicted") } } else { work("conflicted") };
    let plan = Plan {
        exchanges: vec![ExchangeDecl { name: "ev".into(), kind: ExchangeKind::Direct }],
        queues: vec![queue],
        bindings: vec![binding("ev", "conflicted", "k", json!(null))],
    };
    broker.declare(&plan).await.expect("declare");
    broker.declare(&plan).await.expect("the same plan again");
    let mut runner_limit = plan.clone();
    runner_limit.queues[0].max_message_bytes = Some(1024);
    broker.declare(&runner_limit).await.expect("the runner's body limit is not the broker's declaration");

    let mut differing = plan.clone();
    let (parts, agreeing) = if bounded {
        differing.queues[0].max_length = Some(7_654_321);
        (["conflicted", "max_length", "1234567", "7654321"], ["single_active", "dead_letter", "quorum"])
    } else {
        differing.queues[0].kind = QueueKind::Classic;
        (["conflicted", "type", "quorum", "classic"], ["single_active", "dead_letter", "max_length"])
    };
    let Err(BrokerError::Conflict(message)) = broker.declare(&differing).await else { panic!("a conflict") };
    let message = message.to_string();
    let words = message.to_lowercase().replace('-', "_");
    for part in parts {
        assert!(words.contains(part), "{part} in: {message}");
    }
    for agreeing in agreeing {
        assert!(!words.contains(agreeing), "{agreeing} (which agrees) in: {message}");
    }

    let mut other_kind = plan.clone();
    other_kind.exchanges[0].kind = ExchangeKind::Topic;
    let Err(BrokerError::Conflict(message)) = broker.declare(&other_kind).await else { panic!("a conflict") };
    let message = message.to_string();
    for part in ["ev", "type", "direct", "topic"] {
        assert!(message.contains(part), "{part} in: {message}");
    }
    assert_eq!(broker.stats("conflicted").await.expect("the queue stands").ready, 0);
    broker.close().await;
}

/// On a single-active-consumer queue only one consumer receives, in queue order, however
/// much room the others have; when it closes, the next takes over from what it handed back.
async fn a_single_active_consumer_queue_delivers_to_one_at_a_time<S: Subject>(subject: S) {
    let broker = subject.session().await;
    let plan = queues(vec![QueueDecl { single_active_consumer: true, ..work("ordered") }]);
    if !broker.capabilities().orderings.contains(&sluice::broker::capabilities::Ordering::SingleActiveConsumer) {
        if broker.capabilities().orders() {
            return one_group_is_delivered_in_order_one_at_a_time(broker, &plan).await;
        }
        let refused = broker.declare(&plan).await;
        let refused = refused.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("single_active_consumer"), "a broker without it refuses, naming it: {refused}");
        broker.close().await;
        return;
    }
    broker.declare(&plan).await.expect("declare");
    let (mut active, first) = broker.consume("ordered", Credit::at_most(1)).await.expect("first consumer");
    let (mut waiting, second) = broker.consume("ordered", Credit::at_most(10)).await.expect("second consumer");
    let consumers = if broker.capabilities().counts_waiting_consumers { 2 } else { 1 };
    wait_for_stats(&broker, "ordered", QueueStats { ready: 0, consumers }).await;
    publish_all(&broker, "ordered", &["m1", "m2", "m3", "m4"]).await;
    let d1 = next(&mut active, "the active consumer's first").await;
    assert_eq!(body(&d1), "m1");
    // The other has room for all three, yet they stay ready.
    wait_for_stats(&broker, "ordered", QueueStats { ready: 3, consumers }).await;
    first.ack(&[d1]).await.expect("ack");
    let d2 = next(&mut active, "the active consumer's second").await;
    assert_eq!(body(&d2), "m2");
    wait_for_stats(&broker, "ordered", QueueStats { ready: 2, consumers }).await;
    first.close().await;
    let (order, rest) = bodies(&mut waiting, 3, "after the active consumer closed").await;
    assert_eq!(order, ["m2", "m3", "m4"], "the next consumer takes over, in order");
    second.ack(&rest).await.expect("ack");
    wait_for_stats(&broker, "ordered", QueueStats { ready: 0, consumers: 1 }).await;
    second.close().await;
    broker.close().await;
}

/// Where a broker orders a queue per key instead (SQS FIFO), the queue is one key: while a
/// message is held, another consumer with room receives nothing; once it is acked and its
/// consumer gone, the other receives the rest in queue order.
async fn one_group_is_delivered_in_order_one_at_a_time<B: Operate>(broker: B, plan: &Plan) {
    broker.declare(plan).await.expect("declare");
    publish_all(&broker, "ordered", &["m1", "m2", "m3", "m4"]).await;
    let (mut first, one) = broker.consume("ordered", Credit::at_most(1)).await.expect("first consumer");
    let d1 = next(&mut first, "the first consumer's first").await;
    assert_eq!(body(&d1), "m1");
    let (mut second, two) = broker.consume("ordered", Credit::at_most(10)).await.expect("second consumer");
    // The other has room for all three, yet they stay ready while m1 is held.
    wait_for_stats(&broker, "ordered", QueueStats { ready: 3, consumers: 0 }).await;
    one.ack(&[d1]).await.expect("ack");
    one.close().await;
    let (order, rest) = bodies(&mut second, 3, "after the first consumer acked and closed").await;
    assert_eq!(order, ["m2", "m3", "m4"], "the rest in queue order");
    two.ack(&rest).await.expect("ack");
    wait_for_stats(&broker, "ordered", QueueStats { ready: 0, consumers: 0 }).await;
    two.close().await;
    broker.close().await;
}

/// Browsing reads a queue in order, at most `window` unsettled; each message acked is removed
/// at once, and closing hands back the rest, in their order.
async fn browsing_reads_in_order_and_hands_back_the_rest<S: Subject>(subject: S) {
    let broker = subject.session().await;
    broker.declare(&queues(vec![work("q")])).await.expect("declare");
    publish_all(&broker, "q", &["m1", "m2", "m3", "m4", "m5"]).await;
    let (mut deliveries, consumer) = broker.browse("q", Credit::at_most(2)).await.expect("browse");
    let (first, held) = bodies(&mut deliveries, 2, "the window").await;
    assert_eq!(first, ["m1", "m2"]);
    wait_for_stats(&broker, "q", QueueStats { ready: 3, consumers: 1 }).await;
    consumer.ack(&held[1..]).await.expect("ack m2");
    assert_eq!(body(&next(&mut deliveries, "the next after an ack").await), "m3");
    consumer.close().await;
    wait_for_stats(&broker, "q", QueueStats { ready: 4, consumers: 0 }).await;
    let (mut again, other) = broker.browse("q", Credit::at_most(10)).await.expect("browse again");
    assert_eq!(bodies(&mut again, 4, "browsing again").await.0, ["m1", "m3", "m4", "m5"]);
    other.close().await;
    wait_for_stats(&broker, "q", QueueStats { ready: 4, consumers: 0 }).await;
    broker.close().await;
}

/// `stats` counts the messages ready (not those delivered and unsettled) and the consumers
/// attached; an unknown queue is `NotFound`.
async fn stats_count_ready_messages_and_consumers<S: Subject>(subject: S) {
    let broker = subject.session().await;
    broker.declare(&queues(vec![work("q")])).await.expect("declare");
    assert_eq!(broker.stats("q").await.expect("stats"), QueueStats { ready: 0, consumers: 0 });
    publish_all(&broker, "q", &["m1", "m2", "m3"]).await;
    wait_for_stats(&broker, "q", QueueStats { ready: 3, consumers: 0 }).await;
    let (mut deliveries, consumer) = broker.consume("q", Credit::at_most(1)).await.expect("consume");
    let d = next(&mut deliveries, "one").await;
    wait_for_stats(&broker, "q", QueueStats { ready: 2, consumers: 1 }).await;
    let (_browsing, browser) = broker.browse("q", Credit::at_most(1)).await.expect("browse");
    wait_for_stats(&broker, "q", QueueStats { ready: 1, consumers: 2 }).await;
    browser.close().await;
    consumer.ack(&[d]).await.expect("ack");
    consumer.close().await;
    wait_for_stats(&broker, "q", QueueStats { ready: 2, consumers: 0 }).await;
    let missing = broker.stats("nowhere").await;
    assert!(matches!(missing, Err(BrokerError::NotFound(_))), "an undeclared queue: {missing:?}");
    broker.close().await;
}

/// Removing a binding removes it and only it: its queue and what the queue holds stay, and
/// removing it again is no error. After a lost session, `redeclare` makes the plan stand
/// without bringing back what was unbound; declaring the binding again brings it back.
async fn unbinding_removes_only_the_bindings<S: Subject>(subject: S) {
    let broker = subject.session().await;
    let (kept, dropped) = (binding("ev", "a", "k", json!(null)), binding("ev", "b", "k", json!(null)));
    let plan = Plan {
        exchanges: vec![ExchangeDecl { name: "ev".into(), kind: ExchangeKind::Direct }],
        queues: vec![work("a"), work("b")],
        bindings: vec![kept, dropped.clone()],
    };
    broker.declare(&plan).await.expect("declare");
    broker.publish("ev", "k", message("before")).await.expect("publish");
    broker.unbind(std::slice::from_ref(&dropped)).await.expect("unbind");
    broker.unbind(std::slice::from_ref(&dropped)).await.expect("unbinding again is no error");
    crate::support::wait_until(DEADLINE, "b still holds its message", || async {
        broker.depth("b").await.expect("depth") == 1
    })
    .await;
    broker.publish("ev", "k", message("after")).await.expect("publish");
    assert_eq!(read_until_end(&broker, "a").await, ["before", "after"]);
    assert_eq!(read_until_end(&broker, "b").await, ["before"], "the queue and what it held stay");

    let unbound = Plan { bindings: plan.bindings[..1].to_vec(), ..plan.clone() };
    broker.redeclare(&unbound).await.expect("redeclare");
    broker.publish("ev", "k", message("again")).await.expect("publish");
    assert_eq!(read_until_end(&broker, "b").await, Vec::<String>::new(), "redeclare brings back nothing unbound");
    broker.declare(&plan).await.expect("declare the binding again");
    broker.publish("ev", "k", message("back")).await.expect("publish");
    assert_eq!(read_until_end(&broker, "b").await, ["back"]);
    broker.close().await;
}

/// Acks in any order, from many tasks at once on clones of one consumer: each delivery is
/// acked exactly once and none comes again (a broker that acks cumulatively sends what it
/// held back when the consumer closes).
async fn acks_in_any_order_settle_each_once<S: Subject>(subject: S) {
    let broker = subject.session().await;
    broker.declare(&queues(vec![work("q")])).await.expect("declare");
    let names: Vec<String> = (0..20).map(|i| format!("m{i:02}")).collect();
    publish_all(&broker, "q", &names.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let (mut deliveries, consumer) = broker.consume("q", Credit::at_most(20)).await.expect("consume");
    let (_, held) = bodies(&mut deliveries, 20, "every message").await;
    let mut shares: Vec<Vec<_>> = (0..4).map(|_| Vec::new()).collect();
    for (i, d) in held.into_iter().enumerate() {
        shares[i % 4].push(d);
    }
    let tasks: Vec<_> = shares
        .into_iter()
        .map(|share| {
            let consumer = consumer.clone();
            tokio::spawn(async move {
                for d in share.into_iter().rev() {
                    consumer.ack(std::slice::from_ref(&d)).await.expect("ack");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("an acking task");
    }
    consumer.close().await;
    assert_eq!(read_until_end(&broker, "q").await, Vec::<String>::new(), "nothing acked comes again");
    broker.close().await;
}

/// A delivery shows what was published: body and size, id, timestamp, route, each header
/// (also as JSON, for people), no dead-letter record; it is live until its consumer closes.
/// A broker that can tell where a publish would go before sending it names the queue.
async fn a_delivery_shows_what_was_published<S: Subject>(subject: S) {
    let broker = subject.session().await;
    assert!(broker.is_connected(), "a new session is connected");
    let plan = Plan {
        exchanges: vec![ExchangeDecl { name: "ev".into(), kind: ExchangeKind::Topic }],
        queues: vec![work("q")],
        bindings: vec![binding("ev", "q", "order.*", json!(null))],
    };
    broker.declare(&plan).await.expect("declare");
    if let Some(limits) = broker.body_limits("ev", "order.paid", &Headers::new()).await.expect("body limits") {
        assert_eq!(limits.iter().map(|(q, _)| q.as_str()).collect::<Vec<_>>(), ["q"], "{limits:?}");
    }
    let sent = Outgoing { headers: headers(&[("s", text("v")), ("n", HeaderValue::Int(7))]), ..message("m") };
    broker.publish("ev", "order.paid", sent).await.expect("publish");
    let (mut deliveries, consumer) = broker.consume("q", Credit::at_most(1)).await.expect("consume");
    let d = next(&mut deliveries, "the message").await;
    assert_eq!((body(&d).as_str(), d.size()), ("m", 1));
    assert_eq!((d.message_id(), d.timestamp()), (Some("id-m"), Some(1_700_000_000)));
    assert_eq!((d.kind(), d.content_type()), (Some("t"), Some("application/x-test")));
    let route = d.route().map(|r| (r.exchange.as_str(), r.routing_key.as_str()));
    assert_eq!(route, Some(("ev", "order.paid")));
    assert_eq!((d.header("n"), d.header("absent")), (Some(HeaderValue::Int(7)), None));
    let shown = d.headers();
    assert_eq!((shown.get("s"), shown.get("n")), (Some(&json!("v")), Some(&json!(7))), "{shown:?}");
    assert_eq!(d.dead_letter_record(), None, "never dead-lettered");
    assert!(d.is_live(), "its consumer is open");
    consumer.close().await;
    assert!(!d.is_live(), "handed back: no longer this consumer's to ack");
    broker.close().await;
}

/// Cancelling a consumer stops new deliveries: what was sent still arrives, then the stream
/// ends; a delivery of it can still be acked, and closing hands back the rest.
async fn cancel_ends_the_stream_and_close_hands_back_the_rest<S: Subject>(subject: S) {
    let broker = subject.session().await;
    broker.declare(&queues(vec![work("q")])).await.expect("declare");
    publish_all(&broker, "q", &["m1", "m2", "m3"]).await;
    let (mut deliveries, consumer) = broker.consume("q", Credit::at_most(1)).await.expect("consume");
    let first = next(&mut deliveries, "the first").await;
    consumer.cancel().await.expect("cancel");
    let mut sent = Vec::new();
    tokio::time::timeout(DEADLINE, async {
        while let Some(d) = deliveries.next().await {
            sent.push(d.expect("a delivery"));
        }
    })
    .await
    .expect("the stream ends after a cancel");
    assert!(sent.is_empty(), "nothing beyond the credit: {:?}", sent.iter().map(body).collect::<Vec<_>>());
    consumer.ack(&[first]).await.expect("ack after the cancel");
    consumer.close().await;
    let mut rest = read_until_end(&broker, "q").await;
    rest.sort();
    assert_eq!(rest, ["m2", "m3"]);
    broker.close().await;
}

/// A consumer that takes no body over a limit gets a larger message whole, or as its size
/// alone where the broker knows it without reading it; a smaller one always whole.
async fn consume_within_gives_a_large_body_whole_or_as_its_size<S: Subject>(subject: S) {
    let broker = subject.session().await;
    broker.declare(&queues(vec![work("q")])).await.expect("declare");
    let large = "x".repeat(100);
    publish_all(&broker, "q", &["small", &large]).await;
    let (mut deliveries, consumer) = broker.consume_within("q", Credit::at_most(10), 10).await.expect("consume");
    let small = next(&mut deliveries, "the small one").await;
    assert_eq!(body(&small), "small");
    let held = next(&mut deliveries, "the large one").await;
    assert_eq!(held.size(), 100);
    assert!(held.body().is_empty() || body(&held) == large, "whole or held back: {} bytes", held.body().len());
    consumer.ack(&[small, held]).await.expect("ack");
    consumer.close().await;
    broker.close().await;
}

/// Drift: before anything is declared, the plan's exchange and queue are missing; once it is
/// declared, nothing is missing or conflicting.
async fn drift_names_what_is_missing_and_then_nothing<S: Subject>(subject: S) {
    let broker = subject.session().await;
    let plan = Plan {
        exchanges: vec![ExchangeDecl { name: "ev".into(), kind: ExchangeKind::Fanout }],
        queues: vec![work("q")],
        bindings: vec![binding("ev", "q", "", json!(null))],
    };
    let before = broker.drift(&plan).await.expect("drift");
    assert!(before.contains(&Drift::MissingExchange { name: "ev".into() }), "{before:?}");
    assert!(before.contains(&Drift::MissingQueue { name: "q".into() }), "{before:?}");
    broker.declare(&plan).await.expect("declare");
    let after = broker.drift(&plan).await.expect("drift");
    assert!(
        after.iter().all(|d| matches!(d, Drift::BindingsUnchecked { .. })),
        "only what the broker cannot check may remain: {after:?}"
    );
    broker.close().await;
}

/// What operators read without taking: the oldest message where the broker can read it so,
/// and the messages held under a running lease where deliveries are leased.
async fn the_oldest_and_the_leased_are_read_without_taking<S: Subject>(subject: S) {
    let broker = subject.session().await;
    broker.declare(&queues(vec![work("q")])).await.expect("declare");
    publish_all(&broker, "q", &["m1", "m2"]).await;
    if let Some(oldest) = broker.oldest("q").await.expect("oldest") {
        assert_eq!(oldest.as_ref().map(body).as_deref(), Some("m1"));
    }
    let (mut deliveries, consumer) = broker.consume("q", Credit::at_most(1)).await.expect("consume");
    let held = next(&mut deliveries, "the first").await;
    let leased = broker.leased("q").await.expect("leased");
    match broker.capabilities().leases {
        true => assert_eq!(leased.map(|l| l.count), Some(1), "the one held: {leased:?}"),
        false => assert_eq!(leased, None, "no leases"),
    }
    consumer.ack(&[held]).await.expect("ack");
    consumer.close().await;
    assert_eq!(read_until_end(&broker, "q").await, ["m2"]);
    broker.close().await;
}

/// Where the broker's own store holds idempotency keys, an ack can record them in its
/// transaction; any other broker refuses, acking nothing (the delivery stays ackable).
async fn keys_ride_an_ack_only_where_the_broker_holds_them<S: Subject>(subject: S) {
    let broker = subject.session().await;
    broker.declare(&queues(vec![work("q")])).await.expect("declare");
    publish_all(&broker, "q", &["m"]).await;
    let (mut deliveries, consumer) = broker.consume("q", Credit::at_most(1)).await.expect("consume");
    let d = next(&mut deliveries, "the message").await;
    let recorded = consumer.ack_recording(std::slice::from_ref(&d), &["q\0k".into()], Duration::from_secs(60)).await;
    match broker.capabilities().holds_keys {
        true => recorded.expect("acked with its key"),
        false => {
            assert!(recorded.is_err(), "a broker without keys refuses");
            assert!(d.is_live(), "and acks nothing");
            consumer.ack(&[d]).await.expect("ack");
        }
    }
    consumer.close().await;
    assert_eq!(read_until_end(&broker, "q").await, Vec::<String>::new());
    broker.close().await;
}

/// For each body, a module of tests, one per broker: each runs the body on a broker of its
/// own. A broker joins the suite with one line in the list.
macro_rules! conformance {
    (brokers $brokers:tt tests { $($test:ident),* $(,)? }) => {
        $(conformance!(@one $test $brokers);)*
    };
    (@one $test:ident { $($broker:ident: $subject:expr),* $(,)? }) => {
        mod $test {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $broker() {
                    super::$test($subject).await
                }
            )*
        }
    };
}

conformance! {
    brokers {
        memory: InMemory(Memory::new()),
        embedded: EmbeddedDir::new(),
        rabbitmq: Vhost::new(),
        redis: OnRedis(RedisPrefix::with(&format!("&lease={}s", REDIS_LEASE.as_secs()))),
        redis_sentinel: OnRedis(RedisPrefix::on_sentinels(&format!("&lease={}s", REDIS_LEASE.as_secs()))),
        redis_cluster: OnRedis(RedisPrefix::on_cluster(&format!("&lease={}s", REDIS_LEASE.as_secs()))),
        jetstream: OnNats(NatsPrefix::with(&format!("&lease={}s", NATS_LEASE.as_secs()))),
        sqs: OnSqs(SqsPrefix::with(&format!("&lease={}s", SQS_LEASE.as_secs()))),
    }
    tests {
        every_exchange_type_routes_as_rabbitmq_does,
        prefetch_is_a_bound_and_close_hands_back_in_order,
        a_lost_sessions_unacked_deliveries_come_again_to_another_consumer,
        delays_are_exact_and_block_nothing,
        dead_letter_and_redrive_keep_the_message_and_edit_headers,
        a_full_queue_refuses_publishes,
        a_differing_declaration_names_the_setting_and_both_values,
        a_single_active_consumer_queue_delivers_to_one_at_a_time,
        browsing_reads_in_order_and_hands_back_the_rest,
        stats_count_ready_messages_and_consumers,
        unbinding_removes_only_the_bindings,
        acks_in_any_order_settle_each_once,
        a_delivery_shows_what_was_published,
        cancel_ends_the_stream_and_close_hands_back_the_rest,
        consume_within_gives_a_large_body_whole_or_as_its_size,
        drift_names_what_is_missing_and_then_nothing,
        the_oldest_and_the_leased_are_read_without_taking,
        keys_ride_an_ack_only_where_the_broker_holds_them,
    }
}
