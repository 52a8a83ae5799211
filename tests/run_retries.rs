//! `sluice run` against real RabbitMQ: retries and dead-lettering, counted at the receiver.

mod support;

use std::time::Duration;

use sluice::broker::HeaderValue;
use support::*;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

async fn retry_exhaustion_calls_exactly_max_attempts_then_dead_letters<P: Place>(place: P) {
    let server = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(503)).mount(&server).await;
    let dir = work_pipeline(&format!(
        r##"    handler:
      webhook: {{url: "{}/hook"}}
    retry: {{max_attempts: 3, initial: 100ms, max: 300ms}}
"##,
        server.uri()
    ));
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run(dir.path(), &place.url(), &[]);
    publish(&broker, "ev", "x", "key-1", serde_json::json!({"n": 1})).await;
    wait_until(Duration::from_secs(30), "one message in work.dlq", || async {
        place.drain_queue("work.dlq").await.len() == 1
    })
    .await;
    let keys = keys_received(&server).await;
    assert_eq!(keys, ["key-1", "key-1", "key-1"], "exactly max_attempts calls");
    let dead = place.drain_queue("work.dlq").await;
    let headers = &dead[0].1;
    assert_eq!(headers.get("x-sluice-reason"), Some(&HeaderValue::Str("exhausted".into())));
    assert_eq!(headers.get("x-sluice-attempts"), Some(&HeaderValue::Int(3)));
    assert_eq!(headers.get("x-sluice-source-queue"), Some(&HeaderValue::Str("work".into())));
    assert!(matches!(headers.get("x-sluice-error"), Some(HeaderValue::Str(e)) if e.starts_with("HTTP 503")));
}

/// DESIGN "Life of a delivery": when the broker refuses the dead-letter copy (a full DLQ), the
/// worker holds the original unacked and retries the publish; once the DLQ takes it, the copy
/// lands and the original is acked. Nothing is dropped meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_dead_letter_copy_holds_the_message_until_the_broker_takes_it() {
    let vhost = Vhost::new();
    let dir = work_pipeline(
        r##"    type: classic
    handler:
      command: {program: /bin/sh, args: ["-c", "exit 65"], permanent_exit_codes: [65]}
"##,
    );
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let policy = |args: &[&str]| {
        let out = std::process::Command::new("rabbitmqctl").args(args).output().expect("rabbitmqctl");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    // A full DLQ: max-length 0 with reject-publish nacks every copy.
    policy(&[
        "set_policy",
        "-p",
        &vhost.name,
        "full-dlq",
        r"^work\.dlq$",
        r#"{"max-length": 0, "overflow": "reject-publish"}"#,
        "--apply-to",
        "queues",
    ]);
    publish(&broker, "ev", "a", "poison", serde_json::json!({})).await;
    let _sluice = Sluice::run(dir.path(), &vhost.url(), &[]);
    // The handler ran (exit 65) and the copy is refused: the original stays in `work`, unacked.
    tokio::time::sleep(Duration::from_secs(2)).await; // let a few refused publishes happen
    assert!(vhost.drain_queue("work.dlq").await.is_empty(), "the full DLQ took nothing");
    let held = std::process::Command::new("rabbitmqctl")
        .args(["list_queues", "-p", &vhost.name, "name", "messages"])
        .output()
        .expect("rabbitmqctl");
    let listing = String::from_utf8_lossy(&held.stdout);
    assert!(listing.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["work", "1"]), "held: {listing}");
    policy(&["clear_policy", "-p", &vhost.name, "full-dlq"]);
    wait_until(Duration::from_secs(30), "the copy lands once the DLQ has room", || async {
        vhost.drain_queue("work.dlq").await.len() == 1
    })
    .await;
    wait_until(Duration::from_secs(30), "the original acked", || async {
        sluice::broker::Broker::depth(&broker, "work").await.ok() == Some(0)
    })
    .await;
    let dead = vhost.drain_queue("work.dlq").await;
    assert_eq!(dead[0].1.get("x-sluice-reason"), Some(&HeaderValue::Str("permanent".into())));
}

on_both_brokers!(retry_exhaustion_calls_exactly_max_attempts_then_dead_letters,);
