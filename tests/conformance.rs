//! Issue 23 (part 2): the broker contract, one suite for every broker. Each test body is
//! written once against the `Broker` trait and run, by [`conformance!`], on the in-memory test
//! double, the embedded broker (a directory of its own) and RabbitMQ (a vhost of its own): a
//! new broker is "implement, then pass", by adding one line to the list at the bottom.
//!
//! The rules checked are listed in `docs/DESIGN-NOTES.md` ("The broker contract"). Where
//! brokers legitimately differ, the test asks the broker or its [`Subject`] (a capability),
//! never skips.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use futures_util::{Stream, StreamExt as _};
use serde_json::json;
use sluice::broker::memory::Memory;
use sluice::broker::{Broker, BrokerError, Consumer, Delivery, HeaderValue, Headers, Operate, Outgoing, QueueStats};
use sluice::config::ExchangeKind;
use sluice::envelope;
use sluice::topology::{BindingDecl, ExchangeDecl, Plan, QueueDecl, Role};

use crate::support::{EmbeddedDir, Place, RedisPrefix, Vhost};

/// How long anything that should happen soon may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(15);

/// A broker under test, of the test's own: where its sessions come from, and how it
/// legitimately differs from the others.
pub trait Subject: Send + Sync {
    type Broker: Operate;

    /// A new session, as another process would open it.
    fn session(&self) -> impl Future<Output = Self::Broker> + Send;

    /// How long the unsettled deliveries of a consumer whose session ended without closing
    /// it may take to be delivered again: at once where the broker sees the session end
    /// (RabbitMQ, the in-memory broker); after its lease on the embedded broker, which sees
    /// only that nobody renews the lease (a killed process closes nothing).
    fn lost_deliveries_return_within(&self) -> Duration {
        DEADLINE
    }

    /// Whether an ack of a delivery behind an unsettled one may be held back, to go in one
    /// batch with it (RabbitMQ: one `multiple` ack covers a contiguous range of delivery
    /// tags). Such an ack makes no room in the prefetch window while held, and is lost with
    /// the session: that message comes again (at-least-once; idempotency absorbs it). Closing
    /// the consumer sends it.
    fn holds_acks_behind_unsettled(&self) -> bool {
        false
    }

    /// How many messages a queue at its `max_length` may take past it before publishes are
    /// refused (RabbitMQ's quorum queues check the limit only once it is exceeded: one).
    fn admits_past_max_length(&self) -> usize {
        0
    }

    /// Whether `stats` counts the consumers of a single-active-consumer queue that wait their
    /// turn (RabbitMQ counts only the active one).
    fn counts_waiting_consumers(&self) -> bool {
        true
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

    fn lost_deliveries_return_within(&self) -> Duration {
        sluice::broker::embedded::LEASE + DEADLINE
    }
}

impl Subject for Vhost {
    type Broker = sluice::broker::amqp::Amqp;

    async fn session(&self) -> Self::Broker {
        self.connect().await
    }

    fn holds_acks_behind_unsettled(&self) -> bool {
        true
    }

    fn admits_past_max_length(&self) -> usize {
        1
    }

    fn counts_waiting_consumers(&self) -> bool {
        false
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

    /// As on the embedded broker: nobody renewing the lease is what tells of a lost session.
    fn lost_deliveries_return_within(&self) -> Duration {
        REDIS_LEASE + DEADLINE
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
async fn publish_all<B: Broker>(broker: &B, queue: &str, bodies: &[&str]) {
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

/// Waits until the broker says `stats` of `queue`.
async fn wait_for_stats<B: Broker>(broker: &B, queue: &str, stats: QueueStats) {
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
async fn read_until_end<B: Broker>(broker: &B, queue: &str) -> Vec<String> {
    broker.publish("", queue, message("end")).await.unwrap_or_else(|e| panic!("end marker to {queue}: {e}"));
    let (mut deliveries, consumer) = broker.consume(queue, 100).await.expect("consume");
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
    let (mut deliveries, consumer) = broker.consume("q", 2).await.expect("consume");
    let (first, held) = bodies(&mut deliveries, 2, "the first two").await;
    assert_eq!(first, ["m1", "m2"]);
    // Four ready: the broker holds back everything beyond the prefetch.
    wait_for_stats(&broker, "q", QueueStats { ready: 4, consumers: 1 }).await;
    // The oldest: no broker holds this ack back (see `holds_acks_behind_unsettled`).
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
    let (mut again, other) = broker.consume("q", 10).await.expect("consume again");
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
    let (mut deliveries, consumer) = lost.consume("q", 10).await.expect("consume");
    let (got, held) = bodies(&mut deliveries, 4, "the lost session's").await;
    assert_eq!(got, ["m1", "m2", "m3", "m4"]);
    consumer.ack(&held[..1]).await.expect("ack m1");
    consumer.ack(&held[2..3]).await.expect("ack m3, behind m2");
    let (mut again, other) = survivor.consume("q", 10).await.expect("another consumer");
    // The session ends with nothing closed or settled.
    lost.close().await;
    drop((deliveries, consumer, held, lost));
    let within = subject.lost_deliveries_return_within();
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
    let expected: &[&str] = if subject.holds_acks_behind_unsettled() && redelivered.len() == 3 {
        &["m2", "m3", "m4"]
    } else {
        &["m2", "m4"]
    };
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
    let (mut deliveries, consumer) = broker.consume("q", 10).await.expect("consume");
    let d = next(&mut deliveries, "the original").await;
    let long_sent = Instant::now();
    let which = |w: &str| headers(&[("which", text(w)), ("n", HeaderValue::Int(2))]);
    broker.publish_delayed("q", long, &d, which("long")).await.expect("long delay");
    let short_sent = Instant::now();
    broker.publish_delayed("q", short, &d, which("short")).await.expect("short delay");
    consumer.ack(&[d]).await.expect("ack the original");
    let first = next(&mut deliveries, "the short delay").await;
    assert_eq!(first.header("which"), Some(text("short")), "the shorter delay arrives first");
    assert!(short_sent.elapsed() >= short, "not before its delay");
    let second = next(&mut deliveries, "the long delay").await;
    assert_eq!(second.header("which"), Some(text("long")));
    assert!(long_sent.elapsed() >= long, "not before its delay");
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
    let (mut deliveries, consumer) = broker.consume("q", 1).await.expect("consume");
    let d = next(&mut deliveries, "the original").await;
    let failure = headers(&[
        (envelope::REASON_HEADER, text("permanent")),
        (envelope::ERROR_HEADER, text("HTTP 422")),
        (envelope::ATTEMPTS_HEADER, HeaderValue::Int(3)),
        (envelope::FAILED_AT_HEADER, text("2026-12-04T00:00:00Z")),
        (envelope::SOURCE_QUEUE_HEADER, text("q")),
    ]);
    broker.dead_letter("q.dlq", &d, failure.clone()).await.expect("dead-letter");
    consumer.ack(&[d]).await.expect("ack the original");
    consumer.close().await;

    let (mut dead, dead_consumer) = broker.browse("q.dlq", 1).await.expect("browse the dead letters");
    let copy = next(&mut dead, "the dead-lettered copy").await;
    assert_eq!((body(&copy).as_str(), copy.message_id(), copy.timestamp()), ("m", Some("id-m"), Some(1_700_000_000)));
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

    let (mut redriven, redriven_consumer) = broker.consume("q", 1).await.expect("consume the redriven copy");
    let again = next(&mut redriven, "the redriven copy").await;
    assert_eq!(
        (body(&again).as_str(), again.message_id(), again.timestamp()),
        ("m", Some("id-m"), Some(1_700_000_000))
    );
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
    broker.declare(&queues(vec![QueueDecl { max_length: Some(2), ..work("small") }])).await.expect("declare");
    let most = 2 + subject.admits_past_max_length();
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
    let (mut deliveries, consumer) = broker.consume("small", 1).await.expect("consume");
    let d = next(&mut deliveries, "the oldest").await;
    consumer.ack(&[d]).await.expect("ack");
    consumer.close().await;
    wait_for_stats(&broker, "small", QueueStats { ready: accepted.len() as u32 - 1, consumers: 0 }).await;
    // Room again (on a broker that admits one past the limit, once below it).
    let (mut deliveries, consumer) = broker.consume("small", 10).await.expect("consume");
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
    let plan = Plan {
        exchanges: vec![ExchangeDecl { name: "ev".into(), kind: ExchangeKind::Direct }],
        queues: vec![QueueDecl { max_length: Some(1_234_567), ..work("conflicted") }],
        bindings: vec![binding("ev", "conflicted", "k", json!(null))],
    };
    broker.declare(&plan).await.expect("declare");
    broker.declare(&plan).await.expect("the same plan again");
    let mut runner_limit = plan.clone();
    runner_limit.queues[0].max_message_bytes = Some(1024);
    broker.declare(&runner_limit).await.expect("the runner's body limit is not the broker's declaration");

    let mut longer = plan.clone();
    longer.queues[0].max_length = Some(7_654_321);
    let Err(BrokerError::Conflict(message)) = broker.declare(&longer).await else { panic!("a conflict") };
    let message = message.to_string();
    let words = message.to_lowercase().replace('-', "_");
    for part in ["conflicted", "max_length", "1234567", "7654321"] {
        assert!(words.contains(part), "{part} in: {message}");
    }
    for agreeing in ["single_active", "dead_letter", "quorum"] {
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
    broker
        .declare(&queues(vec![QueueDecl { single_active_consumer: true, ..work("ordered") }]))
        .await
        .expect("declare");
    let (mut active, first) = broker.consume("ordered", 1).await.expect("first consumer");
    let (mut waiting, second) = broker.consume("ordered", 10).await.expect("second consumer");
    let consumers = if subject.counts_waiting_consumers() { 2 } else { 1 };
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

/// Browsing reads a queue in order, at most `window` unsettled; each message acked is removed
/// at once, and closing hands back the rest, in their order.
async fn browsing_reads_in_order_and_hands_back_the_rest<S: Subject>(subject: S) {
    let broker = subject.session().await;
    broker.declare(&queues(vec![work("q")])).await.expect("declare");
    publish_all(&broker, "q", &["m1", "m2", "m3", "m4", "m5"]).await;
    let (mut deliveries, consumer) = broker.browse("q", 2).await.expect("browse");
    let (first, held) = bodies(&mut deliveries, 2, "the window").await;
    assert_eq!(first, ["m1", "m2"]);
    wait_for_stats(&broker, "q", QueueStats { ready: 3, consumers: 1 }).await;
    consumer.ack(&held[1..]).await.expect("ack m2");
    assert_eq!(body(&next(&mut deliveries, "the next after an ack").await), "m3");
    consumer.close().await;
    wait_for_stats(&broker, "q", QueueStats { ready: 4, consumers: 0 }).await;
    let (mut again, other) = broker.browse("q", 10).await.expect("browse again");
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
    let (mut deliveries, consumer) = broker.consume("q", 1).await.expect("consume");
    let d = next(&mut deliveries, "one").await;
    wait_for_stats(&broker, "q", QueueStats { ready: 2, consumers: 1 }).await;
    let (_browsing, browser) = broker.browse("q", 1).await.expect("browse");
    wait_for_stats(&broker, "q", QueueStats { ready: 1, consumers: 2 }).await;
    browser.close().await;
    consumer.ack(&[d]).await.expect("ack");
    consumer.close().await;
    wait_for_stats(&broker, "q", QueueStats { ready: 2, consumers: 0 }).await;
    let missing = broker.stats("nowhere").await;
    assert!(matches!(missing, Err(BrokerError::NotFound(_))), "an undeclared queue: {missing:?}");
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
    }
}
