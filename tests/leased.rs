//! Real `sluice` processes on the brokers whose consumers hold leases on a server (Redis,
//! JetStream, SQS): a runner killed with `kill -9` whose leased messages come back and are handled,
//! and two runners with publishers (`publish --jsonl` and a single `publish`, separate
//! processes) on one deployment, each message handled once.

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::json;
use sluice::broker::Broker as _;
use support::*;

/// `kill -9` of a runner mid-work: its leased messages come back once the lease runs out and a
/// second runner handles them; every message succeeds, and no key succeeds twice downstream
/// except those the killed runner finished without acking (at most its concurrency).
async fn a_killed_runners_messages_come_back_and_are_handled<P: Place>(place: P) {
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

/// Two runners and two publishers on one deployment: every message handled once. Returns the
/// runners' logs, for what a broker's own test reads in them.
async fn two_runners_and_publishers_share_one_deployment<P: Place>(place: P) -> [String; 2] {
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
    let route = ["--exchange", "ev", "--routing-key", "x", "--type", "t"];
    let published = broker_cli(&[&["publish"][..], &route, &["--jsonl", jsonl]].concat(), &place.url()).await;
    assert_eq!(published.code, Some(0), "{}", published.stderr);
    let single = broker_cli(&[&["publish"][..], &route, &["--payload", "{\"n\": 200}"]].concat(), &place.url()).await;
    assert_eq!(single.code, Some(0), "{}", single.stderr);
    receiver.wait_for(201, Duration::from_secs(60)).await;
    wait_until(Duration::from_secs(30), "the queue drained", || async { place.depth("work").await == 0 }).await;
    let hits = receiver.hits();
    assert_eq!(counts(hits.iter().map(|h| h.key().to_string())).len(), 201);
    assert_eq!(hits.len(), 201, "each message once");
    assert_eq!(one.stop(Duration::from_secs(30)), Some(0), "{}", one.log());
    assert_eq!(two.stop(Duration::from_secs(30)), Some(0), "{}", two.log());
    broker.close().await;
    [one.log(), two.log()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runners_messages_come_back_on_redis() {
    a_killed_runners_messages_come_back_and_are_handled(RedisPrefix::with("&lease=2s")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runners_messages_come_back_on_jetstream() {
    a_killed_runners_messages_come_back_and_are_handled(NatsPrefix::with("&lease=2s")).await;
}

/// On Redis, each runner's start line says the server's persistence too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runners_and_publishers_share_one_redis() {
    for log in two_runners_and_publishers_share_one_deployment(RedisPrefix::new()).await {
        assert!(log.contains("persistence"), "{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runners_and_publishers_share_one_jetstream() {
    two_runners_and_publishers_share_one_deployment(NatsPrefix::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runners_messages_come_back_on_sqs() {
    a_killed_runners_messages_come_back_and_are_handled(SqsPrefix::with("&lease=3s")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runners_and_publishers_share_one_sqs_deployment() {
    two_runners_and_publishers_share_one_deployment(SqsPrefix::new()).await;
}
