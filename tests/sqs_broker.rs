//! The SQS broker end to end, on the suite's emulator (moto): the shared scenarios that matter
//! most on it (routing, retries, poison messages, the dead-letter tools; `leased.rs` has kill
//! -9 and two runners), run here rather than through `on_every_broker!` because moto answers
//! a request in 10–30 ms; and what only SQS does: a lease extended past the visibility timeout,
//! and a message its redrive policy moved.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_and_redriven() {
    crate::dlq::messages_dead_lettered_while_the_receiver_was_down_run_once_each_after_a_redrive(SqsPrefix::new())
        .await;
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
