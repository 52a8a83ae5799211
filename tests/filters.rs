//! Binding filters (issue 24), end to end through `sluice run` on each broker: what the
//! receivers get (counts per message), what the runner counts as filtered, and that nothing
//! filtered is left in a queue or dead-lettered. A retry copy of a message the filter took
//! comes back through the broker's own delay route (RabbitMQ's delay queues), and is taken
//! again; a message published straight to the queue is judged by all of its bindings.

use crate::support;

use std::time::Duration;

use serde_json::json;
use sluice::broker::Broker as _;
use support::{Place, Receiver, Reply};

/// The pipeline: `work` takes orders of 100 or more that are not tests (filtered binding) and
/// every refund (unfiltered binding); `audit` takes everything.
fn pipeline(work: &Receiver, audit: &Receiver) -> String {
    format!(
        r##"version: 1
exchanges:
  ev: {{type: topic}}
queues:
  work:
    bind:
      - exchange: ev
        routing_key: order.*
        filter:
          all:
            - {{field: payload.amount, gte: 100}}
            - {{not: {{field: payload.test, exists: true}}}}
      - exchange: ev
        routing_key: refund.#
    retry: {{max_attempts: 3, initial: 100ms, max: 200ms}}
    handler:
      webhook: {{url: "{}/work"}}
  audit:
    bind: [{{exchange: ev, routing_key: "#"}}]
    handler:
      webhook: {{url: "{}/audit"}}
"##,
        work.uri(),
        audit.uri()
    )
}

/// The runner's `sluice_messages_total{queue, outcome}`, 0 while absent.
async fn total(admin: &str, queue: &str, outcome: &str) -> f64 {
    let series = format!("sluice_messages_total{{queue=\"{queue}\",outcome=\"{outcome}\"}}");
    support::sample(admin, &series).await.unwrap_or(0.0)
}

async fn filtered_messages_are_acked_and_counted_and_never_reach_the_handler<P: Place>(place: P) {
    // The first call for "retried" fails, so that its retry copy comes back.
    let work = Receiver::start(
        |hit, earlier| {
            if hit.key() == "retried" && earlier == 0 { Reply::status(503) } else { Reply::ok() }
        },
    )
    .await;
    let audit = Receiver::ok().await;
    let dir = support::pipeline(&pipeline(&work, &audit));
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    let sent = [
        ("order.created", "big", json!({"amount": 150})),
        ("order.created", "small", json!({"amount": 5})),
        ("order.created", "test", json!({"amount": 500, "test": true})),
        ("order.created", "text", json!({"amount": "150"})),
        ("order.created", "retried", json!({"amount": 100})),
        ("refund.issued", "refund", json!({"amount": 5})),
    ];
    for (routing_key, key, payload) in &sent {
        support::publish(&broker, "ev", routing_key, key, payload.clone()).await;
    }
    // Straight to the queue: no binding routes it, so every binding has a say, and the one
    // without a filter takes it.
    support::publish(&broker, "", "work", "direct", json!({"amount": 1})).await;
    let (mut runner, admin) = support::run_with_admin(dir.path(), &place.url(), "work").await;
    // Settled: every message of each queue has its final outcome counted.
    support::wait_until(Duration::from_secs(60), "every message settled", || async {
        total(&admin, "work", "success").await + total(&admin, "work", "filtered").await == 7.0
            && total(&admin, "audit", "success").await == 6.0
    })
    .await;
    assert_eq!(total(&admin, "work", "filtered").await, 3.0, "small, test and text");
    assert_eq!(total(&admin, "work", "retry").await, 1.0);
    let at_work = support::counts(work.hits().iter().map(|h| h.key().to_string()));
    let expected = support::counts(["big", "retried", "retried", "refund", "direct"]);
    assert_eq!(at_work, expected, "calls at the work receiver, by key");
    let at_audit = support::counts(audit.hits().iter().map(|h| h.key().to_string()));
    assert_eq!(at_audit, support::counts(sent.iter().map(|(_, key, _)| *key)), "audit takes everything");
    broker.close().await;
    // After the clean stop: an outcome is counted before its ack is done (on Redis, a stream
    // entry counts until its ack deletes it), and a clean stop settles every ack first.
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
    for queue in ["work", "work.dlq", "audit", "audit.dlq"] {
        assert_eq!(place.depth(queue).await, 0, "{queue} is empty");
    }
}

on_every_broker!(filtered_messages_are_acked_and_counted_and_never_reach_the_handler);
