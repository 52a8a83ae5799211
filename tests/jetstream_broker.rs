//! The NATS JetStream broker (issue 35) on the machine's nats-server: `plan --broker nats://…`
//! and several seed servers in one `--broker` value. The trait's rules are checked by the
//! conformance matrix, real processes killed and sharing a deployment by `leased`, and the
//! shared end-to-end bodies run on it through `on_every_broker!`.

use crate::support;

use std::time::Duration;

use sluice::broker::Broker as _;
use support::*;

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
