//! The SQS broker end to end, on the suite's emulator (moto): the shared scenarios that matter
//! most on it (routing, retries, poison messages, the dead-letter tools, per-key order on FIFO
//! queues; `leased.rs` has kill -9 and two runners), run here rather than through
//! `on_every_broker!` because moto answers a request in 10–30 ms; what only SQS does: a lease
//! extended past the visibility timeout, a message its redrive policy moved, a long retry in
//! hops; and, on LocalStack of the test's own, the second oracle: one end-to-end run and FIFO
//! order across two runners.

use crate::support;

use std::time::Duration;

use serde_json::json;
use sluice::broker::Broker as _;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_reaches_every_bound_queue() {
    crate::run_behaviour::fan_out_delivers_once_per_bound_queue(SqsPrefix::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_run_exactly_max_attempts_then_dead_letter() {
    crate::run_retries::retry_exhaustion_calls_exactly_max_attempts_then_dead_letters(SqsPrefix::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_go_to_the_dead_letter_queue_at_once() {
    crate::failure_injection::poison_messages_are_dead_lettered_at_once_and_the_next_message_is_processed(
        SqsPrefix::new(),
    )
    .await;
}

/// `kill -9` of a real `sluice run` between a webhook's side effect and its ack: once their
/// visibility timeout (3 s) runs out, the killed runner's messages come back to the next one;
/// every key reaches the receiver, at most the in-flight ones twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runner_loses_nothing() {
    crate::failure_injection::a_crash_between_webhook_side_effect_and_ack_repeats_at_most_the_in_flight_messages(
        SqsPrefix::with("&lease=3s"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_and_redriven() {
    crate::dlq::messages_dead_lettered_while_the_receiver_was_down_run_once_each_after_a_redrive(SqsPrefix::new())
        .await;
}

/// Issue 36: an `order_by` queue is a FIFO queue grouped by its key. 20 keys × 30 messages,
/// two runners, a receiver failing one first attempt in five: per key, every call the
/// receiver saw is in publish order, none missing. On LocalStack: moto's group lock does not
/// hold across consumers (a receive that began while a group had nothing in flight goes on
/// taking the group's next messages while another consumer holds one: there a key's calls
/// came as 12, 12, 14, 13).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_keeps_each_keys_order_across_two_runners_under_retries() {
    let localstack = moto::Emulator::localstack();
    let place = SqsPrefix::on(&localstack.endpoint, "&lease=5s");
    crate::ordering::keys_in_publish_order_under_retries_on(place, 30, 2).await;
}

/// Issue 36, LocalStack as the second oracle, end to end: published messages reach the
/// receiver through `sluice run`, one after a retry (a delayed copy), and a poison message
/// lands in the dead-letter queue with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_localstack_messages_are_handled_retried_and_dead_lettered() {
    let localstack = moto::Emulator::localstack();
    let place = SqsPrefix::on(&localstack.endpoint, "&lease=5s");
    let receiver = Receiver::start(|hit, earlier| match (hit.key(), earlier) {
        ("retried", 0) => Reply::status(503),
        ("poison", _) => Reply::status(400),
        _ => Reply::ok(),
    })
    .await;
    let dir = webhook_pipeline(&receiver, "    retry: {max_attempts: 3, initial: 1s, max: 1s}\n");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for key in ["plain", "retried", "poison"] {
        publish(&broker, "ev", "x", key, json!({"key": key})).await;
    }
    let mut sluice = Sluice::run(dir.path(), &place.url(), &[]);
    wait_until(Duration::from_secs(60), "two handled and one dead-lettered", || async {
        receiver.succeeded_keys().len() == 2 && place.depth("work.dlq").await == 1
    })
    .await;
    assert_eq!(receiver.succeeded_keys().into_iter().collect::<Vec<_>>(), ["plain", "retried"]);
    let calls = counts(receiver.hits().iter().map(|h| h.key().to_string()));
    assert_eq!((calls["plain"], calls["retried"], calls["poison"]), (1, 2, 1), "{calls:?}");
    let dead = place.drain_queue("work.dlq").await;
    assert_eq!(dead[0].1.get("x-sluice-reason"), Some(&sluice::broker::HeaderValue::Str("permanent".into())));
    assert_eq!(sluice.stop(Duration::from_secs(30)), Some(0), "{}", sluice.log());
    assert_eq!(place.depth("work").await, 0);
    broker.close().await;
}

/// Issue 36: a retry due in 7 s served in hops of at most 2 s (`?hop=2s`, SQS's 15 minutes
/// scaled down, as an hour's retry is served in four hops): the receiver is called again, and
/// never before the retry is due; the attempt is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_longer_than_a_hop_is_served_in_hops_and_never_early() {
    let place = SqsPrefix::with("&lease=5s&hop=2s");
    let receiver = Receiver::start(|_, earlier| if earlier == 0 { Reply::status(503) } else { Reply::ok() }).await;
    let retry = Duration::from_secs(7);
    let dir = webhook_pipeline(&receiver, "    retry: {max_attempts: 2, initial: 7s, max: 7s, jitter: none}\n");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    publish(&broker, "ev", "x", "later", json!({"n": 1})).await;
    let mut sluice = Sluice::run_with_env(dir.path(), &place.url(), &[], &[("RUST_LOG", "sluice=debug")]);
    receiver.wait_for(2, Duration::from_secs(60)).await;
    let hits = receiver.hits();
    let waited = wall_gap(&hits[0], &hits[1]);
    assert!(
        not_before(waited, retry),
        "called again {waited:?} after the first attempt, before its due time ({retry:?})"
    );
    assert_eq!(hits[1].header("x-sluice-attempt"), Some("2"), "the hops spent no attempt");
    assert_eq!(sluice.stop(Duration::from_secs(30)), Some(0), "{}", sluice.log());
    // In hops of 2 s: the copy came back before it was due, and was sent on again (how many
    // times depends on how long each round trip took).
    let early = sluice.log().matches("scheduled for later").count();
    assert!(early >= 1, "never came back early: {}", sluice.log());
    broker.close().await;
}

/// An `ordered` queue is one FIFO group: one call at a time, in publish order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_queue_calls_one_at_a_time_in_publish_order() {
    crate::run_behaviour::ordered_queue_calls_one_at_a_time_in_publish_order(SqsPrefix::new()).await;
}

/// A retry on an `ordered` queue (a FIFO queue, which takes no delay per message) is a copy
/// sent at once with its due time, held by the runner until then: handled once due, its
/// group waiting behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_queues_retry_is_held_until_due() {
    let place = SqsPrefix::new();
    let receiver = Receiver::start(|hit, earlier| match (hit.key(), earlier) {
        ("key-2", 0) => Reply::status(503),
        _ => Reply::ok(),
    })
    .await;
    let dir = webhook_pipeline(
        &receiver,
        "    ordered: true\n    retry: {max_attempts: 3, initial: 2s, max: 2s, jitter: none}\n",
    );
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for n in 1..=4 {
        publish(&broker, "ev", "x", &format!("key-{n}"), json!({"n": n})).await;
    }
    let mut sluice = Sluice::run(dir.path(), &place.url(), &[]);
    let hits = receiver.wait_for(5, Duration::from_secs(60)).await;
    let second = hits.iter().filter(|h| h.key() == "key-2").collect::<Vec<_>>();
    assert_eq!(second.len(), 2, "key-2 retried once");
    assert!(not_before(wall_gap(second[0], second[1]), Duration::from_secs(2)), "retried before its due time");
    assert_eq!(receiver.max_in_flight(), 1, "calls overlapped");
    assert_eq!(sluice.stop(Duration::from_secs(30)), Some(0), "{}", sluice.log());
    assert_eq!((place.depth("work").await, place.depth("work.dlq").await), (0, 0));
    broker.close().await;
}

/// A FIFO dead-letter queue holding more dead letters of one key than one receive takes (10):
/// `dlq list` lists them all (each dead letter is a group of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_dead_letter_queue_is_listed_whole() {
    let place = SqsPrefix::new();
    let receiver = Receiver::start(|_, _| Reply::status(400)).await;
    let dir = webhook_pipeline(&receiver, "    ordered: true\n");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for n in 0..12 {
        publish(&broker, "ev", "x", &format!("dead-{n}"), json!({"n": n})).await;
    }
    let mut sluice = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(60)), Some(0), "{}", sluice.log());
    let path = dir.path().to_str().expect("utf-8");
    let listed = broker_cli(&["dlq", "list", "work", "--pipelines", path, "--format", "json"], &place.url()).await;
    assert_eq!(listed.code, Some(0), "{}", listed.stderr);
    for n in 0..12 {
        assert!(listed.stdout.contains(&format!("\"dead-{n}\"")), "dead-{n} not listed: {}", listed.stdout);
    }
    broker.close().await;
}

/// A poison message of a FIFO queue goes to its FIFO dead-letter queue and releases its key,
/// or holds it until redriven (one runner: moto's group lock holds for one consumer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_poison_message_releases_its_key() {
    crate::ordering::a_poison_message_releases_its_key(SqsPrefix::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_poison_message_holds_its_key_until_redriven() {
    crate::ordering::a_poison_message_holds_its_key_until_redriven(SqsPrefix::new()).await;
}

/// A handler slower than the visibility timeout (3 s here) is called once: its runner extends
/// the lease while the call runs, so SQS never shows the message to the second runner waiting
/// beside it. Idempotency is off: nothing else would stop a second call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_slower_than_the_visibility_timeout_is_called_once() {
    let place = SqsPrefix::with("&lease=3s");
    let receiver = Receiver::start(|_, _| Reply::ok().after(Duration::from_secs(8))).await;
    let dir = webhook_pipeline(&receiver, "    idempotency: {enabled: false}\n");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    publish(&broker, "ev", "x", "slow", json!({"n": 1})).await;
    let mut one = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    receiver.wait_for(1, Duration::from_secs(30)).await;
    let mut two = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(one.wait(Duration::from_secs(60)), Some(0), "{}", one.log());
    assert_eq!(two.wait(Duration::from_secs(60)), Some(0), "{}", two.log());
    assert_eq!(receiver.hits().len(), 1, "called once: {}", one.log());
    assert_eq!(place.depth("work").await, 0);
    broker.close().await;
}

/// A message received more than the redrive policy's `maxReceiveCount` times without being
/// deleted (what a message that kills its runner does) is moved by SQS itself to the queue's
/// dead-letter queue; `sluice dlq list` names why, and a redrive brings it back to be handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_redrive_policy_moved_is_listed_with_why_and_redriven() {
    let place = SqsPrefix::new();
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    publish(&broker, "ev", "x", "crasher", json!({"n": 1})).await;
    // Received and never deleted, its visibility ended at once each time: a runner dying on it.
    let aws = sluice::broker::sqs::aws::Aws::with_env("us-east-1", Some(&moto::sqs_endpoint()), moto::credentials())
        .expect("client");
    let name = format!("{}-work", place.prefix);
    let url = aws.call("GetQueueUrl", &json!({"QueueName": name})).await.expect("queue url")["QueueUrl"].clone();
    let receive = json!({"QueueUrl": url, "MaxNumberOfMessages": 1, "VisibilityTimeout": 0, "WaitTimeSeconds": 1});
    wait_until(Duration::from_secs(60), "SQS moved it to work.dlq", || async {
        aws.call("ReceiveMessage", &receive).await.expect("receive");
        place.depth("work").await == 0 && place.depth("work.dlq").await == 1
    })
    .await;
    let path = dir.path().to_str().expect("utf-8");
    let listed = broker_cli(&["dlq", "list", "work", "--pipelines", path, "--format", "json"], &place.url()).await;
    assert_eq!(listed.code, Some(0), "{}", listed.stderr);
    assert!(listed.stdout.contains("delivery_limit") && listed.stdout.contains("redrive policy"), "{}", listed.stdout);
    let redriven = broker_cli(&["dlq", "redrive", "work", "--pipelines", path], &place.url()).await;
    assert_eq!(redriven.code, Some(0), "{}", redriven.stderr);
    let mut sluice = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(60)), Some(0), "{}", sluice.log());
    assert_eq!(receiver.succeeded_keys().into_iter().collect::<Vec<_>>(), ["crasher"]);
    broker.close().await;
}
