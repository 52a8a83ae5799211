//! Issue 24 (part 5): per-queue broker arguments. On RabbitMQ, `message_ttl` dead-letters what
//! waited too long with reason `expired`, `priority` delivers higher priorities first, and
//! `arguments:` reach the declaration (`plan --broker` names a changed one). The embedded
//! broker, which can honour none of them, refuses them by name before it changes anything.

use crate::support;

use std::time::Duration;

use serde_json::Value;
use support::{Finished, Receiver, Sluice, Vhost};

fn cli(args: &[&str]) -> Finished {
    support::sluice_cli(args, &[], Duration::from_secs(120))
}

async fn cli_async(args: &[&str]) -> Finished {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || cli(&args.iter().map(String::as_str).collect::<Vec<_>>()))
        .await
        .expect("cli task")
}

fn path(p: &std::path::Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The dead-letter queue's entries as `dlq list --format json` gives them.
async fn dead_letters(dir: &std::path::Path, url: &str) -> Vec<Value> {
    let list = cli_async(&["dlq", "list", "work", "--pipelines", path(dir), "--format", "json", "--broker", url]).await;
    assert_eq!(list.code, Some(0), "{}", list.stderr);
    let json: Value = serde_json::from_str(&list.stdout).expect("dlq list JSON");
    json.as_array().cloned().unwrap_or_else(|| panic!("dlq list JSON is an array: {json}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_waiting_past_their_ttl_are_dead_lettered_as_expired() {
    let vhost = Vhost::new();
    let url = vhost.url();
    let receiver = Receiver::ok().await;
    let dir = support::webhook_pipeline(&receiver, "    message_ttl: 1s\n");
    support::declare(dir.path(), &vhost.connect().await).await;
    let d = path(dir.path());
    for n in 0..5 {
        let payload = format!("{{\"n\": {n}}}");
        let sent =
            cli_async(&["publish", "--broker", &url, "--exchange", "ev", "--type", "t", "--payload", &payload]).await;
        assert_eq!(sent.code, Some(0), "{}", sent.stderr);
    }
    // Nobody consumes: after a second each message is the broker's to dead-letter.
    let started = std::time::Instant::now();
    let entries = loop {
        let entries = dead_letters(dir.path(), &url).await;
        if entries.len() == 5 {
            break entries;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "five expired messages in work.dlq: {entries:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let reasons: Vec<&str> = entries.iter().filter_map(|e| e.get("reason").and_then(Value::as_str)).collect();
    assert_eq!(reasons, ["expired"; 5], "{entries:?}");
    // A runner started now finds nothing to handle; what it would have handled is in the DLQ.
    let mut sluice = Sluice::run(dir.path(), &url, &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(60)), Some(0), "{}", sluice.log());
    assert!(receiver.hits().is_empty(), "expired messages were handled: {:?}", receiver.hits().len());
    let plan = cli_async(&["plan", d]).await;
    assert!(plan.stdout.contains("x-message-ttl = 1000"), "{}", plan.stdout);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_priority_queue_delivers_higher_priorities_first() {
    let vhost = Vhost::new();
    let url = vhost.url();
    let receiver = Receiver::ok().await;
    let dir = support::webhook_pipeline(&receiver, "    type: classic\n    priority: 10\n    concurrency: 1\n");
    support::declare(dir.path(), &vhost.connect().await).await;
    // Low ones first, then high ones: all wait in the queue before the runner starts.
    let publish = |priority: &'static str, n: u32| {
        let url = url.clone();
        async move {
            let payload = format!("{{\"priority\": {priority}, \"n\": {n}}}");
            let args = ["publish", "--broker", &url, "--exchange", "ev", "--type", "t", "--priority", priority];
            let sent = cli_async(&[&args[..], &["--payload", &payload]].concat()).await;
            assert_eq!(sent.code, Some(0), "{}", sent.stderr);
        }
    };
    for n in 0..5 {
        publish("1", n).await;
    }
    for n in 0..5 {
        publish("9", n).await;
    }
    let mut sluice = Sluice::run(dir.path(), &url, &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(60)), Some(0), "{}", sluice.log());
    let order: Vec<i64> = receiver
        .hits()
        .iter()
        .filter_map(|hit| hit.json().pointer("/payload/priority").and_then(Value::as_i64))
        .collect();
    assert_eq!(order, [9, 9, 9, 9, 9, 1, 1, 1, 1, 1], "delivery order by priority");
}

#[tokio::test]
async fn plan_against_the_broker_names_a_changed_argument() {
    let vhost = Vhost::new();
    let url = vhost.url();
    let receiver = Receiver::ok().await;
    let extra = "    arguments:\n      x-max-length-bytes: 1000000\n      x-quorum-initial-group-size: 1\n";
    let dir = support::webhook_pipeline(&receiver, extra);
    support::declare(dir.path(), &vhost.connect().await).await;
    let d = path(dir.path());
    let same = cli_async(&["plan", d, "--broker", &url]).await;
    assert_eq!(same.code, Some(0), "{}\n{}", same.stdout, same.stderr);
    let changed = extra.replace("1000000", "2000000");
    std::fs::write(dir.path().join("pipeline.yaml"), support::webhook_yaml(&receiver, &changed)).expect("write");
    let differs = cli_async(&["plan", d, "--broker", &url]).await;
    assert_eq!(differs.code, Some(1), "{}\n{}", differs.stdout, differs.stderr);
    assert!(differs.stdout.contains("x-max-length-bytes"), "{}", differs.stdout);
}

#[tokio::test]
async fn the_embedded_broker_refuses_what_it_cannot_honour_by_name() {
    let receiver = Receiver::ok().await;
    let dir = support::webhook_pipeline(&receiver, "    message_ttl: 1m\n");
    let state = dir.path().join("state");
    let run = cli_async(&["run", path(dir.path()), "--broker", path(&state), "--exit-when-idle"]).await;
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(
        // Issue 32 item 1: refused by capability, at its place, before anything is declared.
        run.stderr.contains("/queues/work/message_ttl: the embedded broker does not support a message TTL"),
        "{}",
        run.stderr
    );
    // Nothing was declared, nor the broker created: the check comes before it is opened.
    assert!(!state.join("broker.db").exists(), "the refused run created the broker");
    let plan = cli_async(&["plan", path(dir.path()), "--broker", path(&state)]).await;
    assert!(plan.stdout.contains("refused = message_ttl"), "{}", plan.stdout);
    assert!(plan.stdout.contains("missing exchange \"ev\""), "{}", plan.stdout);
    // Nor does it take a message priority, which no queue of it could honour.
    std::fs::write(dir.path().join("pipeline.yaml"), support::webhook_yaml(&receiver, "")).expect("write");
    let declared = cli_async(&["run", path(dir.path()), "--broker", path(&state), "--exit-when-idle"]).await;
    assert_eq!(declared.code, Some(0), "{}", declared.stderr);
    let publish = cli_async(&[
        "publish",
        "--broker",
        path(&state),
        "--exchange",
        "ev",
        "--type",
        "t",
        "--priority",
        "3",
        "--payload",
        "{}",
    ])
    .await;
    assert_eq!(publish.code, Some(1), "{}", publish.stderr);
    assert!(publish.stderr.contains("no message priorities"), "{}", publish.stderr);
}

#[test]
fn validate_says_where_an_argument_is_wrong() {
    let dir = support::pipeline(
        "version: 1\nexchanges:\n  ev: {type: topic}\nqueues:\n  work:\n    priority: 5\n    message_ttl: 1e400s\n    arguments:\n      x-max-length: 10\n      x-queue-mode: lazy\n      x-custom-thing: 1\n    bind: [{exchange: ev, routing_key: \"#\"}]\n    handler: {command: {program: /bin/true}}\n",
    );
    let out = cli(&["validate", path(dir.path())]);
    let said = format!("{}{}", out.stdout, out.stderr);
    assert_eq!(out.code, Some(1), "{said}");
    for expected in [
        ":6:15: error: /queues/work/priority: priorities need a classic queue",
        ":7:18: error: /queues/work/message_ttl:",
        ":9:7: error: /queues/work/arguments/x-max-length: queue argument \"x-max-length\" is set by sluice: use max_length",
        ":10:7: error: /queues/work/arguments/x-queue-mode: queue argument \"x-queue-mode\" is for classic queues",
        ":11:7: warning: /queues/work/arguments/x-custom-thing:",
    ] {
        assert!(said.contains(expected), "missing {expected:?} in:\n{said}");
    }
}
