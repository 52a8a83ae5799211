//! `sluice run` as a process: how it ends (a declaration conflict at start-up,
//! `--exit-when-idle`) and what it leaves behind.

use crate::support;

use std::time::Duration;

use serde_json::json;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declaration_conflict_stops_start_up_and_keeps_the_queue() {
    use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};

    let vhost = Vhost::new();
    let conn = lapin::Connection::connect(&vhost.url(), lapin::ConnectionProperties::default()).await.expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    // The arguments sluice gives a classic `work`, so that the queue type is the one difference
    // (RabbitMQ reports only the first inequivalent argument it checks).
    let classic = || {
        let mut args = FieldTable::default();
        for (key, value) in [
            ("x-queue-type", "classic"),
            ("x-dead-letter-exchange", ""),
            ("x-dead-letter-routing-key", "work.dlq"),
            ("x-overflow", "reject-publish"),
        ] {
            args.insert(key.into(), AMQPValue::LongString(value.into()));
        }
        args
    };
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    channel.queue_declare("work".into(), durable, classic()).await.expect("declare classic queue");
    channel
        .basic_publish("".into(), "work".into(), BasicPublishOptions::default(), b"precious", Default::default())
        .await
        .expect("publish")
        .await
        .expect("published");

    let dir = pipeline(
        r#"version: 1
queues:
  work:
    type: quorum
    handler: {command: {program: /bin/true}}
"#,
    );
    let mut sluice = Sluice::run(dir.path(), &vhost.url(), &[]);
    assert_eq!(sluice.wait(Duration::from_secs(20)), Some(1));
    let log = sluice.log();
    for needle in ["\"work\"", "x-queue-type", "quorum", "classic"] {
        assert!(log.contains(needle), "stderr does not name {needle}:\n{log}");
    }

    // Still there, still classic, message and all.
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    let channel = conn.create_channel().await.expect("channel");
    let queue = channel.queue_declare("work".into(), passive, FieldTable::default()).await.expect("queue still exists");
    assert_eq!(queue.message_count(), 1, "the queue's message is gone");
    channel.queue_declare("work".into(), durable, classic()).await.expect("the queue is still classic");
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_when_idle_exits_zero_after_the_backlog() {
    let vhost = Vhost::new();
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "    retry: {max_attempts: 3}\n");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    for i in 0..10 {
        publish(&broker, "ev", "x", &format!("key-{i}"), json!({"i": i})).await;
    }
    let mut sluice = Sluice::run(dir.path(), &vhost.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(30)), Some(0), "log:\n{}", sluice.log());
    let mut keys: Vec<String> =
        receiver.hits().iter().map(|h| h.header("idempotency-key").expect("key").to_string()).collect();
    keys.sort();
    assert_eq!(keys, (0..10).map(|i| format!("key-{i}")).collect::<Vec<_>>());
    assert!(vhost.drain_queue("work").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_when_idle_waits_for_a_pending_retry() {
    let vhost = Vhost::new();
    let receiver = Receiver::start(|_, n| Reply::status(if n == 0 { 503 } else { 200 })).await;
    // The retry waits 2s in the delay cascade: far longer than the idle check needs to see
    // the work queue empty and nothing in flight.
    let dir = webhook_pipeline(&receiver, "    retry: {max_attempts: 3, initial: 2s, max: 2s, jitter: none}\n");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    publish(&broker, "ev", "x", "key-1", json!({})).await;
    let mut sluice = Sluice::run(dir.path(), &vhost.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(30)), Some(0), "log:\n{}", sluice.log());
    let attempts: Vec<String> =
        receiver.hits().iter().map(|h| h.header("x-sluice-attempt").expect("attempt").to_string()).collect();
    assert_eq!(attempts, ["1", "2"], "exited before the retry was delivered");
    assert!(vhost.drain_queue("work.dlq").await.is_empty());
}
