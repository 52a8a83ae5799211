//! The embedded broker as users run it: `sluice` processes sharing one state directory, a
//! runner killed under load, and routing compared with the real RabbitMQ. (The runtime's
//! behaviour on it is checked by the same test bodies as on RabbitMQ: see `on_every_broker!`.)

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use sluice::broker::{Broker, BrokerError, HeaderValue, Headers, Outgoing, Publish as _};
use sluice::envelope::Envelope;
use support::*;

/// The `n` of the payload a receiver got (the default body is the envelope).
fn n_of(hit: &Hit) -> String {
    hit.json()["payload"]["n"].to_string()
}

/// Writes `n` payloads `{"n": i}` as JSON lines; their `n`s.
fn jsonl(dir: &Path, n: usize) -> (std::path::PathBuf, BTreeSet<String>) {
    let path = dir.join("payloads.jsonl");
    let lines: String = (0..n).map(|i| format!("{{\"n\": {i}}}\n")).collect();
    std::fs::write(&path, lines).expect("write payloads");
    (path, (0..n).map(|i| i.to_string()).collect())
}

/// `sluice publish --jsonl` of `file` to exchange `ev`, as a process of its own.
fn publish_jsonl(place: &EmbeddedDir, file: &Path) {
    let args = ["publish", "--broker", &place.url(), "--exchange", "ev", "--routing-key", "x", "--type", "t"];
    let file = file.display().to_string();
    let args: Vec<&str> = args.iter().copied().chain(["--jsonl", file.as_str()]).collect();
    let published = sluice_cli(&args, &[], Duration::from_secs(120));
    assert_eq!(published.code, Some(0), "publish failed: {}", published.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_process_and_a_runner_process_share_one_state_directory() {
    const N: usize = 10_000;
    let place = EmbeddedDir::new();
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "    concurrency: 32\n");
    let (file, keys) = jsonl(dir.path(), N);
    let mut runner = Sluice::run(dir.path(), &place.url(), &[]);
    // The runner declares the topology; the publisher needs the exchange to exist.
    wait_until(Duration::from_secs(30), "the runner consuming", || async {
        let broker = place.connect().await;
        broker.stats("work").await.map(|s| s.consumers == 1).unwrap_or(false)
    })
    .await;
    publish_jsonl(&place, &file);
    wait_until(Duration::from_secs(120), "every message at the receiver", || async { receiver.hits().len() >= N })
        .await;
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "clean exit; log:\n{}", runner.log());
    let per_key = counts(receiver.hits().iter().map(n_of));
    assert_eq!(per_key.keys().cloned().collect::<BTreeSet<_>>(), keys, "every message, and only them");
    assert!(
        per_key.values().all(|n| *n == 1),
        "each once: {:?}",
        per_key.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
    );
    assert_eq!(
        (place.depth("work").await, place.depth("work.dlq").await),
        (0, 0),
        "nothing left, nothing dead-lettered"
    );
}

/// The `n` of every message leased in `queue` right now: what a killed runner held.
fn leased_keys(place: &EmbeddedDir, queue: &str) -> BTreeSet<String> {
    let path = Path::new(&place.url()).join(sluice::broker::embedded::FILE);
    let db = rusqlite::Connection::open(&path).expect("open the broker's file");
    let mut statement = db
        .prepare(
            "SELECT b.data FROM messages m JOIN bodies b ON b.id = m.body WHERE m.queue = ?1 AND m.lease_owner IS NOT NULL",
        )
        .expect("prepare");
    let bodies = statement.query_map([queue], |r| r.get::<_, Vec<u8>>(0)).expect("query");
    bodies
        .map(|body| {
            let body = body.expect("row");
            let envelope = Envelope::decode(&body).expect("an envelope");
            let payload: serde_json::Value = serde_json::from_str(envelope.payload.get()).expect("JSON");
            payload["n"].to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_load_loses_nothing_and_what_was_in_flight_comes_back() {
    const N: usize = 3_000;
    let place = EmbeddedDir::new();
    // Slow enough that the kill finds a full window in flight; no idempotency store, so every
    // redelivery reaches the receiver and the ledger sees it.
    let receiver = Receiver::start(|_, _| Reply::ok().after(Duration::from_millis(20))).await;
    let dir = webhook_pipeline(&receiver, "    concurrency: 32\n    idempotency: {enabled: false}\n");
    let (file, keys) = jsonl(dir.path(), N);
    declare(dir.path(), &place.connect().await).await;
    publish_jsonl(&place, &file);

    let first = Sluice::run(dir.path(), &place.url(), &[]);
    wait_until(Duration::from_secs(60), "a third of the messages handled", || async { receiver.hits().len() >= N / 3 })
        .await;
    first.signal(libc::SIGKILL);
    let mut first = first;
    assert_eq!(first.wait(Duration::from_secs(10)), None, "killed by the signal");
    let in_flight = leased_keys(&place, "work");
    assert!(!in_flight.is_empty(), "the kill came with deliveries in flight");
    assert!(in_flight.len() <= 32, "no more in flight than the prefetch: {}", in_flight.len());
    let killed_at = Instant::now();
    let before = receiver.hits().len();

    let mut second = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(second.wait(Duration::from_secs(180)), Some(0), "log:\n{}", second.log());
    let hits = receiver.hits();
    let per_key = counts(hits.iter().map(n_of));
    assert_eq!(per_key.keys().cloned().collect::<BTreeSet<_>>(), keys, "every message handled: nothing lost");
    let repeated: BTreeSet<String> = per_key.iter().filter(|(_, n)| **n > 1).map(|(k, _)| k.clone()).collect();
    assert!(repeated.is_subset(&in_flight), "only what was in flight at the kill runs twice: {repeated:?}");
    let again: BTreeSet<String> = hits[before..].iter().filter(|h| h.at > killed_at).map(n_of).collect();
    assert!(
        in_flight.is_subset(&again),
        "each delivery in flight at the kill came back: {:?}",
        in_flight.difference(&again)
    );
    assert_eq!(
        (place.depth("work").await, place.depth("work.dlq").await),
        (0, 0),
        "nothing left, nothing dead-lettered"
    );
}

/// Every exchange type with the bindings whose edges RabbitMQ defines: topic `*` (one word)
/// and `#` (zero or more), empty keys, direct's exact match, fanout ignoring the key, headers
/// with `x-match` all and any.
const ROUTING: &str = r##"version: 1
exchanges:
  t: {type: topic}
  d: {type: direct}
  f: {type: fanout}
  h: {type: headers}
queues:
  star:
    bind: [{exchange: t, routing_key: "order.*"}]
    handler: {command: {program: /bin/true}}
  hash:
    bind: [{exchange: t, routing_key: "order.#"}]
    handler: {command: {program: /bin/true}}
  all:
    bind: [{exchange: t, routing_key: "#"}, {exchange: f}]
    handler: {command: {program: /bin/true}}
  middle:
    bind: [{exchange: t, routing_key: "a.*.c"}, {exchange: t, routing_key: "#.end"}, {exchange: t, routing_key: "*"}]
    handler: {command: {program: /bin/true}}
  empty:
    bind: [{exchange: t, routing_key: ""}, {exchange: d, routing_key: ""}]
    handler: {command: {program: /bin/true}}
  exact:
    bind: [{exchange: t, routing_key: order.created}, {exchange: d, routing_key: k}]
    handler: {command: {program: /bin/true}}
  fan:
    bind: [{exchange: f, routing_key: ignored}]
    handler: {command: {program: /bin/true}}
  every:
    bind: [{exchange: h, arguments: {x-match: all, kind: order, v: 2}}]
    handler: {command: {program: /bin/true}}
  some:
    bind: [{exchange: h, arguments: {x-match: any, kind: order, region: eu}}]
    handler: {command: {program: /bin/true}}
"##;

/// Where each message went on a broker: the case numbers each queue holds, and the cases
/// refused as unroutable.
async fn route_all(place: &impl Place, plan: &sluice::topology::Plan) -> BTreeMap<String, Vec<usize>> {
    let broker = place.connect().await;
    broker.declare(plan).await.expect("declare");
    let cases = routing_cases();
    let mut routed: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, (exchange, key, headers)) in cases.iter().enumerate() {
        let message = Outgoing { body: i.to_string().into_bytes(), headers: headers.clone(), ..Outgoing::default() };
        match broker.publish(exchange, key, message).await {
            Ok(()) => {}
            Err(BrokerError::Unroutable { .. }) => routed.entry("(unroutable)".into()).or_default().push(i),
            Err(e) => panic!("case {i} {exchange}/{key}: {e}"),
        }
    }
    for queue in &plan.queues {
        for (body, _) in place.drain_queue(&queue.name).await {
            let case = String::from_utf8(body).expect("text").parse().expect("a case number");
            routed.entry(queue.name.clone()).or_default().push(case);
        }
    }
    broker.close().await;
    routed
}

fn routing_cases() -> Vec<(&'static str, &'static str, Headers)> {
    let h = |pairs: &[(&str, HeaderValue)]| pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect::<Headers>();
    let s = |v: &str| HeaderValue::Str(v.into());
    let mut cases: Vec<(&str, &str, Headers)> = [
        "order.created",
        "order",
        "order.created.eu",
        "",
        "a.b.c",
        "a.c",
        "a.b.b.c",
        "x.end",
        "end",
        "x.y.end",
        "word",
        "order..created",
        ".",
        "Order.created",
    ]
    .into_iter()
    .map(|key| ("t", key, Headers::new()))
    .collect();
    cases.extend(["k", "", "K", "k.k"].into_iter().map(|key| ("d", key, Headers::new())));
    cases.extend(["anything", ""].into_iter().map(|key| ("f", key, Headers::new())));
    cases.extend([
        ("h", "", h(&[("kind", s("order")), ("v", HeaderValue::Int(2))])),
        ("h", "", h(&[("kind", s("order")), ("v", HeaderValue::Int(3))])),
        ("h", "", h(&[("kind", s("order")), ("v", s("2"))])),
        ("h", "", h(&[("region", s("eu"))])),
        ("h", "", h(&[("kind", s("invoice")), ("region", s("us"))])),
        ("h", "", h(&[("kind", s("order")), ("v", HeaderValue::Int(2)), ("extra", s("x"))])),
        ("h", "any.key", Headers::new()),
    ]);
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_matches_what_the_real_rabbitmq_does() {
    let dir = pipeline(ROUTING);
    let validation = sluice::config::load(&[dir.path().to_path_buf()]);
    let config = validation.config.unwrap_or_else(|| panic!("routing pipeline invalid: {:?}", validation.diagnostics));
    let plan = sluice::topology::plan(&config);
    let on_rabbit = route_all(&Vhost::new(), &plan).await;
    let on_embedded = route_all(&EmbeddedDir::new(), &plan).await;
    assert!(on_rabbit.len() > 8, "the cases reach most queues on RabbitMQ: {on_rabbit:?}");
    let cases = routing_cases();
    for queue in on_rabbit.keys().chain(on_embedded.keys()).collect::<BTreeSet<_>>() {
        let (r, e) = (on_rabbit.get(queue), on_embedded.get(queue));
        let show = |cases_in: Option<&Vec<usize>>| -> Vec<String> {
            cases_in
                .into_iter()
                .flatten()
                .map(|&i| format!("{}/{:?}/{:?}", cases[i].0, cases[i].1, cases[i].2))
                .collect()
        };
        assert_eq!(show(e), show(r), "queue {queue}: embedded (left) vs RabbitMQ (right)");
    }
}
