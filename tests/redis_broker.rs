//! The Redis broker (issue 23) on a real Redis: the trait's rules it maps its own way (routing
//! into every bound stream or none, reject-publish, conflicts, hand-back in order on close,
//! exact delays), and a Redis restart under load with `appendonly yes` + `appendfsync always`
//! that loses nothing confirmed. A runner killed with `kill -9` and two runners on one
//! deployment are in `leased`; the shared end-to-end bodies run on it through
//! `on_every_broker!`.

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use futures_util::{FutureExt as _, StreamExt as _};
use serde_json::json;
use sluice::broker::{
    Broker, BrokerError, Consumer as _, Credit, Delivery as _, Edits, HeaderValue, Headers, Operate as _, Outgoing,
    Publish, Target,
};
use support::*;

/// An outgoing message whose body is `text`.
fn message(text: &str) -> Outgoing {
    Outgoing { body: text.as_bytes().to_vec(), ..Default::default() }
}

/// Reads `n` deliveries, their bodies as text.
async fn take<S>(deliveries: &mut S, n: usize) -> Vec<(String, S::Item)>
where
    S: futures_util::Stream + Unpin,
    S::Item: ResultDelivery,
{
    let mut out = Vec::new();
    while out.len() < n {
        let next = tokio::time::timeout(Duration::from_secs(10), deliveries.next()).await;
        let item = next.expect("a delivery within 10 s").expect("stream open");
        out.push((item.text(), item));
    }
    out
}

trait ResultDelivery {
    fn text(&self) -> String;
}

impl ResultDelivery for Result<sluice::broker::redis::RedisDelivery, BrokerError> {
    fn text(&self) -> String {
        let d = self.as_ref().expect("delivery");
        String::from_utf8_lossy(d.body()).into_owned()
    }
}

const TOPOLOGY: &str = r#"version: 1
exchanges: {ev: {type: topic}}
x-handler: &handler {command: {program: /bin/true}}
queues:
  a: {handler: *handler, bind: [{exchange: ev, routing_key: "a.#"}, {exchange: ev, routing_key: "all"}]}
  b: {handler: *handler, bind: [{exchange: ev, routing_key: "all"}], max_length: 2}
"#;

/// Fan-out writes every bound queue or none: a full queue refuses the publish (a nack) and
/// the other queue gets nothing; unroutable and unknown exchanges are errors.
#[tokio::test]
async fn fan_out_writes_every_queue_or_none() {
    let place = RedisPrefix::new();
    let dir = pipeline(TOPOLOGY);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    broker.publish("ev", "all", message("1")).await.expect("first");
    broker.publish("ev", "all", message("2")).await.expect("second");
    broker.publish("ev", "a.x", message("3")).await.expect("a only");
    let refused = broker.publish("ev", "all", message("4")).await;
    assert!(matches!(refused, Err(BrokerError::Rejected { .. })), "{refused:?}");
    assert_eq!((place.depth("a").await, place.depth("b").await), (3, 2), "nothing of the refused publish");
    let unroutable = broker.publish("ev", "nowhere", message("5")).await;
    assert!(matches!(unroutable, Err(BrokerError::Unroutable { .. })), "{unroutable:?}");
    let missing = broker.publish("nope", "all", message("6")).await;
    assert!(matches!(missing, Err(BrokerError::NotFound(_))), "{missing:?}");
    // The default exchange reaches the queue the key names.
    broker.publish("", "a", message("7")).await.expect("default exchange");
    assert_eq!(broker.stats("a").await.expect("stats").ready, 4);
    let priority = broker.publish("ev", "a.x", Outgoing { priority: Some(1), ..message("8") }).await;
    assert!(matches!(priority, Err(BrokerError::Conflict(_))), "{priority:?}");
}

/// A second declaration with another setting names the setting and both values, and changes
/// nothing; `drift` says the same; unbinding stops the routing at once in another session.
#[tokio::test]
async fn conflicts_name_both_values_and_unbind_reroutes() {
    let place = RedisPrefix::new();
    let dir = pipeline(TOPOLOGY);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let changed = pipeline(&TOPOLOGY.replace("max_length: 2", "max_length: 5"));
    let plan = sluice::topology::plan(&sluice::config::load(&[changed.path().to_path_buf()]).config.expect("valid"));
    let refused = broker.declare(&plan).await.expect_err("a conflict");
    assert!(refused.to_string().contains("max_length: declared 5 but current is 2"), "{refused}");
    let drift = broker.drift(&plan).await.expect("drift");
    assert_eq!(drift.len(), 1, "{drift:?}");
    let publisher = place.connect().await;
    publisher.publish("ev", "all", message("1")).await.expect("routed to a and b");
    let binding = plan.bindings.iter().find(|b| b.queue == "b").expect("b's binding").clone();
    broker.unbind(&[binding]).await.expect("unbind");
    publisher.publish("ev", "all", message("2")).await.expect("routed to a");
    assert_eq!((place.depth("a").await, place.depth("b").await), (2, 1));
}

/// A browse delivers in order within its window; an ack removes at once; closing hands the
/// rest back, and the next browse gets them first, in their order.
#[tokio::test]
async fn close_hands_back_in_order() {
    let place = RedisPrefix::new();
    let dir = pipeline(TOPOLOGY);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for i in 0..6 {
        broker.publish("ev", "a.x", message(&i.to_string())).await.expect("publish");
    }
    let (mut deliveries, consumer) = broker.browse("a", Credit::at_most(3)).await.expect("browse");
    let first = take(&mut deliveries, 3).await;
    assert_eq!(first.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>(), ["0", "1", "2"]);
    let second = first.into_iter().nth(1).map(|(_, d)| d.expect("delivery")).expect("second");
    consumer.ack(std::slice::from_ref(&second)).await.expect("ack");
    // Acking twice, or out of order, is safe.
    consumer.ack(std::slice::from_ref(&second)).await.expect("ack again");
    // The room the ack made takes the next one.
    take(&mut deliveries, 1).await;
    assert_eq!(broker.stats("a").await.expect("stats").ready, 2, "2 ready, 3 held");
    consumer.close().await;
    assert_eq!(broker.stats("a").await.expect("stats").ready, 5, "the 3 held handed back");
    assert!(!second.is_live());
    assert_eq!(place.depth("a").await, 5);
    let (mut deliveries, consumer) = broker.browse("a", Credit::at_most(10)).await.expect("browse again");
    let all = take(&mut deliveries, 5).await;
    assert_eq!(all.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>(), ["0", "2", "3", "4", "5"]);
    consumer.close().await;
}

/// An ack that records idempotency keys acks the entry and sets the keys done where the
/// deployment's idempotency store reads them: one script, one round trip.
#[tokio::test]
async fn an_ack_records_its_keys_for_the_deployments_store() {
    let place = RedisPrefix::new();
    let dir = pipeline(TOPOLOGY);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    broker.publish("ev", "a.x", message("m")).await.expect("publish");
    let (mut deliveries, consumer) = broker.consume("a", Credit::at_most(1)).await.expect("consume");
    let (_, d) = take(&mut deliveries, 1).await.remove(0);
    let d = d.expect("delivery");
    let store = sluice::dedup::Store::open(&sluice::dedup::Location::Redis(place.url()), false).await.expect("store");
    let claim = |key: &'static str| store.claim("a", key, Duration::from_secs(60));
    assert_eq!(claim("other").await.expect("claim"), sluice::dedup::Claim::Claimed, "a key not recorded");
    let keys = sluice::dedup::names("a", &["k".to_string()]);
    consumer.ack_recording(std::slice::from_ref(&d), &keys, Duration::from_secs(60)).await.expect("ack recording");
    assert_eq!(place.depth("a").await, 0, "and gone");
    assert_eq!(claim("k").await.expect("claim"), sluice::dedup::Claim::Done, "the store finds the key done");
    consumer.close().await;
}

/// A redrive's move writes the copy and removes the original in one script: the original is
/// gone at once, with no ack (nothing for a lost session to hand back), and the same move sent
/// again, as after a timeout, writes no second copy. A full target refuses and removes nothing.
#[tokio::test]
async fn a_move_copies_and_removes_in_one_step_and_only_once() {
    let place = RedisPrefix::new();
    let dir = pipeline(TOPOLOGY);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for i in 0..3 {
        let headers = Headers::from([("x-sluice-attempt".to_string(), HeaderValue::Int(5))]);
        broker.publish("ev", "a.x", Outgoing { headers, ..message(&i.to_string()) }).await.expect("publish");
    }
    let (mut deliveries, consumer) = broker.browse("a", Credit::at_most(10)).await.expect("browse");
    let read: Vec<_> = take(&mut deliveries, 3).await.into_iter().map(|(_, d)| d.expect("delivery")).collect();
    let edits = sluice::ops::dlq::redrive_edits();
    let moved = broker.copy_and_remove("b", &consumer, &read[0], &edits).await.expect("move");
    assert!(moved, "removed with its copy");
    assert_eq!((place.depth("a").await, place.depth("b").await), (2, 1), "the original gone without an ack");
    let again = broker.copy_and_remove("b", &consumer, &read[0], &edits).await;
    assert!(matches!(again, Err(BrokerError::Lost(_))), "{again:?}");
    assert_eq!(place.depth("b").await, 1, "no second copy");
    broker.copy_and_remove("b", &consumer, &read[1], &edits).await.expect("move");
    let full = broker.copy_and_remove("b", &consumer, &read[2], &edits).await;
    assert!(matches!(full, Err(BrokerError::Rejected { .. })), "b holds its max_length: {full:?}");
    consumer.close().await;
    assert_eq!(broker.stats("a").await.expect("stats").ready, 1, "the refused one handed back");
    let (mut copies, reader) = broker.browse("b", Credit::at_most(10)).await.expect("browse b");
    let copies = take(&mut copies, 2).await;
    assert_eq!(copies.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>(), ["0", "1"]);
    let attempt = copies[0].1.as_ref().expect("delivery").header("x-sluice-attempt");
    assert_eq!(attempt, Some(HeaderValue::Int(1)), "the copy carries the edits");
    reader.close().await;
}

/// Delayed copies come back exactly after their own delay: a long one published first does
/// not hold back a short one; `delayed` counts them until due.
#[tokio::test]
async fn delays_are_exact_without_head_of_line_blocking() {
    let place = RedisPrefix::new();
    let dir = pipeline(TOPOLOGY);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    broker.publish("ev", "a.x", message("long")).await.expect("publish");
    broker.publish("ev", "a.x", message("short")).await.expect("publish");
    let (mut deliveries, consumer) = broker.consume("a", Credit::at_most(10)).await.expect("consume");
    let both = take(&mut deliveries, 2).await;
    // Due times are the server's wall clock's: measured on it.
    let start = std::time::SystemTime::now();
    let mut originals = Vec::new();
    for (text, d) in both {
        let d = d.expect("delivery");
        let delay = if text == "long" { Duration::from_secs(4) } else { Duration::from_millis(600) };
        broker
            .copy(&d, Target::Later { queue: "a", delay }, &Edits::setting(Headers::new()))
            .await
            .expect("delayed copy");
        originals.push(d);
    }
    consumer.ack(&originals).await.expect("ack");
    assert_eq!(broker.delayed().await.expect("delayed"), 2);
    let back = take(&mut deliveries, 1).await;
    assert_eq!(back[0].0, "short");
    let short_after = wall_elapsed(start);
    assert!(not_before(short_after, Duration::from_millis(600)), "not before its time: {short_after:?}");
    let back = take(&mut deliveries, 1).await;
    assert_eq!(back[0].0, "long");
    assert!(not_before(wall_elapsed(start), Duration::from_secs(4)));
    consumer.close().await;
}

/// A consumer that stops renewing (every handle gone, as a killed process) loses its entries
/// after the lease: another consumer takes them back; `delayed` counts them meanwhile.
#[tokio::test]
async fn a_dead_consumers_entries_come_back_after_the_lease() {
    let place = RedisPrefix::with("&lease=1s");
    let dir = pipeline(TOPOLOGY);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for i in 0..3 {
        broker.publish("ev", "a.x", message(&i.to_string())).await.expect("publish");
    }
    {
        let (mut deliveries, consumer) = broker.consume("a", Credit::at_most(10)).await.expect("consume");
        take(&mut deliveries, 3).await;
        drop((deliveries, consumer));
    }
    let other = place.connect().await;
    let (mut deliveries, consumer) = other.consume("a", Credit::at_most(10)).await.expect("consume");
    let back = take(&mut deliveries, 3).await;
    let texts: BTreeSet<String> = back.iter().map(|(t, _)| t.clone()).collect();
    assert_eq!(texts, ["0", "1", "2"].map(String::from).into());
    let settled: Vec<_> = back.into_iter().map(|(_, d)| d.expect("delivery")).collect();
    consumer.ack(&settled).await.expect("ack");
    assert_eq!(place.depth("a").await, 0);
    consumer.close().await;
}

/// One queue `o`, single-active-consumer (`ordered`).
const ORDERED: &str = "version: 1\nexchanges: {ev: {type: topic}}\nqueues:\n  o:\n    ordered: true\n    concurrency: 1\n    handler: {command: {program: /bin/true}}\n    bind: [{exchange: ev, routing_key: \"#\"}]\n";

/// A single-active-consumer queue delivers to one consumer at a time; the next one takes over
/// at once when the first closes, in order (well within the 30 s lease).
#[tokio::test]
async fn a_single_active_consumer_queue_delivers_to_one() {
    let place = RedisPrefix::new();
    let dir = pipeline(ORDERED);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for i in 0..3 {
        broker.publish("ev", "x", message(&i.to_string())).await.expect("publish");
    }
    let (mut first, one) = broker.consume("o", Credit::at_most(10)).await.expect("first consumer");
    let got = take(&mut first, 3).await;
    let (mut second, two) = broker.consume("o", Credit::at_most(10)).await.expect("second consumer");
    broker.publish("ev", "x", message("3")).await.expect("publish");
    let settled: Vec<_> = got.into_iter().map(|(_, d)| d.expect("delivery")).collect();
    one.ack(&settled).await.expect("ack");
    let next = take(&mut first, 1).await;
    assert_eq!(next[0].0, "3", "the active consumer gets the next one too");
    one.close().await;
    let taken_over = take(&mut second, 1).await;
    assert_eq!(taken_over[0].0, "3", "handed back to the next consumer");
    two.close().await;
}

/// On a single-active-consumer queue, a live active consumer keeps its place however short the
/// lease (its claims renew it at least every third of the lease: they came every second, and
/// a lease under that ran out under it); killed (every handle gone without a close), its lease
/// runs out and the next consumer takes over with the entries it held, in order.
#[tokio::test]
async fn a_killed_active_consumers_place_passes_on_after_its_lease() {
    let place = RedisPrefix::with("&lease=500ms");
    let dir = pipeline(ORDERED);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for i in 0..3 {
        broker.publish("ev", "x", message(&i.to_string())).await.expect("publish");
    }
    let killed = place.connect().await;
    let (mut first, one) = killed.consume("o", Credit::at_most(10)).await.expect("first consumer");
    let held = take(&mut first, 3).await;
    let (mut second, two) = place.connect().await.consume("o", Credit::at_most(10)).await.expect("second consumer");
    // A retry copy due after four leases goes to the active consumer, still active.
    let original = held[0].1.as_ref().expect("delivery");
    killed
        .copy(original, Target::Later { queue: "o", delay: Duration::from_secs(2) }, &Edits::setting(Headers::new()))
        .await
        .expect("retry copy");
    assert_eq!(take(&mut first, 1).await[0].0, "0", "the copy, to the active consumer");
    assert!(second.next().now_or_never().is_none(), "nothing for the other while the active one lives");
    drop((first, one, held, killed));
    let taken_over = take(&mut second, 4).await;
    let texts: Vec<&str> = taken_over.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(texts, ["0", "1", "2", "0"], "what the killed one held, in order");
    two.close().await;
}

/// An entry a claim took whose answer never reached the consumer (the connection broke, or the
/// server restarted, after the script ran) is not renewed by the consumer that never knew of it:
/// its lease runs out and it is delivered. (Such an entry was renewed for as long as the runner
/// lived: CI lost one across a Redis restart.)
#[tokio::test]
async fn an_entry_claimed_without_the_consumer_knowing_comes_back_after_its_lease() {
    let place = RedisPrefix::with("&lease=1s");
    let dir = pipeline(TOPOLOGY);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    broker.publish("", "a", message("m0")).await.expect("publish");
    let (mut deliveries, consumer) = broker.consume("a", Credit::at_most(1)).await.expect("consume");
    let held = take(&mut deliveries, 1).await.remove(0).1.expect("delivery");
    // Its prefetch is full; m1 is read under its name behind its back, as a lost answer leaves it.
    broker.publish("", "a", message("m1")).await.expect("publish");
    let stream = format!("{}s:a", place.prefix);
    let mut raw = place.raw();
    let consumers: Vec<redis::Value> =
        redis::cmd("XINFO").arg("CONSUMERS").arg(&stream).arg("g").query(&mut raw).expect("XINFO");
    let name = consumers
        .iter()
        .find_map(|c| match c {
            redis::Value::Array(fields) => match fields.get(1) {
                Some(redis::Value::BulkString(name)) => Some(String::from_utf8_lossy(name).into_owned()),
                _ => None,
            },
            _ => None,
        })
        .expect("the consumer's name");
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg(&name)
        .arg("COUNT")
        .arg(1)
        .arg("STREAMS")
        .arg(&stream)
        .arg(">")
        .query(&mut raw)
        .expect("XREADGROUP");
    consumer.ack(&[held]).await.expect("ack m0");
    let (text, again) = take(&mut deliveries, 1).await.remove(0);
    assert_eq!(text, "m1", "the entry it never knew of, after its lease");
    consumer.ack(&[again.expect("delivery")]).await.expect("ack m1");
    consumer.close().await;
}

/// A retry copy that comes due while its queue holds its `max_length` goes in all the same, as
/// on RabbitMQ (see the claim script): the queue admitted the message once, and nothing is lost.
/// Publishers are refused meanwhile.
#[tokio::test]
async fn a_retry_coming_due_enters_its_queue_at_max_length() {
    let place = RedisPrefix::new();
    let dir = pipeline(TOPOLOGY);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    broker.publish("ev", "all", message("1")).await.expect("publish");
    let (mut deliveries, consumer) = broker.consume("b", Credit::at_most(1)).await.expect("consume");
    let first = take(&mut deliveries, 1).await.remove(0).1.expect("delivery");
    for text in ["2", "3"] {
        broker.publish("ev", "all", message(text)).await.expect("publish");
    }
    let refused = broker.publish("ev", "all", message("4")).await;
    assert!(matches!(refused, Err(BrokerError::Rejected { .. })), "b holds its max_length: {refused:?}");
    broker
        .copy(&first, Target::Later { queue: "b", delay: Duration::from_millis(200) }, &Edits::setting(Headers::new()))
        .await
        .expect("retry copy");
    // The consumer, its prefetch held by `first`, takes nothing but moves the copy in when due.
    wait_until(Duration::from_secs(10), "the copy in b", || async {
        broker.stats("b").await.expect("stats").ready == 3
    })
    .await;
    consumer.ack(&[first]).await.expect("ack");
    consumer.close().await;
    let (mut deliveries, consumer) = broker.consume("b", Credit::at_most(10)).await.expect("consume again");
    let texts: Vec<String> = take(&mut deliveries, 3).await.into_iter().map(|(t, _)| t).collect();
    assert_eq!(texts, ["2", "3", "1"]);
    consumer.close().await;
}

/// A claim takes a few MiB of bodies at most, and a consumer whose stream holds that much unread
/// claims no more: a browse of large messages keeps a few in memory, not a claim's worth (a
/// claim took up to 1,024 entries whatever their size).
#[tokio::test]
async fn large_messages_are_claimed_a_few_at_a_time() {
    let place = RedisPrefix::new();
    let dir = pipeline(TOPOLOGY);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let size = 3 << 20;
    for i in 0..8 {
        broker.publish("", "a", message(&format!("{i}{}", " ".repeat(size)))).await.expect("publish");
    }
    let claimed = || async { 8 - broker.stats("a").await.expect("stats").ready };
    // When the consumer's registration runs out: each claim renews it.
    let registration = || -> f64 {
        let scores: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(format!("{}c:a", place.prefix))
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(&mut place.raw())
            .expect("ZRANGE");
        scores.first().map_or(0.0, |(_, score)| *score)
    };
    let (mut deliveries, consumer) = broker.browse("a", Credit::at_most(100)).await.expect("browse");
    // The first claim stops once past 4 MiB: two, 6 MiB, all unread.
    wait_until(Duration::from_secs(10), "a claim", || async { claimed().await > 0 }).await;
    let before = registration();
    wait_until(Duration::from_secs(10), "a later claim", || async { registration() > before }).await;
    assert_eq!(claimed().await, 2, "no more claimed while the stream holds 6 MiB unread");
    let mut got = Vec::new();
    for _ in 0..8 {
        let (_, d) = take(&mut deliveries, 1).await.remove(0);
        let read = u32::try_from(got.len()).expect("small") + 1;
        assert!(claimed().await <= read + 3, "a few ahead of the reader");
        got.push(d.expect("delivery").body()[0]);
    }
    assert_eq!(got, b"01234567", "all, in order");
    consumer.close().await;
}

/// `sluice plan --broker redis://…` shows the plan in the Redis broker's terms (each queue's
/// stream, the settings it keeps, no delay cascade), says what the server's persistence is,
/// and warns when a restart would lose queued messages.
#[test]
fn plan_says_the_servers_persistence() {
    let place = RedisPrefix::new();
    let dir = pipeline(TOPOLOGY);
    let dir_arg = dir.path().to_str().expect("utf-8");
    let done = sluice_cli(&["plan", dir_arg, "--broker", &place.url()], &[], Duration::from_secs(30));
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    let prefix = &place.prefix;
    assert!(done.stdout.starts_with(&format!("the Redis broker, keys under \"{prefix}\"")), "{}", done.stdout);
    let b = format!("  b\n    stream = \"{prefix}s:b\"\n    dead_letter = \"b.dlq\"\n    max_length = 2\n");
    assert!(done.stdout.contains(&b), "{}", done.stdout);
    assert!(!done.stdout.contains("x-queue-type") && !done.stdout.contains("delay cascade"), "{}", done.stdout);
    assert!(done.stdout.contains("broker persistence: appendonly "), "{}", done.stdout);
    let mut c = place.raw();
    let aof: Vec<String> = redis::cmd("CONFIG").arg("GET").arg("appendonly").query(&mut c).expect("config");
    if aof.get(1).map(String::as_str) == Some("no") {
        assert!(done.stdout.contains("a restart loses"), "{}", done.stdout);
    }
    assert!(done.stdout.contains("missing queue \"a\""), "{}", done.stdout);
}

/// A Redis server of the test's own on a free port, in a directory of its own, with the
/// settings a test gives (maxmemory, a password, `replicaof`, ...); killed on drop. A test that
/// changes a server's configuration starts its own: the shared one is never changed.
pub(crate) struct OwnRedis {
    pub port: u16,
    dir: tempfile::TempDir,
    args: Vec<String>,
    child: Option<std::process::Child>,
}

impl OwnRedis {
    /// With `appendonly yes` and `appendfsync always`: nothing confirmed is lost in a restart.
    pub fn start() -> OwnRedis {
        OwnRedis::with(&["--appendonly", "yes", "--appendfsync", "always"])
    }

    /// With `args` (`redis-server` options: `--maxmemory`, `--requirepass`, ...) after its
    /// port, address and directory, and no snapshots unless `args` say otherwise.
    pub fn with(args: &[&str]) -> OwnRedis {
        let mut server = OwnRedis {
            port: free_port(),
            dir: tempfile::tempdir().expect("tempdir"),
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let child = std::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server runs");
        self.child = Some(child);
        let address: std::net::SocketAddr = format!("127.0.0.1:{}", self.port).parse().expect("address");
        let start = std::time::Instant::now();
        while std::net::TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(10), "redis-server did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the server (SIGKILL: no shutdown save) and starts it again on its files.
    pub fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.spawn();
    }

    /// `redis://127.0.0.1:PORT`, as the default user (without a password).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A plain connection as `url` (`redis://…` with a user and password if needed) for
    /// setting the server up.
    pub fn raw(&self, url: &str) -> redis::Connection {
        redis::Client::open(url).expect("redis url").get_connection().expect("connect to redis")
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A Redis killed and restarted under load (publisher and runner busy): with `appendonly yes`
/// and `appendfsync always` every publish that was confirmed is handled; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_under_load_loses_nothing_confirmed() {
    let mut server = OwnRedis::start();
    let place = RedisPrefix::on(&server.url(), "&lease=2s");
    let receiver = Receiver::start(|_, _| Reply::ok().after(Duration::from_millis(5))).await;
    let dir = idempotent_pipeline(&receiver, 8);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let mut runner = Sluice::run(dir.path(), &place.url(), &[]);
    let mut confirmed = BTreeSet::new();
    for i in 0..400 {
        let key = format!("k{i}");
        let envelope = sluice::envelope::Envelope::new("test.event", &json!({"n": i}), Some(key.clone()));
        if i == 150 {
            server.restart();
        }
        let out = Outgoing { body: envelope.encode(), message_id: Some(envelope.id.clone()), ..Default::default() };
        if broker.publish("ev", "x", out).await.is_ok() {
            confirmed.insert(key);
        }
    }
    assert!(confirmed.len() >= 300, "the publisher carried on after the restart: {}", confirmed.len());
    let handled = || async { receiver.succeeded_keys().is_superset(&confirmed) };
    let start = std::time::Instant::now();
    while !handled().await && start.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let succeeded = receiver.succeeded_keys();
    let missing: Vec<&String> = confirmed.difference(&succeeded).collect();
    assert!(missing.is_empty(), "{} confirmed and never handled: {missing:?}\n{}", missing.len(), runner.log());
    // Issue 31 item 11: a restart that kept the deployment's keys is no empty restart.
    assert!(!runner.log().contains("came back empty"), "{}", runner.log());
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
}
