//! Issue 19: a reload that removes or renames a queue unbinds it from its exchanges, against
//! the real binary on RabbitMQ and on the embedded broker. What is published afterwards
//! reaches only the queues the files name (a removed queue that is full no longer gets every
//! publish refused), renaming a queue and back runs each message once, and the removed
//! queue's gauges go idle. A reload is seen applied through
//! `sluice_config_reloads_total{result="applied"}`; what it did, through the receivers' calls
//! and the queues' depths.

use crate::support;

use std::time::Duration;

use serde_json::json;
use sluice::broker::{Broker, BrokerError, Outgoing, Publish};
use sluice::envelope::Envelope;
use sluice::topology::BindingDecl;
use support::*;

/// How long any one condition may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(30);

on_every_broker!(
    unbinding_is_idempotent,
    a_removed_queue_is_unbound_even_when_full,
    renaming_a_queue_and_back_runs_each_message_once,
    a_removed_queues_gauges_go_idle,
);

/// A pipeline: fanout exchange `ev` and `queues` (name, YAML lines indented by four spaces),
/// each bound to it.
fn yaml(queues: &[(&str, String)]) -> String {
    let mut text = String::from("version: 1\nexchanges:\n  ev: {type: fanout}\nqueues:\n");
    for (name, body) in queues {
        text.push_str(&format!("  {name}:\n    bind: [{{exchange: ev}}]\n{body}"));
    }
    text
}

/// A queue's handler calling `{receiver}/{path}`, and `extra` lines.
fn calling(receiver: &Receiver, path: &str, extra: &str) -> String {
    format!("    handler: {{webhook: {{url: \"{}/{path}\"}}}}\n{extra}", receiver.uri())
}

/// `{prefix}-0` .. `{prefix}-{n-1}`.
fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Publishes a message with each key to `ev`; the keys the broker refused, with its reason.
async fn publish_all<B: Publish>(broker: &B, keys: &[String]) -> Vec<String> {
    let mut refused = Vec::new();
    for key in keys {
        let body = Envelope::new("test.event", &json!({}), Some(key.clone())).encode();
        if let Err(e) = broker.publish("ev", "", Outgoing { body, ..Outgoing::default() }).await {
            refused.push(format!("{key}: {e}"));
        }
    }
    refused
}

/// The keys `receiver` answered 2xx at `path`, in arrival order.
fn handled_at(receiver: &Receiver, path: &str) -> Vec<String> {
    receiver.hits().iter().filter(|h| h.target == path && h.succeeded()).map(|h| h.key().to_string()).collect()
}

async fn depth<B: Publish>(broker: &B, queue: &str) -> u32 {
    broker.depth(queue).await.unwrap_or_else(|e| panic!("depth of {queue}: {e}"))
}

/// Issue 19: `Broker::unbind` removes the bindings named, and one already gone, or whose
/// queue or exchange is gone, is no error: the session goes on, the queue keeps its messages.
async fn unbinding_is_idempotent<P: Place>(place: P) {
    let dir = pipeline(&yaml(&[("a", "    handler: {command: {program: /bin/true}}\n".into())]));
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let binding = |exchange: &str, queue: &str| BindingDecl {
        exchange: exchange.into(),
        queue: queue.into(),
        routing_key: String::new(),
        arguments: Default::default(),
    };
    assert_eq!(publish_all(&broker, &keys("bound", 1)).await, Vec::<String>::new());
    for (what, gone) in [
        ("the binding", binding("ev", "a")),
        ("the binding again", binding("ev", "a")),
        ("a queue never declared", binding("ev", "ghost")),
        ("an exchange never declared", binding("nowhere", "a")),
    ] {
        broker.unbind(&[gone]).await.unwrap_or_else(|e| panic!("unbinding {what}: {e}"));
    }
    let unbound = broker.publish("ev", "", Outgoing { body: b"{}".to_vec(), ..Outgoing::default() }).await;
    assert!(matches!(unbound, Err(BrokerError::Unroutable { .. })), "{unbound:?}");
    assert_eq!(depth(&broker, "a").await, 1, "a keeps its message");
    broker.close().await;
}

/// Issue 19: a queue removed by a reload is unbound: everything published afterwards reaches
/// the queue that stays, is confirmed, and none of it reaches the removed queue, which keeps
/// the messages it held. Before, the removed queue kept taking a copy of each, and once its
/// `max_length` was full every publish to the exchange was refused (nacked by RabbitMQ; on
/// the embedded broker written nowhere).
async fn a_removed_queue_is_unbound_even_when_full<P: Place>(place: P) {
    let (a, b) = (Receiver::ok().await, Receiver::ok().await);
    let dir = pipeline(&yaml(&[("a", calling(&a, "a", "")), ("b", calling(&b, "b", "    max_length: 3\n"))]));
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let (mut sluice, admin) = run_with_admin(dir.path(), &place.url(), "b").await;
    // b stops consuming, so that it fills up.
    // The broker names the state directory holding the token the runner generated.
    let paused = sluice_cli(&["pause", "b", "--admin", &admin, "--broker", &place.url()], &[], DEADLINE);
    assert_eq!(paused.code, Some(0), "{paused:?}");
    wait_until(DEADLINE, "b without a consumer", || async { broker.stats("b").await.is_ok_and(|s| s.consumers == 0) })
        .await;
    assert_eq!(publish_all(&broker, &keys("before", 3)).await, Vec::<String>::new());
    wait_until(DEADLINE, "a handled 3 and b is full", || async {
        a.succeeded_keys().len() == 3 && depth(&broker, "b").await == 3
    })
    .await;

    reload_pipeline(dir.path(), &admin, &yaml(&[("a", calling(&a, "a", ""))]), 1).await;
    let after = keys("after", 20);
    let refused = publish_all(&broker, &after).await;
    assert!(
        refused.is_empty(),
        "{} of {} publishes refused after b was removed: {refused:?}",
        refused.len(),
        after.len()
    );
    wait_until(DEADLINE, "a handled all 23", || async { a.succeeded_keys().len() == 23 }).await;
    assert_eq!(depth(&broker, "b").await, 3, "b holds what it held and nothing more");
    assert!(b.hits().is_empty(), "nothing consumed b: {:?}", b.succeeded_keys());
    assert_eq!(sample(&admin, "sluice_config_reloads_total{result=\"rejected\"}").await, None, "no reload rejected");
    assert_eq!(sluice.stop(DEADLINE), Some(0), "clean exit; log:\n{}", sluice.log());
    broker.close().await;
}

/// Issue 19: renaming a queue (b to c) and back runs each message once, at the queue that had
/// the name when it was published. Before, b stayed bound while renamed, collected a copy of
/// everything published meanwhile, and ran it all a second time once the name came back
/// (c in turn kept collecting after the renaming back).
async fn renaming_a_queue_and_back_runs_each_message_once<P: Place>(place: P) {
    let (a, r) = (Receiver::ok().await, Receiver::ok().await);
    let with = |name: &str| yaml(&[("a", calling(&a, "a", "")), (name, calling(&r, name, ""))]);
    let dir = pipeline(&with("b"));
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let (mut sluice, admin) = run_with_admin(dir.path(), &place.url(), "b").await;
    let rounds = [("one", "b"), ("two", "c"), ("three", "b")];
    for (n, (round, name)) in rounds.into_iter().enumerate() {
        if n > 0 {
            reload_pipeline(dir.path(), &admin, &with(name), n as u64).await;
        }
        let batch = keys(round, 10);
        assert_eq!(publish_all(&broker, &batch).await, Vec::<String>::new(), "round {round}");
        let path = format!("/{name}");
        wait_until(DEADLINE, &format!("round {round} handled at a and at {name}"), || async {
            let (at_a, at_r) = (a.succeeded_keys(), handled_at(&r, &path));
            batch.iter().all(|k| at_a.contains(k) && at_r.contains(k))
        })
        .await;
    }
    assert_eq!(sluice.stop(DEADLINE), Some(0), "clean exit; log:\n{}", sluice.log());

    // Stopped: no call can come any more, and what was left in a queue stays there.
    let published: Vec<String> = rounds.iter().flat_map(|(round, _)| keys(round, 10)).collect();
    let once: std::collections::BTreeMap<String, usize> = published.iter().map(|k| (k.clone(), 1)).collect();
    assert_eq!(counts(a.hits().iter().map(|h| h.key().to_string())), once, "calls per key at a");
    assert_eq!(counts(r.hits().iter().map(|h| h.key().to_string())), once, "calls per key at b or c");
    let mut at_b = keys("one", 10);
    at_b.extend(keys("three", 10));
    let sorted = |mut keys: Vec<String>| {
        keys.sort();
        keys
    };
    assert_eq!(sorted(handled_at(&r, "/b")), sorted(at_b));
    assert_eq!(sorted(handled_at(&r, "/c")), sorted(keys("two", 10)));
    assert_eq!((depth(&broker, "b").await, depth(&broker, "c").await), (0, 0), "left in b and c");
    broker.close().await;
}

/// Issue 19: a removed queue's gauges go to their idle values: the alert on its open breaker
/// (`sluice_circuit_state` above 0 for 10 minutes) clears, and nothing goes on reporting its
/// depth, consumers or concurrency. The exporter cannot drop a series, so they stay, at 0.
/// Before, they kept their last values for the life of the process.
async fn a_removed_queues_gauges_go_idle<P: Place>(place: P) {
    let a = Receiver::ok().await;
    // Port 9 refuses connections: the first call opens b's breaker.
    let unwell = "    handler: {webhook: {url: \"http://127.0.0.1:9/b\"}}\n    \
                  circuit_breaker: {failure_rate: 100%, min_calls: 1, open_for: 1h}\n";
    let dir = pipeline(&yaml(&[("a", calling(&a, "a", "")), ("b", unwell.to_string())]));
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let (mut sluice, admin) = run_with_admin(dir.path(), &place.url(), "b").await;
    assert_eq!(publish_all(&broker, &keys("k", 1)).await, Vec::<String>::new());
    wait_until(DEADLINE, "b's breaker open and b's depth polled", || async {
        gauge(&admin, "sluice_circuit_state", "b").await == Some(2.0)
            && gauge(&admin, "sluice_queue_depth", "b").await.is_some()
    })
    .await;

    reload_pipeline(dir.path(), &admin, &yaml(&[("a", calling(&a, "a", ""))]), 1).await;
    let names = [
        "sluice_circuit_state",
        "sluice_concurrency_limit",
        "sluice_queue_depth",
        "sluice_dlq_depth",
        "sluice_queue_consumers",
        "sluice_consumer_lag_seconds",
        "sluice_paused",
    ];
    let mut values = Vec::new();
    for name in names {
        values.push((name, gauge(&admin, name, "b").await));
    }
    let idle: Vec<(&str, Option<f64>)> = names.iter().map(|name| (*name, Some(0.0))).collect();
    assert_eq!(values, idle, "b's gauges once b is removed");
    assert_eq!(gauge(&admin, "sluice_circuit_state", "a").await, Some(0.0), "a's are its own");
    assert_eq!(sluice.stop(DEADLINE), Some(0), "clean exit; log:\n{}", sluice.log());
    broker.close().await;
}
