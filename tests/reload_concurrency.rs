//! Issue 19: reloads while webhook calls outlive `--shutdown-grace`, against the real binary on
//! RabbitMQ and on the embedded broker. The calls a replaced worker leaves running keep their
//! messages and count against the queue's concurrency: the receiver never has more calls at
//! once than the limit, and no message is called twice, with no idempotency configured.
//! Before, the old worker handed its messages back to the broker once the grace was over, the
//! new one ran them again beside the old calls, and the receiver saw several times the limit.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;
use sluice::broker::Broker;
use support::*;

/// How long any one condition may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(60);

/// The queue's concurrency.
const LIMIT: usize = 3;

on_every_broker!(reloads_during_calls_longer_than_the_grace_keep_the_limit_and_run_each_message_once);

/// The pipeline: `work` calling `receiver` with [`LIMIT`], idempotency off (its claims would
/// hide a second run: the key busy, the message waits), and `max_attempts` (which reloads
/// change, so that each restarts the queue's worker).
fn yaml(receiver: &Receiver, max_attempts: u32) -> String {
    let queue = format!(
        "    concurrency: {LIMIT}\n    idempotency: {{enabled: false}}\n    retry: {{max_attempts: {max_attempts}}}\n"
    );
    webhook_yaml(receiver, &queue)
}

/// Issue 19: three reloads, each while [`LIMIT`] calls have just started and will take far
/// longer than the grace.
async fn reloads_during_calls_longer_than_the_grace_keep_the_limit_and_run_each_message_once<P: Place>(place: P) {
    let receiver = Receiver::start(|_, _| Reply::ok().after(Duration::from_millis(1500))).await;
    let dir = pipeline(&yaml(&receiver, 5));
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let (mut sluice, admin) =
        run_with_admin_and(dir.path(), &place.url(), "work", &["--shutdown-grace", "200ms"]).await;
    let keys: Vec<String> = (0..4 * LIMIT).map(|i| format!("m-{i}")).collect();
    for key in &keys {
        publish(&broker, "ev", "k", key, json!({})).await;
    }
    for round in 1..=3 {
        receiver.wait_for(round * LIMIT, DEADLINE).await;
        reload_pipeline(dir.path(), &admin, &yaml(&receiver, 5 + round as u32), round as u64).await;
    }
    // Counted once answered and settled, where the receiver counts a call as it arrives.
    let handled = r#"sluice_messages_total{queue="work",outcome="success"}"#;
    wait_until(DEADLINE, "every message handled", || async {
        sample(&admin, handled).await.is_some_and(|n| n >= keys.len() as f64)
    })
    .await;
    assert_eq!(sluice.stop(DEADLINE), Some(0), "clean exit; log:\n{}", sluice.log());

    let calls = counts(receiver.hits().iter().map(|h| h.key().to_string()));
    let once: BTreeMap<String, usize> = keys.iter().map(|k| (k.clone(), 1)).collect();
    assert_eq!(calls, once, "calls per message");
    assert!(receiver.max_in_flight() <= LIMIT, "{} calls at once, over the limit of {LIMIT}", receiver.max_in_flight());
    assert_eq!(place.depth("work").await, 0, "nothing left in the queue");
    assert_eq!(place.depth("work.dlq").await, 0, "nothing dead-lettered");
    broker.close().await;
}
