//! The NATS JetStream broker (issue 35) on the machine's nats-server: real `sluice` processes
//! on it (a runner killed with `kill -9` whose leased messages come back, two runners and
//! `sluice publish --jsonl` on one deployment), `plan --broker nats://…`, and a publish whose
//! answer was lost retried without a duplicate. The trait's rules are checked by the
//! conformance matrix, and the shared end-to-end bodies run on it through `on_every_broker!`.

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::json;
use sluice::broker::Broker as _;
use support::*;

/// A webhook pipeline with idempotency on, calling `receiver`.
fn idempotent_pipeline(receiver: &Receiver, concurrency: u32) -> tempfile::TempDir {
    webhook_pipeline(receiver, &format!("    concurrency: {concurrency}\n    idempotency: {{ttl: 1h}}\n"))
}

/// `kill -9` of a runner on JetStream mid-work: its leased messages come back once the lease
/// (`ack_wait`) runs out and a second runner handles them; every message succeeds, and no key
/// succeeds twice downstream except those the killed runner finished without acking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runners_messages_come_back_and_are_handled() {
    let place = NatsPrefix::with("&lease=2s");
    let receiver = Receiver::start(|_, _| Reply::ok().after(Duration::from_millis(200))).await;
    let dir = idempotent_pipeline(&receiver, 8);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let n = 60;
    for i in 0..n {
        publish(&broker, "ev", "x", &format!("k{i}"), json!({"n": i})).await;
    }
    let mut first = Sluice::run(dir.path(), &place.url(), &[]);
    receiver.wait_for(10, Duration::from_secs(30)).await;
    first.signal(libc::SIGKILL);
    first.wait(Duration::from_secs(10));
    assert!(place.depth("work").await > 0, "the killed runner left messages");
    let mut second = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(second.wait(Duration::from_secs(120)), Some(0), "{}", second.log());
    let keys: BTreeSet<String> = (0..n).map(|i| format!("k{i}")).collect();
    assert_eq!(receiver.succeeded_keys(), keys, "every message handled: {}", second.log());
    assert_eq!(place.depth("work").await, 0);
    let twice = counts(receiver.hits().iter().map(|h| h.key().to_string())).into_values().filter(|c| *c > 1).count();
    assert!(twice <= 8, "{twice} keys ran twice");
    broker.close().await;
}

/// Two runners and a publisher (`sluice publish --jsonl`, a separate process) on one
/// deployment: every message handled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runners_and_a_publisher_share_one_deployment() {
    let place = NatsPrefix::new();
    let receiver = Receiver::start(|_, _| Reply::ok().after(Duration::from_millis(20))).await;
    let dir = idempotent_pipeline(&receiver, 4);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let mut one = Sluice::run(dir.path(), &place.url(), &[]);
    let mut two = Sluice::run(dir.path(), &place.url(), &[]);
    let lines: String = (0..200).map(|i| format!("{{\"n\": {i}}}\n")).collect();
    let jsonl = dir.path().join("m.jsonl");
    std::fs::write(&jsonl, lines).expect("jsonl");
    let jsonl = jsonl.to_str().expect("utf-8");
    let args = [
        "publish",
        "--exchange",
        "ev",
        "--routing-key",
        "x",
        "--type",
        "t",
        "--jsonl",
        jsonl,
        "--broker",
        &place.url(),
    ];
    let published = sluice_cli(&args, &[], Duration::from_secs(60));
    assert_eq!(published.code, Some(0), "{}", published.stderr);
    let single = ["publish", "--exchange", "ev", "--routing-key", "x", "--type", "t", "--payload", "{\"n\": 200}"];
    let single = sluice_cli(&[&single[..], &["--broker", &place.url()]].concat(), &[], Duration::from_secs(60));
    assert_eq!(single.code, Some(0), "{}", single.stderr);
    receiver.wait_for(201, Duration::from_secs(60)).await;
    wait_until(Duration::from_secs(30), "the queue drained", || async { place.depth("work").await == 0 }).await;
    let hits = receiver.hits();
    assert_eq!(counts(hits.iter().map(|h| h.key().to_string())).len(), 201);
    assert_eq!(hits.len(), 201, "each message once");
    assert_eq!(one.stop(Duration::from_secs(30)), Some(0), "{}", one.log());
    assert_eq!(two.stop(Duration::from_secs(30)), Some(0), "{}", two.log());
    broker.close().await;
}

/// `sluice plan --broker nats://…` shows each queue's stream and what the broker refuses.
#[test]
fn plan_shows_the_streams() {
    let place = NatsPrefix::new();
    let dir = pipeline(
        "version: 1\nexchanges: {ev: {type: topic}}\nqueues:\n  a: {handler: {command: {program: /bin/true}}, bind: [{exchange: ev, routing_key: \"a.#\"}], max_length: 2}\n",
    );
    let dir_arg = dir.path().to_str().expect("utf-8");
    let done = sluice_cli(&["plan", dir_arg, "--broker", &place.url()], &[], Duration::from_secs(30));
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    let prefix = &place.prefix;
    assert!(done.stdout.starts_with(&format!("the JetStream broker, names under \"{prefix}\"")), "{}", done.stdout);
    let a = format!("  a\n    stream = \"{prefix}_q_61\" on \"{prefix}.q.61\"\n");
    assert!(done.stdout.contains(&a), "{}", done.stdout);
    assert!(done.stdout.contains("max_length = 2"), "{}", done.stdout);
}

/// Several seed servers in one `--broker` value (which the command line splits at the commas):
/// one refusing connections, the machine's server beside it. The publish reaches the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_seed_servers_in_one_broker_value() {
    let place = NatsPrefix::new();
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let seeds = format!("nats://127.0.0.1:1,{}", place.url());
    let published =
        broker_cli(&["publish", "--exchange", "ev", "--routing-key", "x", "--type", "t", "--payload", "{}"], &seeds)
            .await;
    assert_eq!(published.code, Some(0), "{published:?}");
    assert_eq!(place.depth("work").await, 1, "the message reached the queue");
    broker.close().await;
}
